"""gRPC TLS between the services, with a throwaway CA made by the openssl CLI at test time.

Real in-process servers on port 0: a TLS drafter and the verifier's DrafterPool, a fake
verifier on a TLS GrpcServer and the gateway's VerifierClient. Plus flag validation, the
launcher's pass-through, loopback defaults and the gateway's $SPECDEC_API_KEY.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.fake_verifier import FakeVerifier

from drafter_svc import server as drafter_server
from drafter_svc.server import start_drafter_server, stop_drafter_server
from gateway import VerifierClient
from gateway import __main__ as gateway_main
from specdec import launcher
from specdec.config import SpeculativeConfig
from specdec.errors import ConfigError, UnavailableError
from specdec.rpc.grpc_server import GrpcServer
from specdec.rpc.tls import GrpcTlsConfig, grpc_tls_from_args
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from verifier_svc import __main__ as verifier_main
from verifier_svc.drafting.drafter_pool import DrafterPool, DraftRequest

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")

K = 3
CONFIG = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": K,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3})
CONTEXT = [1, 2, 3, 4, 1, 2]   # ngram drafts [3, 4, 1]
EXPECTED_DRAFT = [3, 4, 1]
VERIFIER_SERVICE = specdec_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(directory: Path, name: str, ca: str, extensions: str) -> None:
    """name.key and name.pem (P-256), signed by ca.key/ca.pem with the given extensions."""
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
             cwd=directory)
    (directory / f"{name}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "1", "-sha256", "-extfile", f"{name}.ext",
             "-out", f"{name}.pem", cwd=directory)


def _make_ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj",
             f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign", cwd=directory)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, a server cert for 127.0.0.1/localhost, one for another name only, a client cert,
    and an unrelated CA."""
    directory = tmp_path_factory.mktemp("tls")
    _make_ca(directory, "ca")
    _make_ca(directory, "other-ca")
    _issue(directory, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                      "extendedKeyUsage=serverAuth\n")
    _issue(directory, "named", "ca", "subjectAltName=DNS:drafter.specdec.internal\n"
                                     "extendedKeyUsage=serverAuth\n")
    _issue(directory, "client", "ca", "extendedKeyUsage=clientAuth\n")
    (directory / "not-pem.txt").write_text("hello")
    return {name: str(directory / name) for name in (
        "ca.pem", "other-ca.pem", "server.pem", "server.key", "named.pem", "named.key",
        "client.pem", "client.key", "not-pem.txt")}


@pytest.fixture
async def serve_drafter(certs):
    servers = []

    async def start(**tls: str) -> int:
        server, port = await start_drafter_server(CONFIG, "127.0.0.1", 0,
                                                  tls=GrpcTlsConfig(**tls))
        servers.append(server)
        return port

    yield start
    for server in servers:
        await stop_drafter_server(server, grace_s=0)


@pytest.fixture
async def open_pool():
    pools: list[DrafterPool] = []

    async def start(port: int, tls: GrpcTlsConfig | None) -> DrafterPool:
        pool = DrafterPool([f"127.0.0.1:{port}"], vocab_size=100, tokenizer_fingerprint="",
                           backoff_initial_s=0.05, backoff_max_s=0.2, tls=tls)
        pools.append(pool)
        await pool.start()
        return pool

    yield start
    for pool in pools:
        await pool.close()


async def _drafts(pool: DrafterPool) -> dict[int, list[int]]:
    drafts = await pool.propose([DraftRequest(1, list(CONTEXT), 0, K)], [], timeout_s=2.0)
    return {seq_id: draft.token_ids for seq_id, draft in drafts.items()}


async def test_pool_with_the_ca_drafts_over_tls(certs, serve_drafter, open_pool):
    port = await serve_drafter(cert_file=certs["server.pem"], key_file=certs["server.key"])
    pool = await open_pool(port, GrpcTlsConfig(ca_file=certs["ca.pem"]))
    assert await pool.wait_for_healthy(1, timeout_s=5.0)
    assert await _drafts(pool) == {1: EXPECTED_DRAFT}


@pytest.mark.parametrize("client_tls", ["insecure", "other-ca"])
async def test_pool_that_cannot_verify_the_drafter_gets_no_drafts(certs, serve_drafter,
                                                                   open_pool, client_tls):
    port = await serve_drafter(cert_file=certs["server.pem"], key_file=certs["server.key"])
    tls = None if client_tls == "insecure" else GrpcTlsConfig(ca_file=certs["other-ca.pem"])
    pool = await open_pool(port, tls)
    assert not await pool.wait_for_healthy(1, timeout_s=1.0)
    assert await _drafts(pool) == {}  # and no exception


async def test_mutual_tls_refuses_a_client_without_a_certificate(certs, serve_drafter, open_pool):
    port = await serve_drafter(cert_file=certs["server.pem"], key_file=certs["server.key"],
                               ca_file=certs["ca.pem"])
    anonymous = await open_pool(port, GrpcTlsConfig(ca_file=certs["ca.pem"]))
    authenticated = await open_pool(port, GrpcTlsConfig(
        ca_file=certs["ca.pem"], client_cert_file=certs["client.pem"],
        client_key_file=certs["client.key"]))
    assert await authenticated.wait_for_healthy(1, timeout_s=5.0)
    assert await _drafts(authenticated) == {1: EXPECTED_DRAFT}
    assert not await anonymous.wait_for_healthy(1, timeout_s=0.5)
    assert await _drafts(anonymous) == {}


async def test_server_name_override_when_connecting_by_ip(certs, serve_drafter, open_pool):
    # The certificate names drafter.specdec.internal only, not 127.0.0.1.
    port = await serve_drafter(cert_file=certs["named.pem"], key_file=certs["named.key"])
    unnamed = await open_pool(port, GrpcTlsConfig(ca_file=certs["ca.pem"]))
    named = await open_pool(port, GrpcTlsConfig(ca_file=certs["ca.pem"],
                                                server_name="drafter.specdec.internal"))
    assert await named.wait_for_healthy(1, timeout_s=5.0)
    assert await _drafts(named) == {1: EXPECTED_DRAFT}
    assert not await unnamed.wait_for_healthy(1, timeout_s=0.5)


async def test_gateway_client_reaches_a_tls_verifier(certs):
    server = GrpcServer([VERIFIER_SERVICE])
    specdec_pb2_grpc.add_VerifierServicer_to_server(FakeVerifier([5, 6, 7], eos_token_id=2),
                                                    server.server)
    tls = GrpcTlsConfig(cert_file=certs["server.pem"], key_file=certs["server.key"],
                        ca_file=certs["ca.pem"])
    port = await server.start("127.0.0.1", 0, tls.server_credentials())
    address = f"127.0.0.1:{port}"
    secure = VerifierClient([address], tls=GrpcTlsConfig(
        ca_file=certs["ca.pem"], client_cert_file=certs["client.pem"],
        client_key_file=certs["client.key"]))
    insecure = VerifierClient([address], probe_timeout_s=0.5)
    try:
        await secure.start()
        assert (await secure.get_info()).max_model_len > 0
        stream = await secure.generate(specdec_pb2.GenerateRequest(
            request_id="r1", prompt_token_ids=[1, 2],
            sampling=specdec_pb2.SamplingParams(max_tokens=16)))
        token_ids = [token_id async for response in stream for token_id in response.token_ids]
        assert token_ids == [5, 6, 7, 2]

        await insecure.start()
        with pytest.raises(UnavailableError):
            await insecure.get_info()
    finally:
        await secure.close()
        await insecure.close()
        await server.stop(0)


@pytest.mark.parametrize("fields, param", [
    ({"cert_file": "/missing.pem", "key_file": "server.key"}, "grpc_tls_cert"),
    ({"cert_file": "server.pem", "key_file": "/missing.key"}, "grpc_tls_key"),
    ({"cert_file": "server.pem", "key_file": "not-pem.txt"}, "grpc_tls_key"),
    ({"ca_file": "/missing-ca.pem"}, "grpc_tls_ca"),
    ({"ca_file": "ca.pem", "client_cert_file": "/missing.pem",
      "client_key_file": "client.key"}, "grpc_tls_client_cert"),
    ({"ca_file": "ca.pem", "client_cert_file": "client.pem",
      "client_key_file": "/missing.key"}, "grpc_tls_client_key"),
    ({"cert_file": "server.pem", "key_file": "client.key"}, "grpc_tls_key"),
    ({"cert_file": "ca.pem", "key_file": "server.key"}, "grpc_tls_key"),
    ({"ca_file": "ca.pem", "client_cert_file": "client.pem",
      "client_key_file": "server.key"}, "grpc_tls_client_key"),
    ({"ca_file": "server.key"}, "grpc_tls_ca"),
    ({"cert_file": "server.pem"}, "grpc_tls_key"),
    ({"key_file": "server.key"}, "grpc_tls_cert"),
    ({"ca_file": "ca.pem", "client_cert_file": "client.pem"}, "grpc_tls_client_key"),
    ({"client_cert_file": "client.pem", "client_key_file": "client.key"},
     "grpc_tls_client_cert"),
    ({"server_name": "localhost"}, "grpc_tls_server_name"),
])
def test_bad_configuration_names_the_flag(certs, fields, param):
    fields = {name: certs.get(value, value) for name, value in fields.items()}
    with pytest.raises(ConfigError) as caught:
        GrpcTlsConfig(**fields)
    assert caught.value.param == param
    assert "--" + param.replace("_", "-") in caught.value.message


def test_service_clis_reject_bad_tls_flags(certs, capsys, caplog):
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert drafter_server.main(["--speculative-config", spec, "--port", "0",
                                "--grpc-tls-cert", "/missing.pem",
                                "--grpc-tls-key", certs["server.key"]]) == 2
    assert "--grpc-tls-cert '/missing.pem': no such file" in caplog.text
    # A server-only service given a CA but no certificate would verify nothing.
    assert drafter_server.main(["--speculative-config", spec,
                                "--grpc-tls-ca", certs["ca.pem"]]) == 2
    assert "--grpc-tls-ca on a server needs --grpc-tls-cert" in caplog.text
    assert gateway_main.main(["--model", "unused", "--verifier", "127.0.0.1:1",
                              "--grpc-tls-ca", "/missing-ca.pem"]) == 2
    assert "--grpc-tls-ca '/missing-ca.pem': no such file" in capsys.readouterr().err
    args = verifier_main.build_parser().parse_args(["--grpc-tls-client-key", certs["client.key"],
                                                    "--grpc-tls-ca", certs["ca.pem"]])
    with pytest.raises(ConfigError, match="--grpc-tls-client-key needs --grpc-tls-client-cert"):
        grpc_tls_from_args(args)
    assert grpc_tls_from_args(verifier_main.build_parser().parse_args([])) is None


def test_launcher_passes_each_child_the_flags_of_its_sides(certs):
    parser = argparse.ArgumentParser()
    launcher.add_serve_args(parser)
    tls_flags = {"--grpc-tls-cert": certs["server.pem"], "--grpc-tls-key": certs["server.key"],
                 "--grpc-tls-ca": certs["ca.pem"], "--grpc-tls-client-cert": certs["client.pem"],
                 "--grpc-tls-client-key": certs["client.key"],
                 "--grpc-tls-server-name": "localhost"}
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = parser.parse_args(["--speculative-config", spec,
                              *(item for pair in tls_flags.items() for item in pair)])
    commands = dict(launcher._child_commands(args, "/models/tiny"))

    def tls_flags_of(command: list[str]) -> dict[str, str]:
        return {flag: command[index + 1] for index, flag in enumerate(command)
                if flag.startswith("--grpc-tls-")}

    server_side = ("--grpc-tls-cert", "--grpc-tls-key", "--grpc-tls-ca")
    client_side = ("--grpc-tls-ca", "--grpc-tls-client-cert", "--grpc-tls-client-key",
                   "--grpc-tls-server-name")
    assert tls_flags_of(commands["verifier"]) == tls_flags
    assert tls_flags_of(commands["drafter"]) == {flag: tls_flags[flag] for flag in server_side}
    assert tls_flags_of(commands["gateway"]) == {flag: tls_flags[flag] for flag in client_side}
    # Without TLS flags, no child gets any.
    plain = dict(launcher._child_commands(parser.parse_args([]), "/models/tiny"))
    assert not any(tls_flags_of(command) for command in plain.values())


def test_every_service_binds_loopback_unless_told_and_compose_tells_them():
    defaults = {
        "gateway": gateway_main.build_parser().parse_args(["--model", "m", "--verifier", "v:1"]),
        "verifier": verifier_main.build_parser().parse_args([]),
        "drafter": drafter_server.build_arg_parser().parse_args(["--speculative-config", "{}"]),
    }
    assert {name: args.host for name, args in defaults.items()} == dict.fromkeys(defaults,
                                                                                  "127.0.0.1")
    compose = (Path(__file__).parents[2] / "docker-compose.yml").read_text()
    for module in ("drafter_svc", "verifier_svc", "gateway"):
        assert f"python3 -m {module} --host 0.0.0.0" in compose


def test_gateway_api_key_comes_from_the_environment(monkeypatch):
    # More sources (--api-key-file, $VLLM_API_KEY) in tests/stack/test_internal_auth.py.
    monkeypatch.setenv("SPECDEC_API_KEY", "from-env")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    required = ["--model", "m", "--verifier", "127.0.0.1:1"]

    def api_key(*argv: str) -> str | None:
        return gateway_main.api_key_from_args(gateway_main.build_parser().parse_args(argv))

    assert api_key(*required) == "from-env"
    assert api_key(*required, "--api-key", "flag") == "flag"
    monkeypatch.delenv("SPECDEC_API_KEY")
    assert api_key(*required) is None
