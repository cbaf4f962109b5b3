"""`python -m verifier_svc`: the target model behind the Verifier gRPC service."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import sys
from typing import NoReturn

import torch

from specdec.cli import (
    DefaultsHelpFormatter,
    ADDITIONAL_CONFIG_KEYS,
    add_engine_args,
    add_logging_args,
    add_model_args,
    add_shutdown_args,
    add_speculative_args,
    setup_logging,
)
from specdec.config import SpeculativeConfig, parse_additional_config
from specdec.errors import ConfigError
from specdec.heap import freeze_startup_heap
from specdec.rpc.grpc_server import wait_for_signal
from specdec.rpc.internal_auth import (
    add_internal_auth_args,
    check_server_token,
    load_internal_token,
)
from specdec.rpc.tls import add_grpc_tls_args, grpc_tls_from_args
from verifier_svc.builder import VerifierConfig, compile_by_default
from verifier_svc.server import RPC_FLUSH_S, start_verifier
from verifier_svc.startup_phase import StartupPhase

logger = logging.getLogger("verifier_svc")

# Beyond the grace and the RPC flush, what a stop may take before the watchdog ends the
# process; under the launcher's own margin (specdec.launcher.STOP_MARGIN_S).
STOP_WATCHDOG_MARGIN_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m verifier_svc", description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    add_model_args(parser)
    add_engine_args(parser)
    add_speculative_args(parser)
    parser.add_argument("--drafter", action="append", default=[],
                        help="drafter address host:port (repeatable; a name may resolve to "
                             "several replicas)")
    parser.add_argument("--drafter-wait-s", type=float, default=0.0,
                        help="at start-up, wait this long for a drafter replica before "
                             "serving (default 0: serve at once, plain until one connects)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics over HTTP at /metrics on this port")
    add_shutdown_args(parser)
    add_logging_args(parser)
    add_grpc_tls_args(parser)
    add_internal_auth_args(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> VerifierConfig:
    parse_additional_config(args.additional_config, ADDITIONAL_CONFIG_KEYS)
    tls = grpc_tls_from_args(args)
    internal_token = load_internal_token(args.internal_token_file)
    check_server_token(internal_token, args.host, args.insecure_no_internal_token,
                       tls_enabled=tls is not None and tls.server_enabled)
    return VerifierConfig(
        model=args.model, served_model_name=args.served_model_name, dtype=args.dtype,
        device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        compile=compile_by_default(args.device, args.tensor_parallel_size, args.enforce_eager),
        adaptive_speculation=args.speculation_policy == "adaptive",
        enable_prefix_caching=args.enable_prefix_caching, logprobs_mode=args.logprobs_mode,
        speculative_config=SpeculativeConfig.parse(args.speculative_config),
        grpc_tls=tls, internal_token=internal_token, enable_reflection=args.enable_reflection,
        max_waiting_requests=args.max_waiting_requests, request_timeout_s=args.request_timeout_s,
        drafter_targets=tuple(args.drafter), drafter_wait_s=args.drafter_wait_s,
        draft_timeout_s=args.draft_timeout_ms / 1000 if args.draft_timeout_ms else None)


async def serve(args: argparse.Namespace, config: VerifierConfig) -> int:
    signalled = asyncio.ensure_future(wait_for_signal())
    await asyncio.sleep(0)  # the handlers are installed: a stop while starting is heard
    phase = StartupPhase()
    starting = asyncio.ensure_future(start_verifier(config, args.host, args.port,
                                                    args.metrics_port, phase))
    await asyncio.wait({signalled, starting}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        _exit_while_starting(phase)
    verifier = starting.result()
    logger.info("verifier serving on %s:%d (%d start-up objects frozen)", args.host,
                verifier.port, freeze_startup_heap())
    fatal = asyncio.ensure_future(verifier.wait_for_fatal_error())
    await asyncio.wait({signalled, fatal}, return_when=asyncio.FIRST_COMPLETED)
    for task in (signalled, fatal):
        task.cancel()
    if fatal.done() and not fatal.cancelled():
        # A broken tensor-parallel group cannot serve again: exit so the launcher (or the
        # orchestrator) sees it, rather than fail every request from here on.
        logger.error("%s; stopping the verifier", fatal.result())
        await verifier.shutdown(0.0)
        return 1
    # A stop that outlives its bound is a bug (issue 43 saw one, rarely, right after
    # start-up, and it did not reproduce): the process then ends anyway, before the
    # launcher's SIGKILL, with every thread's stack on stderr to find it by. faulthandler's
    # own thread needs no GIL, so a thread stuck holding it cannot stop it.
    stop_limit_s = args.shutdown_grace_s + RPC_FLUSH_S + STOP_WATCHDOG_MARGIN_S
    faulthandler.dump_traceback_later(stop_limit_s, exit=True)
    await verifier.shutdown(args.shutdown_grace_s)
    faulthandler.cancel_dump_traceback_later()
    logger.info("verifier stopped")
    return 0


def _exit_while_starting(phase: StartupPhase) -> NoReturn:
    """Ends the process at once: the engine is being built in a thread that cannot be
    interrupted (a kernel compile, a weight load), which a normal exit would wait for,
    and nothing is served yet, so nothing is lost. A kernel build's lock names this
    process, so the next start takes it over."""
    logger.info("stopped while starting (%s)", phase.name)
    logging.shutdown()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, "verifier")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        # Checked before the model loads: a refused configuration fails at once.
        config = config_from_args(args)
        return asyncio.run(serve(args, config))
    except ConfigError as exc:
        logger.error("%s", exc.message)
        return 2


if __name__ == "__main__":
    sys.exit(main())
