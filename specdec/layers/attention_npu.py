"""`NpuFusedPagedAttention`: paged attention through torch_npu's fused inference kernel.

One kernel call per layer covers the whole flat batch (prefill chunks, decode tokens and
verify windows alike): `torch_npu.npu_fused_infer_attention_score` with input_layout "TND"
reads K/V straight from the paged pool through a block table, the call vllm-ascend makes for
chunked prefill. The arguments, per torch_npu's documentation:

- `query` `[num_tokens, num_heads, head_dim]`: TND, the tokens of every sequence back to back;
- `key`, `value`: the pool viewed as `[num_blocks, block_size, num_kv_heads * head_dim]`;
- `block_table` `[num_seqs, max_blocks]` int32, each row padded with 0 past its blocks;
- `actual_seq_lengths`: cumulative query ends (`query_start_locs[1:]`, TND's convention);
- `actual_seq_lengths_kv`: each sequence's context length (per sequence, not cumulative);
- `sparse_mode=3` (rightDownCausal) with the compressed 2048 x 2048 mask (True above the
  diagonal = masked): query j of a sequence with q query tokens and context length L sees
  keys 0 .. L - q + j, the bottom-right aligned mask of `TorchPagedAttention`;
- `num_heads`, `num_key_value_heads` (GQA), `scale`, `block_size`.

This step's K/V are written first with `torch_npu.npu_scatter_nd_update_` (a documented
in-place ND scatter) on the pool viewed as `[num_slots, num_kv_heads, head_dim]`, indices
`slot_mapping[:, None]`.

Fallback: the plain-torch `TorchPagedAttention`. It serves everything when torch_npu is not
importable, inputs the kernel does not take (dtypes other than its documented float16 and
bfloat16; a block size that is not a multiple of 16), and any step whose kernel call raises:
that kind of step (dtype, block size, decode-only or not) is then remembered, logged once,
and sent straight to the reference from then on.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType

import torch
from torch.nn.utils.rnn import pad_sequence

from specdec.layers.attention_metadata import AttentionMetadata
from specdec.layers.attention_torch import TorchPagedAttention, write_kv

logger = logging.getLogger(__name__)

FUSED_DTYPES = (torch.float16, torch.bfloat16)
BLOCK_SIZE_ALIGNMENT = 16
# sparse_mode 3 takes this fixed compressed causal mask whatever the sequence lengths.
COMPRESSED_MASK_SIZE = 2048
SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3


def import_torch_npu() -> ModuleType | None:
    """torch_npu, or None when it is not installed."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError:
        return None


@dataclass(slots=True)
class _StepInputs:
    """What every layer of one step passes to the kernel; built once per step."""

    metadata: AttentionMetadata
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    query_ends: list[int]  # [num_seqs] cumulative
    context_lens: list[int]  # [num_seqs]
    decode_only: bool


class NpuFusedPagedAttention:
    """`AttentionBackend` on torch_npu's fused kernel; see the module docstring."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 ) -> None:
        self.reference = TorchPagedAttention(num_heads, num_kv_heads, head_dim, scale)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = self.reference.scale
        self.torch_npu = import_torch_npu()
        if self.torch_npu is None:
            logger.warning("torch_npu is not importable: attention uses the plain-torch reference")
        self.num_fused_calls = 0
        self.num_reference_calls = 0
        self._unsupported: set[tuple[torch.dtype, int, bool]] = set()
        self._fused_write = True
        self._step: _StepInputs | None = None
        self._mask: torch.Tensor | None = None

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        npu = self.torch_npu
        block_size = key_cache.shape[1]
        # A step with tree drafts takes the reference, which has the tree mask.
        if (npu is None or query.dtype not in FUSED_DTYPES
                or block_size % BLOCK_SIZE_ALIGNMENT != 0 or metadata.tree_parent_tensors()):
            return self._reference(query, key, value, key_cache, value_cache, metadata)
        step = self._step_inputs(metadata, query.device, block_size)
        kind = (query.dtype, block_size, step.decode_only)
        if kind in self._unsupported:
            return self._reference(query, key, value, key_cache, value_cache, metadata)
        self._write(npu, key, value, key_cache, value_cache, metadata.slot_mapping)
        try:
            output = self._fused(npu, query, key_cache, value_cache, step)
        except Exception as exc:
            self._unsupported.add(kind)
            logger.warning("npu_fused_infer_attention_score refused a step (%s, block size %d, %s): "
                           "%s; such steps use the plain-torch reference from now on",
                           query.dtype, block_size, "decode" if step.decode_only else "prefill/verify",
                           exc)
            return self._reference(query, key, value, key_cache, value_cache, metadata)
        self.num_fused_calls += 1
        return output

    def _reference(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor,
                   metadata: AttentionMetadata) -> torch.Tensor:
        self.num_reference_calls += 1
        return self.reference.forward(query, key, value, key_cache, value_cache, metadata)

    def _write(self, npu: ModuleType, key: torch.Tensor, value: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
               ) -> None:
        if self._fused_write:
            indices = slot_mapping.view(-1, 1)  # [num_tokens, 1]
            try:
                for pool, update in ((key_cache, key), (value_cache, value)):
                    npu.npu_scatter_nd_update_(pool.view(-1, self.num_kv_heads, self.head_dim),
                                               indices, update.to(pool.dtype))
                return
            except Exception as exc:
                self._fused_write = False
                logger.warning("npu_scatter_nd_update_ failed (%s); K/V are written with "
                               "index_copy_ from now on", exc)
        write_kv(key, value, key_cache, value_cache, slot_mapping)

    def _step_inputs(self, metadata: AttentionMetadata, device: torch.device, block_size: int,
                     ) -> _StepInputs:
        """Kernel arguments shared by every layer of a step (the metadata object is the step)."""
        step = self._step
        if step is not None and step.metadata is metadata:
            return step
        starts = metadata.query_start_locs
        query_ends: list[int] = []
        context_lens: list[int] = []
        tables: list[torch.Tensor] = []
        decode_only = True
        for index, context_len in enumerate(metadata.context_lens):
            query_len = starts[index + 1] - starts[index]
            if query_len == 0:
                continue  # nothing to attend; TND needs strictly growing query ends
            decode_only = decode_only and query_len == 1
            query_ends.append(starts[index + 1])
            context_lens.append(context_len)
            num_blocks = -(-context_len // block_size)
            tables.append(metadata.block_tables[index][:num_blocks])
        block_table = pad_sequence(tables, batch_first=True, padding_value=0).to(
            device=device, dtype=torch.int32)  # [num_seqs, max_blocks]
        self._step = _StepInputs(metadata, block_table, query_ends, context_lens, decode_only)
        return self._step

    def _fused(self, npu: ModuleType, query: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, step: _StepInputs) -> torch.Tensor:
        num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
        key_pool = key_cache.view(num_blocks, block_size, -1)  # [num_blocks, block_size, kv_heads * head_dim]
        value_pool = value_cache.view(num_blocks, block_size, -1)
        output, _ = npu.npu_fused_infer_attention_score(
            query.contiguous(), key_pool, value_pool,
            atten_mask=self._causal_mask(query.device),
            block_table=step.block_table,
            actual_seq_lengths=step.query_ends,
            actual_seq_lengths_kv=step.context_lens,
            num_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            scale=self.scale,
            input_layout="TND",
            block_size=block_size,
            sparse_mode=SPARSE_MODE_RIGHT_DOWN_CAUSAL,
        )
        return output.view(query.shape[0], self.num_heads, self.head_dim)

    def _causal_mask(self, device: torch.device) -> torch.Tensor:  # [2048, 2048] bool
        mask = self._mask
        if mask is None or mask.device != device:
            mask = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool,
                              device=device).triu_(1)
            self._mask = mask
        return mask
