"""Trains a `draft_model` for a target: a few of its own layers, distilled on its outputs.

The draft is a Llama model with the target's geometry and tokenizer: `layer_ids` of the
target's layers (default: the first two and the last one), the target's final norm, and the
target's embedding / lm_head (tied in SmolLM2), frozen. Only the layers and the norm are
trained, with the soft cross-entropy against the target's top-K next tokens, and only they
are shipped: config.json lists the borrowed tensors under `specdec_borrowed_tensors`, which
`drafter_svc.draft_model_proposer` reads from the target (`load_model(borrow_from=...)`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec.models.llama import LlamaForCausalLM
from specdec.models.model_config import ModelConfig
from specdec.train.batches import Batch, VocabMap, distill_loss, scored_rows
from specdec.train.checkpoint import published_tensors, write_draft
from specdec.train.features import FeatureSet, choose_draft_vocab, token_frequencies
from specdec.train.ttt import attention_ttt, rope_positions

logger = logging.getLogger(__name__)

BORROWED = ("model.embed_tokens.weight",)


def default_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    return (0, 1, num_target_layers - 1)


class DraftModelTrainer:
    """See the module docstring."""

    needs_features = False

    def __init__(self, target: LlamaForCausalLM, target_raw: dict[str, Any], features: FeatureSet, *,
                 layer_ids: tuple[int, ...] | None = None, loss_vocab_size: int = 8192,
                 target_name: str = "", seed: int = 0) -> None:
        torch.manual_seed(seed)
        layer_ids = layer_ids or default_layer_ids(target.config.num_hidden_layers)
        self.raw_config = dict(target_raw)
        self.raw_config.update({"num_hidden_layers": len(layer_ids), "tie_word_embeddings": True,
                                "torch_dtype": "bfloat16", "specdec_borrowed_tensors": list(BORROWED),
                                "specdec_target_layers": list(layer_ids)})
        if target_name:
            self.raw_config["specdec_target"] = target_name
        self.raw_config.pop("quantization_config", None)
        config = ModelConfig.from_hf(self.raw_config)
        self.module = LlamaForCausalLM(config, max_positions=4096)
        model = self.module
        model.model.embed_tokens.weight = nn.Parameter(
            target.model.embed_tokens.weight.detach().float().clone(), requires_grad=False)
        model.lm_head.weight = model.model.embed_tokens.weight
        if not target.config.tie_word_embeddings:
            raise NotImplementedError("draft_model training borrows a tied embedding / lm_head")
        with torch.no_grad():
            for draft_layer, target_id in zip(model.model.layers, layer_ids):
                for name, param in draft_layer.named_parameters():
                    param.copy_(target.model.layers[target_id].get_parameter(name).float())
            model.model.norm.weight.copy_(target.model.norm.weight.float())
        d2t, _ = choose_draft_vocab(token_frequencies(features, config.vocab_size), loss_vocab_size)
        vocab_ids = torch.arange(d2t.shape[0]) + d2t
        self.vocab = VocabMap(vocab_ids, config.vocab_size)
        self._loss_head = model.lm_head.weight[vocab_ids]  # [V_loss, H], frozen

    def loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        model = self.module.model
        num_rows, width = batch.token_ids.shape
        hidden = model.embed_tokens(batch.token_ids)
        positions = rope_positions(num_rows, width, 0)
        for layer in model.layers:
            hidden = hidden + attention_ttt(layer.self_attn, layer.input_layernorm(hidden), positions, [])
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        rows = scored_rows(batch.loss_rows, batch.topk_ids, self.vocab)
        logits = model.norm(hidden[rows]) @ self._loss_head.t()  # [R, V_loss]
        loss, correct = distill_loss(logits, batch.topk_ids[rows], batch.topk_logits[rows], self.vocab)
        count = max(1, int(rows.sum()))
        return loss / count, {"acc0": int(correct) / count}

    def export(self, output_dir: Path) -> int:
        """config.json + model.safetensors (bf16; the embedding / lm_head come from the target)."""
        tensors = published_tensors(self.module, self.module.shard_sizes,
                                    exclude={"model.embed_tokens.weight", "lm_head.weight"})
        return write_draft(output_dir, self.raw_config, tensors)
