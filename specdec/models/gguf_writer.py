"""Writing a Llama checkpoint (a Hugging Face directory) as a GGUF file that llama.cpp and
transformers load, at F32, F16, BF16, Q8_0, Q4_0, Q4_1 or Q4_K_M.

For `bench scale` and the tests: the same random model as an HF directory and as GGUF at
each precision, so specdec and llama.cpp run the same file. What llama.cpp's converter
writes for a Llama: its metadata under `llama.*`, the tokenizer (a byte-level BPE as
`gpt2`, with merges and the chat template), q and k rows permuted per head into llama.cpp's
RoPE order (transformers undoes it on load), 1-D tensors at F32. Quantised matrices at the
precision's type, with llama.cpp's Q4_K_M mix (Q6_K for the output and for attn_v and
ffn_down in a quarter or so of the layers); a matrix whose width the type's blocks do not
divide falls back to Q8_0, else F16. Q8_0, Q4_0 and Q4_1 are quantised by the `gguf`
package, Q4_K and Q6_K by `specdec.models.gguf_kquants` (or, when given, a quantiser of the
caller's).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from specdec.models.gguf_blocks import inputs_per_block
from specdec.models.gguf_kquants import quantize_q4_k, quantize_q6_k
from specdec.models.gguf_names import gguf_tensor_name, rope_permutation

logger = logging.getLogger(__name__)

# precision -> llama.cpp's general.file_type
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15, "BF16": 32}
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4


def _more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's Q4_K_M gives these layers' attn_v and ffn_down Q6_K."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def tensor_type(precision: str, name: str, shape: tuple[int, ...], num_layers: int) -> str:
    """The GGML type a tensor is written at, as llama.cpp's quantiser picks it."""
    import gguf

    if len(shape) == 1:
        return "F32"
    if precision in ("F32", "F16", "BF16"):
        return precision
    wanted = precision
    if precision == "Q4_K_M":
        wanted = "Q4_K"
        if name == "output.weight":
            wanted = "Q6_K"
        elif name.endswith((".attn_v.weight", ".ffn_down.weight")) and _more_bits(int(name.split(".")[1]), num_layers):
            wanted = "Q6_K"
    for candidate in (wanted, "Q8_0"):
        if shape[-1] % inputs_per_block(int(gguf.GGMLQuantizationType[candidate])) == 0:
            return candidate
    return "F16"


def quantize_rows(values: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [rows, k] -> the raw blocks of `type_name`, uint8 [rows, row bytes]."""
    import gguf

    if type_name == "Q4_K":
        return quantize_q4_k(values)
    if type_name == "Q6_K":
        return quantize_q6_k(values)
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])


def _checkpoint(model_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors as float32 arrays, read as the loader reads them (a GGUF
    model's directory: from its file)."""
    from specdec.models.loader import _iter_tensors, _weight_files  # the loader reads GGUF names through this module

    for path in _weight_files(model_dir):
        for name, tensor in _iter_tensors(path):
            yield name, tensor.float().numpy()


def _tokenizer_fields(model_dir: Path, vocab_size: int) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json as GGUF's `gpt2` tokenizer lists."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    model = tokenizer["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{model_dir}'s tokenizer is {model.get('type')}, not a byte-level BPE")
    tokens = [f"[PAD{index}]" for index in range(vocab_size)]
    types = [_TOKEN_USER_DEFINED] * vocab_size
    for token, index in model["vocab"].items():
        if index < vocab_size:
            tokens[index], types[index] = token, _TOKEN_NORMAL
    for added in tokenizer.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = _TOKEN_CONTROL if added.get("special") else _TOKEN_USER_DEFINED
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model.get("merges", [])]
    template = None
    if (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    elif (model_dir / "tokenizer_config.json").is_file():
        template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    return {"tokens": tokens, "types": types, "merges": merges, "chat_template": template}


def write_llama_gguf(model_dir: Path, destination: Path, precision: str, tokenizer_pre: str = "default") -> Path:
    """Writes the Llama in `model_dir` to `destination` at `precision` (see FILE_TYPES);
    written under a temporary name first, so an interrupted run leaves no half file."""
    import gguf

    if precision not in FILE_TYPES:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(FILE_TYPES)}")
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "llama" or config.get("rope_scaling"):
        raise ValueError("write_llama_gguf writes Llama models with the default RoPE")
    num_layers, num_heads = config["num_hidden_layers"], config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads", num_heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    partial = destination.with_name(destination.name + ".partial")
    destination.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(partial, "llama")
    writer.add_name(model_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(FILE_TYPES[precision])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    fields = _tokenizer_fields(model_dir, config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre)
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["types"])
    writer.add_token_merges(fields["merges"])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        value = config.get(key)
        if isinstance(value, list):
            value = value[0]
        if isinstance(value, int):
            add(value)
    writer.add_add_bos_token(False)
    if fields["chat_template"]:
        writer.add_chat_template(fields["chat_template"])
    for hf_name, values in _checkpoint(model_dir):
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        name = gguf_tensor_name(hf_name)
        if name.endswith(".attn_q.weight"):
            values = values[rope_permutation(values.shape[0], num_heads)]
        elif name.endswith(".attn_k.weight"):
            values = values[rope_permutation(values.shape[0], num_kv_heads)]
        kind = tensor_type(precision, name, values.shape, num_layers)
        if kind == "F32":
            writer.add_tensor(name, values.astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(name, values.astype(np.float16))
        else:
            raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16) if kind == "BF16" \
                else quantize_rows(values, kind)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(destination)
    logger.info("wrote %s (%s, %.1f MB)", destination, precision, destination.stat().st_size / 1e6)
    return destination
