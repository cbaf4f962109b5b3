"""Per-request sampling parameters, with vLLM's names, defaults and bounds.

`SamplingParams` is the one definition of each parameter: its name, its default and, in the
field's metadata, the interval it must lie in (`PARAMETERS` lists them). The gateway checks a
request's JSON with `check_parameter` and the checks below; the verifier builds a
SamplingParams from what reaches it (a direct gRPC client's values included), which runs the
same checks: both sides refuse a value by the same rule, in the same words. Every rejection
raises `InvalidRequestError` naming the offending field in `param`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
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
# stop_token_ids: how many a request may give; an id is a uint32 on the wire.
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKEN_ID = 2**32 - 1


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
        return f"{'(' if self.low_open else '['}{_bound(self.low)}, {_bound(self.high)}]"


def _bound(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True, slots=True)
class Parameter:
    """One bounded sampling parameter, as `SamplingParams` declares it."""

    name: str
    integer: bool
    # None: the parameter is optional (not given means off).
    default: float | int | None
    bounds: Bounds


def _number(low: float, high: float, *, low_open: bool = False) -> dict[str, Any]:
    """A number field's metadata: its bounds."""
    return {"bounds": Bounds(low, high, low_open), "integer": False}


def _integer(low: int, high: int) -> dict[str, Any]:
    """An integer field's metadata: its bounds."""
    return {"bounds": Bounds(low, high), "integer": True}


def check_parameter(name: str, value: object, param: str | None = None) -> float | int:
    """`value` of the bounded parameter `name` (float for a number), or InvalidRequestError
    naming the field; `param` names the request field where it is not `name` (an alias such
    as max_completion_tokens)."""
    parameter = PARAMETERS[name]
    param = param or name
    if parameter.integer:
        if not _is_int(value):
            raise InvalidRequestError(f"{param} must be an integer, got {value!r}", param=param)
        if value not in parameter.bounds:  # type: ignore[operator]
            raise InvalidRequestError(
                f"{param} must be an integer in {parameter.bounds}, got {value!r}", param=param)
        return value  # type: ignore[return-value]
    if not _is_number(value):
        raise InvalidRequestError(f"{param} must be a number, got {value!r}", param=param)
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number not in parameter.bounds:
        raise InvalidRequestError(f"{param} must be in {parameter.bounds}, got {value!r}",
                                  param=param)
    return number


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    if min_tokens > max_tokens:
        raise InvalidRequestError(f"min_tokens ({min_tokens}) must be at most max_tokens "
                                  f"({max_tokens})", param="min_tokens")


def check_stop_token_ids(value: object) -> tuple[int, ...]:
    """A request's stop_token_ids: at most MAX_STOP_TOKEN_IDS ids, each a uint32."""
    if (not isinstance(value, (list, tuple)) or len(value) > MAX_STOP_TOKEN_IDS
            or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in value)):
        raise InvalidRequestError(
            f"stop_token_ids must be an array of at most {MAX_STOP_TOKEN_IDS} token ids "
            f"(integers in [0, {MAX_TOKEN_ID}])", param="stop_token_ids")
    return tuple(value)


def check_logit_bias_ids(token_ids: Iterable[int], vocab_size: int) -> None:
    """Refuses a logit_bias id outside the vocabulary (the smallest, named)."""
    bad = min((token_id for token_id in token_ids if token_id >= vocab_size), default=None)
    if bad is not None:
        raise InvalidRequestError(f"logit_bias token id {bad} is outside the vocabulary "
                                  f"(size {vocab_size})", param="logit_bias")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request turns target logits into tokens.

    A bounded field's interval is in its metadata (`PARAMETERS`).

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

    temperature: float = field(default=1.0, metadata=_number(0.0, MAX_TEMPERATURE))
    top_p: float = field(default=1.0, metadata=_number(0.0, 1.0, low_open=True))
    top_k: int = field(default=-1, metadata=_integer(-1, MAX_INT32))
    repetition_penalty: float = field(
        default=1.0, metadata=_number(0.0, MAX_REPETITION_PENALTY, low_open=True))
    # The wire carries uint64; a negative seed keeps its two's-complement bits.
    seed: int | None = field(default=None, metadata=_integer(-(2**63), 2**64 - 1))
    max_tokens: int = field(default=16, metadata=_integer(1, MAX_INT32))
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = field(default=0.0,
                                    metadata=_number(-MAX_ABS_PENALTY, MAX_ABS_PENALTY))
    frequency_penalty: float = field(default=0.0,
                                     metadata=_number(-MAX_ABS_PENALTY, MAX_ABS_PENALTY))
    min_tokens: int = field(default=0, metadata=_integer(0, MAX_INT32))
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = field(default=0.0, metadata=_number(0.0, 1.0))
    logprobs: int | None = field(default=None, metadata=_integer(0, MAX_TOP_LOGPROBS))

    def __post_init__(self) -> None:
        for name, parameter in PARAMETERS.items():
            value = getattr(self, name)
            if value is not None or parameter.default is not None:  # None: not given
                check_parameter(name, value)
        check_min_tokens(self.min_tokens, self.max_tokens)
        # Frozen: normalise through object.__setattr__ (0 means "off" for top_k, as in vLLM).
        object.__setattr__(self, "stop_token_ids", check_stop_token_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))
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


def logit_bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
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


# Every bounded parameter, in SamplingParams' order: what the gateway reads from a request's
# JSON and the verifier from the wire.
PARAMETERS: dict[str, Parameter] = {
    item.name: Parameter(item.name, item.metadata["integer"], item.default,  # type: ignore[arg-type]
                         item.metadata["bounds"])
    for item in fields(SamplingParams) if "bounds" in item.metadata}
