"""host:port addresses of gRPC peers, parsed and written in one way.

An IPv6 literal is written in brackets (`[::1]:50051`) and parsed without them. Used for
the gateway's --verifier and the verifier's --drafter addresses, and for the per-IP
addresses a name resolves to.
"""

from __future__ import annotations

from specdec.errors import ConfigError


def split_host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of `host:port` or `[ipv6]:port`, the port in [1, 65535]; None where
    `address` is not of that form (a gRPC URI such as `dns:///name:port` may still be)."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def parse_host_port(address: str, flag: str) -> tuple[str, int]:
    """`split_host_port`, or a ConfigError naming `flag` (e.g. "--drafter")."""
    parsed = split_host_port(address)
    if parsed is None:
        raise ConfigError(f"{flag} must be host:port, got {address!r}", param=flag.lstrip("-"))
    return parsed


def format_address(ip: str, port: int) -> str:
    """The address of `ip` (v4 or v6) and `port` as gRPC dials it."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
