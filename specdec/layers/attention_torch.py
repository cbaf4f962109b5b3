"""The plain-torch reference backend: gathers K/V by block table, then SDPA. It runs on
cpu, cuda and npu; faster backends are tested against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.layers.attention_metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store each token's K/V at its slot (in place; the pools are contiguous)."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def tree_attention_mask(parents: list[int], context_len: int, device: torch.device) -> torch.Tensor:
    """[len(parents), context_len] bool, True where a tree segment's token may attend: the
    cached prefix and its path (AttentionMetadata's terms)."""
    query_len = len(parents)
    first_position = context_len - query_len
    mask = torch.zeros(query_len, context_len, dtype=torch.bool)
    mask[:, :first_position] = True
    for token, parent in enumerate(parents):
        if not -1 <= parent < token:
            raise ValueError(f"tree parent {parent} of token {token} does not come before it")
        if parent >= 0:
            mask[token] = mask[parent]
        mask[token, first_position + token] = True
    return mask.to(device)


class TorchPagedAttention:
    """Reference paged attention: gather each sequence's K/V by block table, then SDPA.

    One instance serves every layer of a model. It keeps a boolean causal mask that grows
    on demand and is sliced per sequence, so a step allocates no mask; single-token queries
    (plain decode) need none at all. A sequence whose whole context arrives in this step
    (a first prefill chunk) attends to its own input K/V and skips the gather.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self._causal_mask: torch.Tensor | None = None  # [n, n] bool, True where attending is allowed

    def _mask_rows(self, first_position: int, context_len: int, device: torch.device) -> torch.Tensor:
        """Rows `first_position .. context_len - 1` of the causal mask, columns `0 .. context_len - 1`."""
        mask = self._causal_mask
        if mask is None or mask.shape[0] < context_len or mask.device != device:
            size = max(256, 1 << (context_len - 1).bit_length())
            mask = torch.ones(size, size, dtype=torch.bool, device=device).tril_()
            self._causal_mask = mask
        return mask[first_position:context_len, :context_len]  # [query_len, context_len]

    def _attend(
        self,
        query: torch.Tensor,  # [query_len, num_heads, head_dim]
        key: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
        value: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
        mask: torch.Tensor | None,  # [query_len, context_len] bool
        is_causal: bool,
    ) -> torch.Tensor:  # [query_len, num_heads, head_dim]
        out_dtype = query.dtype
        if query.device.type == "cpu" and out_dtype in (torch.bfloat16, torch.float16):
            # torch's CPU SDPA in 16 bits is 4-6x slower than in fp32 for the few query rows
            # of a decode or verify step (bf16, 9 heads, 800 cached tokens, one row: ~350 us
            # against ~55 us; prefill costs the same either way). So the math runs in fp32;
            # the cache and the output stay 16-bit.
            query, key, value = query.float(), key.float(), value.float()
        query_h = query.transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_dim]
        key_h = key.transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, context_len, head_dim]
        value_h = value.transpose(0, 1).unsqueeze(0)
        gqa = self.num_kv_heads != self.num_heads
        native_gqa = gqa and query.device.type in ("cpu", "cuda")
        if gqa and not native_gqa:
            group = self.num_heads // self.num_kv_heads
            key_h = key_h.repeat_interleave(group, dim=1)
            value_h = value_h.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            query_h, key_h, value_h,
            attn_mask=mask, is_causal=is_causal, scale=self.scale, enable_gqa=native_gqa,
        )  # [1, num_heads, query_len, head_dim]
        return out.squeeze(0).transpose(0, 1).to(out_dtype)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        block_size = key_cache.shape[1]
        starts = metadata.query_start_locs
        if len(metadata.context_lens) == 1 and starts[1] - starts[0] == query.shape[0]:
            output = None  # one sequence: its result is the whole output, no copy needed
        else:
            output = torch.empty_like(query)
        for seq_index, context_len in enumerate(metadata.context_lens):
            start, end = starts[seq_index], starts[seq_index + 1]
            query_len = end - start
            if query_len == 0:
                continue
            tree_parents = metadata.tree_of(seq_index)
            if context_len == query_len and tree_parents is None:
                # Invariant: the cache holds exactly this step's tokens, so attend to them directly.
                seq_key, seq_value = key[start:end], value[start:end]
                mask, is_causal = None, query_len > 1
            else:
                num_blocks = -(-context_len // block_size)
                block_table = metadata.block_tables[seq_index][:num_blocks]
                seq_key = key_cache.index_select(0, block_table).flatten(0, 1)[:context_len]
                seq_value = value_cache.index_select(0, block_table).flatten(0, 1)[:context_len]
                if seq_key.dtype != query.dtype:
                    seq_key, seq_value = seq_key.to(query.dtype), seq_value.to(query.dtype)
                mask = None
                if tree_parents is not None:
                    mask = tree_attention_mask(tree_parents, context_len, query.device)
                elif query_len > 1:
                    mask = self._mask_rows(context_len - query_len, context_len, query.device)
                is_causal = False
            seq_out = self._attend(query[start:end], seq_key, seq_value, mask, is_causal)
            if output is None:
                return seq_out
            output[start:end] = seq_out
        assert output is not None, "metadata describes no query tokens"
        return output
