"""Which forward runs the target model, and what that choice means for determinism.

On the CPU the C++ decoder stack runs the model where it can (fastest measured, nothing to
compile); else the forward is compiled when asked (verifier_svc.builder), else the model
runs eagerly.
"""

from __future__ import annotations

import json
import logging
import shutil

import torch

from specdec.config import SpeculativeConfig
from specdec.device import resolve_device
from specdec.layers.batch_invariance import deterministic_reason
from specdec.engine.kv_cache import KVCache
from specdec.models.compiled_forward import CompiledForward, warm_up
from specdec.models.cpu_stack import CpuDecoderStack, make_cpu_stack
from specdec.models.gguf_linear import GgufLinear
from specdec.models.llama import LlamaForCausalLM
from specdec.models.model_files import resolve_model
from specdec.models.packed_linear import PackedLinear, pack_linears
from specdec.models.parallel import ParallelContext
from verifier_svc.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def choose_forward(model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, *,
                   parallel: ParallelContext | None, cpu_stack: bool, compile_forward: bool,
                   linear_kernel: str | None, spec: SpeculativeConfig | None,
                   ) -> CpuDecoderStack | CompiledForward | None:
    """The forward that runs `model`; None: the model eagerly. A compile that fails falls
    back to eager, with the packing of the layers' linears the compiler was to do."""
    if device.type == "cpu" and parallel is None:
        stack = make_cpu_stack(model, cpu_stack)
        if stack is not None:
            return stack
    if not compile_forward:
        return None
    try:
        forward = CompiledForward(model)
        # Before the first request; the blocks it writes hold no sequence yet.
        warm_up(forward, kv_cache, block_ids=list(range(-(-16 // kv_cache.block_size))),
                aux_layer_ids=drafter_aux_layer_ids(spec, model.config.num_hidden_layers))
    except Exception as exc:
        # The model itself still runs eagerly (its attention falls back outside a trace);
        # its layers' linears still need the packing the compiler was to do.
        logger.warning("compiling the forward failed (%s: %s); running eagerly",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        if linear_kernel is not None:
            pack_linears(model, linear_kernel)
        return None
    return forward


def deterministic(runner: ModelRunner, dtype: torch.dtype, tensor_parallel_size: int) -> bool:
    """Whether greedy answers are independent of load, cache and chunking here; says why not
    once, at start."""
    lm_head = runner.model.lm_head
    reason = deterministic_reason(
        forward_is_cpu_stack=isinstance(runner.forward, CpuDecoderStack),
        lm_head_row_invariant=isinstance(lm_head, GgufLinear)
        or (isinstance(lm_head, PackedLinear) and (lm_head.kernel == "cpu" or lm_head.own_int8)),
        dtype=dtype, tensor_parallel_size=tensor_parallel_size)
    if reason is not None:
        logger.warning("deterministic serving is off: %s; a greedy or seeded answer may change "
                       "with the load, the prefix cache and the chunking (rounding forks at near-ties)",
                       reason)
        return False
    logger.info("deterministic serving: every row is computed the same way whatever shares its step")
    return True


def forward_name(forward: object) -> str:
    if isinstance(forward, CpuDecoderStack):
        return "C++ decoder stack"
    if isinstance(forward, CompiledForward):
        return "compiled forward"
    return "eager forward"


def compile_by_default(device: str, tensor_parallel_size: int, enforce_eager: bool) -> bool:
    """Whether the command line compiles the forward: unless --enforce-eager, on the CPU
    (where it was measured: ~1.3x faster steps), with one rank (the all-reduces stay eager)
    and a C++ compiler for inductor's kernels (the slim container image has none)."""
    if enforce_eager or tensor_parallel_size != 1 or resolve_device(device).type != "cpu":
        return False
    if not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
        logger.info("no C++ compiler found: the forward runs eagerly")
        return False
    return True


def drafter_aux_layer_ids(spec: SpeculativeConfig | None, num_layers: int) -> tuple[int, ...]:
    """The target layers whose states an eagle3 drafter will ask for (the compiled forward
    needs a graph for them); () for every other method, which reads none or the final
    state only. Read from the head's config, as the drafter reads it."""
    if spec is None or spec.method != "eagle3" or spec.model is None:
        return ()
    from specdec.models.eagle3 import aux_layer_ids_from_config

    raw = json.loads((resolve_model(str(spec.model)) / "config.json").read_text())
    return aux_layer_ids_from_config(raw, num_layers)
