"""Keepalive: the verifier's pings never cost it its Propose stream (issue 28, item 12).

The verifier's drafter channels ping every KEEPALIVE_TIME_MS. A drafter on gRPC's default
server policy (one ping per 5 minutes without data, 2 strikes) answered an idle stream's
pings with GOAWAY "too_many_pings", and the verifier lost speculation until it had
reconnected. Both ends now take their settings from specdec.rpc.grpc_server.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from drafter_svc.proposer_factory import proposer_factory
from drafter_svc.server import DRAFTER_SERVICE_NAME
from drafter_svc.servicer import DrafterServicer
from specdec.config import SpeculativeConfig
from specdec.rpc.grpc_server import (
    CHANNEL_OPTIONS,
    KEEPALIVE_TIME_MS,
    GrpcServer,
    client_keepalive_options,
    server_keepalive_options,
)
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from verifier_svc.drafting.drafter_pool import DrafterPool

K = 3
CONFIG = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": K,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3})
# Scaled down from 10 s. gRPC clients never ping more often than once a second, whatever
# keepalive_time_ms says, so a second is as fast as the test can go.
PING_MS = 1_000
# How long the control stream may take to be cut off; it takes about 5 pings.
CONTROL_LIMIT_S = 30.0


def _add_drafter(server: grpc.aio.Server) -> None:
    make_proposer = proposer_factory(CONFIG)
    specdec_pb2_grpc.add_DrafterServicer_to_server(
        DrafterServicer(make_proposer, make_proposer().info), server)


async def _step(call: grpc.aio.StreamStreamCall, step_id: int,
                context: list[int]) -> list[int]:
    """One ProposeRequest on `call` (the whole context of sequence 1); its draft."""
    await call.write(specdec_pb2.ProposeRequest(step_id=step_id, sequences=[
        specdec_pb2.SequenceUpdate(seq_id=1, new_token_ids=context, context_len=len(context),
                                   num_speculative_tokens=K)]))
    response = await call.read()
    assert response.step_id == step_id
    return [token for draft in response.drafts for token in draft.draft_token_ids]


async def test_an_idle_propose_stream_outlives_the_keepalive_pings():
    ours = GrpcServer([DRAFTER_SERVICE_NAME], keepalive_time_ms=PING_MS)
    _add_drafter(ours.server)
    our_port = await ours.start("127.0.0.1", 0)
    # The control: the drafter's server as it was, on gRPC's default ping policy. It proves
    # that the clients below ping often enough, for long enough, to be cut off by it.
    before = grpc.aio.server(options=CHANNEL_OPTIONS)
    _add_drafter(before)
    before_port = before.add_insecure_port("127.0.0.1:0")
    await before.start()
    options = [*CHANNEL_OPTIONS, *client_keepalive_options(PING_MS, PING_MS)]
    our_channel = grpc.aio.insecure_channel(f"127.0.0.1:{our_port}", options=options)
    before_channel = grpc.aio.insecure_channel(f"127.0.0.1:{before_port}", options=options)
    try:
        ours_call = specdec_pb2_grpc.DrafterStub(our_channel).Propose()
        before_call = specdec_pb2_grpc.DrafterStub(before_channel).Propose()
        assert await _step(ours_call, 1, [1, 2, 3, 4, 1, 2]) == [3, 4, 1]
        assert await _step(before_call, 1, [1, 2, 3, 4, 1, 2]) == [3, 4, 1]
        # Both streams idle; the old policy ends its stream after a few pings.
        with pytest.raises(grpc.aio.AioRpcError) as cut_off:
            await asyncio.wait_for(before_call.read(), CONTROL_LIMIT_S)
        assert cut_off.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "too many pings" in (cut_off.value.details() or "").lower()
        # Ours, idle as long under the same pings and two more, still answers on the
        # same stream.
        await asyncio.sleep(2 * PING_MS / 1000)
        assert await _step(ours_call, 2, [1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]
        assert ours_call.done() is False
        ours_call.cancel()
    finally:
        await our_channel.close()
        await before_channel.close()
        await ours.stop(0)
        await before.stop(0)


async def test_the_verifier_pings_no_faster_than_its_drafters_accept(monkeypatch):
    pool = DrafterPool([], vocab_size=10, tokenizer_fingerprint="")
    client = dict(pool.channel_options)
    assert client["grpc.keepalive_time_ms"] == KEEPALIVE_TIME_MS
    assert client["grpc.http2.max_pings_without_data"] == 0  # keeps pinging an idle stream
    # What every GrpcServer (drafter, verifier) is built with.
    built_with: list[dict[str, object]] = []
    make_server = grpc.aio.server

    def spy(*args: object, options: object = (), **kwargs: object) -> grpc.aio.Server:
        built_with.append(dict(options))  # type: ignore[arg-type]
        return make_server(*args, options=options, **kwargs)

    monkeypatch.setattr(grpc.aio, "server", spy)
    GrpcServer([DRAFTER_SERVICE_NAME])
    server = built_with[0]
    assert server == {**server, **dict(server_keepalive_options())}
    assert 0 < server["grpc.http2.min_ping_interval_without_data_ms"] <= KEEPALIVE_TIME_MS
    assert server["grpc.keepalive_permit_without_calls"] == 1
