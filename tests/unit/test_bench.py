"""`python -m specdec bench`'s exit status: a changed greedy output fails only in float32."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from specdec.bench.decode import _finish


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


def test_a_token_map_adds_a_mapped_twin_of_each_draft_it_applies_to() -> None:
    from specdec.bench.decode import _draft_specs

    specs = _draft_specs("shipped", 4, token_map="smollm2-135m-instruct-token-map")
    by_name = {name: spec for name, spec in specs}
    assert by_name["smollm2-135m-instruct-eagle3"].speculative_token_map is None
    assert "smollm2-135m-instruct-eagle3 +map" not in by_name  # its own draft vocabulary
    for name in ("smollm2-135m-instruct-eagle", "smollm2-135m-instruct-draft"):
        assert by_name[name].speculative_token_map is None
        twin = by_name[f"{name} +map"]
        assert (twin.method, twin.model, twin.num_speculative_tokens) == (by_name[name].method, name, 4)
        assert twin.speculative_token_map == "smollm2-135m-instruct-token-map"
    assert [name for name, _ in _draft_specs("shipped", 4)] == [
        "smollm2-135m-instruct-eagle3", "smollm2-135m-instruct-eagle", "smollm2-135m-instruct-draft"]
