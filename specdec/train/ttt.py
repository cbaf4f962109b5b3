"""Dense (unpaged) forwards of draft layers for training, with *training-time test* (TTT).

TTT (EAGLE-3, Li et al. 2025): the head is unrolled on its own outputs for several steps,
as it is when drafting. Unroll step j at index t stands for draft position t + j whose last
verified input was index t: its query attends to the step-0 keys of indices 0..t (the
verified inputs, causally) and to the keys of steps 1..j at index t only (the head's own
earlier drafts for that same verified prefix). RoPE position t + j, as in
`drafter_svc.model_proposer` (draft step i runs at input position n - 1 + i).

The layers are the inference modules themselves (`LlamaAttention`, `LlamaMLP`, norms), so
a trained head's state dict is what the loaders read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.models.llama import LlamaAttention

KeyValue = tuple[torch.Tensor, torch.Tensor]  # each [B, T, num_kv_heads, head_dim]


def attention_ttt(attn: LlamaAttention, attn_input: torch.Tensor, positions: torch.Tensor,
                  cache: list[KeyValue]) -> torch.Tensor:
    """attn_input [B, T, in] at RoPE positions [B, T]; appends this step's K/V to `cache`.

    cache[0] holds step 0 (attended causally), cache[1:] the later unroll steps (attended
    on the diagonal only). Returns [B, T, hidden].
    """
    batch, width = attn_input.shape[:2]
    qkv = attn.qkv_proj(attn_input)  # [B, T, q + 2 kv]
    query, key, value = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    query = query.reshape(batch * width, attn.num_heads, attn.head_dim)
    key = key.reshape(batch * width, attn.num_kv_heads, attn.head_dim)
    value = value.reshape(batch, width, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None and attn.k_norm is not None:
        query, key = attn.q_norm(query), attn.k_norm(key)
    query, key = attn._rotary[0](positions.reshape(-1), query, key)
    query = query.view(batch, width, attn.num_heads, attn.head_dim)
    key = key.view(batch, width, attn.num_kv_heads, attn.head_dim)
    cache.append((key, value))
    group = attn.num_heads // attn.num_kv_heads
    scale = attn.head_dim ** -0.5
    query_h = query.transpose(1, 2)  # [B, heads, T, head_dim]
    key0 = cache[0][0].transpose(1, 2).repeat_interleave(group, dim=1)
    value0 = cache[0][1].transpose(1, 2).repeat_interleave(group, dim=1)
    if len(cache) == 1:
        out = F.scaled_dot_product_attention(query_h, key0, value0, is_causal=True, scale=scale)
    else:
        causal = torch.ones(width, width, dtype=torch.bool, device=query.device).tril_()
        scores = (query_h @ key0.transpose(-1, -2)) * scale  # [B, heads, T, T]
        scores = scores.masked_fill(~causal, float("-inf"))
        diagonals = [(query_h * k.transpose(1, 2).repeat_interleave(group, dim=1)).sum(-1) * scale
                     for k, _ in cache[1:]]  # each [B, heads, T]
        probs = torch.softmax(torch.cat((scores, torch.stack(diagonals, dim=-1)), dim=-1), dim=-1)
        out = probs[..., :width] @ value0
        for step, (_, v) in enumerate(cache[1:]):
            out = out + probs[..., width + step].unsqueeze(-1) * v.transpose(1, 2).repeat_interleave(group, dim=1)
    out = out.transpose(1, 2).reshape(batch, width, attn.q_size)
    return attn.o_proj(out)


def rope_positions(batch: int, width: int, step: int) -> torch.Tensor:
    """[B, T]: t + step."""
    return (torch.arange(width) + step).expand(batch, width)
