"""`python -m specdec bench`'s exit status: a changed greedy output fails only in float32."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from specdec.bench import _finish


@pytest.mark.parametrize(("dtype", "identical", "status"), [
    ("float32", True, 0),
    ("float32", False, 1),
    ("bfloat16", False, 0),  # a near-tie may flip in 16 bits: reported, not failed
    ("bfloat16", True, 0),
])
def test_exit_status(tmp_path: Path, dtype: str, identical: bool, status: int) -> None:
    args = argparse.Namespace(json=str(tmp_path / "rows.json"), dtype=dtype, device="cpu")
    rows = [{"prompt": "repeat", "identical_output": True},
            {"prompt": "open", "identical_output": identical}]
    assert _finish(args, rows, rows) == status
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
