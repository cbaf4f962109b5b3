"""`python -m specdec bench compare`: specdec against transformers and llama.cpp, side by side.

One process, one model, the same prompts (the chat template's token ids), greedy, the same
max tokens and the same CPU thread count for torch and llama.cpp. Each system is warmed up on
each prompt, then the systems take turns (the order rotates every repeat, so none always runs
first); tokens/s is output tokens over the wall time of a request, prefill included, median
over the repeats. Each row gives the ratio to specdec plain and to transformers plain (the
median of each repeat's ratio: see bench_compare_report), and
whether the output is identical to specdec plain's: token ids for specdec and transformers,
text for llama.cpp. llama.cpp reads the weights at specdec's precision by default (F32 for
float32, F16 for 16-bit dtypes, Q8_0 for weight-only int8; see `gguf_precision`), so the
speeds compare like with like;
its text may still differ where its kernels round differently.
The systems themselves live in `bench_compare_systems`.
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gateway.chat import render_chat_prompt
from specdec.cli import DefaultsHelpFormatter
from specdec.bench.compare_build import DEFAULT_NGRAM, build_systems, system_names
from specdec.bench.compare_report import format_table, summarise
from specdec.bench.compare_systems import (
    Generation,
    SpecdecEngine,
    System,
)
from specdec.bench.decode import PROMPTS
from specdec.bench.llama_cpp_system import (
    LlamaCppCrashed,
)
from specdec.bench.serve_requests import SHIPPED_DATASETS, load_requests
from specdec.config import SpeculativeConfig
from specdec.speculative_fields import TOKEN_MAP_METHODS
from specdec.device import resolve_device, resolve_dtype
from specdec.errors import ConfigError
from specdec.models.gguf_precision import (
    PRECISIONS,
)
from specdec.models.loader import load_model_config
from specdec.models.model_files import (
    DEFAULT_MODEL,
    load_tokenizer,
    resolve_model,
)

logger = logging.getLogger(__name__)

COMPARE_PROMPTS = {**PROMPTS,
                   "explain": "Explain to a ten-year-old how a bicycle stays upright."}
WARM_UP_TOKENS = 8


def shipped_draft_configs(num_speculative_tokens: int = 3) -> list[SpeculativeConfig]:
    """A config per draft shipped for the default model (`specdec.drafts`), by name; none
    when the package ships none (or has no `specdec.drafts` at all)."""
    try:
        from specdec.drafts import SHIPPED_DRAFTS, SHIPPED_TOKEN_MAP, shipped_draft_dir
    except ImportError:
        return []
    # Each as specdec serves it best: eagle and draft_model with the shipped token map.
    return [SpeculativeConfig.parse({"method": method, "model": name,
                                     "num_speculative_tokens": num_speculative_tokens,
                                     **({"speculative_token_map": SHIPPED_TOKEN_MAP}
                                        if method in TOKEN_MAP_METHODS else {})})
            for name, method in SHIPPED_DRAFTS.items() if shipped_draft_dir(name) is not None]


def select(names: Sequence[str], patterns: Sequence[str] | None) -> list[str]:
    """The names matching any of the comma-separated patterns (fnmatch); all when None."""
    if not patterns:
        return list(names)
    wanted = [p.strip() for group in patterns for p in group.split(",") if p.strip()]
    for pattern in wanted:
        if not fnmatch.filter(names, pattern):
            raise ConfigError(f"--systems: no system matches {pattern!r}; available: "
                              f"{', '.join(names)}", param="systems")
    return [name for name in names if any(fnmatch.fnmatch(name, p) for p in wanted)]


def prompt_messages(args: argparse.Namespace) -> dict[str, list[dict[str, str]]]:
    """Prompt name -> chat messages: the --prompt ones, or the first --num-prompts requests of
    --dataset (named NAME-1, NAME-2, ...; a file by its stem)."""
    if args.dataset is None:
        return {name: [{"role": "user", "content": COMPARE_PROMPTS[name]}]
                for name in args.prompt or list(COMPARE_PROMPTS)}
    if args.prompt:
        raise ConfigError("give --prompt or --dataset, not both", param="dataset")
    if args.num_prompts < 1:
        raise ConfigError("--num-prompts must be >= 1", param="num_prompts")
    try:
        requests = load_requests(args.dataset, args.num_prompts)
    except ValueError as exc:
        raise ConfigError(str(exc), param="dataset") from None
    return {f"{Path(args.dataset).stem}-{number}": request.messages or []
            for number, request in enumerate(requests, 1)}


# ------------------------------------------------------------------ the runs

async def measure(systems: list[System], prompts: dict[str, list[int]], max_tokens: int,
                  repeats: int, progress: bool = True) -> dict[str, dict[str, list[Generation]]]:
    """prompt -> system name -> its timed runs (warm-up excluded)."""
    from tqdm import tqdm

    results: dict[str, dict[str, list[Generation]]] = {}
    total = len(prompts) * len(systems) * (repeats + 1)
    with tqdm(total=total, unit="run", file=sys.stderr, disable=not progress) as bar:
        for prompt_name, prompt_ids in prompts.items():
            runs: dict[str, list[Generation]] = {system.name: [] for system in systems}
            for system in systems:
                await system.generate(prompt_ids, min(WARM_UP_TOKENS, max_tokens))
                bar.update()
            for repeat in range(repeats):
                shift = repeat % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    bar.set_description(f"{prompt_name} {system.name}")
                    runs[system.name].append(await system.generate(prompt_ids, max_tokens))
                    bar.update()
            results[prompt_name] = runs
    return results


# ------------------------------------------------------------------ the command

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="python -m specdec bench compare",
        description="tokens/s of specdec (plain and speculative), transformers generate() "
                    "(plain, prompt lookup, assisted) and llama.cpp (plain, prompt lookup) "
                    "on the same model and prompts, greedy")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"HF directory, .gguf file or {DEFAULT_MODEL!r} (default)")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--quantization", choices=["int8"], default=None,
                        help="specdec's engines as serve --quantization int8 (weight-only "
                             "int8); llama.cpp then reads Q8_0 (--llama-cpp-precision same); "
                             "transformers stays unquantised")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | npu")
    parser.add_argument("--speculative-config", action="append", default=None,
                        help="a specdec method to measure (repeatable; default: ngram k=3 "
                             "plus each draft shipped under specdec/drafts/)")
    parser.add_argument("--systems", action="append", default=None,
                        help="comma-separated names or fnmatch patterns (default: all): "
                             "specdec, specdec-METHOD, transformers, transformers-prompt-lookup, "
                             "transformers-assisted, llama.cpp, llama.cpp-prompt-lookup")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system and prompt")
    parser.add_argument("--prompt", action="append", choices=sorted(COMPARE_PROMPTS), default=None)
    parser.add_argument("--dataset", default=None,
                        help=f"instead of --prompt, requests of a bench serve dataset "
                             f"({' | '.join(SHIPPED_DATASETS)} or a JSONL file), as chat")
    parser.add_argument("--num-prompts", type=int, default=4,
                        help="with --dataset: its first N requests (default %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch and llama.cpp (default: torch's count)")
    parser.add_argument("--gguf", default=None,
                        help="GGUF file for llama.cpp (default: the model's own)")
    parser.add_argument("--llama-cpp-precision", default="same",
                        choices=["same", "file", *PRECISIONS],
                        help="weights llama.cpp reads: same (the file itself where specdec serves "
                             "a .gguf on its blocks, else F32 for float32, F16 for 16-bit "
                             "dtypes, Q8_0 with --quantization int8; another GGUF type is "
                             "converted once into the cache), file (the GGUF as it is), or "
                             "F32 / F16 / BF16 / Q8_0")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: min(2048, the model's))")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="specdec's engines never compile their forward (as serve "
                             "--enforce-eager; by default they compile as serve does)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--log-level", default="warning",
                        choices=["debug", "info", "warning", "error"])
    return parser


async def _compare(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    if args.max_tokens < 1 or args.repeats < 1:
        raise ConfigError("--max-tokens and --repeats must be >= 1", param="max_tokens")
    parsed = ([SpeculativeConfig.parse(text) for text in args.speculative_config]
              if args.speculative_config else [DEFAULT_NGRAM]
              + (shipped_draft_configs() if args.model.strip().lower() == DEFAULT_MODEL else []))
    specs = [spec for spec in parsed if spec is not None]
    kinds = system_names(specs)
    selected = select(list(kinds), args.systems)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    conversations = prompt_messages(args)
    prompt_names = list(conversations)
    prompts = {name: render_chat_prompt(tokenizer, messages) for name, messages in conversations.items()}
    max_model_len = args.max_model_len or min(
        2048, load_model_config(model_dir).max_position_embeddings)
    longest = max(len(ids) for ids in prompts.values()) + args.max_tokens + 1 + max(
        [spec.num_speculative_tokens for spec in specs] + [0])
    if longest > max_model_len:
        raise ConfigError(f"prompt + --max-tokens needs {longest} positions, more than "
                          f"--max-model-len {max_model_len}", param="max_tokens")
    engines: list[SpecdecEngine] = []
    systems: list[System] = []
    try:
        systems, unavailable = await build_systems(args, specs, selected, model_dir, tokenizer,
                                                   max_model_len, engines)
        if not systems:
            raise ConfigError("none of the selected systems can run here: " + "; ".join(
                f"{u.name}: {u.reason}" for u in unavailable), param="systems")
        results = await measure(systems, prompts, args.max_tokens, args.repeats,
                                not args.disable_tqdm)
    finally:
        for system in systems:
            await system.close()
        for engine in engines:
            await engine.stop()
    rows = summarise(results, kinds)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    report = {
        "model": args.model, "dtype": str(dtype).removeprefix("torch."),
        "quantization": args.quantization, "device": str(device),
        "threads": args.threads, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "prompts": {name: (COMPARE_PROMPTS[name] if args.dataset is None else messages)
                    for name, messages in conversations.items()},
        "systems": [{"name": s.name, "kind": s.kind, "description": s.description}
                    for s in systems],
        "skipped": [{"name": u.name, "kind": u.kind, "reason": u.reason} for u in unavailable],
        "rows": rows,
    }
    quantized = f" (weight-only {args.quantization})" if args.quantization else ""
    print(f"model {args.model}, {report['dtype']}{quantized} on {device}, {args.threads} threads, greedy, "
          f"max_tokens {args.max_tokens}, {args.repeats} timed runs per system and prompt")
    print("\n".join(f"  {s.name}: {s.description}" for s in systems))
    print(format_table(rows, unavailable, prompt_names))
    # In float32 speculation must not change a single token (docs/architecture.md); elsewhere a near-tie
    # may flip, so only float32 fails the command.
    broken = [row for row in rows if row["kind"] == "specdec" and row["system"] != "specdec"
              and row["identical_to_specdec"] is False]
    if broken and dtype == torch.float32:
        print("speculation changed the float32 output of: " + ", ".join(
            sorted({row["system"] for row in broken})), file=sys.stderr)
        return report, 1
    return report, 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s bench-compare %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":
        import transformers
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    args.threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        report, code = asyncio.run(_compare(args))
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except LlamaCppCrashed as exc:  # mid-run: the figures would lack a system
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return code
