"""The verifier's gRPC server: the Verifier service plus health and (when asked) reflection."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from specdec.errors import UnavailableError
from specdec.rpc.grpc_server import GrpcServer
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from verifier_svc.builder import ServedModel, VerifierConfig, build_engine
from specdec.engine.engine import Engine
from verifier_svc.metrics import VerifierMetrics
from verifier_svc.servicer import VerifierServicer
from verifier_svc.starting_servicer import StartingVerifierServicer
from verifier_svc.startup_phase import PHASE_WAITING_FOR_DRAFTER, StartupPhase

logger = logging.getLogger(__name__)

SERVICE_NAME = specdec_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
# After the engine is idle, the time the last responses and error statuses get to reach
# their clients before the gRPC server closes.
RPC_FLUSH_S = 1.0
# How often a tensor-parallel verifier checks that its worker ranks are alive while idle.
WORKER_POLL_S = 0.5


@dataclass
class RunningVerifier:
    server: GrpcServer
    engine: Engine
    served: ServedModel
    port: int

    async def stop(self) -> None:
        await self.server.stop()
        await self.engine.stop()
        self.engine.runner.close()

    async def wait_for_fatal_error(self) -> str:
        """Returns why the engine can serve no more (a tensor-parallel worker died, a
        collective failed); never returns while it can."""
        tensor_parallel = self.engine.runner.tensor_parallel
        while True:
            if tensor_parallel is not None:
                failure = tensor_parallel.poll_failure()
                if failure is not None:
                    return failure
            await asyncio.sleep(WORKER_POLL_S)

    async def shutdown(self, grace_s: float) -> None:
        """Graceful stop (SIGTERM): NOT_SERVING and no new Generate calls at once (they
        get UNAVAILABLE); in-flight requests get `grace_s` seconds to finish; the rest then
        end with UNAVAILABLE, so a client retries elsewhere instead of hanging."""
        await self.server.set_serving(False)
        self.engine.stop_accepting()
        logger.info("shutting down: NOT_SERVING; %d requests in flight get %.1f s to finish",
                    self.engine.num_requests, grace_s)
        if not await self.engine.drain(grace_s):
            num_aborted = self.engine.abort_all(UnavailableError(
                "the verifier shut down before the request finished; retry it"))
            logger.warning("shutdown grace of %.1f s over: aborted %d requests", grace_s,
                           num_aborted)
        await self.server.stop(RPC_FLUSH_S)
        await self.engine.stop()
        self.engine.runner.close()


async def start_verifier(config: VerifierConfig, host: str = "127.0.0.1", port: int = 0,
                         metrics_port: int | None = None,
                         phase: StartupPhase | None = None) -> RunningVerifier:
    """Serves gRPC at once (health NOT_SERVING, `GetInfo` telling `phase`: see
    verifier_svc.starting_servicer), builds the engine off the event loop, then serves it;
    port 0 picks a free port (tests).

    With `metrics_port`, Prometheus metrics are served over HTTP at /metrics there.
    """
    phase = phase or StartupPhase()
    server = GrpcServer([SERVICE_NAME], internal_token=config.internal_token,
                        enable_reflection=config.enable_reflection)
    servicer = StartingVerifierServicer(phase)
    specdec_pb2_grpc.add_VerifierServicer_to_server(servicer, server.server)
    tls = config.grpc_tls
    bound = await server.start(host, port, tls.server_credentials() if tls is not None else None,
                               serving=False)
    try:
        engine, served = await asyncio.to_thread(build_engine, config, phase.enter)
    except BaseException:
        await server.stop(0)
        raise
    try:
        await _start_engine(engine, served, config, host, metrics_port, phase)
    except BaseException:
        engine.runner.close()  # no orphaned tensor-parallel workers
        await server.stop(0)
        raise
    servicer.serve_with(VerifierServicer(engine, served))
    await server.set_serving(True)
    return RunningVerifier(server, engine, served, bound)


async def _start_engine(engine: Engine, served: ServedModel, config: VerifierConfig, host: str,
                        metrics_port: int | None, phase: StartupPhase) -> None:
    """Metrics, the engine's loop, and a drafter to wait for (when asked)."""
    if metrics_port is not None:
        engine.metrics = VerifierMetrics(engine, served.model_name)  # a name, never a path
        engine.metrics.serve(host, metrics_port)
    await engine.start()
    if engine.drafter_pool is not None and config.drafter_wait_s > 0:
        phase.enter(PHASE_WAITING_FOR_DRAFTER)
    await _wait_for_a_drafter(engine, config.drafter_wait_s)


async def _wait_for_a_drafter(engine: Engine, wait_s: float) -> None:
    """Holds start-up until one drafter replica is connected, so that the first requests
    are speculated; after `wait_s` the verifier serves plain until a replica connects."""
    pool = engine.drafter_pool
    if pool is None or wait_s <= 0:
        return
    if await pool.wait_for_healthy(1, timeout_s=wait_s):
        logger.info("a drafter replica is connected")
    else:
        logger.warning("no drafter replica connected in %.0f s; serving without drafts until "
                       "one does", wait_s)
