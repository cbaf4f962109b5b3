"""Every bound of every sampling parameter gives the same error on both sides of the wire:
the gateway answers a request's JSON with HTTP 400 naming the field, and the verifier
answers a direct gRPC client's value with INVALID_ARGUMENT and the field in its
`specdec-param` metadata, in the same words, because both check with the one definition in
specdec.engine.sampling_params.

The table is built from that definition (`PARAMETERS`): a parameter added there is tested
here without an edit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import pytest_asyncio

from specdec.config_flags import build_config
from specdec.engine.sampling_params import MAX_ABS_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, PARAMETERS, Parameter
from specdec.rpc.grpc_status import PARAM_METADATA_KEY, error_param
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.fake_verifier import SERVED_MODEL, FakeVerifier, LiveGateway, live_gateway
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.builder import VerifierConfig
from verifier_svc.server import RunningVerifier, start_verifier

# The verifier's tasks live as long as the module's fixture, so the tests share its loop.
module_loop = pytest.mark.asyncio(loop_scope="module")


def outside(parameter: Parameter) -> list[tuple[str, float | int]]:
    """A value just below and one just above the parameter's interval; half a unit off for
    numbers, which the wire's float32 carries exactly."""
    step = 1 if parameter.integer else 0.5
    return [("below", parameter.bounds.low - step), ("above", parameter.bounds.high + step)]


# (case id, the request's JSON fields, the same values as the wire's SamplingParams fields)
BOUND_CASES = [(f"{name}-{side}", {name: value}, {name: value})
               for name, parameter in PARAMETERS.items() for side, value in outside(parameter)]
# The rules between and within fields, checked by the same code on both sides.
OTHER_CASES = [
    ("min_tokens-above-max_tokens", {"min_tokens": 5, "max_tokens": 3},
     {"min_tokens": 5, "max_tokens": 3}),
    ("logit_bias-above", {"logit_bias": {"3": MAX_ABS_LOGIT_BIAS + 0.5}},
     {"logit_bias": {3: MAX_ABS_LOGIT_BIAS + 0.5}}),
    ("stop_token_ids-too-many", {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)},
     {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}),
]
CASES = BOUND_CASES + OTHER_CASES


def wire_params(fields: dict[str, Any]) -> specdec_pb2.SamplingParams | None:
    """The fields as a direct gRPC client sends them; None where the wire cannot say the
    value: its type cannot hold it (a negative min_tokens in a uint32), or proto3 reads it
    as unset (max_tokens 0: up to max_model_len). Then only the gateway can see it."""
    try:
        params = specdec_pb2.SamplingParams(**fields)
    except (ValueError, TypeError):
        return None
    unset = [name for name, value in fields.items()
             if value == 0 and name in PARAMETERS and 0 not in PARAMETERS[name].bounds]
    return None if unset else params


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-sampling-bounds"))


@pytest.fixture(scope="module")
def live(tokenizer: Any) -> Iterator[tuple[LiveGateway, FakeVerifier]]:
    with live_gateway(tokenizer) as live:
        yield live


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def verifier(tiny_model: Path) -> AsyncIterator[RunningVerifier]:
    running = await start_verifier(build_config(
        VerifierConfig, model=str(tiny_model), device="cpu", dtype="float32", max_model_len=128,
        block_size=4, num_kv_blocks=64), "127.0.0.1", 0)
    yield running
    await running.stop()


async def gateway_refusal(gateway: LiveGateway, fields: dict[str, Any]) -> tuple[str, str]:
    """The gateway's 400 for a completion with `fields`: (message, param)."""
    client = openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
    async with client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=SERVED_MODEL, prompt="Hello", extra_body=fields)
    assert refused.value.status_code == 400
    body = refused.value.body
    assert isinstance(body, dict)
    return body["message"], body["param"]


async def verifier_refusal(verifier: RunningVerifier,
                           params: specdec_pb2.SamplingParams) -> tuple[str, str | None]:
    """The verifier's INVALID_ARGUMENT for a direct Generate call with `params`."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}") as channel:
        stub = specdec_pb2_grpc.VerifierStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(specdec_pb2.GenerateRequest(
                    prompt_token_ids=[5, 6], sampling=params)):
                pass
    error = refused.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert any(key == PARAM_METADATA_KEY for key, _ in error.trailing_metadata() or ())
    return error_param(error)


def test_the_table_covers_both_ends_of_every_parameter() -> None:
    assert {case_id.rsplit("-", 1)[0] for case_id, _, _ in BOUND_CASES} == set(PARAMETERS)
    assert len(BOUND_CASES) == 2 * len(PARAMETERS)


@module_loop
@pytest.mark.parametrize(("json_fields", "wire_fields"),
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
async def test_a_value_out_of_bounds_is_refused_alike_on_both_sides(
        live: tuple[LiveGateway, FakeVerifier], verifier: RunningVerifier,
        json_fields: dict[str, Any], wire_fields: dict[str, Any]) -> None:
    message, param = await gateway_refusal(live[0], json_fields)
    assert param in json_fields
    params = wire_params(wire_fields)
    if params is None:
        # Only an integer the wire cannot say is left to the gateway alone.
        (value,) = wire_fields.values()
        assert isinstance(value, int) and (value <= 0 or value >= 2**31)
        return
    assert await verifier_refusal(verifier, params) == (message, param)
