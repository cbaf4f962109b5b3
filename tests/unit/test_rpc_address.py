"""One host:port parser for every gRPC peer address (specdec.rpc.address)."""

from __future__ import annotations

import pytest

from gateway.config import GatewayConfig
from specdec.errors import ConfigError
from specdec.rpc.address import format_address, split_host_port
from specdec.rpc.replica_set import ReplicaTarget
from verifier_svc.drafting.drafter_pool import DrafterPool


@pytest.mark.parametrize(("address", "parsed"), [
    ("verifier-0.specdec:50051", ("verifier-0.specdec", 50051)),
    ("127.0.0.1:1", ("127.0.0.1", 1)),
    ("[::1]:50052", ("::1", 50052)),
    ("host:0", None), ("host:65536", None), ("host:", None), (":80", None), ("host", None),
    ("host:8o", None),
])
def test_split_host_port(address: str, parsed: tuple[str, int] | None) -> None:
    assert split_host_port(address) == parsed


def test_format_is_the_inverse_for_resolved_ips() -> None:
    for ip in ("10.0.0.5", "fe80::1"):
        assert split_host_port(format_address(ip, 7)) == (ip, 7)


def test_the_gateway_and_the_verifier_refuse_the_same_addresses() -> None:
    for bad in ("host", "host:0", "host:99999"):
        with pytest.raises(ConfigError) as gateway:
            GatewayConfig(model="m", verifier_addresses=(bad,))
        with pytest.raises(ConfigError) as verifier:
            DrafterPool([bad], vocab_size=8, tokenizer_fingerprint="")
        assert (gateway.value.param, verifier.value.param) == ("verifier", "drafter")
        assert "must be host:port" in gateway.value.message
        assert "must be host:port" in verifier.value.message


def test_a_replica_target_resolves_names_and_dials_uris_as_given() -> None:
    assert ReplicaTarget.parse(0, "specdec-verifier:50051").host == "specdec-verifier"
    assert ReplicaTarget.parse(0, "dns:///specdec-verifier:50051").host is None
    assert ReplicaTarget.parse(0, "127.0.0.1:50051").host is None  # a literal: nothing to resolve
