"""The drafter process: a grpc.aio server with Drafter, health and (when asked) reflection.

On stop the open Propose streams are ended first, with UNAVAILABLE, and new ones refused:
a verifier's stream otherwise stays open through the whole grace period and grpc then
cancels its handler, logging "Exception not handled ... CancelledError" at every roll.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from drafter_svc.metrics import DrafterMetrics
from drafter_svc.proposer import ModelOptions
from drafter_svc.proposer_factory import proposer_factory
from drafter_svc.sequence_table import StreamLimits
from drafter_svc.servicer import DrafterServicer
from specdec.cli import DEFAULT_PORTS, DefaultsHelpFormatter, add_listen_args, add_logging_args, setup_logging
from specdec.config import SpeculativeConfig
from specdec.config_flags import add_config_args, build_config
from specdec.errors import ConfigError
from specdec.heap import freeze_startup_heap
from specdec.rpc.grpc_server import SHUTDOWN_GRACE_S, GrpcServer, run_until_signalled
from specdec.rpc.internal_auth import (
    add_internal_auth_args,
    check_server_token,
    load_internal_token,
)
from specdec.rpc.tls import GrpcTlsConfig, add_grpc_tls_args, grpc_tls_from_args
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_PORT = DEFAULT_PORTS["drafter"]
DRAFTER_SERVICE_NAME = specdec_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
SHUTDOWN_DETAILS = "drafter shutting down"
# How long the ended streams get to send their status before the server stops anyway.
END_STREAMS_TIMEOUT_S = 2.0


class StoppableDrafterServicer(DrafterServicer):
    """DrafterServicer whose open Propose streams `end_streams` ends with UNAVAILABLE."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # DrafterServicer's
        super().__init__(*args, **kwargs)
        self._streams: set[asyncio.Task] = set()  # the handler task of each open stream
        self._stopping = False

    async def Propose(self, request_iterator: AsyncIterator[specdec_pb2.ProposeRequest],
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[specdec_pb2.ProposeResponse]:
        if self._stopping:  # a verifier reconnecting while the server drains
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTDOWN_DETAILS)
        task = asyncio.current_task()
        assert task is not None
        self._streams.add(task)
        try:
            async for response in super().Propose(request_iterator, context):
                yield response
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            # Cancelled by end_streams, not by grpc: answer with a status instead.
            if hasattr(task, "uncancel"):  # Python 3.11+
                task.uncancel()
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTDOWN_DETAILS)
        finally:
            self._streams.discard(task)

    async def end_streams(self, timeout_s: float = END_STREAMS_TIMEOUT_S) -> None:
        """Ends every open stream with UNAVAILABLE (their sequences' state is freed) and
        refuses new ones; waits up to timeout_s for the statuses to go out."""
        self._stopping = True
        tasks = list(self._streams)
        if not tasks:
            return
        logger.info("ending %d open Propose stream(s) before stopping", len(tasks))
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=timeout_s)


class DrafterGrpcServer(GrpcServer):
    """GrpcServer that ends the open Propose streams before the grace period starts."""

    servicer: StoppableDrafterServicer | None = None  # set once registered

    async def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        await self.set_serving(False)
        if self.servicer is not None:
            await self.servicer.end_streams()
        await super().stop(grace_s)


async def start_drafter_server(config: SpeculativeConfig, host: str = "127.0.0.1",
                               port: int = DEFAULT_PORT, *,
                               options: ModelOptions | None = None,
                               tls: GrpcTlsConfig | None = None,
                               metrics_port: int | None = None,
                               limits: StreamLimits | None = None,
                               internal_token: str | None = None,
                               enable_reflection: bool = False,
                               ) -> tuple[GrpcServer, int]:
    """Builds the proposer, binds host:port (0 = any free port) and starts serving.

    Model methods load their weights here (`options`: target model, dtype, device, KV pool).
    With `tls` carrying a server certificate the port accepts TLS only. With
    `metrics_port`, Prometheus metrics are served over HTTP at /metrics there.
    With `internal_token`, every call but the health check must carry it (None: open).
    Returns the started server and the bound port; health reports SERVING once started.
    """
    make_proposer = proposer_factory(config, options)
    info = make_proposer().info
    server = DrafterGrpcServer([DRAFTER_SERVICE_NAME], internal_token=internal_token,
                               enable_reflection=enable_reflection)
    metrics = None
    if metrics_port is not None:
        metrics = DrafterMetrics(config.method)
        metrics.serve(host, metrics_port)
    server.servicer = StoppableDrafterServicer(make_proposer, info, metrics, limits)
    specdec_pb2_grpc.add_DrafterServicer_to_server(server.servicer, server.server)
    try:
        bound_port = await server.start(host, port,
                                        tls.server_credentials() if tls is not None else None)
    except OSError as exc:
        raise ConfigError(f"drafter: {exc}", param="port") from None
    logger.info("drafter serving on %s:%d: method=%s num_speculative_tokens=%d%s", host,
                bound_port, config.method, config.num_speculative_tokens,
                f" prompt_lookup=[{config.prompt_lookup_min}, {config.prompt_lookup_max}]"
                if config.method == "ngram" else "" if config.model is None
                else f" model={config.model}")
    return server, bound_port


async def stop_drafter_server(server: GrpcServer, grace_s: float = 5.0) -> None:
    """Reports NOT_SERVING, ends the open Propose streams (UNAVAILABLE), then stops,
    letting other calls finish within grace_s."""
    await server.stop(grace_s)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="python -m drafter_svc",
        description="specdec drafter: proposes draft tokens to verifiers over gRPC.")
    parser.add_argument("--speculative-config", required=True,
                        help='vLLM-style JSON, e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 3, "prompt_lookup_max": 4}\'')
    add_listen_args(parser, "drafter")
    add_config_args(parser, ModelOptions)
    add_config_args(parser, StreamLimits)
    add_logging_args(parser)
    add_grpc_tls_args(parser, client=False)
    add_internal_auth_args(parser)
    return parser


async def serve(config: SpeculativeConfig, host: str, port: int, options: ModelOptions,
                tls: GrpcTlsConfig | None = None, metrics_port: int | None = None,
                limits: StreamLimits | None = None, internal_token: str | None = None,
                enable_reflection: bool = False) -> None:
    server, _ = await start_drafter_server(config, host, port, options=options, tls=tls,
                                           metrics_port=metrics_port, limits=limits,
                                           internal_token=internal_token,
                                           enable_reflection=enable_reflection)
    freeze_startup_heap()
    await run_until_signalled(server)


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    setup_logging(args.log_level, "drafter")
    try:
        config = SpeculativeConfig.parse(args.speculative_config)
        if config is None:
            raise ConfigError("--speculative-config is empty; the drafter needs a method",
                              param="speculative_config")
        if not 0 <= args.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {args.port}", param="port")
        options = build_config(ModelOptions, args)
        limits = build_config(StreamLimits, args)
        tls = grpc_tls_from_args(args)
        internal_token = load_internal_token(args.internal_token_file)
        check_server_token(internal_token, args.host, args.insecure_no_internal_token,
                           tls_enabled=tls is not None and tls.server_enabled)
        asyncio.run(serve(config, args.host, args.port, options, tls, args.metrics_port, limits,
                          internal_token, args.enable_reflection))
    except ConfigError as exc:
        logger.error("%s", exc.message)
        return 2
    return 0
