"""llama.cpp's bench system in its child process (specdec/bench/llama_cpp_system.py), on a
stand-in llama_cpp package: answers come back, and a crash at load or mid-run is named
instead of killing the bench; `bench scale` then prints llama.cpp's cells as crashed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from specdec.bench import scale
from specdec.bench.llama_cpp_system import LlamaCppCrashed, LlamaCppSystem, llama_cpp_installed
from specdec.models.gguf_linear import gguf_kernel_supports
from tests.support.fake_llama_cpp import CRASH_ENV, write_fake_llama_cpp
from tests.support.tiny_models import make_gguf_ready_llama


@pytest.fixture
def fake_llama_cpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(write_fake_llama_cpp(tmp_path / "fake")))
    monkeypatch.delenv(CRASH_ENV, raising=False)


async def _one_generation(gguf_path: Path) -> tuple[str, int]:
    system = LlamaCppSystem("llama.cpp", gguf_path, 1, 64, None)
    try:
        generation = await system.generate([1, 2, 3], 5)
        return generation.text, generation.num_output_tokens
    finally:
        await system.close()


def test_a_generation_comes_back_from_the_child(fake_llama_cpp: None, tmp_path: Path) -> None:
    assert llama_cpp_installed()
    assert asyncio.run(_one_generation(tmp_path / "model.gguf")) == ("aaaaa", 5)


@pytest.mark.parametrize("stage, doing", [("load", "loading"), ("generate", "generating on")])
def test_a_crash_is_named(fake_llama_cpp: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          stage: str, doing: str) -> None:
    monkeypatch.setenv(CRASH_ENV, stage)
    with pytest.raises(LlamaCppCrashed, match=f"llama.cpp killed by SIGSEGV while {doing} model.gguf"):
        asyncio.run(_one_generation(tmp_path / "model.gguf"))


@pytest.mark.skipif(not gguf_kernel_supports(torch.bfloat16), reason="no GGUF kernel here")
def test_bench_scale_goes_on_without_a_crashed_llama_cpp(fake_llama_cpp: None, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "specdec-cache"))
    monkeypatch.setenv(CRASH_ENV, "generate")
    tokenizer_dir = make_gguf_ready_llama(tmp_path / "tokenizer")
    assert scale.main(["--presets", "tiny", "--formats", "F16", "--rounds", "1", "--max-tokens", "4",
                       "--tokenizer-model", str(tokenizer_dir), "--cache-dir", str(tmp_path / "scale")]) == 0
    printed = capsys.readouterr()
    (row,) = [line for line in printed.out.splitlines() if line.startswith("| tiny |")]
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert float(cells[4].split()[0]) > 0 and cells[5] == "crashed" and cells[6] == "-"
    assert "tiny F16: llama.cpp killed by SIGSEGV while generating on tiny.F16.gguf" in printed.err
