"""Verification under a grammar, in the engine (issue #31, items 3, 4 and 6).

A tiny random Llama over the default model's vocabulary (its logits favour padding ids,
so only the masks make its output valid), served by the real engine with real drafter
services: outputs satisfy every kind of constraint with every drafting method, greedy
output is the same with speculation on and off, grammar-forced tokens are drafted without
the drafter, a drafter's tokens that leave the grammar are cut before verification, and
sampling follows the masked target distribution.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path

import pytest
import torch

from specdec.config_flags import build_config
from specdec.engine.rejection_sampler import verify
from specdec.engine.sampling_params import SamplingParams
from specdec.errors import InvalidRequestError
from tests.support.engine_harness import served_engine
from tests.support.grammar_decode import PADDED_VOCAB, make_padded_tiny_model
from verifier_svc.builder import VerifierConfig, build_engine
from verifier_svc.drafting.drafter_pool import Draft
from specdec.engine.engine import Engine
from verifier_svc.grammar import GrammarBackend
from verifier_svc.grammar.verification import mask_rows

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 1, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                          "maximum": 9}},
                  "required": ["id"], "additionalProperties": False},
    },
    "required": ["color", "size", "tags", "owner"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": json.dumps(SCHEMA),
    "json_object": "",
    "regex": r"[a-c]{3}-[0-9]{2}",
    "choice": json.dumps(["yes", "no", "maybe later"]),
    "grammar": 'start: "(" item ("," item)* ")"\nitem: "x" | "y"',
}
MAX_TOKENS = 48
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    path = tmp_path_factory.mktemp("grammar-target")
    make_padded_tiny_model(default_tokenizer.eos_token_id).save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return path


def valid(kind: str, value: str, text: str) -> bool:
    if kind == "json_schema":
        data = json.loads(text)
        return (set(data) == set(SCHEMA["properties"]) and data["color"] in ("red", "green", "blue")
                and 1 <= data["size"] <= 99 and isinstance(data["tags"], list)
                and len(data["tags"]) <= 2 and all(t in ("a", "b") for t in data["tags"])
                and set(data["owner"]) == {"id"} and 0 <= data["owner"]["id"] <= 9)
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(value, text) is not None
    if kind == "choice":
        return text in json.loads(value)
    return re.fullmatch(r"\([xy](,[xy])*\)", text) is not None


def bias(default_tokenizer) -> dict[int, float]:
    """Closing tokens first where the grammar allows them, so a random model finishes."""
    ids = {}
    for text, value in (("}", 30.0), ("]", 20.0), (")", 30.0), ('"', 40.0)):
        encoded = default_tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == 1:
            ids[encoded[0]] = value
    return ids


async def collect_tokens(queue: asyncio.Queue) -> list[int]:
    """A request's tokens from its engine queue, up to its finish."""
    tokens: list[int] = []
    while True:
        output = await queue.get()
        assert not isinstance(output, Exception), output
        tokens += output.token_ids
        if output.finish_reason is not None:
            return tokens


async def run(model_dir: Path, spec: dict | None, requests: list[tuple[str, str, SamplingParams]],
              device: str = "cpu", propose=None) -> tuple[list[list[int]], Engine]:
    async with served_engine(model_dir, spec, device, max_model_len=256,
                             num_kv_blocks=512, max_num_batched_tokens=64) as engine:
        if propose is not None:
            assert engine.drafter_pool is not None
            engine.drafter_pool.propose = propose  # type: ignore[method-assign]

        async def one(index: int, kind: str, value: str, params: SamplingParams) -> list[int]:
            compiled = await engine.compile_grammar(kind, value)
            prompt = [1] + list(range(100 + index, 130 + index))
            _, queue = engine.add_request(f"g{index}", prompt, params, grammar=compiled)
            return await collect_tokens(queue)

        outputs = await asyncio.gather(*(one(i, kind, value, params)
                                         for i, (kind, value, params) in enumerate(requests)))
    return list(outputs), engine


def greedy_requests(default_tokenizer) -> list[tuple[str, str, SamplingParams]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias=bias(default_tokenizer))
    return [(kind, value, params) for kind, value in CONSTRAINTS.items()]


@pytest.fixture(scope="module")
def plain(model_dir, default_tokenizer) -> list[list[int]]:
    outputs, _ = asyncio.run(run(model_dir, None, greedy_requests(default_tokenizer)))
    return outputs


def test_plain_outputs_satisfy_every_constraint(plain, default_tokenizer) -> None:
    for (kind, value), tokens in zip(CONSTRAINTS.items(), plain):
        text = default_tokenizer.decode(tokens)
        assert valid(kind, value, text), (kind, text)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "suffix"])
async def test_speculation_keeps_greedy_outputs_under_grammars(model_dir, default_tokenizer, plain,
                                                               method) -> None:
    spec = {"ngram": NGRAM, "suffix": {"method": "suffix", "num_speculative_tokens": 4},
            "draft_model": {"method": "draft_model", "model": str(model_dir),
                            "num_speculative_tokens": 4}}[method]
    outputs, engine = await run(model_dir, spec, greedy_requests(default_tokenizer))
    assert outputs == plain
    # The schema's keys and punctuation are forced: drafted by the verifier itself.
    assert engine.spec.num_forced_tokens > 0


PROMPT_LEN = 31


async def test_drafts_leaving_the_grammar_are_cut_before_verification(model_dir, default_tokenizer,
                                                                     plain) -> None:
    """Every draft is [the right next token, a padding id, a padding id]: the grammar cuts
    it to its first token, which is verified and accepted; no padding id is ever verified."""
    pad = PADDED_VOCAB - 1

    async def propose(requests, finished, timeout_s):
        drafts = {}
        for request in requests:
            index = request.token_ids[1] - 100
            position = len(request.token_ids) - PROMPT_LEN
            expected = plain[index]
            if position < len(expected):
                drafts[request.seq_id] = Draft([expected[position], pad, pad], None)
        return drafts

    outputs, engine = await run(model_dir, NGRAM, greedy_requests(default_tokenizer), propose=propose)
    assert outputs == plain
    spec = engine.spec
    assert spec.num_draft_tokens > 0
    # Cut to one token each time, and that token always accepted.
    assert spec.num_draft_tokens == spec.num_drafts == spec.num_accepted_tokens


async def test_forced_tokens_need_no_drafter(model_dir, default_tokenizer) -> None:
    """Without any drafter the schema's forced tokens are still drafted (and all accepted)."""
    kind, value = "json_schema", CONSTRAINTS["json_schema"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias=bias(default_tokenizer))
    outputs, engine = await run(model_dir, NGRAM, [(kind, value, params)])
    forced = engine.spec.num_forced_tokens
    assert forced >= len(default_tokenizer.encode('{"color":"', add_special_tokens=False))
    assert forced < len(outputs[0])


async def test_seeded_sampling_under_a_grammar_does_not_depend_on_speculation(model_dir) -> None:
    requests = [(kind, value, SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS, seed=7 + i))
                for i, (kind, value) in enumerate(CONSTRAINTS.items()) if kind != "json_object"]
    plain_outputs, _ = await run(model_dir, None, requests)
    spec_outputs, engine = await run(model_dir, NGRAM, requests)
    assert spec_outputs == plain_outputs
    assert engine.spec.num_forced_tokens > 0


async def test_a_bad_grammar_is_an_invalid_request(model_dir) -> None:
    engine, _ = build_engine(build_config(VerifierConfig, model=str(model_dir), device="cpu", dtype="float32",
                                          max_model_len=128, num_kv_blocks=64))
    try:
        with pytest.raises(InvalidRequestError) as info:
            await engine.compile_grammar("json_schema", '{"type": "object", "properties": 3}')
        assert info.value.param == "grammar"
        with pytest.raises(InvalidRequestError):
            await engine.compile_grammar("regex", "(unclosed")
    finally:
        await engine.stop()


def chi_square_critical(degrees: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (Wilson-Hilferty)."""
    return degrees * (1 - 2 / (9 * degrees) + z * math.sqrt(2 / (9 * degrees))) ** 3


def test_masked_verification_samples_the_masked_distribution(default_tokenizer) -> None:
    """The rejection sampler on masked rows, with a draft, draws the first token from the
    target's distribution restricted to the grammar (chi-square, small bins merged)."""
    backend = GrammarBackend(default_tokenizer, PADDED_VOCAB)
    compiled = backend.compile("choice", json.dumps(["alpha", "beta", "gamma", "delta", "omega"]))
    generator = torch.Generator().manual_seed(0)
    raw = torch.randn(2, PADDED_VOCAB, generator=generator) * 2.0
    masked = raw.clone()
    draft = [default_tokenizer.encode("beta", add_special_tokens=False)[0]]
    mask_rows(masked, [(0, backend.new_state(compiled), draft)], PADDED_VOCAB)
    allowed = torch.nonzero(torch.isfinite(masked[0])).flatten().tolist()
    assert 1 < len(allowed) < 100 and draft[0] in allowed
    expected = torch.softmax(masked[0].double(), dim=-1)
    params = SamplingParams(temperature=1.0, max_tokens=4)
    draws = 3000
    counts = dict.fromkeys(allowed, 0)
    for seed in range(draws):
        rows = raw.clone()
        mask_rows(rows, [(0, backend.new_state(compiled), draft)], PADDED_VOCAB)
        emitted = verify(rows, draft, [1, 2], params, torch.Generator().manual_seed(seed))
        assert emitted[0] in counts, "a token outside the grammar was emitted"
        counts[emitted[0]] += 1
    big = [i for i in allowed if draws * float(expected[i]) >= 5]
    small = [i for i in allowed if i not in big]
    bins = [(counts[i], draws * float(expected[i])) for i in big]
    if small:
        bins.append((sum(counts[i] for i in small), draws * sum(float(expected[i]) for i in small)))
    chi_square = sum((observed - mean) ** 2 / mean for observed, mean in bins if mean > 0)
    assert len(bins) >= 3
    assert chi_square < chi_square_critical(len(bins) - 1), (chi_square, bins)


async def test_a_tokenizer_without_grammar_support_is_a_clear_invalid_request(tmp_path) -> None:
    from tests.support.tiny_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "word-level")  # llguidance cannot read its decoder
    engine, _ = build_engine(build_config(VerifierConfig, model=str(model), device="cpu", dtype="float32",
                                          max_model_len=128, num_kv_blocks=64))
    try:
        for _ in range(2):  # the failure is remembered, and said the same way each time
            with pytest.raises(InvalidRequestError) as info:
                await engine.compile_grammar("regex", "[ab]+")
            assert info.value.param == "grammar"
            assert "not available with this model's tokenizer" in info.value.message
    finally:
        await engine.stop()


@pytest.mark.parametrize("pattern", [format(bits, "04b") for bits in range(16)])
def test_masking_any_pattern_of_constrained_rows_in_inference_mode(default_tokenizer, pattern) -> None:
    """Four sequences in one step, each constrained ('1') or plain ('0'), with drafts of
    different lengths: the step's logits come out of the forward as inference tensors, and
    masking any subset of their rows (adjacent or not) equals masking each sequence's rows
    alone, and leaves the plain rows untouched."""
    backend = GrammarBackend(default_tokenizer, PADDED_VOCAB)
    compiled = backend.compile("choice", json.dumps(["alpha", "beta", "gamma"]))
    drafts = [[], default_tokenizer.encode("beta", add_special_tokens=False)[:1], [], [5, 6]]
    firsts = [0]
    for draft in drafts[:-1]:
        firsts.append(firsts[-1] + len(draft) + 1)
    num_rows = firsts[-1] + len(drafts[-1]) + 1
    raw = torch.randn(num_rows, PADDED_VOCAB, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logits = raw.clone()  # an inference tensor, as the model runner returns
    jobs = [(firsts[i], backend.new_state(compiled), drafts[i])
            for i, bit in enumerate(pattern) if bit == "1"]
    if jobs:
        mask_rows(logits, jobs, PADDED_VOCAB)
    expected = raw.clone()
    for first, _, draft in jobs:
        rows = expected[first:first + len(draft) + 1].clone()
        mask_rows(rows, [(0, backend.new_state(compiled), draft)], PADDED_VOCAB)
        expected[first:first + len(draft) + 1] = rows
    assert torch.equal(logits, expected)
    for i, bit in enumerate(pattern):
        rows = slice(firsts[i], firsts[i] + len(drafts[i]) + 1)
        if bit == "0":
            assert torch.equal(logits[rows], raw[rows])
        else:
            assert torch.isinf(logits[rows]).any()


async def test_constrained_and_plain_requests_mixed_in_one_batch(model_dir, default_tokenizer, plain) -> None:
    """Constrained, plain, constrained, ... in one engine's batches (with speculation): every
    request is served, the constrained outputs are valid and every greedy output equals the
    same request served alone."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias=bias(default_tokenizer))
    plain_params = SamplingParams(temperature=0.0, max_tokens=12)
    constrained = list(CONSTRAINTS.items())
    async with served_engine(model_dir, NGRAM, "cpu", max_model_len=256,
                             num_kv_blocks=512, max_num_batched_tokens=256) as engine:
        async def one(index: int, constraint: tuple[str, str] | None) -> list[int]:
            grammar = None if constraint is None else await engine.compile_grammar(*constraint)
            prompt = [1] + list(range(100 + index, 130 + index))
            _, queue = engine.add_request(f"m{index}", prompt,
                                          plain_params if constraint is None else params, grammar=grammar)
            return await collect_tokens(queue)

        order: list[tuple[str, str] | None] = []
        for constraint in constrained:
            order += [constraint, None]
        mixed = await asyncio.gather(*(one(i, c) for i, c in enumerate(order)))
        alone = [await one(i, c) for i, c in enumerate(order)]
    assert mixed == alone
    for index, constraint in enumerate(order):
        if constraint is not None:
            kind, value = constraint
            assert valid(kind, value, default_tokenizer.decode(mixed[index])), (kind, mixed[index])
