"""Tensor parallelism on the CPU (gloo): two ranks give what one rank gives.

The tiny random Llama (4 heads, 2 KV heads) is split over 2 ranks: the verifier process is
rank 0, a `verifier_svc.tp_worker` subprocess rank 1. Logits agree with one rank within fp32
rounding (the all-reduce sums partial products in another order) and greedy tokens are the
same, with and without ngram speculation. A size that does not divide the heads is refused
before anything starts; a worker that dies fails requests with an error instead of hanging.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from drafter_svc.server import start_drafter_server, stop_drafter_server
from specdec.config import SpeculativeConfig
from specdec.config_flags import build_config
from specdec.engine.kv_cache import KVCache
from specdec.engine.sampling_params import SamplingParams
from specdec.errors import ConfigError
from specdec.layers.attention import AttentionMetadata
from specdec.models.loader import load_model
from specdec.models.parallel import ParallelContext, shard_tensor
from tests.support.engine_harness import generate
from tests.support.tiny_models import make_tiny_llama
from verifier_svc import tp_worker
from verifier_svc.builder import VerifierConfig, build_engine
from specdec.engine.engine import Engine
from verifier_svc.model_runner import StepInput
from verifier_svc.requests import EngineError
from verifier_svc.server import RunningVerifier

PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 20, 21, 22, 23],
    [40, 41, 40, 41, 40, 41, 40],
]
MAX_TOKENS = 12
SHORT_MESSAGE_INLINE = 48
ATOL = 1e-5

# The engines' loop tasks live as long as the module's fixture, so the tests share its loop.
module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tp"))


def verifier_config(model_dir: Path, tensor_parallel_size: int, **overrides: object,
                    ) -> VerifierConfig:
    values: dict[str, object] = dict(
        model=str(model_dir), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=64, block_size=4, num_kv_blocks=128,
        tensor_parallel_size=tensor_parallel_size)
    values.update(overrides)
    return build_config(VerifierConfig, **values)  # type: ignore[arg-type]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


class Engines:
    """A one-rank engine and a two-rank engine with ngram speculation (k=3) on one model."""

    def __init__(self, single: Engine, parallel: Engine) -> None:
        self.single = single
        self.parallel = parallel


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(tiny_model: Path) -> AsyncIterator[Engines]:
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert spec is not None
    drafter, port = await start_drafter_server(spec, "127.0.0.1", 0)
    single, _ = build_engine(verifier_config(tiny_model, 1))
    # A short first broadcast: prefills take the two-broadcast path, decode steps one.
    default_inline, tp_worker.MESSAGE_INLINE = tp_worker.MESSAGE_INLINE, SHORT_MESSAGE_INLINE
    try:
        parallel, _ = build_engine(verifier_config(
            tiny_model, 2, speculative_config=spec, drafter_targets=(f"127.0.0.1:{port}",),
            # Drafts every step: the adaptive policy stops asking a drafter that proposes
            # nothing, as ngram often does on the random model's text.
            draft_timeout_s=1.0, adaptive_speculation=False))
    finally:
        tp_worker.MESSAGE_INLINE = default_inline
    try:
        await single.start()
        await parallel.start()
        assert parallel.drafter_pool is not None
        assert await parallel.drafter_pool.wait_for_healthy(1, timeout_s=5)
        yield Engines(single, parallel)
    finally:
        await single.stop()
        await parallel.stop()
        parallel.runner.close()
        await stop_drafter_server(drafter)


def test_shards_split_heads_and_mlp(tiny_model: Path) -> None:
    """Rank 1's shard: half the q and KV heads, half the MLP, an all-reduce per block half."""
    model = load_model(tiny_model, torch.float32, torch.device("cpu"),
                       parallel=ParallelContext(rank=1, world_size=2))
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size) == (2, 1, 32)
    layer = model.model.layers[0]
    head_dim = config.head_dim
    assert tuple(layer.self_attn.qkv_proj.weight.shape) == (4 * head_dim, config.hidden_size)
    assert len(layer.self_attn._forward_hooks) == len(layer.mlp._forward_hooks) == 1
    assert tuple(layer.mlp.down_proj.weight.shape) == (config.hidden_size, 32)
    # v_proj rows of rank 1 = the second half of the checkpoint's v_proj.
    full = load_model(tiny_model, torch.float32, torch.device("cpu"))
    full_qkv = full.model.layers[0].self_attn.qkv_proj.weight
    full_v = full_qkv[4 * head_dim + 2 * head_dim:]  # q: 4 heads, k: 2 heads, then v: 2 heads
    shard_v = layer.self_attn.qkv_proj.weight[3 * head_dim:]  # q: 2 heads, k: 1, v: 1
    assert torch.equal(shard_v, full_v[head_dim:])
    assert torch.equal(shard_tensor("model.layers.0.self_attn.o_proj.bias", full_v, ParallelContext(1, 2)),
                       full_v)  # row-parallel biases are replicated


class CountingContext(ParallelContext):
    """Rank 0 of 2 with the all-reduce replaced by a counter (no process group)."""

    def __init__(self) -> None:
        super().__init__(rank=0, world_size=2)
        self.num_all_reduces = 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.num_all_reduces += 1


def test_all_reduce_survives_packed_linears(tiny_model: Path) -> None:
    """Two all-reduces per layer, also after every nn.Linear is swapped for a packed kernel."""
    from specdec.models.packed_linear import mkldnn_supported, pack_linears

    if not mkldnn_supported(torch.bfloat16):
        pytest.skip("no oneDNN bf16 kernel on this CPU")
    context = CountingContext()
    model = load_model(tiny_model, torch.bfloat16, torch.device("cpu"), parallel=context)
    assert pack_linears(model, "mkldnn") > 0
    kv_cache = KVCache.allocate(model.config, 4, 4, torch.bfloat16, torch.device("cpu"))
    metadata = AttentionMetadata(slot_mapping=torch.arange(3), query_start_locs=[0, 3],
                                 context_lens=[3], block_tables=[torch.tensor([0])])
    with torch.inference_mode():
        model(torch.tensor([5, 6, 7]), torch.arange(3), kv_cache, metadata)
    assert context.num_all_reduces == 2 * model.config.num_hidden_layers


@pytest.mark.parametrize("size,message", [(3, "4 attention heads"), (4, "2 key/value heads")])
def test_size_that_does_not_divide_is_refused(tiny_model: Path, size: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        build_engine(verifier_config(tiny_model, size))
    assert error.value.param == "tensor_parallel_size"
    assert "allows: 1, 2" in error.value.message


def test_size_below_one_is_refused(tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match="must be >= 1"):
        verifier_config(tiny_model, 0)


@module_loop
async def test_logits_match_one_rank(engines: Engines) -> None:
    prompt = PROMPTS[1]
    logits = []
    for engine in (engines.single, engines.parallel):
        # Blocks 100.. are never handed out by these engines' block managers in this test.
        step = StepInput(prompt, 0, list(range(100, 100 + len(prompt) // 4 + 1)), len(prompt))
        batch = engine.runner.prepare([step])
        step_logits, _ = engine.runner.execute(batch)
        logits.append(step_logits)
    assert logits[0].shape == (len(prompt), 96)
    torch.testing.assert_close(logits[1], logits[0], atol=ATOL, rtol=0)
    tensor_parallel = engines.parallel.runner.tensor_parallel
    assert tensor_parallel is not None and tensor_parallel.num_split_messages == 1


@module_loop
async def test_greedy_tokens_match_one_rank(engines: Engines) -> None:
    for prompt in PROMPTS:
        expected = await generate(engines.single, prompt, greedy())
        plain = await generate(engines.parallel, prompt, greedy(), num_speculative_tokens=0)
        speculative = await generate(engines.parallel, prompt, greedy())
        assert plain == expected, prompt
        assert speculative == expected, prompt
    # The random model rarely accepts a draft, but every draft went through a (k + 1)-token
    # verify window on both ranks.
    assert engines.parallel.spec.num_draft_tokens > 0
    tensor_parallel = engines.parallel.runner.tensor_parallel
    assert tensor_parallel is not None
    assert 0 < tensor_parallel.num_split_messages < tensor_parallel.num_steps  # both paths ran


@module_loop
async def test_batched_requests_match_one_rank(engines: Engines) -> None:
    expected = [await generate(engines.single, prompt, greedy()) for prompt in PROMPTS]
    together = await asyncio.gather(*(generate(engines.parallel, prompt, greedy())
                                      for prompt in PROMPTS))
    assert list(together) == expected


@module_loop
async def test_dead_worker_fails_requests_loudly(engines: Engines) -> None:
    """Last: it breaks the shared two-rank engine (one process holds one group at a time)."""
    engine = engines.parallel
    tensor_parallel = engine.runner.tensor_parallel
    assert tensor_parallel is not None and tensor_parallel.poll_failure() is None
    worker = tensor_parallel.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    _, queue = engine.add_request("after-death", PROMPTS[0], greedy())
    output = await asyncio.wait_for(queue.get(), timeout=30)
    assert isinstance(output, EngineError)
    failure = tensor_parallel.poll_failure()
    assert failure is not None and "rank 1" in failure and "-9" in failure
    # The group stays broken: later steps fail at once instead of meeting a dead peer.
    _, queue = engine.add_request("later", PROMPTS[1], greedy())
    assert isinstance(await asyncio.wait_for(queue.get(), timeout=30), EngineError)
    # The server's watch returns, so `python -m verifier_svc` exits (code 1).
    running: Any = RunningVerifier(server=None, engine=engine, served=None, port=0)  # type: ignore[arg-type]
    assert "rank 1" in await asyncio.wait_for(running.wait_for_fatal_error(), timeout=5)
