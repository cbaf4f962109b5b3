"""Entry points: --help for each, and clear start-up errors before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("module,flags", [
    ("gateway", ["--verifier", "--served-model-name", "--api-key"]),
    ("verifier_svc", ["--speculative-config", "--max-num-batched-tokens", "--drafter"]),
    ("drafter_svc", ["--speculative-config", "--port"]),
    ("specdec serve", ["--speculative-config", "--max-model-len", "--gpu-memory-utilization",
                       "--tensor-parallel-size", "--additional-config", "--device",
                       "--trust-remote-code", "--served-model-name", "--dtype"]),
])
def test_help(module: str, flags: list[str]) -> None:
    result = run(*module.split(), "--help")
    assert result.returncode == 0, result.stderr
    for flag in flags:
        assert flag in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/model"], "/no/such/model"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
     "num_speculative_tokens"),
    (["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'],
     "ngram, eagle, eagle3, draft_model"),
    # The default model's 9 attention heads and 3 KV heads split over 1 or 3 ranks only.
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2 does not divide the model's 9 "
                                      "attention heads; sizes this model allows: 1, 3"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    (["--additional-config", "{not json"], "additional-config"),
])
def test_serve_refuses_bad_configuration(args: list[str], message: str) -> None:
    result = run("specdec", "serve", "--port", "1", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
