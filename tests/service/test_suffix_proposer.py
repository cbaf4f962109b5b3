"""`"method": "suffix"`: its config, the per-stream method with the server's global tree,
and greedy invariance plus cross-request drafting through a real drafter and verifier."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from drafter_svc.proposer import ModelOptions
from drafter_svc.proposer_factory import proposer_factory
from drafter_svc.server import start_drafter_server, stop_drafter_server
from drafter_svc.suffix_proposer import LEAD_IN_MIN_PROB, SuffixMethod
from specdec.config import SpeculativeConfig
from specdec.config_flags import build_config
from specdec.engine.sampling_params import SamplingParams
from specdec.errors import ConfigError
from tests.support.engine_harness import generate
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.builder import VerifierConfig, build_engine
from specdec.engine.engine import Engine


def suffix(**fields: object) -> SpeculativeConfig:
    config = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 8, **fields})
    assert config is not None
    return config


# --- config --------------------------------------------------------------------------------
def test_defaults_are_vllms_and_survive_to_json() -> None:
    config = SpeculativeConfig.parse('{"method": "suffix"}')
    assert config is not None
    assert (config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob) == \
        (24, 10000, 1.0, 0.1)
    assert config.suffix_decoding_max_cached_tokens == 1_000_000
    assert config.num_speculative_tokens == 24  # vLLM: the tree depth when not given
    assert SpeculativeConfig.parse(config.to_json()) == config
    given = suffix(suffix_decoding_max_tree_depth=8, suffix_decoding_max_cached_requests=0,
                   suffix_decoding_max_spec_factor=2, suffix_decoding_min_token_prob=0.5)
    assert SpeculativeConfig.parse(given.to_json()) == given
    assert given.suffix_decoding_max_spec_factor == 2.0


@pytest.mark.parametrize("raw, param", [
    ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
    ({"suffix_decoding_max_tree_depth": 2.5}, "suffix_decoding_max_tree_depth"),
    ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
    ({"suffix_decoding_max_cached_tokens": -1}, "suffix_decoding_max_cached_tokens"),
    ({"suffix_decoding_max_cached_tokens": "many"}, "suffix_decoding_max_cached_tokens"),
    ({"suffix_decoding_max_spec_factor": -0.5}, "suffix_decoding_max_spec_factor"),
    ({"suffix_decoding_max_spec_factor": "1"}, "suffix_decoding_max_spec_factor"),
    ({"suffix_decoding_max_spec_factor": float("inf")}, "suffix_decoding_max_spec_factor"),
    ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
    ({"suffix_decoding_min_token_prob": True}, "suffix_decoding_min_token_prob"),
    ({"prompt_lookup_min": 2}, "prompt_lookup_min"),
    ({"model": "some/draft"}, "model"),
])
def test_invalid_suffix_fields_are_refused_naming_the_field(raw, param) -> None:
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 4, **raw})
    assert info.value.param == param


@pytest.mark.parametrize("method, extra", [("ngram", {}), ("draft_model", {"model": "m"})])
def test_other_methods_refuse_suffix_fields(method, extra) -> None:
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 4, **extra,
                                 "suffix_decoding_min_token_prob": 0.2})
    assert info.value.param == "suffix_decoding_min_token_prob"


# --- the method ----------------------------------------------------------------------------
def start(method: SuffixMethod, seq_id: int, prompt: list[int]) -> None:
    method.add_sequence(seq_id)
    method.append_tokens(seq_id, prompt, None)


def draft(method: SuffixMethod, seq_id: int, k: int = 8) -> list[int]:
    return method.propose([seq_id], [k])[0].draft_token_ids


def test_drafts_from_the_request_itself() -> None:
    method = proposer_factory(suffix())()
    assert isinstance(method, SuffixMethod)
    start(method, 1, [10, 11, 12, 13, 14, 15, 16, 40, 41, 10, 11, 12, 13])
    # "10 11 12 13" matched (4 tokens): up to 4 * 1.0 tokens of what followed.
    assert draft(method, 1) == [14, 15, 16, 40]
    assert method.propose([1], [2])[0].draft_token_ids == [14, 15]
    assert method.propose([1], [2])[0].draft_probs is None  # greedy


def test_drafts_never_enter_the_state_so_rollback_is_safe() -> None:
    method = proposer_factory(suffix())()
    start(method, 1, [1, 2, 3, 4, 1, 2])
    assert draft(method, 1) == [3, 4]
    method.rollback(1, 0)
    # The target chose 9: only verified tokens are held, the next draft follows them.
    method.append_tokens(1, [9], None)
    assert method.context_len(1) == 7
    method.append_tokens(1, [1, 2], None)
    # "1 2" went on with 3 and with 9 once each (and ends the context once): the first seen
    # wins the tie, p = 1/3 per token. Had the draft [3, 4] been held, "1 2 3 4" would count 2.
    assert draft(method, 1) == [3, 4]
    assert method._trees[1].count(method._trees[1].match([1, 2, 3, 4])[-1]) == 1


def test_a_finished_output_is_drafted_from_by_later_requests_on_other_streams() -> None:
    make = proposer_factory(suffix())
    first, second = make(), make()
    output = [70, 71, 72, 73, 74, 75, 76, 77]
    start(first, 1, [1, 2, 3])
    first.append_tokens(1, output, None)
    start(second, 5, [4, 5, 6])
    second.append_tokens(5, [70, 71, 72], None)
    assert draft(second, 5) == []  # the first is still running: not yet a source
    first.remove_sequence(1)  # finished
    assert draft(second, 5) == [73, 74, 75]
    second.append_tokens(5, [73, 74, 75], None)
    assert draft(second, 5) == [76, 77]
    # A later request whose answer starts alike drafts from it at once.
    start(second, 6, [9, 1, 2, 3])
    second.append_tokens(6, [70], None)
    assert draft(second, 6) == [71]


@pytest.mark.parametrize("publish", ["finished", "learnt"])
def test_an_output_is_held_behind_the_last_tokens_of_its_prompt(publish) -> None:
    method = proposer_factory(suffix(num_speculative_tokens=4))()
    assert isinstance(method, SuffixMethod) and method.params.lead_in == 4

    def publish_output(seq_id: int, prompt: list[int], output: list[int]) -> None:
        if publish == "finished":  # a stream whose verifier sends no finished outputs
            start(method, seq_id, prompt)
            method.append_tokens(seq_id, output, None)
            method.remove_sequence(seq_id)
        else:
            method.learn(seq_id, prompt, output)

    # Three answers behind one prompt ending, three others behind another; all start alike.
    for seq_id in range(3):
        publish_output(seq_id, [40, 41, 42, 43, 44, 45, 46, 47], [70, 71, 72, 73, 74, 75])
        publish_output(10 + seq_id, [50, 51, 52, 53], [70, 81, 82, 83])
    # A new prompt ending in the lead-in drafts the answers that followed it before its own
    # answer starts: p = 3/4 (its own occurrence counts, and does not go on), k tokens.
    start(method, 20, [9, 44, 45, 46, 47])
    assert draft(method, 20, 4) == [70, 71, 72, 73]
    # On "70" alone the two kinds of answer tie; the lead-in picks the one this prompt's end
    # was followed by.
    start(method, 21, [9, 50, 51, 52, 53])
    method.append_tokens(21, [70], None)
    assert draft(method, 21, 4) == [81, 82, 83]
    start(method, 22, [9, 40, 41, 42])  # the prompt before its lead-in is not held
    assert draft(method, 22, 4) == []


def test_a_lead_in_draft_must_stay_likely() -> None:
    """One earlier answer behind a prompt ending is p = 1/2 (the new prompt's own occurrence
    counts): under LEAD_IN_MIN_PROB, so no draft from the lead-in; a chat template's header,
    the same before every answer, would otherwise draft the commonest answer's start."""
    method = proposer_factory(suffix(num_speculative_tokens=4))()
    assert isinstance(method, SuffixMethod) and LEAD_IN_MIN_PROB > 0.5
    method.learn(1, [40, 41, 42, 43], [70, 71, 72, 73])
    start(method, 2, [9, 40, 41, 42, 43])
    assert draft(method, 2, 4) == []
    method.learn(3, [40, 41, 42, 43], [70, 71, 72, 73])  # two of three: p = 2/3
    start(method, 4, [9, 40, 41, 42, 43])
    assert draft(method, 4, 4) == []
    method.learn(5, [40, 41, 42, 43], [70, 71, 72, 73])  # p = 3/4
    start(method, 6, [9, 40, 41, 42, 43])
    assert draft(method, 6, 4) == [70, 71, 72, 73]


@pytest.mark.parametrize("fields, lead_in", [
    ({}, 8),
    ({"suffix_decoding_max_spec_factor": 0.5}, 16),
    ({"suffix_decoding_max_spec_factor": 3.0}, 3),
    ({"suffix_decoding_max_spec_factor": 0.25}, 24),  # at most the tree depth
    ({"suffix_decoding_max_spec_factor": 0.0}, 0),
])
def test_the_lead_in_is_what_a_full_draft_needs_as_its_match(fields, lead_in) -> None:
    method = proposer_factory(suffix(**fields))()
    assert isinstance(method, SuffixMethod) and method.params.lead_in == lead_in


def test_zero_cached_requests_disables_the_global_tree() -> None:
    make = proposer_factory(suffix(suffix_decoding_max_cached_requests=0))
    first, second = make(), make()
    start(first, 1, [1])
    first.append_tokens(1, [70, 71, 72, 73], None)
    first.remove_sequence(1)
    start(second, 2, [70, 71])
    assert draft(second, 2) == []


def test_the_oldest_output_is_evicted_first() -> None:
    method = proposer_factory(suffix(suffix_decoding_max_cached_requests=2))()
    for seq_id, output in enumerate(([80, 81, 82], [90, 91, 92], [60, 61, 62])):
        start(method, seq_id, [1])
        method.append_tokens(seq_id, output, None)
        method.remove_sequence(seq_id)
    start(method, 10, [80, 81])
    assert draft(method, 10) == []  # evicted
    start(method, 11, [90, 91])
    assert draft(method, 11) == [92]
    start(method, 12, [60, 61])
    assert draft(method, 12) == [62]


def test_the_global_cache_is_bounded_in_tokens_too() -> None:
    """Issue 44 item 6: outputs are dropped oldest first to stay within the token bound, and
    one longer than the bound on its own is never held."""
    method = proposer_factory(suffix(suffix_decoding_max_cached_tokens=50,
                                     suffix_decoding_max_tree_depth=4,
                                     num_speculative_tokens=4))()
    assert isinstance(method, SuffixMethod)
    cache = method.cache
    for output_id in range(5):
        cache.add([100 + output_id * 20 + i for i in range(20)], output_id)
        assert cache.num_tokens <= 50
    assert list(cache.outputs()) == [3, 4] and cache.num_tokens == 40
    cache.add(list(range(200, 260)), 9)  # 60 tokens: more than the whole bound
    assert list(cache.outputs()) == [3, 4] and cache.num_tokens == 40
    # What was evicted is gone from the trie, not only from the index.
    start(method, 1, [100, 101, 102])
    assert draft(method, 1) == []
    start(method, 2, [160, 161, 162])
    assert draft(method, 2)[:1] == [163]


def test_memory_stays_bounded_over_thousands_of_requests() -> None:
    rng = random.Random(0)
    config = suffix(suffix_decoding_max_cached_requests=50, suffix_decoding_max_tree_depth=8)
    method = proposer_factory(config)()
    assert isinstance(method, SuffixMethod)
    output_len = 40
    for seq_id in range(3000):
        start(method, seq_id, [rng.randrange(1000) for _ in range(10)])
        for _ in range(output_len // 8):
            method.append_tokens(seq_id, [rng.randrange(1000) for _ in range(8)], None)
            draft(method, seq_id)
        method.remove_sequence(seq_id)
    assert len(method.cache) == 50
    # Each cached output adds at most (lead-in + output_len) * depth nodes.
    assert method.cache.tree.num_nodes <= 50 * (method.params.lead_in + output_len) * 8
    assert not method._states and not method._trees


# --- through the real services -------------------------------------------------------------
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
    [30, 31, 32, 30, 31, 32, 33],
    [50, 60, 70, 80, 90, 50, 60, 70, 80, 90, 50, 60, 70, 80, 90, 51, 52, 53],
]
K = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("target"))


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def run_stack(target: Path, device: str, spec: dict | None,
                    batches: list[list[list[int]]]) -> tuple[list[list[list[int]]], list[int], Engine]:
    """Runs each batch of prompts concurrently, one batch after the other; returns the
    outputs and the accepted draft tokens counted after each batch."""
    config = SpeculativeConfig.parse(spec) if spec else None
    drafter = None
    targets: tuple[str, ...] = ()
    if config is not None:
        options = ModelOptions(target_model=str(target), device=device)
        drafter, port = await start_drafter_server(config, "127.0.0.1", 0, options=options)
        targets = (f"127.0.0.1:{port}",)
    engine, _ = build_engine(build_config(VerifierConfig,
        model=str(target), device=device, dtype="float32", max_model_len=128, block_size=4,
        num_kv_blocks=256, max_num_batched_tokens=16, speculative_config=config,
        drafter_targets=targets, draft_timeout_s=2.0, adaptive_speculation=False))
    await engine.start()
    outputs: list[list[list[int]]] = []
    accepted: list[int] = []
    try:
        if engine.drafter_pool is not None:
            assert await engine.drafter_pool.wait_for_healthy(1, timeout_s=3.0)
        for batch in batches:
            outputs.append(list(await asyncio.gather(*(generate(engine, p, greedy())
                                                       for p in batch))))
            accepted.append(engine.spec.num_accepted_tokens)
    finally:
        await engine.stop()
        if drafter is not None:
            await stop_drafter_server(drafter)
    return outputs, accepted, engine


async def test_greedy_output_equals_plain_decoding(target, device) -> None:
    plain, _, _ = await run_stack(target, str(device), None, [PROMPTS])
    spec = {"method": "suffix", "num_speculative_tokens": K}
    outputs, _, engine = await run_stack(target, str(device), spec, [PROMPTS, PROMPTS])
    assert outputs == [plain[0], plain[0]]
    assert engine.spec.num_draft_tokens > 0


@pytest.mark.parametrize("cached", [10000, 0])
async def test_a_finished_answer_is_a_draft_source_for_the_next_request(target, device,
                                                                        cached) -> None:
    """The same prompt twice, one after the other: the second drafts from the first's output
    through the global tree, which the per-request tree alone (cached = 0) cannot do."""
    prompt = [PROMPTS[0]]
    spec = {"method": "suffix", "num_speculative_tokens": K,
            "suffix_decoding_max_cached_requests": cached}
    outputs, accepted, _ = await run_stack(target, str(device), spec, [prompt, prompt])
    assert outputs[0] == outputs[1]
    first, second = accepted[0], accepted[1] - accepted[0]
    if cached:
        # All but the first few output tokens come from accepted drafts.
        assert second > first
        assert second >= len(outputs[0][0]) // 2
    else:
        assert second == first
