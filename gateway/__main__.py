"""`python -m gateway`: the OpenAI-compatible HTTP gateway in front of the verifiers."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.server import add_server_args, limits_from_args, uvicorn_config
from gateway.verifier_client import VerifierClient
from specdec.cli import DefaultsHelpFormatter, add_logging_args, setup_logging
from specdec.config_flags import add_config_args, build_config
from specdec.errors import SpecdecError
from specdec.heap import freeze_startup_heap
from specdec.rpc.internal_auth import (
    add_api_key_args,
    add_internal_auth_args,
    load_api_key,
    load_internal_token,
)
from specdec.rpc.tls import add_grpc_tls_args, grpc_tls_from_args

logger = logging.getLogger("gateway")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="python -m gateway",
        description="OpenAI-compatible HTTP gateway of specdec: chat template, validation, "
                    "SSE and stop strings in front of one or more verifiers.")
    add_config_args(parser, GatewayConfig)
    add_api_key_args(parser)
    add_logging_args(parser)
    add_grpc_tls_args(parser, server=False)
    add_internal_auth_args(parser, server=False)
    add_server_args(parser)
    return parser


def api_key_from_args(args: argparse.Namespace) -> str | None:
    """The API key of --api-key, --api-key-file, $SPECDEC_API_KEY or $VLLM_API_KEY."""
    if args.api_key is not None:
        logger.warning("--api-key on the command line is visible to every local user (ps); "
                       "prefer $SPECDEC_API_KEY or --api-key-file")
    return load_api_key(args.api_key, args.api_key_file)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, "gateway")
    # Imported here: the model-files module is only needed by the real server.
    from specdec.models.model_files import load_tokenizer, resolve_model

    try:
        config = build_config(GatewayConfig, args, api_key=api_key_from_args(args))
        verifier_client = VerifierClient(
            config.verifier_addresses, tls=grpc_tls_from_args(args),
            internal_token=load_internal_token(args.internal_token_file))
        limits = limits_from_args(args)
        tokenizer = load_tokenizer(resolve_model(config.model))
    except (SpecdecError, OSError) as exc:
        print(f"error: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    app = create_app(config, tokenizer, verifier_client)
    freeze_startup_heap()
    server = uvicorn.Server(uvicorn_config(app, config.host, config.port,
                                           log_level=args.log_level, limits=limits))
    server.run(sockets=None if args.listen_fd is None else [socket.socket(fileno=args.listen_fd)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
