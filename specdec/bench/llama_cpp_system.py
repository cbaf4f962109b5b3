"""llama.cpp (llama-cpp-python, optional) as a bench system, run in a child process.

Why a child: llama.cpp is native code, and a crash there (a segfault: llama.cpp builds with
the AMX kernels do on some CPUs with AMX, see docs/performance.md) kills the process that
called it with no Python exception. In a child, the bench sees the child die, says how and
where (`LlamaCppCrashed`) and goes on without llama.cpp; and the child's resident memory is
llama.cpp's own, measured apart from specdec's.

The child (`specdec.bench.llama_cpp_child`) loads the model once, then answers one request
at a time over a pipe; the time of a generation is taken inside it (the pipe's round trip
left out).
"""

from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing
import signal
from pathlib import Path
from typing import Any

from specdec.bench.compare_systems import Generation
from specdec.bench.llama_cpp_child import serve
from specdec.config import SpeculativeConfig

LLAMA_CPP_MISSING = "llama-cpp-python is not installed (pip install llama-cpp-python)"
# How long a child may take to load a model and answer that it is ready.
LOAD_TIMEOUT_S = 900.0


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppCrashed(RuntimeError):
    """llama.cpp's process died (a signal or an exit) instead of answering."""


def cpu_has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def describe_exit(exitcode: int | None, doing: str, gguf_path: Path) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            how = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"killed by signal {-exitcode}"
    else:
        how = f"exited with status {exitcode}"
    message = f"llama.cpp {how} while {doing} {gguf_path.name}"
    if exitcode in (-signal.SIGSEGV, -signal.SIGILL, -signal.SIGBUS) and cpu_has_amx():
        message += ("; this CPU has AMX, and llama.cpp builds with its AMX kernels crash on such "
                    "CPUs: build llama-cpp-python with AMX off (docs/performance.md)")
    return message


class LlamaCppSystem:
    """llama.cpp on `gguf_path` in a child process (plain, or with prompt lookup)."""

    kind = "llama.cpp"

    def __init__(self, name: str, gguf_path: Path, threads: int, n_ctx: int,
                 lookup: SpeculativeConfig | None) -> None:
        self.name, self._gguf_path = name, gguf_path
        self.description = f"llama.cpp on {gguf_path.name}, {threads} threads"
        lookup_args = None
        if lookup is not None:
            lookup_args = (lookup.num_speculative_tokens, lookup.prompt_lookup_max or 2)
            self.description += (f", prompt lookup k={lookup.num_speculative_tokens} "
                                 f"max ngram {lookup.prompt_lookup_max}")
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=serve, name=f"llama.cpp {name}", daemon=True,
                                        args=(child_conn, str(gguf_path), threads, n_ctx, lookup_args))
        self._process.start()
        child_conn.close()  # so that the child's death ends our reads
        if not self._conn.poll(LOAD_TIMEOUT_S):
            self._process.kill()
            raise LlamaCppCrashed(f"llama.cpp did not load {gguf_path.name} in {LOAD_TIMEOUT_S:.0f} s")
        _, before, after = self._answer("loading")
        # llama.cpp's memory: what loading the model added to a process that has llama_cpp imported.
        self.model_mb = after - before
        self.resident_mb = after

    def _answer(self, doing: str) -> Any:
        try:
            return self._conn.recv()
        except (EOFError, ConnectionError):
            self._process.join(timeout=10.0)
            raise LlamaCppCrashed(describe_exit(self._process.exitcode, doing, self._gguf_path)) from None

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> Generation:
        try:
            self._conn.send(("generate", list(prompt_ids), max_tokens))
        except (BrokenPipeError, ConnectionError):
            self._process.join(timeout=10.0)
            raise LlamaCppCrashed(describe_exit(self._process.exitcode, "generating on",
                                                self._gguf_path)) from None
        _, text, num_tokens, seconds, self.resident_mb = await asyncio.to_thread(self._answer, "generating on")
        return Generation(None, text, num_tokens, seconds)

    async def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(("close",))
            except (BrokenPipeError, ConnectionError):
                pass
            self._process.join(timeout=30.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
