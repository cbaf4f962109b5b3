"""`python -m specdec bench forward` runs every kernel path on a tiny model and prints them."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.__main__ import main
from tests.tiny_models import make_tiny_llama


def test_prints_each_path_and_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    assert main(["bench", "forward", "--model", str(model), "--paths", "fp32,fp32-compiled,bf16-int8",
                 "--repeats", "2", "--context-len", "40", "--num-speculative-tokens", "3",
                 "--profile", "bf16-int8"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["fp32"], ["fp32-compiled"], ["bf16-int8"])]
    assert sorted((row[0], int(row[1])) for row in rows) == sorted(
        (name, tokens) for name in ("fp32", "fp32-compiled", "bf16-int8") for tokens in (1, 4))
    assert all(float(row[2]) > 0 and float(row[4]) > 0 for row in rows)
    assert "_weight_int8pack_mm" in out  # the profile of the int8 path
    bandwidth = next(line for line in out.splitlines() if line.startswith("memory read bandwidth"))
    assert float(bandwidth.split()[3]) > 0 and "(measured)" in bandwidth


def test_unknown_path_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "forward", "--paths", "fp64"])
    assert info.value.code == 2 and "unknown paths ['fp64']" in capsys.readouterr().err
