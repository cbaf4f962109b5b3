"""A Propose stream cannot hold unbounded drafter memory, nor feed ids outside the vocabulary.

Issue #28 (12, second bullet): one stream of 16 messages of 1,000 never-finished sequences
of 4,000 tokens grew the drafter without bound, a context_len over max-model-len was
accepted and out-of-vocabulary ids were echoed back as drafts. These tests count the
sequences and tokens the drafter holds (not RSS) under each bound: sequences per stream,
max-model-len, idle eviction, vocabulary.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from drafter_svc.proposer import ModelOptions, NgramMethod, Proposal
from drafter_svc.proposer_factory import proposer_factory
from drafter_svc.server import (
    DRAFTER_SERVICE_NAME,
    main,
    start_drafter_server,
    stop_drafter_server,
)
from drafter_svc.propose_request import TOKEN_IDS_FIELD, handle_propose_request, handle_propose_request_sliced
from drafter_svc.sequence_table import SequenceTable, StreamLimits
from drafter_svc.servicer import DrafterServicer
from specdec.config import SpeculativeConfig
from specdec.errors import ConfigError, InvalidRequestError
from specdec.rpc.grpc_server import GrpcServer
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.draft_checkpoints import make_draft_model
from tests.support.tiny_models import make_tiny_llama

K = 3
VOCAB = 96
MAX_POSITIONS = 256
NGRAM = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": K,
                                 "prompt_lookup_min": 1, "prompt_lookup_max": 3})


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-bounds"), vocab_size=VOCAB,
                           max_positions=MAX_POSITIONS)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def update(seq_id: int, new: list[int], context_len: int, k: int = K) -> specdec_pb2.SequenceUpdate:
    return specdec_pb2.SequenceUpdate(seq_id=seq_id, new_token_ids=new, context_len=context_len,
                                      num_speculative_tokens=k)


def step(step_id: int, *updates: specdec_pb2.SequenceUpdate,
         finished: tuple[int, ...] = ()) -> specdec_pb2.ProposeRequest:
    return specdec_pb2.ProposeRequest(step_id=step_id, sequences=list(updates),
                                      finished_seq_ids=list(finished))


def ngram_table(limits: StreamLimits, clock: FakeClock | None = None,
                options: ModelOptions | None = None) -> SequenceTable:
    proposer = proposer_factory(NGRAM, options)()
    return SequenceTable(proposer, limits, clock or FakeClock())


def repeating(length: int, offset: int = 0) -> list[int]:
    return [3 + (offset + i) % 7 for i in range(length)]


# ---------------------------------------------------------------- the stream, scaled


def test_a_stream_of_unfinished_sequences_holds_a_bounded_number() -> None:
    """16 messages of 100 new sequences each, never finished: at most max-seqs are held."""
    table = ngram_table(StreamLimits(max_seqs_per_stream=256))
    for message in range(16):
        request = step(message + 1, *(update(message * 100 + i, repeating(200, i), 200)
                                      for i in range(100)))
        handle_propose_request(table.proposer, request, table)
    # Without the bound: 1,600 sequences and 320,000 tokens.
    assert len(table) == 256
    assert table.num_tokens() == 256 * 200
    assert table.num_evicted == 1600 - 256
    # The most recently updated are the ones kept.
    assert all(table.proposer.context_len(seq_id) == 200 for seq_id in range(1600 - 256, 1600))
    assert table.proposer.context_len(0) is None


def test_contexts_longer_than_max_model_len_are_not_held() -> None:
    options = ModelOptions(max_model_len=2048)
    table = ngram_table(StreamLimits(), options=options)
    assert table.proposer.info.max_model_len == 2048
    response = handle_propose_request(table.proposer, step(1, *(
        update(i, repeating(4000, i), 4000) for i in range(8))), table)
    assert list(response.drafts) == []  # no draft, no resync
    assert table.num_tokens() == 0
    assert table.too_long == set(range(8))
    # Later updates of such a sequence are neither held nor answered with a resync (which
    # would make the verifier resend the whole context every step).
    response = handle_propose_request(table.proposer, step(2, update(3, [5], 4001)), table)
    assert list(response.drafts) == [] and table.num_tokens() == 0
    # A fitting context next to them is served normally, and finishing forgets them.
    response = handle_propose_request(table.proposer, step(3, update(9, repeating(30), 30)),
                                      table, )
    assert [draft.seq_id for draft in response.drafts] == [9]
    handle_propose_request(table.proposer, step(4, finished=tuple(range(8))), table)
    assert len(table) == 1 and table.too_long == set() and table.num_tokens() == 30


def test_a_context_exactly_max_model_len_is_held() -> None:
    table = ngram_table(StreamLimits(), options=ModelOptions(max_model_len=64))
    handle_propose_request(table.proposer, step(1, update(1, repeating(63), 63)), table)
    handle_propose_request(table.proposer, step(2, update(1, [4], 64)), table)
    assert table.num_tokens() == 64
    handle_propose_request(table.proposer, step(3, update(1, [4], 65)), table)
    assert table.num_tokens() == 0 and table.too_long == {1}


def test_idle_sequences_are_evicted_and_then_resynced() -> None:
    clock = FakeClock()
    table = ngram_table(StreamLimits(seq_idle_timeout_s=300.0), clock)
    proposer = table.proposer
    handle_propose_request(proposer, step(1, update(1, repeating(20), 20),
                                          update(2, repeating(20), 20)), table)
    clock.now += 200
    handle_propose_request(proposer, step(2, update(2, [4], 21)), table)
    assert len(table) == 2
    clock.now += 101  # seq 1: 301 s since its last update; seq 2: 101 s
    response = handle_propose_request(proposer, step(3, update(2, [5], 22)), table)
    assert len(table) == 1 and proposer.context_len(1) is None and proposer.context_len(2) == 22
    assert table.num_evicted == 1 and all(not d.needs_resync for d in response.drafts)
    # The evicted sequence's next incremental update asks the verifier for its context.
    response = handle_propose_request(proposer, step(4, update(1, [4], 21)), table)
    assert [(d.seq_id, d.needs_resync) for d in response.drafts] == [(1, True)]


def test_a_full_table_evicts_the_least_recently_updated() -> None:
    table = ngram_table(StreamLimits(max_seqs_per_stream=3))
    proposer = table.proposer
    handle_propose_request(proposer, step(1, *(update(i, repeating(10), 10) for i in (1, 2, 3))),
                           table)
    handle_propose_request(proposer, step(2, update(1, [4], 11)), table)  # 2 is now the oldest
    handle_propose_request(proposer, step(3, update(4, repeating(10), 10)), table)
    assert [proposer.context_len(i) for i in (1, 2, 3, 4)] == [11, None, 10, 10]
    with pytest.raises(InvalidRequestError) as info:
        handle_propose_request(proposer, step(4, *(update(i, [3], 1) for i in range(10, 14))), table)
    assert info.value.param == "sequences" and "--max-seqs-per-stream 3" in info.value.message
    assert [proposer.context_len(i) for i in (1, 3, 4)] == [11, 10, 10]  # nothing applied


def test_a_stream_holds_a_bounded_number_of_tokens() -> None:
    """Issue 44 item 6: a sequence whose update would take the stream past
    --max-tokens-per-stream is refused (not held, not drafted, no resync asked), and the
    others are served as before."""
    table = ngram_table(StreamLimits(max_tokens_per_stream=100))
    proposer = table.proposer
    response = handle_propose_request(proposer, step(1, *(update(i, repeating(40, i), 40)
                                                          for i in (1, 2, 3))), table)
    assert [d.seq_id for d in response.drafts] == [1, 2]
    assert table.num_tokens() == 80 and table.over_budget == {3}
    # The refused one's incremental updates are skipped: no resync (a resent context would
    # be refused again), no draft.
    response = handle_propose_request(proposer, step(2, update(3, [4], 41),
                                                     update(1, repeating(10), 50)), table)
    assert [(d.seq_id, d.needs_resync) for d in response.drafts] == [(1, False)]
    assert table.num_tokens() == 90
    # Growing past the bound refuses the sequence that grows; its tokens are let go.
    response = handle_propose_request(proposer, step(3, update(2, repeating(20), 60)), table)
    assert list(response.drafts) == [] and table.num_tokens() == 50
    assert table.over_budget == {2, 3}
    # Once there is room, a full context is taken again; finishing forgets the refusals.
    response = handle_propose_request(proposer, step(4, update(3, repeating(41, 3), 41)), table)
    assert [d.seq_id for d in response.drafts] == [3] and table.num_tokens() == 91
    handle_propose_request(proposer, step(5, finished=(1, 2, 3)), table)
    assert table.num_tokens() == 0 and table.over_budget == set() and len(table) == 0


async def test_a_big_message_does_not_stall_other_streams() -> None:
    """Issue 44 item 6: a message with many long prompts gives the loop back between them,
    so a small message of another stream is answered before the big one is done (counted
    in order of completion, not time)."""
    big_table = ngram_table(StreamLimits())
    small_table = ngram_table(StreamLimits())
    big = step(1, *(update(i, repeating(1000, i), 1000) for i in range(8)))
    small = step(1, update(1, repeating(30), 30))
    finished: list[str] = []

    async def run(name: str, table: SequenceTable, request: specdec_pb2.ProposeRequest) -> None:
        await handle_propose_request_sliced(table.proposer, request, table)
        finished.append(name)

    await asyncio.gather(run("big", big_table, big), run("small", small_table, small))
    assert finished == ["small", "big"]
    assert big_table.num_tokens() == 8000
    # The same message, sliced or not, leaves the same state and answers the same.
    plain_table = ngram_table(StreamLimits())
    sliced_table = ngram_table(StreamLimits())
    assert (handle_propose_request(plain_table.proposer, big, plain_table)
            == await handle_propose_request_sliced(sliced_table.proposer, big, sliced_table))


async def test_streams_beyond_the_limit_get_resource_exhausted() -> None:
    method = NgramMethod.from_config(NGRAM)
    servicer = DrafterServicer(lambda: NgramMethod(method.proposer, method.info), method.info,
                               limits=StreamLimits(max_propose_streams=2))
    server, port = await start_servicer(servicer)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = specdec_pb2_grpc.DrafterStub(channel)
            open_calls = []
            for _ in range(2):
                call = stub.Propose()
                await call.write(step(1, update(1, [5, 6, 5], 3)))
                assert (await call.read()).drafts
                open_calls.append(call)
            refused = stub.Propose()
            await refused.write(step(1, update(1, [5, 6, 5], 3)))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await refused.read()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-propose-streams" in info.value.details()
            assert len(servicer.tables) == 2
            await open_calls[0].done_writing()
            deadline = time.monotonic() + 30
            while len(servicer.tables) > 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            again = stub.Propose()  # a closed stream frees its place
            await again.write(step(1, update(1, [5, 6, 5], 3)))
            assert (await again.read()).drafts
            for call in (open_calls[1], again):
                await call.done_writing()
    finally:
        await server.stop(0)


def test_limits_are_checked() -> None:
    with pytest.raises(ConfigError):
        StreamLimits(max_seqs_per_stream=0)
    with pytest.raises(ConfigError) as info:
        StreamLimits(max_tokens_per_stream=0)
    assert info.value.param == "max_tokens_per_stream"
    with pytest.raises(ConfigError) as info:
        StreamLimits(max_propose_streams=0)
    assert info.value.param == "max_propose_streams"
    assert main(["--speculative-config", NGRAM.to_json(), "--max-propose-streams", "0"]) == 2
    with pytest.raises(ConfigError):
        StreamLimits(seq_idle_timeout_s=0)
    assert main(["--speculative-config", NGRAM.to_json(), "--max-seqs-per-stream", "0"]) == 2
    assert main(["--speculative-config", NGRAM.to_json(), "--seq-idle-timeout-s", "-1"]) == 2


# ---------------------------------------------------------------- the vocabulary


def test_ngram_reads_the_targets_vocabulary_and_length(tiny_model: Path) -> None:
    info = NgramMethod.from_config(NGRAM, ModelOptions(target_model=str(tiny_model))).info
    assert (info.vocab_size, info.max_model_len) == (VOCAB, MAX_POSITIONS)
    info = NgramMethod.from_config(
        NGRAM, ModelOptions(target_model=str(tiny_model), max_model_len=100)).info
    assert (info.vocab_size, info.max_model_len) == (VOCAB, 100)
    info = NgramMethod.from_config(NGRAM, ModelOptions(target_model="not-a-directory")).info
    assert (info.vocab_size, info.max_model_len) == (0, 8192)


@pytest.mark.parametrize("bad_id", [VOCAB, 4294967295])
def test_ids_outside_the_vocabulary_are_refused(tiny_model: Path, bad_id: int) -> None:
    table = ngram_table(StreamLimits(), options=ModelOptions(target_model=str(tiny_model)))
    with pytest.raises(InvalidRequestError) as info:
        handle_propose_request(table.proposer, step(1, update(1, [5, 6], 2),
                                                    update(2, [5, bad_id, 5, bad_id], 4)), table)
    assert info.value.param == TOKEN_IDS_FIELD and str(bad_id) in info.value.message
    assert len(table) == 0  # the message was refused as a whole


def test_without_a_known_vocabulary_int32_bounds_the_ids() -> None:
    table = ngram_table(StreamLimits())
    handle_propose_request(table.proposer, step(1, update(1, [2**31 - 1] * 3, 3)), table)
    with pytest.raises(InvalidRequestError):
        handle_propose_request(table.proposer, step(2, update(2, [4294967295] * 3, 3)), table)


class _BadIdsNgram(NgramMethod):
    """An ngram method whose drafts end in an id outside its vocabulary (a method bug)."""

    def propose(self, seq_ids, num_tokens):
        return [Proposal([5, 6, VOCAB + 1]) for _ in seq_ids]


def test_a_method_never_sends_ids_outside_the_vocabulary(tiny_model: Path) -> None:
    method = NgramMethod.from_config(NGRAM, ModelOptions(target_model=str(tiny_model)))
    proposer = _BadIdsNgram(method.proposer, method.info)
    response = handle_propose_request(proposer, step(1, update(1, [5, 6, 5], 3)))
    assert [list(d.draft_token_ids) for d in response.drafts] == [[5, 6]]


def test_draft_model_refuses_bad_ids_and_long_contexts(tmp_path: Path) -> None:
    """The model methods: an id past the embedding table is INVALID_ARGUMENT (it was an
    INTERNAL index error), and a context past max-model-len holds no draft KV blocks."""
    draft = make_draft_model(tmp_path / "draft", vocab_size=VOCAB)
    config = SpeculativeConfig.parse({"method": "draft_model", "model": str(draft),
                                      "num_speculative_tokens": K})
    make = proposer_factory(config, ModelOptions(target_model=str(draft), dtype="float32",
                                                 device="cpu", num_blocks=64, block_size=4,
                                                 max_model_len=40))
    proposer = make()
    assert (proposer.info.vocab_size, proposer.info.max_model_len) == (VOCAB, 40)
    table = SequenceTable(proposer, StreamLimits(), FakeClock())
    with pytest.raises(InvalidRequestError) as info:
        handle_propose_request(proposer, step(1, update(1, [5, VOCAB], 2)), table)
    assert info.value.param == TOKEN_IDS_FIELD
    block_manager = proposer._pool.block_manager
    response = handle_propose_request(proposer, step(2, update(1, repeating(20), 20)), table)
    assert len(response.drafts[0].draft_token_ids) == K
    assert block_manager.num_free_blocks < 64
    handle_propose_request(proposer, step(3, update(1, repeating(21, 20), 41)), table)
    assert table.too_long == {1} and block_manager.num_free_blocks == 64
    proposer.close()


# ---------------------------------------------------------------- over gRPC


async def start_servicer(servicer: DrafterServicer) -> tuple[GrpcServer, int]:
    server = GrpcServer([DRAFTER_SERVICE_NAME])
    specdec_pb2_grpc.add_DrafterServicer_to_server(servicer, server.server)
    return server, await server.start("127.0.0.1", 0)


async def test_out_of_vocabulary_id_over_grpc_is_invalid_argument(tiny_model: Path) -> None:
    server, port = await start_drafter_server(NGRAM, "127.0.0.1", 0,
                                              options=ModelOptions(target_model=str(tiny_model)))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = specdec_pb2_grpc.DrafterStub(channel)
            assert (await stub.GetInfo(specdec_pb2.GetDrafterInfoRequest())).vocab_size == VOCAB
            call = stub.Propose()
            await call.write(step(1, update(1, [5, 4294967295], 2)))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert TOKEN_IDS_FIELD in info.value.details()
            good = stub.Propose()
            await good.write(step(1, update(1, [5, 6, 5], 3)))
            assert list((await good.read()).drafts[0].draft_token_ids) == [6, 5]
            await good.done_writing()
    finally:
        await stop_drafter_server(server, grace_s=0)


async def test_a_quiet_stream_is_swept_and_closed_streams_hold_nothing() -> None:
    method = NgramMethod.from_config(NGRAM)
    servicer = DrafterServicer(lambda: NgramMethod(method.proposer, method.info), method.info,
                               limits=StreamLimits(max_seqs_per_stream=8, seq_idle_timeout_s=0.2))
    server, port = await start_servicer(servicer)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = specdec_pb2_grpc.DrafterStub(channel).Propose()
            await call.write(step(1, *(update(i, repeating(50), 50) for i in range(20, 26))))
            await call.read()
            assert servicer.held() == (6, 300)
            # The stream stays open but sends nothing: its sequences go anyway.
            deadline = time.monotonic() + 30
            while servicer.held() != (0, 0) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert servicer.held() == (0, 0)
            assert len(servicer.tables) == 1  # the stream itself is still open
            await call.write(step(2, update(20, [4], 51)))
            assert (await call.read()).drafts[0].needs_resync
            await call.done_writing()
            deadline = time.monotonic() + 30
            while servicer.tables and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert servicer.tables == set()
    finally:
        await server.stop(0)
