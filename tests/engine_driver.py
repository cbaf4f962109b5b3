"""Driving an in-process verifier engine from tests: one request to its end."""

from __future__ import annotations

from specdec.engine.sampling_params import SamplingParams
from verifier_svc.engine import Engine
from verifier_svc.requests import collect_outputs


async def generate(engine: Engine, prompt: list[int], params: SamplingParams,
                   num_speculative_tokens: int | None = None) -> list[int]:
    """The streamed token ids of one request (None: the engine's speculation setting)."""
    _, queue = engine.add_request("test", prompt, params, num_speculative_tokens)
    tokens, _ = await collect_outputs(queue)
    return tokens
