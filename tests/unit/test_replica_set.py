"""The replica-set client both the gateway (verifiers) and the verifier (drafters) use:
one replica per address a name resolves to, kept in step with DNS (specdec.rpc.replica_set);
health judged on evidence and the model check (specdec.rpc.replica_health). No socket: the
resolver is a fake and a replica is a plain record."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import cast

import pytest

from specdec.rpc import replica_health
from specdec.rpc.replica_health import (
    NOT_SERVING,
    SERVING,
    UNREACHABLE,
    ReplicaHealth,
    model_mismatch,
)
from specdec.rpc.replica_set import ReplicaSet, ReplicaTarget
from specdec.rpc.tls import GrpcTlsConfig
from specdec.v1 import specdec_pb2

NAME = "drafters.test"


class FakeDns:
    """What NAME resolves to now (None: the lookup fails)."""

    def __init__(self, ips: list[str] | None) -> None:
        self.ips = ips
        self.lookups: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def __call__(self, host: str, port: int) -> list[str]:
        with self._lock:
            self.lookups.append((host, port))
            if self.ips is None:
                raise OSError(-2, "Name or service not known")
            return list(self.ips)


@dataclass(eq=False)
class FakeReplica:
    address: str
    channel_options: list[tuple[str, str]]
    retired: bool = False


@dataclass
class Owner:
    """Opens and retires FakeReplicas as a ReplicaSet asks."""

    opened: list[FakeReplica] = field(default_factory=list)
    retired: list[FakeReplica] = field(default_factory=list)

    def open(self, address: str, options: list[tuple[str, str]]) -> FakeReplica:
        replica = FakeReplica(address, options)
        self.opened.append(replica)
        return replica

    async def retire(self, replica: FakeReplica) -> None:
        replica.retired = True
        self.retired.append(replica)

    def replica_set(self, addresses: list[str], dns: FakeDns,
                    tls: GrpcTlsConfig | None = None) -> ReplicaSet[FakeReplica]:
        return ReplicaSet("drafter", addresses, open_replica=self.open,
                          retire_replica=self.retire, tls=tls, resolver=dns)


def names(replicas: ReplicaSet[FakeReplica]) -> dict[str, str]:
    return {name: replica.address for name, replica in replicas.named()}


async def test_a_name_is_one_replica_per_address_and_follows_dns() -> None:
    owner, dns = Owner(), FakeDns(["10.0.0.1", "10.0.0.2"])
    replicas = owner.replica_set([f"{NAME}:7"], dns)
    assert await replicas.resolve() == owner.opened
    assert names(replicas) == {"drafter-0.0": "10.0.0.1:7", "drafter-0.1": "10.0.0.2:7"}
    assert dns.lookups == [(NAME, 7)]

    dns.ips = ["10.0.0.2", "10.0.0.3"]  # one replica leaves, another joins
    added = await replicas.resolve()
    assert [replica.address for replica in added] == ["10.0.0.3:7"]
    assert [replica.address for replica in owner.retired] == ["10.0.0.1:7"]
    # The replica that stayed keeps its name; the new one takes the slot freed.
    assert names(replicas) == {"drafter-0.0": "10.0.0.3:7", "drafter-0.1": "10.0.0.2:7"}

    dns.ips = ["10.0.0.2"]  # back to one: its name is the plain one again
    await replicas.resolve()
    assert names(replicas) == {"drafter-0": "10.0.0.2:7"}
    assert await replicas.resolve() == []  # nothing changed: nothing opened
    assert len(owner.opened) == 3


@pytest.mark.parametrize("answer", [None, []])
async def test_a_failed_or_empty_lookup_keeps_the_replicas(answer: list[str] | None) -> None:
    owner, dns = Owner(), FakeDns(["10.0.0.1", "10.0.0.2"])
    replicas = owner.replica_set([f"{NAME}:7"], dns)
    await replicas.resolve()
    dns.ips = answer
    assert await replicas.resolve() == []
    assert len(replicas.replicas) == 2 and owner.retired == []


async def test_a_name_not_resolvable_yet_is_dialled_as_given_until_it_resolves() -> None:
    owner, dns = Owner(), FakeDns(None)
    replicas = owner.replica_set([f"{NAME}:7"], dns)
    await replicas.resolve()
    assert names(replicas) == {"drafter-0": f"{NAME}:7"}
    dns.ips = ["10.0.0.1"]
    await replicas.resolve()
    assert names(replicas) == {"drafter-0": "10.0.0.1:7"}
    assert [replica.address for replica in owner.retired] == [f"{NAME}:7"]


async def test_literals_localhost_and_uris_are_dialled_as_given_and_never_resolved() -> None:
    owner, dns = Owner(), FakeDns(None)
    targets = ["127.0.0.1:5", "[::1]:6", "localhost:7", "dns:///drafter:8"]
    replicas = owner.replica_set(targets, dns)
    await replicas.start()
    try:
        assert names(replicas) == {f"drafter-{index}": target
                                   for index, target in enumerate(targets)}
        assert dns.lookups == []
    finally:
        await replicas.close()


async def test_the_set_re_resolves_periodically_and_reports_what_it_added() -> None:
    owner, dns = Owner(), FakeDns(["10.0.0.1"])
    replicas = ReplicaSet("verifier", [f"{NAME}:7"], open_replica=owner.open,
                          retire_replica=owner.retire, resolver=dns, resolve_interval_s=0.01)
    reported: list[FakeReplica] = []
    added = asyncio.Event()

    async def on_added(new: list[FakeReplica]) -> None:
        reported.extend(new)
        added.set()

    await replicas.start(on_added)
    try:
        dns.ips = ["10.0.0.1", "10.0.0.2"]
        await asyncio.wait_for(added.wait(), timeout=30)
        assert [replica.address for replica in reported] == ["10.0.0.2:7"]
        assert list(dict(replicas.named())) == ["verifier-0.0", "verifier-0.1"]
    finally:
        await replicas.close()


@dataclass(frozen=True)
class ClientTls:
    """What a replica target reads of a GrpcTlsConfig (whose files must exist)."""

    client_enabled: bool = True
    server_name: str | None = None


def test_over_tls_an_ip_reached_by_name_checks_the_name() -> None:
    target = ReplicaTarget.parse(0, f"{NAME}:7")
    tls = cast(GrpcTlsConfig, ClientTls())
    assert target.channel_options("10.0.0.1:7", tls) == [("grpc.ssl_target_name_override", NAME)]
    assert target.channel_options("10.0.0.1:7", None) == []
    assert target.channel_options(f"{NAME}:7", tls) == []  # dialled by the name itself
    named = cast(GrpcTlsConfig, ClientTls(server_name="other"))
    assert target.channel_options("10.0.0.1:7", named) == []  # --grpc-tls-server-name decides


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_a_replica_goes_down_on_evidence_and_comes_back(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(replica_health.time, "monotonic", clock)
    health = ReplicaHealth()
    assert (health.healthy, health.status) == (False, UNREACHABLE)
    assert health.up() and (health.healthy, health.status) == (True, SERVING)
    assert not health.up()  # already up: nothing to announce

    # Timeouts behind a busy peer are no evidence while it answered lately...
    clock.now_s += 29.0
    assert not health.timeout_is_evidence(silent_down_s=30.0)
    health.alive()  # a response read on some call
    clock.now_s += 29.0
    assert not health.timeout_is_evidence(silent_down_s=30.0)
    # ...a silence as long as silent_down_s is.
    clock.now_s += 1.0
    assert health.timeout_is_evidence(silent_down_s=30.0)

    assert health.down(NOT_SERVING) and (health.healthy, health.status) == (False, NOT_SERVING)
    assert not health.down()  # already down
    assert health.timeout_is_evidence(silent_down_s=30.0)  # a down peer stays down
    assert health.up() and health.healthy and health.last_alive_s == clock.now_s


async def test_concurrent_probes_of_one_replica_share_one() -> None:
    health = ReplicaHealth()
    release = asyncio.Event()
    calls = 0

    async def probe_now() -> bool:
        nonlocal calls
        calls += 1
        await release.wait()
        return health.up()

    probes = [asyncio.ensure_future(health.probe(probe_now)) for _ in range(5)]
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(*probes) == [True] * 5
    assert calls == 1


def test_a_refusal_is_new_once_per_reason() -> None:
    health = ReplicaHealth()
    assert health.refusal_is_new("a") and not health.refusal_is_new("a")
    assert health.refusal_is_new("b") and health.refusal_is_new("a")


def test_another_model_is_a_mismatch_naming_both_values() -> None:
    info = specdec_pb2.DrafterInfo(vocab_size=80, tokenizer_fingerprint="theirs")
    assert model_mismatch(info, vocab_size=100, tokenizer_fingerprint="ours", ours="verifier") == [
        "its vocab_size is 80, the verifier's is 100",
        "its tokenizer fingerprint is 'theirs', the verifier's is 'ours'"]
    verifier = specdec_pb2.VerifierInfo(vocab_size=80, tokenizer_fingerprint="theirs")
    assert model_mismatch(verifier, vocab_size=None, tokenizer_fingerprint="ours",
                          ours="gateway") == [
        "its tokenizer fingerprint is 'theirs', the gateway's is 'ours'"]


@pytest.mark.parametrize(("vocab_size", "fingerprint"), [(80, "ours"), (0, ""), (0, "ours")])
def test_the_same_model_or_an_unreported_value_is_no_mismatch(vocab_size: int,
                                                             fingerprint: str) -> None:
    info = specdec_pb2.DrafterInfo(vocab_size=vocab_size, tokenizer_fingerprint=fingerprint)
    assert model_mismatch(info, vocab_size=80, tokenizer_fingerprint="ours", ours="verifier") == []
    assert model_mismatch(info, vocab_size=None, tokenizer_fingerprint=None, ours="gateway") == []
