"""`python -m specdec bench prefix-cache`: what prefix caching and logprobs cost and save,
measured inside one engine (as `serve` builds it, with a real drafter service).

Three measurements, each comparing settings side by side in one run (this machine's
speed drifts within minutes, so only ratios of interleaved runs mean anything):
- TTFT of a request whose long system prompt (`--system-tokens`, default 1,500) was
  already served, against the first request with it (on a fresh engine: a server's first
  request), and against the same request with caching switched off;
- throughput of a chat workload whose requests share that system prompt (different user
  questions), caching on against off, in alternating rounds;
- the cost of logprobs (`--top-logprobs`) per decode step at each `--batch-sizes`, with
  against without, in alternating rounds.
Switching caching off here sets the block manager's flag, as `--no-enable-prefix-caching`
does at start: no lookups, no new cached blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time
from pathlib import Path
from typing import Any

from drafter_svc.server import stop_drafter_server
from gateway.chat import render_chat_prompt
from specdec.bench.decode import ServeJob, add_engine_config_args, serve_all, start_engine
from specdec.bench.serve_requests import load_requests
from specdec.cli import (
    DefaultsHelpFormatter,
    add_logging_args,
    setup_logging,
)
from specdec.config import SpeculativeConfig
from specdec.engine.sampling_params import SamplingParams
from specdec.errors import ConfigError
from specdec.models.model_files import load_tokenizer, resolve_model
from specdec.engine.engine import Engine
from specdec.engine.step_record import StepRecord
from verifier_svc.requests import collect_outputs

logger = logging.getLogger(__name__)

DEFAULT_SPECULATIVE_CONFIG = ('{"method": "ngram", "num_speculative_tokens": 3, '
                              '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
_SUBJECTS = ("the assistant", "every answer", "a reply", "the agent", "each tool call",
             "the summary", "a quoted passage", "the final message")
_RULES = ("must cite the section it relies on", "keeps to the customer's own words",
          "never invents an order number", "asks before it cancels anything",
          "states prices in the customer's currency", "lists at most five items",
          "names the warehouse that ships the parcel", "uses the metric system",
          "ends with the ticket reference", "mentions the refund window of 30 days",
          "escalates a safety complaint at once", "treats the account email as private")


def system_prompt(tokenizer: Any, num_tokens: int, seed: int = 0) -> str:
    """A support-desk policy of about `num_tokens` tokens, varied sentences (a seed)."""
    rng = random.Random(seed)
    lines = ["You are the support assistant of a parcel company. Follow this policy."]
    section = 1
    while len(tokenizer.encode("\n".join(lines))) < num_tokens:
        lines.append(f"Section {section}.{rng.randrange(1, 9)}: {rng.choice(_SUBJECTS)} "
                     f"{rng.choice(_RULES)}, and {rng.choice(_SUBJECTS)} {rng.choice(_RULES)}.")
        section += 1
    return "\n".join(lines)


def questions(num: int) -> list[str]:
    """User questions from the shipped `chat` workload (cycled)."""
    requests = load_requests("chat", None)
    texts = [request.messages[-1]["content"] for request in requests if request.messages]
    return [texts[index % len(texts)] for index in range(num)]


async def _ttft(engine: Engine, prompt_ids: list[int], request_id: str) -> tuple[float, int]:
    """Seconds to the first token, and the prompt tokens the prefix cache held."""
    started = time.perf_counter()
    _, queue = engine.add_request(request_id, prompt_ids,
                                  SamplingParams(temperature=0.0, max_tokens=1))
    output = await queue.get()
    seconds = time.perf_counter() - started
    assert not isinstance(output, Exception), output
    assert output.finish_reason is not None  # max_tokens 1: the first output is the last
    return seconds, output.num_cached_tokens


async def measure_ttft(engine: Engine, prompts: list[list[int]]) -> dict[str, Any]:
    manager = engine.scheduler.block_manager
    first, _ = await _ttft(engine, prompts[0], "ttft-first")
    cached, uncached, hits_on, hits_off = [], [], [], []
    for index, prompt in enumerate(prompts[1:], start=1):
        manager.enable_prefix_caching = False
        seconds, hits = await _ttft(engine, prompt, f"ttft-off-{index}")
        uncached.append(seconds)
        hits_off.append(hits)
        manager.enable_prefix_caching = True
        seconds, hits = await _ttft(engine, prompt, f"ttft-on-{index}")
        cached.append(seconds)
        hits_on.append(hits)
    return {"prompt_tokens": len(prompts[0]), "first_ms": 1000 * first,
            "cached_tokens_on": min(hits_on), "cached_tokens_off": max(hits_off),
            "cached_ms": 1000 * statistics.median(cached),
            "uncached_ms": 1000 * statistics.median(uncached),
            "first_over_cached": first / statistics.median(cached),
            "uncached_over_cached": statistics.median(uncached) / statistics.median(cached)}


async def measure_throughput(engine: Engine, prompts: list[list[int]], max_tokens: int,
                             concurrency: int, rounds: int) -> dict[str, Any]:
    manager = engine.scheduler.block_manager
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for caching in (False, True):
            manager.enable_prefix_caching = caching
            started = time.perf_counter()
            tokens = await serve_all(engine, [ServeJob(ids, params) for ids in prompts],
                                     concurrency)
            rates[caching].append(tokens / (time.perf_counter() - started))
    manager.enable_prefix_caching = True
    ratios = [on / off for on, off in zip(rates[True], rates[False])]
    return {"requests": len(prompts), "concurrency": concurrency,
            "on_tokens_per_s": statistics.median(rates[True]),
            "off_tokens_per_s": statistics.median(rates[False]),
            "on_over_off": statistics.median(ratios), "worst_round_on_over_off": min(ratios)}


async def measure_logprobs(engine: Engine, prompts: list[list[int]], top: int, max_tokens: int,
                           rounds: int) -> dict[str, Any]:
    """Mean decode-step time with logprobs over without, speculation off; one request per
    prompt at once (the batch size)."""
    batch_size = len(prompts)
    records: list[StepRecord] = []
    engine.step_listener = records.append
    engine.speculation_enabled = False
    step_ms: dict[bool, list[float]] = {True: [], False: []}
    try:
        for round_index in range(rounds):
            for with_logprobs in (False, True):
                records.clear()
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                        logprobs=top if with_logprobs else None)
                await asyncio.gather(*(
                    collect_outputs(engine.add_request(f"lp-{round_index}-{i}", prompt, params)[1])
                    for i, prompt in enumerate(prompts)))
                decode = [r.finished - r.started for r in records
                          if r.num_prefill_tokens == 0 and r.num_sequences == batch_size]
                if decode:
                    step_ms[with_logprobs].append(1000 * statistics.mean(decode))
    finally:
        engine.step_listener = None
        engine.speculation_enabled = True
    ratios = [on / off for on, off in zip(step_ms[True], step_ms[False])]
    return {"batch_size": batch_size, "top_logprobs": top,
            "step_ms_without": statistics.median(step_ms[False]),
            "step_ms_with": statistics.median(step_ms[True]),
            "cost": statistics.median(ratios) - 1.0}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specdec bench prefix-cache",
                                     description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    add_engine_config_args(parser)
    parser.add_argument("--speculative-config", default=DEFAULT_SPECULATIVE_CONFIG)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--ttft-requests", type=int, default=6,
                        help="repeated requests timed with caching on and off (each)")
    parser.add_argument("--num-prompts", type=int, default=16, help="chat workload requests")
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--top-logprobs", type=int, default=5)
    parser.add_argument("--parts", default="ttft,throughput,logprobs",
                        help="which measurements to run, comma-separated")
    parser.add_argument("--json", default=None, help="also write the figures here")
    add_logging_args(parser)
    return parser


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec is None:  # the engine is measured as served, with its drafter
        raise ConfigError("--speculative-config must name a method", param="speculative_config")
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    system = system_prompt(tokenizer, args.system_tokens)
    batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    asked = questions(max(args.ttft_requests + 1, args.num_prompts, *batch_sizes))

    def chat_ids(question: str) -> list[int]:
        return render_chat_prompt(tokenizer, [{"role": "system", "content": system},
                                              {"role": "user", "content": question}])

    engine, drafter = await start_engine(args, spec, model_dir,
                                         max_num_seqs=max(batch_sizes + [args.max_concurrency]))
    parts = set(args.parts.split(","))
    figures: dict[str, Any] = {}
    try:
        if "ttft" in parts:
            figures["ttft"] = await measure_ttft(
                engine, [chat_ids(q) for q in asked[:args.ttft_requests + 1]])
        if "throughput" in parts:
            figures["throughput"] = await measure_throughput(
                engine, [chat_ids(q) for q in asked[:args.num_prompts]], args.max_tokens,
                args.max_concurrency, args.rounds)
        if "logprobs" in parts:
            figures["logprobs"] = [await measure_logprobs(
                engine, [render_chat_prompt(tokenizer, [{"role": "user", "content": q}])
                         for q in asked[:size]], args.top_logprobs, 32, args.rounds)
                for size in batch_sizes]
    finally:
        await engine.stop()
        await stop_drafter_server(drafter)
    return figures


def format_figures(figures: dict[str, Any]) -> str:
    lines = []
    if "ttft" in figures:
        ttft = figures["ttft"]
        lines.append(
            f"TTFT, {ttft['prompt_tokens']}-token prompt: first {ttft['first_ms']:.0f} ms; "
        f"repeated system prompt {ttft['cached_ms']:.0f} ms cached, "
            f"{ttft['uncached_ms']:.0f} ms uncached; first/cached {ttft['first_over_cached']:.1f}x, "
            f"uncached/cached {ttft['uncached_over_cached']:.1f}x")
    if "throughput" in figures:
        throughput = figures["throughput"]
        lines.append(
            f"chat with a shared system prompt ({throughput['requests']} requests, c = "
        f"{throughput['concurrency']}): {throughput['on_tokens_per_s']:.1f} tok/s cached, "
        f"{throughput['off_tokens_per_s']:.1f} uncached; on/off {throughput['on_over_off']:.2f}x "
            f"(worst round {throughput['worst_round_on_over_off']:.2f}x)")
    for row in figures.get("logprobs", []):
        lines.append(f"logprobs (top {row['top_logprobs']}) at batch {row['batch_size']}: decode "
                     f"step {row['step_ms_without']:.2f} -> {row['step_ms_with']:.2f} ms "
                     f"({100 * row['cost']:+.1f}%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, "bench")
    try:
        figures = asyncio.run(_run(args))
    except ConfigError as exc:
        logger.error("%s", exc.message)
        return 2
    print(format_figures(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0
