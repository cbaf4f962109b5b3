"""`--compile`: the inductor-compiled forward computes what the eager one does, greedy
speculation through it stays token-for-token plain decoding (fp32), and it refuses the
configurations it does not run in."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from specdec.config_flags import build_config
from specdec.engine.kv_cache import KVCache
from specdec.errors import ConfigError
from specdec.layers.attention import AttentionMetadata
from specdec.models.compiled_forward import CompiledForward, linears_to_pack, warm_up
from specdec.models.cpu_stack import CPU_STACK_ENV
from specdec.models.loader import load_model
from specdec.models.packed_linear import choose_kernel, mkldnn_supported, pack_linears
from tests.support.engine_harness import PROMPTS, generate, greedy, ngram_engine, plain_outputs
from tests.support.tiny_models import make_tiny_llama
from verifier_svc import forward_choice
from verifier_svc.builder import VerifierConfig
from verifier_svc.forward_choice import compile_by_default

BLOCK_SIZE = 4


@pytest.fixture(autouse=True)
def no_cpu_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verifier's CPU forward is the C++ decoder stack where it runs; these tests are
    about the compiled forward it falls back to."""
    monkeypatch.setenv(CPU_STACK_ENV, "0")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-compiled"), num_layers=3)


def _step(chunks: list[tuple[list[int], int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor,
                                                                   AttentionMetadata]:
    """A flat batch from (token_ids, start_position, block_table) per sequence."""
    token_ids, positions, slots, starts, context_lens, tables = [], [], [], [0], [], []
    for ids, start, table in chunks:
        token_ids += ids
        for position in range(start, start + len(ids)):
            positions.append(position)
            slots.append(table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
        starts.append(starts[-1] + len(ids))
        context_lens.append(start + len(ids))
        tables.append(torch.tensor(table))
    metadata = AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_locs=starts,
                                 context_lens=context_lens, block_tables=tables)
    return torch.tensor(token_ids), torch.tensor(positions), metadata


def test_compiled_logits_match_eager(tiny_model: Path) -> None:
    eager = load_model(tiny_model, torch.float32, torch.device("cpu"))
    compiled_model = load_model(tiny_model, torch.float32, torch.device("cpu"))
    config = eager.config
    caches = [KVCache.allocate(config, 16, BLOCK_SIZE, torch.float32, torch.device("cpu"))
              for _ in range(2)]
    for cache in caches:  # compared whole below, unused slots included
        for pool in cache.key_caches + cache.value_caches:
            pool.zero_()
    compiled = CompiledForward(compiled_model)
    table_a, table_b = [3, 7, 1, 9], [0, 2, 5, 11]
    steps = [
        # Two first prefill chunks in one step.
        [([5, 6, 7, 8, 9], 0, table_a), ([10, 11, 12, 13, 14, 15, 16], 0, table_b)],
        # A decode row beside a verify window, both against the cache.
        [([17], 5, table_a), ([18, 19, 20], 7, table_b)],
        # One token alone: the single-token graph.
        [([21], 6, table_a)],
        # A later prefill chunk (context larger than the chunk).
        [([22, 23, 24, 25], 10, table_b)],
    ]
    for chunks in steps:
        input_ids, positions, metadata = _step(chunks)  # outside inference mode, as the runner
        with torch.inference_mode():
            expected = eager.compute_logits(eager(input_ids, positions, caches[0], metadata))
            hidden, aux = compiled(input_ids, positions, caches[1], metadata, (0, 2))
            got = compiled.compute_logits(hidden)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            _, eager_aux = eager(input_ids, positions, caches[0], metadata, (0, 2))
            for got_aux, want_aux in zip(aux, eager_aux):
                torch.testing.assert_close(got_aux, want_aux, rtol=1e-4, atol=1e-4)
    # Called directly, the compiled model's layers still run eagerly (tests and tools do).
    input_ids, positions, metadata = _step([([26], 14, table_b)])
    with torch.inference_mode():
        direct = compiled_model.compute_logits(compiled_model(input_ids, positions, caches[1], metadata))
        expected = eager.compute_logits(eager(input_ids, positions, caches[0], metadata))
    torch.testing.assert_close(direct, expected, rtol=1e-4, atol=1e-4)
    for layer_id in range(config.num_hidden_layers):
        torch.testing.assert_close(caches[1].key_caches[layer_id], caches[0].key_caches[layer_id],
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True], ids=["linear", "builder_kernel"])
def test_warm_up_compiles_every_graph_steps_need(tiny_model: Path, dtype: torch.dtype, packed: bool) -> None:
    model = load_model(tiny_model, dtype, torch.device("cpu"))
    kernel = choose_kernel(torch.device("cpu"), dtype, None) if packed else None
    if kernel is not None:  # as the verifier's builder packs them (the cpu kernel: all)
        pack_linears(model, kernel, only=linears_to_pack(kernel))
    # 16-token blocks: the size of warm-up's prefill chunk, which dynamo must not take for
    # the size of every chunk.
    block_size = 16
    kv_cache = KVCache.allocate(model.config, 8, block_size, dtype, torch.device("cpu"))
    compiled = CompiledForward(model)
    assert warm_up(compiled, kv_cache, block_ids=[0]) > 0
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    table = [1, 2, 3, 4, 5]
    # As the engine does: prefills, a verify window, a decode row, a batch of verify windows.
    steps = [([(list(range(4, 24)), 0)]), ([(list(range(24, 28)), 20)]), ([([28], 24)]),
             ([(list(range(30, 70)), 25)]), ([([71, 72, 73, 74], 65)] * 8)]
    for chunks in steps:
        tokens, start = chunks[0]
        input_ids = torch.tensor(tokens * len(chunks))
        positions = torch.arange(start, start + len(tokens)).repeat(len(chunks))
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor([table[p // block_size] * block_size + p % block_size
                                       for p in positions.tolist()]),
            query_start_locs=[len(tokens) * i for i in range(len(chunks) + 1)],
            context_lens=[start + len(tokens)] * len(chunks),
            block_tables=[torch.tensor(table)] * len(chunks))
        with torch.inference_mode():
            compiled(input_ids, positions, kv_cache, metadata)
    assert counters["stats"]["unique_graphs"] == before, "a step recompiled after warm-up"


def test_warm_forwards_of_two_models_keep_to_their_own_graphs(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Once warm, a forward checks only the guards that tell cached graphs apart. Two models
    of the same shapes (the same code object, so one cache of graphs) called in turn with
    every kind of step must each still compute its own logits."""
    skipping = []
    set_stance = torch.compiler.set_stance

    def spy(*args: object, **kwargs: object) -> object:
        skipping.append(kwargs.get("skip_guard_eval_unsafe", False))
        return set_stance(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", spy)
    runs = []
    for seed in (1, 2):
        model_dir = make_tiny_llama(tmp_path / f"seed{seed}", seed=seed)
        model = load_model(model_dir, torch.float32, torch.device("cpu"))
        kernel = choose_kernel(torch.device("cpu"), torch.float32, None)
        if kernel is not None:
            pack_linears(model, kernel, only=linears_to_pack(kernel))
        eager = load_model(model_dir, torch.float32, torch.device("cpu"))
        caches = [KVCache.allocate(model.config, 16, BLOCK_SIZE, torch.float32, torch.device("cpu"))
                  for _ in range(2)]
        compiled = CompiledForward(model)
        warm_up(compiled, caches[0], block_ids=[12, 13, 14, 15])
        runs.append((compiled, eager, caches))
    # A prefill, a verify window, a decode row, a batch of both; inputs made outside inference
    # mode as the engine's runner makes them.
    steps = [[(list(range(3, 14)), 0, [0, 1, 2])], [([20, 21, 22, 23], 11, [0, 1, 2, 3])],
             [([30], 15, [0, 1, 2, 3])], [([31], 16, [0, 1, 2, 3, 4]), (list(range(40, 47)), 0, [5, 6])]]
    for step in steps:
        input_ids, positions, metadata = _step(step)
        logits = []
        for compiled, eager, caches in runs:
            with torch.inference_mode():
                got = compiled.compute_logits(compiled(input_ids, positions, caches[0], metadata))
                expected = eager.compute_logits(eager(input_ids, positions, caches[1], metadata))
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            logits.append(got)
        assert not torch.allclose(logits[0], logits[1], atol=1e-2), "the two models agree: nothing tested"
    assert skipping and all(skipping), "warm steps did not skip the full guard check"


def test_a_warm_step_that_needs_a_new_graph_compiles_it(tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = load_model(tiny_model, torch.float32, torch.device("cpu"))
    kv_cache = KVCache.allocate(model.config, 16, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    compiled = CompiledForward(model)
    warm_up(compiled, kv_cache, block_ids=[12, 13, 14, 15])
    compiled_graphs = compiled._compiled
    refusals = []

    def refuse_once(*args: object) -> torch.Tensor:
        # What dynamo raises when, checking only the telling guards, no graph is the step's.
        if not refusals:
            refusals.append(args)
            raise RuntimeError("Recompilation triggered with skip_guard_eval_unsafe stance.")
        return compiled_graphs(*args)

    compiled._compiled = refuse_once
    input_ids, positions, metadata = _step([(list(range(3, 9)), 0, [0, 1])])
    with torch.inference_mode(), caplog.at_level("WARNING"):
        hidden = compiled(input_ids, positions, kv_cache, metadata)
    assert refusals and hidden.shape == (6, model.config.hidden_size)
    assert "did not compile; compiling it" in caplog.text


async def test_compiled_speculation_is_plain_decoding(tiny_model: Path) -> None:
    plain = await plain_outputs(tiny_model, "cpu")
    async with ngram_engine(tiny_model, "cpu", k=3, compile=True) as engine:
        speculative = [await generate(engine, prompt, greedy()) for prompt in PROMPTS]
        assert engine.spec.num_accepted_tokens > 0, "ngram never helped"
    assert speculative == plain


def test_compile_refuses_tensor_parallel() -> None:
    with pytest.raises(ConfigError, match="compiled forward does not run with --tensor-parallel"):
        build_config(VerifierConfig, model="m", compile=True, tensor_parallel_size=3)


def test_compile_by_default_only_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/g++" if name == "g++" else None)
    assert compile_by_default("cpu", 1, enforce_eager=False)
    assert not compile_by_default("cpu", 1, enforce_eager=True)
    assert not compile_by_default("cpu", 2, enforce_eager=False)  # the all-reduces stay eager
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no C++ compiler for inductor
    assert not compile_by_default("cpu", 1, enforce_eager=False)


@pytest.mark.skipif(not mkldnn_supported(torch.bfloat16), reason="no oneDNN bf16 on this CPU")
async def test_a_failed_compile_runs_eagerly(tiny_model: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    def fail(*args: object, **kwargs: object) -> float:
        raise RuntimeError("InductorError: no C++ compiler\nmore lines")

    monkeypatch.setattr(forward_choice, "warm_up", fail)
    async with ngram_engine(tiny_model, "cpu", dtype="bfloat16", compile=True) as engine:
        assert engine.runner.forward is engine.runner.model  # eager
        # The layers' linears got the packing the compiler would have done.
        assert all(not isinstance(module, torch.nn.Linear) for module in engine.runner.model.modules())
        compiled_failed = [await generate(engine, prompt, greedy()) for prompt in PROMPTS]
    async with ngram_engine(tiny_model, "cpu", dtype="bfloat16") as engine:
        eager = [await generate(engine, prompt, greedy()) for prompt in PROMPTS]
    assert compiled_failed == eager
    assert "compiling the forward failed (RuntimeError: InductorError: no C++ compiler); " \
           "running eagerly" in caplog.text
