"""`python -m specdec bench forward` runs every kernel path on a tiny model and prints them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from specdec.__main__ import main
from specdec.bench.forward import significant
from specdec.layers.cpu_extension import linear_supports
from specdec.models.gguf_linear import gguf_kernel_supports
from specdec.models.gguf_writer import write_llama_gguf
from tests.support.tiny_models import make_gguf_ready_llama, make_tiny_llama


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
    # Per row: median, min, bound, the paired read (ms) and the forward over its read. Each
    # is a positive number however fast the machine: a fast path on a tiny model takes
    # microseconds, which a fixed number of decimals once printed as 0.
    assert all(len(row) == 7 for row in rows), rows
    numbers = {(row[0], int(row[1])): [float(value) for value in row[2:]] for row in rows}
    assert all(math.isfinite(value) and value > 0 for values in numbers.values() for value in values), rows
    assert all(median >= minimum for median, minimum, *_ in numbers.values()), rows
    # The bound is the weight bytes over one bandwidth: its linears' weights read as a byte each.
    bounds = {name: numbers[(name, 1)][2] for name in names}
    assert bounds["bf16-int8"] < bounds["fp32"] / 2
    # The profile of the int8 path: specdec's kernel where it is built, else torch's.
    assert ("specdec_cpu::linear" if own_int8 else "_weight_int8pack_mm") in out
    bandwidth = next(line for line in out.splitlines() if line.startswith("memory read bandwidth"))
    gbps = float(bandwidth.split()[3])
    assert math.isfinite(gbps) and gbps > 0 and "(measured)" in bandwidth


def test_unknown_path_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "forward", "--paths", "fp64"])
    assert info.value.code == 2 and "unknown paths ['fp64']" in capsys.readouterr().err


@pytest.mark.parametrize("value", [12345.6, 99.96, 1.0, 0.04, 0.01234, 3.1e-4, 2.5e-7])
def test_times_keep_three_significant_digits(value: float) -> None:
    """Whatever the size of the model and the speed of the machine: never 0, never an exponent."""
    text = significant(value)
    assert "e" not in text.lower() and float(text) > 0
    assert abs(float(text) - value) <= 0.005 * value


def test_a_prefill_shape_and_the_sdpa_stack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not linear_supports(torch.float32):
        pytest.skip("the C++ decoder stack is not built for this CPU")
    model = make_tiny_llama(tmp_path / "tiny")
    names = ["fp32-stack", "fp32-stack-sdpa"]
    assert main(["bench", "forward", "--model", str(model), "--paths", ",".join(names), "--repeats", "2",
                 "--context-len", "40", "--prefill-len", "70", "--num-speculative-tokens", "3"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in [[n] for n in names]]
    assert sorted((row[0], int(row[1])) for row in rows) == sorted(
        (name, tokens) for name in names for tokens in (1, 4, 70))


@pytest.mark.skipif(not gguf_kernel_supports(torch.bfloat16), reason="no GGUF kernel here")
def test_a_gguf_path_reads_the_files_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = write_llama_gguf(make_gguf_ready_llama(tmp_path / "hf"), tmp_path / "tiny.Q4_0.gguf", "Q4_0")
    assert main(["bench", "forward", "--model", str(gguf_file), "--paths", "bf16-stack,bf16-gguf-stack",
                 "--repeats", "2", "--context-len", "40"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {(row[0], int(row[1])): float(row[4]) for row in (line.split() for line in lines)
            if row[:1] in (["bf16-stack"], ["bf16-gguf-stack"])}
    # The bound: the dense tensors (the bf16 embedding, read as the tied LM head on the dense
    # path) plus 4.5 bits a weight for the layers and the head on the file's blocks.
    assert rows[("bf16-gguf-stack", 1)] < rows[("bf16-stack", 1)] * 0.7
