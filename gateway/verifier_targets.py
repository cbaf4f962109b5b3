"""What one `--verifier host:port` stands for: the addresses its name resolves to now.

A name with several addresses (a Kubernetes headless Service, a swarm service with
`endpoint_mode: dnsrr` and replicas) is several verifiers: one grpc channel to the name
would use one of them at a time, so the gateway dials each resolved IP on its own and
re-resolves periodically (gateway.verifier_client). An IP literal, `localhost` or a target
that is not host:port (a grpc URI such as `unix:` or `dns:///`) is dialled as given.

An address gone from DNS gets no new requests and its channel closes once its streams have
ended; a failed (or empty) lookup keeps the endpoints there are, and a name that does not
resolve at start is dialled as given (grpc's own resolver keeps trying) until it does.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from specdec.rpc.address import format_address, split_host_port
from specdec.rpc.tls import GrpcTlsConfig
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

logger = logging.getLogger(__name__)

# host, port -> the IPs the host resolves to now; raises OSError when it cannot tell.
# Called in a worker thread (it may block on DNS).
Resolver = Callable[[str, int], Sequence[str]]


def resolve_ips(host: str, port: int) -> list[str]:
    """The IPv4/IPv6 addresses of host, in the resolver's order, without duplicates."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    # An IPv4/IPv6 sockaddr starts with the address text (the isinstance tells the type checker).
    ips = [info[4][0] for info in infos
           if info[0] in (socket.AF_INET, socket.AF_INET6) and isinstance(info[4][0], str)]
    return list(dict.fromkeys(ips))


@dataclass(slots=True, eq=False)
class VerifierEndpoint:
    """One verifier the gateway dials (gateway.verifier_client) and its last probed state."""

    address: str  # dialled: an IP the --verifier name resolved to, or the target as given
    channel: grpc.aio.Channel
    stub: specdec_pb2_grpc.VerifierStub
    # Which --verifier (by position) this endpoint is one address of.
    target: int = 0
    # What /health shows instead of the address: "verifier-<index>[.<slot>]".
    name: str = ""
    info: specdec_pb2.VerifierInfo | None = None
    healthy: bool = False
    # When the verifier last showed it works (a probe answered, a Generate response read),
    # on the monotonic clock: probes that time out mark it down only after a long silence.
    last_alive_s: float = 0.0
    # Held while a probe of this verifier is in flight: one at a time, however many ask.
    probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # What /health reports: serving | not_serving (draining, shutting down) |
    # unreachable (down, or still loading its model) | tokenizer_mismatch (never used).
    status: str = "unreachable"
    # The foreign fingerprint already logged: a mismatch is logged once, not every probe.
    mismatch_logged: str | None = None


@dataclass(slots=True)
class VerifierTarget:
    """One configured `--verifier` and, by dialled address, the slot of each endpoint it
    has now: the slot makes the /health name ("verifier-<index>.<slot>") stable while
    other addresses of the same name come and go."""

    index: int
    address: str
    host: str | None  # None: dialled as given, never resolved
    port: int
    slots: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, index: int, address: str) -> VerifierTarget:
        parsed = split_host_port(address)
        # A grpc URI ("dns:///name:port", "ipv4:...") names its own resolver.
        if parsed is None or "/" in parsed[0] or _is_literal(parsed[0]):
            return cls(index, address, None, 0)
        return cls(index, address, *parsed)

    @property
    def resolvable(self) -> bool:
        return self.host is not None

    def addresses_for(self, ips: Sequence[str]) -> list[str]:
        return [format_address(ip, self.port) for ip in ips]

    async def wanted(self, resolver: Resolver, current: list[str]) -> list[str]:
        """The addresses to have endpoints for now; `current`: those there are."""
        if self.host is None:
            return [self.address]
        try:
            ips = list(await asyncio.to_thread(resolver, self.host, self.port))
        except OSError as exc:
            ips, reason = [], str(exc)
        else:
            reason = "no address"
        if ips:
            return self.addresses_for(ips)
        logger.warning("cannot resolve verifier %s (%s); keeping %s", self.address, reason,
                       ", ".join(current) or "the name as given")
        return current or [self.address]

    def channel_options(self, address: str, tls: GrpcTlsConfig | None) -> list[tuple[str, str]]:
        """Dialled by IP over TLS: the server certificate is checked against the name it
        was reached by (--grpc-tls-server-name, when given, decides instead)."""
        if (address == self.address or self.host is None or tls is None
                or not tls.client_enabled or tls.server_name is not None):
            return []
        return [("grpc.ssl_target_name_override", self.host)]

    def add(self, address: str) -> None:
        """Gives a new endpoint the smallest slot free."""
        used = set(self.slots.values())
        self.slots[address] = next(slot for slot in range(len(used) + 1) if slot not in used)

    def name(self, address: str) -> str:
        """What /health shows: "verifier-<index>" while the target has one endpoint (as
        for a single-address name or an IP literal), else "verifier-<index>.<slot>"."""
        if len(self.slots) <= 1:
            return f"verifier-{self.index}"
        return f"verifier-{self.index}.{self.slots[address]}"


def _is_literal(host: str) -> bool:
    """An IP literal or localhost: one endpoint, dialled as given (localhost may resolve to
    ::1 too, where a server bound to 127.0.0.1 does not listen)."""
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
