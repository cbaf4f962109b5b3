"""EAGLE-3 draft heads (Li et al. 2025, arXiv:2503.01840) in the published format.

Checkpoint layout (SafeAILab/EAGLE `eagle/model/cnets.py`, SpecForge; loaded as vLLM
`model_executor/models/llama_eagle3.py` does): `config.json` (a Llama config with
`draft_vocab_size`, optionally `target_hidden_size`, `eagle_config`) and weights
`fc.weight` [H, 3 * H_target], `midlayer.self_attn.{q,k,v}_proj.weight` over 2H inputs,
`midlayer.self_attn.o_proj.weight`, `midlayer.mlp.*`, `midlayer.{input_layernorm,
hidden_norm, post_attention_layernorm}.weight`, `norm.weight`, `lm_head.weight`
[draft_vocab, H], and with a reduced draft vocabulary `d2t` [draft_vocab] (target id =
draft id + d2t[draft id]) and `t2d` [vocab] (bool: target id is in the draft vocabulary).
`embed_tokens.weight` is optional (the target's embedding otherwise).

What the head computes, checked against cnets.py (`LlamaDecoderLayeremb.forward`,
`Model.forward`, `topK_genrate`) and vLLM's llama_eagle3.py:

- *target features*: the residual stream ENTERING target layers (2, L // 2, L - 3) - the
  EAGLE repo's `modeling_llama_kv.py` appends `hidden_states` before running layer idx for
  those idx, in increasing order - unless the head's config names other ids
  (`eagle_aux_hidden_state_layer_ids`, top level or inside `eagle_config`, in vLLM's
  convention, where id i is the state entering layer i = the output of layer i - 1). That is
  exactly `LlamaForCausalLM.forward(aux_layer_ids=...)`, so ids pass through unchanged;
- fc fuses the concatenated features [n, 3 * H_target] into [n, H];
- midlayer at head position t: residual = hidden (the fused feature); the attention input
  is concat(input_layernorm(embed(token_{t+1})), hidden_norm(hidden)) - embedding FIRST;
  then residual + attention, post_attention_layernorm, MLP, residual. (`norm_before_residual`
  in the config makes the residual the normed hidden, as in vLLM.)
- logits = lm_head(norm(out)) over the draft vocabulary, mapped to target ids by d2t;
- later draft steps feed the head's own PRE-norm output instead of fc(target features)
  (cnets `topK_genrate`: `input_hidden = out_hidden`, fc skipped when the width is H;
  vLLM: `hidden_prenorm`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec.engine.kv_cache import KVCache
from specdec.errors import ConfigError
from specdec.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchPagedAttention,
    make_attention_backend,
)
from specdec.models.eagle import (
    TargetParts,
    fill_parameters,
    head_model_config,
    read_checkpoint,
)
from specdec.models.llama import LlamaAttention, LlamaMLP, RMSNorm, RotaryEmbedding
from specdec.models.model_config import ModelConfig

logger = logging.getLogger(__name__)


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default target layers: the states entering layers 2, L // 2 and L - 3."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def aux_layer_ids_from_config(raw: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """The head's `eagle_aux_hidden_state_layer_ids` (top level or in eagle_config), else the default."""
    eagle_config = raw.get("eagle_config")
    layer_ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if not layer_ids and isinstance(eagle_config, dict):
        layer_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(int(i) for i in layer_ids) if layer_ids else default_aux_layer_ids(num_target_layers)
    if any(not 0 <= i < num_target_layers for i in ids):
        raise ConfigError(f"eagle3 head: target layer ids {list(ids)} must lie in [0, "
                          f"{num_target_layers}) for a target with {num_target_layers} layers "
                          "(set eagle_aux_hidden_state_layer_ids in the head's config.json)",
                          param="model")
    return ids


class Eagle3DecoderLayer(nn.Module):
    """cnets.py's `LlamaDecoderLayeremb`: attention over concat(normed embedding, normed hidden)."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 norm_before_residual: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, backend)
        # q/k/v read [embedding, hidden]: twice the hidden size.
        self.self_attn.qkv_proj = nn.Linear(  # type: ignore[assignment]  # as published: a plain nn.Linear
            2 * config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        embeds: torch.Tensor,  # [num_tokens, hidden]
        hidden: torch.Tensor,  # [num_tokens, hidden]: fused target features or own pre-norm output
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden], pre-norm
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        attn_input = torch.cat((self.input_layernorm(embeds), hidden), dim=-1)  # [num_tokens, 2 * hidden]
        hidden = residual + self.self_attn(positions, attn_input, key_cache, value_cache, attn_metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """EAGLE-3 head; see the module docstring. `d2t` is None when the vocabularies are equal."""

    def __init__(self, config: ModelConfig, *, target_hidden_size: int, num_aux_layers: int,
                 draft_vocab_size: int, reduced_vocab: bool, norm_before_residual: bool,
                 max_positions: int, attention_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.draft_vocab_size = draft_vocab_size
        # Training runs the reference (autograd); serving passes the device's backend.
        self.attention_backend = attention_backend or TorchPagedAttention(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.rotary_emb = RotaryEmbedding(config, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(num_aux_layers * target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config, self.rotary_emb, self.attention_backend,
                                           norm_before_residual)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, draft_vocab_size, bias=False)
        self.d2t: torch.Tensor | None
        self.t2d: torch.Tensor
        if reduced_vocab:
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        else:
            self.d2t = None

    def shard_sizes(self, fused_name: str) -> list[int]:
        if fused_name == "qkv_proj":
            return [self.config.q_size, self.config.kv_size, self.config.kv_size]
        return [self.config.intermediate_size, self.config.intermediate_size]

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:  # [n, k * H_target] -> [n, H]
        return self.fc(aux.to(self.embed_tokens.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]: token t + 1 for head position t
        positions: torch.Tensor,  # [num_tokens]: head positions t
        hidden: torch.Tensor,  # [num_tokens, hidden]: combine_hidden_states(...) or own pre-norm output
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden], pre-norm: next step's input and compute_logits' input
        embeds = self.embed_tokens(input_ids)
        return self.midlayer(positions, embeds, hidden.to(embeds.dtype), kv_cache.key_caches[0],
                             kv_cache.value_caches[0], attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, draft_vocab] float32
        return self.lm_head(self.norm(hidden)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target vocabulary ids of draft vocabulary ids: id + d2t[id]."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]


def load_eagle3_head(head_dir: Path, target: TargetParts, dtype: torch.dtype, device: torch.device,
                     max_positions: int) -> tuple[Eagle3Head, tuple[int, ...]]:
    """Builds an Eagle3Head from a published checkpoint; returns it with the target layer ids it needs."""
    head_dir = Path(head_dir)
    tensors = read_checkpoint(head_dir)
    tensors = {name.removeprefix("model."): tensor for name, tensor in tensors.items()}
    tensors = {name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name: tensor
               for name, tensor in tensors.items()}  # the speculators / vLLM spelling of midlayer
    config, raw = head_model_config(head_dir, tensors, layer_prefix="midlayer.")
    if config.num_hidden_layers != 1:
        logger.warning("eagle3 head %s: config says %d layers; published EAGLE-3 heads have one "
                       "midlayer and only that one is used", head_dir, config.num_hidden_layers)
        config = _with_layers(config, 1)
    target_config = target.config
    target_hidden = int(raw.get("target_hidden_size") or config.hidden_size)
    if target_hidden != target_config.hidden_size or config.vocab_size != target_config.vocab_size:
        raise ConfigError(
            f"eagle3 head {head_dir} (target_hidden_size {target_hidden}, vocab_size "
            f"{config.vocab_size}) does not fit the target (hidden_size {target_config.hidden_size}, "
            f"vocab_size {target_config.vocab_size})", param="model")
    layer_ids = aux_layer_ids_from_config(raw, target_config.num_hidden_layers)
    draft_vocab_size = int(raw.get("draft_vocab_size") or config.vocab_size)
    reduced_vocab = "d2t" in tensors
    if draft_vocab_size != config.vocab_size and not reduced_vocab:
        raise ConfigError(f"eagle3 head {head_dir}: draft_vocab_size {draft_vocab_size} != vocab_size "
                          f"{config.vocab_size} but the checkpoint has no d2t", param="model")
    if reduced_vocab and "t2d" not in tensors:
        tensors["t2d"] = _t2d_from_d2t(tensors["d2t"], config.vocab_size)
    with torch.device("meta"):
        head = Eagle3Head(config, target_hidden_size=target_hidden, num_aux_layers=len(layer_ids),
                          draft_vocab_size=draft_vocab_size, reduced_vocab=reduced_vocab,
                          norm_before_residual=bool(raw.get("norm_before_residual", False)),
                          max_positions=max_positions,
                          attention_backend=make_attention_backend(device, config.num_attention_heads,
                                                                   config.num_key_value_heads, config.head_dim))
    head = head.to(dtype).to_empty(device=device)  # d2t / t2d keep their int64 / bool dtypes
    head.rotary_emb.reset_cache(device, dtype)
    head.requires_grad_(False)
    shared: set[str] = set()
    if "embed_tokens.weight" not in tensors:
        shared.add("embed_tokens.weight")
        head.embed_tokens.weight = nn.Parameter(target.embed_tokens, requires_grad=False)
    if "lm_head.weight" not in tensors:
        if reduced_vocab:
            raise ConfigError(f"eagle3 head {head_dir} lacks lm_head.weight", param="model")
        shared.add("lm_head.weight")  # full-vocabulary head without its own: the target's
        head.lm_head.weight = nn.Parameter(target.lm_head, requires_grad=False)
    fill_parameters(head, tensors.items(), head.shard_sizes, head_dir, shared)
    if head.d2t is not None:
        target_ids = torch.arange(draft_vocab_size, device=device) + head.d2t
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= config.vocab_size:
            raise ConfigError(f"eagle3 head {head_dir}: d2t maps draft ids outside the target "
                              f"vocabulary [0, {config.vocab_size})", param="model")
    head.eval()
    logger.info("loaded eagle3 head %s: hidden %d, target layers %s, draft vocab %d of %d, "
                "embedding from %s, %s on %s", head_dir, config.hidden_size, list(layer_ids),
                draft_vocab_size, config.vocab_size,
                "the target" if "embed_tokens.weight" in shared else "the head", dtype, device)
    return head, layer_ids


def _t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.shape[0]) + d2t.long()] = True
    return t2d


def _with_layers(config: ModelConfig, num_layers: int) -> ModelConfig:
    return dataclasses.replace(config, num_hidden_layers=num_layers)
