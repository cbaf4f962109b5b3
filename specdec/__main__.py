"""`python -m specdec serve ...` starts the whole service; `bench` measures it."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from specdec.cli import DefaultsHelpFormatter, setup_logging
from specdec.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # "ready in N s" counts the imports, download and conversion too
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "serve"]:  # the serving benchmark has flags of its own
        from specdec.bench import serve as bench_serve
        return bench_serve.main(argv[2:])
    if argv[:2] == ["bench", "compare"]:  # so do the comparison with other engines
        from specdec.bench import compare as bench_compare
        return bench_compare.main(argv[2:])
    if argv[:2] == ["bench", "accuracy"]:  # and the accuracy check over the OpenAI API
        from specdec.bench import accuracy as bench_accuracy
        return bench_accuracy.main(argv[2:])
    if argv[:2] == ["bench", "scale"]:  # and specdec against llama.cpp by model size and GGUF format
        from specdec.bench import scale as bench_scale
        return bench_scale.main(argv[2:])
    if argv[:2] == ["bench", "forward"]:  # and the verifier forward per kernel path
        from specdec.bench import forward as bench_forward
        return bench_forward.main(argv[2:])
    if argv[:2] == ["bench", "concurrency"]:  # and speculation on / off inside one loaded engine
        from specdec.bench import concurrency as bench_concurrency
        return bench_concurrency.main(argv[2:])
    if argv[:2] == ["bench", "prefix-cache"]:  # and prefix caching's and logprobs' effect
        from specdec.bench import prefix_cache as bench_prefix_cache
        return bench_prefix_cache.main(argv[2:])
    if argv[:2] == ["bench", "structured"]:  # and structured decoding with / without drafts
        from specdec.bench import structured as bench_structured
        return bench_structured.main(argv[2:])
    if argv[:2] == ["bench", "replay"]:  # and suffix drafts replayed offline against answers
        from specdec.bench import replay as bench_replay
        return bench_replay.main(argv[2:])
    parser = argparse.ArgumentParser(prog="python -m specdec",
                                     formatter_class=DefaultsHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    from specdec import launcher
    from specdec.bench import decode as bench

    serve_parser = commands.add_parser("serve", formatter_class=DefaultsHelpFormatter,
                                       help="start drafter, verifier and gateway")
    launcher.add_serve_args(serve_parser)
    bench_parser = commands.add_parser(
        "bench", help="tokens/s with and without speculation; `bench serve --help`: load a "
                      "running server; `bench compare --help`: against transformers and "
                      "llama.cpp; `bench accuracy --help`: answers with and without "
                      "speculation; `bench concurrency --help`: on against off under load "
                      "inside one engine; `bench forward --help`: one forward per kernel path; "
                      "`bench prefix-cache --help`: prefix caching's TTFT and throughput, "
                      "`bench scale --help`: against llama.cpp by model size and GGUF format; "
                      "and the cost of logprobs; `bench structured --help`: JSON and tool "
                      "calls under a grammar, with and without speculation; `bench replay "
                      "--help`: suffix drafts replayed offline against known answers")
    bench.add_bench_args(bench_parser)
    from specdec.train import cli as train_cli

    train_parser = commands.add_parser("train", formatter_class=DefaultsHelpFormatter,
                                       help="train drafts (eagle3, eagle, draft_model) "
                                                     "for the target on its own answers")
    train_cli.add_train_args(train_parser)
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
