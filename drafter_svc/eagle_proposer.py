"""`eagle`: an EAGLE-1/2 head drafts from the target's final hidden states.

GetInfo asks for layer -1 (the target's final hidden state after its last norm) and
reports the TARGET's vocabulary and tokenizer: the head reads the target's embedding and
writes through the target's lm_head. Head semantics: specdec/models/eagle.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from drafter_svc.model_proposer import DraftKVPool, ModelProposer
from drafter_svc.proposer import ModelOptions, ProposerInfo
from specdec.config import SpeculativeConfig
from specdec.device import resolve_device, resolve_dtype
from specdec.errors import ConfigError
from specdec.layers.attention import AttentionMetadata
from specdec.models import load_tokenizer, resolve_model, tokenizer_fingerprint
from specdec.models.eagle import (
    EagleHead,
    TargetParts,
    load_eagle_head,
    load_target_parts,
)
from specdec.models.eagle3 import Eagle3Head
from specdec.models.packed_linear import pack_for_device
from specdec.models.token_map import load_token_map, restrict_lm_head

logger = logging.getLogger(__name__)

FINAL_HIDDEN_STATE = -1

HeadT = TypeVar("HeadT", EagleHead, Eagle3Head)


class HeadProposer(ModelProposer, Generic[HeadT]):
    """Per-stream state over a shared EAGLE-style head (eagle, eagle3). Inputs pair tokens
    with features; draft inputs feed the head's own output back as the next feature, so
    their K/V are never reused (see model_proposer)."""

    uses_features = True
    reuses_draft_kv = False

    def __init__(self, head: HeadT, info: ProposerInfo, pool: DraftKVPool,
                 device: torch.device, dtype: torch.dtype, options: ModelOptions,
                 token_map: torch.Tensor | None = None) -> None:
        super().__init__(info, pool, device, feature_dtype=dtype,
                         max_positions=head.rotary_emb.max_positions,
                         draft_sampling=options.draft_sampling, seed=options.seed, token_map=token_map)
        self.head: HeadT = head

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.compute_logits(hidden)


class EagleProposer(HeadProposer[EagleHead]):
    """EAGLE-1/2: the target's final feature (or the head's own output) goes straight in."""

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor | None,
                 from_target: bool, attn_metadata: AttentionMetadata) -> torch.Tensor:
        assert features is not None
        return self.head(input_ids, positions, features, self._pool.kv_cache, attn_metadata)


def load_target_for_head(options: ModelOptions, dtype: torch.dtype, device: torch.device
                         ) -> tuple[TargetParts, str, int]:
    """The target's parts, tokenizer fingerprint and the head's RoPE table length."""
    target_dir = resolve_model(options.target_model)
    target = load_target_parts(target_dir, dtype, device)
    fingerprint = tokenizer_fingerprint(load_tokenizer(target_dir))
    max_positions = options.max_model_len or target.config.max_position_embeddings
    return target, fingerprint, max_positions


def build_eagle_method(config: SpeculativeConfig, options: ModelOptions) -> Callable[[], EagleProposer]:
    """Loads the head (and the target's embedding / lm_head) once; returns the per-stream factory."""
    if not config.model:
        raise ConfigError("speculative config: method 'eagle' needs 'model' (an EAGLE head "
                          "directory)", param="model")
    head_dir = resolve_model(config.model)  # a bad head path fails before the target loads
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    target, fingerprint, max_positions = load_target_for_head(options, dtype, device)
    head = load_eagle_head(head_dir, target, dtype, device, max_positions)
    token_map = None
    if config.speculative_token_map is not None:  # before packing: the cut head is what gets packed
        token_map = load_token_map(config.speculative_token_map, target.config.vocab_size)
        restrict_lm_head(head, token_map)
        logger.info("eagle: drafting among %d of %d tokens (token map)", len(token_map),
                    target.config.vocab_size)
    pack_for_device(head, device, dtype)
    info = ProposerInfo(method="eagle", max_num_speculative_tokens=config.num_speculative_tokens,
                        hidden_state_layer_ids=(FINAL_HIDDEN_STATE,),
                        vocab_size=target.config.vocab_size, tokenizer_fingerprint=fingerprint,
                        hidden_state_width=target.config.hidden_size, max_model_len=max_positions)
    pool = DraftKVPool(head.config, options.num_blocks, options.block_size, dtype, device)
    return lambda: EagleProposer(head, info, pool, device, dtype, options, token_map)
