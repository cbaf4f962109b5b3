"""Tiny random draft checkpoints written to disk in the published key layouts.

- draft_model: a Hugging Face Llama directory with its tokenizer (`tests/support/tiny_models.py`);
- eagle: EAGLE-1/2 heads as SafeAILab/EAGLE releases them (`fc.weight` [H, 2H], optional
  `fc.bias`, `layers.0.*` without input_layernorm, optional `embed_tokens.weight`), as
  `pytorch_model.bin` or `model.safetensors`;
- eagle3: EAGLE-3 heads (`fc.weight` [H, 3H], `midlayer.*`, `norm.weight`, `lm_head.weight`,
  and with a reduced draft vocabulary `d2t` / `t2d`).

Each writer returns the raw tensors too, so tests can compute a reference without our loader.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.support.tiny_models import make_tiny_llama

__all__ = ["make_draft_model", "make_eagle_head", "make_eagle3_head", "target_config"]


def make_draft_model(path: Path, *, vocab_size: int = 96, num_layers: int = 2, seed: int = 0) -> Path:
    """A draft_model directory (weights + tokenizer); same arguments as the target = same model."""
    return make_tiny_llama(path, vocab_size=vocab_size, num_layers=num_layers, seed=seed)


def target_config(target_dir: Path) -> dict:
    return json.loads((Path(target_dir) / "config.json").read_text())


def _head_config(target: dict, **extra: object) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": target["hidden_size"],
        "intermediate_size": 48,
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "num_hidden_layers": 1,
        "max_position_embeddings": target["max_position_embeddings"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": target["vocab_size"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    config.update(extra)
    return config


def _random(generator: torch.Generator, *shape: int, scale: float = 0.3) -> torch.Tensor:
    return torch.randn(*shape, generator=generator) * scale


def _norm_weight(generator: torch.Generator, size: int) -> torch.Tensor:
    return 1.0 + _random(generator, size, scale=0.1)


def _layer(generator: torch.Generator, prefix: str, hidden: int, qkv_in: int, config: dict,
           norms: tuple[str, ...]) -> dict[str, torch.Tensor]:
    head_dim = hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    tensors = {
        f"{prefix}self_attn.q_proj.weight": _random(generator, q_size, qkv_in),
        f"{prefix}self_attn.k_proj.weight": _random(generator, kv_size, qkv_in),
        f"{prefix}self_attn.v_proj.weight": _random(generator, kv_size, qkv_in),
        f"{prefix}self_attn.o_proj.weight": _random(generator, hidden, q_size),
        f"{prefix}mlp.gate_proj.weight": _random(generator, inter, hidden),
        f"{prefix}mlp.up_proj.weight": _random(generator, inter, hidden),
        f"{prefix}mlp.down_proj.weight": _random(generator, hidden, inter),
    }
    for norm in norms:
        tensors[f"{prefix}{norm}.weight"] = _norm_weight(generator, hidden)
    return tensors


def _save(path: Path, config: dict, tensors: dict[str, torch.Tensor], weights_format: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if weights_format == "safetensors":
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path / "model.safetensors"))
    else:
        torch.save(tensors, path / "pytorch_model.bin")


def make_eagle_head(path: Path, target_dir: Path, *, fc_bias: bool, with_embed: bool,
                    weights_format: str = "bin", seed: int = 1) -> dict[str, torch.Tensor]:
    """An EAGLE-1/2 head for the target in `target_dir`; returns its tensors."""
    target = target_config(target_dir)
    config = _head_config(target, bias=fc_bias)  # EAGLE's ea_model reads "bias" for fc
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    tensors = {"fc.weight": _random(generator, hidden, 2 * hidden)}
    if fc_bias:
        tensors["fc.bias"] = _random(generator, hidden)
    tensors.update(_layer(generator, "layers.0.", hidden, hidden, config, ("post_attention_layernorm",)))
    if with_embed:
        tensors["embed_tokens.weight"] = _random(generator, config["vocab_size"], hidden, scale=1.0)
    saved = dict(tensors)
    if weights_format == "bin":  # old EAGLE training code saved the RoPE buffer too
        head_dim = hidden // config["num_attention_heads"]
        saved["layers.0.self_attn.rotary_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)
    _save(path, config, saved, weights_format)
    return tensors


def make_eagle3_head(path: Path, target_dir: Path, *, draft_vocab_size: int | None,
                     layer_ids: list[int] | None, with_embed: bool = False,
                     weights_format: str = "safetensors", seed: int = 2) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head; `draft_vocab_size` None = the target's vocabulary (no d2t / t2d)."""
    target = target_config(target_dir)
    vocab_size = target["vocab_size"]
    extra: dict[str, object] = {"architectures": ["LlamaForCausalLMEagle3"],
                                "draft_vocab_size": draft_vocab_size or vocab_size}
    if layer_ids is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids,
                                 "use_aux_hidden_state": True}
    config = _head_config(target, **extra)
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    tensors = {"fc.weight": _random(generator, hidden, 3 * hidden)}
    tensors.update(_layer(generator, "midlayer.", hidden, 2 * hidden, config,
                          ("input_layernorm", "hidden_norm", "post_attention_layernorm")))
    tensors["norm.weight"] = _norm_weight(generator, hidden)
    tensors["lm_head.weight"] = _random(generator, draft_vocab_size or vocab_size, hidden)
    if draft_vocab_size is not None:
        # The draft vocabulary: a random subset of target ids, in increasing order as SpecForge builds it.
        chosen = torch.randperm(vocab_size, generator=generator)[:draft_vocab_size].sort().values
        tensors["d2t"] = chosen - torch.arange(draft_vocab_size)
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[chosen] = True
        tensors["t2d"] = t2d
    if with_embed:
        tensors["embed_tokens.weight"] = _random(generator, vocab_size, hidden, scale=1.0)
    _save(path, config, tensors, weights_format)
    return tensors
