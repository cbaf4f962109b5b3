"""Trains an EAGLE-3 head (Li et al. 2025, arXiv:2503.01840) for a target, in the published format.

The head is `specdec.models.eagle3.Eagle3Head` itself: fc fuses the target's low / mid /
high features (the residual entering `aux_layer_ids`), one decoder layer attends over
concat(normed embedding, normed hidden), and a reduced lm_head scores the draft
vocabulary, the `draft_vocab_size` target tokens the target says most often (d2t / t2d).

Training-time test: the head is unrolled `ttt_steps` times on its own pre-norm outputs
(`ttt.py`); step j's loss is weighted by `step_decay ** j`, the soft cross-entropy against
the target's top-K at the position that step drafts. The target's embedding is borrowed
and frozen; lm_head starts as the target's rows for the draft vocabulary and norm as the
target's final norm, so step 0 starts close to "what the target would say".
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec.models.eagle3 import Eagle3Head
from specdec.models.llama import LlamaForCausalLM
from specdec.models.model_config import ModelConfig
from specdec.train.batches import Batch, VocabMap, distill_loss, scored_rows, shift_rows
from specdec.train.checkpoint import published_tensors, write_draft
from specdec.train.features import FeatureSet, choose_draft_vocab, token_frequencies
from specdec.train.ttt import attention_ttt, rope_positions

logger = logging.getLogger(__name__)


def head_config_dict(target_raw: dict[str, Any], num_layers: int, **extra: Any) -> dict[str, Any]:
    """A Llama config.json for a head over `target_raw`'s geometry (hidden, heads, RoPE)."""
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
            "rope_parameters",
            "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
    config = {key: target_raw[key] for key in keep if target_raw.get(key) is not None}
    config.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                   "num_hidden_layers": num_layers, "tie_word_embeddings": False,
                   "torch_dtype": "bfloat16"})
    config.update(extra)
    return config


class Eagle3Trainer:
    """See the module docstring."""

    needs_features = True

    def __init__(self, target: LlamaForCausalLM, target_raw: dict[str, Any], features: FeatureSet, *,
                 draft_vocab_size: int = 8192, ttt_steps: int = 4, step_decay: float = 0.8,
                 seed: int = 0) -> None:
        torch.manual_seed(seed)
        target_config = target.config
        self.aux_layer_ids = features.aux_layer_ids
        self.ttt_steps, self.step_decay = ttt_steps, step_decay
        self.raw_config = head_config_dict(
            target_raw, 1, architectures=["LlamaForCausalLMEagle3"],
            draft_vocab_size=min(draft_vocab_size, target_config.vocab_size),
            target_hidden_size=target_config.hidden_size,
            eagle_config={"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                          "use_aux_hidden_state": True})
        config = ModelConfig.from_hf(self.raw_config)
        d2t, t2d = choose_draft_vocab(token_frequencies(features, target_config.vocab_size),
                                      self.raw_config["draft_vocab_size"])
        self.module = Eagle3Head(config, target_hidden_size=target_config.hidden_size,
                                 num_aux_layers=len(self.aux_layer_ids),
                                 draft_vocab_size=self.raw_config["draft_vocab_size"], reduced_vocab=True,
                                 norm_before_residual=False, max_positions=4096)
        head = self.module
        assert head.d2t is not None
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        vocab_ids = torch.arange(d2t.shape[0]) + d2t
        self.vocab = VocabMap(vocab_ids, target_config.vocab_size)
        head.embed_tokens.weight = nn.Parameter(target.model.embed_tokens.weight.detach().float().clone(),
                                                requires_grad=False)
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head.weight[vocab_ids].float())
            head.norm.weight.copy_(target.model.norm.weight.float())

    def loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        head, layer = self.module, self.module.midlayer
        num_rows, width = batch.token_ids.shape
        hidden = head.combine_hidden_states(batch.aux)  # [B, T, H]
        cache: list = []
        total = hidden.new_zeros(())
        metrics: dict[str, float] = {}
        weight_sum = 0.0
        for step in range(self.ttt_steps):
            # Index t at step j: input token t + 1 + j, label row t + 1 + j (see ttt.py).
            input_ids = shift_rows(batch.token_ids, 1 + step)
            rows = shift_rows(batch.loss_rows, 1 + step)
            embeds = head.embed_tokens(input_ids)
            residual = hidden
            attn_input = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hidden)), dim=-1)
            hidden = residual + attention_ttt(layer.self_attn, attn_input,
                                              rope_positions(num_rows, width, step), cache)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))  # pre-norm output
            topk_ids = shift_rows(batch.topk_ids, 1 + step)
            rows = scored_rows(rows, topk_ids, self.vocab)
            logits = head.compute_logits(hidden[rows])  # [R, draft_vocab]: scored rows only
            loss, correct = distill_loss(logits, topk_ids[rows], shift_rows(batch.topk_logits, 1 + step)[rows],
                                         self.vocab)
            count = max(1, int(rows.sum()))
            weight = self.step_decay ** step
            total = total + weight * loss / count
            weight_sum += weight
            metrics[f"acc{step}"] = int(correct) / count
        return total / weight_sum, metrics

    def export(self, output_dir: Path) -> int:
        """config.json + model.safetensors (bf16; no embed_tokens: the loader borrows the target's)."""
        tensors = published_tensors(self.module, self.module.shard_sizes, exclude={"embed_tokens.weight"})
        return write_draft(output_dir, self.raw_config, tensors)
