"""Logprobs from the verify forward (issue #30, item 1).

In fp32 the log-probabilities reported with speculation are bit-identical to those without
it, for ngram and for a model drafter whose every draft is accepted (so most tokens are
scored from accepted-draft rows). Raw values match transformers' own forward; processed
values are the log-softmax of the request's processed logits.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from specdec.engine.logits_processor import process_logits
from specdec.engine.logprobs import (
    TokenLogprobs,
    batch_token_logprobs,
    token_logprobs,
    top_k,
)
from specdec.engine.sampling_params import SamplingParams
from specdec.errors import InvalidRequestError
from tests.support.engine_harness import served_engine
from tests.support.tiny_models import make_tiny_llama
from specdec.engine.engine import Engine

PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [10, 11, 12, 13, 10, 11, 12, 13, 10, 11],
    [40, 41, 40, 41, 40, 41, 40],
]
MAX_TOKENS = 20
TOP = 5


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-logprobs"))


async def run(model: Path, device: str, spec: dict | None, params: SamplingParams,
              logprobs_mode: str = "raw_logprobs") -> tuple[list[tuple[list[int], list[TokenLogprobs]]], Engine]:
    async with served_engine(model, spec, device, max_model_len=128, num_kv_blocks=256,
                             max_num_batched_tokens=32, logprobs_mode=logprobs_mode) as engine:
        results = await asyncio.gather(*(collect(engine, prompt, params) for prompt in PROMPTS))
    return list(results), engine


async def collect(engine: Engine, prompt: list[int],
                  params: SamplingParams) -> tuple[list[int], list[TokenLogprobs]]:
    _, queue = engine.add_request("logprobs", prompt, params)
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs] = []
    while True:
        output = await queue.get()
        assert not isinstance(output, Exception), output
        assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids)
        token_ids += output.token_ids
        logprobs += output.logprobs
        if output.finish_reason is not None:
            return token_ids, logprobs


def greedy(**extra: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP,
                          **extra)  # type: ignore[arg-type]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def draft_model_spec(model: Path) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def plain(tiny_model: Path, device) -> list[tuple[list[int], list[TokenLogprobs]]]:
    results, _ = asyncio.run(run(tiny_model, str(device), None, greedy()))
    return results


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
async def test_logprobs_are_bit_identical_with_and_without_speculation(tiny_model, device, plain,
                                                                        method) -> None:
    spec = NGRAM if method == "ngram" else draft_model_spec(tiny_model)
    results, engine = await run(tiny_model, str(device), spec, greedy())
    assert engine.spec.num_accepted_tokens > 0, "no draft was accepted: nothing was tested"
    if method == "draft_model":  # the same model drafts: every row but the bonus is a draft's
        assert engine.spec.num_accepted_tokens == engine.spec.num_draft_tokens
    for (tokens, logprobs), (plain_tokens, plain_logprobs) in zip(results, plain):
        assert tokens == plain_tokens
        assert logprobs == plain_logprobs  # floats compared exactly (fp32)


def test_top_logprobs_are_sorted_and_hold_the_greedy_token(plain) -> None:
    for tokens, logprobs in plain:
        for token_id, entry in zip(tokens, logprobs):
            assert len(entry.top_token_ids) == TOP
            assert list(entry.top_logprobs) == sorted(entry.top_logprobs, reverse=True)
            # Greedy: the chosen token is the most likely one.
            assert entry.top_token_ids[0] == token_id
            assert entry.logprob == entry.top_logprobs[0]
            assert entry.logprob <= 0.0


def test_raw_logprobs_match_transformers(tiny_model, plain) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    model.eval()
    for prompt, (tokens, logprobs) in zip(PROMPTS, plain):
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = model(ids).logits[0]  # [len, vocab]
        reference = torch.log_softmax(logits.float(), dim=-1)
        for position, (token_id, entry) in enumerate(zip(tokens, logprobs)):
            row = reference[len(prompt) - 1 + position]
            assert entry.logprob == pytest.approx(float(row[token_id]), abs=1e-4)
            top_values, top_ids = row.topk(TOP)
            assert list(entry.top_token_ids)[:2] == top_ids.tolist()[:2]
            assert list(entry.top_logprobs) == pytest.approx(top_values.tolist(), abs=1e-4)


async def test_processed_logprobs_follow_the_penalised_distribution(tiny_model, device) -> None:
    params = greedy(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={7: 3.0})
    raw_results, _ = await run(tiny_model, str(device), NGRAM, params)
    processed_results, engine = await run(tiny_model, str(device), NGRAM, params,
                                          logprobs_mode="processed_logprobs")
    assert engine.spec.num_draft_tokens > 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    for prompt, (tokens, raw), (processed_tokens, processed) in zip(PROMPTS, raw_results,
                                                                    processed_results):
        assert tokens == processed_tokens
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0]
        rows = logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
        expected = token_logprobs(
            process_logits(rows, prompt, tokens[:-1], params, prompt_len=len(prompt)), tokens, TOP)
        assert [entry.logprob for entry in processed] == pytest.approx(
            [entry.logprob for entry in expected], abs=1e-4)
        # The penalties moved something: processed differs from raw.
        assert any(abs(a.logprob - b.logprob) > 1e-3 for a, b in zip(raw, processed))


def test_logprobs_bounds() -> None:
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(logprobs=bad)  # type: ignore[arg-type]
        assert info.value.param == "logprobs"
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(logprobs=20).logprobs == 20


def test_token_logprobs_with_no_top() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    entries = token_logprobs(logits, [2, 0], 0)
    expected = torch.log_softmax(logits, dim=-1)
    assert [entry.logprob for entry in entries] == pytest.approx([float(expected[0, 2]),
                                                                  float(expected[1, 0])], abs=1e-6)
    assert all(entry.top_token_ids == () for entry in entries)


def test_two_pass_top_k_equals_torch_topk() -> None:
    generator = torch.Generator().manual_seed(0)
    for vocab_size in (49152, 1000, 777, 5):
        logits = torch.randn(7, vocab_size, generator=generator)
        for k in (1, 5, 20):
            k = min(k, vocab_size)
            values, ids = top_k(logits, k)
            expected_values, expected_ids = logits.topk(k, dim=-1)
            assert torch.equal(values, expected_values) and torch.equal(ids, expected_ids)


def test_batched_entries_equal_one_sequence_at_a_time() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 3000, generator=generator)
    groups = [(0, [5, 6], 3), (2, [7], 0), (3, [1, 2, 3, 4], 20), (7, [9, 9], 1)]
    batched = batch_token_logprobs(logits, groups)
    for (first, ids, top), entries in zip(groups, batched):
        assert entries == token_logprobs(logits[first:first + len(ids)], ids, top)


def test_token_bytes_are_exact_for_partial_characters() -> None:
    """A byte-level token may hold part of a UTF-8 character: its `bytes` are its own, so a
    completion's tokens' bytes join into the completion's text exactly."""
    from gateway.logprobs import TokenTexts
    from specdec.models.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    text = "naïve café 😀 — 日本"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    texts = TokenTexts(tokenizer)
    pieces = [texts(token_id)[1] for token_id in token_ids]
    assert bytes(byte for piece in pieces for byte in piece) == text.encode("utf-8")
    assert any(bytes(piece).decode("utf-8", errors="replace") != bytes(piece).decode(
        "utf-8", errors="ignore") for piece in pieces), "no token split a character"
