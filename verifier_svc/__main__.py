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
    add_listen_args,
    add_logging_args,
    add_shutdown_args,
    setup_logging,
)
from specdec.config_flags import add_config_args, build_config
from specdec.errors import ConfigError
from specdec.heap import freeze_startup_heap
from specdec.rpc.grpc_server import wait_for_signal
from specdec.rpc.internal_auth import (
    add_internal_auth_args,
    check_server_token,
    load_internal_token,
)
from specdec.rpc.tls import add_grpc_tls_args, grpc_tls_from_args
from verifier_svc.builder import VerifierConfig
from verifier_svc.server import RPC_FLUSH_S, start_verifier
from verifier_svc.startup_phase import StartupPhase

logger = logging.getLogger("verifier_svc")

# Beyond the grace and the RPC flush, what a stop may take before the watchdog ends the
# process; under the launcher's own margin (specdec.launcher.STOP_MARGIN_S).
STOP_WATCHDOG_MARGIN_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m verifier_svc", description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    add_config_args(parser, VerifierConfig)
    add_listen_args(parser, "verifier")
    add_shutdown_args(parser)
    add_logging_args(parser)
    add_grpc_tls_args(parser)
    add_internal_auth_args(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> VerifierConfig:
    tls = grpc_tls_from_args(args)
    internal_token = load_internal_token(args.internal_token_file)
    check_server_token(internal_token, args.host, args.insecure_no_internal_token,
                       tls_enabled=tls is not None and tls.server_enabled)
    return build_config(VerifierConfig, args, grpc_tls=tls, internal_token=internal_token,
                        enable_reflection=args.enable_reflection, compile=None)


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
    try:
        # Checked before the model loads: a refused configuration fails at once.
        config = config_from_args(args)
        if config.threads:
            torch.set_num_threads(config.threads)
        return asyncio.run(serve(args, config))
    except ConfigError as exc:
        logger.error("%s", exc.message)
        return 2


if __name__ == "__main__":
    sys.exit(main())
