"""DrafterPool against real in-process grpc.aio drafters on port 0."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
import torch

from drafter_svc.ngram_proposer import NgramProposer
from drafter_svc.proposer import NgramMethod
from drafter_svc.proposer_factory import proposer_factory
from drafter_svc.server import start_drafter_server, stop_drafter_server
from drafter_svc.servicer import DrafterServicer
from specdec.config import SpeculativeConfig
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from verifier_svc.drafting.drafter_pool import DrafterPool, DraftRequest

K = 3
VOCAB_SIZE = 100
CONFIG = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": K,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3})
MATCHER = NgramProposer(1, 3, K)


def make_pool(*ports: int, **kwargs) -> DrafterPool:
    options = dict(vocab_size=VOCAB_SIZE, tokenizer_fingerprint="fp-verifier",
                   backoff_initial_s=0.05, backoff_max_s=0.2)
    options.update(kwargs)
    return DrafterPool([f"127.0.0.1:{port}" for port in ports], **options)


async def start_custom_server(servicer: DrafterServicer, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    specdec_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


class RecordingServicer(DrafterServicer):
    """The real servicer, remembering every request it got."""

    def __init__(self) -> None:
        method = NgramMethod.from_config(CONFIG)
        super().__init__(proposer_factory(CONFIG), method.info)
        self.requests: list[specdec_pb2.ProposeRequest] = []

    async def Propose(self, request_iterator, context):
        async def recorded():
            async for request in request_iterator:
                self.requests.append(request)
                yield request
        async for response in super().Propose(recorded(), context):
            yield response


@pytest.fixture
async def drafter():
    servicer = RecordingServicer()
    server, port = await start_custom_server(servicer)
    yield servicer, port
    await server.stop(0)


@pytest.fixture
async def pool_for(request):
    pools: list[DrafterPool] = []

    async def start(*ports: int, num_healthy: int | None = None, **kwargs) -> DrafterPool:
        pool = make_pool(*ports, **kwargs)
        pools.append(pool)
        await pool.start()
        if num_healthy is None:
            num_healthy = len(ports)
        assert await pool.wait_for_healthy(num_healthy, timeout_s=5.0)
        return pool

    yield start
    for pool in pools:
        await pool.close()


def requests_for(contexts: dict[int, list[int]], k: int = K) -> list[DraftRequest]:
    return [DraftRequest(seq_id, context, 0, k) for seq_id, context in contexts.items()]


async def test_proposals_equal_ngram_proposer_and_updates_are_incremental(drafter, pool_for):
    servicer, port = drafter
    pool = await pool_for(port)
    contexts = {1: [1, 2, 3, 4, 1, 2], 2: [5, 6, 5, 6, 5], 3: [7, 8, 9]}
    for step, new in enumerate(([], [3], [4, 1], [9, 9, 5])):
        for context in contexts.values():
            context += new
        drafts = await pool.propose(requests_for(contexts), [], timeout_s=5.0)
        for seq_id, context in contexts.items():
            expected = MATCHER.propose(context, K)
            assert (drafts[seq_id].token_ids if seq_id in drafts else []) == expected
            assert all(draft.probs is None for draft in drafts.values())
        sent = {update.seq_id: list(update.new_token_ids)
                for update in servicer.requests[-1].sequences}
        if step == 0:
            assert sent == contexts  # the whole context the first time
        else:
            assert sent == {seq_id: new for seq_id in contexts}  # then only the new tokens
    assert len(servicer.requests) == 4  # one message per step


async def test_finished_ids_drop_state(drafter, pool_for):
    servicer, port = drafter
    pool = await pool_for(port)
    await pool.propose(requests_for({1: [1, 2, 1]}), [], timeout_s=5.0)
    drafts = await pool.propose(requests_for({2: [3, 4, 3]}), [1], timeout_s=5.0)
    assert list(servicer.requests[-1].finished_seq_ids) == [1]
    assert drafts[2].token_ids == [4, 3]
    # seq 1 is forgotten on both sides: reusing the id sends its whole context again.
    drafts = await pool.propose(requests_for({1: [8, 9, 8]}), [], timeout_s=5.0)
    assert list(servicer.requests[-1].sequences[0].new_token_ids) == [8, 9, 8]
    assert drafts[1].token_ids == [9, 8]


async def test_resync_after_drafter_restart(pool_for):
    server, port = await start_drafter_server(CONFIG, "127.0.0.1", 0)
    pool = await pool_for(port)
    contexts = {1: [1, 2, 3, 1, 2], 2: [4, 5, 4]}
    drafts = await pool.propose(requests_for(contexts), [], timeout_s=5.0)
    assert drafts[1].token_ids == [3, 1, 2]

    await stop_drafter_server(server, grace_s=0)
    deadline = time.monotonic() + 5.0
    while pool.num_healthy() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert pool.num_healthy() == 0
    contexts[1].append(3)
    assert await pool.propose(requests_for(contexts), [], timeout_s=0.2) == {}

    server, _ = await start_drafter_server(CONFIG, "127.0.0.1", port)
    try:
        assert await pool.wait_for_healthy(1, timeout_s=5.0)
        contexts[1].append(1)
        drafts = await pool.propose(requests_for(contexts), [], timeout_s=5.0)
        # The fresh drafter knows nothing; the pool resent the whole contexts.
        assert drafts[1].token_ids == MATCHER.propose(contexts[1], K) == [2, 3, 1]
        assert drafts[2].token_ids == [5, 4]
    finally:
        await stop_drafter_server(server, grace_s=0)


async def test_needs_resync_from_drafter_resends_the_context(pool_for):
    """A drafter that lost a sequence's state says so; the next step carries the full context."""
    servicer = RecordingServicer()
    server, port = await start_custom_server(servicer)
    pool = await pool_for(port)
    try:
        await pool.propose(requests_for({1: [1, 2, 1]}), [], timeout_s=5.0)
        state = pool._placement.get(1)
        assert state is not None
        state.num_synced_tokens = 1  # the pool now believes the drafter has 1 token
        drafts = await pool.propose(requests_for({1: [1, 2, 1, 2]}), [], timeout_s=5.0)
        assert drafts == {}
        drafts = await pool.propose(requests_for({1: [1, 2, 1, 2]}), [], timeout_s=5.0)
        assert list(servicer.requests[-1].sequences[0].new_token_ids) == [1, 2, 1, 2]
        assert drafts[1].token_ids == [1, 2]
    finally:
        await server.stop(0)


async def test_two_replicas_share_sequences_stickily(pool_for):
    servicers = [RecordingServicer(), RecordingServicer()]
    started = [await start_custom_server(servicer) for servicer in servicers]
    pool = await pool_for(*(port for _, port in started))
    try:
        contexts = {seq_id: [seq_id, 1, seq_id, 1] for seq_id in range(8)}
        for _ in range(3):
            drafts = await pool.propose(requests_for(contexts), [], timeout_s=5.0)
            assert set(drafts) == set(contexts)
            for context in contexts.values():
                context.append(context[-2])
        seen = [{update.seq_id for request in servicer.requests for update in request.sequences}
                for servicer in servicers]
        assert len(seen[0]) == len(seen[1]) == 4
        assert not seen[0] & seen[1]  # sticky: every sequence stayed on one replica
        assert all(len(servicer.requests) == 3 for servicer in servicers)
    finally:
        for server, _ in started:
            await server.stop(0)


class SlowServicer(RecordingServicer):
    async def Propose(self, request_iterator, context):
        async for response in super().Propose(request_iterator, context):
            await asyncio.sleep(1.0)
            yield response


class GatedServicer(RecordingServicer):
    """Answers each step only once the test opens the gate, counting the answers."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.num_answered = 0

    async def Propose(self, request_iterator, context):
        async for response in super().Propose(request_iterator, context):
            await self.gate.wait()
            self.num_answered += 1
            yield response


# How long a test waits for a call that must return on its own: a hang guard, far above
# what any machine needs, so that a call that waits for the wrong thing fails, not hangs.
HANG_GUARD_S = 30.0


async def test_slow_drafter_yields_no_drafts_within_the_deadline(pool_for):
    servicer = GatedServicer()
    server, port = await start_custom_server(servicer)
    pool = await pool_for(port)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        drafts = await asyncio.wait_for(
            pool.propose(requests_for({1: [1, 2, 1]}), [], timeout_s=0.1), HANG_GUARD_S)
        waited = loop.time() - started
        assert drafts == {}
        # It gave up at its deadline, not at the answer: the drafter has answered nothing yet.
        assert servicer.num_answered == 0
        assert waited >= 0.09  # the deadline's lower bound: load lengthens it, never shortens it
        assert pool.num_healthy() == 1  # slow is not down
        servicer.gate.set()  # the late answer is dropped; the next step gets its drafts
        drafts = await pool.propose(requests_for({1: [1, 2, 1, 2]}), [], timeout_s=5.0)
        assert drafts[1].token_ids == [1, 2]
    finally:
        servicer.gate.set()
        await server.stop(0)


class GarbageServicer(DrafterServicer):
    """Answers each step with a fixed set of drafts, whatever was asked."""

    def __init__(self) -> None:
        super().__init__(proposer_factory(CONFIG), NgramMethod.from_config(CONFIG).info)

    async def Propose(self, request_iterator, context):
        good_probs = torch.full((2, VOCAB_SIZE), 1.0 / VOCAB_SIZE)
        async for request in request_iterator:
            response = specdec_pb2.ProposeResponse(step_id=request.step_id)
            response.drafts.add(seq_id=1, draft_token_ids=[5, VOCAB_SIZE])    # out of vocab
            response.drafts.add(seq_id=2, draft_token_ids=[1, 2, 3, 4])       # more than asked
            response.drafts.add(seq_id=3, draft_token_ids=[7, 8])             # fine
            response.drafts.add(seq_id=4, draft_token_ids=[7, 8]).draft_probs.CopyFrom(
                specdec_pb2.Tensor(data=b"\x00" * 12, dtype="float32", shape=[2, VOCAB_SIZE]))
            response.drafts.add(seq_id=5, draft_token_ids=[9, 9]).draft_probs.CopyFrom(
                specdec_pb2.Tensor(data=good_probs.numpy().tobytes(), dtype="float32",
                                   shape=[2, VOCAB_SIZE]))
            response.drafts.add(seq_id=77, draft_token_ids=[1])               # not asked
            yield response


async def test_garbage_drafts_are_dropped(pool_for, caplog):
    server, port = await start_custom_server(GarbageServicer())
    pool = await pool_for(port)
    try:
        with caplog.at_level(logging.WARNING, logger="verifier_svc.drafting.drafter_pool"):
            drafts = await pool.propose(requests_for({i: [1, 2, 3] for i in range(1, 6)}), [],
                                        timeout_s=5.0)
        assert sorted(drafts) == [3, 5]
        assert drafts[3].token_ids == [7, 8] and drafts[3].probs is None
        assert drafts[5].probs.shape == (2, VOCAB_SIZE)
        assert torch.allclose(drafts[5].probs.sum(dim=-1), torch.ones(2))
        assert "dropped a draft" in caplog.text
    finally:
        await server.stop(0)


class MismatchedServicer(DrafterServicer):
    def __init__(self) -> None:
        super().__init__(proposer_factory(CONFIG), NgramMethod.from_config(CONFIG).info)

    async def GetInfo(self, request, context):
        return specdec_pb2.DrafterInfo(method="draft_model", max_num_speculative_tokens=K,
                                       vocab_size=VOCAB_SIZE, tokenizer_fingerprint="fp-other")


async def test_mismatched_drafter_is_refused(pool_for, caplog):
    good_server, good_port = await start_drafter_server(CONFIG, "127.0.0.1", 0)
    bad_server, bad_port = await start_custom_server(MismatchedServicer())
    try:
        with caplog.at_level(logging.ERROR, logger="verifier_svc.drafting.drafter_pool"):
            pool = await pool_for(good_port, bad_port, num_healthy=1)
            deadline = time.monotonic() + 5.0
            while "refused" not in caplog.text and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        assert "fp-other" in caplog.text and "fp-verifier" in caplog.text
        assert pool.num_healthy() == 1
        contexts = {seq_id: [1, 2, 1] for seq_id in range(4)}
        drafts = await pool.propose(requests_for(contexts), [], timeout_s=5.0)
        assert set(drafts) == set(contexts)  # all served by the good replica
    finally:
        await stop_drafter_server(good_server, grace_s=0)
        await bad_server.stop(0)


async def test_no_replica_reachable_gives_no_drafts(pool_for):
    server, port = await start_drafter_server(CONFIG, "127.0.0.1", 0)
    await stop_drafter_server(server, grace_s=0)
    pool = await pool_for(port, num_healthy=0)
    # Nothing to wait for: propose returns within a few turns of the event loop (counted, not
    # timed), however long its deadline.
    proposing = asyncio.ensure_future(pool.propose(requests_for({1: [1, 2, 1]}), [7], timeout_s=3600))
    try:
        for _ in range(10):
            await asyncio.sleep(0)
        assert proposing.done() and proposing.result() == {}
    finally:
        proposing.cancel()
    assert pool.num_healthy() == 0


async def test_one_replica_per_resolved_address(pool_for):
    """A name resolving to several addresses (compose --scale) gives one replica each."""
    server, port = await start_drafter_server(CONFIG, "0.0.0.0", 0)
    resolved = ["127.0.0.1", "127.0.0.2"]

    def resolver(host: str, port_: int) -> list[str]:
        assert (host, port_) == ("drafter", port)
        return list(resolved)

    pool = DrafterPool([f"drafter:{port}"], resolve_interval_s=0.05, vocab_size=VOCAB_SIZE,
                       tokenizer_fingerprint="", backoff_initial_s=0.05, resolver=resolver)
    await pool.start()
    try:
        assert await pool.wait_for_healthy(2, timeout_s=5.0)
        contexts = {seq_id: [seq_id, 1, seq_id] for seq_id in range(4)}
        assert set(await pool.propose(requests_for(contexts), [], timeout_s=5.0)) == set(contexts)
        resolved.pop()  # one replica leaves: its sequences move to the other one
        deadline = time.monotonic() + 5.0
        while len(pool.replicas) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert pool.num_healthy() == 1
        for context in contexts.values():
            context.append(1)
        drafts = await pool.propose(requests_for(contexts), [], timeout_s=5.0)
        assert {seq_id: draft.token_ids for seq_id, draft in drafts.items()} == {
            seq_id: MATCHER.propose(context, K) for seq_id, context in contexts.items()}
    finally:
        await pool.close()
        await stop_drafter_server(server, grace_s=0)


async def test_stuck_drafter_is_reconnected(pool_for, caplog):
    """A replica that stops answering altogether gets a fresh stream instead of a backlog."""
    server, port = await start_custom_server(SlowServicer())
    pool = await pool_for(port)
    try:
        with caplog.at_level(logging.WARNING, logger="verifier_svc.drafting.drafter_pool"):
            for step in range(40):
                contexts = {1: [1, 2, 1] + [3] * step}
                assert await pool.propose(requests_for(contexts), [], timeout_s=0.005) == {}
        assert "has not answered" in caplog.text
        assert await pool.wait_for_healthy(1, timeout_s=5.0)
    finally:
        await server.stop(0)


async def test_a_sync_sends_the_context_without_asking_and_the_ask_only_what_followed(drafter, pool_for):
    servicer, port = drafter
    pool = await pool_for(port)
    prompt = [1, 2, 3, 4, 1, 2]
    pool.sync([DraftRequest(1, prompt, 0, 0)])
    for _ in range(100):  # the drafter answers the sync too; nothing waits for it
        await asyncio.sleep(0.01)
        if servicer.requests:
            break
    sync_message = servicer.requests[-1]
    assert [(update.seq_id, list(update.new_token_ids), update.num_speculative_tokens)
            for update in sync_message.sequences] == [(1, prompt, 0)]
    context = [*prompt, 3]
    drafts = await pool.propose([DraftRequest(1, context, 0, K)], [], timeout_s=5.0)
    assert [list(update.new_token_ids) for update in servicer.requests[-1].sequences] == [[3]]
    assert drafts[1].token_ids == MATCHER.propose(context, K)
