"""`eagle3`: an EAGLE-3 head drafts from three of the target's intermediate hidden states.

GetInfo asks for the target layer ids the head was trained on (the residual stream
entering those layers; default 2, L // 2, L - 3) and reports the TARGET's vocabulary and
tokenizer. Draft ids from a reduced draft vocabulary are mapped to target ids with d2t
before they leave the drafter. Head semantics: specdec/models/eagle3.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from drafter_svc.eagle_proposer import HeadProposer, load_target_for_head
from drafter_svc.model_proposer import DraftKVPool
from drafter_svc.proposer import ModelOptions, ProposerInfo
from specdec.config import SpeculativeConfig
from specdec.device import resolve_device, resolve_dtype
from specdec.errors import ConfigError
from specdec.layers.attention import AttentionMetadata
from specdec.models import resolve_model
from specdec.models.eagle3 import Eagle3Head, load_eagle3_head
from specdec.models.packed_linear import pack_for_device

logger = logging.getLogger(__name__)


class Eagle3Proposer(HeadProposer[Eagle3Head]):
    """EAGLE-3: verified inputs carry fc(target features); draft inputs the head's own
    pre-norm output."""

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor | None,
                 from_target: bool, attn_metadata: AttentionMetadata) -> torch.Tensor:
        assert features is not None
        hidden = self.head.combine_hidden_states(features) if from_target else features
        return self.head(input_ids, positions, hidden, self._pool.kv_cache, attn_metadata)


def build_eagle3_method(config: SpeculativeConfig, options: ModelOptions) -> Callable[[], Eagle3Proposer]:
    """Loads the head (and the target's embedding) once; returns the per-stream factory."""
    if not config.model:
        raise ConfigError("speculative config: method 'eagle3' needs 'model' (an EAGLE-3 head "
                          "directory)", param="model")
    head_dir = resolve_model(config.model)  # a bad head path fails before the target loads
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    target, fingerprint, max_positions = load_target_for_head(options, dtype, device)
    head, layer_ids = load_eagle3_head(head_dir, target, dtype, device, max_positions)
    pack_for_device(head, device, dtype)
    info = ProposerInfo(method="eagle3", max_num_speculative_tokens=config.num_speculative_tokens,
                        hidden_state_layer_ids=layer_ids,
                        vocab_size=target.config.vocab_size, tokenizer_fingerprint=fingerprint,
                        hidden_state_width=len(layer_ids) * target.config.hidden_size,
                        max_model_len=max_positions)
    pool = DraftKVPool(head.config, options.num_blocks, options.block_size, dtype, device)
    # A reduced draft vocabulary is a token map: draft id i is target id i + d2t[i].
    token_map = (None if head.d2t is None
                 else head.to_target_ids(torch.arange(head.draft_vocab_size, device=device)))
    return lambda: Eagle3Proposer(head, info, pool, device, dtype, options, token_map)
