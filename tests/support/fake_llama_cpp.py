"""A stand-in `llama_cpp` package for the bench's llama.cpp child process: it answers
completions with a fixed text, or dies by SIGSEGV where `FAKE_LLAMA_CPP_CRASH` says
("load" or "generate"), as a llama.cpp build with broken native kernels does."""

from __future__ import annotations

from pathlib import Path

CRASH_ENV = "FAKE_LLAMA_CPP_CRASH"

_SOURCE = '''
import os
import signal


def _crash_if(stage):
    if os.environ.get("FAKE_LLAMA_CPP_CRASH") == stage:
        os.kill(os.getpid(), signal.SIGSEGV)


class Llama:
    def __init__(self, model_path, **kwargs):
        _crash_if("load")

    def reset(self):
        pass

    def create_completion(self, prompt, max_tokens, **kwargs):
        _crash_if("generate")
        return {"choices": [{"text": "a" * max_tokens}], "usage": {"completion_tokens": max_tokens}}

    def close(self):
        pass
'''


def write_fake_llama_cpp(directory: Path) -> Path:
    """Writes the package under `directory` (put it on sys.path: the spawned child takes the
    parent's) and returns `directory`."""
    package = directory / "llama_cpp"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(_SOURCE)
    return directory
