"""`CompiledForward`: a model's forward compiled by inductor, attention left to the backend.

Why: a decode or verify forward of a small model on a CPU spends about as long in the
~60 small ops per layer (norms, RoPE, SiLU, residual adds, views), each a trip through
torch's dispatcher, as in the matmuls. Inductor fuses those into a few generated C++ loops
per layer and, with `freezing`, prepacks the weights for oneDNN as `PackedLinear` does.

How: the paged attention cannot be traced (its metadata is Python lists that change every
step), so it is one opaque custom op, `specdec::paged_attention`, in an otherwise whole
graph. The op takes the step's tensors; the step's `AttentionMetadata` and the eager
backend that does the work travel beside the graph in a per-thread *forward context*, set
around each call (as vLLM does for its attention op). Only the number of tokens is
dynamic (marked on each call's inputs; everything else, the KV caches and the weights, is
static, which keeps dynamo's per-call guards and the graph's inputs few: ~1 ms a step less
than `dynamic=True` on the default model): one graph serves the single-token decode and
one every larger step (with `linear()`'s fp32 path, on machines without specdec's kernel,
two: it branches on up to 8 rows), so steps never recompile once `warm_up` has run.

Limits: inference only; cpu (the path measured); not with tensor parallelism (its
all-reduce hooks stay eager). The LM head is left out of the graph: `compute_logits` runs
it on the rows that are sampled, packed eagerly by the caller.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.engine.kv_cache import KVCache
from specdec.layers.attention import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from specdec.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64


@dataclass(slots=True)
class _ForwardContext:
    backend: AttentionBackend
    metadata: AttentionMetadata


# The forward in progress on this thread: set by `CompiledForward.__call__` only.
_forward_context = threading.local()
# Held around every compiled forward (see CompiledForward.__call__).
_stance_lock = threading.Lock()


@torch.library.custom_op("specdec::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], contiguous
    """The backend's attention for this step. Writes this step's K/V into the caches, a side
    effect the graph never observes (nothing in it reads the caches), so it is not declared."""
    context: _ForwardContext = _forward_context.current
    out = context.backend.forward(query, key, value, key_cache, value_cache, context.metadata)
    # The graph assumes the fake's contiguous layout below; a view would be misread.
    return out.contiguous()


@paged_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
      value_cache: torch.Tensor) -> torch.Tensor:
    return query.new_empty(query.shape)


def linears_to_pack(kernel: str) -> tuple[str, ...] | None:
    """Which of a to-be-compiled model's linears its builder packs eagerly for `kernel`
    (`pack_linears`' `only`; None: all). oneDNN's packed weights are opaque tensors dynamo
    cannot trace, and inductor's freezing prepacks the layers itself, so only the LM head,
    which runs outside the graph, is packed; the `cpu` kernel's weights and int8 packs are
    plain tensors, traced as they are (the `cpu` kernel is one operator call in the graph)."""
    return ("lm_head",) if kernel == "mkldnn" else None


class _OpAttention:
    """The backend the layers see once compiled: inside a trace it emits the custom op;
    called eagerly (a test or a tool running the model itself) it is the wrapped backend."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.specdec.paged_attention(query, key, value, key_cache, value_cache)
        return self.backend.forward(query, key, value, key_cache, value_cache, metadata)


class CompiledForward:
    """Calls like the model (`(input_ids, positions, kv_cache, metadata, aux_layer_ids)`),
    runs its compiled forward. Build it after the weights are final (loaded, not packed)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        import torch._inductor.config as inductor_config
        import torch.fx.experimental._config as shape_config

        self.model = model
        self.backend: AttentionBackend = model.attention_backend
        op_attention = _OpAttention(self.backend)
        for layer in model.model.layers:
            layer.self_attn._backend = op_attention
        # Process-wide, and read when a graph is compiled (torch.compile's `options` does not
        # reach it): weights become constants that inductor prepacks for oneDNN.
        inductor_config.freezing = True
        # Round every intermediate to the model dtype where eager rounds it. Without it the
        # one-token graph and the many-token graph fused a bf16 layer's ops differently and
        # kept different intermediates in fp32, so a token's logits in a decode step and in
        # a verify window differed (a bf16 near-tie could flip under speculation); with it
        # both equal the eager forward bit for bit, at no cost measured (8.4 -> 8.2 ms).
        inductor_config.emulate_precision_casts = True
        # Every instance's graphs are cached on the one code object below, up to
        # recompile_limit (8 by default), after which dynamo silently runs it eagerly. An
        # instance holds 2-3 (one token, several, and in fp32 many), and a process may build
        # a few engines (bench compare, the tests).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   RECOMPILE_LIMIT)
        # Duck sizing would take a token count that equals another size at trace time (a
        # 16-token warm-up and 16-token KV blocks) to be that size for good, so that every
        # other count recompiles.
        shape_config.use_duck_shape = False

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                    attn_metadata: AttentionMetadata, aux_layer_ids: tuple[int, ...],
                    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
            return model(input_ids, positions, kv_cache, attn_metadata, aux_layer_ids)

        self._compiled = torch.compile(forward, dynamic=None)
        # The aux layer sets `warm_up` compiled every graph for (see __call__).
        self.warmed_aux_layer_ids: set[tuple[int, ...]] = set()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                 attn_metadata: AttentionMetadata, aux_layer_ids: tuple[int, ...] = (),
                 ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        if input_ids.shape[0] > 1:  # one token is its own graph
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        # Dynamo's stance is process-wide: forwards of several instances (engines) on other
        # threads run one at a time, so none compiles under another's guard-skipping stance.
        with _stance_lock:
            return self._call(input_ids, positions, kv_cache, attn_metadata, aux_layer_ids)

    def _call(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
              attn_metadata: AttentionMetadata, aux_layer_ids: tuple[int, ...],
              ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        _forward_context.current = _ForwardContext(self.backend, attn_metadata)
        args = (input_ids, positions, kv_cache, attn_metadata, aux_layer_ids)
        try:
            if aux_layer_ids not in self.warmed_aux_layer_ids or input_ids.is_inference():
                return self._compiled(*args)
            # A step like those warm-up ran: dynamo checks only the guards that tell its
            # cached graphs apart (the token count; which instance's graph, when a process
            # holds several), not all (every KV cache tensor and weight, on each call: 0.5-1
            # ms of a 9 ms bf16 step on the default model). Sound because such a step cannot
            # need another graph: its token count is the only input that varies and warm-up
            # compiled one for each class of it (tests/service/test_compiled_forward.py). Any other
            # call (other aux layers, inference tensors from a tool) keeps the full guards.
            try:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    return self._compiled(*args)
            except RuntimeError as error:
                # Dynamo refuses, before running anything, a step none of its graphs tells
                # apart as its own: then the full check finds or compiles the right one.
                if "skip_guard_eval_unsafe" not in str(error):
                    raise
                logger.warning("a step needed a graph warm-up did not compile; compiling it")
                return self._compiled(*args)
        finally:
            _forward_context.current = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def warm_up(forward: CompiledForward, kv_cache: KVCache, block_ids: list[int],
            aux_layer_ids: tuple[int, ...] = ()) -> float:
    """Compiles the graphs steps use before any request arrives: one token, a few (a verify
    window) and many (a prefill chunk; fp32 linears branch on the row count), writing only
    into `block_ids` (blocks no sequence holds yet, enough for 16 tokens); returns the
    seconds it took. Inputs are made outside inference mode, as `ModelRunner.prepare` makes
    them: dynamo's guards tell the two kinds of tensor apart."""
    started = time.perf_counter()
    block_size = kv_cache.block_size
    steps = []
    with torch.inference_mode(False):  # even when the caller is in inference mode
        block_table = torch.tensor(block_ids, dtype=torch.long)
        # (tokens, context length): the first attends to itself, the others to the cache too.
        for num_tokens, context_len in ((16, 16), (2, 3), (1, 4)):
            positions = torch.arange(context_len - num_tokens, context_len)
            slots = block_table[positions // block_size] * block_size + positions % block_size
            metadata = AttentionMetadata(slot_mapping=slots, query_start_locs=[0, num_tokens],
                                         context_lens=[context_len], block_tables=[block_table])
            steps.append((positions % 8, positions, metadata))
    with torch.inference_mode():
        for input_ids, positions, metadata in steps:
            forward(input_ids, positions, kv_cache, metadata, aux_layer_ids)
    forward.warmed_aux_layer_ids.add(aux_layer_ids)
    seconds = time.perf_counter() - started
    logger.info("compiled the forward in %.1f s", seconds)
    return seconds
