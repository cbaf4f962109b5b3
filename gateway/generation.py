"""One choice's generation: sampling options -> GenerateRequest, responses -> text deltas.

`stream_text` is the single loop shared by chat and completions, streaming or not: it
detokenizes incrementally, applies stop strings and cancels the verifier call the moment
a stop string is found (or the consumer goes away), so the verifier frees the sequence.
A request with n choices runs n such loops, one Generate call each (`choice_requests`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from gateway.generation_stream import GenerationStream
from gateway.protocol import SamplingOptions
from specdec.engine.sampling_params import check_logit_bias_ids
from specdec.errors import InvalidRequestError, UnavailableError
from specdec.v1 import specdec_pb2

_FINISH_REASONS = {
    specdec_pb2.FINISH_REASON_STOP: "stop",
    specdec_pb2.FINISH_REASON_LENGTH: "length",
}


@dataclass(slots=True)
class GenerationResult:
    """Filled in by `stream_text` as the generation runs."""

    num_prompt_tokens: int
    started_at: float = field(default_factory=time.monotonic)
    num_completion_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    # The verifier's counters are per request and cumulative: the latest one is the total.
    speculation: specdec_pb2.SpeculationStats | None = None
    num_cached_tokens: int = 0
    # (drafted, accepted) of each drafting step, gathered from the responses when the
    # request set record_steps (their per_step_* lists are not cumulative).
    steps: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class TextDelta:
    """Text released to the client, and the tokens (with their logprobs, when asked)
    received since the previous delta. The text is empty only in a last delta that
    carries logprobs alone."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[specdec_pb2.TokenLogprob] = field(default_factory=list)


def build_generate_request(prompt_token_ids: list[int], sampling: SamplingOptions,
                           info: specdec_pb2.VerifierInfo, max_model_len: int,
                           prompt_param: str, record_steps: bool = False) -> specdec_pb2.GenerateRequest:
    """Checks lengths against max_model_len and fills in vLLM's default max_tokens;
    `record_steps` asks the verifier for each drafting step's counts."""
    num_prompt_tokens = len(prompt_token_ids)
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{prompt_param} has {num_prompt_tokens} tokens, which leaves no room for the "
            "completion.", prompt_param)
    min_tokens = sampling.params.min_tokens
    max_tokens = sampling.params.max_tokens  # 0: not given
    if not max_tokens:
        room = max_model_len - num_prompt_tokens
        max_tokens = room if sampling.default_max_tokens is None else min(sampling.default_max_tokens, room)
        if min_tokens > max_tokens:
            what = ("the room left in the context" if max_tokens == room
                    else "the default max_tokens")
            raise InvalidRequestError(
                f"min_tokens ({min_tokens}) must be at most {what} ({max_tokens} "
                "tokens); set max_tokens.", "min_tokens")
    elif num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"{prompt_param}, {max_tokens} in the completion). Please reduce the length of "
            f"the {prompt_param} or max_tokens.", "max_tokens")
    check_logit_bias_ids(sampling.params.logit_bias, info.vocab_size)
    speculation = specdec_pb2.SpeculationOverride(record_steps=record_steps)
    if sampling.speculation is not None:
        speculation.enabled = sampling.speculation.enabled
        num_tokens = sampling.speculation.num_speculative_tokens
        if num_tokens is not None:
            if num_tokens > info.num_speculative_tokens:
                raise InvalidRequestError(
                    f"speculation must be at most the server's num_speculative_tokens "
                    f"({info.num_speculative_tokens}), got {num_tokens}.", "speculation")
            speculation.num_speculative_tokens = num_tokens
    if sampling.n > 1 and info.max_num_seqs and sampling.n > info.max_num_seqs:
        raise InvalidRequestError(
            f"n must be at most the server's max_num_seqs ({info.max_num_seqs}), got "
            f"{sampling.n}.", "n")
    params = specdec_pb2.SamplingParams()
    params.CopyFrom(sampling.params)
    params.max_tokens = max_tokens
    if sampling.grammar is not None:
        params.grammar.CopyFrom(specdec_pb2.GrammarSpec(kind=sampling.grammar.kind,
                                                        value=sampling.grammar.value))
    return specdec_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=prompt_token_ids, sampling=params,
        speculation=speculation, cache_salt=sampling.cache_salt or "")


def choice_requests(request: specdec_pb2.GenerateRequest,
                    n: int) -> list[specdec_pb2.GenerateRequest]:
    """One Generate call per choice: choice i has its own random stream, seed + i when the
    request is seeded (as vLLM), so that choices differ and each is reproducible."""
    if n == 1:
        return [request]
    requests = []
    for index in range(n):
        choice = specdec_pb2.GenerateRequest()
        choice.CopyFrom(request)
        choice.request_id = f"{request.request_id}-{index}"
        if request.sampling.HasField("seed"):
            choice.sampling.seed = (request.sampling.seed + index) % 2**64
        requests.append(choice)
    return requests


async def stream_text(stream: GenerationStream, detokenizer: IncrementalDetokenizer,
                      stop_matcher: StopStringMatcher, result: GenerationResult,
                      min_tokens: int = 0) -> AsyncGenerator[TextDelta, None]:
    """Yields text deltas (see TextDelta); sets result.finish_reason before returning.
    Stop strings are looked for once `min_tokens` tokens are out (as vLLM, which checks no
    stop condition before then).

    Closing the generator early (client gone) cancels the verifier call.
    """
    pending = TextDelta("")
    try:
        async for response in stream:
            if response.token_ids:
                if result.first_token_at is None:
                    result.first_token_at = time.monotonic()
                result.num_completion_tokens += len(response.token_ids)
                pending.token_ids.extend(response.token_ids)
                pending.logprobs.extend(response.logprobs)
            if response.HasField("speculation"):
                result.speculation = response.speculation
                result.steps += zip(response.speculation.per_step_drafted,
                                    response.speculation.per_step_accepted)
            if response.HasField("usage"):
                result.num_cached_tokens = response.usage.cached_tokens
            finished = response.finish_reason != specdec_pb2.FINISH_REASON_UNSPECIFIED
            # The tokens before the min_tokens-th pass by the stop strings unchecked.
            num_before = len(response.token_ids) - max(0, result.num_completion_tokens - min_tokens)
            unchecked = detokenizer.push(response.token_ids[:num_before]) if num_before > 0 else ""
            text = detokenizer.push(response.token_ids[max(0, num_before):])
            if finished:
                text += detokenizer.flush()
            released, stopped = stop_matcher.push(text)
            released = unchecked + released
            if stopped:
                stream.cancel()
                result.finish_reason = "stop"
            elif finished:
                released += stop_matcher.flush()
                reason = _FINISH_REASONS.get(response.finish_reason)
                if reason is None:
                    raise UnavailableError("The verifier aborted the request.")
                result.finish_reason = reason
            if released or (result.finish_reason is not None and pending.logprobs):
                pending.text = released
                yield pending
                pending = TextDelta("")
            if result.finish_reason is not None:
                return
        raise UnavailableError("The verifier ended the stream without a finish reason.")
    finally:
        result.finished_at = time.monotonic()
        stream.cancel()


def speculation_usage(stats: specdec_pb2.SpeculationStats | None) -> dict:
    """usage.speculation: the verifier's counters plus vLLM's derived figures."""
    if stats is None:
        stats = specdec_pb2.SpeculationStats()
    num_drafts = stats.num_drafts
    num_draft_tokens = stats.num_draft_tokens
    num_accepted = stats.num_accepted_tokens
    return {
        "num_drafts": num_drafts,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted,
        "accepted_per_position": list(stats.accepted_per_position),
        # Tokens a grammar forced (its only continuation), verified without the drafter;
        # not in num_draft_tokens / num_accepted_tokens.
        "num_forced_tokens": stats.num_forced_tokens,
        # Why the adaptive policy was not drafting for this request when it last decided
        # ("" while it drafts): "off by choice", with its figures, is not "broken".
        "policy": stats.policy,
        # The policy's state for this request when it last decided: drafting, probing
        # (off, measuring acceptance again with one draft token) or off; "" without one.
        "policy_state": stats.policy_state,
        "acceptance_rate": num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
        # Tokens per verify step: the accepted drafts plus the recovered or bonus token.
        "mean_acceptance_length": 1.0 + num_accepted / num_drafts if num_drafts else 1.0,
    }


def sum_speculation(results: list[GenerationResult]) -> specdec_pb2.SpeculationStats | None:
    stats = [result.speculation for result in results if result.speculation is not None]
    if len(stats) <= 1:
        return stats[0] if stats else None
    total = specdec_pb2.SpeculationStats()
    per_position: list[int] = []
    for item in stats:
        total.num_drafts += item.num_drafts
        total.num_draft_tokens += item.num_draft_tokens
        total.num_accepted_tokens += item.num_accepted_tokens
        total.num_forced_tokens += item.num_forced_tokens
        total.policy = total.policy or item.policy  # the choices share one policy
        total.policy_state = total.policy_state or item.policy_state
        per_position.extend([0] * (len(item.accepted_per_position) - len(per_position)))
        for position, count in enumerate(item.accepted_per_position):
            per_position[position] += count
    total.accepted_per_position.extend(per_position)
    return total


def usage(results: GenerationResult | list[GenerationResult]) -> dict:
    """OpenAI's usage over a request's choices: the prompt once, every choice's completion
    tokens, and (prompt_tokens_details.cached_tokens) the prompt tokens every choice found
    in the prefix cache."""
    if isinstance(results, GenerationResult):
        results = [results]
    num_prompt_tokens = results[0].num_prompt_tokens
    num_completion_tokens = sum(result.num_completion_tokens for result in results)
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": min(result.num_cached_tokens for result in results)},
        "speculation": speculation_usage(sum_speculation(results)),
    }
