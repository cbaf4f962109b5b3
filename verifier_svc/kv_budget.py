"""How many KV cache blocks a verifier allocates: what fits its memory budget, capped at
what its limits can ever use."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from specdec.config import EngineConfig
from specdec.device import device_memory_bytes
from specdec.engine.kv_cache import KVCache
from specdec.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Fixed headroom for allocator fragmentation and framework buffers.
_ACTIVATION_SLACK_BYTES = 256 << 20


class MemoryLimits(Protocol):
    """What the budget reads of the verifier's configuration (verifier_svc.builder's
    VerifierConfig is one)."""

    @property
    def engine(self) -> EngineConfig: ...

    @property
    def gpu_memory_utilization(self) -> float: ...

    @property
    def kv_cache_memory_bytes(self) -> int | None: ...

    @property
    def cpu_kv_cache_space_gib(self) -> float: ...

    @property
    def tensor_parallel_size(self) -> int: ...


def num_kv_blocks(config: MemoryLimits, model: LlamaForCausalLM, dtype: torch.dtype,
                   device: torch.device, max_model_len: int) -> int:
    """Blocks that fit the memory budget, capped at what the limits can ever use."""
    engine = config.engine
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    model_config = model.config
    block_size = engine.block_size
    bytes_per_block = KVCache.bytes_per_block(model_config, block_size, dtype)
    # Buffers too: a GGUF model's quantized blocks are its GgufLinears' buffers.
    weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    element = torch.tensor([], dtype=dtype).element_size()
    activation_bytes = (engine.max_num_batched_tokens * element
                        * (4 * model_config.hidden_size + 2 * model_config.intermediate_size)
                        + engine.max_num_batched_tokens * model_config.vocab_size * 4
                        + _ACTIVATION_SLACK_BYTES)
    device_bytes = device_memory_bytes(device)
    if device.type == "cpu":
        # Tensor-parallel ranks on the CPU share its RAM; `model` is one rank's shard.
        device_bytes //= config.tensor_parallel_size
    budget = (int(config.gpu_memory_utilization * device_bytes)
              - weight_bytes - activation_bytes)
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif device.type == "cpu":
        budget = min(budget, int(config.cpu_kv_cache_space_gib * 2**30))
    usable = max(0, budget) // bytes_per_block
    blocks_per_seq = -(-max_model_len // block_size)
    most_ever_used = engine.max_num_seqs * blocks_per_seq
    num_blocks = min(usable, most_ever_used)
    logger.info("KV budget: %.2f GiB (device memory %.2f GiB, weights %.2f GiB, "
                "activations %.2f GiB) -> %d blocks (%d fit, %d the limits can use)",
                max(0, budget) / 2**30, device_memory_bytes(device) / 2**30, weight_bytes / 2**30,
                activation_bytes / 2**30, num_blocks, usable, most_ever_used)
    return num_blocks
