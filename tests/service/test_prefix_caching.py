"""Automatic prefix caching (issue #30, item 4).

The block manager's accounting on its own (hits, misses, eviction order, reference
counts), then the engine: a request reusing another's blocks gives the greedy output it
gives with caching off, a cached block is never written again, eviction under pressure,
one prefill for requests arriving together with one prompt, and no leaked or double-freed
block after a few hundred mixed requests with speculation, cancellations and preemption.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from specdec.engine.block_manager import BlockManager, block_hash, extend_block_hashes
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import Sequence
from tests.support.engine_harness import generate, ngram_engine
from tests.support.tiny_models import make_tiny_llama
from specdec.engine.step_record import StepRecord
from verifier_svc.requests import collect_outputs

BLOCK = 4


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), token_ids=list(tokens),
                    prompt_len=len(tokens), params=SamplingParams(), max_speculative_tokens=0)


def run_prefill(manager: BlockManager, seq: Sequence) -> int:
    """Admits `seq` as the scheduler does and marks its whole prompt but the last token
    computed; returns its cache hits in tokens."""
    hits = manager.lookup(seq)
    cached = manager.take_prefix(seq, hits)
    manager.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens - 1
    manager.cache_full_blocks(seq)
    return cached


def test_hit_and_miss_accounting() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    first = make_seq(0, list(range(10)))  # blocks [0-3] [4-7] full, [8-9] partial
    assert run_prefill(manager, first) == 0
    assert manager.num_cached_blocks == 2
    manager.free(first)
    second = make_seq(1, list(range(9)) + [99])  # shares 9 tokens: two full blocks
    assert run_prefill(manager, second) == 8
    assert second.block_table[:2] == first.block_table[:2] or manager.num_cached_blocks == 2
    assert (manager.num_queried_tokens, manager.num_hit_tokens) == (20, 8)
    third = make_seq(2, [1] + list(range(1, 10)))  # differs in the first token: no hit
    assert run_prefill(manager, third) == 0
    manager.check_consistency([second, third])


def test_the_last_token_is_never_a_hit() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    first = make_seq(0, list(range(9)))
    run_prefill(manager, first)
    manager.free(first)
    # Exactly two full blocks: the second holds the last token, whose forward must run.
    same = make_seq(1, list(range(8)))
    assert run_prefill(manager, same) == 4
    assert same.num_computed_tokens == 7


def test_blocks_are_shared_and_reference_counted() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    first = make_seq(0, list(range(10)))
    run_prefill(manager, first)
    second = make_seq(1, list(range(10)))
    assert run_prefill(manager, second) == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert [manager.ref_count(b) for b in first.block_table[:2]] == [2, 2]
    shared = first.block_table[0]
    manager.free(first)
    assert [manager.ref_count(b) for b in second.block_table[:2]] == [1, 1]
    assert all(b not in manager._free for b in second.block_table)  # held, not free
    manager.check_consistency([second])
    manager.free(second)
    manager.check_consistency([])
    assert manager.num_free_blocks == 16
    with pytest.raises(AssertionError, match="freed twice"):
        manager._release(shared)


def test_only_computed_blocks_are_cached_and_duplicates_are_not() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    seq = make_seq(0, list(range(12)))
    manager.allocate(seq, 12)
    seq.num_computed_tokens = 5  # one full block computed, the rest still to run
    manager.cache_full_blocks(seq)
    assert manager.num_cached_blocks == 1
    twin = make_seq(1, list(range(12)))
    manager.allocate(twin, 12)  # computed apart (no lookup): same content, other blocks
    twin.num_computed_tokens = 12
    manager.cache_full_blocks(twin)
    # Block 0's content is cached already (seq's); twin's blocks 1 and 2 are new.
    assert manager.num_cached_blocks == 3
    assert not manager.is_cached(twin.block_table[0])
    manager.check_consistency([seq, twin])


def test_drafts_computed_past_a_stop_register_only_the_kept_blocks() -> None:
    """A step verified drafts past the request's end (the engine counts them computed, then
    appends tokens only up to the stop): only blocks full of kept tokens are cached."""
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    seq = make_seq(0, list(range(6)))
    manager.allocate(seq, 6 + 8)  # the last token and 7 drafts: 14 slots, 4 blocks
    seq.num_computed_tokens = 6 + 7  # all accepted ...
    seq.token_ids.append(100)  # ... but the first new token stopped the request: 7 kept
    manager.cache_full_blocks(seq)  # raised IndexError: 3 full blocks computed, 1 kept
    assert manager.num_cached_blocks == 1
    assert manager.is_cached(seq.block_table[0]) and not manager.is_cached(seq.block_table[1])
    manager.check_consistency([seq])


def test_eviction_takes_uncached_blocks_first_then_the_least_recently_freed() -> None:
    manager = BlockManager(6, BLOCK, enable_prefix_caching=True)
    old = make_seq(0, list(range(9)))        # 2 full blocks cached, 1 partial
    run_prefill(manager, old)
    old_blocks = list(old.block_table)
    manager.free(old)
    new = make_seq(1, list(range(100, 109)))  # 2 more cached
    run_prefill(manager, new)
    new_blocks = list(new.block_table)
    manager.free(new)
    assert manager.num_cached_blocks == 4 and manager.num_free_blocks == 6
    hungry = make_seq(2, list(range(200, 212)))
    manager.allocate(hungry, 12)  # 3 blocks: the 2 uncached ones, then 1 cached
    assert manager.num_evicted_blocks == 1 and manager.num_cached_blocks == 3
    # The least recently freed request (old) loses a block, and its tail block first (a
    # request's blocks are freed last-first), so its first block still hits.
    assert manager.lookup(make_seq(3, list(range(9)))) == old_blocks[:1]
    assert manager.lookup(make_seq(4, list(range(100, 109)))) == new_blocks[:2]
    manager.check_consistency([hungry])


def test_hash_chain_depends_on_the_whole_prefix() -> None:
    a = block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    b = block_hash(block_hash(None, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert a != b and len(a) == 32


def test_different_cache_salts_never_share_a_block() -> None:
    manager = BlockManager(32, BLOCK, enable_prefix_caching=True)
    tokens = list(range(13))
    alice = make_seq(0, tokens)
    alice.cache_salt = "tenant-a"
    assert run_prefill(manager, alice) == 0
    manager.free(alice)
    for seq_id, salt in enumerate(["tenant-b", ""], start=1):  # another salt, or none
        other = make_seq(seq_id, tokens)
        other.cache_salt = salt
        assert run_prefill(manager, other) == 0
        assert not set(other.block_table) & set(alice.block_table)
        manager.free(other)
    again = make_seq(3, tokens)
    again.cache_salt = "tenant-a"
    assert run_prefill(manager, again) == 12  # the same salt still hits
    manager.check_consistency([again])
    # Every block's hash differs, not only the first one's.
    salted = make_seq(4, tokens)
    salted.cache_salt = "x"
    plain = make_seq(5, tokens)
    salted_hashes = extend_block_hashes(salted, BLOCK)
    plain_hashes = extend_block_hashes(plain, BLOCK)
    assert len(salted_hashes) == 3
    assert all(a != b for a, b in zip(salted_hashes, plain_hashes))


def test_caching_off_never_hits() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=False)
    first = make_seq(0, list(range(10)))
    run_prefill(manager, first)
    manager.free(first)
    assert run_prefill(manager, make_seq(1, list(range(10)))) == 0
    assert manager.num_cached_blocks == 0 and manager.num_queried_tokens == 0


# ------------------------------------------------------------------ the engine

SYSTEM = [7, 3, 9, 12, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47]
TAILS = [[5, 6, 7, 5, 6], [10, 11, 12, 10, 11, 12], [50, 51, 50], [60, 61, 62, 63, 60, 61]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-prefix"))


def greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def sequential_outputs(model: Path, device: str, caching: bool, **overrides: object
                             ) -> tuple[list[list[int]], list[int]]:
    async with ngram_engine(model, device, k=3, enable_prefix_caching=caching,
                            **overrides) as engine:
        outputs, cached = [], []
        for tail in TAILS + TAILS:
            _, queue = engine.add_request("r", SYSTEM + tail, greedy())
            tokens = []
            while True:
                output = await queue.get()
                tokens += output.token_ids
                if output.finish_reason is not None:
                    cached.append(output.num_cached_tokens)
                    break
            outputs.append(tokens)
        engine.scheduler.block_manager.check_consistency([])
    return outputs, cached


async def test_reusing_cached_blocks_gives_the_uncached_greedy_output(tiny_model, device) -> None:
    uncached, no_hits = await sequential_outputs(tiny_model, str(device), caching=False)
    cached, hits = await sequential_outputs(tiny_model, str(device), caching=True)
    assert cached == uncached
    assert no_hits == [0] * len(no_hits)
    assert hits[0] == 0
    # Every later request finds the system prompt's full blocks; the repeats find more.
    assert all(hit >= len(SYSTEM) // BLOCK * BLOCK for hit in hits[1:])
    assert hits[len(TAILS):] > hits[:len(TAILS)]


async def test_eviction_under_pressure_keeps_outputs(tiny_model, device) -> None:
    # 24 blocks of 4 tokens: a few requests' worth, so cached blocks are evicted all along.
    uncached, _ = await sequential_outputs(tiny_model, str(device), caching=False,
                                           num_kv_blocks=24, max_model_len=64)
    async with ngram_engine(tiny_model, str(device), k=3, num_kv_blocks=24,
                            max_model_len=64) as engine:
        outputs = []
        for tail in TAILS + TAILS:
            outputs.append(await generate(engine, SYSTEM + tail, greedy()))
        manager = engine.scheduler.block_manager
        assert manager.num_evicted_blocks > 0
        manager.check_consistency([])
    assert outputs == uncached


async def test_a_cached_block_is_never_written_again(tiny_model, device) -> None:
    async with ngram_engine(tiny_model, str(device), k=3) as engine:
        await generate(engine, SYSTEM + TAILS[0], greedy())
        manager = engine.scheduler.block_manager
        cached_ids = sorted(block for block in range(manager.num_blocks) if manager.is_cached(block))
        assert cached_ids
        kv = engine.runner.kv_cache
        before = [(k[cached_ids].clone(), v[cached_ids].clone())
                  for k, v in zip(kv.key_caches, kv.value_caches)]
        # Later requests share the prefix and speculate past it (drafts, rollbacks).
        await asyncio.gather(*(generate(engine, SYSTEM + tail, greedy(24)) for tail in TAILS))
        still_cached = [index for index, block in enumerate(cached_ids) if manager.is_cached(block)]
        assert still_cached
        for (k_before, v_before), k, v in zip(before, kv.key_caches, kv.value_caches):
            rows = [cached_ids[index] for index in still_cached]
            assert torch.equal(k[rows], k_before[still_cached])
            assert torch.equal(v[rows], v_before[still_cached])


async def test_requests_arriving_together_share_one_prefill(tiny_model, device) -> None:
    prompt = SYSTEM * 3 + TAILS[1]  # 72 tokens, 17 full blocks
    async with ngram_engine(tiny_model, str(device), k=3) as engine:
        prefill_tokens = 0

        def count(record: StepRecord) -> None:
            nonlocal prefill_tokens
            prefill_tokens += record.num_prefill_tokens

        engine.step_listener = count
        queues = [engine.add_request(f"choice-{i}", prompt, greedy())[1] for i in range(3)]
        results = [await collect_outputs(queue) for queue in queues]
    assert results[0][0] == results[1][0] == results[2][0]
    # One prefill, then each other request recomputes at most its last partial block.
    assert prefill_tokens <= len(prompt) + 2 * (len(prompt) % BLOCK or BLOCK)


async def test_no_block_leaks_after_mixed_requests(tiny_model, device) -> None:
    """A few hundred requests: shared and distinct prefixes, speculation, cancellations at
    random points, and a pool small enough to preempt; every block comes back once."""
    rng = random.Random(1)
    async with ngram_engine(tiny_model, str(device), k=3, num_kv_blocks=40,
                            max_model_len=80, max_num_seqs=6) as engine:
        manager = engine.scheduler.block_manager

        async def one(index: int) -> None:
            prompt = (SYSTEM if rng.random() < 0.7 else [rng.randrange(48, 90) for _ in range(20)])
            prompt = prompt + rng.choice(TAILS)
            params = (greedy(rng.randrange(4, 24)) if rng.random() < 0.5 else
                      SamplingParams(temperature=0.8, max_tokens=rng.randrange(4, 24),
                                     ignore_eos=True, seed=index))
            seq_id, queue = engine.add_request(f"mixed-{index}", prompt, params)
            if rng.random() < 0.25:
                for _ in range(rng.randrange(0, 4)):
                    await asyncio.sleep(0)
                    await asyncio.sleep(0.001)
                engine.abort(seq_id)
                return
            await collect_outputs(queue)

        for start in range(0, 240, 12):
            await asyncio.gather(*(one(index) for index in range(start, start + 12)))
        assert engine.num_requests == 0
        assert engine.scheduler.num_preemptions > 0
        assert manager.num_hit_tokens > 0
        manager.check_consistency([])
        assert manager.num_free_blocks == manager.num_blocks
