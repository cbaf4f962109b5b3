"""SamplingParams: defaults, normalisation, and validation errors that name the field."""

from __future__ import annotations

import dataclasses

import pytest

from specdec.engine.sampling_params import SamplingParams
from specdec.errors import InvalidRequestError


def test_defaults_follow_vllm() -> None:
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, -1)
    assert (params.repetition_penalty, params.seed, params.max_tokens) == (1.0, None, 16)
    assert (params.stop_token_ids, params.ignore_eos) == ((), False)
    assert not params.is_greedy


@pytest.mark.parametrize(
    ("temperature", "is_greedy"),
    [(0.0, True), (9e-6, True), (1e-5, False), (0.7, False), (2.0, False)],
)
def test_is_greedy_below_1e_5(temperature: float, is_greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is is_greedy


def test_top_k_zero_means_off() -> None:
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(top_k=5).top_k == 5


def test_stop_token_ids_become_a_tuple() -> None:
    params = SamplingParams(stop_token_ids=[3, 7])  # type: ignore[arg-type]
    assert params.stop_token_ids == (3, 7)
    hash(params)  # frozen and hashable


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"stop_token_ids": (1, -3)}, "stop_token_ids"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert excinfo.value.param == param
    assert param in excinfo.value.message


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 1},
        {"repetition_penalty": 0.5},
        {"max_tokens": 1},
        {"seed": 0},
        {"seed": -7},
        {"stop_token_ids": (0, 2)},
        {"temperature": 1},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)  # type: ignore[arg-type]
