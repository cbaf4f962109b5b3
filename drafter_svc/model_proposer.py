"""Machinery shared by the model-based methods (draft_model, eagle, eagle3).

Terms:
- *input position* p: one slot of the draft model's own KV cache. For draft_model input p
  is token p of the context. For EAGLE heads input p pairs token p + 1 with the target's
  feature at position p (the head predicts the next feature), so a context of n tokens
  whose first n - 1 features arrived has n - 1 *verified inputs*.
- *verified inputs*: inputs built only from the verified context (and target features).
  `DraftSequence.num_computed` of them have valid K/V in the draft cache.
- *draft inputs*: inputs built from the drafter's own proposals. Step i of a proposal
  (i = 1 .. k - 1) writes input position n - 1 + i. For draft_model those K/V are exactly
  what the verified context will produce if the drafts are accepted, so up to k - 1 of them
  are kept on acceptance; EAGLE heads feed their own predicted feature there, never the
  target's, so their draft inputs are always recomputed (`reuses_draft_kv = False`).

One proposal of k tokens costs k batched forwards over all proposing sequences (flat
batching through `AttentionMetadata`): step 0 runs every sequence's uncomputed verified
inputs (a prefill chunk; at least the last one, whose output gives the first draft),
steps 1 .. k - 1 run one draft input per sequence still drafting.

Rollback: after the verifier accepted a of the k drafts, `rollback` notes
min(a, drafts cached) reusable positions and `append_tokens` keeps those whose draft token
equals the token the verifier appended (a check, so a confused peer can cost speed, never
correctness). Stale K/V past `num_computed` are simply overwritten later.

Drafts are greedy (argmax, one-hot q) unless `draft_sampling` is set: then each token is
sampled from softmax(draft logits) and those probabilities travel as `draft_probs`, so the
verifier can accept with min(1, p/q) (Leviathan et al. 2023).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from drafter_svc.proposer import Proposal, ProposerInfo
from specdec.engine.block_manager import BlockManager
from specdec.engine.kv_cache import KVCache
from specdec.engine.logits_processor import argmax_rows
from specdec.layers.attention import AttentionMetadata
from specdec.models.model_config import ModelConfig

logger = logging.getLogger(__name__)


class DraftKVPool:
    """The draft KV cache of a drafter server, shared by all its streams (one block table per sequence)."""

    def __init__(self, model_config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.kv_cache = KVCache.allocate(model_config, num_blocks, block_size, dtype, device)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.block_size = block_size


@dataclass(slots=True)
class DraftSequence:
    """One sequence's drafter state. Invariant: inputs [0, num_computed) have valid K/V."""

    block_table: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the verified context
    num_computed: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # the last proposal
    num_draft_cached: int = 0  # leading drafts whose K/V follow the verified inputs
    num_reusable: int = 0  # set by rollback: cached drafts the verifier accepted
    # Target features not yet run, rows for input positions [feature_start, ...); the row of
    # the last verified input is kept after use, so it can be rerun to draft again.
    feature_chunks: list[torch.Tensor] = field(default_factory=list)
    feature_start: int = 0


@dataclass(slots=True)
class _Work:
    """One sequence's part of a proposal."""

    index: int  # into the propose() arguments
    seq: DraftSequence
    num_tokens: int  # k for this sequence
    start: int  # first verified input to run in step 0
    num_inputs: int  # verified inputs
    block_table: torch.Tensor  # int64 on the device
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: list[torch.Tensor] = field(default_factory=list)


class ModelProposer:
    """A `Proposer` for one stream over a shared model and KV pool; subclasses supply the model."""

    uses_features: ClassVar[bool] = False  # EAGLE: inputs pair tokens with target features
    reuses_draft_kv: ClassVar[bool] = True  # draft_model: accepted drafts' K/V stay valid

    def __init__(self, info: ProposerInfo, pool: DraftKVPool, device: torch.device,
                 feature_dtype: torch.dtype, max_positions: int, *, draft_sampling: bool = False,
                 seed: int = 0, token_map: torch.Tensor | None = None) -> None:
        self.info = info
        # Target ids of the draft vocabulary's ids when the LM head was cut to a token map
        # (specdec/models/token_map.py); None: the draft vocabulary is the target's.
        self._token_map = None if token_map is None else token_map.to(device)
        self._pool = pool
        self._device = device
        self._feature_dtype = feature_dtype
        self._max_positions = max_positions
        self._draft_sampling = draft_sampling
        self._generator = torch.Generator(device=device).manual_seed(seed) if draft_sampling else None
        self._seqs: dict[int, DraftSequence] = {}

    # ------------------------------------------------------------ model hooks

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor | None,
                 from_target: bool, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """[num_tokens, hidden]: the draft model's output rows (features: target's or own)."""
        raise NotImplementedError

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, draft_vocab] float32 logits of output rows."""
        raise NotImplementedError

    def _to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self._token_map is None else self._token_map[draft_ids]

    def _probs_to_target(self, probs: torch.Tensor) -> torch.Tensor:
        """[n, draft_vocab] -> [n, target vocab]: the same when the vocabularies agree; zero
        outside a token map."""
        if self._token_map is None:
            return probs
        target_probs = probs.new_zeros(probs.shape[0], self.info.vocab_size)
        target_probs[:, self._token_map] = probs
        return target_probs

    # ------------------------------------------------------------ Proposer

    def context_len(self, seq_id: int) -> int | None:
        seq = self._seqs.get(seq_id)
        return None if seq is None else len(seq.token_ids)

    def add_sequence(self, seq_id: int) -> None:
        self.remove_sequence(seq_id)
        self._seqs[seq_id] = DraftSequence()

    def append_tokens(self, seq_id: int, token_ids: Sequence[int],
                      hidden_states: torch.Tensor | None) -> None:
        seq = self._seqs[seq_id]
        if seq.num_reusable and seq.num_computed == len(seq.token_ids):
            num_kept = 0
            for draft_id, token_id in zip(seq.draft_token_ids[:seq.num_reusable], token_ids):
                if draft_id != token_id:
                    break
                num_kept += 1
            seq.num_computed += num_kept
        seq.draft_token_ids, seq.num_draft_cached, seq.num_reusable = [], 0, 0
        seq.token_ids.extend(token_ids)
        if self.uses_features:
            assert hidden_states is not None, "the servicer checks that feature rows arrived"
            if hidden_states.shape[0]:
                seq.feature_chunks.append(hidden_states.to(self._device, self._feature_dtype))
        self._pool.block_manager.trim(seq, seq.num_computed)  # type: ignore[arg-type]

    def rollback(self, seq_id: int, num_accepted_tokens: int) -> None:
        seq = self._seqs[seq_id]
        seq.num_reusable = min(num_accepted_tokens, seq.num_draft_cached)

    def remove_sequence(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._pool.block_manager.free(seq)  # type: ignore[arg-type]

    def close(self) -> None:
        """Returns every sequence's blocks to the shared pool (the stream ended)."""
        for seq_id in list(self._seqs):
            self.remove_sequence(seq_id)

    def num_verified_inputs(self, seq: DraftSequence) -> int:
        if self.uses_features:
            return max(len(seq.token_ids) - 1, 0)
        return len(seq.token_ids)

    def propose(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seq_ids]
        work = self._plan(seq_ids, num_tokens)
        if not work:
            return proposals
        with torch.inference_mode():
            carry = self._first_step(work)
            for step in range(1, work[0].num_tokens):
                active = [item for item in work if item.num_tokens > step]  # a prefix: sorted by k
                carry = self._draft_step(active, step, carry[:len(active)])
        for item in work:
            item.seq.draft_token_ids = item.draft_token_ids
            item.seq.num_draft_cached = len(item.draft_token_ids) - 1 if self.reuses_draft_kv else 0
            probs = torch.stack(item.draft_probs).cpu() if item.draft_probs else None
            proposals[item.index] = Proposal(item.draft_token_ids, probs)
        return proposals

    # ------------------------------------------------------------ drafting

    def _plan(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> list[_Work]:
        """Allocates blocks for each proposing sequence; those that cannot draft are left out."""
        block_manager = self._pool.block_manager
        work: list[_Work] = []
        for index, (seq_id, count) in enumerate(zip(seq_ids, num_tokens)):
            seq = self._seqs[seq_id]
            num_inputs = self.num_verified_inputs(seq)
            count = min(count, self.info.max_num_speculative_tokens,
                        self._max_positions - num_inputs + 1)
            if count <= 0 or num_inputs == 0:
                continue
            # Step i writes input position num_inputs - 1 + i, the last step k - 1.
            needed = num_inputs + count - 1
            if not block_manager.can_allocate(seq, needed):  # type: ignore[arg-type]
                logger.debug("draft KV pool full: no draft for seq %d this step", seq_id)
                continue
            block_manager.allocate(seq, needed)  # type: ignore[arg-type]
            work.append(_Work(index=index, seq=seq, num_tokens=count,
                              start=min(seq.num_computed, num_inputs - 1), num_inputs=num_inputs,
                              block_table=torch.tensor(seq.block_table, dtype=torch.int64,
                                                       device=self._device)))
        work.sort(key=lambda item: -item.num_tokens)
        return work

    def _first_step(self, work: list[_Work]) -> torch.Tensor:
        """Runs the uncomputed verified inputs, drafts token 1; returns the last rows [len(work), hidden]."""
        token_offset = 1 if self.uses_features else 0
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        features: list[torch.Tensor] = []
        for item in work:
            seq, start, end = item.seq, item.start, item.num_inputs
            input_ids += seq.token_ids[start + token_offset:end + token_offset]
            positions += range(start, end)
            query_lens.append(end - start)
            if self.uses_features:
                rows = torch.cat(seq.feature_chunks) if len(seq.feature_chunks) > 1 else seq.feature_chunks[0]
                assert seq.feature_start + rows.shape[0] == end, "one feature row per verified input"
                features.append(rows[start - seq.feature_start:])
                # Keep only the last verified input's row (see DraftSequence).
                seq.feature_chunks, seq.feature_start = [rows[-1:].clone()], end - 1
            seq.num_computed = end
        metadata = self._metadata(work, positions, query_lens, [item.num_inputs for item in work])
        hidden = self._forward(torch.tensor(input_ids, dtype=torch.int64, device=self._device),
                               torch.tensor(positions, dtype=torch.int64, device=self._device),
                               torch.cat(features) if features else None, True, metadata)
        last_rows = torch.tensor(metadata.query_start_locs[1:], device=self._device) - 1
        last = hidden.index_select(0, last_rows)  # [len(work), hidden]
        self._choose(work, last)
        return last

    def _draft_step(self, active: list[_Work], step: int, carry: torch.Tensor) -> torch.Tensor:
        """Runs draft token `step` of every active sequence, drafts token step + 1."""
        positions = [item.num_inputs - 1 + step for item in active]
        metadata = self._metadata(active, positions, [1] * len(active),
                                  [position + 1 for position in positions])
        input_ids = torch.tensor([item.draft_token_ids[-1] for item in active], dtype=torch.int64,
                                 device=self._device)
        hidden = self._forward(input_ids, torch.tensor(positions, dtype=torch.int64, device=self._device),
                               carry if self.uses_features else None, False, metadata)
        self._choose(active, hidden)
        return hidden

    def _choose(self, work: list[_Work], hidden: torch.Tensor) -> None:
        """Appends one draft token (and its distribution when sampling) to each item."""
        logits = self._compute_logits(hidden)  # [len(work), draft_vocab]
        if self._draft_sampling:
            probs = torch.softmax(logits, dim=-1)
            draft_ids = torch.multinomial(probs, 1, generator=self._generator).squeeze(-1)
            target_probs = self._probs_to_target(probs).cpu()
            for item, row in zip(work, target_probs):
                item.draft_probs.append(row)
        else:
            draft_ids = argmax_rows(logits)
        for item, token_id in zip(work, self._to_target_ids(draft_ids).tolist()):
            item.draft_token_ids.append(token_id)

    def _metadata(self, work: list[_Work], positions: list[int], query_lens: list[int],
                  context_lens: list[int]) -> AttentionMetadata:
        block_size = self._pool.block_size
        slots: list[int] = []
        cursor = 0
        starts = [0]
        for item, query_len in zip(work, query_lens):
            table = item.seq.block_table
            slots += [table[p // block_size] * block_size + p % block_size
                      for p in positions[cursor:cursor + query_len]]
            cursor += query_len
            starts.append(cursor)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self._device),
            query_start_locs=starts,
            context_lens=context_lens,
            block_tables=[item.block_table for item in work],
        )
