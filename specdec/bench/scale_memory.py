"""`python -m specdec.bench.scale_memory`: where a GGUF model served on its blocks keeps its
resident memory, step by step, in one process.

Why: `bench scale` gives one figure, what loading and running a model added to specdec's
process. This runs the same start (`SpecdecEngine.start` on a `bench scale` preset, as
`bench scale` runs it) and reads the process's memory at each step: the imports, the CPU
kernels, the tokenizer, the GGUF reader, the dense part of the model, the blocks, the
engine's KV cache and forward, a warm-up and a measured request. Each row gives the resident
memory (VmRSS), its anonymous, file-backed and shared parts (RssAnon, RssFile: a file's
pages stay counted while any view of its mapping is alive; RssShmem), what glibc's heap
holds free (mallinfo2's free bytes, resident or not), the peak so far (VmHWM) and the
seconds since the start. At the end `malloc_trim(0)` shows how much of that free heap was
resident.

The steps are read by wrapping the functions the start calls (the wrappers only read
/proc), so the figures are those of the real path.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdec.heap import return_free_heap


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc() -> Any | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def memory_mb() -> dict[str, float]:
    """This process's VmRSS, its peak so far (VmHWM), RssAnon, RssFile and RssShmem (MB; 0
    where /proc is missing) and the free bytes in glibc's heap (MB; 0 without mallinfo2)."""
    values = {"rss": 0.0, "peak": 0.0, "anon": 0.0, "file": 0.0, "shmem": 0.0, "heap_free": 0.0}
    keys = {"VmRSS:": "rss", "VmHWM:": "peak", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key = keys.get(line.split(":")[0] + ":")
            if key is not None:
                values[key] = int(line.split()[1]) / 1e3
    except OSError:
        pass
    libc = _libc()
    if libc is not None and hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
        values["heap_free"] = libc.mallinfo2().fordblks / 1e6
    return values


class Steps:
    """The rows: a step's name and the memory after it."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, dict[str, float]]] = []
        self.started = time.perf_counter()

    def mark(self, name: str) -> None:
        self.rows.append((name, {**memory_mb(), "seconds": time.perf_counter() - self.started}))
        print(f"  {name}: {self.rows[-1][1]['rss']:.0f} MB", file=sys.stderr, flush=True)

    def after(self, owner: Any, attribute: str, name: str, before: str | None = None, once: bool = False) -> None:
        """Marks `name` each time `owner.attribute` (a function or class) returns (the first
        time only, with `once`), and `before` as it is called."""
        original: Callable[..., Any] = getattr(owner, attribute)
        calls = [0]
        if isinstance(original, type):  # a subclass, so that isinstance checks still hold
            marks = self

            class Marked(original):  # type: ignore[misc,valid-type]
                def __init__(self, *args: Any, **kwargs: Any) -> None:
                    if before is not None:
                        marks.mark(before)
                    super().__init__(*args, **kwargs)
                    marks.mark(name)

            Marked.__name__ = original.__name__
            setattr(owner, attribute, Marked)
            return

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if once and calls[0] > 1:
                return original(*args, **kwargs)
            if before is not None:
                self.mark(before)
            result = original(*args, **kwargs)
            self.mark(name)
            return result

        setattr(owner, attribute, wrapped)

    def table(self, file_mb: float) -> str:
        lines = ["| step | resident MB | + | anonymous | file-backed | shared | glibc heap free | peak so far | s |",
                 "|---|---|---|---|---|---|---|---|---|"]
        previous = None
        for name, values in self.rows:
            delta = "" if previous is None else f"{values['rss'] - previous['rss']:+.0f}"
            lines.append(f"| {name} | {values['rss']:.0f} | {delta} | {values['anon']:.0f} | {values['file']:.0f} "
                         f"| {values['shmem']:.0f} | {values['heap_free']:.0f} | {values['peak']:.0f} "
                         f"| {values['seconds']:.1f} |")
            previous = values
        lines.append(f"\nfile: {file_mb:.0f} MB")
        return "\n".join(lines)


async def _run(args: argparse.Namespace, steps: Steps) -> float:
    import torch

    from gateway.chat import render_chat_prompt
    from specdec.bench.compare_systems import SpecdecEngine, SpecdecSystem
    from specdec.bench.scale import MAX_MODEL_LEN, PROMPT
    from specdec.bench.scale_models import build_gguf
    from specdec.errors import InvalidRequestError
    from specdec.models.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model

    torch.set_num_threads(args.threads)
    steps.mark("imports: specdec's engine and bench")
    gguf_path = build_gguf(args.preset, args.format, args.cache_dir, resolve_model(DEFAULT_MODEL))
    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    prompt_ids = render_chat_prompt(tokenizer, [{"role": "user", "content": PROMPT}])
    steps.mark("the bench's tokenizer")
    resolve_model(str(gguf_path))
    gc.collect()
    steps.mark("the file's cached conversion found; `bench scale` measures from here")
    _wrap_start(steps)
    engine = await SpecdecEngine.start(gguf_path, str(gguf_path), "auto", "cpu", None, MAX_MODEL_LEN)
    steps.mark("engine started")
    try:  # the grammar backend, which the engine builds in a thread of its own from its start
        await asyncio.get_running_loop().run_in_executor(None, engine.engine.grammars._get_backend)
    except InvalidRequestError:
        pass
    steps.mark("the grammar backend built (a thread the engine starts)")
    system = SpecdecSystem("specdec", engine, speculate=False, tokenizer=tokenizer)
    await system.generate(prompt_ids, args.max_tokens)
    steps.mark(f"a warm-up request ({args.max_tokens} tokens)")
    generation = await system.generate(prompt_ids, args.max_tokens)
    steps.mark(f"a request ({generation.num_output_tokens / generation.seconds:.1f} tok/s)")
    gc.collect()
    steps.mark("gc.collect()")
    if return_free_heap():
        steps.mark("malloc_trim(0): the free heap's resident pages returned")
    await engine.stop()
    return gguf_path.stat().st_size / 1e6


def _wrap_start(steps: Steps) -> None:
    """Marks the steps of `SpecdecEngine.start` on a GGUF file."""
    import gguf

    from specdec.layers import cpu_extension
    from specdec.models import cpu_stack, gguf_model
    from verifier_svc import builder, target_model

    steps.after(cpu_extension, "load_extension", "C++ kernels loaded", once=True)
    steps.after(target_model, "load_gguf_model", "load_gguf_model returned")
    steps.after(gguf, "GGUFReader", "GGUFReader opened (metadata parsed)")
    steps.after(gguf_model, "load_model", "dense model: norms read, the linears' memory untouched")
    steps.after(gguf_model, "GgufEmbedding", "the embedding's lookup")
    steps.after(target_model, "load_tokenizer", "the engine's tokenizer")
    steps.after(builder, "pack_linears", "pack_linears (nothing to pack on blocks)")
    steps.after(builder, "choose_forward", "C++ decoder stack: the blocks moved into one buffer",
                before="KV cache allocated")
    steps.after(cpu_stack, "move_into_arena", "weights moved into the arena")


def main(argv: list[str] | None = None) -> int:
    steps = Steps()
    steps.mark("python")
    import torch  # noqa: F401

    steps.mark("import torch")
    import gguf  # noqa: F401
    import numpy  # noqa: F401
    import transformers  # noqa: F401

    steps.mark("import numpy, gguf, transformers")
    from specdec.bench.scale_models import FORMATS, PRESETS
    from specdec.models.model_files import default_cache_dir

    parser = argparse.ArgumentParser(prog="python -m specdec.bench.scale_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="0.8b", choices=list(PRESETS))
    parser.add_argument("--format", default="Q4_0", choices=list(FORMATS))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir() / "scale")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    file_mb = asyncio.run(_run(args, steps))
    print(steps.table(file_mb))
    print(f"{time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
