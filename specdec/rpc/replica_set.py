"""The replicas behind configured host:port names: one per address each name resolves to.

A name with several addresses (a Kubernetes headless Service, a swarm service with
`endpoint_mode: dnsrr` and replicas, `docker compose --scale`) is several servers: one grpc
channel to the name would use one of them at a time, so a client dials each resolved IP on
its own and re-resolves every `resolve_interval_s`. The gateway's client of the verifiers
(gateway.verifier_client) and the verifier's client of the drafters
(verifier_svc.drafting.drafter_pool) are both a `ReplicaSet`; what a replica is, and how its
health is judged (specdec.rpc.replica_health), is theirs.

An IP literal, `localhost` or a target that is not host:port (a grpc URI such as `unix:` or
`dns:///`) is dialled as given. An address gone from DNS is handed back to its owner to
retire; a failed (or empty) lookup keeps the replicas there are, and a name that does not
resolve at start is dialled as given (grpc's own resolver keeps trying) until it does.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from specdec.rpc.address import format_address, split_host_port
from specdec.rpc.tls import GrpcTlsConfig

logger = logging.getLogger(__name__)

R = TypeVar("R")
# host, port -> the IPs the host resolves to now; raises OSError when it cannot tell.
# Called in a worker thread (it may block on DNS).
Resolver = Callable[[str, int], Sequence[str]]
# Extra channel options of one replica's channel (on top of the owner's own).
ChannelOptions = list[tuple[str, str]]


def resolve_ips(host: str, port: int) -> list[str]:
    """The IPv4/IPv6 addresses of host, in the resolver's order, without duplicates."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    # An IPv4/IPv6 sockaddr starts with the address text (the isinstance tells the type checker).
    ips = [info[4][0] for info in infos
           if info[0] in (socket.AF_INET, socket.AF_INET6) and isinstance(info[4][0], str)]
    return list(dict.fromkeys(ips))


@dataclass(slots=True)
class ReplicaTarget:
    """One configured address and, by dialled address, the slot of each replica it has
    now: the slot keeps a replica's name ("<kind>-<index>.<slot>") stable while other
    addresses of the same name come and go."""

    index: int
    address: str
    host: str | None  # None: dialled as given, never resolved
    port: int
    slots: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, index: int, address: str) -> ReplicaTarget:
        parsed = split_host_port(address)
        # A grpc URI ("dns:///name:port", "ipv4:...") names its own resolver.
        if parsed is None or "/" in parsed[0] or _is_literal(parsed[0]):
            return cls(index, address, None, 0)
        return cls(index, address, *parsed)

    @property
    def resolvable(self) -> bool:
        return self.host is not None

    async def wanted(self, resolver: Resolver, current: list[str], kind: str) -> list[str]:
        """The addresses to have replicas for now; `current`: those there are."""
        if self.host is None:
            return [self.address]
        try:
            ips = list(await asyncio.to_thread(resolver, self.host, self.port))
        except OSError as exc:
            ips, reason = [], str(exc)
        else:
            reason = "no address"
        if ips:
            return [format_address(ip, self.port) for ip in ips]
        logger.warning("cannot resolve %s %s (%s); keeping %s", kind, self.address, reason,
                       ", ".join(current) or "the name as given")
        return current or [self.address]

    def channel_options(self, address: str, tls: GrpcTlsConfig | None) -> ChannelOptions:
        """Dialled by IP over TLS: the server certificate is checked against the name it
        was reached by (--grpc-tls-server-name, when given, decides instead)."""
        if (address == self.address or self.host is None or tls is None
                or not tls.client_enabled or tls.server_name is not None):
            return []
        return [("grpc.ssl_target_name_override", self.host)]

    def add(self, address: str) -> None:
        """Gives a new replica the smallest slot free."""
        used = set(self.slots.values())
        self.slots[address] = next(slot for slot in range(len(used) + 1) if slot not in used)

    def name(self, kind: str, address: str) -> str:
        """"<kind>-<index>" while the target has one replica (as for a single-address name
        or an IP literal), else "<kind>-<index>.<slot>"."""
        if len(self.slots) <= 1:
            return f"{kind}-{self.index}"
        return f"{kind}-{self.index}.{self.slots[address]}"


@dataclass(slots=True, eq=False)
class _Member(Generic[R]):
    target: ReplicaTarget
    address: str
    replica: R


class ReplicaSet(Generic[R]):
    """The replicas of `addresses`, kept in step with DNS. The owner makes a replica of an
    address (`open_replica(address, extra channel options)`), retires one gone from DNS
    (`retire_replica`) and closes the members itself once `close()` has stopped the
    re-resolution. `kind` names the replicas ("verifier-0.1") and the log lines."""

    def __init__(self, kind: str, addresses: Sequence[str], *,
                 open_replica: Callable[[str, ChannelOptions], R],
                 retire_replica: Callable[[R], Awaitable[None]],
                 tls: GrpcTlsConfig | None = None, resolver: Resolver = resolve_ips,
                 resolve_interval_s: float = 10.0) -> None:
        self.kind = kind
        self.targets = [ReplicaTarget.parse(index, address)
                        for index, address in enumerate(addresses)]
        self._open_replica = open_replica
        self._retire_replica = retire_replica
        self._tls = tls
        self._resolver = resolver
        self._resolve_interval_s = resolve_interval_s
        self._members: list[_Member[R]] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def replicas(self) -> list[R]:
        """Every replica, by target and slot."""
        return [member.replica for member in self._members]

    def named(self) -> list[tuple[str, R]]:
        """Every replica with its name, by target and slot."""
        return [(member.target.name(self.kind, member.address), member.replica)
                for member in self._members]

    async def start(self, on_added: Callable[[list[R]], Awaitable[None]] | None = None) -> None:
        """Resolves every target once, then (where one is a name) every resolve_interval_s,
        telling `on_added` of the replicas each later round added."""
        await self.resolve()
        if any(target.resolvable for target in self.targets):
            self._task = asyncio.create_task(self._resolve_periodically(on_added))

    async def close(self) -> None:
        """Stops re-resolving; the members stay the owner's to close."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _resolve_periodically(self, on_added: Callable[[list[R]], Awaitable[None]] | None,
                                    ) -> None:
        while True:
            await asyncio.sleep(self._resolve_interval_s)
            try:
                added = await self.resolve()
                if on_added is not None and added:
                    await on_added(added)
            except Exception:  # a bug here must not end the re-resolution for good
                logger.exception("resolving the %s addresses failed", self.kind)

    async def resolve(self) -> list[R]:
        """Reconciles the replicas with what each target resolves to now; returns those
        added."""
        added: list[R] = []
        for target in self.targets:
            current = [m for m in self._members if m.target is target]
            wanted = await target.wanted(self._resolver, [m.address for m in current],
                                         self.kind)
            for member in current:
                if member.address not in wanted:
                    await self._retire(member)
            have = {member.address for member in current}
            added += [self._open(target, address) for address in wanted if address not in have]
        self._members.sort(key=lambda m: (m.target.index, m.target.slots[m.address]))
        return added

    def _open(self, target: ReplicaTarget, address: str) -> R:
        replica = self._open_replica(address, target.channel_options(address, self._tls))
        target.add(address)
        self._members.append(_Member(target, address, replica))
        if address != target.address:
            logger.info("%s %s: adding replica %s", self.kind, target.address, address)
        return replica

    async def _retire(self, member: _Member[R]) -> None:
        logger.info("%s %s: %s is no longer one of its addresses", self.kind,
                    member.target.address, member.address)
        self._members.remove(member)
        del member.target.slots[member.address]
        await self._retire_replica(member.replica)


def _is_literal(host: str) -> bool:
    """An IP literal or localhost: one replica, dialled as given (localhost may resolve to
    ::1 too, where a server bound to 127.0.0.1 does not listen)."""
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
