"""`python -m gateway`: the OpenAI-compatible HTTP gateway in front of the verifiers."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from gateway.app import GatewayConfig, create_app
from gateway.server import add_server_args, limits_from_args, uvicorn_config
from gateway.tools import TOOL_CALL_PARSERS
from gateway.verifier_client import VerifierClient
from specdec.cli import DEFAULT_GATEWAY_PORT, DefaultsHelpFormatter, add_spec_decode_metrics_arg
from specdec.errors import SpecdecError
from specdec.grammar_checker import add_grammar_args, grammar_limits_from_args
from specdec.heap import freeze_startup_heap
from specdec.rpc.internal_auth import (
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
    parser.add_argument("--model", required=True,
                        help="model whose tokenizer and chat template to load (a path or a "
                             "shipped model name, as given to the verifier)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name in the API (default: --model as given)")
    parser.add_argument("--verifier", action="append", required=True, metavar="HOST:PORT",
                        help="verifier gRPC address; repeat for several (round-robin)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/*. Kept for vLLM "
                             "parity, but argv is visible to every local user (ps): prefer "
                             "--api-key-file or the environment. First match wins: --api-key, "
                             "--api-key-file, $SPECDEC_API_KEY, $VLLM_API_KEY; none: no key")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="file holding the API key (see --api-key)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length limit (default: the verifier's)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='allow tool_choice "auto" (the default when a request has tools): '
                             "the tools go through the chat template (or specdec's own system "
                             "prompt where it renders none), and the output is parsed by "
                             "--tool-call-parser (vLLM's flag)")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                        help='how tool_choice "auto" output is read for tool calls (vLLM\'s '
                             "flag; hermes: <tool_call>{...}</tool_call> blocks)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM compatibility")
    add_spec_decode_metrics_arg(parser)
    parser.add_argument("--log-level", default="info", type=str.lower,
                        choices=["critical", "error", "warning", "info", "debug"])
    add_grpc_tls_args(parser, server=False)
    add_internal_auth_args(parser, server=False)
    add_server_args(parser)
    add_grammar_args(parser)
    return parser


def api_key_from_args(args: argparse.Namespace) -> str | None:
    """The API key of --api-key, --api-key-file, $SPECDEC_API_KEY or $VLLM_API_KEY."""
    if args.api_key is not None:
        logger.warning("--api-key on the command line is visible to every local user (ps); "
                       "prefer $SPECDEC_API_KEY or --api-key-file")
    return load_api_key(args.api_key, args.api_key_file)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Imported here: the model-files module is only needed by the real server.
    from specdec.models.model_files import load_tokenizer, resolve_model

    try:
        config = GatewayConfig(model=args.model, served_model_name=args.served_model_name,
                               verifier_addresses=tuple(args.verifier),
                               max_model_len=args.max_model_len,
                               api_key=api_key_from_args(args), host=args.host, port=args.port,
                               enable_auto_tool_choice=args.enable_auto_tool_choice,
                               tool_call_parser=args.tool_call_parser,
                               per_request_spec_decode_metrics=args.per_request_spec_decode_metrics,
                               grammar_limits=grammar_limits_from_args(args))
        verifier_client = VerifierClient(
            config.verifier_addresses, tls=grpc_tls_from_args(args),
            internal_token=load_internal_token(args.internal_token_file))
        limits = limits_from_args(args)
        tokenizer = load_tokenizer(resolve_model(args.model))
    except (SpecdecError, OSError) as exc:
        print(f"error: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    app = create_app(config, tokenizer, verifier_client)
    freeze_startup_heap()
    uvicorn.Server(uvicorn_config(app, config.host, config.port, log_level=args.log_level,
                                  limits=limits)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
