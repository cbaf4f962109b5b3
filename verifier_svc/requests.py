"""A request at the engine's edge: what is admitted, what comes out, how it can fail.

`check_request` refuses a request that can never be served (INVALID_ARGUMENT, HTTP 400);
`check_admission` refuses one the server cannot take now (RESOURCE_EXHAUSTED, HTTP 429).
Admitted requests get `RequestOutput`s and, when they cannot go on, one `SpecdecError`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from specdec.config import EngineConfig
from specdec.engine.logprobs import TokenLogprobs
from specdec.engine.sampling_params import SamplingParams, check_logit_bias_ids
from specdec.engine.sequence import FinishReason, SpeculationCounters
from specdec.errors import InvalidRequestError, OverloadedError, SpecdecError


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    # The request's counters so far: a client that stops early (stop strings) still has them.
    spec: SpeculationCounters
    # One per token_ids entry when the request asked for logprobs; else None.
    logprobs: list[TokenLogprobs] | None = None
    # Prompt tokens whose KV came from the prefix cache.
    num_cached_tokens: int = 0


async def collect_outputs(queue: asyncio.Queue[RequestOutput | SpecdecError],
                          ) -> tuple[list[int], SpeculationCounters]:
    """Drains one request's output queue to its end: every streamed token id and the
    request's speculation counters; raises the `SpecdecError` that ended it instead."""
    token_ids: list[int] = []
    while True:
        output = await queue.get()
        if isinstance(output, SpecdecError):
            raise output
        token_ids.extend(output.token_ids)
        if output.finish_reason is not None:
            return token_ids, output.spec


class EngineError(SpecdecError):
    """The step that served this request failed; the request cannot go on (INTERNAL)."""


def check_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                  max_model_len: int) -> None:
    """Raises `InvalidRequestError` naming the field when the request can never run."""
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    bad = next((t for t in prompt_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary "
                                  f"(size {vocab_size})", param="prompt")
    check_logit_bias_ids((token_id for token_id, _ in params.logit_bias), vocab_size)
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt "
            f"has {len(prompt_token_ids)} tokens and leaves no room for output",
            param="prompt")
    if len(prompt_token_ids) + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(prompt_token_ids) + params.max_tokens} tokens "
            f"({len(prompt_token_ids)} in the prompt, {params.max_tokens} in the completion)",
            param="max_tokens")


def check_admission(config: EngineConfig, num_requests: int) -> None:
    """Raises `OverloadedError` when `num_requests` in flight already fill the running
    slots and the bounded waiting queue."""
    if num_requests >= config.max_num_seqs + config.waiting_limit:
        raise OverloadedError(
            f"the server is overloaded: {num_requests} requests in flight (max_num_seqs "
            f"{config.max_num_seqs} running + max_waiting_requests {config.waiting_limit} "
            "waiting); retry later")
