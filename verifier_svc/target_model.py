"""The verifier's target model as loaded: the CPU kernels, the weights (a GGUF file's own
blocks where it runs on them; rank 0's shard with tensor parallelism), the tokenizer and
the EOS ids."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from specdec.device import resolve_device, resolve_dtype
from specdec.layers import cpu_extension
from specdec.models.gguf_model import load_gguf_model, native_gguf_file
from specdec.models.llama import LlamaForCausalLM
from specdec.models.loader import load_model, load_model_config
from specdec.models.model_files import load_tokenizer, resolve_model
from specdec.models.parallel import ParallelContext, check_tensor_parallel
from verifier_svc.startup_phase import PHASE_COMPILING_KERNELS, PHASE_LOADING_WEIGHTS
from verifier_svc.tp_worker import rank_device


class TargetSettings(Protocol):
    """What loading reads of the verifier's configuration (verifier_svc.builder's
    VerifierConfig is one)."""

    @property
    def model(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def quantization(self) -> str | None: ...

    @property
    def tensor_parallel_size(self) -> int: ...

    @property
    def attention_backend(self) -> str: ...


@dataclass(frozen=True)
class TargetModel:
    """The target model as rank 0 holds it (with tensor parallelism, its shard: heads / N)
    and where it runs."""

    model_dir: Path
    model: LlamaForCausalLM
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    parallel: ParallelContext | None


def load_target(config: TargetSettings, enter_phase: Callable[[str], None]) -> TargetModel:
    """The CPU kernels (built on a first start), then the weights, sharded with tensor
    parallelism."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model_dir = resolve_model(config.model)
    if device.type == "cpu":
        # First, so that a first start says it is compiling rather than loading weights.
        if not cpu_extension.is_cached():
            enter_phase(PHASE_COMPILING_KERNELS)
        cpu_extension.load_extension()
    enter_phase(PHASE_LOADING_WEIGHTS)
    parallel = None
    if config.tensor_parallel_size > 1:
        # Refuse a size the model's heads do not divide before anything is loaded or started.
        check_tensor_parallel(load_model_config(model_dir), config.tensor_parallel_size)
        parallel = ParallelContext(rank=0, world_size=config.tensor_parallel_size)
        device = rank_device(device, 0)
    native_gguf = native_gguf_file(config.model, config.dtype, config.quantization, device, dtype,
                                   config.tensor_parallel_size)
    if native_gguf is not None:
        model = load_gguf_model(native_gguf, model_dir, dtype, device, attention_backend=config.attention_backend)
    else:
        model = load_model(model_dir, dtype, device, parallel=parallel,
                           attention_backend=config.attention_backend)
    return TargetModel(model_dir, model, load_tokenizer(model_dir), device, dtype, parallel)


def model_eos_token_ids(model_dir: Path, config_eos: tuple[int, ...] | list[int],
                        tokenizer: object) -> tuple[int, ...]:
    """EOS ids from config.json, generation_config.json and the tokenizer, in that order."""
    ids: list[int] = list(config_eos or ())
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        value = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.extend(value if isinstance(value, list) else [] if value is None else [value])
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if tokenizer_eos is not None:
        ids.append(tokenizer_eos)
    return tuple(dict.fromkeys(ids))
