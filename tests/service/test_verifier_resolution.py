"""One `--verifier` name behind which several replicas answer (a Kubernetes headless
Service, a swarm dnsrr service): the gateway's VerifierClient dials every address the
name resolves to, follows DNS as replicas come and go, and keeps what it has while a
lookup fails. Two real fake verifiers listen on 127.0.0.1 and 127.0.0.2 at the same port;
the resolver is injected so the test decides what the name resolves to."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from tests.support.fake_verifier import FakeVerifier, FakeVerifierServer, free_port

from gateway import VerifierClient
from specdec.rpc.replica_set import ReplicaTarget
from specdec.v1 import specdec_pb2

NAME = "verifiers.test"
IPS = ("127.0.0.1", "127.0.0.2")


class AliasVerifierServer(FakeVerifierServer):
    """A FakeVerifierServer bound to another loopback address."""

    def __init__(self, servicer: FakeVerifier, host: str, port: int) -> None:
        super().__init__(servicer, port)
        self.host = host

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class FakeDns:
    """What NAME resolves to now (None: the lookup fails); counts lookups."""

    def __init__(self, ips: list[str] | None) -> None:
        self.ips = ips
        self.lookups: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, host: str, port: int) -> list[str]:
        with self._lock:
            self.lookups.append(host)
            if self.ips is None:
                raise OSError(-2, "Name or service not known")
            return list(self.ips)


@pytest.fixture
def servers() -> Iterator[list[AliasVerifierServer]]:
    port = free_port()
    started = [AliasVerifierServer(FakeVerifier([5, 6, 7], 2), ip, port) for ip in IPS]
    for server in started:
        server.start()
    yield started
    for server in started:
        server.close()


async def generate(client: VerifierClient, request_id: str, prefer: str | None = None) -> str:
    """Runs one request to its end; the address of the verifier that served it."""
    request = specdec_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3])
    request.sampling.max_tokens = 4
    stream = await client.generate(request, prefer=prefer)
    tokens = [token async for response in stream for token in response.token_ids]
    assert tokens == [5, 6, 7, 2]
    return stream.address


async def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def served_by(servers: list[AliasVerifierServer]) -> list[int]:
    return [len(server.servicer.requests) for server in servers]


async def test_requests_spread_over_every_address_of_the_name(servers):
    port = servers[0].port
    dns = FakeDns(list(IPS))
    client = VerifierClient([f"{NAME}:{port}"], resolver=dns, reprobe_interval_s=3600)
    await client.start()
    try:
        assert dns.lookups and set(dns.lookups) == {NAME}
        assert client.statuses() == {"verifier-0.0": "serving", "verifier-0.1": "serving"}
        addresses = [await generate(client, f"r{i}") for i in range(4)]
        assert sorted(addresses) == sorted([f"{ip}:{port}" for ip in IPS] * 2)
        assert served_by(servers) == [2, 2]
        # n>1 choices follow their first one by the address the stream reports.
        second = f"{IPS[1]}:{port}"
        assert [await generate(client, f"p{i}", prefer=second) for i in range(2)] == [second] * 2
        assert served_by(servers) == [2, 4]
    finally:
        await client.close()


async def test_an_address_gone_from_dns_is_closed_and_the_other_serves(servers):
    port = servers[0].port
    dns = FakeDns(list(IPS))
    client = VerifierClient([f"{NAME}:{port}"], resolver=dns, reprobe_interval_s=3600,
                            resolve_interval_s=0.05)
    await client.start()
    try:
        gone = next(e for e in client._endpoints if e.address == f"{IPS[1]}:{port}")
        dns.ips = [IPS[0]]
        # Back to a single endpoint: its name is the plain one again.
        await wait_for(lambda: client.statuses() == {"verifier-0": "serving"})
        await wait_for(lambda: gone.channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN)
        before = served_by(servers)
        addresses = {await generate(client, f"r{i}") for i in range(4)}
        assert addresses == {f"{IPS[0]}:{port}"}
        assert served_by(servers) == [before[0] + 4, before[1]]
        # The replica comes back: it is probed and used again.
        dns.ips = list(IPS)
        await wait_for(lambda: client.statuses() == {"verifier-0.0": "serving",
                                                     "verifier-0.1": "serving"})
        assert {await generate(client, f"b{i}") for i in range(2)} == {
            f"{ip}:{port}" for ip in IPS}
    finally:
        await client.close()


async def test_a_stream_open_on_an_address_gone_from_dns_runs_to_its_end(servers):
    port = servers[0].port
    for server in servers:
        server.servicer.delay_s = 0.05
    dns = FakeDns([IPS[1]])
    client = VerifierClient([f"{NAME}:{port}"], resolver=dns, reprobe_interval_s=3600,
                            resolve_interval_s=0.05)
    await client.start()
    try:
        request = specdec_pb2.GenerateRequest(request_id="long", prompt_token_ids=[1])
        request.sampling.max_tokens = 40
        request.sampling.ignore_eos = True
        stream = await client.generate(request)
        assert stream.address == f"{IPS[1]}:{port}"
        dns.ips = [IPS[0]]
        await wait_for(lambda: [e.address for e in client._endpoints] == [f"{IPS[0]}:{port}"])
        tokens = [token async for response in stream for token in response.token_ids]
        assert len(tokens) == 40
    finally:
        await client.close()


async def test_a_failed_lookup_keeps_the_endpoints(servers):
    port = servers[0].port
    dns = FakeDns(list(IPS))
    client = VerifierClient([f"{NAME}:{port}"], resolver=dns, reprobe_interval_s=3600,
                            resolve_interval_s=0.05)
    await client.start()
    try:
        dns.ips = None
        failed_from = len(dns.lookups)
        await wait_for(lambda: len(dns.lookups) >= failed_from + 3)
        assert client.statuses() == {"verifier-0.0": "serving", "verifier-0.1": "serving"}
        assert {await generate(client, f"r{i}") for i in range(2)} == {
            f"{ip}:{port}" for ip in IPS}
        # An empty answer is no answer either.
        dns.ips = []
        failed_from = len(dns.lookups)
        await wait_for(lambda: len(dns.lookups) >= failed_from + 3)
        assert len(client.statuses()) == 2
    finally:
        await client.close()


async def test_a_name_not_resolvable_at_start_is_dialled_as_given_until_it_resolves(servers):
    port = servers[0].port
    dns = FakeDns(None)
    client = VerifierClient([f"{NAME}:{port}"], resolver=dns, reprobe_interval_s=3600,
                            resolve_interval_s=0.05)
    await client.start()
    try:
        assert [e.address for e in client._endpoints] == [f"{NAME}:{port}"]
        assert list(client.statuses()) == ["verifier-0"]
        dns.ips = list(IPS)
        await wait_for(lambda: client.statuses() == {"verifier-0.0": "serving",
                                                     "verifier-0.1": "serving"})
        assert sorted(e.address for e in client._endpoints) == [f"{ip}:{port}" for ip in IPS]
    finally:
        await client.close()


async def test_ip_literals_and_localhost_are_not_resolved(servers):
    port = servers[0].port
    dns = FakeDns(None)
    client = VerifierClient([f"{IPS[0]}:{port}", f"{IPS[1]}:{port}", f"localhost:{port}"],
                            resolver=dns, reprobe_interval_s=3600, resolve_interval_s=0.05)
    await client.start()
    try:
        assert client.statuses() == {"verifier-0": "serving", "verifier-1": "serving",
                                     "verifier-2": "serving"}
        assert [e.address for e in client._endpoints] == list(client.addresses)
        await asyncio.sleep(0.2)
        assert dns.lookups == []
    finally:
        await client.close()


def test_tls_channels_to_a_resolved_ip_check_the_name(monkeypatch):
    """Dialled by IP, the server certificate is still checked against the name (unless
    --grpc-tls-server-name says otherwise)."""
    import gateway.verifier_client as module

    opened: list[tuple[str, list]] = []

    def fake_open_channel(tls, address, options, internal_token=None):
        opened.append((address, list(options)))
        return grpc.aio.insecure_channel(address)

    class FakeTls:
        client_enabled = True
        server_name: str | None = None

    monkeypatch.setattr(module, "open_channel", fake_open_channel)

    async def run() -> None:
        client = VerifierClient([f"{NAME}:50051", "10.0.0.9:50051"], tls=FakeTls(),
                                resolver=FakeDns(["10.1.0.1", "fd00::2"]),
                                probe_timeout_s=0.01)
        await client.start()
        await client.close()

    asyncio.run(run())
    overrides = {address: dict(options).get("grpc.ssl_target_name_override")
                 for address, options in opened}
    assert overrides == {"10.1.0.1:50051": NAME, "[fd00::2]:50051": NAME,
                         "10.0.0.9:50051": None}


@pytest.mark.parametrize("address,host", [
    ("verifier.svc:50051", "verifier.svc"), ("10.0.0.1:50051", None), ("[fd00::1]:50051", None),
    ("localhost:50051", None), ("dns:///verifier.svc:50051", None), ("unix:/tmp/v.sock", None),
])
def test_which_targets_are_resolved(address, host):
    assert ReplicaTarget.parse(0, address).host == host
