"""Sampling parameters have one definition of their bounds: the gateway refuses a value
outside them in a request's JSON, and the verifier refuses it from a direct gRPC client,
by the same rule and in the same words."""

from __future__ import annotations

import pytest

from gateway.protocol import parse_sampling
from specdec.engine.sampling_params import (
    INTEGER_BOUNDS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    NUMBER_BOUNDS,
    SamplingParams,
)
from specdec.errors import InvalidRequestError
from specdec.v1 import specdec_pb2
from verifier_svc.servicer import sampling_params_from_proto

# Just outside each bound (exact in the wire's float32), and on it.
OUTSIDE = {"temperature": MAX_TEMPERATURE + 1, "top_p": 1.5, "min_p": -0.125,
           "repetition_penalty": MAX_REPETITION_PENALTY * 2, "presence_penalty": 2.5,
           "frequency_penalty": -3.0}
INSIDE = {"temperature": MAX_TEMPERATURE, "top_p": 1.0, "min_p": 0.0,
          "repetition_penalty": MAX_REPETITION_PENALTY, "presence_penalty": 2.0,
          "frequency_penalty": -2.0}


def gateway_error(body: dict) -> InvalidRequestError:
    """The completions endpoint's refusal (its logprobs is the integer the wire carries)."""
    with pytest.raises(InvalidRequestError) as caught:
        parse_sampling(body, chat=False)
    return caught.value


def verifier_error(message: specdec_pb2.SamplingParams) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        sampling_params_from_proto(message, max_model_len=64, prompt_len=4)
    return caught.value


@pytest.mark.parametrize("name", sorted(NUMBER_BOUNDS))
def test_a_number_out_of_bounds_is_refused_on_both_sides_alike(name: str) -> None:
    assert set(OUTSIDE) == set(NUMBER_BOUNDS) == set(INSIDE)
    at_gateway = gateway_error({name: OUTSIDE[name]})
    at_verifier = verifier_error(specdec_pb2.SamplingParams(**{name: OUTSIDE[name]}))
    assert at_gateway.param == at_verifier.param == name
    assert at_gateway.message == at_verifier.message
    assert str(NUMBER_BOUNDS[name]) in at_gateway.message
    # The bound itself is accepted on both sides.
    assert getattr(parse_sampling({name: INSIDE[name]}), name) == INSIDE[name]
    assert getattr(SamplingParams(**{name: INSIDE[name]}), name) == INSIDE[name]


def test_integer_bounds_are_the_same_on_both_sides() -> None:
    for name, value in (("top_k", -2), ("max_tokens", 0), ("logprobs", 21)):
        at_gateway = gateway_error({name: value})
        with pytest.raises(InvalidRequestError) as caught:
            SamplingParams(**{name: value})
        assert at_gateway.param == caught.value.param == name
        bounds = INTEGER_BOUNDS[name]
        assert f"[{int(bounds.low)}, {int(bounds.high)}]" in at_gateway.message
        assert f"[{int(bounds.low)}, {int(bounds.high)}]" in caught.value.message
    # A direct client's uint32 max_tokens beyond the gateway's bound is refused as well.
    assert verifier_error(specdec_pb2.SamplingParams(max_tokens=2**31)).param == "max_tokens"
