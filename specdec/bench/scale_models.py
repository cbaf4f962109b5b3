"""Random-weight Llama models at chosen sizes, for `bench scale`: as Hugging Face directories
and as GGUF at F16, Q8_0, Q4_K_M and Q4_0, with the default model's tokenizer and chat
template. Built once into the cache; no download (but the default model's, for its
tokenizer).

Random weights decode as fast as trained ones (the work per token is the same), so speed
at a size can be measured on a model nobody has to fetch. The size `135m` is the default
model itself, its shipped Q4_1 file among the formats. Quantised files come from
llama.cpp's own quantiser (llama-cpp-python) where it is installed, else from
`specdec.models.gguf_writer`.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.bench.llama_cpp_system import llama_cpp_installed
from specdec.models.gguf_writer import FILE_TYPES, write_llama_gguf
from specdec.models.model_files import DEFAULT_MODEL, default_cache_dir, fetch_default_gguf, resolve_model

logger = logging.getLogger(__name__)

FORMATS = ("F16", "Q8_0", "Q4_K_M", "Q4_0", "Q4_1")
# Matrices are drawn from N(0, INIT_STD), norms are ones.
INIT_STD = 0.02
# Largest safetensors shard written at once (bytes of bf16).
SHARD_BYTES = 1 << 30
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@dataclass(frozen=True)
class ScalePreset:
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int

    def num_params(self, vocab_size: int) -> int:
        head_dim = self.hidden_size // self.num_heads
        attention = self.hidden_size * head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp + 2 * self.hidden_size) + vocab_size * self.hidden_size


# Llama shapes near 0.5B, 0.8B, 1.5B and 3B with SmolLM2's 49,152-token vocabulary (tied
# embeddings), widths in whole K-quant super-blocks; `tiny` for tests.
PRESETS = {
    "tiny": ScalePreset(256, 2, 512, 4, 2),
    "0.5b": ScalePreset(1024, 28, 4096, 16, 4),
    "0.8b": ScalePreset(2048, 16, 5632, 32, 4),
    "1.5b": ScalePreset(2048, 24, 8192, 32, 4),
    "3b": ScalePreset(3072, 28, 8192, 24, 8),
}
# The default model itself (SmolLM2-135M-Instruct, trained weights): its shipped Q4_1 file,
# and the other formats written from its dequantised directory.
DEFAULT_SIZE = "135m"
SIZES = (DEFAULT_SIZE, *PRESETS)


def _tensor_shapes(preset: ScalePreset, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    head_dim = preset.hidden_size // preset.num_heads
    hidden, ffn = preset.hidden_size, preset.intermediate_size
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab_size, hidden))]
    for layer in range(preset.num_layers):
        prefix = f"model.layers.{layer}."
        shapes += [(prefix + "input_layernorm.weight", (hidden,)),
                   (prefix + "self_attn.q_proj.weight", (preset.num_heads * head_dim, hidden)),
                   (prefix + "self_attn.k_proj.weight", (preset.num_kv_heads * head_dim, hidden)),
                   (prefix + "self_attn.v_proj.weight", (preset.num_kv_heads * head_dim, hidden)),
                   (prefix + "self_attn.o_proj.weight", (hidden, preset.num_heads * head_dim)),
                   (prefix + "post_attention_layernorm.weight", (hidden,)),
                   (prefix + "mlp.gate_proj.weight", (ffn, hidden)),
                   (prefix + "mlp.up_proj.weight", (ffn, hidden)),
                   (prefix + "mlp.down_proj.weight", (hidden, ffn))]
    shapes.append(("model.norm.weight", (hidden,)))
    return shapes


def _write_weights(preset: ScalePreset, vocab_size: int, directory: Path, seed: int) -> None:
    """bf16 safetensors shards of at most SHARD_BYTES, with their index."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    shards: list[dict[str, torch.Tensor]] = []
    size = 0
    for name, shape in _tensor_shapes(preset, vocab_size):
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * INIT_STD).to(torch.bfloat16)
        if shard and size + tensor.numel() * 2 > SHARD_BYTES:
            shards.append(shard)
            shard, size = {}, 0
        shard[name] = tensor
        size += tensor.numel() * 2
    shards.append(shard)
    weight_map = {}
    for index, tensors in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in tensors})
    total = sum(tensor.numel() * 2 for tensors in shards for tensor in tensors.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_json))


def build_hf_model(name: str, cache_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """The HF directory of preset `name` (made once): config, bf16 weights and the tokenizer
    files of `tokenizer_dir`; for DEFAULT_SIZE, the default model's own directory."""
    if name == DEFAULT_SIZE:
        return resolve_model(DEFAULT_MODEL)
    preset = PRESETS[name]
    destination = cache_dir / name / "hf"
    if (destination / "config.json").is_file():
        return destination
    tokenizer_config = json.loads((tokenizer_dir / "config.json").read_text())
    vocab_size = tokenizer_config["vocab_size"]
    partial = destination.with_name("hf.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    logger.info("building random model %s (%.2fB parameters) in %s", name,
                preset.num_params(vocab_size) / 1e9, destination)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": preset.hidden_size, "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers, "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": tokenizer_config.get("bos_token_id"), "eos_token_id": tokenizer_config.get("eos_token_id"),
    }
    (partial / "config.json").write_text(json.dumps(config, indent=1))
    for file_name in _TOKENIZER_FILES:
        if (tokenizer_dir / file_name).is_file():
            shutil.copy2(tokenizer_dir / file_name, partial / file_name)
    _write_weights(preset, vocab_size, partial, seed)
    partial.replace(destination)
    return destination


def _quantize_with_llama_cpp(source: Path, destination: Path, precision: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{precision}")
    result = llama_cpp.llama_model_quantize(str(source).encode(), str(destination).encode(), params)
    if result != 0:
        raise RuntimeError(f"llama.cpp's quantiser failed on {source} -> {precision} ({result})")


def build_gguf(name: str, precision: str, cache_dir: Path, tokenizer_dir: Path,
               use_llama_cpp: bool | None = None) -> Path:
    """Preset `name` as GGUF at `precision` (made once): F16 written from the HF directory,
    the quantised formats by llama.cpp's quantiser from it (when installed, or as asked),
    else by `gguf_writer`; DEFAULT_SIZE at Q4_1 is the default model's shipped file."""
    if precision not in FILE_TYPES:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(FILE_TYPES)}")
    if name == DEFAULT_SIZE and precision == "Q4_1":
        return fetch_default_gguf(default_cache_dir())
    destination = cache_dir / name / f"{name}.{precision}.gguf"
    if destination.is_file():
        return destination
    hf_dir = build_hf_model(name, cache_dir, tokenizer_dir)
    use_llama_cpp = llama_cpp_installed() if use_llama_cpp is None else use_llama_cpp
    if precision in ("F16", "F32", "BF16") or not use_llama_cpp:
        return write_llama_gguf(hf_dir, destination, precision, tokenizer_pre="smollm")
    source = build_gguf(name, "F16", cache_dir, tokenizer_dir, use_llama_cpp)
    partial = destination.with_name(destination.name + ".partial")
    _quantize_with_llama_cpp(source, partial, precision)
    partial.replace(destination)
    return destination
