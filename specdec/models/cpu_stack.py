"""`CpuDecoderStack`: a Llama-family model's forward (embedding, layers, final norm) in one
C++ call on the CPU (`specdec/layers/csrc/decoder_cpu.cpp`).

Why: once the linears and the attention ran in C++, what was left of a decode step's time
outside them (about a quarter, bf16, default model, 2 cores) was the glue: norms, RoPE,
SiLU and residual adds as inductor's small kernels called from Python, and dynamo's guards.
The stack does that glue in C++ loops around the same linear and attention kernels, and
needs no compilation at start-up. The LM head stays with the model (`compute_logits`).

It takes the model as loaded and packed (`PackedLinear` with the `cpu` kernel or specdec's
`int8` one, or plain linears), reads the weights in place, and has the model's forward
contract, so the `ModelRunner` calls it as it calls the model. It runs fp32 and bf16 models
without q/k norms (Llama, SmolLM2, Mistral, Qwen2) where the C++ linear has the dtype
(weight-only int8: with AVX512-VBMI); `make_cpu_stack` says
why not otherwise and the caller keeps the compiled or eager forward. Numerics and row
invariance: see the C++ file (each step rounded as the eager model rounds it; a token's
result does not depend on the other tokens of its step).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from specdec.engine.kv_cache import KVCache
from specdec.layers.attention import AttentionMetadata
from specdec.layers.batch_invariance import batch_invariant_requested
from specdec.layers.cpu_extension import linear_supports, load_extension
from specdec.models.gguf_linear import GgufEmbedding, GgufLinear
from specdec.models.llama import LlamaForCausalLM, check_aux_layer_ids
from specdec.models.packed_linear import PackedLinear
from specdec.models.weight_arena import move_into_arena

logger = logging.getLogger(__name__)

# Set to 0 to keep the compiled or eager forward on the CPU (for comparisons).
CPU_STACK_ENV = "SPECDEC_CPU_STACK"


def _operands(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """The weight (packed by `pack_weight` or `pack_weight_int8`, a GGUF linear's blocks, or
    [out, in] to pack), int8 scales (a GGUF linear's block table) and bias of a linear the C++
    kernel can run, or None."""
    scales = None
    if isinstance(linear, GgufLinear):
        weight, scales, bias = linear.packed, linear.table, linear.bias
    elif isinstance(linear, PackedLinear):
        if linear.kernel == "cpu":
            weight, bias = linear.packed, linear.bias
        elif linear.kernel == "int8" and linear.own_int8:
            weight, scales, bias = linear.packed, linear.scales, linear.bias
        else:
            return None
    elif isinstance(linear, nn.Linear):
        weight, bias = linear.weight, linear.bias
    else:
        return None
    if not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return None
    return weight.detach(), scales, None if bias is None else bias.detach()


def _packed(linear: nn.Module) -> torch.Tensor:
    """A linear's weight as the C++ kernel reads it: a `PackedLinear`'s own tensor object (so
    that moving it moves the layer's), or a plain linear's packed here (a copy)."""
    if isinstance(linear, (PackedLinear, GgufLinear)):
        return linear.packed
    weight, _, _ = _operands(linear)  # type: ignore[misc]
    return torch.ops.specdec_cpu.pack_weight(weight)


def _streamed_weights(packed_layers: list[list[torch.Tensor]], lm_head: nn.Module) -> list[torch.Tensor]:
    """The matrices a decode step reads, in the order it reads them: each layer's qkv, o,
    gate_up and down projections, then the LM head's (packed, or the weight it multiplies)."""
    tensors = [weight for layer in packed_layers for weight in layer]
    if isinstance(lm_head, (PackedLinear, GgufLinear)):
        tensors.append(lm_head.packed)
    elif isinstance(lm_head, nn.Linear):
        tensors.append(lm_head.weight)  # the parameter itself, so that moving it moves the head's
    return tensors


def _embedding_like(model: LlamaForCausalLM) -> torch.Tensor:
    """An empty tensor of the embedding's dtype and device (a GGUF embedding's rows come out
    in the model's dtype)."""
    embed = model.model.embed_tokens
    if isinstance(embed, GgufEmbedding):
        return embed.blocks.new_empty(0, dtype=embed.dtype)
    return embed.weight.new_empty(0)


def cpu_stack_from_env() -> bool:
    """False where $SPECDEC_CPU_STACK is 0: the default of the verifier's config field and
    the choice of a process without one (a drafter)."""
    return os.environ.get(CPU_STACK_ENV, "1").strip() != "0"


def unsupported_reason(model: nn.Module, enabled: bool | None = None) -> str | None:
    """Why `model` cannot run as a `CpuDecoderStack` here, or None if it can; `enabled`
    False (None: `cpu_stack_from_env()`) says it is switched off."""
    if not (cpu_stack_from_env() if enabled is None else enabled):
        return f"{CPU_STACK_ENV}=0"
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a LlamaForCausalLM"
    embed = _embedding_like(model)
    if embed.device.type != "cpu":
        return f"the model is on {embed.device.type}"
    if embed.dtype not in (torch.float32, torch.bfloat16) or not linear_supports(embed.dtype):
        return f"no C++ linear for {embed.dtype} on this machine"
    if model.config.qk_norm:
        return "q/k norms are not implemented in the stack"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.num_heads != model.config.num_attention_heads:
            return "a tensor-parallel shard"
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            operands = _operands(linear)
            if operands is None or (operands[0].dtype != embed.dtype and operands[1] is None):
                return f"a linear the C++ kernel cannot use ({linear})"
    return None


class CpuDecoderStack:
    """The model's forward through `decoder_stack`; see the module docstring."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the C++ decoder stack cannot run this model: {reason}")
        kernel = load_extension()
        assert kernel is not None, "unsupported_reason checked the extension"
        self._kernel = kernel
        self.model = model
        self.config = config = model.config
        self._num_layers = config.num_hidden_layers
        kernel_linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj) for layer in model.model.layers]
        packed_layers = [[_packed(linear) for linear in linears] for linears in kernel_linears]
        # The moved tensors keep its buffer alive, and every tensor object sharing one (a
        # PackedLinear's own) now reads it.
        move_into_arena(_streamed_weights(packed_layers, model.lm_head))
        empty = _embedding_like(model)
        tensors: list[torch.Tensor] = []
        for layer, linears, packed in zip(model.model.layers, kernel_linears, packed_layers):
            # Each linear's weight, int8 scales and bias (an empty tensor for none).
            per_linear = []
            for weight, linear in zip(packed, linears):
                _, scales, bias = _operands(linear)  # type: ignore[misc]
                per_linear.append([weight, empty.float() if scales is None else scales,
                                   empty if bias is None else bias])
            qkv, o, gate_up, down = per_linear
            tensors += [layer.input_layernorm.weight.detach(), *qkv, *o,
                        layer.post_attention_layernorm.weight.detach(), *gate_up, *down]
        self._layer_tensors = [tensor.contiguous() for tensor in tensors]
        # A GGUF embedding is looked up here, the stack then taking its rows as its table.
        embed = model.model.embed_tokens
        self._gguf_embedding = embed if isinstance(embed, GgufEmbedding) else None
        self._embed = embed.weight.detach() if self._gguf_embedding is None else empty
        self._final_norm = model.model.norm.weight.detach()
        self._rotary = model.model.rotary_emb
        self._shape = (config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                       config.intermediate_size, float(config.rms_norm_eps), config.head_dim**-0.5)
        # A prefill segment's attention by the kernel, every row as a decode computes it
        # (specdec.layers.batch_invariance); False: by SDPA. Read at every call, so that a
        # benchmark can switch it between steps.
        self.batch_invariant = batch_invariant_requested()

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """As `LlamaForCausalLM.forward`: the final normed hidden states, with the residual
        streams entering `aux_layer_ids` when asked."""
        check_aux_layer_ids(aux_layer_ids, self._num_layers)
        embed = self._embed
        if self._gguf_embedding is not None:
            embed = self._gguf_embedding(input_ids)
            input_ids = torch.arange(input_ids.shape[0])
        outputs = self._kernel.decoder_stack(
            input_ids, positions, embed, self._rotary.cos_cache, self._rotary.sin_cache,
            self._layer_tensors, self._final_norm, kv_cache.key_caches, kv_cache.value_caches,
            attn_metadata.slot_mapping, attn_metadata.query_start_locs, attn_metadata.context_lens,
            attn_metadata.block_tables, list(aux_layer_ids), *self._shape, self.batch_invariant,
            attn_metadata.tree_parent_tensors())
        if not aux_layer_ids:
            return outputs[0]
        return outputs[0], list(outputs[1:])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def make_cpu_stack(model: nn.Module, enabled: bool | None = None) -> CpuDecoderStack | None:
    """A `CpuDecoderStack` over `model`, or None (logged) where it cannot run it or
    `enabled` (see `unsupported_reason`) switches it off."""
    reason = unsupported_reason(model, enabled)
    if reason is not None:
        logger.info("C++ decoder stack not used: %s", reason)
        return None
    return CpuDecoderStack(model)  # type: ignore[arg-type]
