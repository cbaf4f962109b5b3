"""The child process of `specdec.bench.llama_cpp_system`: llama.cpp loads one GGUF file and
answers generation requests over a pipe.

Kept apart, importing neither torch nor specdec's engine: the child is spawned (a fresh
interpreter that imports this module), and its resident memory should be llama.cpp's.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast


def resident_mb() -> float:
    """This process's resident memory (VmRSS), MB; 0 where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1e3
    except OSError:
        pass
    return 0.0


def serve(conn: Connection, gguf_path: str, threads: int, n_ctx: int, lookup: tuple[int, int] | None) -> None:
    """Loads `gguf_path`, sends ("ready", resident MB before, after), then answers each
    ("generate", prompt_ids, max_tokens) with ("done", text, completion tokens, seconds,
    resident MB) until anything else arrives. `lookup`: prompt lookup's (tokens, max ngram)."""
    from llama_cpp import Llama

    draft_model = None
    if lookup is not None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft_model = LlamaPromptLookupDecoding(num_pred_tokens=lookup[0], max_ngram_size=lookup[1])
    before = resident_mb()
    llm = Llama(model_path=gguf_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, seed=0,
                verbose=False, draft_model=draft_model)
    conn.send(("ready", before, resident_mb()))
    while True:
        request = conn.recv()
        if request[0] != "generate":
            break
        _, prompt_ids, max_tokens = request
        llm.reset()  # no prompt reuse from the previous run: every system prefills
        started = time.perf_counter()
        # Not streamed: one response dict.
        completion = cast(dict[str, Any], llm.create_completion(
            prompt=list(prompt_ids), max_tokens=max_tokens, temperature=0.0, top_k=1, top_p=1.0, min_p=0.0,
            repeat_penalty=1.0))
        seconds = time.perf_counter() - started
        conn.send(("done", completion["choices"][0]["text"], int(completion["usage"]["completion_tokens"]),
                   seconds, resident_mb()))
    llm.close()
