"""`python -m specdec bench scale`: specdec against llama.cpp on the same GGUF file, by model
size and format.

For each preset (`specdec.bench.scale_models`: random Llamas near 0.5B to 3B, built and
cached on first use) and each format (F16, Q8_0, Q4_K_M, Q4_0, Q4_1), specdec serves the file as
it is (its quantized blocks on the C++ kernels; F16 as bf16) and llama.cpp
(llama-cpp-python, optional) loads the same file. One request at a time, plain greedy
decoding of `--max-tokens` tokens after the default chat prompt, the two systems
interleaved round by round so that the machine's drift falls on both; tokens/s over the
request's wall time (prefill included), the median of the rounds. Beside it the bytes a
decode step reads (the file's matrices: the layers' and the LM head's), the rate at which
each system read them, each system's resident memory (what loading and running the model
added to its process: each row runs in a fresh process of its own, llama.cpp in a child of
that) and the 1-minute load average at the row's end. A llama.cpp that crashes (see
`specdec.bench.llama_cpp_system`) is named on stderr and its cells say so; specdec's figures
stand.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import multiprocessing
import os
import statistics
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from gateway.chat import render_chat_prompt
from specdec.bench.compare_systems import SpecdecEngine, SpecdecSystem, System
from specdec.bench.llama_cpp_child import resident_mb
from specdec.bench.llama_cpp_system import (
    LLAMA_CPP_MISSING,
    LlamaCppCrashed,
    LlamaCppSystem,
    llama_cpp_installed,
)
from specdec.bench.scale_models import FORMATS, SIZES, build_gguf
from specdec.cli import DefaultsHelpFormatter, setup_logging
from specdec.models.model_files import DEFAULT_MODEL, default_cache_dir, load_tokenizer, resolve_model

logger = logging.getLogger(__name__)

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MAX_MODEL_LEN = 1024


def decode_bytes(gguf_path: Path) -> int:
    """Bytes of the matrices a decode step reads: every layer's and the LM head (the output
    matrix, else the tied embedding); an untied embedding is only gathered from."""
    import gguf

    tensors = [t for t in gguf.GGUFReader(gguf_path).tensors if t.data.ndim == 2 or len(t.shape) > 1]
    names = {t.name for t in tensors}
    return sum(int(t.n_bytes) for t in tensors
               if not (t.name == "token_embd.weight" and "output.weight" in names))


async def _interleaved(systems: list[System], prompt_ids: list[int], max_tokens: int, rounds: int,
                       failures: dict[str, str]) -> dict[str, list[float]]:
    """tok/s of each system per round, after one warm-up run each. A llama.cpp that dies is
    left out from then on, with why in `failures`."""
    running = list(systems)
    speeds: dict[str, list[float]] = {system.name: [] for system in systems}
    for round_index in range(-1, rounds):  # -1: the warm-up
        order = running if round_index % 2 == 0 else running[::-1]
        for system in order:
            try:
                generation = await system.generate(prompt_ids, max_tokens)
            except LlamaCppCrashed as crash:
                failures[system.name] = str(crash)
                running.remove(system)
                continue
            if round_index >= 0:
                speeds[system.name].append(generation.num_output_tokens / generation.seconds)
    return speeds


async def measure(preset: str, precision: str, args: argparse.Namespace, tokenizer_dir: Path) -> dict[str, Any]:
    gguf_path = build_gguf(preset, precision, args.cache_dir, tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    prompt_ids = render_chat_prompt(tokenizer, [{"role": "user", "content": PROMPT}])
    failures: dict[str, str] = {}
    resolve_model(str(gguf_path))  # its conversion (once) before the baseline: not the model's memory
    gc.collect()
    resident_before = resident_mb()
    engine = await SpecdecEngine.start(gguf_path, str(gguf_path), "auto", "cpu", None, MAX_MODEL_LEN)
    systems: list[System] = [SpecdecSystem("specdec", engine, speculate=False, tokenizer=tokenizer)]
    llama_cpp: LlamaCppSystem | None = None
    if args.llama_cpp and llama_cpp_installed():
        try:
            llama_cpp = LlamaCppSystem("llama.cpp", gguf_path, args.threads, MAX_MODEL_LEN, None)
            systems.append(llama_cpp)
        except LlamaCppCrashed as crash:
            failures["llama.cpp"] = str(crash)
    try:
        speeds = await _interleaved(systems, prompt_ids, args.max_tokens, args.rounds, failures)
        specdec_mb = resident_mb() - resident_before
    finally:
        for system in systems:
            await system.close()
        await engine.stop()
    row: dict[str, Any] = {"preset": preset, "format": precision, "file_mb": gguf_path.stat().st_size / 1e6,
                           "decode_mb": decode_bytes(gguf_path) / 1e6, "failures": failures,
                           "memory_mb": {"specdec": specdec_mb}, "load": os.getloadavg()[0]}
    if llama_cpp is not None and "llama.cpp" not in failures:
        row["memory_mb"]["llama.cpp"] = llama_cpp.model_mb
    for name, values in speeds.items():
        if values:
            row[name] = statistics.median(values)
            row[f"{name} rounds"] = values
    return row


def measure_in_process(preset: str, precision: str, args: argparse.Namespace, tokenizer_dir: Path) -> dict[str, Any]:
    """`measure` in a fresh process, so that the row's memory is what its own model adds (in one
    process a later row would reuse what an earlier one freed)."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_measure_row, args=(sender, preset, precision, vars(args), tokenizer_dir),
                              name=f"bench scale {preset} {precision}")
    process.start()
    sender.close()
    try:
        outcome, value = receiver.recv()
    except EOFError:
        outcome, value = "error", f"its process ended ({process.exitcode}) before its row"
    finally:
        process.join()
    if outcome == "error":
        raise RuntimeError(f"bench scale {preset} {precision}: {value}")
    return value


def _measure_row(sender: Connection, preset: str, precision: str, args: dict[str, Any], tokenizer_dir: Path) -> None:
    setup_logging(args["log_level"], "specdec")
    torch.set_num_threads(args["threads"])
    try:
        sender.send(("row", asyncio.run(measure(preset, precision, argparse.Namespace(**args), tokenizer_dir))))
    except Exception:
        sender.send(("error", traceback.format_exc()))
    finally:
        sender.close()


TABLE_HEADER = ("| model | format | file MB | MB read a token | specdec tok/s (GB/s) "
                "| llama.cpp tok/s (GB/s) | ratio | specdec MB | llama.cpp MB | load |\n"
                "|---|---|---|---|---|---|---|---|---|---|")


def format_row(row: dict[str, Any]) -> str:
    cells = []
    for name in ("specdec", "llama.cpp"):
        speed = row.get(name)
        if speed is not None:
            cells.append(f"{speed:.1f} ({speed * row['decode_mb'] / 1e3:.1f})")
        else:
            cells.append("crashed" if name in row["failures"] else "-")
    ratio = f"{row['specdec'] / row['llama.cpp']:.2f}x" if row.get("llama.cpp") else "-"
    memory = [f"{row['memory_mb'][name]:.0f}" if name in row["memory_mb"] else "-"
              for name in ("specdec", "llama.cpp")]
    return (f"| {row['preset']} | {row['format']} | {row['file_mb']:.0f} | {row['decode_mb']:.0f} | "
            f"{cells[0]} | {cells[1]} | {ratio} | {memory[0]} | {memory[1]} | {row['load']:.1f} |")


def add_scale_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", default="0.8b",
                        help=f"comma-separated: {', '.join(SIZES)} (135m: the default model itself)")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated: {', '.join(FORMATS)}")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per system (after a warm-up)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="CPU threads for both systems (torch's and llama.cpp's)")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir() / "scale",
                        help="where the random models are built and kept")
    parser.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false",
                        help="measure specdec alone")
    parser.add_argument("--tokenizer-model", default=DEFAULT_MODEL,
                        help="the model whose tokenizer, chat template and vocabulary the random models take")
    parser.add_argument("--log-level", default="warning")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec bench scale", description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    add_scale_args(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level, "specdec")
    torch.set_num_threads(args.threads)
    presets = [name.strip() for name in args.presets.split(",")]
    formats = [name.strip() for name in args.formats.split(",")]
    unknown = [name for name in presets if name not in SIZES] + [name for name in formats if name not in FORMATS]
    if unknown:
        parser.error(f"unknown preset or format: {', '.join(unknown)}")
    if args.llama_cpp and not llama_cpp_installed():
        print(f"llama.cpp: {LLAMA_CPP_MISSING}; measuring specdec alone", file=sys.stderr)
    tokenizer_dir = resolve_model(args.tokenizer_model)
    # Row by row, so that a long run (or a crash inside llama.cpp) leaves what it measured.
    print(TABLE_HEADER, flush=True)
    for preset in presets:
        for precision in formats:
            row = measure_in_process(preset, precision, args, tokenizer_dir)
            for reason in row["failures"].values():
                print(f"{preset} {precision}: {reason}", file=sys.stderr, flush=True)
            print(format_row(row), flush=True)
    return 0
