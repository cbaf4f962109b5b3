"""Per-request sampling parameters, with vLLM's names, defaults and bounds.

Built once per request at the edge (gateway or gRPC servicer), validated here, then passed
unchanged to the logits processor and the rejection sampler. Every rejection raises
`InvalidRequestError` naming the offending field in `param`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.errors import InvalidRequestError

# Below this temperature a request is greedy (vLLM's `_SAMPLING_EPS`).
GREEDY_TEMPERATURE_EPS = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request turns target logits into tokens.

    temperature: 0 (below `GREEDY_TEMPERATURE_EPS`) means greedy, i.e. argmax.
    top_p: keep the smallest set of tokens whose probability sums to at least top_p; in (0, 1].
    top_k: keep the k most likely tokens; -1 (or 0, normalised to -1) turns it off.
    repetition_penalty: HF/vLLM semantics, > 0; 1 turns it off.
    seed: seeds the request's own generator, so the same request gives the same output.
    max_tokens: how many tokens to generate at most, >= 1.
    stop_token_ids: generation ends after emitting one of these (besides EOS).
    ignore_eos: keep generating past EOS.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}", param="temperature"
            )
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be an integer >= 1, or -1 (or 0) to disable it, got {self.top_k!r}", param="top_k"
            )
        if (
            not _is_number(self.repetition_penalty)
            or not math.isfinite(self.repetition_penalty)
            or self.repetition_penalty <= 0
        ):
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}",
                param="repetition_penalty",
            )
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer or null, got {self.seed!r}", param="seed")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", param="max_tokens")
        stop_token_ids = tuple(self.stop_token_ids)
        if any(not _is_int(token_id) or token_id < 0 for token_id in stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be non-negative integers, got {list(stop_token_ids)!r}", param="stop_token_ids"
            )
        # Frozen: normalise through object.__setattr__ (0 means "off" for top_k, as in vLLM).
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes by argmax (temperature below 1e-5, as vLLM)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS
