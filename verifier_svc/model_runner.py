"""Owns the target model's tensors: turns a planned step into one forward pass.

Input layout (flat batching): the tokens of every scheduled sequence concatenated, each
sequence's uncomputed chunk followed by its draft tokens. Logits are computed only for
the rows that are sampled: all 1 + k rows of a decode with k drafts, the last row of a
prefill's final chunk, none for an intermediate chunk.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.engine.draft_tree import depths
from specdec.engine.kv_cache import KVCache
from specdec.layers.attention import AttentionMetadata
from specdec.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from specdec.models.compiled_forward import CompiledForward
    from specdec.models.cpu_stack import CpuDecoderStack
    from verifier_svc.tp_worker import TensorParallelGroup


@dataclass(slots=True)
class StepInput:
    """One sequence's share of a forward."""

    token_ids: list[int]      # uncomputed chunk + drafts
    start_position: int       # position of token_ids[0] (= tokens already in the cache)
    block_table: list[int]
    num_logit_rows: int       # trailing rows whose logits are needed
    # The segment's tree parents (AttentionMetadata's terms) when its draft is a tree: a
    # token then sits at start_position + its depth below the chunk's first token; None:
    # the tokens are a chain, at consecutive positions.
    tree_parents: list[int] | None = None


@dataclass(slots=True)
class PreparedBatch:
    input_ids: torch.Tensor       # [num_tokens] int64
    positions: torch.Tensor       # [num_tokens] int64
    attn_metadata: AttentionMetadata
    logit_indices: torch.Tensor   # [num_logit_rows] int64
    logit_offsets: list[int]      # [num_seqs + 1]: sequence i's rows in the logits


class ModelRunner:
    """With `tensor_parallel`, this is rank 0: each forward first goes to the other ranks
    (see `verifier_svc.tp_worker`) and `model` / `kv_cache` hold rank 0's shards."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int,
                 device: torch.device, tensor_parallel: TensorParallelGroup | None = None,
                 forward: CompiledForward | CpuDecoderStack | None = None) -> None:
        self.model = model
        # The forward each step runs: a faster forward of the model when built with one.
        self.forward: LlamaForCausalLM | CompiledForward | CpuDecoderStack = forward or model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.dtype = kv_cache.key_caches[0].dtype
        self.tensor_parallel = tensor_parallel

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def prepare(self, inputs: list[StepInput]) -> PreparedBatch:
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_locs = [0]
        context_lens: list[int] = []
        block_tables: list[torch.Tensor] = []
        logit_indices: list[int] = []
        logit_offsets = [0]
        block_size = self.block_size
        tree_parents: list[list[int] | None] = []
        for step in inputs:
            num_query = len(step.token_ids)
            start = step.start_position
            token_ids.extend(step.token_ids)
            table = step.block_table
            for position in range(start, start + num_query):
                slots.append(table[position // block_size] * block_size + position % block_size)
            if step.tree_parents is None:
                positions.extend(range(start, start + num_query))
            else:
                # Chunk tokens are a chain from -1, so depth - 1 is the offset from start.
                positions.extend(start + depth - 1 for depth in depths(step.tree_parents))
            tree_parents.append(step.tree_parents)
            end = query_start_locs[-1] + num_query
            logit_indices.extend(range(end - step.num_logit_rows, end))
            logit_offsets.append(logit_offsets[-1] + step.num_logit_rows)
            query_start_locs.append(end)
            context_lens.append(start + num_query)
            block_tables.append(torch.tensor(table, dtype=torch.long, device=self.device))
        device = self.device
        return PreparedBatch(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            attn_metadata=AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
                query_start_locs=query_start_locs,
                context_lens=context_lens,
                block_tables=block_tables,
                tree_parents=(tree_parents if any(parents is not None for parents in tree_parents)
                              else None),
            ),
            logit_indices=torch.tensor(logit_indices, dtype=torch.long, device=device),
            logit_offsets=logit_offsets,
        )

    @torch.inference_mode()
    def execute(self, batch: PreparedBatch, hidden_layer_ids: tuple[int, ...] = (),
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the forward.

        Returns float32 logits on the CPU, [num_logit_rows, vocab], and, when
        `hidden_layer_ids` asks for them, the target hidden states of every input token
        on the CPU, [num_tokens, len(hidden_layer_ids) * hidden]: layer id -1 is the
        final hidden state after the last norm, layer id i the residual stream entering
        layer i.
        """
        aux_layer_ids = tuple(i for i in hidden_layer_ids if i >= 0)
        parallel_step = (contextlib.nullcontext() if self.tensor_parallel is None else
                         self.tensor_parallel.step(batch.input_ids, batch.positions,
                                                   batch.attn_metadata))
        with parallel_step:
            if aux_layer_ids:
                hidden, aux = self.forward(batch.input_ids, batch.positions, self.kv_cache,
                                           batch.attn_metadata, aux_layer_ids)
            else:
                hidden = self.forward(batch.input_ids, batch.positions, self.kv_cache,
                                      batch.attn_metadata)
        captured = None
        if hidden_layer_ids:
            by_id = dict(zip(aux_layer_ids, aux)) if aux_layer_ids else {}
            parts = [hidden if i < 0 else by_id[i] for i in hidden_layer_ids]
            captured = torch.cat(parts, dim=-1).cpu()
        if batch.logit_indices.numel() == 0:
            return torch.empty(0, 0), captured
        logits = self.model.compute_logits(hidden[batch.logit_indices])
        return logits.float().cpu(), captured
