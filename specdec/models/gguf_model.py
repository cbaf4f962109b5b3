"""Serving a GGUF file as it is: its quantized matrices stay in their blocks.

Why: the people who run models on CPUs download GGUF files, mostly Q4_K_M, Q8_0 or Q4_0;
dequantised to 16 bits such a model reads ~2-3.5x the bytes per token and holds as much
more memory. `load_gguf_model` builds the model from the file's converted directory
(`specdec.models.model_files`: config and tokenizer) and the file itself: the tensors kept
dense (norms, biases, any matrix in a type the kernel does not read) dequantised one by one
(`specdec.models.gguf_tensors`), and, for every linear whose
matrices the file holds as Q8_0, Q4_0, Q4_1, Q4_K or Q6_K, a `GgufLinear` over the file's
own blocks (the projections fused as the model fuses them; llama.cpp's per-head q/k row
order undone, as transformers undoes it), and a quantized embedding stays in its blocks too
(`GgufEmbedding` dequantises the rows a step looks up; tied to the LM head, it reads them
out of the head's blocks). Those weights are never dequantised whole: the resident weights
are the file's blocks, each matrix once, plus the dense tensors (norms, biases, matrices in
other types). Loading lays each matrix out a chunk of rows at a time, drops the file's
pages once read and keeps nothing of the reader (docs/performance.md, "Memory").

When: a GGUF file served at `--dtype auto` on a CPU whose kernels read the blocks runs as
the file is, unless `--quantization int8` asks otherwise; an explicit `--dtype` (bfloat16,
float32, float16) dequantises as before. The default model is its shipped Q4_1 file, so it
too runs on its blocks by default (docs/performance.md, "The default model", has the
evidence: faster, as accurate); where the blocks cannot run (another device, no AVX512-BF16
and VBMI, tensor parallelism) it is dequantised, as any GGUF. `--quantization gguf` (vLLM's
name) asks for the blocks and refuses where they cannot run.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.errors import ConfigError
from specdec.heap import return_free_heap
from specdec.models.gguf_blocks import BLOCK_COLUMNS, TYPE_NAMES, kernel_block_bytes, pack_rows, unpack
from specdec.models.gguf_linear import GgufEmbedding, GgufLinear, gguf_kernel_supports, own_pages
from specdec.models.gguf_names import rope_permutation
from specdec.models.llama import LlamaForCausalLM
from specdec.models.loader import load_model, load_model_config
from specdec.models.model_config import ModelConfig
from specdec.models.model_files import DEFAULT_MODEL, default_cache_dir, fetch_default_gguf

logger = logging.getLogger(__name__)

GGUF_QUANTIZATION = "gguf"
# Our fused linears and the file's matrices they concatenate, in row order.
_LAYER_LINEARS = (("self_attn.qkv_proj", ("attn_q", "attn_k", "attn_v")), ("self_attn.o_proj", ("attn_output",)),
                  ("mlp.gate_up_proj", ("ffn_gate", "ffn_up")), ("mlp.down_proj", ("ffn_down",)))


def gguf_file_of(model: str) -> Path | None:
    """The GGUF file `--model` names (a .gguf path, or the default model's shipped file), or
    None for a Hugging Face directory or a shipped draft."""
    if model.strip().lower() == DEFAULT_MODEL:
        return fetch_default_gguf(default_cache_dir())
    path = Path(model).expanduser()
    return path.resolve() if path.is_file() and path.suffix.lower() == ".gguf" else None


def native_gguf_file(model: str, dtype_name: str, quantization: str | None, device: torch.device,
                     dtype: torch.dtype, tensor_parallel_size: int) -> Path | None:
    """The GGUF file to serve as it is, or None to load the dequantised model (see the module
    docstring); ConfigError where `--quantization gguf` asks for what cannot run here."""
    asked = quantization == GGUF_QUANTIZATION
    if quantization not in (None, GGUF_QUANTIZATION):
        return None
    if not asked and dtype_name != "auto":
        return None
    source = gguf_file_of(model)
    if source is None:
        if asked:
            raise ConfigError("--quantization gguf needs a GGUF model (a .gguf file or the default model)",
                              param="quantization")
        return None
    reason = None
    if device.type != "cpu":
        reason = f"GGUF blocks run on the cpu only, not {device.type}"
    elif tensor_parallel_size != 1:
        reason = "GGUF blocks do not run with tensor parallelism"
    elif not gguf_kernel_supports(dtype):
        reason = f"this machine's C++ kernels read no GGUF blocks for {dtype} rows (AVX512-BF16 and VBMI)"
    if reason is None:
        return source
    if asked:
        raise ConfigError(f"--quantization gguf: {reason}", param="quantization")
    logger.info("GGUF %s dequantised: %s", source.name, reason)
    return None


# Rows unpacked and laid out at a time (a multiple of the kernel's 32 columns): the unpacked
# codes take a byte a weight, and laying them out a few copies more; a whole LM head of
# 49k rows at a time held ~500 MB of them at 0.8B.
CHUNK_ROWS = 2048


def _pack(tensors: list[Any], rope_heads: list[int | None]) -> tuple[np.ndarray, np.ndarray, int]:
    """The kernel's blocks and table (`gguf_blocks.pack_rows`) for the row-concatenation of
    the file matrices `tensors`, their rows in our order (llama.cpp's per-head q/k order
    undone where `rope_heads` gives the heads), written chunk by chunk of CHUNK_ROWS rows
    into pages of their own (`own_pages`): the same bytes as packing them whole. Returns
    the blocks, the table and the input width."""
    in_features = int(tensors[0].shape[0])
    if any(int(tensor.shape[0]) != in_features for tensor in tensors):
        raise ValueError("the parts of a fused matrix must share their input width")
    sizes = [kernel_block_bytes(int(t.tensor_type), in_features) * -(-int(t.shape[1]) // BLOCK_COLUMNS)
             for t in tensors]
    packed = own_pages(sum(sizes))
    tables = []
    offset = column = 0
    for tensor, heads in zip(tensors, rope_heads):
        qtype, num_rows = int(tensor.tensor_type), int(tensor.shape[1])
        raw = np.asarray(tensor.data).reshape(num_rows, -1)
        order = None if heads is None else np.argsort(rope_permutation(num_rows, heads))
        for start in range(0, num_rows, CHUNK_ROWS):
            rows = slice(start, min(start + CHUNK_ROWS, num_rows))
            blocks, table = pack_rows([unpack(raw[rows] if order is None else raw[order[rows]], qtype,
                                              in_features)])
            packed[offset:offset + blocks.size] = blocks
            table[:, 0] += offset
            table[:, 2] += column
            tables.append(table)
            offset += blocks.size
            column += rows.stop - rows.start
        _drop_pages(tensor)
    assert offset == packed.size, "the blocks' size as laid out"
    return packed, np.concatenate(tables), in_features


def _drop_pages(tensor: Any) -> None:
    """Unmaps the file's pages of `tensor`, once read, from this process (MADV_DONTNEED on
    the reader's read-only mapping: they stay in the page cache, read again if touched).
    Else every page of the file stayed resident until the reader closed, the file's size
    again at the end of loading (455 MB at 0.8B Q4_0)."""
    data = tensor.data
    while data.base is not None and not isinstance(data, np.memmap):
        data = data.base
    pages = getattr(data, "_mmap", None)
    if not isinstance(pages, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = int(tensor.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(int(tensor.data_offset) + int(tensor.n_bytes), len(pages))
    try:
        pages.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):
        pass


def native_linears(reader: Any, config: ModelConfig) -> dict[str, list[Any]]:
    """Our linear modules whose file matrices are all in types the kernel reads, with those
    matrices in row order. The LM head is `output.weight`, or the embedding where tied."""
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    plan: dict[str, list[Any]] = {}
    for layer in range(config.num_hidden_layers):
        for module, names in _LAYER_LINEARS:
            parts = [tensors.get(f"blk.{layer}.{name}.weight") for name in names]
            if all(part is not None and int(part.tensor_type) in TYPE_NAMES for part in parts):
                plan[f"model.layers.{layer}.{module}"] = parts
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if head is not None and int(head.tensor_type) in TYPE_NAMES:
        plan["lm_head"] = [head]
    return plan


def load_gguf_model(gguf_path: Path, model_dir: Path, dtype: torch.dtype, device: torch.device,
                    max_positions: int | None = None, attention_backend: str | None = None) -> LlamaForCausalLM:
    """The model of `model_dir` (the conversion of `gguf_path`) with its quantized linears on
    the file's blocks; see the module docstring."""
    import gguf

    if device.type != "cpu" or not gguf_kernel_supports(dtype):
        raise ConfigError(f"GGUF blocks run on specdec's C++ CPU kernels, not here ({device}, {dtype})",
                          param="quantization")
    reader = gguf.GGUFReader(gguf_path)
    # The vocabulary (the tokenizer comes from the converted directory): its tokens parsed as
    # small arrays, ~150 MB at 49k tokens, held by the reader until it goes.
    for name in [name for name in reader.fields if name.startswith("tokenizer.")]:
        del reader.fields[name]
    config = load_model_config(model_dir)
    plan = native_linears(reader, config)
    tied_head = config.tie_word_embeddings and "output.weight" not in {t.name for t in reader.tensors}
    leave_out = {f"{module}.weight" for module in plan if not (module == "lm_head" and tied_head)}
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is not None and int(embedding.tensor_type) in TYPE_NAMES:
        leave_out.add("model.embed_tokens.weight")
    else:
        embedding = None
    model = load_model(model_dir, dtype, device, max_positions=max_positions, leave_out=frozenset(leave_out),
                       attention_backend=attention_backend, gguf_reader=reader)
    llama_order = str(reader.fields["general.architecture"].contents()) == "llama"
    rope_heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    num_bytes = 0
    with torch.no_grad():
        for module_name, tensors in plan.items():
            parent_name, _, leaf = module_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            dense = getattr(parent, leaf)
            heads = [rope_heads.get(tensor.name.split(".")[-2]) if llama_order else None for tensor in tensors]
            linear = GgufLinear.from_blocks(*_pack(tensors, heads), bias=dense.bias)
            if (linear.in_features, linear.out_features) != (dense.in_features, dense.out_features):
                raise ConfigError(f"GGUF {gguf_path.name}: {module_name} is [{linear.out_features}, "
                                  f"{linear.in_features}] in the file, [{dense.out_features}, "
                                  f"{dense.in_features}] in its config", param="model")
            setattr(parent, leaf, linear)
            num_bytes += linear.packed.numel()
    if embedding is not None:
        dense = model.model.embed_tokens
        qtype = int(embedding.tensor_type)
        if tied_head and isinstance(model.lm_head, GgufLinear):  # its rows read from the head's blocks
            lookup = GgufEmbedding(None, qtype, dense.embedding_dim, dtype, head=model.lm_head)
        else:
            lookup = GgufEmbedding(np.asarray(embedding.data).reshape(dense.num_embeddings, -1), qtype,
                                   dense.embedding_dim, dtype)
            num_bytes += lookup.blocks.numel()
        model.model.embed_tokens = lookup  # type: ignore[assignment]  # the same call, no dense weight
    types = sorted({TYPE_NAMES[int(t.tensor_type)] for tensors in plan.values() for t in tensors})
    logger.info("GGUF %s served as the file is: %d linears on its blocks (%s, %.1f MB); other tensors "
                "dense in %s", gguf_path.name, len(plan), ", ".join(types) or "none", num_bytes / 1e6, dtype)
    # Nothing may keep a view of the file's mapping (the pages it touches would stay resident).
    del reader, plan, embedding
    return_free_heap()
    return model
