"""Trains an EAGLE-1 head (Li et al. 2024, arXiv:2401.15077) for a target, in the published format.

The head is `specdec.models.eagle.EagleHead`: fc over concat(embed(token t + 1), f_t), one
decoder layer without input norm, whose output is the predicted next feature f_{t+1} (the
target's final normed hidden state) and goes straight into the target's lm_head. Loss as
EAGLE: feature regression (smooth L1 to f_{t+1}) plus `token_weight` x the token loss
(soft cross-entropy of lm_head(h) against the target's top-K), with the target's embedding
and lm_head frozen and left out of the checkpoint.

As for EAGLE-3 the head is unrolled on its own outputs (`ttt_steps`, weights
`step_decay ** j`), which is how it drafts; the token loss is computed over the target
tokens the data uses (`loss_vocab_size` most frequent; the lm_head at inference is the
full one, unchanged). The head starts from random weights: a copy of the target's last layer was tried and
starts far off, since that layer's output is the un-normed residual (outliers in the
thousands), not the normed feature the head must predict.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.eagle import EagleHead
from specdec.models.llama import LlamaForCausalLM
from specdec.models.model_config import ModelConfig
from specdec.train.batches import Batch, VocabMap, distill_loss, scored_rows, shift_rows
from specdec.train.checkpoint import published_tensors, write_draft
from specdec.train.eagle3_trainer import head_config_dict
from specdec.train.features import FeatureSet, choose_draft_vocab, token_frequencies
from specdec.train.ttt import attention_ttt, rope_positions

logger = logging.getLogger(__name__)


class EagleTrainer:
    """See the module docstring."""

    needs_features = True

    def __init__(self, target: LlamaForCausalLM, target_raw: dict[str, Any], features: FeatureSet, *,
                 ttt_steps: int = 3, step_decay: float = 0.8, token_weight: float = 0.3,
                 loss_vocab_size: int = 8192, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.ttt_steps, self.step_decay, self.token_weight = ttt_steps, step_decay, token_weight
        self.raw_config = head_config_dict(target_raw, 1, bias=False)  # EAGLE reads "bias" for fc
        config = ModelConfig.from_hf(self.raw_config)
        self.module = EagleHead(config, fc_bias=False, max_positions=4096)
        head = self.module
        head.embed_tokens.weight = nn.Parameter(target.model.embed_tokens.weight.detach().float().clone(),
                                                requires_grad=False)
        head.lm_head.weight = nn.Parameter(target.lm_head.weight.detach().float().clone(), requires_grad=False)
        d2t, _ = choose_draft_vocab(token_frequencies(features, config.vocab_size), loss_vocab_size)
        vocab_ids = torch.arange(d2t.shape[0]) + d2t
        self.vocab = VocabMap(vocab_ids, config.vocab_size)
        self._loss_head = head.lm_head.weight[vocab_ids]  # [V_loss, H], frozen

    def loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        head = self.module
        num_rows, width = batch.token_ids.shape
        features = batch.final  # step 0: the target's feature at t
        cache_per_layer: list[list] = [[] for _ in head.layers]
        total = features.new_zeros(())
        metrics: dict[str, float] = {}
        weight_sum = 0.0
        for step in range(self.ttt_steps):
            embeds = head.embed_tokens(shift_rows(batch.token_ids, 1 + step))
            hidden = head.fc(torch.cat((embeds, features), dim=-1))
            positions = rope_positions(num_rows, width, step)
            for layer, cache in zip(head.layers, cache_per_layer):
                hidden = hidden + attention_ttt(layer.self_attn, layer.input_layernorm(hidden), positions, cache)
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            rows = shift_rows(batch.loss_rows, 1 + step)
            target_features = shift_rows(batch.final, 1 + step)
            regression = F.smooth_l1_loss(hidden[rows], target_features[rows], reduction="sum") / hidden.shape[-1]
            topk_ids = shift_rows(batch.topk_ids, 1 + step)
            scored = scored_rows(rows, topk_ids, self.vocab)
            logits = hidden[scored] @ self._loss_head.t()  # [R, V_loss]
            token_loss, correct = distill_loss(logits, topk_ids[scored],
                                               shift_rows(batch.topk_logits, 1 + step)[scored], self.vocab)
            count = max(1, int(scored.sum()))
            weight = self.step_decay ** step
            total = total + weight * (regression / max(1, int(rows.sum())) + self.token_weight * token_loss / count)
            weight_sum += weight
            metrics[f"acc{step}"] = int(correct) / count
            features = hidden  # the next step feeds the head's own prediction
        return total / weight_sum, metrics

    def export(self, output_dir: Path) -> int:
        """config.json + model.safetensors (bf16; embed_tokens and lm_head come from the target)."""
        tensors = published_tensors(self.module, self.module.shard_sizes,
                                    exclude={"embed_tokens.weight", "lm_head.weight"})
        return write_draft(output_dir, self.raw_config, tensors)
