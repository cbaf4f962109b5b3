"""Per-request sampling parameters, with vLLM's names, defaults and bounds.

Built once per request at the edge (gateway or gRPC servicer), validated here, then passed
unchanged to the logits processor and the rejection sampler. Every rejection raises
`InvalidRequestError` naming the offending field in `param`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specdec.errors import InvalidRequestError

# Below this temperature a request is greedy (vLLM's `_SAMPLING_EPS`).
GREEDY_TEMPERATURE_EPS = 1e-5
# OpenAI's bounds.
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
# OpenAI's top_logprobs bound.
MAX_TOP_LOGPROBS = 20
# specdec's own: beyond these the distribution is flat, or the penalty all there is.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_INT32 = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Bounds:
    """The interval a sampling parameter must lie in: [low, high], or (low, high]."""

    low: float
    high: float
    low_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


# The one definition of each parameter's bounds, checked by the gateway on a request's JSON
# (gateway/protocol.py) and by SamplingParams on whatever reaches the verifier (a direct
# gRPC client included), with the same words.
NUMBER_BOUNDS = {
    "temperature": Bounds(0.0, MAX_TEMPERATURE),
    "top_p": Bounds(0.0, 1.0, low_open=True),
    "repetition_penalty": Bounds(0.0, MAX_REPETITION_PENALTY, low_open=True),
    "presence_penalty": Bounds(-MAX_ABS_PENALTY, MAX_ABS_PENALTY),
    "frequency_penalty": Bounds(-MAX_ABS_PENALTY, MAX_ABS_PENALTY),
    "min_p": Bounds(0.0, 1.0),
}
INTEGER_BOUNDS = {
    "top_k": Bounds(-1, MAX_INT32),
    "max_tokens": Bounds(1, MAX_INT32),
    "min_tokens": Bounds(0, MAX_INT32),
    "logprobs": Bounds(0, MAX_TOP_LOGPROBS),
    # The wire carries uint64; a negative seed keeps its two's-complement bits.
    "seed": Bounds(-(2**63), 2**64 - 1),
}


def check_number(name: str, value: object) -> float:
    """`value` of the number parameter `name`, or InvalidRequestError naming it."""
    if not _is_number(value):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError:
        number = math.inf
    bounds = NUMBER_BOUNDS[name]
    if not math.isfinite(number) or number not in bounds:
        raise InvalidRequestError(f"{name} must be in {bounds}, got {value!r}", param=name)
    return number


def check_integer(name: str, value: object) -> int:
    """`value` of the integer parameter `name`, or InvalidRequestError naming it."""
    if not _is_int(value):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    bounds = INTEGER_BOUNDS[name]
    if value not in bounds:  # type: ignore[operator]
        raise InvalidRequestError(f"{name} must be an integer in [{int(bounds.low)}, "
                                  f"{int(bounds.high)}], got {value!r}", param=name)
    return value  # type: ignore[return-value]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request turns target logits into tokens.

    Each field's bounds are NUMBER_BOUNDS' or INTEGER_BOUNDS'.

    temperature: 0 (below `GREEDY_TEMPERATURE_EPS`) means greedy, i.e. argmax.
    top_p: keep the smallest set of tokens whose probability sums to at least top_p; in (0, 1].
    top_k: keep the k most likely tokens; -1 (or 0, normalised to -1) turns it off.
    repetition_penalty: HF/vLLM semantics, > 0; 1 turns it off.
    seed: seeds the request's own generator, so the same request gives the same output.
    max_tokens: how many tokens to generate at most, >= 1.
    stop_token_ids: generation ends after emitting one of these (besides EOS).
    ignore_eos: keep generating past EOS.
    presence_penalty, frequency_penalty: OpenAI's, in [-2, 2], over the generated tokens
        only: logit[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0).
    min_tokens: EOS (unless ignore_eos) and stop_token_ids are masked until this many tokens
        have been generated (vLLM); 0 <= min_tokens <= max_tokens.
    logit_bias: (token id, bias) pairs, bias in [-100, 100] added to the logit; given as a
        mapping or pairs, stored sorted by id. Ids are checked against the vocabulary where
        it is known (`verifier_svc/requests.py`).
    min_p: in [0, 1]; drop tokens whose probability is below min_p times the most likely
        token's (after temperature); 0 turns it off.
    logprobs: None reports no log-probabilities; n in [0, 20] reports each output token's
        and the n most likely at its position (specdec/engine/logprobs.py).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in NUMBER_BOUNDS:
            check_number(name, getattr(self, name))
        for name in ("top_k", "max_tokens", "min_tokens"):
            check_integer(name, getattr(self, name))
        for name in ("seed", "logprobs"):  # None: not given
            if getattr(self, name) is not None:
                check_integer(name, getattr(self, name))
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must be at most "
                                      f"max_tokens ({self.max_tokens})", param="min_tokens")
        stop_token_ids = tuple(self.stop_token_ids)
        if any(not _is_int(token_id) or token_id < 0 for token_id in stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be non-negative integers, got {list(stop_token_ids)!r}", param="stop_token_ids"
            )
        logit_bias = _logit_bias_pairs(self.logit_bias)
        # Frozen: normalise through object.__setattr__ (0 means "off" for top_k, as in vLLM).
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        object.__setattr__(self, "logit_bias", logit_bias)
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes by argmax (temperature below 1e-5, as vLLM)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def moves_argmax(self) -> bool:
        """Whether some processing can change which token is most likely: a penalty,
        logit_bias or min_tokens (temperature, min_p, top-k and top-p never do)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias) or self.min_tokens > 0)


def _logit_bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """A mapping or pairs of token id -> bias, validated and sorted by id."""
    # Any: unchecked input; iterating or unpacking what is not pairs raises the error below.
    items: Any = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(token_id, bias) for token_id, bias in items]
    except (TypeError, ValueError):
        raise InvalidRequestError(
            f"logit_bias must map token ids to biases, got {value!r}", param="logit_bias") from None
    for token_id, bias in pairs:
        if not _is_int(token_id) or token_id < 0:
            raise InvalidRequestError(
                f"logit_bias keys must be non-negative token ids, got {token_id!r}", param="logit_bias")
        if not _is_number(bias) or not (-MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS):
            raise InvalidRequestError(
                f"logit_bias values must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], "
                f"got {bias!r} for token {token_id}", param="logit_bias")
    if len({token_id for token_id, _ in pairs}) != len(pairs):
        raise InvalidRequestError("logit_bias names a token id twice", param="logit_bias")
    return tuple(sorted((token_id, float(bias)) for token_id, bias in pairs))
