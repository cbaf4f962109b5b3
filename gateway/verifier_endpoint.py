"""One verifier the gateway dials: an address a `--verifier` resolved to (or the target
as given; see specdec.rpc.replica_set), its channel, and what the gateway last learnt of
it (specdec.rpc.replica_health)."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from specdec.rpc.replica_health import ReplicaHealth
from specdec.v1 import specdec_pb2, specdec_pb2_grpc


@dataclass(slots=True, eq=False)
class VerifierEndpoint:
    """One verifier of gateway.verifier_client and its last probed state. Its status, as
    /health reports it: serving | not_serving (draining, shutting down) | unreachable
    (down, or still loading its model) | starting: <phase> | tokenizer_mismatch (never
    used)."""

    address: str
    channel: grpc.aio.Channel
    stub: specdec_pb2_grpc.VerifierStub
    health: ReplicaHealth = field(default_factory=ReplicaHealth)
    info: specdec_pb2.VerifierInfo | None = None

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def status(self) -> str:
        return self.health.status
