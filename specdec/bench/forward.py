"""`python -m specdec bench forward`: one verifier forward, per kernel path, side by side.

Loads the model once per path (dtype x linear kernel), then times forwards over 1 and over
1 + k tokens against a cached context (and with `--prefill-len N` a prompt's prefill of N
tokens), alternating the paths so they see the same machine
state; prints the median and the minimum per path, the weight-reading bound at each
dtype, and with `--profile` the torch profiler's table for one path.

The bound is the weight bytes over one read bandwidth measured at the end, but this
machine's reads swing between ~28 and ~60 GB/s from one minute to the next, so a median
forward over a whole run against a bandwidth measured once may compare a slow phase with a
fast one (in one run 1.36x, where reads paired with the forwards gave 1.16x). So each
repeat also reads as many bytes as the path's weights (a sum, just before and just after
the path's forwards) and the table gives that read's median time and the median of each
forward over its own repeat's faster read: the ratio that does not depend on the phase.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from specdec.cli import DefaultsHelpFormatter
from specdec.engine.kv_cache import KVCache
from specdec.layers.attention import AttentionMetadata
from specdec.models.compiled_forward import CompiledForward, linears_to_pack, warm_up
from specdec.models.cpu_stack import CpuDecoderStack
from specdec.models.gguf_linear import GgufLinear
from specdec.models.gguf_model import gguf_file_of, load_gguf_model
from specdec.models.llama import LlamaForCausalLM
from specdec.models.loader import load_model
from specdec.models.model_files import DEFAULT_MODEL, resolve_model
from specdec.models.packed_linear import pack_linears

# name -> (dtype, packed kernel or None, forward: eager, compiled or the C++ stack). The
# verifier's CPU default is bf16-stack (fp32-stack with --dtype float32) where specdec's
# kernels build, bf16-compiled (oneDNN) where they do not. *-stack-sdpa: the stack with a
# prefill segment's attention by torch's SDPA (VLLM_BATCH_INVARIANT=0), for its cost.
PATHS: dict[str, tuple[torch.dtype, str | None, str]] = {
    "fp32": (torch.float32, None, "eager"),
    "fp32-onednn": (torch.float32, "mkldnn", "eager"),
    "fp32-compiled": (torch.float32, None, "compiled"),
    "fp32-cpu": (torch.float32, "cpu", "eager"),
    "fp32-cpu-compiled": (torch.float32, "cpu", "compiled"),
    "fp32-stack": (torch.float32, "cpu", "stack"),
    "fp32-stack-sdpa": (torch.float32, "cpu", "stack-sdpa"),
    "fp32-int8-stack": (torch.float32, "int8", "stack"),
    "bf16": (torch.bfloat16, None, "eager"),
    "bf16-onednn": (torch.bfloat16, "mkldnn", "eager"),
    "bf16-compiled": (torch.bfloat16, "mkldnn", "compiled"),
    "bf16-cpu": (torch.bfloat16, "cpu", "eager"),
    "bf16-cpu-compiled": (torch.bfloat16, "cpu", "compiled"),
    "bf16-stack": (torch.bfloat16, "cpu", "stack"),
    "bf16-stack-sdpa": (torch.bfloat16, "cpu", "stack-sdpa"),
    "bf16-int8": (torch.bfloat16, "int8", "eager"),
    "bf16-int8-stack": (torch.bfloat16, "int8", "stack"),
    # The model's GGUF file on its own blocks (the default model's Q4_1, or a .gguf --model).
    "fp32-gguf-stack": (torch.float32, "gguf", "stack"),
    "bf16-gguf-stack": (torch.bfloat16, "gguf", "stack"),
    # The same with the kernel's AMX path off (bf16 rows by vdpbf16ps, as on a CPU without AMX).
    "bf16-gguf-noamx-stack": (torch.bfloat16, "gguf-noamx", "stack"),
}
BLOCK_SIZE = 16


@dataclass
class Path:
    name: str
    model: LlamaForCausalLM
    forward: LlamaForCausalLM | CompiledForward | CpuDecoderStack  # the model, or a faster forward of it
    kv_cache: KVCache
    weight_bytes: int
    gguf_amx: bool | None = None  # the GGUF kernel's AMX setting its forwards run under


def _load(model_dir, name: str, num_blocks: int, model_name: str) -> Path:
    dtype, kernel, kind = PATHS[name]
    compiled = kind == "compiled"
    gguf_amx = None
    if kernel == "gguf-noamx":
        kernel, gguf_amx = "gguf", False
    if kernel == "gguf":
        gguf_path = gguf_file_of(model_name)
        if gguf_path is None:
            raise SystemExit(f"path {name} needs a GGUF --model (a .gguf file or the default model)")
        model = load_gguf_model(gguf_path, model_dir, dtype, torch.device("cpu"))
        kernel = "cpu"  # for the linears the file holds dense
    else:
        model = load_model(model_dir, dtype, torch.device("cpu"))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes += sum(m.packed.numel() for m in model.modules() if isinstance(m, GgufLinear))  # a GGUF's blocks
    if kernel == "int8":  # a byte a linear weight (a tied head's included: the int8 copy is read)
        weight_bytes -= sum(linear.weight.numel() * (linear.weight.element_size() - 1)
                            for linear in model.modules() if isinstance(linear, nn.Linear))
    if kernel is not None:
        pack_linears(model, kernel, only=linears_to_pack(kernel) if compiled else None)
    kv_cache = KVCache.allocate(model.config, num_blocks, BLOCK_SIZE, dtype, torch.device("cpu"))
    for cache in kv_cache.key_caches + kv_cache.value_caches:
        cache.zero_()
    forward: LlamaForCausalLM | CpuDecoderStack | CompiledForward = model
    if kind in ("stack", "stack-sdpa"):
        stack = CpuDecoderStack(model)
        stack.batch_invariant = kind == "stack"
        forward = stack
    if compiled:  # as the verifier builds it: warmed up in the last block, which no step uses
        forward = compiled_forward = CompiledForward(model)
        warm_up(compiled_forward, kv_cache, block_ids=[num_blocks - 1])
    if PATHS[name][1] == "gguf" and dtype == torch.bfloat16:  # the setting the process started with
        gguf_amx = bool(torch.ops.specdec_cpu.gguf_amx(None))
    return Path(name, model, forward, kv_cache, weight_bytes, gguf_amx)


def _forward(path: Path, num_tokens: int, context_len: int) -> float:
    context_len = max(context_len, num_tokens)  # a prefill longer than the context: the whole prompt
    with torch.inference_mode(False):  # the step's inputs, made as the verifier's runner makes them
        positions = torch.arange(context_len - num_tokens, context_len)
        metadata = AttentionMetadata(slot_mapping=positions.clone(), query_start_locs=[0, num_tokens],
                                     context_lens=[context_len],
                                     block_tables=[torch.arange(-(-context_len // BLOCK_SIZE))])
        input_ids = positions % path.model.config.vocab_size
    if path.gguf_amx is not None:
        torch.ops.specdec_cpu.gguf_amx(path.gguf_amx)
    started = time.perf_counter()
    hidden = path.forward(input_ids, positions, path.kv_cache, metadata)
    assert isinstance(hidden, torch.Tensor), "no aux layers asked: the forward returns the hidden states only"
    path.forward.compute_logits(hidden)
    return time.perf_counter() - started


def _read_seconds(data: torch.Tensor) -> float:
    started = time.perf_counter()
    data.sum()
    return time.perf_counter() - started


def read_bandwidth_gbps(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """The best of `repeats` reads of a `num_bytes` fp32 tensor (a sum), in GB/s: what a
    matrix-vector product streaming its weights can reach at most, on these threads."""
    data = torch.ones(num_bytes // 4)
    return num_bytes / min(_read_seconds(data) for _ in range(repeats)) / 1e9


def significant(value: float, digits: int = 3) -> str:
    """`value` with at least `digits` significant digits and no exponent (1234.5 -> "1234",
    0.01234 -> "0.0123"): a fixed number of decimals prints a fast path on a tiny model as 0."""
    if value == 0 or not math.isfinite(value):
        return str(value)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.paths.split(",") if name.strip()]
    unknown = [name for name in names if name not in PATHS]
    if unknown:
        parser.error(f"unknown paths {unknown}; allowed: {', '.join(PATHS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    num_blocks = -(-max(args.context_len, args.prefill_len) // BLOCK_SIZE) + 1
    shapes = (1, 1 + args.num_speculative_tokens) + ((args.prefill_len,) if args.prefill_len else ())
    with torch.inference_mode():
        paths = [_load(model_dir, name, num_blocks, args.model) for name in names]
        for path in paths:
            for num_tokens in shapes:
                _forward(path, num_tokens, args.context_len)  # warm-up
        times, reads = _timed_rounds(paths, shapes, args.context_len, args.repeats)
        _print_table(paths, shapes, times, reads, args.memory_gbps)
        if args.profile:
            profiled = next((p for p in paths if p.name == args.profile), None)
            if profiled is None:
                parser.error(f"--profile {args.profile!r} is not among --paths")
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                for _ in range(10):
                    _forward(profiled, shapes[1], args.context_len)
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specdec bench forward", description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--paths", default="fp32,fp32-cpu,fp32-stack,bf16-onednn,bf16-cpu,bf16-stack,bf16-int8-stack",
                        help=f"comma-separated, of: {', '.join(PATHS)}")
    parser.add_argument("--num-speculative-tokens", type=int, default=4,
                        help="the second shape is 1 + k tokens")
    parser.add_argument("--context-len", type=int, default=200)
    parser.add_argument("--prefill-len", type=int, default=0,
                        help="also time a prefill of this many tokens (the tail of a context of "
                             "max(--context-len, this))")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--memory-gbps", type=float, default=None,
                        help="memory read bandwidth for the weight-reading bound (default: "
                             "measured here by summing a 512 MiB tensor)")
    parser.add_argument("--profile", default=None, metavar="PATH_NAME",
                        help="print the torch profiler's table for this path's 1 + k forward")
    return parser


def _timed_rounds(paths: list[Path], shapes: tuple[int, ...], context_len: int, repeats: int,
                  ) -> tuple[dict[tuple[str, int], list[float]], dict[str, list[float]]]:
    """Each path's forward times per shape, and per repeat the faster of two reads of as many
    bytes as its weights, taken beside its forwards (so drift falls on both)."""
    times: dict[tuple[str, int], list[float]] = {}
    reads: dict[str, list[float]] = {}
    readable = torch.ones(max(path.weight_bytes for path in paths) // 4)
    for _ in range(repeats):
        for path in paths:
            weights_worth = readable[:path.weight_bytes // 4]
            before = _read_seconds(weights_worth)
            for num_tokens in shapes:
                times.setdefault((path.name, num_tokens), []).append(
                    _forward(path, num_tokens, context_len))
            reads.setdefault(path.name, []).append(min(before, _read_seconds(weights_worth)))
    return times, reads


def _print_table(paths: list[Path], shapes: tuple[int, ...], times: dict[tuple[str, int], list[float]],
                 reads: dict[str, list[float]], memory_gbps: float | None) -> None:
    measured = memory_gbps is None
    gbps = read_bandwidth_gbps() if memory_gbps is None else memory_gbps
    print(f"memory read bandwidth {significant(gbps)} GB/s"
          f"{' (measured)' if measured else ''}; bound = weight bytes / bandwidth")
    width = max(12, *(len(path.name) for path in paths))
    print("read ms: reading as many bytes as the weights, paired with the forwards; "
          "x read: the median of each forward over its repeat's read")
    print(f"{'path':{width}s} {'tokens':>6s} {'median ms':>10s} {'min ms':>8s} {'bound ms':>9s} "
          f"{'read ms':>8s} {'x read':>7s}")
    for path in paths:
        bound_ms = path.weight_bytes / (gbps * 1e9) * 1e3
        paired_reads = reads[path.name]
        for num_tokens in shapes:
            samples = times[(path.name, num_tokens)]
            over_read = statistics.median(sample / read for sample, read in zip(samples, paired_reads))
            print(f"{path.name:{width}s} {num_tokens:6d} {significant(statistics.median(samples) * 1e3):>10s} "
                  f"{significant(min(samples) * 1e3):>8s} {significant(bound_ms):>9s} "
                  f"{significant(statistics.median(paired_reads) * 1e3):>8s} {significant(over_read):>7s}")
