"""Per-token draft confidence (SequenceDraft.confidence) from the text-matching drafters:
the estimate, ngram's and suffix's evidence, and its way to the verifier's Draft."""

from __future__ import annotations

import random

import grpc
import pytest

from drafter_svc.confidence import match_confidence
from drafter_svc.ngram_proposer import NgramProposer
from drafter_svc.proposer_factory import proposer_factory
from drafter_svc.server import start_drafter_server, stop_drafter_server
from drafter_svc.propose_request import handle_propose_request
from drafter_svc.servicer import DrafterServicer
from drafter_svc.suffix_tree import SuffixTree
from specdec.config import SpeculativeConfig
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from verifier_svc.drafting.drafter_pool import DrafterPool, DraftRequest

K = 4
NGRAM = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": K,
                                 "prompt_lookup_min": 1, "prompt_lookup_max": 5})


@pytest.mark.parametrize("agree, total, match_len, low, high", [
    (2, 2, 5, 0.93, 1.0),    # a 5-gram seen twice, one continuation (the offline study)
    (1, 2, 5, 0.0, 0.35),    # continuations disagree
    (1, 3, 5, 0.0, 0.25),
    (1, 1, 1, 0.7, 0.8),     # one short match: weak evidence
    (0, 2, 5, 0.0, 0.0),
    (0, 0, 5, 0.0, 0.0),
])
def test_the_estimate(agree, total, match_len, low, high) -> None:
    assert low <= match_confidence(agree, total, match_len) <= high


def test_more_evidence_means_more_confidence() -> None:
    assert match_confidence(1, 1, 2) < match_confidence(1, 1, 5)  # a longer match
    assert match_confidence(1, 1, 3) < match_confidence(2, 2, 3)  # seen again, same way
    assert match_confidence(2, 3, 3) < match_confidence(2, 2, 3)  # seen again, another way


def test_ngram_confidence_leaves_the_draft_unchanged() -> None:
    proposer = NgramProposer(1, 5, K)
    rng = random.Random(0)
    for _ in range(300):
        context = [rng.randrange(6) for _ in range(rng.randrange(2, 60))]
        draft, confidence = proposer.propose_with_confidence(context, K)
        assert draft == proposer.propose(context, K)
        assert len(confidence) == len(draft)
        assert all(0.0 < value <= 1.0 for value in confidence)


def reference_confidence(context: list[int], proposer: NgramProposer) -> list[float]:
    """The definition, by brute force: the longest n, its occurrences, and at each draft
    position those that agreed so far."""
    draft = proposer.propose(context, K)
    if not draft:
        return []
    last = len(context)
    n = next(n for n in range(min(proposer.prompt_lookup_max, last - 1), 0, -1)
             if any(context[j - n + 1:j + 1] == context[last - n:] for j in range(n - 1, last - 1)))
    ends = [j for j in range(n - 1, last - 1) if context[j - n + 1:j + 1] == context[last - n:]]
    confidence = []
    for i, token in enumerate(draft):
        going_on = [j for j in ends if j + 1 + i < last]
        agreeing = [j for j in going_on if context[j + 1 + i] == token]
        confidence.append(match_confidence(len(agreeing), len(going_on), n + i))
        ends = agreeing
    return confidence


def test_ngram_confidence_is_the_definition() -> None:
    proposer = NgramProposer(1, 5, K)
    rng = random.Random(1)
    for _ in range(300):
        context = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
        _, confidence = proposer.propose_with_confidence(context, K)
        assert confidence == pytest.approx(reference_confidence(context, proposer))


def test_ngram_confidence_follows_the_evidence() -> None:
    proposer = NgramProposer(1, 5, K)
    agreeing = [1, 2, 3, 4, 5, 8, 0, 1, 2, 3, 4, 5, 8, 0, 1, 2, 3, 4, 5]
    disagreeing = [1, 2, 3, 4, 5, 8, 0, 1, 2, 3, 4, 5, 9, 0, 1, 2, 3, 4, 5]
    draft, sure = proposer.propose_with_confidence(agreeing, K)
    assert draft[0] == 8 and sure[0] >= 0.93
    draft, unsure = proposer.propose_with_confidence(disagreeing, K)
    assert draft[0] == 8 and unsure[0] <= 0.35  # the earliest occurrence's, contradicted
    # After a token both occurrences agreed on, a long copy grows surer.
    _, copying = proposer.propose_with_confidence([7, 1, 2, 3, 4, 5, 6, 9, 7, 1, 2], K)
    assert copying == sorted(copying)


def test_suffix_confidence_comes_from_the_tree_counts() -> None:
    tree = SuffixTree(max_depth=8)
    tree.insert([1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4])
    sure = tree.speculate(tree.match([1, 2, 3]), 3, 1.0, 0.1)
    assert sure.token_ids == [4, 0, 1] and len(sure.confidence) == 3
    assert sure.confidence[0] >= 0.93
    split = SuffixTree(max_depth=8)
    split.insert([1, 2, 3, 4, 0, 1, 2, 3, 7, 0, 1, 2, 3, 4])
    unsure = split.speculate(split.match([1, 2, 3]), 3, 1.0, 0.1)
    assert unsure.token_ids[0] == 4 and unsure.confidence[0] < 0.7 < sure.confidence[0]


def test_the_servicer_sends_one_confidence_per_token() -> None:
    for config in (NGRAM, SpeculativeConfig.parse({"method": "suffix",
                                                   "num_speculative_tokens": K})):
        method = proposer_factory(config)()
        request = specdec_pb2.ProposeRequest(step_id=1)
        request.sequences.add(seq_id=1, new_token_ids=[5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
                              context_len=10, num_speculative_tokens=K)
        draft = handle_propose_request(method, request).drafts[0]
        assert len(draft.draft_token_ids) > 0
        assert len(draft.confidence) == len(draft.draft_token_ids)
        assert all(0.0 < value <= 1.0 for value in draft.confidence)


async def test_the_pool_decodes_it_into_the_draft() -> None:
    server, port = await start_drafter_server(NGRAM, "127.0.0.1", 0)
    pool = DrafterPool([f"127.0.0.1:{port}"], vocab_size=100, tokenizer_fingerprint="",
                       backoff_initial_s=0.05)
    await pool.start()
    try:
        assert await pool.wait_for_healthy(1, timeout_s=30.0)
        context = [1, 2, 3, 4, 5, 8, 0, 1, 2, 3, 4, 5, 8, 0, 1, 2, 3]
        drafts = await pool.propose([DraftRequest(1, context, 0, K)], [], timeout_s=30.0)
        expected = NgramProposer(1, 5, K).propose_with_confidence(context, K)
        assert drafts[1].token_ids == expected[0]
        assert drafts[1].confidence == pytest.approx(expected[1], rel=1e-6)  # float32 on the wire
    finally:
        await pool.close()
        await stop_drafter_server(server, grace_s=0)


class BadConfidenceServicer(DrafterServicer):
    def __init__(self) -> None:
        method = proposer_factory(NGRAM)()
        super().__init__(proposer_factory(NGRAM), method.info)

    async def Propose(self, request_iterator, context):
        async for request in request_iterator:
            response = specdec_pb2.ProposeResponse(step_id=request.step_id)
            response.drafts.add(seq_id=1, draft_token_ids=[7, 8], confidence=[0.5])  # short
            response.drafts.add(seq_id=2, draft_token_ids=[7, 8], confidence=[0.5, 2.0])
            response.drafts.add(seq_id=3, draft_token_ids=[7, 8], confidence=[0.5, 0.25])
            yield response


async def test_a_malformed_confidence_is_dropped_and_the_draft_kept() -> None:
    server = grpc.aio.server()
    specdec_pb2_grpc.add_DrafterServicer_to_server(BadConfidenceServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = DrafterPool([f"127.0.0.1:{port}"], vocab_size=100, tokenizer_fingerprint="",
                       backoff_initial_s=0.05)
    await pool.start()
    try:
        assert await pool.wait_for_healthy(1, timeout_s=30.0)
        drafts = await pool.propose([DraftRequest(i, [1, 2, 3], 0, K) for i in (1, 2, 3)], [],
                                    timeout_s=30.0)
        assert {i: d.token_ids for i, d in drafts.items()} == {1: [7, 8], 2: [7, 8], 3: [7, 8]}
        assert drafts[1].confidence is None and drafts[2].confidence is None
        assert drafts[3].confidence == [0.5, 0.25]
    finally:
        await pool.close()
        await server.stop(0)
