"""`python -m specdec bench`: tokens/s and acceptance with and without speculation.

Both modes run in one process on one engine, alternating, so they see the same machine
state: plain decoding is the same request with speculation turned off per request. The
drafter is a real drafter service on a loopback port, as in production.

Two ways to use it:
- one speculation (`--speculative-config`) on the two built-in prompts (`--prompt`),
  per-prompt rows (the original mode);
- the drafts specdec ships (`--drafts shipped`, or names / paths, comma-separated) on the
  held-out chat prompts (`--prompts heldout`, never trained on) at each of
  `--temperatures`: per draft and temperature the acceptance rate, mean acceptance length
  (accepted + 1 per verify step), per-position acceptance, tokens/s and the speedup over
  plain decoding measured in the same run. `--write-cards` stores the figures in each
  shipped draft's bench.json and README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from drafter_svc.proposer import ModelOptions
from drafter_svc.server import start_drafter_server, stop_drafter_server
from gateway.chat import render_chat_prompt
from specdec.cli import add_logging_args
from specdec.config import SpeculativeConfig
from specdec.config_flags import add_config_args, build_config
from specdec.device import resolve_device, resolve_dtype
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import SpeculationCounters
from specdec.models.model_files import load_tokenizer, resolve_model
from specdec.rpc.grpc_server import GrpcServer
from verifier_svc.builder import VerifierConfig, build_engine
from specdec.engine.engine import Engine
from verifier_svc.requests import collect_outputs

logger = logging.getLogger(__name__)

PROMPTS = {
    "repeat": (
        "Repeat the following paragraph exactly, word for word:\n\n"
        "The quick brown fox jumps over the lazy dog. The dog, startled, runs into the forest "
        "where it meets a wise old owl. The owl tells the dog that the fox is not its enemy, "
        "only a friend who likes to play games. The dog returns to the field and the two of "
        "them play together until the sun goes down."),
    "open": "Write a short story about a robot who learns to paint.",
}


@dataclass
class RunResult:
    token_ids: list[int]
    seconds: float
    spec: SpeculationCounters | None


# The verifier's fields a bench sets itself (it starts its own drafter), not flags.
BENCH_SET_FIELDS = ("speculative_config", "drafter_targets", "drafter_wait_s")


def add_engine_config_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """The verifier's flags, as the benches that build an engine in-process take them."""
    add_config_args(parser, VerifierConfig, exclude=BENCH_SET_FIELDS + exclude)


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    add_engine_config_args(parser)
    parser.add_argument("--speculative-config",
                        default='{"method": "ngram", "num_speculative_tokens": 3, '
                                '"prompt_lookup_min": 2, "prompt_lookup_max": 5}',
                        help="the speculation to compare with plain decoding")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each mode per prompt; the median is reported")
    parser.add_argument("--prompt", action="append", choices=sorted(PROMPTS), default=None)
    parser.add_argument("--json", default=None, help="also write the figures here")
    drafts = parser.add_argument_group("trained drafts")
    drafts.add_argument("--drafts", default=None,
                        help="'shipped' (every draft specdec ships) or comma-separated shipped names "
                             "or draft directories; replaces --speculative-config")
    drafts.add_argument("--prompts", default="heldout",
                        help="with --drafts: 'heldout' (specdec/prompts/heldout_chat.jsonl) or a JSONL "
                             "file of {\"messages\": [...]} lines")
    drafts.add_argument("--num-prompts", type=int, default=None, help="the first N prompts only")
    drafts.add_argument("--temperatures", default="0,0.7", help="comma-separated")
    drafts.add_argument("--num-speculative-tokens", type=int, default=4, help="k, drafted as a chain")
    drafts.add_argument("--token-map", default=None,
                        help="with --drafts: also bench each eagle and draft_model draft with its LM head "
                             "cut to this token map (a file or a shipped map name; rows named "
                             "'<draft> +map'), beside the draft as it is")
    drafts.add_argument("--write-cards", action="store_true",
                        help="write bench.json and README.md into each shipped draft measured")
    add_logging_args(parser)


async def _generate(engine: Engine, prompt_ids: list[int], max_tokens: int,
                    num_speculative_tokens: int | None, temperature: float = 0.0,
                    seed: int | None = None) -> RunResult:
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    started = time.perf_counter()
    _, queue = engine.add_request("bench", prompt_ids, params, num_speculative_tokens)
    token_ids, spec = await collect_outputs(queue)
    return RunResult(token_ids, time.perf_counter() - started, spec)


@dataclass(frozen=True, slots=True)
class ServeJob:
    """One request of a load run: its prompt ids, parameters and optional compiled grammar."""

    prompt_ids: list[int]
    params: SamplingParams
    grammar: Any = None


async def serve_all(engine: Engine, jobs: list[ServeJob], concurrency: int) -> int:
    """Runs `jobs` through `engine`, at most `concurrency` at once; the tokens they output."""
    limit = asyncio.Semaphore(concurrency)

    async def one(index: int, job: ServeJob) -> int:
        async with limit:
            _, queue = engine.add_request(f"bench-{index}", job.prompt_ids, job.params,
                                          grammar=job.grammar)
            token_ids, _ = await collect_outputs(queue)
            return len(token_ids)

    return sum(await asyncio.gather(*(one(index, job) for index, job in enumerate(jobs))))


async def start_engine(args: argparse.Namespace, spec: SpeculativeConfig, model_dir: Path,
                 max_num_seqs: int = 4, adaptive: bool | None = None) -> tuple[Engine, GrpcServer]:
    """A drafter server and an engine using it, the other settings from the verifier's
    flags in `args`; `adaptive` None: the --speculation-policy flag."""
    options = ModelOptions(target_model=str(model_dir), dtype=args.dtype, device=args.device)
    drafter, drafter_port = await start_drafter_server(spec, "127.0.0.1", 0, options=options)
    given: dict[str, object] = {} if adaptive is None else {"adaptive_speculation": adaptive}
    # The model as given (a name, directory or .gguf), as `serve` gives it: a GGUF (the default
    # model's Q4_1 file included) then runs on its blocks, as served.
    config = build_config(
        VerifierConfig, args, model=args.model, max_model_len=args.max_model_len or 2048,
        max_num_seqs=max_num_seqs, num_kv_blocks=args.num_gpu_blocks_override or 512,
        speculative_config=spec, drafter_targets=(f"127.0.0.1:{drafter_port}",), compile=None,
        **given)
    try:
        engine, _ = build_engine(config)
    except BaseException:
        await stop_drafter_server(drafter)
        raise
    await engine.start()
    if engine.drafter_pool is not None and not await engine.drafter_pool.wait_for_healthy(1, timeout_s=120.0):
        logger.warning("the drafter is not healthy: speculative runs may decode plainly")
    return engine, drafter


async def _bench(args: argparse.Namespace) -> list[dict[str, object]]:
    spec = SpeculativeConfig.parse(args.speculative_config)
    assert spec is not None
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    engine, drafter = await start_engine(args, spec, model_dir)
    rows: list[dict[str, object]] = []
    try:
        for name in args.prompt or sorted(PROMPTS):
            prompt_ids = render_chat_prompt(tokenizer, [{"role": "user", "content": PROMPTS[name]}])
            await _generate(engine, prompt_ids, 8, 0)  # warm-up
            runs: dict[str, list[RunResult]] = {"plain": [], spec.method: []}
            for _ in range(args.repeats):
                runs["plain"].append(await _generate(engine, prompt_ids, args.max_tokens, 0))
                runs[spec.method].append(await _generate(engine, prompt_ids, args.max_tokens, None))
            rows.append(_summarise(name, runs, spec.method))
    finally:
        await engine.stop()
        await stop_drafter_server(drafter)
    return rows


def _summarise(prompt: str, runs: dict[str, list[RunResult]], method: str) -> dict[str, object]:
    def tokens_per_s(results: list[RunResult]) -> float:
        return statistics.median(len(r.token_ids) / r.seconds for r in results)

    plain, speculative = runs["plain"], runs[method]
    spec = speculative[-1].spec or SpeculationCounters()
    num_drafts = max(1, spec.num_drafts)
    return {
        "prompt": prompt,
        "method": method,
        "output_tokens": len(plain[-1].token_ids),
        "plain_tokens_per_s": round(tokens_per_s(plain), 2),
        "spec_tokens_per_s": round(tokens_per_s(speculative), 2),
        "speedup": round(tokens_per_s(speculative) / tokens_per_s(plain), 3),
        "acceptance_rate": round(spec.num_accepted_tokens / max(1, spec.num_draft_tokens), 3),
        "mean_acceptance_length": round(1 + spec.num_accepted_tokens / num_drafts, 3),
        "per_position_acceptance": [round(n / num_drafts, 3) for n in spec.accepted_per_position],
        "identical_output": all(r.token_ids == plain[0].token_ids for r in plain + speculative),
    }


# ------------------------------------------------------------ trained drafts on held-out prompts


def _draft_specs(value: str, k: int, token_map: str | None = None) -> list[tuple[str, SpeculativeConfig]]:
    """(name, config) per draft named in --drafts; the method comes from the shipped table or the name.
    With `token_map`, each draft a map applies to comes twice: as it is, then named '<name> +map'."""
    from specdec.speculative_fields import TOKEN_MAP_METHODS
    from specdec.drafts import SHIPPED_DRAFTS, shipped_draft_dir

    names = list(SHIPPED_DRAFTS) if value.strip() == "shipped" else [v.strip() for v in value.split(",") if v.strip()]
    specs = []
    for name in names:
        if name in SHIPPED_DRAFTS and shipped_draft_dir(name) is None:
            logger.warning("shipped draft %s is not installed: skipped", name)
            continue
        raw: dict[str, object] = {"model": name, "num_speculative_tokens": k}
        if name in SHIPPED_DRAFTS:
            raw["method"] = SHIPPED_DRAFTS[name]
        spec = SpeculativeConfig.parse(raw)
        specs.append((name, spec))
        if token_map is not None and spec.method in TOKEN_MAP_METHODS:
            specs.append((f"{name} +map", SpeculativeConfig.parse({**raw, "method": spec.method,
                                                                    "speculative_token_map": token_map})))
    return specs


def _prompt_texts(value: str, limit: int | None) -> list[str]:
    from specdec.train.prompts import heldout_prompts

    if value == "heldout":
        texts = heldout_prompts()
    else:
        texts = [json.loads(line)["messages"][-1]["content"]
                 for line in Path(value).read_text().splitlines() if line.strip()]
    return texts[:limit] if limit else texts


def _aggregate(name: str, method: str, temperature: float, plain: list[RunResult],
               speculative: list[RunResult]) -> dict[str, object]:
    """One row over all prompts: token-weighted tokens/s, summed speculation counters."""
    counters = SpeculationCounters()
    for result in speculative:
        spec = result.spec or SpeculationCounters()
        counters.num_drafts += spec.num_drafts
        counters.num_draft_tokens += spec.num_draft_tokens
        counters.num_accepted_tokens += spec.num_accepted_tokens
        for position, count in enumerate(spec.accepted_per_position):
            if position >= len(counters.accepted_per_position):
                counters.accepted_per_position.append(0)
            counters.accepted_per_position[position] += count
    num_drafts = max(1, counters.num_drafts)
    plain_tps = sum(len(r.token_ids) for r in plain) / sum(r.seconds for r in plain)
    spec_tps = sum(len(r.token_ids) for r in speculative) / sum(r.seconds for r in speculative)
    return {
        "draft": name, "method": method, "temperature": temperature, "num_prompts": len(plain),
        "output_tokens": sum(len(r.token_ids) for r in speculative),
        "acceptance_rate": round(counters.num_accepted_tokens / max(1, counters.num_draft_tokens), 3),
        "mean_acceptance_length": round(1 + counters.num_accepted_tokens / num_drafts, 3),
        "per_position_acceptance": [round(n / num_drafts, 3) for n in counters.accepted_per_position],
        "plain_tokens_per_s": round(plain_tps, 2), "spec_tokens_per_s": round(spec_tps, 2),
        "speedup": round(spec_tps / plain_tps, 3),
        "identical_output": all(p.token_ids == s.token_ids for p, s in zip(plain, speculative)),
    }


async def _bench_drafts(args: argparse.Namespace) -> list[dict[str, object]]:
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = [render_chat_prompt(tokenizer, [{"role": "user", "content": text}])
               for text in _prompt_texts(args.prompts, args.num_prompts)]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    rows: list[dict[str, object]] = []
    for name, spec in _draft_specs(args.drafts, args.num_speculative_tokens, args.token_map):
        # Fixed speculation: every step drafts k tokens as a chain, so acceptance is per position.
        engine, drafter = await start_engine(args, spec, model_dir, adaptive=False)
        try:
            # Warm-up at full length in both modes: the first runs of each shape pay for
            # allocation and kernel selection, which would count against whichever mode came first.
            await _generate(engine, prompts[0], args.max_tokens, None)
            await _generate(engine, prompts[0], args.max_tokens, 0)
            for temperature in temperatures:
                plain: list[RunResult] = []
                speculative: list[RunResult] = []
                for index, prompt_ids in enumerate(prompts):
                    seed = index if temperature > 0 else None  # the same seed in both modes
                    plain.append(await _generate(engine, prompt_ids, args.max_tokens, 0, temperature, seed))
                    speculative.append(await _generate(engine, prompt_ids, args.max_tokens, None,
                                                       temperature, seed))
                row = _aggregate(name, spec.method, temperature, plain, speculative)
                row["token_map"] = spec.speculative_token_map
                logger.info("%s", row)
                rows.append(row)
        finally:
            await engine.stop()
            await stop_drafter_server(drafter)
    return rows


def _write_cards(rows: list[dict[str, object]], args: argparse.Namespace) -> None:
    from specdec.drafts import shipped_draft_dir
    from specdec.train.card import write_card

    def draft_name(row: dict[str, object]) -> str:  # a '<name> +map' row belongs to <name>'s card
        return str(row["draft"]).removesuffix(" +map")

    for name in dict.fromkeys(draft_name(row) for row in rows):
        directory = shipped_draft_dir(name)
        if directory is None:
            continue
        device = resolve_device(args.device)
        bench = {"k": args.num_speculative_tokens, "max_tokens": args.max_tokens,
                 "num_prompts": rows[0]["num_prompts"],
                 "dtype": str(resolve_dtype(args.dtype, device)).removeprefix("torch."), "device": device.type,
                 "rows": [row for row in rows if draft_name(row) == name]}
        (directory / "bench.json").write_text(json.dumps(bench, indent=2) + "\n")
        write_card(directory)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.drafts:
        rows = asyncio.run(_bench_drafts(args))
        print(f"{'draft':30} {'temp':>4} {'accept':>6} {'mean len':>8} {'plain tok/s':>11} {'spec tok/s':>10} "
              f"{'speedup':>7} identical  per-position")
        for row in rows:
            print(f"{row['draft']:30} {row['temperature']:>4} {row['acceptance_rate']:>6} "
                  f"{row['mean_acceptance_length']:>8} {row['plain_tokens_per_s']:>11} "
                  f"{row['spec_tokens_per_s']:>10} {row['speedup']:>6}x {str(row['identical_output']):9}  "
                  f"{row['per_position_acceptance']}")
        if args.write_cards:
            _write_cards(rows, args)
        return _finish(args, rows, [row for row in rows if row["temperature"] == 0])
    rows = asyncio.run(_bench(args))
    print(f"{'prompt':8} {'method':8} {'tokens':>6} {'plain tok/s':>11} {'spec tok/s':>10} "
          f"{'speedup':>7} {'accept':>6} {'mean len':>8} identical  per-position")
    for row in rows:
        print(f"{row['prompt']:8} {row['method']:8} {row['output_tokens']:>6} "
              f"{row['plain_tokens_per_s']:>11} {row['spec_tokens_per_s']:>10} "
              f"{row['speedup']:>6}x {row['acceptance_rate']:>6} "
              f"{row['mean_acceptance_length']:>8} {str(row['identical_output']):9}  "
              f"{row['per_position_acceptance']}")
    return _finish(args, rows, rows)


def _finish(args: argparse.Namespace, rows: list[dict[str, object]],
            greedy_rows: list[dict[str, object]]) -> int:
    """Writes --json; the exit status is 1 when speculation changed a greedy float32 output
    (in 16-bit dtypes a near-tie may flip, see docs/architecture.md, so there it is reported only)."""
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    if resolve_dtype(args.dtype, resolve_device(args.device)) != torch.float32:
        return 0
    return 0 if all(row["identical_output"] for row in greedy_rows) else 1
