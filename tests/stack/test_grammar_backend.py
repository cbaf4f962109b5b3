"""The verifier's grammar backend (verifier_svc/grammar/): compilation, cache, masks, drafts.

Runs on the default model's tokenizer (SmolLM2, 49k tokens; tests/stack/test_model.py fetches it the
same way) and, for decode loops, a tiny random Llama over that vocabulary with padding ids.
"""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from specdec.errors import InvalidRequestError
from tests.support.grammar_decode import PADDED_VOCAB, make_padded_tiny_model, masked_decode
from verifier_svc.grammar import GrammarBackend, apply_masks, bitmask_to_bool

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 9},
                   "minItems": 1, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                   "zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "scores", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def backend(default_tokenizer) -> GrammarBackend:
    return GrammarBackend(default_tokenizer, PADDED_VOCAB)


@pytest.fixture(scope="module")
def tiny_model(default_tokenizer) -> LlamaForCausalLM:
    return make_padded_tiny_model(default_tokenizer.eos_token_id)


def allowed(mask: torch.Tensor, row: int, token_id: int) -> bool:
    return bool(bitmask_to_bool(mask[row:row + 1], PADDED_VOCAB)[0, token_id])


def encode(default_tokenizer, text: str) -> list[int]:
    return default_tokenizer.encode(text, add_special_tokens=False)


# -- compilation and cache -------------------------------------------------------------------

@pytest.mark.parametrize("kind, value", [
    ("json_object", ""),
    ("json_schema", json.dumps(NESTED_SCHEMA)),
    ("regex", r"[a-z]{2}-[0-9]+"),
    ("choice", json.dumps(["yes", "no", "maybe"])),
    ("grammar", 'start: "(" NUM ")"\nNUM: /[0-9]+/\n'),
    ("grammar", 'root ::= "yes" | "no"\n'),  # GBNF, converted to Lark
])
def test_every_kind_compiles(backend: GrammarBackend, kind: str, value: str) -> None:
    compiled = backend.compile(kind, value)
    assert compiled.kind == kind and compiled.grammar
    assert not backend.new_state(compiled).is_accepting()


@pytest.mark.parametrize("kind, value, why", [
    ("json_schema", '{"type": "foo"}', "foo"),
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}', "minimum"),
    ("json_schema", '{"type": "string", "pattern": "(["}', "regex"),
    ("json_schema", "{not json", "JSON"),
    ("json_schema", "[1, 2]", "object"),
    ("regex", "a{3,1}", "repetition"),
    ("choice", "[]", "non-empty"),
    ("grammar", "start: missing_rule", "missing_rule"),
    ("nonsense", "x", "unknown grammar kind"),
])
def test_bad_constraint_is_invalid_request_naming_the_field(backend: GrammarBackend, kind: str,
                                                           value: str, why: str) -> None:
    for _ in range(2):  # the second answer comes from the cache, with this caller's field
        with pytest.raises(InvalidRequestError) as caught:
            backend.compile(kind, value, param="response_format.json_schema.schema")
        assert caught.value.param == "response_format.json_schema.schema"
        assert why.lower() in caught.value.message.lower()


def test_cache_hit(default_tokenizer) -> None:
    backend = GrammarBackend(default_tokenizer, PADDED_VOCAB, cache_size=2)
    first = backend.compile("regex", "[0-9]+")
    assert backend.compile("regex", "[0-9]+") is first
    assert backend.cache_info() == {"hits": 1, "misses": 1, "size": 1}
    backend.compile("regex", "a+")
    backend.compile("regex", "b+")  # evicts the least recently used, "[0-9]+"
    assert backend.compile("regex", "[0-9]+") is not first
    assert backend.cache_info()["size"] == 2


def test_compile_async_and_concurrent_threads(backend: GrammarBackend) -> None:
    values = [json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                          "required": [f"k{i}"]}) for i in range(24)]
    results: dict[int, object] = {}

    def work(index: int) -> None:
        results[index] = backend.compile("json_schema", values[index % len(values)])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(48)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 48
    for index, compiled in results.items():  # one compiled object per distinct schema
        assert compiled is results[index % len(values)]
        state = backend.new_state(compiled)
        assert state.forced_tokens(8), "a fixed first key is forced"

    async def many() -> list:
        return await asyncio.gather(*(backend.compile_async("regex", f"x{i}[0-9]+") for i in range(16)))

    compiled_async = asyncio.run(many())
    assert [c.value for c in compiled_async] == [f"x{i}[0-9]+" for i in range(16)]


# -- masks -----------------------------------------------------------------------------------

def test_json_object_allows_brace_first_not_a(backend: GrammarBackend, default_tokenizer) -> None:
    state = backend.new_state(backend.compile("json_object", ""))
    mask = state.fill_masks([])
    assert allowed(mask, 0, encode(default_tokenizer, "{")[0])
    assert not allowed(mask, 0, encode(default_tokenizer, "a")[0])
    assert not allowed(mask, 0, default_tokenizer.eos_token_id)
    assert not bitmask_to_bool(mask, PADDED_VOCAB)[0, 49152:].any(), "padding ids are never allowed"


def test_apply_masks_sets_minus_inf_outside(backend: GrammarBackend, default_tokenizer) -> None:
    state = backend.new_state(backend.compile("choice", '["yes", "no"]'))
    logits = torch.zeros(1, PADDED_VOCAB)
    apply_masks(logits, state.fill_masks([]))
    finite = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert finite and all(any(word.startswith(default_tokenizer.decode([t])) for word in ("yes", "no"))
                          for t in finite)
    assert torch.isinf(logits[0, encode(default_tokenizer, "maybe")[0]])


def test_valid_prefix_len_cuts_at_first_rejected_token(backend: GrammarBackend, default_tokenizer) -> None:
    state = backend.new_state(backend.compile("json_schema", json.dumps(NESTED_SCHEMA)))
    good = encode(default_tokenizer, '{"name": "Al", "age": 3')
    bad = encode(default_tokenizer, "x")
    assert state.valid_prefix_len(good) == len(good)
    assert state.valid_prefix_len(good + bad + good) == len(good)  # "x" after the age's digit
    assert state.valid_prefix_len(good[:1] + bad + good[1:]) == 1  # "x" as the first key
    assert state.valid_prefix_len(good[:3] + [49160]) == 3  # a padding id
    assert state.valid_prefix_len(good + [default_tokenizer.eos_token_id]) == len(good)  # not complete
    assert state.num_accepted == 0 and state.fill_masks([]).equal(
        backend.new_state(backend.compile("json_schema", json.dumps(NESTED_SCHEMA))).fill_masks([]))


def test_fill_masks_rows_follow_the_drafts(backend: GrammarBackend, default_tokenizer) -> None:
    state = backend.new_state(backend.compile("json_schema", json.dumps(NESTED_SCHEMA)))
    draft = encode(default_tokenizer, '{"name": "Al')
    masks = state.fill_masks(draft)
    assert masks.shape[0] == len(draft) + 1
    for row, token in enumerate(draft):
        assert allowed(masks, row, token)
    # The same rows, one accepted token at a time.
    for row, token in enumerate(draft):
        assert state.fill_masks([]).equal(masks[row:row + 1])
        assert state.accept(token)
    assert state.fill_masks([]).equal(masks[-1:])


def test_rollback_after_partial_acceptance_restores_the_mask(backend: GrammarBackend, default_tokenizer) -> None:
    state = backend.new_state(backend.compile("json_schema", json.dumps(NESTED_SCHEMA)))
    prefix = encode(default_tokenizer, '{"name": "Al", "age": ')
    assert state.accept_tokens(prefix) == len(prefix)
    before = state.fill_masks([]).clone()
    draft = encode(default_tokenizer, "12, \"role")
    accepted_drafts = 2
    assert state.accept_tokens(draft) == len(draft)  # the verifier advances through all drafts
    state.rollback(len(draft) - accepted_drafts)  # the target accepted the first two
    expected = backend.new_state(backend.compile("json_schema", json.dumps(NESTED_SCHEMA)))
    expected.accept_tokens(prefix + draft[:accepted_drafts])
    assert state.fill_masks([]).equal(expected.fill_masks([]))
    state.rollback(accepted_drafts)
    assert state.fill_masks([]).equal(before)
    with pytest.raises(ValueError):
        state.rollback(state.num_accepted + 1)


def test_forced_tokens_of_a_fixed_key_are_each_the_only_allowed(backend: GrammarBackend, default_tokenizer) -> None:
    schema = {"type": "object", "properties": {"temperature": {"type": "integer"}},
              "required": ["temperature"], "additionalProperties": False}
    state = backend.new_state(backend.compile("json_schema", json.dumps(schema)))
    forced = state.forced_tokens(32)
    # The space after the colon is not forced as a token: " 1", " -" ... also start with it.
    assert default_tokenizer.decode(forced) == '{"temperature":'
    assert forced == encode(default_tokenizer, '{"temperature": 21}')[:len(forced)]
    masks = state.fill_masks(forced)
    for row, token in enumerate(forced):
        only = bitmask_to_bool(masks[row:row + 1], PADDED_VOCAB)[0].nonzero().flatten().tolist()
        assert only == [token]
    assert state.num_accepted == 0
    assert state.forced_tokens(2) == forced[:2]


def test_terminated_state_allows_only_eos(backend: GrammarBackend, default_tokenizer) -> None:
    state = backend.new_state(backend.compile("choice", '["yes", "no"]'))
    assert state.accept_tokens(encode(default_tokenizer, "no")) == len(encode(default_tokenizer, "no"))
    assert state.is_accepting()
    only = bitmask_to_bool(state.fill_masks([]), PADDED_VOCAB)[0].nonzero().flatten().tolist()
    assert only == [default_tokenizer.eos_token_id]
    assert state.forced_tokens(4) == []
    assert state.accept(default_tokenizer.eos_token_id)
    assert not state.accept(default_tokenizer.eos_token_id)
    state.rollback(1)  # a rolled-back EOS leaves the state as before it
    assert not state.accept(encode(default_tokenizer, "x")[0])
    assert state.accept(default_tokenizer.eos_token_id)


# -- decoding a tiny random model under the grammar -----------------------------------------

def _check_nested(answer: dict) -> None:
    assert set(answer) == {"name", "age", "role", "scores", "address"}
    assert isinstance(answer["name"], str) and len(answer["name"]) <= 6
    assert isinstance(answer["age"], int) and 0 <= answer["age"] <= 120
    assert answer["role"] in ("admin", "user", "guest")
    assert 1 <= len(answer["scores"]) <= 3 and all(isinstance(s, int) and -5 <= s <= 9 for s in answer["scores"])
    assert answer["address"]["city"] in ("Paris", "Oslo")
    assert len(answer["address"]["zip"]) == 3 and answer["address"]["zip"].isdigit()


def test_masked_decode_satisfies_a_nested_schema(backend: GrammarBackend, tiny_model, default_tokenizer) -> None:
    text = masked_decode(backend, tiny_model, default_tokenizer, "json_schema", json.dumps(NESTED_SCHEMA))
    _check_nested(json.loads(text))
    for seed in range(3):
        sampled = masked_decode(backend, tiny_model, default_tokenizer, "json_schema", json.dumps(NESTED_SCHEMA),
                                sample_seed=seed)
        _check_nested(json.loads(sampled))


def test_masked_decode_regex_choice_object(backend: GrammarBackend, tiny_model, default_tokenizer) -> None:
    import re

    tokenizer = default_tokenizer
    pattern = r"[a-z]{2}-[0-9]{1,3}"
    assert re.fullmatch(pattern, masked_decode(backend, tiny_model, tokenizer, "regex", pattern))
    choice = masked_decode(backend, tiny_model, tokenizer, "choice", '["red", "green", "blue"]')
    assert choice in ("red", "green", "blue")
    grammar = 'start: "(" NUM ("," NUM)? ")"\nNUM: /[0-9]{1,2}/\n'
    assert re.fullmatch(r"\(\d{1,2}(,\d{1,2})?\)", masked_decode(backend, tiny_model, tokenizer, "grammar", grammar))
    value = json.loads(masked_decode(backend, tiny_model, tokenizer, "json_schema", json.dumps(
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
         "additionalProperties": False})))
    assert isinstance(value["ok"], bool)


def test_unmasked_decode_would_not_parse(tiny_model) -> None:
    """The model above picks padding ids unmasked: the masks are what makes outputs valid."""
    with torch.no_grad():
        logits = tiny_model(torch.tensor([[1, 2, 3]])).logits[0, -1]
    assert int(logits.argmax()) >= 49152


def test_backend_refuses_a_model_vocab_smaller_than_the_tokenizer(default_tokenizer) -> None:
    with pytest.raises(ValueError):
        GrammarBackend(default_tokenizer, 1000)


def test_drafts_with_eos(backend: GrammarBackend, default_tokenizer) -> None:
    state = backend.new_state(backend.compile("choice", '["yes", "no"]'))
    eos = default_tokenizer.eos_token_id
    word = encode(default_tokenizer, "no")
    x = encode(default_tokenizer, "x")
    assert state.valid_prefix_len(word + [eos] + x) == len(word) + 1  # nothing after EOS
    assert state.valid_prefix_len([eos]) == 0  # not satisfied yet
    masks = state.fill_masks(word + [eos] + x)
    rows = bitmask_to_bool(masks, PADDED_VOCAB)
    assert rows[len(word), eos] and rows[len(word)].sum() == 1
    # Rows after a drafted EOS allow EOS alone (finite logits, never used).
    assert rows[len(word) + 1:].sum(dim=1).tolist() == [1, 1]
    assert rows[len(word) + 1:, eos].all()
    assert state.num_accepted == 0


@pytest.mark.parametrize("vocab, words", [(49152, 1536), (49160, 1537), (49216, 1536), (70, 2), (96, 3)])
@pytest.mark.parametrize("pattern", ["random", "sparse", "dense", "sparse and dense rows"])
def test_apply_masks_paths_agree(vocab: int, words: int, pattern: str) -> None:
    """The word-at-a-time CPU path, the bit path (bf16) and a bool mask give one answer:
    -inf exactly where the bit is 0 or the column is past the bitmask."""
    generator = torch.Generator().manual_seed(vocab + words)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), dtype=torch.int64, generator=generator).to(torch.int32)
    if pattern == "sparse":
        bitmask[:, 2:] = 0
    elif pattern == "dense":
        bitmask[:] = -1
        bitmask[:, 1] = 5
    elif pattern == "sparse and dense rows":
        bitmask[:2, 2:] = 0
        bitmask[2:] = -1
        bitmask[2:, 1] = 5
        bitmask[3, -1] = 0
    logits = torch.randn(5, vocab, generator=generator)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    bits = np.pad(bits, ((0, 0), (0, max(0, vocab - bits.shape[1]))))[:, :vocab]
    expected = logits.masked_fill(torch.from_numpy(bits) == 0, float("-inf"))
    assert torch.equal(apply_masks(logits.clone(), bitmask), expected)
    assert torch.equal(apply_masks(logits.clone().bfloat16(), bitmask), expected.bfloat16())
    assert torch.equal(apply_masks(logits.clone(), bitmask_to_bool(bitmask, vocab)), expected)
    # Rows past the mask's rows are left alone.
    assert torch.equal(apply_masks(logits.clone(), bitmask[:2])[2:], logits[2:])
