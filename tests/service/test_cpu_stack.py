"""The C++ decoder stack (`specdec.models.cpu_stack`): what it runs, its numerics, and where
the verifier uses it. Its logits against transformers' are in tests/stack/test_model.py (every
flavour it runs), its bf16 verify windows against one-token decodes and exact bf16
speculation in tests/stack/test_bf16_speculation.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.config_flags import build_config
from specdec.engine.kv_cache import KVCache
from specdec.layers.attention import AttentionMetadata
from specdec.layers.cpu_extension import linear_supports
from specdec.models.compiled_forward import CompiledForward
from specdec.models.cpu_stack import (
    CPU_STACK_ENV,
    CpuDecoderStack,
    make_cpu_stack,
    unsupported_reason,
)
from specdec.models.loader import load_model
from specdec.models.packed_linear import pack_linears
from tests.support.engine_harness import PROMPTS, generate, greedy, ngram_engine
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.builder import VerifierConfig, build_engine

pytestmark = pytest.mark.skipif(not linear_supports(torch.float32),
                                reason="specdec's C++ linear is not built for this CPU")

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-stack"), hidden_size=64, num_layers=3)


def _step(work: list[tuple[list[int], int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) for sequences (token ids, start position, block table)."""
    input_ids, positions, slots, starts, context_lens = [], [], [], [0], []
    for token_ids, start, table in work:
        for offset, token_id in enumerate(token_ids):
            position = start + offset
            input_ids.append(token_id)
            positions.append(position)
            slots.append(table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
        starts.append(starts[-1] + len(token_ids))
        context_lens.append(start + len(token_ids))
    return (torch.tensor(input_ids), torch.tensor(positions),
            AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_locs=starts, context_lens=context_lens,
                              block_tables=[torch.tensor(table) for _, _, table in work]))


def _run(forward: CpuDecoderStack, work: list[tuple[list[int], int, list[int]]], cache: KVCache) -> torch.Tensor:
    input_ids, positions, metadata = _step(work)
    return forward(input_ids, positions, cache, metadata)  # type: ignore[return-value]


def _tokens(count: int, seed: int, vocab_size: int = 96) -> list[int]:
    return torch.randint(3, vocab_size, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


# (dtype, packed kernel): the stack's linears, fp32 or bf16, or weight-only int8 for bf16 rows.
KERNELS = pytest.mark.parametrize(("dtype", "kernel"), [
    (torch.float32, "cpu"), (torch.bfloat16, "cpu"), (torch.float32, "int8"), (torch.bfloat16, "int8")],
    ids=["fp32", "bf16", "fp32-int8", "bf16-int8"])


def _packed_model(model_dir: Path, dtype: torch.dtype, kernel: str) -> torch.nn.Module:
    if not linear_supports(dtype, int8_weights=kernel == "int8"):
        pytest.skip(f"no C++ linear for {dtype} rows{' and int8 weights' if kernel == 'int8' else ''} here")
    model = load_model(model_dir, dtype, torch.device("cpu"))
    pack_linears(model, kernel)
    return model


@KERNELS
def test_the_stack_computes_the_models_forward(model_dir: Path, dtype: torch.dtype, kernel: str) -> None:
    """Prefill, decode, a verify window and a mixed step, with the aux states and the KV cache
    written: the stack equals the model to its dtype's rounding."""
    model = _packed_model(model_dir, dtype, kernel)
    stack = CpuDecoderStack(model)
    caches = [KVCache.allocate(model.config, 32, BLOCK_SIZE, dtype, torch.device("cpu")) for _ in range(2)]
    for cache in caches:
        for tensor in cache.key_caches + cache.value_caches:
            tensor.zero_()  # allocated uninitialised
    # The first prefill and the last step's second segment are long (> 32 tokens: torch's
    # SDPA over the gathered context), the rest the kernel's short segments.
    first, second = _tokens(50, seed=1), _tokens(45, seed=2)
    table_a, table_b = [9, 3, 14, 0, 7, 21, 2, 11, 5, 30, 18, 26, 6], [17, 1, 25, 8, 12, 4, 31, 10, 23, 13, 28, 19]
    steps = [[(first[:37], 0, table_a)], [(first[37:38], 37, table_a)], [(first[38:43], 38, table_a)],
             [(second[:9], 0, table_b), (first[43:44], 43, table_a)], [(first[44:50], 44, table_a),
                                                                     (second[9:45], 9, table_b)]]
    # fp32: the residual stream reaches ~70 here; the two computations' few-ulp differences
    # (norm statistics, e^x) grow through the layers' sums to ~1.5e-4 (~2e-6 of that scale).
    tolerance = {"atol": 5e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    with torch.inference_mode():
        for work in steps:
            input_ids, positions, metadata = _step(work)
            expected, expected_aux = model(input_ids, positions, caches[0], metadata, aux_layer_ids=(0, 2))
            hidden, aux = stack(input_ids, positions, caches[1], metadata, aux_layer_ids=(0, 2))
            torch.testing.assert_close(hidden.float(), expected.float(), **tolerance)
            for got, want in zip(aux, expected_aux):
                torch.testing.assert_close(got.float(), want.float(), **tolerance)
            assert hidden.dtype == dtype and hidden.shape == expected.shape
    for cache in ("key_caches", "value_caches"):
        for got, want in zip(getattr(caches[1], cache), getattr(caches[0], cache)):
            torch.testing.assert_close(got.float(), want.float(), **tolerance)


def test_the_weights_move_into_one_buffer_in_reading_order(tmp_path: Path) -> None:
    """The stack moves the matrices a step streams into one buffer, each layer's qkv, o,
    gate_up and down then the LM head, without changing a value; a tied LM head keeps the
    embedding as its weight beside its packed copy, and the model's eager forward reads the
    moved weights too."""
    if not linear_supports(torch.float32):
        pytest.skip("no C++ linear for fp32 here")
    tied = make_tiny_llama(tmp_path / "tied", hidden_size=64, num_layers=2, tie_word_embeddings=True)
    model = load_model(tied, torch.float32, torch.device("cpu"))
    pack_linears(model, "cpu")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    stack = CpuDecoderStack(model)
    linears = [linear for layer in model.model.layers
               for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                              layer.mlp.gate_up_proj, layer.mlp.down_proj)] + [model.lm_head]
    starts = [linear.packed.data_ptr() for linear in linears]
    assert starts == sorted(starts)
    for linear, start in zip(linears, starts):
        assert linear.packed.untyped_storage().data_ptr() == linears[0].packed.untyped_storage().data_ptr()
        assert start % 64 == 0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)
    cache = KVCache.allocate(model.config, 8, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    input_ids, positions, metadata = _step([(_tokens(5, seed=3), 0, [0, 1])])
    with torch.inference_mode():
        hidden = stack(input_ids, positions, cache, metadata)
        assert torch.isfinite(stack.compute_logits(hidden)).all()


def test_an_unpacked_models_weights_are_packed_into_the_buffer_too(model_dir: Path) -> None:
    """A model whose linears were not packed: the stack packs copies of the layers'
    weights, and moves the LM head's own parameter (which the model multiplies by) behind
    them in the same buffer; the stack's forward matches the model's."""
    if not linear_supports(torch.float32):
        pytest.skip("no C++ linear for fp32 here")
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    stack = CpuDecoderStack(model)
    buffer = stack._layer_tensors[1].untyped_storage().data_ptr()  # the first packed qkv
    assert model.lm_head.weight.untyped_storage().data_ptr() == buffer
    cache = KVCache.allocate(model.config, 8, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    for tensor in cache.key_caches + cache.value_caches:
        tensor.zero_()
    input_ids, positions, metadata = _step([(_tokens(5, seed=3), 0, [0, 1])])
    with torch.inference_mode():
        hidden = stack(input_ids, positions, cache, metadata)
        expected = model(input_ids, positions, cache, metadata)
    torch.testing.assert_close(hidden, expected, atol=5e-4, rtol=1e-5)


@KERNELS
def test_a_sequence_computes_the_same_alone_and_batched(model_dir: Path, dtype: torch.dtype, kernel: str) -> None:
    """Batch invariance: a sequence's rows are bit-identical whether its step holds other
    sequences (a prefill chunk, another verify window) or not."""
    model = _packed_model(model_dir, dtype, kernel)
    stack = CpuDecoderStack(model)
    cache = KVCache.allocate(model.config, 32, BLOCK_SIZE, dtype, torch.device("cpu"))
    tokens, other = _tokens(14, seed=3), _tokens(20, seed=4)
    table, other_table = [4, 12, 6, 1], [2, 9, 10, 15, 3, 18]
    with torch.inference_mode():
        _run(stack, [(tokens[:10], 0, table)], cache)
        alone = _run(stack, [(tokens[10:14], 10, table)], cache)
        batched = _run(stack, [(other[:16], 0, other_table), (tokens[10:14], 10, table),
                               (other[16:20], 16, other_table)], cache)
    assert torch.equal(batched[16:20], alone)


# How an 80-token prompt reaches the cache: one prefill (past the attention's 32-token
# pieces), prefill chunks, a cache-hit head then its tail, a prefill then decodes.
PROMPT_SPLITS = {"one prefill": [80], "chunks of 33": [33, 66, 80], "cache hit, tail": [64, 80],
                 "decodes": [70, *range(71, 81)]}


def _prompt_states(stack: CpuDecoderStack, model: torch.nn.Module, dtype: torch.dtype, cuts: list[int],
                   with_others: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The 80-token prompt's final hidden states and the residuals entering layers 0 and 2
    (what eagle3's capture reads), run in steps ending at `cuts`, alone or each step beside
    another sequence's prefill chunk and a decode."""
    cache = KVCache.allocate(model.config, 64, BLOCK_SIZE, dtype, torch.device("cpu"))
    tokens, other = _tokens(80, seed=5), _tokens(60, seed=6)
    table, other_table, decode_table = list(range(40, 60)), list(range(1, 16)), [20, 21]
    hidden, aux, start = [], [[], []], 0
    with torch.inference_mode():
        for step, end in enumerate(cuts):
            work = [(tokens[start:end], start, table)]
            if with_others:
                other_start = (step * 7) % 50
                work = [(other[other_start:other_start + 9], other_start, other_table), *work,
                        (other[:1], step % 6, decode_table)]
            input_ids, positions, metadata = _step(work)
            states, captured = stack(input_ids, positions, cache, metadata, aux_layer_ids=(0, 2))
            first = len(work[0][0]) if with_others else 0
            hidden.append(states[first:first + end - start])
            for kept, layer_states in zip(aux, captured):
                kept.append(layer_states[first:first + end - start])
            start = end
    return torch.cat(hidden), [torch.cat(kept) for kept in aux]


@KERNELS
@pytest.mark.parametrize("split", list(PROMPT_SPLITS))
def test_a_prompt_computes_the_same_whatever_its_chunking(model_dir: Path, dtype: torch.dtype, kernel: str,
                                                          split: str) -> None:
    """Batch invariance of a prefill through every kernel of the stack (linears, attention,
    norms, RoPE) and the hidden-state capture: each prompt token's states are bit-identical
    whether the prompt is one prefill, chunks, a cache hit's tail or decodes, alone or beside
    other sequences."""
    model = _packed_model(model_dir, dtype, kernel)
    stack = CpuDecoderStack(model)
    whole, whole_aux = _prompt_states(stack, model, dtype, [80], with_others=False)
    for with_others in (False, True):
        hidden, aux = _prompt_states(stack, model, dtype, PROMPT_SPLITS[split], with_others)
        differing = (hidden != whole).any(dim=1).nonzero().flatten().tolist()
        assert not differing, f"tokens {differing} differ (others: {with_others})"
        for kept, expected in zip(aux, whole_aux):
            assert torch.equal(kept, expected)


def test_what_the_stack_leaves_to_the_model(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    assert unsupported_reason(model) is None
    pack_linears(model, "mkldnn")  # oneDNN's opaque layout: not the C++ linear's
    assert "a linear the C++ kernel cannot use" in unsupported_reason(model)
    assert make_cpu_stack(model) is None
    with pytest.raises(ValueError, match="cannot run this model"):
        CpuDecoderStack(model)
    assert "is not a LlamaForCausalLM" in unsupported_reason(torch.nn.Linear(2, 2))
    monkeypatch.setenv(CPU_STACK_ENV, "0")
    assert unsupported_reason(load_model(model_dir, torch.float32, torch.device("cpu"))) == f"{CPU_STACK_ENV}=0"


def test_bad_steps_are_refused(model_dir: Path) -> None:
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    stack = CpuDecoderStack(model)
    cache = KVCache.allocate(model.config, 32, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    input_ids, positions, metadata = _step([([5, 6], 0, [0])])
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="outside the RoPE table"):
            stack(input_ids, torch.tensor([0, 10**6]), cache, metadata)
        with pytest.raises(ValueError, match="aux_layer_ids"):
            stack(input_ids, positions, cache, metadata, aux_layer_ids=(3,))
        with pytest.raises(RuntimeError, match="no layers"):
            stack._kernel.decoder_stack(input_ids, positions, stack._embed, stack._rotary.cos_cache,
                                        stack._rotary.sin_cache, [], stack._final_norm, [], [],
                                        metadata.slot_mapping, metadata.query_start_locs, metadata.context_lens,
                                        metadata.block_tables, [], *stack._shape, stack.batch_invariant,
                                        metadata.tree_parent_tensors())
        with pytest.raises(RuntimeError, match="one K and V cache per layer"):
            short = KVCache.allocate(model.config, 32, BLOCK_SIZE, torch.float32, torch.device("cpu"))
            short.key_caches = short.key_caches[:1]
            stack(input_ids, positions, short, metadata)
        # The linears run unchecked inside the stack, so a bias of the wrong width is refused
        # before the first layer (index 3: layer 0's qkv bias slot).
        good = stack._layer_tensors[3]
        stack._layer_tensors[3] = torch.zeros(5)
        with pytest.raises(RuntimeError, match="a bias must be"):
            stack(input_ids, positions, cache, metadata)
        stack._layer_tensors[3] = good
        assert stack(input_ids, positions, cache, metadata).shape == (2, model.config.hidden_size)


async def test_the_verifier_runs_the_stack_on_the_cpu(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The stack is the CPU verifier's forward, compiling or not; with it turned off, the
    compiled forward; every one answers the same greedy tokens. Quantised int8 runs the stack
    too, where the int8 kernel is built (else the model)."""
    outputs = {}
    with caplog.at_level("INFO"):
        async with ngram_engine(model_dir, "cpu", k=3, compile=True) as engine:
            assert isinstance(engine.runner.forward, CpuDecoderStack)
            outputs["stack"] = [await generate(engine, prompt, greedy()) for prompt in PROMPTS]
            assert engine.spec.num_accepted_tokens > 0
    assert "(C++ decoder stack)" in caplog.text
    async with ngram_engine(model_dir, "cpu", k=3, quantization="int8") as engine:
        own_int8 = linear_supports(torch.float32, int8_weights=True)
        assert isinstance(engine.runner.forward, CpuDecoderStack) == own_int8
        for prompt in PROMPTS:  # fp32: speculation changes no token of the quantised model's
            plain = await generate(engine, prompt, greedy(), num_speculative_tokens=0)
            assert await generate(engine, prompt, greedy()) == plain
    monkeypatch.setenv(CPU_STACK_ENV, "0")
    async with ngram_engine(model_dir, "cpu", compile=True) as engine:
        assert isinstance(engine.runner.forward, CompiledForward)
        outputs["compiled"] = [await generate(engine, prompt, greedy()) for prompt in PROMPTS]
    async with ngram_engine(model_dir, "cpu") as engine:
        assert engine.runner.forward is engine.runner.model
        outputs["eager"] = [await generate(engine, prompt, greedy()) for prompt in PROMPTS]
    assert outputs["stack"] == outputs["compiled"] == outputs["eager"]


def test_a_draft_model_drafts_through_the_stack(model_dir: Path) -> None:
    from drafter_svc.draft_model_proposer import build_draft_model_method
    from drafter_svc.proposer import ModelOptions
    from specdec.config import SpeculativeConfig

    config = SpeculativeConfig(method="draft_model", model=str(model_dir), num_speculative_tokens=3)
    proposer = build_draft_model_method(config, ModelOptions(target_model=str(model_dir), dtype="float32",
                                                             device="cpu", num_blocks=16))()
    assert isinstance(proposer.forward, CpuDecoderStack)


@pytest.mark.parametrize(("dtype", "env", "deterministic"), [
    ("bfloat16", {}, True), ("float32", {}, True), ("bfloat16", {"VLLM_BATCH_INVARIANT": "0"}, False),
    ("float32", {CPU_STACK_ENV: "0"}, False), ("float16", {}, False)])
def test_the_verifier_says_whether_it_serves_deterministically(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture, dtype: str,
                                                               env: dict[str, str], deterministic: bool) -> None:
    """Deterministic (GetInfo, and so the gateway's /health) where the stack and the LM head
    run on the batch-invariant kernels in bf16 or fp32; elsewhere it says why, once, at start."""
    if dtype == "bfloat16" and not linear_supports(torch.bfloat16):
        pytest.skip("no C++ bf16 linear here")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level("INFO", logger="verifier_svc.forward_choice"):
        _, served = build_engine(build_config(VerifierConfig, model=str(model_dir), device="cpu",
                                              dtype=dtype, max_model_len=64,
                                              block_size=BLOCK_SIZE, num_kv_blocks=32))
    assert served.deterministic is deterministic
    assert caplog.text.count("deterministic serving is off") == (0 if deterministic else 1)
