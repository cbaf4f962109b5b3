"""`python -m specdec bench`: tokens/s of one request with and without speculation.

Both modes run in one process on one engine, alternating, so they see the same machine
state: plain decoding is the same request with speculation turned off per request. The
drafter is a real drafter service on a loopback port, as in production.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from dataclasses import dataclass

import torch

from drafter_svc.server import start_drafter_server, stop_drafter_server
from specdec.cli import add_engine_args, add_logging_args, add_model_args
from specdec.config import SpeculativeConfig
from specdec.models.model_files import load_tokenizer, resolve_model
from specdec.sampling_params import SamplingParams
from specdec.sequence import SpeculationCounters
from verifier_svc.builder import VerifierConfig, build_engine
from verifier_svc.engine import Engine, EngineError

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


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    add_engine_args(parser)
    parser.add_argument("--speculative-config",
                        default='{"method": "ngram", "num_speculative_tokens": 3, '
                                '"prompt_lookup_min": 2, "prompt_lookup_max": 5}',
                        help="the speculation to compare with plain decoding")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each mode per prompt; the median is reported")
    parser.add_argument("--prompt", action="append", choices=sorted(PROMPTS), default=None)
    parser.add_argument("--json", default=None, help="also write the figures here")
    add_logging_args(parser)


async def _generate(engine: Engine, prompt_ids: list[int], max_tokens: int,
                    num_speculative_tokens: int | None) -> RunResult:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    started = time.perf_counter()
    seq_id, queue = engine.add_request("bench", prompt_ids, params, num_speculative_tokens)
    token_ids: list[int] = []
    while True:
        output = await queue.get()
        if isinstance(output, EngineError):
            raise RuntimeError(str(output))
        token_ids.extend(output.token_ids)
        if output.finish_reason is not None:
            return RunResult(token_ids, time.perf_counter() - started, output.spec)


async def _bench(args: argparse.Namespace) -> list[dict[str, object]]:
    spec = SpeculativeConfig.parse(args.speculative_config)
    assert spec is not None
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    drafter, drafter_port = await start_drafter_server(spec, "127.0.0.1", 0)
    config = VerifierConfig(
        model=str(model_dir), dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len or 2048, max_num_seqs=4,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks_override=args.num_gpu_blocks_override or 512,
        speculative_config=spec, drafter_targets=(f"127.0.0.1:{drafter_port}",),
        draft_timeout_s=args.draft_timeout_ms / 1000 if args.draft_timeout_ms else None)
    engine, _ = build_engine(config)
    await engine.start()
    rows: list[dict[str, object]] = []
    try:
        for name in args.prompt or sorted(PROMPTS):
            prompt_ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": PROMPTS[name]}], add_generation_prompt=True,
                tokenize=True, return_dict=False)
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


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = asyncio.run(_bench(args))
    print(f"{'prompt':8} {'method':8} {'tokens':>6} {'plain tok/s':>11} {'spec tok/s':>10} "
          f"{'speedup':>7} {'accept':>6} {'mean len':>8} identical  per-position")
    for row in rows:
        print(f"{row['prompt']:8} {row['method']:8} {row['output_tokens']:>6} "
              f"{row['plain_tokens_per_s']:>11} {row['spec_tokens_per_s']:>10} "
              f"{row['speedup']:>6}x {row['acceptance_rate']:>6} "
              f"{row['mean_acceptance_length']:>8} {str(row['identical_output']):9}  "
              f"{row['per_position_acceptance']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    return 0 if all(row["identical_output"] for row in rows) else 1
