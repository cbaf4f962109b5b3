"""Load a `LlamaForCausalLM` from a Hugging Face model directory.

Reads `config.json` (plus `generation_config.json` for extra stop ids) and the weights from
`model.safetensors`, sharded safetensors with `model.safetensors.index.json`, or
`pytorch_model.bin` (sharded or not, read with `weights_only=True`), or, for a GGUF model's
directory in the cache, the GGUF file it names (`model_files.GGUF_SOURCE_FILE`; dequantised tensor by
tensor, `specdec.models.gguf_tensors`). Loading is strict: a
missing or unexpected tensor, or one of the wrong shape, raises `ConfigError` naming it.

Parameters are allocated uninitialised on the target device and filled tensor by tensor,
so no random init runs and at most one checkpoint tensor is in flight at a time.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from specdec.errors import ConfigError
from specdec.layers.attention import make_attention_backend
from specdec.models.gguf_tensors import iter_gguf_tensors
from specdec.models.llama import LlamaForCausalLM
from specdec.models.model_config import ModelConfig
from specdec.models.model_files import gguf_source
from specdec.models.parallel import (
    ParallelContext,
    finish_loading,
    install_all_reduce,
    rank_config,
    shard_tensor,
)

logger = logging.getLogger(__name__)

# Checkpoint tensors that carry no weights of ours (derived buffers saved by old transformers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}", param="model") from None


def load_model_config(model_dir: Path) -> ModelConfig:
    """Parse `model_dir/config.json` (and generation_config.json's eos ids) into a ModelConfig."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"model directory {model_dir} does not exist", param="model")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"model directory {model_dir} has no config.json", param="model")
    raw = _read_json(config_path)
    extra_eos: tuple[int, ...] = ()
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        eos = _read_json(generation_path).get("eos_token_id")
        extra_eos = (eos,) if isinstance(eos, int) else tuple(eos or ())
    try:
        return ModelConfig.from_hf(raw, extra_eos_token_ids=extra_eos)
    except ConfigError as error:
        raise ConfigError(f"{config_path}: {error.message}", param=error.param) from None


def _weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint files, safetensors preferred over pytorch_model.bin; a GGUF model's
    directory: its GGUF file."""
    source = gguf_source(model_dir)
    if source is not None:
        return [source]
    for index_name, single_name in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index_path = model_dir / index_name
        if index_path.is_file():
            weight_map = _read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConfigError(f"{index_path} has no weight_map", param="model")
            return [model_dir / name for name in sorted(set(weight_map.values()))]
        if (model_dir / single_name).is_file():
            return [model_dir / single_name]
    raise ConfigError(
        f"model directory {model_dir} holds no weights (model.safetensors, sharded safetensors "
        "with model.safetensors.index.json, or pytorch_model.bin)",
        param="model",
    )


def _iter_tensors(path: Path, keep: Callable[[str], bool] | None = None,
                  gguf_reader: Any | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, cpu tensor) from one checkpoint file (only names `keep` accepts, when
    given; the others are not read); a corrupt file raises ConfigError. A GGUF file is read
    through `gguf_reader` where the caller has one open on it."""
    if not path.is_file():
        raise ConfigError(f"weight file {path} is missing", param="model")
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    if keep is None or keep(name):
                        yield name, reader.get_tensor(name)
        elif path.suffix.lower() == ".gguf":
            yield from iter_gguf_tensors(path if gguf_reader is None else gguf_reader, keep)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from ((name, tensor) for name, tensor in state.items() if keep is None or keep(name))
    except ConfigError:
        raise
    except Exception as error:  # safetensors / pickle errors come in many types
        raise ConfigError(f"cannot read weights from {path}: {error}", param="model") from None


def _target_of(model: LlamaForCausalLM, hf_name: str) -> tuple[str, int | None]:
    """Our parameter name for a checkpoint tensor name, and its shard index if fused."""
    for fused, original, shard in model.stacked_params:
        marker = f".{original}."
        if marker in hf_name:
            return hf_name.replace(marker, f".{fused}."), shard
    return hf_name, None


def load_model(
    model_dir: Path, dtype: torch.dtype, device: torch.device, max_positions: int | None = None,
    parallel: ParallelContext | None = None, borrow_from: Path | None = None,
    leave_out: frozenset[str] = frozenset(),
    attention_backend: str | None = None, gguf_reader: Any | None = None,
) -> LlamaForCausalLM:
    """Build the model described by `model_dir/config.json` and fill it from the checkpoint.

    `max_positions` bounds the RoPE table (default: the config's max_position_embeddings);
    pass `--max-model-len` to save memory on long-context models. With `parallel`, only this
    rank's tensor-parallel shard is built and read (see `specdec.models.parallel`); its
    `config` is then the rank-local one. With `borrow_from` (another model directory, e.g.
    the target of a shipped draft that leaves out its embedding), tensors the checkpoint
    lacks are read from there instead, with the same shape checks. Parameters named in
    `leave_out` (ours, e.g. `model.layers.0.self_attn.qkv_proj.weight`) are neither read nor
    required: the caller replaces their modules (their memory, never written, is never
    resident). `attention_backend`: see `make_attention_backend`. `gguf_reader`: a
    `GGUFReader` open on a GGUF model's file, read instead of parsing the file again.
    """
    model_dir = Path(model_dir)
    started = time.perf_counter()
    config = load_model_config(model_dir)
    if parallel is not None:
        config = rank_config(config, parallel.world_size)
    model = _empty_model(config, dtype, device, max_positions, parallel, attention_backend)
    params = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
    loaded: set[tuple[str, int | None]] = set()
    for path in _weight_files(model_dir):
        loaded |= _fill_from(path, model, params, parallel, leave_out, gguf_reader)
    missing = _expected_tensors(model, params, leave_out) - loaded
    if missing and borrow_from is not None:
        missing = _borrow(model, params, missing, Path(borrow_from))
    if missing:
        names = sorted(_hf_name(model, name, shard) for name, shard in missing)
        raise ConfigError(f"checkpoint in {model_dir} lacks tensors: {', '.join(names[:8])}", param="model")
    if parallel is not None:
        finish_loading(model, parallel)
    model.eval()
    num_params = sum(p.numel() for p in params.values())
    logger.info(
        "loaded %s (%s, %.1fM params) as %s on %s in %.1f s",
        model_dir, config.model_type, num_params / 1e6, dtype, device, time.perf_counter() - started,
    )
    return model


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None, parallel: ParallelContext | None,
                 attention_backend: str | None) -> LlamaForCausalLM:
    """The model's modules on `device`, their memory allocated but not written."""
    backend = make_attention_backend(device, config.num_attention_heads, config.num_key_value_heads,
                                     config.head_dim, attention_backend)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions=max_positions, attention_backend=backend)
    if parallel is not None:
        install_all_reduce(model, parallel)
    model = model.to(dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.reset_cache(device, dtype)
    model.requires_grad_(False)
    return model


def _expected_tensors(model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter],
                      leave_out: frozenset[str]) -> set[tuple[str, int | None]]:
    """(parameter, shard) pairs a complete checkpoint fills: each shard of a fused one."""
    expected: set[tuple[str, int | None]] = set()
    for name in params:
        if name in leave_out:
            continue
        fused = next((f for f, _, _ in model.stacked_params if f".{f}." in name), None)
        if fused is None:
            expected.add((name, None))
        else:
            expected.update((name, shard) for shard in range(len(model.shard_sizes(fused))))
    return expected


def _fill_from(path: Path, model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter],
               parallel: ParallelContext | None, leave_out: frozenset[str],
               gguf_reader: Any | None) -> set[tuple[str, int | None]]:
    """Copies one checkpoint file's tensors into `params` (this rank's shard of each);
    returns the (parameter, shard) pairs it filled."""
    config = model.config
    loaded: set[tuple[str, int | None]] = set()
    for hf_name, tensor in _iter_tensors(path, lambda hf_name: _target_of(model, hf_name)[0] not in leave_out,
                                         gguf_reader):
        if hf_name.endswith(_IGNORED_SUFFIXES):
            continue
        if config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue  # some tied checkpoints store the shared matrix twice
        name, shard = _target_of(model, hf_name)
        if name in leave_out:
            continue
        if parallel is not None:
            tensor = shard_tensor(hf_name, tensor, parallel)
        if name not in params:
            raise ConfigError(f"unexpected tensor {hf_name!r} in {path}", param="model")
        target = params[name].data
        if shard is not None:
            fused = name.rsplit(".", 2)[-2]
            sizes = model.shard_sizes(fused)
            target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
        if tuple(tensor.shape) != tuple(target.shape):
            raise ConfigError(
                f"tensor {hf_name!r} in {path} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape)}",
                param="model",
            )
        target.copy_(tensor)
        loaded.add((name, shard))
    return loaded


def _borrow(model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter],
            missing: set[tuple[str, int | None]], borrow_from: Path) -> set[tuple[str, int | None]]:
    """Fills unsharded missing parameters from `borrow_from`'s checkpoint; returns what is still missing."""
    wanted = {name for name, shard in missing if shard is None}
    for path in _weight_files(borrow_from):
        for hf_name, tensor in _iter_tensors(path, keep=wanted.__contains__):
            target = params[hf_name].data
            if tuple(tensor.shape) != tuple(target.shape):
                raise ConfigError(f"borrowed tensor {hf_name!r} in {path} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(target.shape)}", param="model")
            target.copy_(tensor)
            missing = missing - {(hf_name, None)}
    logger.info("borrowed %s from %s", ", ".join(sorted(wanted)), borrow_from)
    return missing


def _hf_name(model: LlamaForCausalLM, name: str, shard: int | None) -> str:
    """The checkpoint name of one of our parameters (or of one shard of a fused one)."""
    if shard is None:
        return name
    for fused, original, index in model.stacked_params:
        if index == shard and f".{fused}." in name:
            return name.replace(f".{fused}.", f".{original}.")
    return name
