"""Property-based gRPC fuzzing (issue #28, item 9): generated requests to real servers.

Real servers on port 0, in one event loop on a background thread: a verifier on a tiny
random model with ngram speculation from a real ngram drafter, and an EAGLE drafter on
the same tiny target (its Propose stream decodes hidden-state tensors and runs a draft KV
pool). Hypothesis generates GenerateRequests (huge ids, NaN / negative / huge numbers,
random bytes instead of a message) and Propose streams (random bytes as tensors, wrong
shapes and dtypes, huge ids and counts, unknown, duplicate and finished-never-started
sequence ids, out-of-order steps). Properties:

- no server crashes, and every error is a proper status (INVALID_ARGUMENT, OUT_OF_RANGE,
  FAILED_PRECONDITION, RESOURCE_EXHAUSTED) with no traceback, never UNKNOWN or INTERNAL;
- what is answered is well-formed (ids in the vocabulary, no more drafts than asked);
- after every example a normal request is served exactly as before the fuzzing (greedy
  text, greedy drafts), and no KV block of the verifier or the draft pool is leaked.

Example counts are modest and derandomized, so CI runs the same examples every time.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from drafter_svc.proposer import ModelOptions
from drafter_svc.proposer_factory import proposer_factory
from drafter_svc.server import DRAFTER_SERVICE_NAME, start_drafter_server
from drafter_svc.servicer import DrafterServicer
from specdec.config import SpeculativeConfig
from specdec.config_flags import build_config
from specdec.rpc.grpc_server import GrpcServer
from specdec.rpc.tensors import encode_tensor
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.draft_checkpoints import make_eagle_head
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.builder import VerifierConfig
from verifier_svc.server import RunningVerifier, start_verifier

VOCAB = 96
HIDDEN = 32
MAX_MODEL_LEN = 128
NUM_BLOCKS = 64
K = 3
PROPER_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
NGRAM = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": K,
                                 "prompt_lookup_min": 1, "prompt_lookup_max": 3})
NORMAL_PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
NORMAL_CONTEXT = [5, 6, 7, 5, 6, 7, 5, 6]
FUZZ = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CALL_TIMEOUT_S = 60.0

UINT32 = 2**32 - 1
UINT64 = 2**64 - 1


def mostly(valid: st.SearchStrategy[Any], anything: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` five times in six: a request with every field wrong only tests the first check."""
    return st.one_of(valid, valid, valid, valid, valid, anything)


token_ids = st.one_of(st.integers(0, VOCAB - 1),
                      st.sampled_from([VOCAB, 2**31 - 1, 2**31, UINT32]), st.integers(0, UINT32))
valid_ids = st.integers(3, VOCAB - 1)  # no EOS: most requests run to max_tokens


def id_lists(min_size: int = 0, max_size: int = 12) -> st.SearchStrategy[list[int]]:
    return mostly(st.lists(valid_ids, min_size=min_size, max_size=max_size),
                  st.lists(token_ids, min_size=min_size, max_size=max_size))


counts = mostly(st.integers(0, 8), st.one_of(st.sampled_from([2**31, UINT32]), st.integers(0, UINT32)))
floats = st.floats(width=32)


class Servers:
    """The servers, in an event loop of their own on a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Stack:
    verifier: RunningVerifier
    verifier_channel: grpc.Channel
    ngram_channel: grpc.Channel
    eagle_channel: grpc.Channel
    eagle_free_blocks: Callable[[], int]
    reference_text: list[int]
    reference_drafts: dict[str, list[int]]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("fuzz")
    model = make_tiny_llama(root / "target", vocab_size=VOCAB, hidden_size=HIDDEN,
                            max_positions=MAX_MODEL_LEN)
    make_eagle_head(root / "eagle", model, fc_bias=True, with_embed=False)
    servers = Servers()
    eagle_factory = proposer_factory(
        SpeculativeConfig.parse({"method": "eagle", "model": str(root / "eagle"),
                                 "num_speculative_tokens": K}),
        ModelOptions(target_model=str(model), dtype="float32", device="cpu",
                     num_blocks=NUM_BLOCKS, block_size=4))
    pool = eagle_factory()._pool  # type: ignore[attr-defined]

    async def start() -> tuple[list[Any], RunningVerifier, int, int]:
        ngram_server, ngram_port = await start_drafter_server(
            NGRAM, "127.0.0.1", 0, options=ModelOptions(target_model=str(model)))
        eagle_server = GrpcServer([DRAFTER_SERVICE_NAME])
        specdec_pb2_grpc.add_DrafterServicer_to_server(
            DrafterServicer(eagle_factory, eagle_factory().info), eagle_server.server)
        eagle_port = await eagle_server.start("127.0.0.1", 0)
        verifier = await start_verifier(build_config(VerifierConfig,
            model=str(model), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
            block_size=4, num_kv_blocks=NUM_BLOCKS, speculative_config=NGRAM,
            drafter_targets=(f"127.0.0.1:{ngram_port}",), drafter_wait_s=30.0), "127.0.0.1", 0)
        return [ngram_server, eagle_server], verifier, ngram_port, eagle_port

    drafters, verifier, ngram_port, eagle_port = servers.run(start())
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}")
                for port in (verifier.port, ngram_port, eagle_port)]
    try:
        stack = Stack(verifier, *channels, eagle_free_blocks=lambda: pool.block_manager.num_free_blocks,
                      reference_text=[], reference_drafts={})
        stack.reference_text = normal_generate(stack, speculation=False)
        stack.reference_drafts = {name: normal_drafts(channel)
                                  for name, channel in (("ngram", channels[1]), ("eagle", channels[2]))}
        assert len(stack.reference_drafts["ngram"]) == K and len(stack.reference_drafts["eagle"]) == K
        yield stack
    finally:
        for channel in channels:
            channel.close()

        async def stop() -> None:
            await verifier.stop()
            for server in drafters:
                await server.stop(0)
        servers.run(stop())
        servers.close()


# ---------------------------------------------------------------- normal requests


def normal_generate(stack: Stack, speculation: bool = True) -> list[int]:
    stub = specdec_pb2_grpc.VerifierStub(stack.verifier_channel)
    request = specdec_pb2.GenerateRequest(
        prompt_token_ids=NORMAL_PROMPT, sampling=specdec_pb2.SamplingParams(max_tokens=12, ignore_eos=True),
        speculation=specdec_pb2.SpeculationOverride(enabled=speculation))
    tokens: list[int] = []
    for response in stub.Generate(request, timeout=CALL_TIMEOUT_S):
        tokens += response.token_ids
    return tokens


def normal_hidden_rows(num_rows: int) -> torch.Tensor:
    return torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(3))


def normal_drafts(channel: grpc.Channel) -> list[int]:
    update = specdec_pb2.SequenceUpdate(seq_id=1, new_token_ids=NORMAL_CONTEXT,
                                        context_len=len(NORMAL_CONTEXT), num_speculative_tokens=K)
    encode_tensor(normal_hidden_rows(len(NORMAL_CONTEXT) - 1), update.hidden_states)
    call = specdec_pb2_grpc.DrafterStub(channel).Propose(
        iter([specdec_pb2.ProposeRequest(step_id=1, sequences=[update])]), timeout=CALL_TIMEOUT_S)
    [response] = list(call)
    [draft] = response.drafts
    return list(draft.draft_token_ids)


def assert_proper(error: grpc.RpcError, allowed: set[grpc.StatusCode] = PROPER_CODES) -> None:
    code, details = error.code(), error.details() or ""
    # What --hypothesis-show-statistics lists: which checks the examples reached.
    event(f"{code.name}: {re.sub(r'-?[0-9][0-9.]*(e[+-]?[0-9]+)?', 'N', details)[:70]}")
    assert code in allowed, f"{code}: {details}"
    assert "Traceback" not in details and 'File "' not in details, details


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def assert_verifier_healthy(stack: Stack) -> None:
    assert normal_generate(stack) == stack.reference_text
    block_manager = stack.verifier.engine.scheduler.block_manager
    assert wait_until(lambda: block_manager.num_free_blocks == NUM_BLOCKS), "KV blocks leaked"


def assert_drafters_healthy(stack: Stack) -> None:
    assert normal_drafts(stack.ngram_channel) == stack.reference_drafts["ngram"]
    assert normal_drafts(stack.eagle_channel) == stack.reference_drafts["eagle"]
    assert wait_until(lambda: stack.eagle_free_blocks() == NUM_BLOCKS), "draft KV blocks leaked"


# ---------------------------------------------------------------- Generate


sampling_params = st.builds(
    specdec_pb2.SamplingParams,
    temperature=mostly(st.sampled_from([0.0, 0.0, 0.7, 1.0]), floats),
    top_p=mostly(st.sampled_from([0.0, 0.5, 0.9, 1.0]), floats),
    top_k=mostly(st.sampled_from([-1, 0, 1, 5, 50]), st.integers(-2**31, 2**31 - 1)),
    repetition_penalty=mostly(st.sampled_from([0.0, 1.0, 1.3]), floats),
    seed=st.one_of(st.none(), st.integers(0, 10), st.integers(0, UINT64)),
    max_tokens=mostly(st.integers(1, 12), st.one_of(st.just(0), counts)),
    stop_token_ids=st.lists(token_ids, max_size=4), ignore_eos=st.booleans())
speculation = st.builds(specdec_pb2.SpeculationOverride, enabled=st.one_of(st.none(), st.booleans()),
                        num_speculative_tokens=st.one_of(st.none(), counts))
generate_requests = st.builds(
    specdec_pb2.GenerateRequest,
    request_id=st.text(st.characters(exclude_categories=("Cs",)), max_size=20),
    prompt_token_ids=mostly(id_lists(min_size=1, max_size=20),
                            st.one_of(st.just([]), st.lists(valid_ids, min_size=100, max_size=140))),
    sampling=sampling_params, speculation=speculation)


@FUZZ
@given(request=generate_requests, cancel_after=st.sampled_from([None, None, 0, 1]))
def test_generate_fuzz(stack: Stack, request: specdec_pb2.GenerateRequest,
                       cancel_after: int | None) -> None:
    call = specdec_pb2_grpc.VerifierStub(stack.verifier_channel).Generate(request,
                                                                         timeout=CALL_TIMEOUT_S)
    responses: list[specdec_pb2.GenerateResponse] = []
    try:
        for response in call:
            responses.append(response)
            if cancel_after is not None and len(responses) > cancel_after:
                call.cancel()
                break
    except grpc.RpcError as error:
        assert_proper(error)
        assert not responses or error.code() != grpc.StatusCode.INVALID_ARGUMENT
    else:
        event("served" if cancel_after is None else "cancelled by the client")
        tokens = [t for r in responses for t in r.token_ids]
        assert all(t < VOCAB for t in tokens)
        if cancel_after is None:
            assert responses[-1].finish_reason != specdec_pb2.FINISH_REASON_UNSPECIFIED
            # A stop token (EOS, stop_token_ids) is counted in usage, not streamed (as vLLM).
            hidden = responses[-1].finish_reason == specdec_pb2.FINISH_REASON_STOP
            assert len(tokens) + hidden == responses[-1].usage.completion_tokens
            assert len(request.prompt_token_ids) + len(tokens) <= MAX_MODEL_LEN
    assert_verifier_healthy(stack)


@FUZZ
@given(payload=st.one_of(st.binary(max_size=64),
                         generate_requests.map(lambda r: r.SerializeToString()[:-1])))
def test_generate_random_bytes(stack: Stack, payload: bytes) -> None:
    raw = stack.verifier_channel.unary_stream("/specdec.v1.Verifier/Generate")
    try:
        responses = list(raw(payload, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as error:
        assert_proper(error)
    else:  # the bytes parsed as some request, and it was served
        assert responses
    assert_verifier_healthy(stack)


# ---------------------------------------------------------------- Propose


def hidden_states(data: st.DataObject, num_rows: int, wrong: bool) -> specdec_pb2.Tensor | None:
    """Rows for an update: right, or (`wrong`) maybe absent or wrong in one of many ways."""
    kind = data.draw(mostly(st.just("right"), st.sampled_from(["none", "bytes", "shape", "dtype",
                                                               "huge"]))) if wrong else "right"
    # A context_len that disagrees with the drafter's state: the rows are wrong anyway.
    num_rows = max(0, min(num_rows, MAX_MODEL_LEN + 1))
    if kind == "none":
        return None
    if kind == "right":
        dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
        return encode_tensor(normal_hidden_rows(num_rows).to(dtype))
    if kind == "bytes":
        return specdec_pb2.Tensor(data=data.draw(st.binary(max_size=2048)),
                                  dtype=data.draw(st.sampled_from(["float32", "bfloat16", "x", ""])),
                                  shape=data.draw(st.lists(st.integers(0, 64), max_size=3)))
    if kind == "shape":
        rows = data.draw(st.integers(0, num_rows + 3))
        width = data.draw(st.sampled_from([HIDDEN, HIDDEN - 1, 2 * HIDDEN, 0]))
        return encode_tensor(torch.zeros(rows, width))
    if kind == "dtype":
        tensor = torch.zeros(num_rows, HIDDEN, dtype=data.draw(
            st.sampled_from([torch.float64, torch.int64, torch.int8, torch.bool])))
        return encode_tensor(tensor)
    return specdec_pb2.Tensor(data=b"\0" * 16, dtype="float32",
                              shape=data.draw(st.lists(st.integers(0, UINT32), min_size=1, max_size=8)))


def propose_stream(data: st.DataObject) -> list[specdec_pb2.ProposeRequest]:
    """1-6 steps; a local mirror of the drafter's state makes many updates consistent."""
    known: dict[int, int] = {}  # seq_id -> context length the drafter holds (as predicted)
    seq_ids = st.one_of(st.integers(0, 5), st.integers(0, 5), st.integers(0, UINT64))
    # Whether this stream sends ids outside the vocabulary and wrong tensors: each refuses
    # the stream at once, so the other faults (order, counts, lengths) need streams without.
    wrong_ids, wrong_tensors = data.draw(st.booleans()), data.draw(st.booleans())
    messages = []
    for _ in range(data.draw(st.integers(1, 6))):
        message = specdec_pb2.ProposeRequest(
            step_id=data.draw(st.one_of(st.integers(0, 10), st.integers(0, UINT64))),
            finished_seq_ids=data.draw(st.lists(seq_ids, max_size=3)))
        for seq_id in message.finished_seq_ids:
            known.pop(seq_id, None)
        # Mostly distinct ids: a duplicate ends the stream at once (tested, but not every time).
        unique = data.draw(st.sampled_from([True, True, True, False]))
        for seq_id in data.draw(st.lists(seq_ids, max_size=4, unique=unique)):
            held = known.get(seq_id, 0)
            new = data.draw(st.lists(token_ids if wrong_ids else valid_ids, max_size=12))
            context_len = data.draw(mostly(st.sampled_from([held + len(new), len(new)]), counts))
            update = message.sequences.add(
                seq_id=seq_id, new_token_ids=new, context_len=context_len,
                num_accepted_tokens=data.draw(counts), num_speculative_tokens=data.draw(counts))
            base = 0 if context_len == len(new) else held
            tensor = hidden_states(data, max(context_len - 1, 0) - max(base - 1, 0), wrong_tensors)
            if tensor is not None:
                update.hidden_states.CopyFrom(tensor)
            if context_len in (len(new), held + len(new)) and context_len <= MAX_MODEL_LEN:
                known[seq_id] = context_len
            else:
                known.pop(seq_id, None)
        messages.append(message)
    return messages


def check_responses(call: Iterator[specdec_pb2.ProposeResponse],
                    messages: list[specdec_pb2.ProposeRequest]) -> None:
    answered = 0
    try:
        for response in call:
            message = messages[answered]
            answered += 1
            assert response.step_id == message.step_id
            asked = {u.seq_id: min(u.num_speculative_tokens, K) for u in message.sequences}
            for draft in response.drafts:
                assert draft.seq_id in asked
                assert len(draft.draft_token_ids) <= asked[draft.seq_id]
                assert all(t < VOCAB for t in draft.draft_token_ids)
    except grpc.RpcError as error:
        assert_proper(error)
    else:
        assert answered == len(messages)
        event("stream served to its end")


@FUZZ
@given(data=st.data(), drafter=st.sampled_from(["ngram", "eagle"]))
def test_propose_fuzz(stack: Stack, data: st.DataObject, drafter: str) -> None:
    messages = propose_stream(data)
    event(f"drafter {drafter}")
    channel = stack.ngram_channel if drafter == "ngram" else stack.eagle_channel
    call = specdec_pb2_grpc.DrafterStub(channel).Propose(iter(messages), timeout=CALL_TIMEOUT_S)
    check_responses(call, messages)
    assert_drafters_healthy(stack)


@FUZZ
@given(payloads=st.lists(st.binary(max_size=64), min_size=1, max_size=4),
       drafter=st.sampled_from(["ngram", "eagle"]))
def test_propose_random_bytes(stack: Stack, payloads: list[bytes], drafter: str) -> None:
    channel = stack.ngram_channel if drafter == "ngram" else stack.eagle_channel
    raw = channel.stream_stream("/specdec.v1.Drafter/Propose")
    try:
        for _ in raw(iter(payloads), timeout=CALL_TIMEOUT_S):
            pass
    except grpc.RpcError as error:
        assert_proper(error)
    for target, method in ((channel, "/specdec.v1.Drafter/GetInfo"),
                           (stack.verifier_channel, "/specdec.v1.Verifier/GetInfo")):
        try:
            target.unary_unary(method)(payloads[0], timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as error:
            assert_proper(error)
    assert_drafters_healthy(stack)
