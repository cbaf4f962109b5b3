"""Suffix decoding shared across drafter replicas: the verifier's bounded log of finished
outputs, its broadcast to every replica, the catch-up of a replica that (re)connects, and
the drafter's side (bounds, no double counting), through real services on real ports."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import grpc
import pytest

from drafter_svc.proposer import ModelOptions
from drafter_svc.proposer_factory import proposer_factory
from drafter_svc.propose_request import handle_propose_request
from drafter_svc.servicer import DrafterServicer
from drafter_svc.suffix_proposer import GlobalSuffixCache, SuffixMethod
from specdec.config import SpeculativeConfig
from specdec.config_flags import build_config
from specdec.engine.sampling_params import SamplingParams
from specdec.errors import InvalidRequestError
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.engine_harness import generate
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.builder import VerifierConfig, build_engine
from verifier_svc.drafting.drafter_pool import DrafterPool
from verifier_svc.drafting.finished_outputs import PROMPT_TAIL_TOKENS, FinishedOutputLog
from specdec.engine.engine import Engine

K = 3
VOCAB_SIZE = 96  # the tiny model's
# A hang guard for waits on something that must happen on its own, far above any machine.
HANG_GUARD_S = 30.0


def suffix(**fields: object) -> SpeculativeConfig:
    config = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": K, **fields})
    assert config is not None
    return config


async def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


# --- the verifier's log ----------------------------------------------------------------------
def test_the_log_is_bounded_by_count_and_tokens_and_cursors_see_the_rest() -> None:
    log = FinishedOutputLog(max_outputs=3, max_tokens=1000)
    for seq_id in range(5):
        log.append(seq_id, [1] * 100, [seq_id + 10] * 5)
    assert len(log) == 3  # the count bound
    assert log.num_tokens == 3 * (PROMPT_TAIL_TOKENS + 5)  # only the prompt's tail is kept
    cursor = log.catch_up_cursor()  # a new replica gets what is left: seqs 2, 3, 4
    assert [[e.output[0] for e in m] for m in log.messages_after(cursor)] == [[12, 13, 14]]
    assert log.messages_after(log.head()) == []
    log = FinishedOutputLog(max_outputs=100, max_tokens=200)
    for seq_id in range(50):
        log.append(seq_id, [], [7] * 30)
    assert len(log) == 6 and log.num_tokens == 180  # the token bound
    log.append(99, [], [7] * 201)  # larger than the whole log: not kept
    assert len(log) == 6
    ids = {entry.output_id & 0xFFFFFFFF for m in log.messages_after(0) for entry in m}
    assert ids == set(range(44, 50))
    # Two logs (two verifiers, or one restarted) never give the same id to their seq 0.
    first, second = FinishedOutputLog(), FinishedOutputLog()
    first.append(0, [], [1])
    second.append(0, [], [1])
    assert first.messages_after(0)[0][0].output_id != second.messages_after(0)[0][0].output_id


def test_a_catch_up_goes_in_few_messages() -> None:
    log = FinishedOutputLog(max_outputs=100_000, max_tokens=1 << 22)
    for seq_id in range(20_000):
        log.append(seq_id, [], [5] * 40)
    normal = log.messages_after(0)
    catch_up = log.messages_after(0, max_messages=8)
    assert len(normal) > 17 >= len(catch_up)
    assert sum(map(len, catch_up)) == 20_000


# --- the drafter's side ----------------------------------------------------------------------
def finished(output_id: int, output: list[int], prompt: list[int] = ()) -> specdec_pb2.ProposeRequest:
    request = specdec_pb2.ProposeRequest(step_id=1)
    request.finished_outputs.add(seq_id=output_id, prompt_token_ids=list(prompt),
                                 output_token_ids=output)
    return request


def update(seq_id: int, tokens: list[int], context_len: int) -> specdec_pb2.ProposeRequest:
    request = specdec_pb2.ProposeRequest(step_id=2)
    request.sequences.add(seq_id=seq_id, new_token_ids=tokens, context_len=context_len,
                          num_speculative_tokens=K)
    return request


def drafts(response: specdec_pb2.ProposeResponse) -> dict[int, list[int]]:
    return {draft.seq_id: list(draft.draft_token_ids) for draft in response.drafts}


def test_a_finished_output_from_the_verifier_is_learned_once() -> None:
    make = proposer_factory(suffix())
    method = make()
    assert isinstance(method, SuffixMethod) and method.info.wants_finished_outputs
    assert not proposer_factory(suffix(suffix_decoding_max_cached_requests=0))() \
        .info.wants_finished_outputs
    output = [40, 41, 42, 43, 44]
    handle_propose_request(method, finished(7, output, prompt=[1, 2]))
    handle_propose_request(method, finished(7, output))  # replayed: already held
    assert len(method.cache) == 1
    assert method.cache.tree.count(method.cache.tree.match([40])[-1]) == 1
    # Another stream of the same server drafts from it.
    other = make()
    assert drafts(handle_propose_request(other, update(3, [9, 40, 41], 3))) == {3: [42, 43]}


def test_a_stream_told_of_finished_outputs_stops_publishing_its_own() -> None:
    """One path per output: the verifier's copy, not also the drafter's own at finish."""
    method = proposer_factory(suffix())()
    handle_propose_request(method, update(1, [9], 1))
    handle_propose_request(method, update(1, [50, 51, 52], 4))
    # The sequence finishes: its output arrives with its finished_seq_ids entry.
    request = finished(1, [50, 51, 52, 53])
    request.finished_seq_ids.append(1)
    handle_propose_request(method, request)
    assert len(method.cache) == 1
    assert method.cache.tree.count(method.cache.tree.match([50, 51])[-1]) == 1  # not 2
    # A stream that never got one publishes its finished sequences itself (as before).
    alone = proposer_factory(suffix())()
    handle_propose_request(alone, update(1, [9], 1))  # the prompt
    handle_propose_request(alone, update(1, [50, 51], 3))  # its output
    request = specdec_pb2.ProposeRequest(step_id=3, finished_seq_ids=[1])
    handle_propose_request(alone, request)
    assert len(alone.cache) == 1


def test_finished_outputs_are_bounds_checked() -> None:
    method = proposer_factory(suffix(), ModelOptions(max_model_len=16))()
    with pytest.raises(InvalidRequestError) as error:
        handle_propose_request(method, finished(1, [5, 1 << 31]))
    assert error.value.param == "finished_outputs"
    assert len(method.cache) == 0
    handle_propose_request(method, finished(2, list(range(10)), prompt=list(range(10))))
    assert len(method.cache) == 0  # longer than this drafter's max-model-len: skipped
    # An ngram drafter ignores them.
    ngram = proposer_factory(SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 2}))()
    assert not ngram.info.wants_finished_outputs
    handle_propose_request(ngram, finished(3, [1, 2, 3]))


# --- through the real services ---------------------------------------------------------------
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
    [30, 31, 32, 30, 31, 32, 33],
    [50, 60, 70, 80, 90, 50, 60, 70, 80, 90, 50, 60, 70, 80, 90, 51, 52, 53],
]


class Replica:
    """One suffix drafter on a real port, remembering which sequences it was sent."""

    def __init__(self, config: SpeculativeConfig, options: ModelOptions) -> None:
        self.config = config
        self.options = options
        self.port = 0
        self.seq_ids: set[int] = set()
        self.cache: GlobalSuffixCache | None = None
        self.server: grpc.aio.Server | None = None

    async def start(self) -> Replica:
        make = proposer_factory(self.config, self.options)
        template = make()
        assert isinstance(template, SuffixMethod)
        self.cache = template.cache
        replica = self

        class Recording(DrafterServicer):
            async def Propose(self, request_iterator, context):
                async def recorded():
                    async for request in request_iterator:
                        replica.seq_ids.update(update.seq_id for update in request.sequences)
                        yield request
                async for response in super().Propose(recorded(), context):
                    yield response

        self.server = grpc.aio.server()
        specdec_pb2_grpc.add_DrafterServicer_to_server(Recording(make, template.info), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("target"))


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def start_replicas(target: Path, device: str, count: int, **fields) -> list[Replica]:
    options = ModelOptions(target_model=str(target), device=device)
    return [await Replica(suffix(**fields), options).start() for _ in range(count)]


async def start_engine(target: Path, device: str, replicas: list[Replica] | None) -> Engine:
    config = suffix() if replicas else None
    engine, _ = build_engine(build_config(VerifierConfig,
        model=str(target), device=device, dtype="float32", max_model_len=128, block_size=4,
        num_kv_blocks=256, max_num_batched_tokens=16, speculative_config=config,
        drafter_targets=tuple(f"127.0.0.1:{r.port}" for r in replicas or ()),
        draft_timeout_s=5.0, adaptive_speculation=False))
    await engine.start()
    if replicas:
        assert engine.drafter_pool is not None
        assert await engine.drafter_pool.wait_for_healthy(len(replicas), timeout_s=HANG_GUARD_S)
    return engine


async def run_one(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    """The output and the draft tokens accepted for it."""
    before = engine.spec.num_accepted_tokens
    output = await generate(engine, prompt, greedy())
    return output, engine.spec.num_accepted_tokens - before


async def test_an_answer_finished_through_one_replica_is_a_draft_source_on_another(
        target, device) -> None:
    replicas = await start_replicas(target, str(device), 2)
    engine = await start_engine(target, str(device), replicas)
    try:
        first_output, first_accepted = await run_one(engine, PROMPTS[0])
        served, other = sorted(replicas, key=lambda r: 0 not in r.seq_ids)
        assert 0 in served.seq_ids and 0 not in other.seq_ids
        # The other replica learned it although it never drafted for it: all of it, up to
        # the last token (which no drafter is ever sent as context).
        await wait_until(lambda: len(other.cache) == 1, "the broadcast")
        assert list(other.cache.outputs().values()) == [first_output]
        await served.stop()  # the same prompt again can only go to the other replica
        await wait_until(lambda: engine.drafter_pool.num_healthy() == 1, "the replica to go")
        second_output, second_accepted = await run_one(engine, PROMPTS[0])
        assert second_output == first_output
        assert 1 in other.seq_ids and 1 not in served.seq_ids
        assert second_accepted > first_accepted
        assert second_accepted >= len(first_output) // 2
    finally:
        await engine.stop()
        for replica in replicas:
            await replica.stop()


async def test_a_restarted_replica_catches_up_from_the_verifiers_replay(target, device) -> None:
    replica, = await start_replicas(target, str(device), 1)
    engine = await start_engine(target, str(device), [replica])
    pool = engine.drafter_pool
    assert pool is not None
    try:
        outputs = [(await run_one(engine, prompt))[0] for prompt in PROMPTS]
        await replica.stop()
        await wait_until(lambda: pool.num_healthy() == 0, "the replica to go")
        await replica.start()  # same port, a fresh process state: an empty tree
        assert len(replica.cache) == 0
        await pool.wait_for_healthy(1, timeout_s=HANG_GUARD_S)
        await wait_until(lambda: not any(r.catching_up for r in pool.replicas),
                         "the catch-up")
        assert sorted(replica.cache.outputs().values()) == sorted(outputs)
        output, accepted = await run_one(engine, PROMPTS[1])
        assert output == outputs[1]
        assert accepted >= len(output) // 2  # drafted from the replayed answer
    finally:
        await engine.stop()
        await replica.stop()


async def test_memory_stays_bounded_after_thousands_of_finished_outputs(target, device) -> None:
    """The verifier's log and each drafter's tree stay under their bounds; a dead replica
    holds nothing."""
    depth, cached = 8, 50
    replicas = await start_replicas(target, str(device), 2, suffix_decoding_max_tree_depth=depth,
                                    suffix_decoding_max_cached_requests=cached)
    dead_port = replicas[1].port
    await replicas[1].stop()
    pool = DrafterPool([f"127.0.0.1:{replicas[0].port}", f"127.0.0.1:{dead_port}"],
                       vocab_size=VOCAB_SIZE, tokenizer_fingerprint="",
                       backoff_initial_s=0.05, backoff_max_s=0.2, replay_max_outputs=200,
                       replay_max_tokens=5000, finished_flush_delay_s=0.0)
    await pool.start()
    rng = random.Random(0)
    output_len = 40
    try:
        assert await pool.wait_for_healthy(1, timeout_s=HANG_GUARD_S)
        for seq_id in range(3000):
            pool.record_finished_output(seq_id, [rng.randrange(VOCAB_SIZE) for _ in range(100)],
                                        [rng.randrange(VOCAB_SIZE) for _ in range(output_len)])
            if seq_id % 100 == 99:
                await asyncio.sleep(0)  # lets the flush run now and then
            log = pool.sharing.log
            assert len(log) <= 200 and log.num_tokens <= 5000
        live = next(r for r in pool.replicas if r.healthy)
        # All sent: nothing waits for the dead replica.
        await wait_until(lambda: live.outputs_cursor == log.head(), "the flush")
        # The drafter has them once it holds the last one recorded.
        await wait_until(lambda: list(replicas[0].cache.outputs())[-1] & 0xFFFFFFFF == 2999,
                         "the last output")
        assert len(replicas[0].cache) == cached
        assert replicas[0].cache.tree.num_nodes <= cached * output_len * depth
    finally:
        await pool.close()
        await replicas[0].stop()


async def run_workload(target: Path, device: str, num_replicas: int,
                       ) -> tuple[list[list[int]], tuple[int, int]]:
    """A repeated workload, three requests at a time: the second round in another order, so
    with several replicas each answer comes back on a replica that did not draft it.
    Returns the outputs and (draft tokens, accepted tokens)."""
    replicas = await start_replicas(target, device, num_replicas) if num_replicas else None
    engine = await start_engine(target, device, replicas)
    try:
        outputs: list[list[int]] = []
        for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
            batch = await asyncio.gather(*(generate(engine, PROMPTS[i], greedy()) for i in order))
            by_prompt = dict(zip(order, batch))
            outputs += [by_prompt[i] for i in range(3)]
        return outputs, (engine.spec.num_draft_tokens, engine.spec.num_accepted_tokens)
    finally:
        await engine.stop()
        for replica in replicas or ():
            await replica.stop()


async def test_greedy_output_and_acceptance_are_the_same_with_one_two_and_three_replicas(
        target, device) -> None:
    plain, _ = await run_workload(target, str(device), 0)
    one, one_counts = await run_workload(target, str(device), 1)
    two, two_counts = await run_workload(target, str(device), 2)
    three, three_counts = await run_workload(target, str(device), 3)
    assert one == two == three == plain
    assert one_counts[1] > 0
    # Every replica learned every answer, so each drafted what the single one drafted.
    assert two_counts == one_counts
    assert three_counts == one_counts
