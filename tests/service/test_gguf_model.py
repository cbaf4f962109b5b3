"""A GGUF file served as it is (`specdec.models.gguf_model`): tiny random Llamas written as
GGUF at Q8_0, Q4_0, Q4_1 and Q4_K_M (Q4_K with Q6_K), loaded on their blocks, and served
with ngram speculation giving the quantized model's own greedy output.
"""

from __future__ import annotations

import argparse
import weakref
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from specdec import launcher
from specdec.engine.sampling_params import SamplingParams
from specdec.errors import ConfigError
from specdec.models.cpu_stack import CpuDecoderStack
from specdec.models.gguf_linear import GgufEmbedding, GgufLinear, gguf_kernel_supports
from specdec.models.gguf_model import load_gguf_model, native_gguf_file
from specdec.models.gguf_writer import write_llama_gguf
from specdec.models.loader import load_model
from specdec.models.model_files import default_cache_dir, resolve_model
from tests.support.engine_harness import generate, ngram_engine
from tests.support.paged_forward import PagedSequence, fresh_cache, reversed_blocks, run_step
from tests.support.tiny_models import make_gguf_ready_llama

PRECISIONS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K_M")
# Token ids of the byte-level vocabulary, with repeats for the ngram drafter to find.
PROMPTS = [[70, 71, 72, 73, 74, 70, 71, 72, 73, 74, 70, 71], [100, 101, 102, 100, 101, 102, 100],
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 40, 41, 42, 43]]
CPU = torch.device("cpu")

needs_kernel = pytest.mark.skipif(not gguf_kernel_supports(torch.bfloat16),
                                  reason="no GGUF kernel here (needs AVX-512 with BF16 and VBMI)")


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-models")
    hf_dir = make_gguf_ready_llama(root / "hf", num_layers=2)
    return {precision: write_llama_gguf(hf_dir, root / f"tiny.{precision}.gguf", precision)
            for precision in PRECISIONS}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "specdec-cache"))


def test_which_gguf_runs_on_its_blocks(gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("specdec.models.gguf_model.gguf_kernel_supports", lambda dtype: True)
    path = str(gguf_files["Q4_0"])
    assert native_gguf_file(path, "auto", None, CPU, torch.bfloat16, 1) == gguf_files["Q4_0"]
    assert native_gguf_file(path, "auto", "gguf", CPU, torch.bfloat16, 1) == gguf_files["Q4_0"]
    # A dtype given or int8 asked for: dequantised.
    assert native_gguf_file(path, "bfloat16", None, CPU, torch.bfloat16, 1) is None
    assert native_gguf_file(path, "auto", "int8", CPU, torch.bfloat16, 1) is None
    # The default model is its shipped Q4_1 file: on its blocks by default too.
    default_file = native_gguf_file("smollm2-135m-instruct", "auto", None, CPU, torch.bfloat16, 1)
    assert default_file is not None and default_file.name.endswith(".Q4_1.gguf")
    assert native_gguf_file("smollm2-135m-instruct", "bfloat16", None, CPU, torch.bfloat16, 1) is None
    # Another device: dequantised.
    assert native_gguf_file("smollm2-135m-instruct", "auto", None, torch.device("meta"), torch.bfloat16, 1) is None
    # Where the blocks cannot run: dequantised, or refused when asked for.
    assert native_gguf_file(path, "auto", None, CPU, torch.bfloat16, 2) is None
    with pytest.raises(ConfigError, match="tensor parallelism") as error:
        native_gguf_file(path, "auto", "gguf", CPU, torch.bfloat16, 2)
    assert error.value.param == "quantization"
    with pytest.raises(ConfigError, match="needs a GGUF model"):
        native_gguf_file(str(gguf_files["Q4_0"].parent), "auto", "gguf", CPU, torch.bfloat16, 1)


def test_serve_gives_its_verifier_the_gguf_file_not_its_conversion(gguf_files: dict[str, Path]) -> None:
    """Else `serve --model FILE.gguf` (or the default model with --quantization gguf) would
    load the converted directory, dequantised."""
    serve = argparse.ArgumentParser()
    launcher.add_serve_args(serve)

    def model_of(argv: list[str], service: str) -> str | None:
        command = dict(launcher._child_commands(serve.parse_args(argv), "/converted/model"))[service]
        return command[command.index("--model") + 1] if "--model" in command else None

    path = gguf_files["Q4_0"]
    assert model_of(["--model", str(path)], "verifier") == str(path.resolve())
    assert model_of(["--model", str(path)], "gateway") == "/converted/model"
    # The default model: the verifier's own default, which it resolves to the shipped file.
    assert model_of(["--quantization", "gguf"], "verifier") in (None, "smollm2-135m-instruct")
    assert model_of(["--model", str(path.parent)], "verifier") == "/converted/model"


def _transformers_conversion(gguf_path: Path, output_dir: Path) -> Path:
    """What the conversion used to write: transformers' float32 dequantisation of the file."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                    dtype=torch.float32)
    hf_model.hf_quantizer = None
    del hf_model.config.quantization_config
    hf_model.save_pretrained(str(output_dir))
    return output_dir


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_gguf_loads_from_its_file_without_a_float32_copy(gguf_files: dict[str, Path], precision: str,
                                                           tmp_path: Path) -> None:
    """The conversion keeps config and tokenizer only; the weights are read from the file,
    with the values (and so the logits) of transformers' float32 conversion."""
    model_dir = resolve_model(str(gguf_files[precision]))
    written = [path.name for path in (default_cache_dir() / "converted").rglob("*") if path.is_file()]
    assert not [name for name in written if name.endswith((".safetensors", ".bin"))], written
    assert (model_dir / "tokenizer.json").is_file() and (model_dir / "chat_template.jinja").is_file()
    from_file = load_model(model_dir, torch.float32, CPU)
    converted = load_model(_transformers_conversion(gguf_files[precision], tmp_path / "hf"), torch.float32, CPU)
    assert from_file.config == converted.config
    expected = converted.state_dict()
    for name, tensor in from_file.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    logits = []
    for model in (from_file, converted):
        sequence = PagedSequence(reversed_blocks(4, 0))
        logits.append(run_step(model, fresh_cache(model, CPU), [(sequence, PROMPTS[0])], CPU)[0])
    assert torch.equal(logits[0], logits[1])


@needs_kernel
@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_blocks_hold_the_dequantised_weights(gguf_files: dict[str, Path], precision: str) -> None:
    """Each linear on the file's blocks multiplies by exactly the weight transformers
    dequantises from the file (q/k rows in HF's order, projections fused in ours): the
    identity's rows give the weight's columns bit for bit."""
    model_dir = resolve_model(str(gguf_files[precision]))
    native = load_gguf_model(gguf_files[precision], model_dir, torch.float32, CPU)
    dense = load_model(model_dir, torch.float32, CPU)
    names = [name for name, module in native.named_modules() if isinstance(module, GgufLinear)]
    assert len(names) == 4 * native.config.num_hidden_layers + 1  # every projection and the LM head
    for name in names:
        linear = native.get_submodule(name)
        weight = dense.get_submodule(name).weight
        columns = linear(torch.eye(linear.in_features))
        assert torch.equal(columns.T, weight), name
    if precision == "Q4_K_M":
        assert native.model.layers[1].self_attn.qkv_proj.qtypes == ("Q4_K", "Q6_K")
        assert native.model.layers[1].mlp.down_proj.qtypes == ("Q6_K",)
    # The LM head tied to the embedding: on the embedding's blocks.
    assert native.lm_head.qtypes == (precision[:4],)
    # The embedding stays in its blocks too, the tied LM head's (held once); a looked-up row
    # is the dense model's, every row of the vocabulary in any order.
    embed = native.model.embed_tokens
    assert isinstance(embed, GgufEmbedding) and embed.blocks is native.lm_head.packed
    token_ids = torch.tensor([[0, 7, 259], [3, 3, 100]])
    assert torch.equal(embed(token_ids), dense.model.embed_tokens(token_ids))
    every_row = torch.randperm(embed.num_embeddings)
    assert torch.equal(embed(every_row), dense.model.embed_tokens.weight[every_row])
    with pytest.raises(IndexError):
        embed(torch.tensor([embed.num_embeddings]))
    # What stays resident: the blocks, about the size of the file's (Q4_K's 6-bit scales and
    # mins take a byte each, 148 bytes a super-block instead of 144; a matrix's last block of
    # 32 rows is padded whole), and the norms. Nothing dense of a matrix's size.
    blocks = sum(native.get_submodule(name).packed.numel() for name in names)
    tensors = gguf.GGUFReader(gguf_files[precision]).tensors
    in_file = sum(int(t.n_bytes) for t in tensors if t.data.ndim == 2)
    assert in_file <= blocks <= in_file * 1.05
    assert all(p.dim() == 1 for p in native.parameters())


@needs_kernel
def test_blocks_laid_out_chunk_by_chunk_are_the_whole_matrix(gguf_files: dict[str, Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading lays a matrix out CHUNK_ROWS rows at a time (the LM head's temporaries whole
    took ~500 MB at 0.8B): the same blocks and table as all rows at once, fused parts and
    per-head q/k reordering included."""
    model_dir = resolve_model(str(gguf_files["Q4_K_M"]))
    whole = load_gguf_model(gguf_files["Q4_K_M"], model_dir, torch.float32, CPU)
    monkeypatch.setattr("specdec.models.gguf_model.CHUNK_ROWS", 32)
    chunked = load_gguf_model(gguf_files["Q4_K_M"], model_dir, torch.float32, CPU)
    names = [name for name, module in whole.named_modules() if isinstance(module, GgufLinear)]
    assert "model.layers.0.self_attn.qkv_proj" in names and "lm_head" in names
    for name in names:
        expected, got = whole.get_submodule(name), chunked.get_submodule(name)
        assert got.table.shape[0] > 1 and torch.equal(got.table, expected.table), name
        assert torch.equal(got.packed, expected.packed), name
        assert (got.in_features, got.out_features, got.qtypes) == (expected.in_features, expected.out_features,
                                                                    expected.qtypes)


def _mapped(path: Path) -> bool:
    """Whether this process maps `path` (/proc/self/maps)."""
    return any(line.rstrip().endswith(str(path)) for line in Path("/proc/self/maps").read_text().splitlines())


@needs_kernel
@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc")
@pytest.mark.parametrize("tied", [True, False])
def test_a_loaded_model_keeps_nothing_of_the_files_mapping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           tied: bool) -> None:
    """The reader maps the whole file; a view of that mapping kept by the model would keep
    every page of it that loading touched resident. Once loaded (no garbage collection
    asked for), neither the reader nor its mapping is alive, and the file is not mapped;
    an untied embedding holds its own copy of the file's rows."""
    hf_dir = make_gguf_ready_llama(tmp_path / "hf", num_layers=1, tie_word_embeddings=tied)
    path = write_llama_gguf(hf_dir, tmp_path / "tiny.Q4_0.gguf", "Q4_0").resolve()
    model_dir = resolve_model(str(path))
    readers: list[weakref.ref[Any]] = []
    opened = gguf.GGUFReader

    class Watched(opened):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            readers.extend([weakref.ref(self), weakref.ref(self.data)])

    monkeypatch.setattr(gguf, "GGUFReader", Watched)
    model = load_gguf_model(path, model_dir, torch.bfloat16, CPU)
    assert readers and all(reader() is None for reader in readers)
    assert not _mapped(path)
    embed = model.model.embed_tokens
    assert isinstance(embed, GgufEmbedding)
    assert (embed.blocks is model.lm_head.packed) == tied
    dense = load_model(model_dir, torch.bfloat16, CPU)
    assert torch.equal(embed(torch.arange(embed.num_embeddings)), dense.model.embed_tokens.weight)


@needs_kernel
@pytest.mark.parametrize("precision", PRECISIONS)
async def test_speculation_gives_the_quantized_models_greedy_output(gguf_files: dict[str, Path],
                                                                    precision: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    async with ngram_engine(gguf_files[precision], "cpu", k=3, dtype="auto") as engine:
        assert isinstance(engine.runner.forward, CpuDecoderStack)
        assert isinstance(engine.runner.model.lm_head, GgufLinear)
        for prompt in PROMPTS:
            plain = await generate(engine, prompt, params, num_speculative_tokens=0)
            assert await generate(engine, prompt, params) == plain
        assert engine.spec.num_accepted_tokens > 0, "ngram never helped"


def test_bench_compare_gives_llama_cpp_the_file_specdec_serves(gguf_files: dict[str, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from specdec.bench import compare as bench_compare
    from specdec.bench import compare_build

    monkeypatch.setattr("specdec.models.gguf_model.gguf_kernel_supports", lambda dtype: True)
    path = str(gguf_files["Q4_K_M"])
    assert compare_build.llama_cpp_precision(bench_compare.build_parser().parse_args(["--model", path])) == "file"
    dequantised = bench_compare.build_parser().parse_args(["--model", path, "--dtype", "bfloat16"])
    assert compare_build.llama_cpp_precision(dequantised) == "F16"
