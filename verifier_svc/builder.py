"""Builds a verifier engine from its configuration: model, KV pool, scheduler, drafters."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.cli import ADDITIONAL_CONFIG_KEYS, served_model_name
from specdec.config import (
    MODEL_METHODS,
    EngineConfig,
    SpeculativeConfig,
    default_draft_timeout_s,
    default_long_prefill_token_threshold,
    parse_additional_config,
)
from specdec.config_flags import env_default, flag, nested
from specdec.engine.block_manager import BlockManager
from specdec.engine.kv_cache import KVCache
from specdec.engine.scheduler import Scheduler
from specdec.errors import ConfigError
from specdec.grammar_checker import GrammarLimits
from specdec.layers.attention import (
    ATTENTION_BACKEND_ENV,
    ATTENTION_BACKENDS,
    attention_backend_from_env,
)
from specdec.models.compiled_forward import linears_to_pack
from specdec.models.cpu_stack import cpu_stack_from_env
from specdec.models.model_files import (
    DEFAULT_MODEL,
    tokenizer_fingerprint,
)
from specdec.models.packed_linear import choose_kernel, pack_linears
from specdec.rpc.tls import GrpcTlsConfig
from verifier_svc.drafting.drafter_pool import DrafterPool
from specdec.engine.engine import Engine
from verifier_svc.grammar.backend import GrammarBackend
from verifier_svc.forward_choice import (
    choose_forward,
    compile_by_default,
    deterministic,
    forward_name,
)
from verifier_svc.grammar.verification import GrammarService
from verifier_svc.kv_budget import num_kv_blocks
from verifier_svc.model_runner import ModelRunner
from verifier_svc.startup_phase import (
    PHASE_WARMING_UP,
)
from verifier_svc.target_model import TargetModel, load_target, model_eos_token_ids
from verifier_svc.tp_worker import TensorParallelGroup

logger = logging.getLogger(__name__)

# vLLM's CPU backend's variable for VerifierConfig.cpu_kv_cache_space_gib, and its default.
CPU_KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_KV_CACHE_DEFAULT_GIB = 4.0


@dataclass(frozen=True)
class VerifierConfig:
    """Everything a verifier is built from; `python -m verifier_svc`'s flags are its fields'
    (specdec.config_flags), the engine's own in the nested `engine`."""

    model: str = field(default=DEFAULT_MODEL, metadata=flag(
        f"HF directory, .gguf file or {DEFAULT_MODEL!r} (default)"))
    # What GetInfo and the metrics call the model; None: `model` as given, a path by its
    # last component (specdec.cli.served_model_name). Never the resolved path.
    served_model_name: str | None = field(default=None, metadata=flag(
        "name clients use in 'model' (default: --model as given; a path is named by its "
        "last component)"))
    trust_remote_code: bool = field(default=False, metadata=flag(
        "accepted for vLLM compatibility; specdec never runs model code"))
    dtype: str = field(default="auto", metadata=flag(
        "auto | float32 | bfloat16 | float16 (auto: bfloat16; float32 on a cpu without bf16 "
        "kernels; float32 makes greedy speculation bit-exact). A .gguf --model at auto runs on "
        "its quantized blocks; a dtype given dequantises it"))
    device: str = field(default="auto", metadata=flag("auto | cpu | cuda | npu"))
    engine: EngineConfig = field(default_factory=EngineConfig, metadata=nested())
    gpu_memory_utilization: float = field(default=0.9, metadata=flag(
        "fraction of device memory (RAM on cpu) for weights, activations and the KV cache"))
    kv_cache_memory_bytes: int | None = field(default=None, metadata=flag(
        "KV cache size; default: from --gpu-memory-utilization (on cpu capped at "
        f"${CPU_KV_CACHE_SPACE_ENV} GiB, default {CPU_KV_CACHE_DEFAULT_GIB:g})"))
    # The cap on the KV cache on the CPU, GiB, where kv_cache_memory_bytes is not given: the
    # KV cache shares RAM with everything else on the host, so, as vLLM's CPU backend does,
    # it gets 4 GiB unless told otherwise (by the field, or $VLLM_CPU_KVCACHE_SPACE).
    cpu_kv_cache_space_gib: float = field(default_factory=env_default(
        CPU_KV_CACHE_SPACE_ENV, float, CPU_KV_CACHE_DEFAULT_GIB))
    tensor_parallel_size: int = field(default=1, metadata=flag("ranks the model is split over"))
    # None, "int8" (weight-only; see specdec.models.packed_linear) or "gguf" (a GGUF's own
    # blocks; see specdec.models.gguf_model).
    quantization: str | None = field(default=None, metadata=flag(
        "int8: weight-only int8 linears, quantised at load per output channel (CPU; lossy "
        "against the checkpoint, speculation stays lossless against the quantised model). "
        "gguf: a GGUF model's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices run on the file's own blocks "
        "(CPU; what a .gguf --model at --dtype auto does anyway; the default model needs it "
        "asked)", choices=("int8", "gguf")))
    enforce_eager: bool = field(default=False, metadata=flag(
        "never compile. By default, on the CPU with one rank and a C++ compiler at hand, the "
        "verifier compiles its forward with torch.compile at start-up (about a minute and a "
        "half for the default model on 2 cores; steps are then ~1.3x faster) and falls back "
        "to eager if compiling fails"))
    # Compile the forward (see specdec.models.compiled_forward); None, as the command line
    # sets it: `compile_by_default` (which --enforce-eager turns off).
    compile: bool | None = False
    # The model's attention backend (specdec.layers.attention.ATTENTION_BACKENDS).
    attention_backend: str = field(default_factory=attention_backend_from_env)
    # False: on the CPU, the compiled or eager forward instead of the C++ decoder stack (for
    # comparisons; specdec.models.cpu_stack).
    cpu_stack: bool = field(default_factory=cpu_stack_from_env)
    speculative_config: SpeculativeConfig | None = field(default=None, metadata=flag(
        'JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5}\'', type=str, to_field=SpeculativeConfig.parse,
        to_flag=SpeculativeConfig.to_json))
    drafter_targets: tuple[str, ...] = field(default=(), metadata=flag(
        "drafter address host:port (repeatable; a name may resolve to several replicas)",
        name="--drafter", repeated=True))
    # Seconds the verifier waits at start-up for a drafter replica before it serves (0: it
    # serves at once and drafting starts when a replica connects).
    drafter_wait_s: float = field(default=0.0, metadata=flag(
        "at start-up, wait this long for a drafter replica before serving (0: serve at once, "
        "plain until one connects)"))
    # vLLM's; its keys are named in a warning, none is used (specdec.config).
    additional_config: str | None = field(default=None, metadata=flag("JSON object"))
    threads: int | None = field(default=None, metadata=flag("torch CPU threads"))
    # None: plain gRPC (loopback); see specdec.rpc.tls.
    grpc_tls: GrpcTlsConfig | None = None
    # Required of gateways, sent to drafters (specdec.rpc.internal_auth); None: open. Never in
    # a repr (logs, tracebacks).
    internal_token: str | None = field(default=None, repr=False)
    # Serve gRPC reflection (--enable-reflection, a flag of specdec.rpc.internal_auth's).
    enable_reflection: bool = False
    # What one structured-output constraint may cost (specdec.grammar_checker).
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits, metadata=nested())

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size must be >= 1, got "
                              f"{self.tensor_parallel_size}", param="tensor_parallel_size")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1], got "
                              f"{self.gpu_memory_utilization}", param="gpu_memory_utilization")
        if self.compile and self.tensor_parallel_size > 1:
            raise ConfigError("a compiled forward does not run with --tensor-parallel-size > 1 "
                              "(the all-reduces stay eager); set compile=False "
                              "(--enforce-eager)", param="compile")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"{ATTENTION_BACKEND_ENV}={self.attention_backend!r} is not "
                              f"supported; allowed values: {', '.join(ATTENTION_BACKENDS)}",
                              param=ATTENTION_BACKEND_ENV)
        parse_additional_config(self.additional_config, ADDITIONAL_CONFIG_KEYS)
        if self.speculative_config is not None and not self.drafter_targets:
            raise ConfigError("--speculative-config is set but no --drafter address is given",
                              param="drafter")


@dataclass(frozen=True)
class ServedModel:
    """What the verifier tells gateways about its model (Verifier.GetInfo)."""

    model_name: str  # the served name, never a filesystem path
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    speculative_method: str
    num_speculative_tokens: int
    tokenizer_fingerprint: str
    deterministic: bool


def build_engine(config: VerifierConfig, enter_phase: Callable[[str], None] = lambda name: None,
                 ) -> tuple[Engine, ServedModel]:
    """`enter_phase` is told each start-up phase as it begins (verifier_svc.startup_phase).
    Everything that can refuse the configuration runs before the tensor-parallel workers
    start."""
    target = load_target(config, enter_phase)
    model_config = target.model.config
    max_model_len = _max_model_len(config, model_config.max_position_embeddings)
    num_blocks = num_kv_blocks(config, target.model, target.dtype, target.device, max_model_len)
    compile_forward = (compile_by_default(config.device, config.tensor_parallel_size,
                                          config.enforce_eager)
                       if config.compile is None else config.compile)
    enter_phase(PHASE_WARMING_UP)
    linear_kernel = _pack_linears(config, target, compile_forward)
    engine_config = _engine_config(config, max_model_len, num_blocks, target.device.type)
    _check_kv_holds_a_sequence(num_blocks, config.engine.block_size, max_model_len)
    fingerprint = tokenizer_fingerprint(target.tokenizer)
    pool = _drafter_pool(config, model_config.vocab_size, fingerprint)
    eos_token_ids = model_eos_token_ids(target.model_dir, model_config.eos_token_ids,
                                        target.tokenizer)
    kv_cache = KVCache.allocate(model_config, num_blocks, config.engine.block_size, target.dtype,
                                target.device)
    tensor_parallel = _start_tensor_parallel(config, target, num_blocks, linear_kernel)
    forward = choose_forward(target.model, kv_cache, target.device, parallel=target.parallel,
                             cpu_stack=config.cpu_stack, compile_forward=compile_forward,
                             linear_kernel=linear_kernel, spec=config.speculative_config)
    runner = ModelRunner(target.model, kv_cache, config.engine.block_size, target.device,
                         tensor_parallel, forward)
    engine = _assemble_engine(config, engine_config, num_blocks, runner, target.tokenizer,
                              eos_token_ids, pool)
    if engine_config.seed is not None:
        torch.manual_seed(engine_config.seed)  # the stream of the requests that bring no seed
    _log_engine(config, target, runner, engine_config, num_blocks)
    return engine, _served_model(config, target, runner, max_model_len, eos_token_ids,
                                 fingerprint)


def _max_model_len(config: VerifierConfig, max_position_embeddings: int) -> int:
    """--max-model-len, by default the model's own; never beyond it."""
    max_model_len = config.engine.max_model_len or max_position_embeddings
    if max_model_len > max_position_embeddings:
        raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's "
                          f"max_position_embeddings ({max_position_embeddings})",
                          param="max_model_len")
    return max_model_len


def _pack_linears(config: VerifierConfig, target: TargetModel, compile_forward: bool,
                  ) -> str | None:
    """Packs the linears for their kernel (None: none packs here); returns the kernel.

    After the KV budget, which counts the checkpoint's weights. For a compiled forward
    `linears_to_pack` says which are packed here (with oneDNN only the LM head, which runs
    eagerly: inductor prepacks the layers itself)."""
    if compile_forward and target.device.type not in ("cpu", "cuda"):
        raise ConfigError(f"a compiled forward runs on cpu or cuda, not {target.device.type}; "
                          "set compile=False (--enforce-eager)", param="compile")
    linear_kernel = choose_kernel(target.device, target.dtype, config.quantization)
    if linear_kernel is not None:
        pack_linears(target.model, linear_kernel,
                     only=linears_to_pack(linear_kernel) if compile_forward else None)
    return linear_kernel


def _engine_config(config: VerifierConfig, max_model_len: int, num_blocks: int,
                   device_type: str) -> EngineConfig:
    """The engine's config with what the builder settles: the lengths, the KV blocks, and
    the defaults that depend on the device or the speculative method."""
    spec = config.speculative_config
    engine = config.engine
    return dataclasses.replace(
        engine, max_model_len=max_model_len, num_kv_blocks=num_blocks,
        draft_timeout_s=engine.draft_timeout_s or default_draft_timeout_s(spec),
        long_prefill_token_threshold=(
            engine.long_prefill_token_threshold
            if engine.long_prefill_token_threshold is not None
            else default_long_prefill_token_threshold(device_type)),
        text_drafter=spec is None or spec.method not in MODEL_METHODS,
        disable_by_batch_size=spec.disable_by_batch_size if spec is not None else None,
        draft_caps=spec.draft_caps if spec is not None else None)


def _check_kv_holds_a_sequence(num_blocks: int, block_size: int, max_model_len: int) -> None:
    if num_blocks * block_size < max_model_len:
        raise ConfigError(f"the KV cache holds {num_blocks * block_size} tokens, less "
                          f"than one sequence of --max-model-len {max_model_len}; raise "
                          "--gpu-memory-utilization or lower --max-model-len",
                          param="max_model_len")


def _drafter_pool(config: VerifierConfig, vocab_size: int, fingerprint: str,
                  ) -> DrafterPool | None:
    """The client of the --drafter replicas; None without speculation."""
    if config.speculative_config is None:
        return None
    return DrafterPool(list(config.drafter_targets), vocab_size=vocab_size,
                       tokenizer_fingerprint=fingerprint, tls=config.grpc_tls,
                       internal_token=config.internal_token)


def _start_tensor_parallel(config: VerifierConfig, target: TargetModel, num_blocks: int,
                           linear_kernel: str | None) -> TensorParallelGroup | None:
    """Starts the workers of ranks 1..N-1; None without tensor parallelism."""
    if target.parallel is None:
        return None
    return TensorParallelGroup.start(target.parallel, model_dir=target.model_dir,
                                     dtype=target.dtype, device=target.device,
                                     num_blocks=num_blocks, block_size=config.engine.block_size,
                                     linear_kernel=linear_kernel,
                                     attention_backend=config.attention_backend)


def _assemble_engine(config: VerifierConfig, engine_config: EngineConfig, num_blocks: int,
                     runner: ModelRunner, tokenizer: Any, eos_token_ids: tuple[int, ...],
                     pool: DrafterPool | None) -> Engine:
    spec = config.speculative_config
    vocab_size = runner.model.config.vocab_size
    scheduler = Scheduler(engine_config, BlockManager(
        num_blocks, engine_config.block_size,
        enable_prefix_caching=engine_config.enable_prefix_caching))
    return Engine(engine_config, runner, scheduler, vocab_size=vocab_size,
                  eos_token_ids=eos_token_ids,
                  num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                  drafter_pool=pool,
                  grammars=GrammarService(functools.partial(
                      GrammarBackend, tokenizer, vocab_size,
                      eos_token_ids=eos_token_ids, limits=config.grammar_limits)))


def _log_engine(config: VerifierConfig, target: TargetModel, runner: ModelRunner,
                engine_config: EngineConfig, num_blocks: int) -> None:
    spec = config.speculative_config
    block_size = engine_config.block_size
    logger.info("verifier: model %s on %s in %s (%s), tensor parallel %d, max_model_len %d, %d KV "
                "blocks of %d tokens (%d tokens), speculation %s", target.model_dir,
                target.device, target.dtype, forward_name(runner.forward),
                config.tensor_parallel_size, engine_config.max_model_len,
                num_blocks, block_size, num_blocks * block_size,
                f"{spec.method} k={spec.num_speculative_tokens} via {', '.join(config.drafter_targets)}"
                if spec else "off")
    logger.info("admission: %d running + %d waiting requests, then RESOURCE_EXHAUSTED; "
                "request timeout %s", engine_config.max_num_seqs, engine_config.waiting_limit,
                f"{engine_config.request_timeout_s} s" if engine_config.request_timeout_s
                else "none (client deadlines apply)")


def _served_model(config: VerifierConfig, target: TargetModel, runner: ModelRunner,
                  max_model_len: int, eos_token_ids: tuple[int, ...],
                  fingerprint: str) -> ServedModel:
    spec = config.speculative_config
    return ServedModel(model_name=served_model_name(config.model, config.served_model_name),
                       max_model_len=max_model_len,
                       vocab_size=target.model.config.vocab_size, eos_token_ids=eos_token_ids,
                       speculative_method=spec.method if spec else "",
                       num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                       tokenizer_fingerprint=fingerprint,
                       deterministic=deterministic(runner, target.dtype,
                                                   config.tensor_parallel_size))
