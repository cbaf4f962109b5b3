"""`draft_model`: a small causal LM of the Llama family drafts for the target.

The draft model (HF directory or GGUF, through `resolve_model`) runs on its own paged KV
cache (`DraftKVPool`). GetInfo reports the DRAFT model's vocabulary size and tokenizer
fingerprint: the verifier refuses a drafter whose vocabulary differs from the target's,
since draft token ids would mean other tokens there.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from drafter_svc.model_proposer import DraftKVPool, ModelProposer
from drafter_svc.proposer import ModelOptions, ProposerInfo
from specdec.config import SpeculativeConfig
from specdec.device import resolve_device, resolve_dtype
from specdec.errors import ConfigError
from specdec.layers.attention import AttentionMetadata
from specdec.models import (
    LlamaForCausalLM,
    load_model,
    load_tokenizer,
    resolve_model,
    tokenizer_fingerprint,
)
from specdec.models.cpu_stack import CpuDecoderStack, make_cpu_stack
from specdec.models.packed_linear import pack_for_device
from specdec.models.token_map import load_token_map, restrict_lm_head

logger = logging.getLogger(__name__)


class DraftModelProposer(ModelProposer):
    """Per-stream state over a shared draft model; see model_proposer for the algorithm."""

    uses_features = False
    reuses_draft_kv = True

    def __init__(self, model: LlamaForCausalLM, info: ProposerInfo, pool: DraftKVPool,
                 device: torch.device, options: ModelOptions,
                 forward: CpuDecoderStack | None = None, token_map: torch.Tensor | None = None) -> None:
        super().__init__(info, pool, device, feature_dtype=torch.float32,
                         max_positions=model.max_positions, draft_sampling=options.draft_sampling,
                         seed=options.seed, token_map=token_map)
        self.model = model
        self.forward: LlamaForCausalLM | CpuDecoderStack = forward or model

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor | None,
                 from_target: bool, attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.forward(input_ids, positions, self._pool.kv_cache, attn_metadata)
        assert isinstance(hidden, torch.Tensor)
        return hidden

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}", param="model") from None


def build_draft_model_method(config: SpeculativeConfig, options: ModelOptions
                             ) -> Callable[[], DraftModelProposer]:
    """Loads the draft model and allocates the KV pool once; returns the per-stream factory."""
    if not config.model:
        raise ConfigError("speculative config: method 'draft_model' needs 'model' (a draft model "
                          "directory or GGUF file)", param="model")
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    model_dir = resolve_model(config.model)
    # A draft trained by `specdec train` leaves out what it shares with its target
    # (config.json: specdec_borrowed_tensors, usually without a tokenizer): read it from there.
    borrowed = _read_json(model_dir / "config.json").get("specdec_borrowed_tensors")
    target_dir = resolve_model(options.target_model) if borrowed else None
    model = load_model(model_dir, dtype, device, max_positions=options.max_model_len, borrow_from=target_dir)
    token_map = None
    if config.speculative_token_map is not None:  # before packing: the cut head is what gets packed
        token_map = load_token_map(config.speculative_token_map, model.config.vocab_size)
        restrict_lm_head(model, token_map)
    pack_for_device(model, device, dtype)
    # On the CPU its layers run as the verifier's do, in one C++ call where that runs them.
    forward = make_cpu_stack(model) if device.type == "cpu" else None
    has_tokenizer = any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = load_tokenizer(model_dir if has_tokenizer or target_dir is None else target_dir)
    info = ProposerInfo(method="draft_model",
                        max_num_speculative_tokens=config.num_speculative_tokens,
                        vocab_size=model.config.vocab_size,
                        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                        max_model_len=model.max_positions)
    pool = DraftKVPool(model.config, options.num_blocks, options.block_size, dtype, device)
    logger.info("draft_model %s: %d layers, vocab %d%s, k=%d, %s on %s%s", model_dir,
                model.config.num_hidden_layers, model.config.vocab_size,
                "" if token_map is None else f" drafting among {len(token_map)} (token map)",
                config.num_speculative_tokens, dtype, device, " (C++ decoder stack)" if forward else "")
    return lambda: DraftModelProposer(model, info, pool, device, options, forward, token_map)
