"""Tensor parallelism for the Llama family: which slice of every weight a rank holds.

Megatron's split, as vLLM does it, over N ranks:
- *column-parallel* (output dim split): `qkv_proj` holds this rank's q heads, then its k
  heads, then its v heads (each HF projection is sliced before it is stacked, so the fused
  `[q | k | v]` layout holds per rank); `gate_up_proj` holds its gate slice then its up slice.
- *row-parallel* (input dim split): `o_proj` and `down_proj` see only this rank's heads /
  intermediate slice; their partial outputs are summed by one all-reduce each, so a decoder
  layer costs two all-reduces and everything between them stays rank-local.
- *replicated*: `embed_tokens`, `lm_head`, every norm. Vocab-parallel embedding and head
  would save `vocab * hidden * (N - 1) / N` weights per rank but add an all-reduce (embedding)
  and a gather of the logits (head) to every step; replicated, rank 0 samples from full
  logits with no collective at either end, which matters more for the small and mid-size
  models a verifier serves than the memory does.

A rank's model is an ordinary `LlamaForCausalLM` built from the rank-local `ModelConfig`
(`rank_config`: heads, KV heads and intermediate size divided by N), so attention, the KV
cache (num_kv_heads / N heads per rank) and the attention backend size themselves with no
change to the model code. `install_all_reduce` adds the sum after each attention and MLP
block (forward hooks); row-parallel biases are kept on rank 0 only (`finish_loading`).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn

from specdec.errors import ConfigError
from specdec.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

# HF projection name -> dim its checkpoint weight is split along (0: output, 1: input).
# Row-parallel biases (o_proj, down_proj) are not split: see finish_loading.
_SPLIT_DIMS = {
    "q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0,
    "o_proj": 1, "down_proj": 1,
}
_ROW_PARALLEL = ("o_proj", "down_proj")
# The decoder layer's two halves, each ending in a row-parallel projection.
_BLOCK_HALVES = ("self_attn", "mlp")


@dataclasses.dataclass(slots=True)
class ParallelContext:
    """This process's place in the tensor-parallel group.

    `group` is None until the process group is up (the model is built and loaded first);
    a forward before then is a bug.
    """

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums `tensor` over the ranks, in place."""
        assert self.group is not None, "tensor-parallel forward before the process group is up"
        dist.all_reduce(tensor, group=self.group)


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """Raises ConfigError unless every split this model needs divides evenly."""
    if world_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {world_size}",
                          param="tensor_parallel_size")
    for what, count in (("attention heads", config.num_attention_heads),
                        ("key/value heads", config.num_key_value_heads),
                        ("intermediate size", config.intermediate_size)):
        if count % world_size != 0:
            divisors = [n for n in range(1, config.num_key_value_heads + 1)
                        if config.num_attention_heads % n == 0
                        and config.num_key_value_heads % n == 0
                        and config.intermediate_size % n == 0]
            raise ConfigError(
                f"--tensor-parallel-size {world_size} does not divide the model's {count} "
                f"{what}; sizes this model allows: {', '.join(map(str, divisors))}",
                param="tensor_parallel_size")


def rank_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The architecture one rank builds: heads, KV heads and intermediate size over N."""
    check_tensor_parallel(config, world_size)
    if world_size == 1:
        return config
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=config.num_key_value_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
    )


def install_all_reduce(model: nn.Module, context: ParallelContext) -> int:
    """Sums each decoder layer's attention and MLP output over the ranks; returns how many
    block halves got the hook (2 per layer).

    A forward hook on the block half, not a subclass of its last linear layer, so later
    swaps of the linear layers themselves (packed or quantised kernels) keep the all-reduce.
    """
    def all_reduce_output(module: nn.Module, args: object, output: torch.Tensor) -> None:
        context.all_reduce(output)  # [num_tokens, hidden], in place

    num_hooked = 0
    for layer in model.modules():
        halves = [half for name in _BLOCK_HALVES if isinstance(half := getattr(layer, name, None), nn.Module)]
        if len(halves) == len(_BLOCK_HALVES):
            for half in halves:
                half.register_forward_hook(all_reduce_output)
                num_hooked += 1
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if num_hooked == 0 or (num_layers is not None and num_hooked != 2 * num_layers):
        raise RuntimeError(f"tensor parallelism found {num_hooked} attention/MLP blocks to "
                           f"all-reduce, expected 2 per layer ({num_layers} layers)")
    return num_hooked


def shard_tensor(hf_name: str, tensor: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    """This rank's slice of checkpoint tensor `hf_name` (a view; the tensor itself if replicated)."""
    if context.world_size == 1:
        return tensor
    parts = hf_name.split(".")
    if len(parts) < 2 or parts[-2] not in _SPLIT_DIMS:
        return tensor
    projection, kind = parts[-2], parts[-1]
    dim = _SPLIT_DIMS[projection]
    if kind == "bias" and dim == 1:
        return tensor  # a row-parallel bias applies to the summed output: replicated
    size = tensor.shape[dim] // context.world_size
    return tensor.narrow(dim, context.rank * size, size)


def finish_loading(model: nn.Module, context: ParallelContext) -> None:
    """Zeroes row-parallel biases on ranks other than 0: each rank loads the whole bias, and
    the all-reduce must add it once."""
    if context.rank == 0:
        return
    for name, param in model.named_parameters():
        parts = name.split(".")
        if parts[-1] == "bias" and len(parts) >= 2 and parts[-2] in _ROW_PARALLEL:
            param.data.zero_()
