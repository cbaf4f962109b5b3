"""Driving an in-process verifier engine from tests: one request to its end."""

from __future__ import annotations

from specdec.sampling_params import SamplingParams
from verifier_svc.engine import Engine


async def generate(engine: Engine, prompt: list[int], params: SamplingParams,
                   num_speculative_tokens: int | None = None) -> list[int]:
    """The streamed token ids of one request (None: the engine's speculation setting)."""
    _, queue = engine.add_request("test", prompt, params, num_speculative_tokens)
    tokens: list[int] = []
    while True:
        output = await queue.get()
        assert not isinstance(output, Exception), output
        tokens.extend(output.token_ids)
        if output.finish_reason is not None:
            return tokens
