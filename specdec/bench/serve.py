"""`python -m specdec bench serve`: load a running server the way vLLM's benchmark_serving does.

N requests go to an OpenAI-compatible server (specdec's gateway, or any other) at a
Poisson request rate (inf: all at once) and/or under a concurrency cap. Every request is
streamed unless told otherwise, and timed on the client:

- TTFT: time to the first chunk carrying text;
- TPOT: per request, (e2e latency - TTFT) / (output tokens - 1), output tokens from the
  usage chunk (`stream_options.include_usage`);
- ITL: the gaps between successive text chunks. A verify step that accepts drafts sends
  several tokens in one chunk, so with speculation ITL rises while TPOT falls.

The speculation block comes from the gateway's `/metrics` (vLLM's counters, read before
and after the run), or from the responses' `usage.speculation` when /metrics lacks them;
per-position acceptance likewise (accepted at position i / drafts). A failed request is
counted and reported, never raised; the command exits 1 when any request failed.
`run_benchmark` is the async API behind the command (tests drive load with it).
Several comma-separated `--speculation` settings are compared side by side over `--rounds`
(specdec/bench/serve_compare.py), or request by request, held out, with `--paired`
(specdec/bench/serve_paired.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any


from specdec.cli import DefaultsHelpFormatter
from specdec.bench.serve_compare import (
    compare,
    format_comparison,
    format_run,
    parse_settings,
    parse_speculation,
    run_rounds,
)
from specdec.bench.serve_paired import (
    DEFAULT_WARMUP,
    PairedRun,
    report_paired,
    run_paired,
    summarise_paired,
)
from specdec.bench.serve_report import (
    format_summary,
    summarise,
    write_plot,
)
from specdec.bench.serve_run import (
    DEFAULT_BASE_URL,
    BenchConfig,
    BenchReport,
    Progress,
    fetch_model,
    open_client,
    run_benchmark,
)
from specdec.bench.serve_requests import (
    DEFAULT_MAX_TOKENS,
    ENDPOINTS,
    BenchRequest,
    RequestResult,
    load_requests,
)

__all__ = ["BenchConfig", "BenchReport", "BenchRequest", "RequestResult", "load_requests",
           "main", "run_benchmark", "summarise", "format_summary"]

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="python -m specdec bench serve",
        description="Load a running OpenAI-compatible server (vLLM's benchmark_serving): "
                    "throughput, TTFT, TPOT, ITL and speculation figures.")
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL,
                        help="server root, e.g. %(default)s (a trailing /v1 is accepted)")
    parser.add_argument("--model", default=None,
                        help="served model name (default: the first of GET /v1/models)")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat",
                        help="API to load; prompts become user messages for chat")
    parser.add_argument("--dataset", default="builtin",
                        help="'builtin' (varied chat prompts shipped with specdec), 'repeat' "
                             "(eight shipped 'repeat this paragraph' prompts), a workload "
                             "generated from templates (agent, code-edit, rag, extract, "
                             "multi-turn, chat: docs/performance.md) or a JSONL "
                             'file of {"prompt": ...} or {"messages": [...]}, optional '
                             '"max_tokens" and "response_format"')
    parser.add_argument("--no-response-format", action="store_true",
                        help="leave out the dataset's response_format (extract's JSON schema), "
                             "for servers without structured outputs")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests to send (default: each dataset line once; cycles)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests/s with Poisson arrivals (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="at most this many requests in flight")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"output tokens per request (default: the line's, else "
                             f"{DEFAULT_MAX_TOKENS})")
    parser.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate exactly max_tokens (fixed output lengths)")
    _add_comparison_args(parser)
    parser.add_argument("--no-stream", action="store_true",
                        help="non-streaming requests (no TTFT / TPOT / ITL)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the Poisson arrivals and of the rounds' order")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--metrics-url", default=None,
                        help="Prometheus endpoint with the speculation counters (default: "
                             "BASE_URL/metrics; e.g. the verifier's, for per-position counts)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--output-json", default=None, metavar="PATH",
                        help="write every figure (and per-request data) here")
    parser.add_argument("--plot", default=None, metavar="PATH.png",
                        help="acceptance per position and latency per request (needs matplotlib)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--log-level", default="warning",
                        choices=["debug", "info", "warning", "error"])
    return parser


def _add_comparison_args(parser: argparse.ArgumentParser) -> None:
    """--speculation settings, compared over --rounds or request by request (--paired)."""
    parser.add_argument("--speculation", default=None,
                        help="per-request override: 'off', 'on' or a number of speculative "
                             "tokens (default: the server's setting); several, comma-separated "
                             "(e.g. off,on), are compared side by side over --rounds")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with several --speculation settings: rounds of one run per "
                             "setting (per pair of rounds an order drawn from --seed, then its "
                             "reverse), reported as per-round throughput ratios with a 95%% "
                             "interval (default 1)")
    parser.add_argument("--paired", action="store_true",
                        help="with several --speculation settings: held-out comparison, request "
                             "by request. Waves of --max-concurrency requests (default 1) in "
                             "dataset order; each wave is prefilled once (max_tokens=1, no "
                             "speculation, untimed), then run once per setting in the order "
                             "given, timed, so the first setting meets every answer first (list "
                             "the drafting one first: on,off) and drift hits all settings alike. "
                             "Reports tokens/s and the ratio to the first setting, with a 95%% "
                             "interval (a bootstrap over the waves, from five waves up), for "
                             "the first --paired-warmup requests, the rest and overall, the "
                             "acceptance length from the responses and, at temperature 0, the "
                             "requests whose texts differ. Not with --rounds or --request-rate")
    parser.add_argument("--paired-warmup", type=int, default=None, metavar="N",
                        help=f"with --paired: the first N requests (a cold server's) are "
                             f"reported apart (default {DEFAULT_WARMUP})")


def _options(args: argparse.Namespace, speculation: str | None) -> dict[str, Any]:
    options: dict[str, Any] = {"temperature": args.temperature}
    if args.ignore_eos:
        options["ignore_eos"] = True
    if speculation is not None:
        options["speculation"] = parse_speculation(speculation)
    return options


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s bench %(levelname)s %(name)s: %(message)s")
    try:
        if args.num_prompts is not None and args.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
        if args.max_tokens is not None and args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        config = BenchConfig(base_url=args.base_url, model=args.model,
                             request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                             api_key=args.api_key, timeout_s=args.timeout, seed=args.seed,
                             progress=not args.disable_tqdm, metrics_url=args.metrics_url)
        # None: the one run sends no speculation field.
        settings: list[str | None] = (list(parse_settings(args.speculation))
                                      if args.speculation is not None else [None])
        if args.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
        if args.rounds > 1 and len(settings) < 2:
            raise ValueError("--rounds compares settings: give two or more, e.g. --speculation off,on")
        if len(settings) > 1 and args.plot:
            raise ValueError("--plot draws one run; leave it out when comparing --speculation settings")
        _check_paired(args, settings)
        requests_for = {setting: load_requests(args.dataset, args.num_prompts, endpoint=args.endpoint,
                                               max_tokens=args.max_tokens, options=_options(args, setting),
                                               response_format=not args.no_response_format)
                        for setting in settings}
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.no_stream:
        requests_for = {setting: [dataclasses.replace(request, stream=False) for request in requests]
                        for setting, requests in requests_for.items()}
    # Paired or compared runs have two or more settings, all parsed names (none is None).
    if args.paired:
        return _paired_settings(args, config, settings, requests_for)  # type: ignore[arg-type]
    if len(settings) > 1:
        return _compare_settings(args, config, settings, requests_for)  # type: ignore[arg-type]
    report = asyncio.run(run_benchmark(config, requests_for[settings[0]]))
    summary = summarise(report)
    print(format_summary(summary))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(summary, indent=2) + "\n")
    if args.plot:
        write_plot(summary, args.plot)
    if report.failed:
        print(f"{len(report.failed)} of {len(report.results)} requests failed",
              file=sys.stderr)
        return 1
    return 0


def _compare_settings(args: argparse.Namespace, config: BenchConfig, settings: list[str],
                      requests_for: dict[str, list[BenchRequest]]) -> int:
    """Rounds of one run per setting (see specdec/bench/serve_compare.py); prints each run
    and the comparison, writes every run's summary and the comparison to --output-json."""
    failed = 0

    async def run_one(setting: str) -> dict[str, Any]:
        nonlocal failed
        report = await run_benchmark(config, requests_for[setting])
        failed += len(report.failed)
        return summarise(report)

    def on_run(round_index: int, setting: str, summary: dict[str, Any]) -> None:
        print(format_run(round_index, setting, summary), flush=True)

    runs = asyncio.run(run_rounds(settings, args.rounds, run_one, on_run, seed=args.seed))
    comparison = compare(settings, runs)
    print(format_comparison(comparison, args.rounds))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(
            {"settings": settings, "rounds": args.rounds, "comparison": comparison, "runs": runs},
            indent=2) + "\n")
    if failed:
        print(f"{failed} requests failed over {len(runs)} runs", file=sys.stderr)
        return 1
    return 0


def _check_paired(args: argparse.Namespace, settings: list[str | None]) -> None:
    """--paired and --paired-warmup: a paired run compares settings, once each, in waves."""
    if args.paired_warmup is not None and not args.paired:
        raise ValueError("--paired-warmup needs --paired")
    if not args.paired:
        return
    if len(settings) < 2:
        raise ValueError("--paired compares settings: give two or more, e.g. --speculation on,off")
    if args.rounds > 1:
        raise ValueError("--paired runs each request once per setting; leave out --rounds")
    if math.isfinite(args.request_rate):
        raise ValueError("--paired sends waves of --max-concurrency requests; leave out "
                         "--request-rate")
    if args.paired_warmup is not None and args.paired_warmup < 0:
        raise ValueError(f"--paired-warmup must be >= 0, got {args.paired_warmup}")


def _paired_settings(args: argparse.Namespace, config: BenchConfig, settings: list[str],
                     requests_for: dict[str, list[BenchRequest]]) -> int:
    """Waves of requests, each prefilled then run once per setting (see
    specdec/bench/serve_paired.py); prints the table, writes the summary to --output-json."""
    progress = Progress(len(requests_for[settings[0]]) * len(settings), config.progress)

    async def run() -> PairedRun:
        async with open_client(config) as client:
            model = config.model or await fetch_model(client)
            return await run_paired(client, model, settings, requests_for,
                                    config.max_concurrency or 1, lambda _: progress.update())

    try:
        paired = asyncio.run(run())
    finally:
        progress.close()
    warmup = DEFAULT_WARMUP if args.paired_warmup is None else args.paired_warmup
    return report_paired(summarise_paired(paired, warmup, compare_texts=args.temperature == 0),
                         args.output_json)
