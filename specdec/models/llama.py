"""`LlamaForCausalLM`: a lean Llama-family model (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3)
written for this engine's flat batches and paged KV cache.

Terms:
- *flat batch*: tokens of several sequences concatenated (`input_ids [num_tokens]`); prefill
  chunks, decode tokens and verify windows mix freely. `positions [num_tokens]` gives each
  token's position in its own sequence; `AttentionMetadata` says which tokens belong together.
- *fused projections*: `qkv_proj` holds HF's q_proj, k_proj, v_proj stacked along the output
  dim; `gate_up_proj` holds gate_proj then up_proj. The loader fills them slice by slice
  (`stacked_params`), so one matmul replaces three (two).
- *aux hidden states*: the residual stream entering given layers (HF's `hidden_states[i]`),
  which EAGLE-3 drafters consume.

Numerics follow transformers' LlamaForCausalLM: RMSNorm in float32 then cast, RoPE with
`rotate_half` on the HF checkpoint layout, cos/sin computed in float32 and cast to the model
dtype.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from specdec.engine.kv_cache import KVCache
from specdec.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchPagedAttention,
)
from specdec.models.linear import Linear
from specdec.models.model_config import ModelConfig

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32 as transformers does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., size]
        input_dtype = hidden.dtype
        hidden32 = hidden.float()
        variance = hidden32.pow(2).mean(-1, keepdim=True)
        hidden32 = hidden32 * torch.rsqrt(variance + self.eps)
        return self.weight * hidden32.to(input_dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # [head_dim // 2] float32
    """Inverse RoPE frequencies, with linear or Llama 3.1 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by factor, interpolate in between.
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / scaling.low_freq_factor
    high_freq_wavelen = old_context_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    freq_range = scaling.high_freq_factor - scaling.low_freq_factor
    smooth = (old_context_len / wavelen - scaling.low_freq_factor) / freq_range
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE with a cos/sin table precomputed for positions [0, max_positions), indexed per token."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)  # [max_positions, head_dim]
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)  # [max_positions, head_dim]
        # The default device: meta while the loader builds the model, so nothing is computed twice.
        self.reset_cache(torch.empty(0).device, torch.float32)

    def reset_cache(self, device: torch.device, dtype: torch.dtype) -> None:
        """(Re)compute the table in float32 on `device` and store it in `dtype`."""
        inv_freq = rope_inv_freq(self.config).to(device)
        freqs = torch.arange(self.max_positions, device=device).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos_cache = emb.cos().to(dtype)
        self.sin_cache = emb.sin().to(dtype)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache[positions].unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.sin_cache[positions].unsqueeze(1)
        return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # Shared with every layer, not submodules: kept out of this module's state.
        self._rotary = (rotary,)
        self._backend = backend

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = self._rotary[0](positions, query, key)
        attn = self._backend.forward(query, key, value, key_cache, value_cache, attn_metadata)
        return self.o_proj(attn.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        # gate, up: [num_tokens, intermediate] each
        gate, up = self.gate_up_proj(hidden).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the residual stream
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        attn = self.self_attn(positions, self.input_layernorm(hidden), key_cache, value_cache, attn_metadata)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config, max_positions)
        # A ModuleList (registered as submodules), typed as what it holds.
        self.layers = cast(Sequence[LlamaDecoderLayer], nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary_emb, backend) for _ in range(config.num_hidden_layers)
        ))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def check_aux_layer_ids(aux_layer_ids: tuple[int, ...], num_layers: int) -> None:
    """Refuses layer ids a forward of `num_layers` layers has no residual stream for."""
    outside = [i for i in aux_layer_ids if not 0 <= i < num_layers]
    if outside:
        raise ValueError(f"aux_layer_ids {outside} outside [0, {num_layers})")


class LlamaForCausalLM(nn.Module):
    """The Llama family on flat batches and a paged KV cache. See the module docstring.

    Parameter names mirror transformers' checkpoint names except for the fused
    `qkv_proj` / `gate_up_proj`; `stacked_params` maps those back for the loader.
    """

    # (fused name, HF name, shard index) for every fused parameter, per weight/bias suffix.
    stacked_params: tuple[tuple[str, str, int], ...] = (
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", 1),
        ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int | None = None,
        attention_backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions or config.max_position_embeddings
        self.attention_backend = attention_backend or TorchPagedAttention(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim
        )
        self.model = LlamaModel(config, self.max_positions, self.attention_backend)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def shard_sizes(self, fused_name: str) -> list[int]:
        """Output widths of the shards stacked in a fused parameter, in shard order."""
        if fused_name == "qkv_proj":
            return [self.config.q_size, self.config.kv_size, self.config.kv_size]
        if fused_name == "gate_up_proj":
            return [self.config.intermediate_size, self.config.intermediate_size]
        raise KeyError(fused_name)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Hidden states after the final norm, `[num_tokens, hidden]`.

        With `aux_layer_ids`, returns `(hidden, aux)` where `aux[j]` is the residual stream
        entering layer `aux_layer_ids[j]` (`[num_tokens, hidden]`, before that layer's norm).
        """
        check_aux_layer_ids(aux_layer_ids, len(self.model.layers))
        hidden = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        # Filled by plain int comparisons, which dynamo traces (a dict keyed by layer id was not).
        aux: list[torch.Tensor] = [hidden] * len(aux_layer_ids)
        for layer_id, layer in enumerate(self.model.layers):
            for index, wanted in enumerate(aux_layer_ids):
                if wanted == layer_id:
                    aux[index] = hidden
            hidden = layer(
                positions, hidden, kv_cache.key_caches[layer_id], kv_cache.value_caches[layer_id], attn_metadata
            )
        hidden = self.model.norm(hidden)
        if not aux_layer_ids:
            return hidden
        return hidden, aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        return self.lm_head(hidden).float()
