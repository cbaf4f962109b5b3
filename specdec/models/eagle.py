"""EAGLE-1/2 draft heads (Li et al. 2024, arXiv:2401.15077 and 2406.16858) in the published format.

Checkpoint layout (as released for LLaMA/Vicuna/Qwen targets, e.g. yuhuili/EAGLE-llama2-chat-7B):
`config.json` (a Llama config, usually one decoder layer) and `pytorch_model.bin` or
`model.safetensors` holding `fc.weight` [H, 2H] (+ optional `fc.bias`),
`layers.{i}.self_attn.{q,k,v,o}_proj.*`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
`layers.{i}.post_attention_layernorm.weight`, `layers.{i}.input_layernorm.weight` for i > 0
only, and optionally `embed_tokens.weight` (else the target's embedding is used).

What the head computes, checked against SafeAILab/EAGLE `eagle/model/cnets1.py` (`Model`,
`LlamaDecoderLayer`, `topK_genrate`) and vLLM `model_executor/models/llama_eagle.py`:

- *feature* f_t: the target's hidden state at position t AFTER its final norm (EAGLE's
  `ea_model.py` takes `base_model.model(...)[0]`, which is normed);
- the head's input at its position t pairs the NEXT token with that feature:
  x_t = fc(concat(embed(token_{t+1}), f_t)) - embedding first (cnets1 `Model.forward`);
- layer 0 has no input_layernorm (identity; cnets1 `if self.index != 0`), later layers do;
- the head's output h_t goes straight into the TARGET's lm_head: no norm in between
  (cnets1 `topK_genrate`: `head(last_hidden)`; vLLM returns the layer output unnormed);
- drafting continues autoregressively: the next input pairs the drafted token with h_t,
  again through fc, at head position t + 1.

The head attends over its own paged KV cache of earlier positions, like the target.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from specdec.engine.kv_cache import KVCache
from specdec.errors import ConfigError
from specdec.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchPagedAttention,
    make_attention_backend,
)
from specdec.models.llama import LlamaDecoderLayer, RotaryEmbedding
from specdec.models.loader import _iter_tensors, _weight_files, load_model_config
from specdec.models.model_config import SUPPORTED_MODEL_TYPES, ModelConfig

logger = logging.getLogger(__name__)

# (fused name, checkpoint name, shard index): q/k/v and gate/up are fused as in LlamaForCausalLM.
STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


# ---------------------------------------------------------------- checkpoint helpers


def read_checkpoint(model_dir: Path, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of `model_dir` (safetensors or .bin, sharded or not), filtered by `keep`.

    RoPE `inv_freq` buffers that old EAGLE training code saved are derived, not weights: skipped.
    """
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(model_dir)):
        tensors.update(_iter_tensors(path, keep))  # only the wanted tensors of a large target are read
    return {name: tensor for name, tensor in tensors.items() if not name.endswith("rotary_emb.inv_freq")}


def head_model_config(head_dir: Path, tensors: dict[str, torch.Tensor], layer_prefix: str
                      ) -> tuple[ModelConfig, dict[str, Any]]:
    """The head's Llama config (+ the raw json), with biases and q/k norm read off the checkpoint.

    Published heads vary (Qwen heads carry q/k/v biases, some configs name model types we do
    not list): the checkpoint's tensors are the truth for which optional tensors exist.
    """
    head_dir = Path(head_dir)
    config_path = head_dir / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"draft head {head_dir} has no config.json", param="model")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read {config_path}: {error}", param="model") from None
    patched = dict(raw)
    if patched.get("model_type") not in SUPPORTED_MODEL_TYPES:
        patched["model_type"] = "llama"  # heads are Llama decoder layers whatever the label
    patched.setdefault("hidden_act", "silu")
    try:
        config = ModelConfig.from_hf(patched)
    except ConfigError as error:
        raise ConfigError(f"{config_path}: {error.message}", param=error.param) from None
    config = dataclasses.replace(
        config,
        attention_bias=f"{layer_prefix}self_attn.q_proj.bias" in tensors,
        o_proj_bias=f"{layer_prefix}self_attn.o_proj.bias" in tensors,
        mlp_bias=f"{layer_prefix}mlp.down_proj.bias" in tensors,
        qk_norm=f"{layer_prefix}self_attn.q_norm.weight" in tensors,
    )
    return config, raw


def fill_parameters(module: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                    shard_sizes: Callable[[str], list[int]], source: Path,
                    shared: Collection[str] = ()) -> None:
    """Copies checkpoint tensors into `module`'s parameters and buffers, strictly.

    Names are the module's own except for fused q/k/v and gate/up (see STACKED_PARAMS).
    `shared` names parameters already set (borrowed from the target), which the checkpoint
    must not hold. A missing, unexpected or misshapen tensor raises ConfigError naming it.
    """
    # Parameters and persistent buffers (EAGLE-3's d2t / t2d); not the RoPE tables.
    targets = {name: tensor for name, tensor in module.state_dict(keep_vars=True).items()
               if name not in shared}
    expected: set[tuple[str, int | None]] = set()
    for name in targets:
        fused = next((f for f, _, _ in STACKED_PARAMS if f".{f}." in name), None)
        if fused is None:
            expected.add((name, None))
        else:
            expected.update((name, shard) for shard in range(len(shard_sizes(fused))))
    loaded: set[tuple[str, int | None]] = set()
    for ckpt_name, tensor in tensors:
        name, shard, fused = ckpt_name, None, None
        for fused_name, original, index in STACKED_PARAMS:
            if f".{original}." in ckpt_name:
                name, shard, fused = ckpt_name.replace(f".{original}.", f".{fused_name}."), index, fused_name
                break
        if name not in targets:
            raise ConfigError(f"unexpected tensor {ckpt_name!r} in {source}", param="model")
        target = targets[name].data
        if fused is not None and shard is not None:
            sizes = shard_sizes(fused)
            target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
        if tuple(tensor.shape) != tuple(target.shape):
            raise ConfigError(f"tensor {ckpt_name!r} in {source} has shape {tuple(tensor.shape)}, "
                              f"expected {tuple(target.shape)}", param="model")
        target.copy_(tensor)
        loaded.add((name, shard))
    missing = sorted(f"{name}[{shard}]" if shard is not None else name for name, shard in expected - loaded)
    if missing:
        raise ConfigError(f"draft head in {source} lacks tensors: {', '.join(missing[:8])}", param="model")


# ---------------------------------------------------------------- the target's parts


@dataclass(frozen=True)
class TargetParts:
    """What a head borrows from its target: config, input embedding, output projection."""

    config: ModelConfig
    embed_tokens: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


def load_target_parts(target_dir: Path, dtype: torch.dtype, device: torch.device) -> TargetParts:
    """Reads only the target's embedding and lm_head (not its layers) from its checkpoint."""
    config = load_model_config(target_dir)
    wanted = {"model.embed_tokens.weight", "lm_head.weight"}
    tensors = read_checkpoint(target_dir, keep=lambda name: name in wanted)
    if "model.embed_tokens.weight" not in tensors:
        raise ConfigError(f"target checkpoint {target_dir} lacks model.embed_tokens.weight", param="model")
    embed = tensors["model.embed_tokens.weight"].to(device=device, dtype=dtype)
    if config.tie_word_embeddings or "lm_head.weight" not in tensors:
        lm_head = embed
    else:
        lm_head = tensors["lm_head.weight"].to(device=device, dtype=dtype)
    expected = (config.vocab_size, config.hidden_size)
    for name, tensor in (("embed_tokens", embed), ("lm_head", lm_head)):
        if tuple(tensor.shape) != expected:
            raise ConfigError(f"target {name} in {target_dir} has shape {tuple(tensor.shape)}, "
                              f"expected {expected}", param="model")
    return TargetParts(config=config, embed_tokens=embed, lm_head=lm_head)


# ---------------------------------------------------------------- the EAGLE-1 head


class EagleHead(nn.Module):
    """EAGLE-1/2 head: fc over (embedding, feature), Llama layers, the target's lm_head."""

    def __init__(self, config: ModelConfig, fc_bias: bool, max_positions: int,
                 attention_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        # Training runs the reference (autograd); serving passes the device's backend.
        self.attention_backend = attention_backend or TorchPagedAttention(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.rotary_emb = RotaryEmbedding(config, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        # A ModuleList (registered as submodules), typed as what it holds.
        self.layers = cast(Sequence[LlamaDecoderLayer], nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary_emb, self.attention_backend)
            for _ in range(config.num_hidden_layers)))
        # Published heads have no norm on layer 0.
        self.layers[0].input_layernorm = nn.Identity()  # type: ignore[assignment]
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def shard_sizes(self, fused_name: str) -> list[int]:
        if fused_name == "qkv_proj":
            return [self.config.q_size, self.config.kv_size, self.config.kv_size]
        return [self.config.intermediate_size, self.config.intermediate_size]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]: token t + 1 for head position t
        positions: torch.Tensor,  # [num_tokens]: head positions t
        features: torch.Tensor,  # [num_tokens, hidden]: target feature t, or the head's own output
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]: the predicted next features (unnormed)
        embeds = self.embed_tokens(input_ids)
        hidden = self.fc(torch.cat((embeds, features.to(embeds.dtype)), dim=-1))
        for layer_id, layer in enumerate(self.layers):
            hidden = layer(positions, hidden, kv_cache.key_caches[layer_id],
                           kv_cache.value_caches[layer_id], attn_metadata)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        return self.lm_head(hidden).float()


def load_eagle_head(head_dir: Path, target: TargetParts, dtype: torch.dtype, device: torch.device,
                    max_positions: int) -> EagleHead:
    """Builds an EagleHead from a published EAGLE-1/2 checkpoint directory and its target."""
    head_dir = Path(head_dir)
    tensors = read_checkpoint(head_dir)
    config, _ = head_model_config(head_dir, tensors, layer_prefix="layers.0.")
    if (config.hidden_size, config.vocab_size) != (target.config.hidden_size, target.config.vocab_size):
        raise ConfigError(
            f"eagle head {head_dir} (hidden_size {config.hidden_size}, vocab_size {config.vocab_size}) "
            f"does not fit the target (hidden_size {target.config.hidden_size}, vocab_size "
            f"{target.config.vocab_size})", param="model")
    if "fc.weight" not in tensors:
        raise ConfigError(f"eagle head {head_dir} lacks fc.weight: not an EAGLE checkpoint", param="model")
    with torch.device("meta"):
        head = EagleHead(config, fc_bias="fc.bias" in tensors, max_positions=max_positions,
                         attention_backend=make_attention_backend(device, config.num_attention_heads,
                                                                  config.num_key_value_heads, config.head_dim))
    head = head.to(dtype).to_empty(device=device)
    head.rotary_emb.reset_cache(device, dtype)
    head.requires_grad_(False)
    # Borrowed tensors are shared with TargetParts, not copied.
    shared = {"lm_head.weight"}
    head.lm_head.weight = nn.Parameter(target.lm_head, requires_grad=False)
    own_embedding = "embed_tokens.weight" in tensors
    if not own_embedding:
        shared.add("embed_tokens.weight")
        head.embed_tokens.weight = nn.Parameter(target.embed_tokens, requires_grad=False)
    fill_parameters(head, tensors.items(), head.shard_sizes, head_dir, shared)
    head.eval()
    logger.info("loaded eagle head %s: %d layer(s), hidden %d, fc bias %s, embedding from %s, %s on %s",
                head_dir, config.num_hidden_layers, config.hidden_size, "fc.bias" in tensors,
                "the head" if own_embedding else "the target", dtype, device)
    return head
