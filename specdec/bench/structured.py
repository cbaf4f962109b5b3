"""`python -m specdec bench structured`: structured decoding with and without speculation,
inside one engine per drafting method (as `serve` builds it, with a real drafter service).

The requests are the shipped `extract` workload (its `response_format` JSON schemas) and
the `agent` workload (the next tool call, constrained to one of the prompt's tools: a
schema `{"name": <that tool>, "arguments": <its parameters>}` per tool, any of them). Every
request carries its grammar in both settings. For each `--methods` entry an engine serves
`--num-prompts` requests of each workload at each `--max-concurrency`, speculation off and
on in alternating rounds (this machine's speed drifts, so only interleaved ratios mean
anything). Reported per method, workload and concurrency: tokens/s off and on and their
ratio (median over rounds, and the worst round), acceptance of the drafter's tokens, the
share of output tokens the grammar forced, and the grammar's own time as a share of the
steps' time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from drafter_svc.server import stop_drafter_server
from gateway.chat import render_chat_prompt
from specdec.bench.decode import ServeJob, add_engine_config_args, serve_all, start_engine
from specdec.bench.serve_requests import BenchRequest, load_requests
from specdec.cli import (
    DefaultsHelpFormatter,
    add_logging_args,
    setup_logging,
)
from specdec.config import SpeculativeConfig
from specdec.engine.sampling_params import SamplingParams
from specdec.models.model_files import load_tokenizer, resolve_model
from specdec.engine.engine import Engine
from specdec.engine.step_record import StepRecord

logger = logging.getLogger(__name__)

METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
              "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    # The shipped drafts (docs/drafts.md).
    "eagle3": {"method": "eagle3", "model": "smollm2-135m-instruct-eagle3",
               "num_speculative_tokens": 4},
    "draft_model": {"method": "draft_model", "model": "smollm2-135m-instruct-draft",
                    "num_speculative_tokens": 4},
}
TOOLS_MARKER = "Tools (OpenAI function schemas):\n"


def tool_call_schema(system_prompt: str) -> dict[str, Any]:
    """Any one of the tools the agent prompt lists, as {"name", "arguments"}."""
    start = system_prompt.index(TOOLS_MARKER) + len(TOOLS_MARKER)
    tools, _ = json.JSONDecoder().raw_decode(system_prompt[start:])
    return {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": tool["function"]["name"]},
                                      "arguments": tool["function"]["parameters"]},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for tool in tools]}


def grammar_of(request: BenchRequest, workload: str) -> tuple[str, str]:
    if workload == "agent":
        assert request.messages is not None
        return "json_schema", json.dumps(tool_call_schema(request.messages[0]["content"]))
    response_format = request.options["response_format"]
    return "json_schema", json.dumps(response_format["json_schema"]["schema"])


async def measure(engine: Engine, jobs: list[ServeJob], concurrency: int,
                  rounds: int) -> dict[str, Any]:
    records: list[StepRecord] = []
    engine.step_listener = records.append
    rates: dict[bool, list[float]] = {False: [], True: []}
    # drafted, accepted, forced, drafts, tokens, steps
    counters = {True: [0] * 6, False: [0] * 6}
    grammar_share: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(rounds):
            for on in (False, True):
                engine.speculation_enabled = on
                records.clear()
                spec = engine.spec
                before = (spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_forced_tokens,
                          spec.num_drafts)
                started = time.perf_counter()
                tokens = await serve_all(engine, jobs, concurrency)
                rates[on].append(tokens / (time.perf_counter() - started))
                after = (spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_forced_tokens,
                         spec.num_drafts)
                for slot in range(4):
                    counters[on][slot] += after[slot] - before[slot]
                counters[on][4] += tokens
                counters[on][5] += len(records)
                step_time = sum(r.finished - r.started for r in records)
                grammar_share[on].append(sum(r.grammar_s for r in records) / step_time
                                         if step_time else 0.0)
    finally:
        engine.step_listener = None
        engine.speculation_enabled = True
    ratios = [on / off for on, off in zip(rates[True], rates[False])]
    drafted, accepted, forced, drafts, tokens, steps = counters[True]
    return {"concurrency": concurrency, "requests": len(jobs),
            "off_tokens_per_s": statistics.median(rates[False]),
            "on_tokens_per_s": statistics.median(rates[True]),
            "on_over_off": statistics.median(ratios), "worst_round": min(ratios),
            "acceptance": accepted / drafted if drafted else 0.0,
            # Acceptance counts the drafter's tokens left after the grammar's cut; tokens a
            # step (the speculative runs' steps, prefills included) is what comes of it.
            "accepted_per_draft": accepted / drafts if drafts else 0.0,
            "tokens_per_step": tokens / steps if steps else 0.0,
            "forced_share": forced / tokens if tokens else 0.0,
            "grammar_share_off": statistics.median(grammar_share[False]),
            "grammar_share_on": statistics.median(grammar_share[True])}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specdec bench structured",
                                     description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    add_engine_config_args(parser)
    parser.add_argument("--methods", default="ngram,suffix",
                        help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--workloads", default="extract,agent")
    parser.add_argument("--num-prompts", type=int, default=8, help="per workload")
    parser.add_argument("--max-concurrency", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="per request (default: each workload line's own)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the figures here")
    add_logging_args(parser)
    return parser


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    levels = [int(level) for level in args.max_concurrency.split(",")]
    rows: list[dict[str, Any]] = []
    for method in args.methods.split(","):
        spec = SpeculativeConfig.parse(METHODS[method])
        engine, drafter = await start_engine(args, spec, model_dir, max_num_seqs=max(levels))
        try:
            for workload in args.workloads.split(","):
                requests = load_requests(workload, args.num_prompts)
                jobs = []
                for request in requests:
                    assert request.messages is not None
                    kind, value = grammar_of(request, workload)
                    params = SamplingParams(temperature=0.0,
                                            max_tokens=args.max_tokens or request.max_tokens)
                    jobs.append(ServeJob(render_chat_prompt(tokenizer, request.messages), params,
                                         await engine.compile_grammar(kind, value)))
                for level in levels:
                    row = await measure(engine, jobs, level, args.rounds)
                    rows.append({"method": method, "workload": workload, **row})
                    print(format_row(rows[-1]), flush=True)
        finally:
            await engine.stop()
            await stop_drafter_server(drafter)
    return rows


def format_row(row: dict[str, Any]) -> str:
    return (f"{row['method']:>6} {row['workload']:>7} c={row['concurrency']}: "
            f"{row['off_tokens_per_s']:.1f} -> {row['on_tokens_per_s']:.1f} tok/s, "
            f"{row['on_over_off']:.2f}x (worst round {row['worst_round']:.2f}x); acceptance "
            f"{row['acceptance']:.2f} ({row['accepted_per_draft']:.2f} tokens a draft, "
            f"{row['tokens_per_step']:.2f} tokens a step), "
            f"forced {100 * row['forced_share']:.0f}% of tokens, "
            f"grammar {100 * row['grammar_share_off']:.1f}% / {100 * row['grammar_share_on']:.1f}% "
            "of step time (off / on)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, "bench")
    rows = asyncio.run(_run(args))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0
