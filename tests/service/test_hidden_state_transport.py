"""Target hidden states travel to drafters that ask for them, and only to those.

Rows cover every context position but the last; the pool sends each row once, again
after a resync, and a replica asking for other layers than the serving ones is refused.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from drafter_svc.proposer import NgramMethod, ProposerInfo
from drafter_svc.proposer_factory import proposer_factory
from drafter_svc.servicer import DrafterServicer
from specdec.config import SpeculativeConfig
from specdec.config_flags import build_config
from specdec.rpc.replica_set import ReplicaTarget
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from verifier_svc.drafting.drafter_pool import DrafterPool, DraftRequest

CONFIG = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2})
WIDTH = 6


class HiddenRecordingServicer(DrafterServicer):
    """An ngram drafter that claims to need target hidden states, recording requests."""

    def __init__(self, layer_ids: tuple[int, ...]) -> None:
        info = NgramMethod.from_config(CONFIG).info
        claimed = ProposerInfo(method=info.method,
                               max_num_speculative_tokens=info.max_num_speculative_tokens,
                               hidden_state_layer_ids=layer_ids)
        super().__init__(proposer_factory(CONFIG), claimed)
        self.requests: list[specdec_pb2.ProposeRequest] = []

    async def Propose(self, request_iterator, context):
        async def recorded():
            async for request in request_iterator:
                recorded_copy = specdec_pb2.ProposeRequest()
                recorded_copy.CopyFrom(request)
                self.requests.append(recorded_copy)
                # The ngram proposer under this servicer ignores the states.
                for update in request.sequences:
                    update.ClearField("hidden_states")
                yield request
        async for response in super().Propose(recorded(), context):
            yield response


async def start(servicer: DrafterServicer) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    specdec_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def decode(message: specdec_pb2.Tensor) -> torch.Tensor:
    assert message.dtype == "float32"
    return torch.frombuffer(bytearray(message.data), dtype=torch.float32).view(*message.shape)


async def test_rows_are_sent_once_each_and_again_after_resync() -> None:
    servicer = HiddenRecordingServicer((-1,))
    server, port = await start(servicer)
    pool = DrafterPool([f"127.0.0.1:{port}"], vocab_size=100, tokenizer_fingerprint="fp")
    await pool.start()
    try:
        assert await pool.wait_for_healthy(1, timeout_s=5)
        assert pool.hidden_state_layer_ids == (-1,)
        context = [5, 6, 7, 5, 6]
        hidden = torch.arange(40 * WIDTH, dtype=torch.float32).view(40, WIDTH)
        await pool.propose([DraftRequest(1, context, 0, 2, hidden[:4])], [], timeout_s=5)
        first = servicer.requests[-1].sequences[0]
        assert list(first.new_token_ids) == context
        assert torch.equal(decode(first.hidden_states), hidden[:4])  # all positions but the last

        context += [7, 5]
        await pool.propose([DraftRequest(1, context, 1, 2, hidden[:6])], [], timeout_s=5)
        second = servicer.requests[-1].sequences[0]
        assert list(second.new_token_ids) == [7, 5]
        assert torch.equal(decode(second.hidden_states), hidden[4:6])

        # Without captured states the sequence is not drafted (it could not be).
        drafts = await pool.propose([DraftRequest(2, [1, 2, 1], 0, 2, None)], [], timeout_s=0.5)
        assert 2 not in drafts and all(u.seq_id != 2 for u in servicer.requests[-1].sequences)

        # After the drafter asks for a resync, the whole context and all rows go again.
        replica = pool.replicas[0]
        pool.mark_needs_resync(replica, 1)
        context += [6]
        await pool.propose([DraftRequest(1, context, 0, 2, hidden[:7])], [], timeout_s=5)
        third = servicer.requests[-1].sequences[0]
        assert list(third.new_token_ids) == context
        assert torch.equal(decode(third.hidden_states), hidden[:7])
    finally:
        await pool.close()
        await server.stop(0)


async def test_replica_needing_other_layers_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    first, first_port = await start(HiddenRecordingServicer((2, 15, 27)))
    second, second_port = await start(HiddenRecordingServicer((-1,)))
    pool = DrafterPool([f"127.0.0.1:{first_port}"], vocab_size=100, tokenizer_fingerprint="fp")
    await pool.start()
    try:
        assert await pool.wait_for_healthy(1, timeout_s=5)
        # A second --drafter, as if configured from the start but reached only now.
        pool._replicas.targets.append(ReplicaTarget.parse(1, f"127.0.0.1:{second_port}"))
        await pool._replicas.resolve()
        assert not await pool.wait_for_healthy(2, timeout_s=1.0)
        assert pool.hidden_state_layer_ids == (2, 15, 27)
        assert "[-1]" in caplog.text and "[2, 15, 27]" in caplog.text
    finally:
        await pool.close()
        await first.stop(0)
        await second.stop(0)


async def test_engine_sends_the_target_states_of_every_position(tmp_path, device) -> None:
    """The rows a drafter receives equal the target's states from one plain prefill."""
    from specdec.engine.kv_cache import KVCache
    from specdec.engine.sampling_params import SamplingParams
    from specdec.layers.attention import AttentionMetadata
    from specdec.models.loader import load_model
    from tests.support.tiny_models import make_tiny_llama
    from verifier_svc.builder import VerifierConfig, build_engine

    model_dir = make_tiny_llama(tmp_path / "tiny")
    servicer = HiddenRecordingServicer((-1, 1))
    server, port = await start(servicer)
    config = build_config(VerifierConfig, model=str(model_dir), device=str(device), dtype="float32",
                          max_model_len=128, block_size=4, num_kv_blocks=64,
                          max_num_batched_tokens=8,  # the prompt prefills in chunks
                          speculative_config=CONFIG, drafter_targets=(f"127.0.0.1:{port}",),
                          draft_timeout_s=1.0)
    engine, _ = build_engine(config)
    await engine.start()
    try:
        assert await engine.drafter_pool.wait_for_healthy(1, timeout_s=5)
        prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 10]
        _, queue = engine.add_request("h", prompt, SamplingParams(temperature=0, max_tokens=12,
                                                                  ignore_eos=True))
        tokens = list(prompt)
        while True:
            output = await queue.get()
            tokens += output.token_ids
            if output.finish_reason is not None:
                break
    finally:
        await engine.stop()
        await server.stop(0)

    rows = [decode(u.hidden_states) for r in servicer.requests for u in r.sequences
            if u.HasField("hidden_states")]
    sent = torch.cat(rows)
    assert sent.shape[1] == 2 * 32 and sent.shape[0] >= len(prompt)

    model = load_model(model_dir, torch.float32, device)
    cache = KVCache.allocate(model.config, 64, 4, torch.float32, device)
    n = sent.shape[0]
    metadata = AttentionMetadata(slot_mapping=torch.arange(n, device=device),
                                 query_start_locs=[0, n], context_lens=[n],
                                 block_tables=[torch.arange(64, device=device)])
    with torch.inference_mode():
        final, (entering_layer_1,) = model(torch.tensor(tokens[:n], device=device),
                                           torch.arange(n, device=device), cache, metadata,
                                           aux_layer_ids=(1,))
    expected = torch.cat([final, entering_layer_1], dim=-1).cpu()
    torch.testing.assert_close(sent, expected, atol=1e-4, rtol=1e-4)
