"""The services authenticate each other (issue 28, item 4).

Real grpc.aio servers on port 0: a drafter and a verifier that require the internal
token refuse every call without it, or with another, as UNAUTHENTICATED (the health check
excepted); the gateway -> verifier -> drafter path works with it. Plus where the token
and the API key come from, the mains that refuse to serve a network open, reflection
off by default, and the launcher that hands secrets to its children in their
environment, never their argv.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from drafter_svc import server as drafter_main
from drafter_svc.server import start_drafter_server, stop_drafter_server
from gateway import GatewayConfig, VerifierClient
from gateway import __main__ as gateway_main
from specdec import launcher
from specdec.config import SpeculativeConfig
from specdec.errors import ConfigError
from specdec.models.model_files import load_tokenizer
from specdec.rpc.internal_auth import (
    METADATA_KEY,
    REFUSAL_DETAILS,
    check_server_token,
    is_loopback,
    load_api_key,
    load_internal_token,
)
from specdec.rpc.tls import open_channel
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.fake_verifier import LiveGateway
from tests.support.served_stack import served_stack
from tests.support.tiny_models import make_tiny_llama
from tests.support.verifier_harness import StartVerifier, request, verifier_starter
from verifier_svc import __main__ as verifier_main
from verifier_svc.drafting.drafter_pool import DrafterPool, DraftRequest

TOKEN = "the-right-token-0123456789"
WRONG = "the-wrong-token-0123456789"
K = 3
CONFIG = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": K,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3})
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
SECRET_ENV = ("SPECDEC_INTERNAL_TOKEN", "SPECDEC_INTERNAL_TOKEN_FILE", "SPECDEC_API_KEY",
              "VLLM_API_KEY")


@pytest.fixture(autouse=True)
def no_secrets_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SECRET_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-auth"))


# --- where the token and the API key come from -------------------------------------

def test_the_token_comes_from_a_file_or_the_environment(monkeypatch, tmp_path):
    assert load_internal_token(None) is None
    monkeypatch.setenv("SPECDEC_INTERNAL_TOKEN", f"  {TOKEN}\n")
    assert load_internal_token(None) == TOKEN
    env_file, flag_file = tmp_path / "env-token", tmp_path / "flag-token"
    env_file.write_text(WRONG + "\n")
    flag_file.write_text(f"\n{TOKEN}  \n")
    monkeypatch.setenv("SPECDEC_INTERNAL_TOKEN_FILE", str(env_file))
    assert load_internal_token(None) == WRONG  # the file before the value
    assert load_internal_token(str(flag_file)) == TOKEN  # the flag before both


@pytest.mark.parametrize("source, value, names", [
    ("flag", "short-secret", "--internal-token-file"),
    ("flag", " \n", "--internal-token-file"),
    ("flag", None, "--internal-token-file"),  # no such file
    ("env-file", "short-secret", "$SPECDEC_INTERNAL_TOKEN_FILE"),
    ("env", "", "$SPECDEC_INTERNAL_TOKEN"),
    ("env", "short-secret", "$SPECDEC_INTERNAL_TOKEN"),
    ("env", "é" * 20, "$SPECDEC_INTERNAL_TOKEN"),
])
def test_a_bad_token_is_refused_naming_where_it_came_from(monkeypatch, tmp_path, source, value,
                                                          names):
    path = tmp_path / "token"
    if value is not None and source != "env":
        path.write_text(value)
    if source == "env":
        monkeypatch.setenv("SPECDEC_INTERNAL_TOKEN", value)
    elif source == "env-file":
        monkeypatch.setenv("SPECDEC_INTERNAL_TOKEN_FILE", str(path))
    with pytest.raises(ConfigError) as caught:
        load_internal_token(str(path) if source == "flag" else None)
    assert names in caught.value.message
    assert "short-secret" not in caught.value.message


def test_the_api_key_comes_from_the_flag_a_file_or_the_environment(monkeypatch, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert load_api_key(None, None) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm-env")
    assert load_api_key(None, None) == "from-vllm-env"
    monkeypatch.setenv("SPECDEC_API_KEY", "from-env")
    assert load_api_key(None, None) == "from-env"
    assert load_api_key(None, str(key_file)) == "from-file"
    assert load_api_key("from-flag", None) == "from-flag"
    with pytest.raises(ConfigError, match="either --api-key or --api-key-file"):
        load_api_key("from-flag", str(key_file))
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="--api-key-file"):
        load_api_key(None, str(key_file))
    args = gateway_main.build_parser().parse_args(
        ["--model", "m", "--verifier", "v:1", "--api-key-file", str(tmp_path / "missing")])
    with pytest.raises(ConfigError, match="no such file"):
        gateway_main.api_key_from_args(args)


# --- the mains ---------------------------------------------------------------------

@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.5", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("drafter", False), ("", False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


def test_open_service_on_the_network_needs_an_explicit_flag(caplog):
    with pytest.raises(ConfigError) as caught:
        check_server_token(None, "0.0.0.0", insecure=False)
    assert "--internal-token-file" in caught.value.message
    assert "SPECDEC_INTERNAL_TOKEN" in caught.value.message
    assert "--insecure-no-internal-token" in caught.value.message
    with caplog.at_level(logging.WARNING):
        check_server_token(None, "0.0.0.0", insecure=True)
        check_server_token(None, "127.0.0.1", insecure=False)
        check_server_token(TOKEN, "0.0.0.0", insecure=False, tls_enabled=True)
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 2 and "--insecure-no-internal-token" in warnings[0]
    assert "no internal token" in warnings[1]


def test_the_verifier_and_drafter_mains_refuse_to_serve_the_network_open(caplog, tmp_path):
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert drafter_main.main(["--speculative-config", spec, "--host", "0.0.0.0",
                              "--port", "0"]) == 2
    assert verifier_main.main(["--host", "0.0.0.0", "--port", "0"]) == 2
    refusals = [record.getMessage() for record in caplog.records
                if "--internal-token-file" in record.getMessage()]
    assert len(refusals) == 2
    short = tmp_path / "short"
    short.write_text("short")
    assert drafter_main.main(["--speculative-config", spec, "--port", "0",
                              "--internal-token-file", str(short)]) == 2
    assert "needs at least 16" in caplog.records[-1].getMessage()
    for parser in (verifier_main.build_parser(), drafter_main.build_arg_parser()):
        flags = parser.format_help()
        for flag in ("--internal-token-file", "--insecure-no-internal-token",
                     "--enable-reflection"):
            assert flag in flags
    assert "--internal-token-file" in gateway_main.build_parser().format_help()


# --- the servers -------------------------------------------------------------------

@pytest.fixture
async def drafter() -> AsyncIterator[str]:
    """The address of a drafter that requires TOKEN."""
    server, port = await start_drafter_server(CONFIG, "127.0.0.1", 0, internal_token=TOKEN)
    yield f"127.0.0.1:{port}"
    await stop_drafter_server(server, grace_s=0)


async def _propose(channel: grpc.aio.Channel) -> list[int]:
    call = specdec_pb2_grpc.DrafterStub(channel).Propose()
    await call.write(specdec_pb2.ProposeRequest(step_id=1, sequences=[
        specdec_pb2.SequenceUpdate(seq_id=1, new_token_ids=[1, 2, 3, 4, 1, 2], context_len=6,
                                   num_speculative_tokens=K)]))
    response = await call.read()
    await call.done_writing()
    return [token for draft in response.drafts for token in draft.draft_token_ids]


async def _health(channel: grpc.aio.Channel, service: str) -> int:
    return (await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=5)).status


@pytest.mark.parametrize("token", [None, WRONG])
async def test_the_drafter_refuses_calls_without_the_token(drafter, token):
    async with open_channel(None, drafter, [], internal_token=token) as channel:
        stub = specdec_pb2_grpc.DrafterStub(channel)
        calls = {
            "GetInfo": lambda: stub.GetInfo(specdec_pb2.GetDrafterInfoRequest(), timeout=5),
            "Propose": lambda: _propose(channel),
            # An unknown method is refused too: the caller learns nothing of what exists.
            "unknown": lambda: channel.unary_unary("/specdec.v1.Drafter/Nope")(b"", timeout=5),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call()
            assert refused.value.code() == UNAUTHENTICATED, name
            assert refused.value.details() == REFUSAL_DETAILS
            assert TOKEN not in refused.value.details() and WRONG not in refused.value.details()
        # Orchestrators probe health without credentials.
        assert await _health(channel, "specdec.v1.Drafter") == health_pb2.HealthCheckResponse.SERVING


async def test_the_drafter_serves_calls_with_the_token(drafter):
    async with open_channel(None, drafter, [], internal_token=TOKEN) as channel:
        info = await specdec_pb2_grpc.DrafterStub(channel).GetInfo(
            specdec_pb2.GetDrafterInfoRequest(), timeout=5)
        assert info.method == "ngram"
        assert await _propose(channel) == [3, 4, 1]
        # Metadata the caller sets itself travels along; a token of its own is replaced.
        info = await specdec_pb2_grpc.DrafterStub(channel).GetInfo(
            specdec_pb2.GetDrafterInfoRequest(), timeout=5,
            metadata=(("x-request-id", "r1"), (METADATA_KEY, WRONG)))
        assert info.method == "ngram"


@pytest.mark.parametrize("token, healthy", [(TOKEN, True), (WRONG, False), (None, False)])
async def test_the_verifier_pool_connects_only_with_the_token(drafter, token, healthy):
    pool = DrafterPool([drafter], vocab_size=100, tokenizer_fingerprint="",
                       backoff_initial_s=0.05, backoff_max_s=0.2, internal_token=token)
    await pool.start()
    try:
        assert await pool.wait_for_healthy(1, timeout_s=5.0 if healthy else 1.0) is healthy
        drafts = await pool.propose([DraftRequest(1, [1, 2, 3, 4, 1, 2], 0, K)], [],
                                    timeout_s=2.0)
        assert {seq: draft.token_ids for seq, draft in drafts.items()} == (
            {1: [3, 4, 1]} if healthy else {})
    finally:
        await pool.close()


async def _list_services(channel: grpc.aio.Channel) -> set[str]:
    call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    response = await call.read()
    await call.done_writing()
    return {service.name for service in response.list_services_response.service}


async def test_reflection_is_off_unless_enabled():
    plain, plain_port = await start_drafter_server(CONFIG, "127.0.0.1", 0)
    reflecting, reflecting_port = await start_drafter_server(
        CONFIG, "127.0.0.1", 0, internal_token=TOKEN, enable_reflection=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{plain_port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as off:
                await _list_services(channel)
            assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED
        address = f"127.0.0.1:{reflecting_port}"
        async with open_channel(None, address, []) as anonymous:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _list_services(anonymous)
            assert refused.value.code() == UNAUTHENTICATED
        async with open_channel(None, address, [], internal_token=TOKEN) as channel:
            assert {"specdec.v1.Drafter", "grpc.health.v1.Health"} <= await _list_services(channel)
    finally:
        await stop_drafter_server(plain, grace_s=0)
        await stop_drafter_server(reflecting, grace_s=0)


@pytest.fixture
async def start(tiny_model: Path, device) -> AsyncIterator[StartVerifier]:
    async with verifier_starter(tiny_model, device, num_blocks=64) as start_one:
        yield start_one


async def test_the_verifier_requires_the_token_and_sends_it_to_its_drafters(
        start: StartVerifier, drafter: str, tiny_model: Path):
    verifier = await start(internal_token=TOKEN, speculative_config=CONFIG,
                           drafter_targets=(drafter,), drafter_wait_s=10.0,
                           draft_timeout_s=2.0, adaptive_speculation=False)
    address = f"127.0.0.1:{verifier.port}"
    assert "internal_token" not in repr(verifier.engine) and TOKEN not in repr(
        verifier.served)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    for token in (None, WRONG):
        async with open_channel(None, address, [], internal_token=token) as channel:
            stub = specdec_pb2_grpc.VerifierStub(channel)
            for call in (lambda stub=stub: stub.GetInfo(specdec_pb2.GetVerifierInfoRequest(), timeout=5),
                         lambda stub=stub: stub.Generate(request(prompt, 4)).read()):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call()
                assert refused.value.code() == UNAUTHENTICATED
            assert await _health(channel, "specdec.v1.Verifier") == \
                health_pb2.HealthCheckResponse.SERVING
    assert verifier.engine.num_requests == 0

    # gateway -> verifier -> drafter, each link carrying the token.
    pool = verifier.engine.drafter_pool
    assert pool is not None and pool.num_healthy() == 1
    config = GatewayConfig(model=str(tiny_model), served_model_name="tiny",
                           verifier_addresses=(address,))
    gateway = LiveGateway(config, load_tokenizer(tiny_model),
                          VerifierClient([address], internal_token=TOKEN))
    # In threads: this loop serves the verifier meanwhile.
    await asyncio.to_thread(gateway.start)
    try:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as client:
            # Long enough for the random model to repeat a token, which ngram then drafts.
            response = await client.post("/v1/completions", json={
                "model": "tiny", "prompt": " ".join(f"w{i}" for i in prompt),
                "max_tokens": 32, "temperature": 0, "ignore_eos": True})
    finally:
        await asyncio.to_thread(gateway.stop)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 32
    assert verifier.engine.spec.num_drafts > 0, "the drafter never proposed"
    assert pool.num_healthy() == 1


# --- the launcher ------------------------------------------------------------------

def test_the_launcher_puts_no_secret_in_argv(monkeypatch):
    parser = argparse.ArgumentParser()
    launcher.add_serve_args(parser)
    monkeypatch.setenv("SPECDEC_INTERNAL_TOKEN_FILE", "/the/operator's/file")
    args = parser.parse_args(["--api-key", "key-in-the-launcher-argv", "--enable-reflection",
                              "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3}'])
    commands = dict(launcher._child_commands(args, "/models/tiny"))
    environments = launcher._child_environments("key-in-the-launcher-argv", TOKEN)
    assert set(commands) == set(environments) == {"drafter", "verifier", "gateway"}
    for name, command in commands.items():
        assert not any("key-in-the-launcher-argv" in item or TOKEN in item for item in command)
        assert "--api-key" not in command
        assert ("--enable-reflection" in command) is (name != "gateway")
        environment = environments[name]
        assert environment["SPECDEC_INTERNAL_TOKEN"] == TOKEN
        assert "SPECDEC_INTERNAL_TOKEN_FILE" not in environment  # it would win over the value
        # The API key goes to the gateway only.
        assert environment.get("SPECDEC_API_KEY") == (
            "key-in-the-launcher-argv" if name == "gateway" else None)


def _proc(pid: int, name: str) -> bytes:
    return Path(f"/proc/{pid}/{name}").read_bytes()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_a_launched_stack_authenticates_with_secrets_only_in_environments(tiny_model,
                                                                         tmp_path):
    key = "launched-api-key-0123456789"
    key_file = tmp_path / "api-key"
    key_file.write_text(key + "\n")
    with served_stack(tiny_model, "--api-key-file", str(key_file)) as stack:
        children = stack.child_pids("drafter_svc|verifier_svc|gateway")
        assert len(children) == 3
        tokens = set()
        for pid in children:
            argv = _proc(pid, "cmdline")
            environment = dict(item.split(b"=", 1)
                               for item in _proc(pid, "environ").split(b"\0") if b"=" in item)
            token = environment[b"SPECDEC_INTERNAL_TOKEN"]
            assert len(token) >= 32 and token not in argv and key.encode() not in argv
            tokens.add(token)
            is_gateway = b"-mgateway" in argv.replace(b"\0", b"")
            assert (environment.get(b"SPECDEC_API_KEY") == key.encode()) is is_gateway
        assert len(tokens) == 1  # one token, shared by the three
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{stack.base_url}/v1/models", timeout=10).status_code == 401
        # Served through gateway -> verifier -> drafter, which would refuse one another
        # without the launcher's token.
        response = httpx.post(f"{stack.base_url}/v1/completions", headers=headers, timeout=60,
                              json={"model": str(tiny_model), "prompt": "w5 w6 w7 w5 w6",
                                    "max_tokens": 8, "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8


def test_a_restarted_drafter_gets_the_same_environment(monkeypatch):
    monkeypatch.setattr(launcher, "RESTART_BACKOFF_S", (0.0, 0.0))
    check = 'import os, sys; sys.exit(0 if os.environ.get("SPECDEC_INTERNAL_TOKEN") == "t" else 3)'
    restarts = launcher._RestartWithBackoff("drafter", {"SPECDEC_INTERNAL_TOKEN": "t"})
    first = launcher.subprocess.Popen([sys.executable, "-c", check])
    first.wait()
    assert restarts.check(first) is first  # schedules the restart
    second = restarts.check(first)
    assert second is not first and second.wait(timeout=60) == 0
