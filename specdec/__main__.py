"""`python -m specdec serve ...` starts the whole service; `bench` measures it."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time

from specdec.cli import DefaultsHelpFormatter, setup_logging
from specdec.errors import ConfigError

# The benchmarks with flags of their own: `bench NAME` runs specdec.bench.MODULE's main.
BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serve", "load a running server"),
    "compare": ("compare", "against transformers and llama.cpp"),
    "accuracy": ("accuracy", "answers with and without speculation"),
    "scale": ("scale", "against llama.cpp by model size and GGUF format"),
    "forward": ("forward", "one forward per kernel path"),
    "concurrency": ("concurrency", "on against off under load inside one engine"),
    "prefix-cache": ("prefix_cache", "prefix caching's TTFT and throughput, and the cost of logprobs"),
    "structured": ("structured", "JSON and tool calls under a grammar, with and without speculation"),
    "replay": ("replay", "suffix drafts replayed offline against known answers"),
}


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # "ready in N s" counts the imports, download and conversion too
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCH_COMMANDS:
        module = importlib.import_module(f"specdec.bench.{BENCH_COMMANDS[argv[1]][0]}")
        return int(module.main(argv[2:]))
    from specdec import launcher
    from specdec.bench import decode as bench
    from specdec.train import cli as train_cli

    args = _build_parser().parse_args(argv)
    setup_logging(args.log_level, "specdec")
    try:
        if args.command == "serve":
            return launcher.serve(args, started)
        if args.command == "train":
            return train_cli.run(args)
        return bench.run(args)
    except ConfigError as exc:
        logging.getLogger("specdec").error("%s", exc.message)
        return 2


def _build_parser() -> argparse.ArgumentParser:
    from specdec import launcher
    from specdec.bench import decode as bench
    from specdec.train import cli as train_cli

    parser = argparse.ArgumentParser(prog="python -m specdec",
                                     formatter_class=DefaultsHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", formatter_class=DefaultsHelpFormatter,
                                       help="start drafter, verifier and gateway")
    launcher.add_serve_args(serve_parser)
    others = "; ".join(f"`bench {name} --help`: {text}" for name, (_, text) in BENCH_COMMANDS.items())
    bench_parser = commands.add_parser(
        "bench", help=f"tokens/s with and without speculation; {others}")
    bench.add_bench_args(bench_parser)
    train_parser = commands.add_parser("train", formatter_class=DefaultsHelpFormatter,
                                       help="train drafts (eagle3, eagle, draft_model) "
                                            "for the target on its own answers")
    train_cli.add_train_args(train_parser)
    return parser


if __name__ == "__main__":
    sys.exit(main())
