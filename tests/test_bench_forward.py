"""`python -m specdec bench forward` runs every kernel path on a tiny model and prints them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.__main__ import main
from specdec.cpu_extension import linear_supports
from tests.tiny_models import make_tiny_llama


def test_prints_each_path_and_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    own_int8 = linear_supports(torch.bfloat16, int8_weights=True)
    names = ["fp32", "fp32-compiled", "bf16-int8"] + (["bf16-int8-stack"] if own_int8 else [])
    assert main(["bench", "forward", "--model", str(model), "--paths", ",".join(names),
                 "--repeats", "2", "--context-len", "40", "--num-speculative-tokens", "3",
                 "--profile", "bf16-int8"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in [[name] for name in names]]
    assert sorted((row[0], int(row[1])) for row in rows) == sorted(
        (name, tokens) for name in names for tokens in (1, 4))
    assert all(float(row[2]) > 0 and float(row[4]) > 0 for row in rows)
    # The read paired with each path's forwards, and each forward over its repeat's read.
    assert all(len(row) == 7 and float(row[5]) > 0 and float(row[6]) > 0 for row in rows)
    reads = {row[0]: float(row[5]) for row in rows}
    assert reads["bf16-int8"] < reads["fp32"]  # fewer bytes read
    bounds = {row[0]: float(row[4]) for row in rows}
    assert bounds["bf16-int8"] < bounds["fp32"] / 2  # its linears' weights read as a byte each
    # The profile of the int8 path: specdec's kernel where it is built, else torch's.
    assert ("specdec_cpu::linear" if own_int8 else "_weight_int8pack_mm") in out
    bandwidth = next(line for line in out.splitlines() if line.startswith("memory read bandwidth"))
    assert float(bandwidth.split()[3]) > 0 and "(measured)" in bandwidth


def test_unknown_path_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "forward", "--paths", "fp64"])
    assert info.value.code == 2 and "unknown paths ['fp64']" in capsys.readouterr().err
