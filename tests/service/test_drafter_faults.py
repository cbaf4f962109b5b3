"""Drafter faults through real processes: a drafter can cost speed, never a request.

A real drafter process (`python -m drafter_svc`, ngram) serves an in-process verifier on
the tiny model. Greedy requests in flight when the drafter is killed, hung (SIGSTOP) or
answers garbage finish with exactly their plain-decoding output (the reference: the same
prompts with speculation off per request); the pool marks a dead replica unhealthy,
reconnects with backoff when it is back and drafts again; with two replicas, new
sequences go to the live one.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from drafter_svc.proposer import NgramMethod
from drafter_svc.proposer_factory import proposer_factory
from drafter_svc.servicer import DrafterServicer
from specdec.config import SpeculativeConfig
from specdec.config_flags import build_config
from specdec.engine.sampling_params import SamplingParams
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.builder import VerifierConfig
from specdec.engine.engine import Engine
from verifier_svc.server import RunningVerifier, start_verifier

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
K = 3
VOCAB_SIZE = 96
SPEC_JSON = json.dumps({"method": "ngram", "num_speculative_tokens": K,
                        "prompt_lookup_min": 1, "prompt_lookup_max": 3})
SPEC = SpeculativeConfig.parse(SPEC_JSON)
DRAFT_TIMEOUT_S = 0.05
# How long a drafter process may take to be connected: it imports torch and grpc while the
# pool retries with a backoff of 0.5 s doubling to 10 s, so one that is up after ~15.5 s is
# first seen at ~25.5 s. 20 s was once too short in CI.
DRAFTER_PROCESS_START_S = 60.0
# Repetitive prompts: the tiny model's greedy text loops, so ngram drafts get accepted.
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [10, 11, 10, 11, 10], [20, 21, 22, 23, 20, 21],
           [30, 31, 30], [40, 41, 42, 40, 41, 42, 40], [50, 51, 52, 53, 54, 50, 51]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-faults"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_drafter_process(port: int, model: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "drafter_svc", "--port", str(port), "--speculative-config",
         SPEC_JSON, "--target-model", str(model), "--log-level", "warning"], cwd=ROOT, env=ENV)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)  # a stopped process cannot handle SIGKILL's reaping
        process.kill()
    process.wait(timeout=10)


async def start(model: Path, device: object, *drafter_ports: int,
                drafter_wait_s: float = 0.0) -> RunningVerifier:
    config = build_config(VerifierConfig, drafter_wait_s=drafter_wait_s, model=str(model),
                          device=str(device), dtype="float32",
                          max_model_len=512, num_kv_blocks=256,
                          speculative_config=SPEC, draft_timeout_s=DRAFT_TIMEOUT_S,
                          drafter_targets=tuple(f"127.0.0.1:{port}" for port in drafter_ports),
                          # Every step asks for drafts, whatever they achieved before.
                          adaptive_speculation=False)
    return await start_verifier(config, "127.0.0.1", 0)


async def until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


class Generation:
    """One greedy request on the engine; `token_ids` grows as it runs."""

    def __init__(self, engine: Engine, prompt: list[int], max_tokens: int,
                 k: int | None = None) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.seq_id, self._queue = engine.add_request("faults", prompt, params, k)
        self.token_ids: list[int] = []
        self.task = asyncio.create_task(self._collect())

    async def _collect(self) -> list[int]:
        while True:
            output = await self._queue.get()
            assert not isinstance(output, Exception), output
            self.token_ids.extend(output.token_ids)
            if output.finish_reason is not None:
                return self.token_ids


async def generate_all(engine: Engine, max_tokens: int, k: int | None = None) -> list[list[int]]:
    runs = [Generation(engine, prompt, max_tokens, k) for prompt in PROMPTS]
    return list(await asyncio.gather(*(run.task for run in runs)))


async def test_killed_drafter_loses_no_request_and_is_used_again_after_restart(
        tiny_model: Path, device) -> None:
    max_tokens = 300
    port = free_port()
    drafter = start_drafter_process(port, tiny_model)
    verifier = await start(tiny_model, device, port)
    engine, pool = verifier.engine, verifier.engine.drafter_pool
    try:
        assert await pool.wait_for_healthy(1, timeout_s=DRAFTER_PROCESS_START_S)
        reference = await generate_all(engine, max_tokens, k=0)
        runs = [Generation(engine, prompt, max_tokens) for prompt in PROMPTS]
        assert await until(lambda: engine.spec.num_drafts > 0
                           and min(len(run.token_ids) for run in runs) >= 8, 20)
        drafter.kill()
        drafter.wait()
        progress_at_kill = [len(run.token_ids) for run in runs]
        assert max(progress_at_kill) < max_tokens, "the kill came after the requests finished"
        assert await until(lambda: pool.num_healthy() == 0, 10)
        outputs = await asyncio.gather(*(run.task for run in runs))
        assert outputs == reference

        drafter = start_drafter_process(port, tiny_model)  # same port: the pool reconnects
        assert await pool.wait_for_healthy(1, timeout_s=DRAFTER_PROCESS_START_S)
        num_drafts = engine.spec.num_drafts
        assert await generate_all(engine, 40) == [tokens[:40] for tokens in reference]
        assert engine.spec.num_drafts > num_drafts  # speculating again
    finally:
        await verifier.stop()
        stop_process(drafter)


async def test_the_verifier_waits_for_a_drafter_before_serving(tiny_model: Path, device) -> None:
    """With --drafter-wait-s (the launcher's setting) the verifier serves only once a replica
    is connected, so the first request is speculated; with none, it serves plain after it."""
    port = free_port()
    drafter = start_drafter_process(port, tiny_model)  # still importing when the verifier starts
    try:
        verifier = await start(tiny_model, device, port, drafter_wait_s=60)
        try:
            assert verifier.engine.drafter_pool.num_healthy() == 1
            await generate_all(verifier.engine, max_tokens=16)
            assert verifier.engine.spec.num_draft_tokens > 0
        finally:
            await verifier.stop()
    finally:
        stop_process(drafter)
    started = time.monotonic()
    verifier = await start(tiny_model, device, free_port(), drafter_wait_s=0.5)  # nobody there
    try:
        assert time.monotonic() - started >= 0.5
        assert verifier.engine.drafter_pool.num_healthy() == 0
        assert await generate_all(verifier.engine, max_tokens=8)  # served, plain
    finally:
        await verifier.stop()


async def test_hung_drafter_costs_at_most_the_draft_deadline_per_step(
        tiny_model: Path, device) -> None:
    max_tokens = 40
    port = free_port()
    drafter = start_drafter_process(port, tiny_model)
    verifier = await start(tiny_model, device, port)
    engine, pool = verifier.engine, verifier.engine.drafter_pool
    try:
        assert await pool.wait_for_healthy(1, timeout_s=DRAFTER_PROCESS_START_S)
        reference = await generate_all(engine, max_tokens, k=0)
        runs = [Generation(engine, prompt, max_tokens) for prompt in PROMPTS]
        assert await until(lambda: engine.spec.num_drafts > 0, 20)
        # Each step waits for the hung drafter at most the draft deadline: every step asks
        # the pool with it (recorded here), and the pool holds to it (tests/service/test_drafter_pool.py).
        # Counted, not timed: how long the steps take depends on the machine.
        deadlines: list[float] = []
        propose = pool.propose

        async def recorded_propose(requests, finished_seq_ids, timeout_s):
            deadlines.append(timeout_s)
            return await propose(requests, finished_seq_ids, timeout_s)

        pool.propose = recorded_propose
        drafter.send_signal(signal.SIGSTOP)
        try:
            # A hang guard, not a speed check: a step that waited for the drafter never ends.
            outputs = await asyncio.wait_for(asyncio.gather(*(run.task for run in runs)), 60)
        finally:
            drafter.send_signal(signal.SIGCONT)
            pool.propose = propose
        assert outputs == reference
        assert deadlines and set(deadlines) == {DRAFT_TIMEOUT_S}

        # Resumed, the drafter is reconnected and drafts again.
        num_drafts = engine.spec.num_drafts
        deadline = time.monotonic() + 30
        while engine.spec.num_drafts == num_drafts and time.monotonic() < deadline:
            assert await generate_all(engine, max_tokens) == reference
        assert engine.spec.num_drafts > num_drafts
    finally:
        await verifier.stop()
        stop_process(drafter)


class GarbageDrafter(specdec_pb2_grpc.DrafterServicer):
    """Answers every step with something wrong: out-of-vocabulary ids, more than k tokens,
    a wrong step id, drafts for sequences nobody asked about, or random (valid) tokens."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.kinds_sent: set[str] = set()

    async def GetInfo(self, request, context) -> specdec_pb2.DrafterInfo:
        return specdec_pb2.DrafterInfo(method="ngram", max_num_speculative_tokens=K)

    async def Propose(self, request_iterator, context):
        rng = random.Random(0)
        kinds = ("out_of_vocab", "too_many", "wrong_step_id", "unknown_and_duplicate", "random")
        async for request in request_iterator:
            self.num_steps += 1
            kind = kinds[request.step_id % len(kinds)]
            self.kinds_sent.add(kind)
            step_id = request.step_id + 1000 if kind == "wrong_step_id" else request.step_id
            response = specdec_pb2.ProposeResponse(step_id=step_id)
            for update in request.sequences:
                token_ids = [rng.randrange(VOCAB_SIZE) for _ in range(K)]
                if kind == "out_of_vocab":
                    token_ids[rng.randrange(K)] = rng.choice([VOCAB_SIZE, 2**31])
                elif kind == "too_many":
                    token_ids += [5] * 3
                elif kind == "unknown_and_duplicate":
                    response.drafts.add(seq_id=update.seq_id + 10_000, draft_token_ids=[1, 2])
                    response.drafts.add(seq_id=update.seq_id, draft_token_ids=token_ids)
                response.drafts.add(seq_id=update.seq_id, draft_token_ids=token_ids)
            yield response


async def test_garbage_drafts_change_nothing(tiny_model: Path, device) -> None:
    max_tokens = 30
    garbage = GarbageDrafter()
    server = grpc.aio.server()
    specdec_pb2_grpc.add_DrafterServicer_to_server(garbage, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    verifier = await start(tiny_model, device, port)
    engine, pool = verifier.engine, verifier.engine.drafter_pool
    try:
        assert await pool.wait_for_healthy(1, timeout_s=20)
        reference = await generate_all(engine, max_tokens, k=0)
        assert await generate_all(engine, max_tokens) == reference
        assert garbage.kinds_sent == {"out_of_vocab", "too_many", "wrong_step_id",
                                      "unknown_and_duplicate", "random"}
        assert engine.spec.num_drafts > 0  # the valid-looking drafts were verified, and lost
        assert await generate_all(engine, 5, k=0) == [t[:5] for t in reference]  # still serving
    finally:
        await verifier.stop()
        await server.stop(0)


class RecordingDrafter(DrafterServicer):
    """The real ngram servicer, remembering which sequences it was sent."""

    def __init__(self) -> None:
        super().__init__(proposer_factory(SPEC), NgramMethod.from_config(SPEC).info)
        self.seq_ids: set[int] = set()

    async def Propose(self, request_iterator, context):
        async def recorded():
            async for request in request_iterator:
                self.seq_ids.update(update.seq_id for update in request.sequences)
                yield request

        async for response in super().Propose(recorded(), context):
            yield response


async def test_new_sequences_go_to_the_live_replica(tiny_model: Path, device) -> None:
    max_tokens = 40
    doomed_port = free_port()
    doomed = start_drafter_process(doomed_port, tiny_model)
    survivor = RecordingDrafter()
    server = grpc.aio.server()
    specdec_pb2_grpc.add_DrafterServicer_to_server(survivor, server)
    survivor_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    verifier = await start(tiny_model, device, doomed_port, survivor_port)
    engine, pool = verifier.engine, verifier.engine.drafter_pool
    try:
        assert await pool.wait_for_healthy(2, timeout_s=DRAFTER_PROCESS_START_S)
        reference = await generate_all(engine, max_tokens, k=0)
        runs = [Generation(engine, prompt, max_tokens) for prompt in PROMPTS]
        assert [await run.task for run in runs] == reference
        seq_ids = {run.seq_id for run in runs}
        # Both replicas served: the least loaded one gets each new sequence.
        assert survivor.seq_ids & seq_ids and seq_ids - survivor.seq_ids

        doomed.kill()
        doomed.wait()
        assert await until(lambda: pool.num_healthy() == 1, 10)
        survivor.seq_ids.clear()
        num_drafts = engine.spec.num_drafts
        runs = [Generation(engine, prompt, max_tokens) for prompt in PROMPTS]
        assert [await run.task for run in runs] == reference
        assert {run.seq_id for run in runs} <= survivor.seq_ids
        assert engine.spec.num_drafts > num_drafts
    finally:
        await verifier.stop()
        await server.stop(0)
        stop_process(doomed)


class SlowDrafter(RecordingDrafter):
    """Answers each step 30 ms late (within the draft deadline); `asked` is set on each step."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = asyncio.Event()

    async def Propose(self, request_iterator, context):
        async def flagged():
            async for request in request_iterator:
                self.asked.set()
                yield request

        async for response in super().Propose(flagged(), context):
            await asyncio.sleep(0.03)
            yield response


async def test_abort_while_drafts_are_awaited_spares_the_other_sequences(
        tiny_model: Path, device) -> None:
    """A client that leaves (a stop string, a disconnect) while the engine waits for the
    drafter frees its blocks mid-step; the step must go on without it."""
    max_tokens = 30
    slow = SlowDrafter()
    server = grpc.aio.server()
    specdec_pb2_grpc.add_DrafterServicer_to_server(slow, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    verifier = await start(tiny_model, device, port)
    engine, pool = verifier.engine, verifier.engine.drafter_pool
    try:
        assert await pool.wait_for_healthy(1, timeout_s=20)
        reference = await generate_all(engine, max_tokens, k=0)
        runs = [Generation(engine, prompt, max_tokens) for prompt in PROMPTS]
        victim = runs.pop(0)
        slow.asked.clear()
        await asyncio.wait_for(slow.asked.wait(), 20)  # the engine now awaits the drafts
        engine.abort(victim.seq_id)
        victim.task.cancel()
        outputs = await asyncio.wait_for(asyncio.gather(*(run.task for run in runs)), 30)
        assert outputs == reference[1:]
    finally:
        await verifier.stop()
        await server.stop(0)
