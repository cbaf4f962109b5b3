"""The whole stack from the launcher (`python -m specdec serve`) on a tiny model, for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
NGRAM_SPEC = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
              '"prompt_lookup_max": 3}')


@dataclass
class Stack:
    base_url: str
    launcher: subprocess.Popen[bytes]

    def child_pids(self, pattern: str) -> list[int]:
        """The launcher's children whose command line matches `pattern`."""
        found = subprocess.run(["pgrep", "-P", str(self.launcher.pid), "-f", pattern],
                               capture_output=True, text=True).stdout.split()
        return [int(pid) for pid in found]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def served_stack(model: Path, *flags: str, ready_timeout_s: float = 60.0) -> Iterator[Stack]:
    """Starts the launcher on `model` (cpu, float32, eager, ngram with a fixed k unless
    `flags` say otherwise), waits for /health, and stops it (SIGTERM, then SIGKILL) on exit."""
    port = free_port()
    command = [sys.executable, "-m", "specdec", "serve", "--model", str(model),
               "--port", str(port), "--device", "cpu", "--dtype", "float32",
               # Compiling is tested in test_compiled_forward and, as the default, in test_e2e.
               "--enforce-eager", "--log-level", "warning", *flags]
    if "--speculative-config" not in flags:
        command += ["--speculative-config", NGRAM_SPEC]
    if "--speculation-policy" not in flags:
        # Drafts every step, so the counters the tests read do not depend on timing.
        command += ["--speculation-policy", "fixed"]
    launcher = subprocess.Popen(command, cwd=ROOT, env=ENV)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if launcher.poll() is not None:
                raise RuntimeError(f"the launcher exited early with code {launcher.returncode}")
            try:
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stack was not healthy in {ready_timeout_s:.0f} s")
            time.sleep(0.2)
        yield Stack(base_url, launcher)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
