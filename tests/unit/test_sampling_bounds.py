"""Sampling parameters have one definition (specdec.engine.sampling_params.SamplingParams):
the gateway's request JSON and the verifier's wire are read from it. Here, in process: the
bounds themselves are accepted on both sides, the defaults are the same, and proto3's zeros
read as unset where a parameter's bounds exclude 0. tests/service/test_sampling_bounds_wire.py
checks that a value outside gets the same error over HTTP and over gRPC."""

from __future__ import annotations

import pytest

from gateway.protocol import parse_sampling
from specdec.engine.sampling_params import PARAMETERS, SamplingParams
from specdec.errors import InvalidRequestError
from specdec.v1 import specdec_pb2
from verifier_svc.servicer import sampling_params_from_proto

MAX_MODEL_LEN = 64
PROMPT_LEN = 4


def from_wire(params: specdec_pb2.SamplingParams) -> SamplingParams:
    return sampling_params_from_proto(params, MAX_MODEL_LEN, PROMPT_LEN)


def closed_ends(name: str) -> list[float | int]:
    bounds = PARAMETERS[name].bounds
    return [bounds.high] if bounds.low_open else [bounds.low, bounds.high]


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_a_bound_itself_is_accepted_on_both_sides(name: str) -> None:
    # max_tokens as large as min_tokens may be: the one rule between the two holds.
    room = {} if name in ("max_tokens", "min_tokens") else {"max_tokens": 16}
    for value in closed_ends(name):
        fields = {"max_tokens": PARAMETERS["max_tokens"].bounds.high, **room, name: value}
        sampling = parse_sampling(fields, chat=False)
        assert getattr(sampling.params, name) == (value % 2**64 if name == "seed" else value)
        engine_value = getattr(SamplingParams(**fields), name)
        assert engine_value == (-1 if name == "top_k" and value == 0 else value)


def test_the_gateway_sends_every_default_and_the_verifier_reads_it_back() -> None:
    params = from_wire(parse_sampling({}, chat=False).params)
    defaults = SamplingParams()
    for name in PARAMETERS:
        if name != "max_tokens":  # not given: the room left in the context
            assert getattr(params, name) == getattr(defaults, name), name
    assert params.max_tokens == MAX_MODEL_LEN - PROMPT_LEN


def test_a_zero_the_bounds_exclude_is_unset_on_the_wire() -> None:
    params = from_wire(specdec_pb2.SamplingParams(temperature=0.5))
    assert (params.top_p, params.repetition_penalty) == (1.0, 1.0)
    assert params.max_tokens == MAX_MODEL_LEN - PROMPT_LEN
    assert (params.seed, params.logprobs) == (None, None)
    # A zero the bounds include is a value: greedy, no min_p.
    assert from_wire(specdec_pb2.SamplingParams()).is_greedy
    assert from_wire(specdec_pb2.SamplingParams(logprobs=0)).logprobs == 0


def test_an_alias_is_named_in_its_error() -> None:
    with pytest.raises(InvalidRequestError) as refused:
        parse_sampling({"max_completion_tokens": 0})
    assert refused.value.param == "max_completion_tokens"
    with pytest.raises(InvalidRequestError) as refused:
        parse_sampling({"logprobs": True, "top_logprobs": 21})
    assert refused.value.param == "top_logprobs"
    assert "[0, 20]" in refused.value.message


def test_a_type_error_names_the_field() -> None:
    for name, value in (("temperature", "hot"), ("top_k", 1.5), ("seed", True)):
        with pytest.raises(InvalidRequestError) as refused:
            parse_sampling({name: value})
        assert refused.value.param == name
