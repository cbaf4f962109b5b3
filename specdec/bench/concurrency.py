"""`python -m specdec bench concurrency`: speculation on against off under concurrent load,
measured inside one engine by switching speculation every `--period` seconds.

Why: on this project's 2-core machine the same setting's throughput drifts by more than
the difference speculation makes at eight or sixteen requests (separate `bench serve`
runs of one setting ten seconds apart: 0.74-1.17x), so runs one after the other cannot tell
0.97x from 1.03x; switching every second within one run still left +-3% between runs of
30 s, every quarter second about +-1%. Here the engine (as `serve` builds it, with a real drafter service on a
loopback port) serves `--num-prompts` requests at `--max-concurrency`, and speculation is
switched off and on for the whole engine every period: a step planned while it is off
drafts nothing and probes nothing, exactly as if every request had asked for no
speculation. Each step is attributed to the setting it was planned under, with its share
of the time up to the next step, and the tokens it appended.

Reported per concurrency, off and on and their ratio:
- all steps: output tokens over the time of the steps (prefill chunks included, which may
  fall unevenly on the two settings);
- decode steps: the same over the steps without a prefill chunk;
- by batch size: per number of sequences in a decode step, on's tokens/s over off's,
  averaged with the time spent at that size as weights (over sizes where both settings ran
  at least MIN_STEPS_PER_SIZE steps): the ratio with the batch's make-up held fixed, since
  requests starting and finishing make the batch size drift between periods;
- paired periods: each on-period over the mean of the off-periods beside it, the median and
  the geometric mean with a 95% bootstrap interval.
The engine is in-process: no gateway and no HTTP client share the cores (`bench serve`
measures those).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import random
import statistics
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from drafter_svc.server import stop_drafter_server
from gateway.chat import render_chat_prompt, tokenize_prompt
from specdec.bench.decode import ServeJob, add_engine_config_args, serve_all, start_engine
from specdec.bench.serve_requests import SHIPPED_DATASETS, BenchRequest, load_requests
from specdec.cli import (
    DefaultsHelpFormatter,
    add_logging_args,
    setup_logging,
)
from specdec.config import SpeculativeConfig
from specdec.engine.sampling_params import SamplingParams
from specdec.errors import ConfigError
from specdec.layers.batch_invariance import batch_invariant_requested
from specdec.models.cpu_stack import CpuDecoderStack
from specdec.models.model_files import load_tokenizer, resolve_model
from specdec.engine.engine import Engine
from specdec.engine.step_record import StepRecord

logger = logging.getLogger(__name__)

DEFAULT_SPECULATIVE_CONFIG = ('{"method": "ngram", "num_speculative_tokens": 3, '
                              '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
# A step whose successor starts later than this after it finished ended a busy spell (the
# engine waited for requests): it counts its own duration, not the idle time after it.
IDLE_GAP_S = 0.1
MIN_STEPS_PER_SIZE = 5
BOOTSTRAP_SAMPLES = 2000
WARM_UP_TOKENS = 16


# ------------------------------------------------------------------ analysis

@dataclass(frozen=True, slots=True)
class Rate:
    tokens: int
    seconds: float
    steps: int
    draft_slots: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def step_seconds(records: Seq[StepRecord]) -> list[float]:
    """Each step's share of the run: up to the next step's start, the engine's work between
    steps included, or its own duration before an idle spell."""
    shares = []
    for record, following in zip(records, list(records[1:]) + [None]):
        if following is None or following.started - record.finished > IDLE_GAP_S:
            shares.append(record.finished - record.started)
        else:
            shares.append(following.started - record.started)
    return shares


def _rate(items: list[tuple[StepRecord, float]]) -> Rate:
    return Rate(sum(r.num_output_tokens for r, _ in items), sum(s for _, s in items), len(items),
                sum(r.num_draft_slots for r, _ in items))


def _ratio(on: Rate, off: Rate) -> float | None:
    if on.seconds <= 0 or off.seconds <= 0 or off.tokens == 0:
        return None
    return on.tokens_per_s / off.tokens_per_s


def by_batch_size(decode: list[tuple[StepRecord, float]]) -> tuple[float | None, list[dict[str, Any]]]:
    """The decode steps' (`decode`) on / off ratio per batch size, and their mean weighted by the time
    spent at each size (sizes where either setting ran fewer than MIN_STEPS_PER_SIZE steps
    are left out)."""
    sizes: dict[int, dict[bool, list[tuple[StepRecord, float]]]] = {}
    for record, seconds in decode:
        sizes.setdefault(record.num_sequences, {True: [], False: []})[record.speculation_enabled].append(
            (record, seconds))
    rows, weighted, total = [], 0.0, 0.0
    for size in sorted(sizes):
        on, off = _rate(sizes[size][True]), _rate(sizes[size][False])
        ratio = _ratio(on, off)
        if ratio is None or on.steps < MIN_STEPS_PER_SIZE or off.steps < MIN_STEPS_PER_SIZE:
            continue
        rows.append({"sequences": size, "off_tokens_per_s": round(off.tokens_per_s, 2),
                     "on_tokens_per_s": round(on.tokens_per_s, 2), "off_steps": off.steps,
                     "on_steps": on.steps, "on_over_off": round(ratio, 4)})
        weight = on.seconds + off.seconds
        weighted += weight * ratio
        total += weight
    return (weighted / total if total else None), rows


def paired_periods(timed: list[tuple[StepRecord, float]], seed: int = 0) -> dict[str, Any]:
    """Each on-period (a run of consecutive steps planned with speculation on) over the
    off-periods beside it: median, geometric mean and its 95% bootstrap interval."""
    periods: list[tuple[bool, Rate]] = []
    start = 0
    for index in range(1, len(timed) + 1):
        if index == len(timed) or timed[index][0].speculation_enabled != timed[start][0].speculation_enabled:
            periods.append((timed[start][0].speculation_enabled, _rate(timed[start:index])))
            start = index
    ratios = []
    for index, (enabled, rate) in enumerate(periods):
        if not enabled or rate.tokens == 0:
            continue
        beside = [periods[j][1] for j in (index - 1, index + 1) if 0 <= j < len(periods)]
        off = Rate(sum(r.tokens for r in beside), sum(r.seconds for r in beside), 0, 0)
        if off.tokens and off.seconds > 0:
            ratios.append(rate.tokens_per_s / off.tokens_per_s)
    if not ratios:
        return {"num_pairs": 0}
    logs = [math.log(ratio) for ratio in ratios]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(BOOTSTRAP_SAMPLES))
    return {"num_pairs": len(ratios), "median": round(statistics.median(ratios), 4),
            "geometric_mean": round(math.exp(statistics.fmean(logs)), 4),
            "ci95": [round(math.exp(means[int(0.025 * BOOTSTRAP_SAMPLES)]), 4),
                     round(math.exp(means[int(0.975 * BOOTSTRAP_SAMPLES) - 1]), 4)]}


def at_common_size(decode: list[tuple[StepRecord, float]]) -> dict[str, Any] | None:
    """At the batch size most decode steps (`decode`) ran: off's steps, on's steps that
    drafted nothing (what being on costs by itself: the plan) and on's steps that drafted
    (what drafts bring), each with tokens/s and tokens a step. The drafting steps are split
    again: those with drafts the policy planned to pay, and those that only probed (one
    draft token a sequence to re-measure its acceptance: what exploring costs)."""
    if not decode:
        return None
    size = statistics.mode(record.num_sequences for record, _ in decode)
    at_size = [(record, seconds) for record, seconds in decode if record.num_sequences == size]
    groups = {
        "off": [t for t in at_size if not t[0].speculation_enabled],
        "on_without_drafts": [t for t in at_size if t[0].speculation_enabled and not t[0].num_draft_slots],
        "on_with_drafts": [t for t in at_size if t[0].speculation_enabled and t[0].num_draft_slots],
    }
    groups["on_with_planned_drafts"] = [t for t in groups["on_with_drafts"]
                                        if t[0].num_draft_slots > t[0].num_probes]
    groups["on_with_probes_only"] = [t for t in groups["on_with_drafts"]
                                     if t[0].num_draft_slots == t[0].num_probes]
    result: dict[str, Any] = {"sequences": size}
    for name, items in groups.items():
        rate = _rate(items)
        tokens_per_step = round(rate.tokens / rate.steps, 3) if rate.steps else None
        result[name] = {**rate_fields(rate), "tokens_per_step": tokens_per_step}
    return result


def summarise(records: Seq[StepRecord], seed: int = 0) -> dict[str, Any]:
    timed = list(zip(records, step_seconds(records)))
    decode = [t for t in timed if t[0].num_prefill_tokens == 0]
    summary: dict[str, Any] = {}
    for name, items in (("all_steps", timed), ("decode_steps", decode)):
        on = _rate([t for t in items if t[0].speculation_enabled])
        off = _rate([t for t in items if not t[0].speculation_enabled])
        ratio = _ratio(on, off)
        summary[name] = {"off": rate_fields(off), "on": rate_fields(on),
                         "on_over_off": None if ratio is None else round(ratio, 4)}
    ratio, sizes = by_batch_size(decode)
    summary["by_batch_size"] = {"on_over_off": None if ratio is None else round(ratio, 4), "sizes": sizes}
    summary["paired_periods"] = paired_periods(timed, seed)
    summary["at_common_size"] = at_common_size(decode)
    return summary


def rate_fields(rate: Rate) -> dict[str, Any]:
    return {"tokens": rate.tokens, "seconds": round(rate.seconds, 3), "steps": rate.steps,
            "draft_slots": rate.draft_slots, "tokens_per_s": round(rate.tokens_per_s, 2)}


def format_summary(concurrency: int, num_requests: int, seconds: float, period_s: float,
                   summary: dict[str, Any], switched: str = "speculation") -> str:
    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}x"

    lines = [f"concurrency {concurrency}: {num_requests} requests in {seconds:.1f} s, {switched} "
             f"switched every {period_s:g} s",
             f"  {'':16} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>8}  steps off / on, draft tokens on"]
    for name, label in (("all_steps", "all steps"), ("decode_steps", "decode steps")):
        row = summary[name]
        lines.append(f"  {label:16} {row['off']['tokens_per_s']:>10.2f} {row['on']['tokens_per_s']:>10.2f} "
                     f"{ratio(row['on_over_off']):>8}  {row['off']['steps']} / {row['on']['steps']}, "
                     f"{row['on']['draft_slots']}")
    sizes = summary["by_batch_size"]
    lines.append(f"  {'by batch size':16} {'':>10} {'':>10} {ratio(sizes['on_over_off']):>8}  "
                 f"decode steps, {len(sizes['sizes'])} batch sizes weighted by time")
    paired = summary["paired_periods"]
    if paired["num_pairs"]:
        low, high = paired["ci95"]
        lines.append(f"  {'paired periods':16} {'':>10} {'':>10} {ratio(paired['median']):>8}  median of "
                     f"{paired['num_pairs']}; geometric mean {paired['geometric_mean']:.3f}x "
                     f"[{low:.3f}, {high:.3f}] 95%")
    common = summary["at_common_size"]
    if common is not None:
        def group(name: str) -> str:
            row = common[name]
            if not row["steps"]:
                return "no steps"
            slots = f", {row['draft_slots'] / row['steps']:.1f} draft tokens" if row["draft_slots"] else ""
            return (f"{row['tokens_per_s']:.2f} tok/s "
                    f"({row['steps']} steps, {row['tokens_per_step']:.2f} tokens{slots} a step)")
        lines.append(f"  at {common['sequences']} sequences: off {group('off')}")
        lines.append(f"    on without drafts {group('on_without_drafts')}")
        lines.append(f"    on with drafts {group('on_with_drafts')}")
        lines.append(f"      of which planned drafts {group('on_with_planned_drafts')}")
        lines.append(f"      of which probes only {group('on_with_probes_only')}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the run

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specdec bench concurrency", description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    add_engine_config_args(parser, exclude=("seed",))
    parser.add_argument("--speculative-config", default=DEFAULT_SPECULATIVE_CONFIG)
    parser.add_argument("--dataset", default="builtin",
                        help=f"{' | '.join(SHIPPED_DATASETS)} or a JSONL file, as bench serve takes")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-concurrency", default="8,16", help="comma-separated; one run each")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="every request runs to --max-tokens (as vLLM's benchmark flag)")
    parser.add_argument("--period", type=float, default=0.25,
                        help="seconds between switches of speculation (off first); short periods "
                             "cancel the machine's drift better (8-16 steps each at the default)")
    parser.add_argument("--compare", choices=("speculation", "batch-invariance"), default="speculation",
                        help="what the switch turns on and off: speculation, or (speculation off) the C++ "
                             "stack's batch-invariant prefill attention against SDPA (VLLM_BATCH_INVARIANT)")
    parser.add_argument("--seed", type=int, default=0, help="for the bootstrap interval")
    parser.add_argument("--json", default=None, help="also write the figures here")
    add_logging_args(parser)
    return parser


def _prompt_ids(request: BenchRequest, tokenizer: Any) -> list[int]:
    """The ids the gateway would give the verifier for this request."""
    if request.messages is not None:
        return render_chat_prompt(tokenizer, request.messages)
    assert request.prompt is not None  # a request has messages or a prompt
    return tokenize_prompt(tokenizer, request.prompt)


async def _switch(engine: Engine, period_s: float, compare: str) -> None:
    while True:
        if compare == "speculation":
            engine.speculation_enabled = not engine.speculation_enabled
        else:
            stack = _cpu_stack(engine)
            stack.batch_invariant = not stack.batch_invariant
        await asyncio.sleep(period_s)


def _recorder(engine: Engine, records: list[StepRecord], compare: str) -> Callable[[StepRecord], None]:
    """The step listener: with --compare batch-invariance a step is filed under the stack's
    setting (the forward runs on the loop's thread and no await follows it in the step, so
    the setting when the step ends is the one its forward ran with), as "on" / "off"."""
    if compare == "speculation":
        return records.append
    stack = _cpu_stack(engine)
    return lambda record: records.append(dataclasses.replace(
        record, speculation_enabled=stack.batch_invariant))


def _cpu_stack(engine: Engine) -> CpuDecoderStack:
    """The C++ decoder stack whose batch_invariant --compare batch-invariance switches
    (`_run` refuses an engine without one before any of this runs)."""
    stack = engine.runner.forward
    assert isinstance(stack, CpuDecoderStack)
    return stack


async def _run(args: argparse.Namespace, levels: list[int],
               requests: list[BenchRequest]) -> list[dict[str, Any]]:
    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec is None:
        raise ConfigError("--speculative-config must name a method to compare with plain decoding",
                          param="speculative_config")
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = [_prompt_ids(request, tokenizer) for request in requests]
    longest = max(len(ids) for ids in prompts) + args.max_tokens + spec.num_speculative_tokens + 1
    if not args.max_model_len:
        args.max_model_len = longest
    if not args.num_gpu_blocks_override:  # every running sequence at its longest, and a spare
        args.num_gpu_blocks_override = max(max(levels) * -(-longest // args.block_size),
                                           -(-args.max_model_len // args.block_size)) + 16
    engine, drafter = await start_engine(args, spec, model_dir, max_num_seqs=max(levels))
    results = []
    try:
        if args.compare == "batch-invariance" and not isinstance(engine.runner.forward, CpuDecoderStack):
            raise ConfigError("--compare batch-invariance needs the C++ decoder stack (the CPU, bf16 or "
                              "fp32, AVX-512)", param="compare")
        # The policy's cost fits and acceptance rates, the kernels' first calls.
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        warm_up = SamplingParams(temperature=0.0, max_tokens=WARM_UP_TOKENS)
        await serve_all(engine, [ServeJob(ids, warm_up) for ids in prompts[:max(levels)]],
                        max(levels))
        for concurrency in levels:
            records: list[StepRecord] = []
            engine.speculation_enabled = args.compare == "speculation"  # the switch turns it off first
            if args.compare == "batch-invariance":
                _cpu_stack(engine).batch_invariant = True
            engine.step_listener = _recorder(engine, records, args.compare)
            switch = asyncio.create_task(_switch(engine, args.period, args.compare))
            started = time.perf_counter()
            try:
                await serve_all(engine, [ServeJob(ids, params) for ids in prompts], concurrency)
            finally:
                switch.cancel()
                engine.step_listener = None
                engine.speculation_enabled = True
                if args.compare == "batch-invariance":
                    _cpu_stack(engine).batch_invariant = batch_invariant_requested()
            seconds = time.perf_counter() - started
            summary = summarise(records, args.seed)
            print(format_summary(concurrency, len(prompts), seconds, args.period, summary, args.compare),
                  flush=True)
            results.append({"concurrency": concurrency, "num_requests": len(prompts),
                            "seconds": round(seconds, 3), **summary})
    finally:
        await engine.stop()
        await stop_drafter_server(drafter)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level, "specdec")
    try:
        levels = [int(value) for value in args.max_concurrency.split(",") if value.strip()]
    except ValueError:
        parser.error(f"--max-concurrency {args.max_concurrency!r}: comma-separated integers expected")
    if not levels or min(levels) < 1 or args.num_prompts < 1 or args.max_tokens < 1 or args.period <= 0:
        parser.error("--max-concurrency, --num-prompts and --max-tokens must be >= 1, --period > 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        requests = load_requests(args.dataset, args.num_prompts, max_tokens=args.max_tokens)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        results = asyncio.run(_run(args, levels, requests))
    except ConfigError as exc:
        logger.error("%s", exc.message)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "speculative_config": args.speculative_config,
                                               "dataset": args.dataset, "max_tokens": args.max_tokens,
                                               "period_s": args.period, "runs": results}, indent=2) + "\n")
    return 0
