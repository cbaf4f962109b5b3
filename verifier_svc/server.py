"""The verifier's gRPC server: the Verifier service plus health and reflection."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.grpc_server import GrpcServer
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from verifier_svc.builder import ServedModel, VerifierConfig, build_engine
from verifier_svc.engine import Engine
from verifier_svc.servicer import VerifierServicer

SERVICE_NAME = specdec_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


@dataclass
class RunningVerifier:
    server: GrpcServer
    engine: Engine
    served: ServedModel
    port: int

    async def stop(self) -> None:
        await self.server.stop()
        await self.engine.stop()


async def start_verifier(config: VerifierConfig, host: str = "127.0.0.1", port: int = 0,
                         ) -> RunningVerifier:
    """Builds the engine and serves it; port 0 picks a free port (tests)."""
    engine, served = build_engine(config)
    await engine.start()
    server = GrpcServer([SERVICE_NAME])
    specdec_pb2_grpc.add_VerifierServicer_to_server(VerifierServicer(engine, served), server.server)
    bound = await server.start(host, port)
    return RunningVerifier(server, engine, served, bound)
