"""`bench scale`'s random models (specdec/bench/scale_models.py) and the command, on the tiny
preset with a tiny byte-level tokenizer standing in for the default model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from specdec.bench import scale
from specdec.bench.scale_models import FORMATS, build_gguf, build_hf_model
from specdec.models.gguf_linear import GgufLinear, gguf_kernel_supports
from specdec.models.gguf_model import load_gguf_model
from specdec.models.loader import load_model
from specdec.models.model_files import resolve_model
from tests.support.paged_forward import PagedSequence, fresh_cache, hf_logits, prompt, reversed_blocks, run_step
from tests.support.tiny_models import make_gguf_ready_llama

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_ready_llama(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "specdec-cache"))


def test_a_tiny_preset_loads_in_specdec_and_transformers_alike(tokenizer_dir: Path, tmp_path: Path) -> None:
    hf_dir = build_hf_model("tiny", tmp_path, tokenizer_dir)
    assert build_hf_model("tiny", tmp_path, tokenizer_dir) == hf_dir  # cached
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["vocab_size"] == 260 and config["tie_word_embeddings"]
    assert (hf_dir / "tokenizer.json").read_text() == (tokenizer_dir / "tokenizer.json").read_text()
    ours = load_model(hf_dir, torch.float32, CPU)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    token_ids = prompt(23, seed=4, vocab_size=260)
    (logits,) = run_step(ours, fresh_cache(ours, CPU), [(PagedSequence(reversed_blocks(8, first=3)), token_ids)], CPU)
    torch.testing.assert_close(logits, hf_logits(theirs, token_ids), atol=1e-4, rtol=0)


@pytest.mark.skipif(not gguf_kernel_supports(torch.bfloat16), reason="no GGUF kernel here")
def test_each_format_is_written_and_served_on_its_blocks(tokenizer_dir: Path, tmp_path: Path) -> None:
    expected_types = {"Q8_0": {"Q8_0"}, "Q4_0": {"Q4_0"}, "Q4_1": {"Q4_1"}, "Q4_K_M": {"Q4_K", "Q6_K"}}
    for precision in FORMATS:
        path = build_gguf("tiny", precision, tmp_path, tokenizer_dir, use_llama_cpp=False)
        assert path.name == f"tiny.{precision}.gguf"
        model = load_gguf_model(path, resolve_model(str(path)), torch.bfloat16, CPU)
        linears = [m for m in model.modules() if isinstance(m, GgufLinear)]
        assert {t for linear in linears for t in linear.qtypes} == expected_types.get(precision, set())


@pytest.mark.skipif(not gguf_kernel_supports(torch.bfloat16), reason="no GGUF kernel here")
def test_the_command_prints_a_row_per_format(tokenizer_dir: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert scale.main(["--presets", "tiny", "--formats", "Q4_0,Q4_K_M", "--rounds", "1", "--max-tokens", "4",
                       "--no-llama-cpp", "--tokenizer-model", str(tokenizer_dir), "--cache-dir", str(tmp_path)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny |")]
    assert [row.split("|")[2].strip() for row in rows] == ["Q4_0", "Q4_K_M"]
    assert all(float(row.split("|")[5].split()[0]) > 0 for row in rows)  # specdec's tok/s
