"""Builds a verifier engine from its configuration: model, KV pool, scheduler, drafters."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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
from specdec.device import device_memory_bytes, resolve_device, resolve_dtype
from specdec.engine.block_manager import BlockManager
from specdec.engine.kv_cache import KVCache
from specdec.engine.scheduler import Scheduler
from specdec.layers import cpu_extension
from specdec.errors import ConfigError
from specdec.grammar_checker import GrammarLimits
from specdec.layers.attention import (
    ATTENTION_BACKEND_ENV,
    ATTENTION_BACKENDS,
    attention_backend_from_env,
)
from specdec.layers.batch_invariance import deterministic_reason
from specdec.models.compiled_forward import CompiledForward, linears_to_pack, warm_up
from specdec.models.cpu_stack import CpuDecoderStack, cpu_stack_from_env, make_cpu_stack
from specdec.models.gguf_linear import GgufLinear
from specdec.models.gguf_model import load_gguf_model, native_gguf_file
from specdec.models.llama import LlamaForCausalLM
from specdec.models.loader import load_model, load_model_config
from specdec.models.model_files import (
    DEFAULT_MODEL,
    load_tokenizer,
    resolve_model,
    tokenizer_fingerprint,
)
from specdec.models.packed_linear import PackedLinear, choose_kernel, pack_linears
from specdec.models.parallel import ParallelContext, check_tensor_parallel
from specdec.rpc.tls import GrpcTlsConfig
from verifier_svc.drafting.drafter_pool import DrafterPool
from specdec.engine.engine import Engine
from verifier_svc.grammar.backend import GrammarBackend
from verifier_svc.grammar.verification import GrammarService
from verifier_svc.model_runner import ModelRunner
from verifier_svc.startup_phase import (
    PHASE_COMPILING_KERNELS,
    PHASE_LOADING_WEIGHTS,
    PHASE_WARMING_UP,
)
from verifier_svc.tp_worker import TensorParallelGroup, rank_device

logger = logging.getLogger(__name__)

# Fixed headroom for allocator fragmentation and framework buffers.
_ACTIVATION_SLACK_BYTES = 256 << 20
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
        spec = self.speculative_config
        if spec is not None and spec.suffix_decoding_use_tree_spec and self.tensor_parallel_size > 1:
            # The accepted path's K/V is moved on rank 0's cache only.
            raise ConfigError("suffix_decoding_use_tree_spec does not run with "
                              "--tensor-parallel-size > 1", param="suffix_decoding_use_tree_spec")
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
    """`enter_phase` is told each start-up phase as it begins (verifier_svc.startup_phase)."""
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
    # With tensor parallelism, `model` and its config are rank 0's shard (heads / N).
    native_gguf = native_gguf_file(config.model, config.dtype, config.quantization, device, dtype,
                                   config.tensor_parallel_size)
    if native_gguf is not None:
        model = load_gguf_model(native_gguf, model_dir, dtype, device, attention_backend=config.attention_backend)
    else:
        model = load_model(model_dir, dtype, device, parallel=parallel,
                           attention_backend=config.attention_backend)
    model_config = model.config
    tokenizer = load_tokenizer(model_dir)

    max_model_len = config.engine.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's "
                          f"max_position_embeddings ({model_config.max_position_embeddings})",
                          param="max_model_len")
    num_blocks = _num_kv_blocks(config, model, dtype, device, max_model_len)
    compile_forward = (compile_by_default(config.device, config.tensor_parallel_size,
                                          config.enforce_eager)
                       if config.compile is None else config.compile)
    enter_phase(PHASE_WARMING_UP)
    if compile_forward and device.type not in ("cpu", "cuda"):
        raise ConfigError(f"a compiled forward runs on cpu or cuda, not {device.type}; set "
                          "compile=False (--enforce-eager)", param="compile")
    # After the KV budget, which counts the checkpoint's weights. For a compiled forward
    # `linears_to_pack` says which are packed here (with oneDNN only the LM head, which runs
    # eagerly: inductor prepacks the layers itself).
    linear_kernel = choose_kernel(device, dtype, config.quantization)
    if linear_kernel is not None:
        pack_linears(model, linear_kernel,
                     only=linears_to_pack(linear_kernel) if compile_forward else None)
    spec = config.speculative_config
    engine_config = dataclasses.replace(
        config.engine, max_model_len=max_model_len, num_kv_blocks=num_blocks,
        draft_timeout_s=config.engine.draft_timeout_s or default_draft_timeout_s(spec),
        long_prefill_token_threshold=(
            config.engine.long_prefill_token_threshold
            if config.engine.long_prefill_token_threshold is not None
            else default_long_prefill_token_threshold(device.type)),
        text_drafter=spec is None or spec.method not in MODEL_METHODS,
        tree_drafts=spec is not None and bool(spec.suffix_decoding_use_tree_spec),
        disable_by_batch_size=spec.disable_by_batch_size if spec is not None else None,
        draft_caps=spec.draft_caps if spec is not None else None)
    block_size = config.engine.block_size
    if num_blocks * block_size < max_model_len:
        raise ConfigError(f"the KV cache holds {num_blocks * block_size} tokens, less "
                          f"than one sequence of --max-model-len {max_model_len}; raise "
                          "--gpu-memory-utilization or lower --max-model-len",
                          param="max_model_len")
    fingerprint = tokenizer_fingerprint(tokenizer)
    pool = None
    if spec is not None:
        pool = DrafterPool(list(config.drafter_targets), vocab_size=model_config.vocab_size,
                           tokenizer_fingerprint=fingerprint, tls=config.grpc_tls,
                           internal_token=config.internal_token)
    eos_token_ids = _eos_token_ids(model_dir, model_config.eos_token_ids, tokenizer)
    kv_cache = KVCache.allocate(model_config, num_blocks, block_size, dtype, device)
    # Workers start last: nothing after this can refuse the configuration.
    tensor_parallel = None
    if parallel is not None:
        tensor_parallel = TensorParallelGroup.start(parallel, model_dir=model_dir, dtype=dtype,
                                                    device=device, num_blocks=num_blocks,
                                                    block_size=block_size,
                                                    linear_kernel=linear_kernel,
                                                    attention_backend=config.attention_backend)
    # On the CPU the C++ decoder stack where it runs the model (fastest measured, nothing to
    # compile), else the compiled forward when asked, else the model eagerly.
    forward: CpuDecoderStack | CompiledForward | None = None
    if device.type == "cpu" and parallel is None:
        forward = make_cpu_stack(model, config.cpu_stack)
    if forward is None and compile_forward:
        try:
            forward = CompiledForward(model)
            # Before the first request; the blocks it writes hold no sequence yet.
            warm_up(forward, kv_cache, block_ids=list(range(-(-16 // block_size))),
                    aux_layer_ids=_drafter_aux_layer_ids(spec, model_config.num_hidden_layers))
        except Exception as exc:
            # The model itself still runs eagerly (its attention falls back outside a trace);
            # its layers' linears still need the packing the compiler was to do.
            logger.warning("compiling the forward failed (%s: %s); running eagerly",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            forward = None
            if linear_kernel is not None:
                pack_linears(model, linear_kernel)
    runner = ModelRunner(model, kv_cache, block_size, device, tensor_parallel, forward)
    scheduler = Scheduler(engine_config, BlockManager(
        num_blocks, block_size, enable_prefix_caching=engine_config.enable_prefix_caching))

    engine = Engine(engine_config, runner, scheduler, vocab_size=model_config.vocab_size,
                    eos_token_ids=eos_token_ids,
                    num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                    drafter_pool=pool,
                    grammars=GrammarService(functools.partial(
                        GrammarBackend, tokenizer, model_config.vocab_size,
                        eos_token_ids=eos_token_ids, limits=config.grammar_limits)))
    if engine_config.seed is not None:
        torch.manual_seed(engine_config.seed)  # the stream of the requests that bring no seed
    logger.info("verifier: model %s on %s in %s (%s), tensor parallel %d, max_model_len %d, %d KV "
                "blocks of %d tokens (%d tokens), speculation %s", model_dir, device, dtype,
                _forward_name(runner.forward), config.tensor_parallel_size, max_model_len,
                num_blocks, block_size, num_blocks * block_size,
                f"{spec.method} k={spec.num_speculative_tokens} via {', '.join(config.drafter_targets)}"
                if spec else "off")
    logger.info("admission: %d running + %d waiting requests, then RESOURCE_EXHAUSTED; "
                "request timeout %s", engine_config.max_num_seqs, engine_config.waiting_limit,
                f"{engine_config.request_timeout_s} s" if engine_config.request_timeout_s
                else "none (client deadlines apply)")
    served = ServedModel(model_name=served_model_name(config.model, config.served_model_name),
                         max_model_len=max_model_len,
                         vocab_size=model_config.vocab_size, eos_token_ids=eos_token_ids,
                         speculative_method=spec.method if spec else "",
                         num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                         tokenizer_fingerprint=fingerprint,
                         deterministic=_deterministic(runner, dtype, config.tensor_parallel_size))
    return engine, served


def _deterministic(runner: ModelRunner, dtype: torch.dtype, tensor_parallel_size: int) -> bool:
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


def _forward_name(forward: object) -> str:
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


def _drafter_aux_layer_ids(spec: SpeculativeConfig | None, num_layers: int) -> tuple[int, ...]:
    """The target layers whose states an eagle3 drafter will ask for (the compiled forward
    needs a graph for them); () for every other method, which reads none or the final
    state only. Read from the head's config, as the drafter reads it."""
    if spec is None or spec.method != "eagle3" or spec.model is None:
        return ()
    from specdec.models.eagle3 import aux_layer_ids_from_config

    raw = json.loads((resolve_model(str(spec.model)) / "config.json").read_text())
    return aux_layer_ids_from_config(raw, num_layers)


def _num_kv_blocks(config: VerifierConfig, model: LlamaForCausalLM, dtype: torch.dtype,
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


def _eos_token_ids(model_dir: Path, config_eos: tuple[int, ...] | list[int],
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
