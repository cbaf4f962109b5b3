"""The verifier while it starts: its gRPC port answers before the model is ready.

Building the engine takes from seconds to minutes (a first start compiles the C++ kernels),
and a port that does not answer meanwhile looks like a crash. So the gRPC server binds
first, with health NOT_SERVING, and `GetInfo` answers with the start-up phase alone
(`VerifierInfo.startup_phase`) until the engine is built; a gateway shows it in /health.
`Generate` is refused with UNAVAILABLE until then.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from verifier_svc.servicer import VerifierServicer
from verifier_svc.startup_phase import StartupPhase


class StartingVerifierServicer(specdec_pb2_grpc.VerifierServicer):
    """Registered before the engine exists (a grpc server takes its services before it
    starts); answers for the engine's servicer once `serve_with` hands it over."""

    def __init__(self, phase: StartupPhase) -> None:
        self.phase = phase
        self._servicer: VerifierServicer | None = None

    def serve_with(self, servicer: VerifierServicer) -> None:
        self._servicer = servicer

    async def GetInfo(self, request: specdec_pb2.GetVerifierInfoRequest,
                      context: grpc.aio.ServicerContext) -> specdec_pb2.VerifierInfo:
        if self._servicer is None:
            return specdec_pb2.VerifierInfo(startup_phase=self.phase.name)
        return await self._servicer.GetInfo(request, context)

    async def Generate(self, request: specdec_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext,
                       ) -> AsyncIterator[specdec_pb2.GenerateResponse]:
        if self._servicer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the verifier is starting ({self.phase.name}); retry later")
            return
        async for response in self._servicer.Generate(request, context):
            yield response
