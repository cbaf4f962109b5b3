"""n > 1: a failing choice ends the request with its own error (issue 44, item 5).

A fake verifier fails one of the request's choices mid-stream while the others still
stream; through the official openai client the request ends with that choice's error
(a 400 naming its field, or a streamed error event), never a 500, and every other
choice's verifier call is cancelled.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from specdec.errors import InvalidRequestError
from specdec.rpc.grpc_status import abort_with
from specdec.v1 import specdec_pb2
from tests.support.fake_verifier import (
    REPLY_TEXT,
    SERVED_MODEL,
    FakeVerifier,
    live_gateway,
    openai_client,
)

FAILING_CHOICE = 1
MESSAGE = "the grammar exceeded the grammar library's limits while generating"


class OneChoiceFails(FakeVerifier):
    """Choice FAILING_CHOICE of every request fails after its first response; the others
    stream slowly (they are still running when it fails)."""

    async def Generate(self, request: specdec_pb2.GenerateRequest, context: Any):
        if not request.request_id.endswith(f"-{FAILING_CHOICE}"):
            async for response in super().Generate(request, context):
                yield response
            return
        self.requests.append(request)
        yield specdec_pb2.GenerateResponse(token_ids=self.reply_token_ids[:2])
        await abort_with(context, InvalidRequestError(MESSAGE, param="grammar"))


@pytest.fixture(scope="module")
def live(tokenizer) -> Iterator[tuple[openai.OpenAI, OneChoiceFails]]:
    servicer = OneChoiceFails(tokenizer.encode(REPLY_TEXT, add_special_tokens=False),
                              tokenizer.eos_token_id)
    servicer.delay_s = 0.05
    with live_gateway(tokenizer, servicer) as (gateway, _):
        yield openai_client(gateway, timeout=30), servicer


def _others_cancelled(servicer: OneChoiceFails, num_choices: int) -> None:
    request_id = servicer.requests[-1].request_id.rsplit("-", 1)[0]
    for index in range(num_choices):
        if index != FAILING_CHOICE:
            assert servicer.wait_cancelled(f"{request_id}-{index}"), index


@pytest.mark.parametrize("n", [2, 4])
def test_a_failing_choice_is_the_requests_error(live, n: int) -> None:
    client, servicer = live
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=SERVED_MODEL, prompt="Hello", n=n, max_tokens=200,
                                  extra_body={"ignore_eos": True})
    assert refused.value.status_code == 400
    # The verifier's error JSON: its message, and the field it names (gRPC trailing metadata).
    assert refused.value.body["message"] == MESSAGE
    assert refused.value.body["param"] == "grammar"
    _others_cancelled(servicer, n)


def test_a_failing_streamed_choice_is_an_error_event(live) -> None:
    client, servicer = live
    stream = client.chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=200,
        stream=True, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError) as failed:
        for _ in stream:
            pass
    assert "exceeded the grammar library's limits" in failed.value.message
    _others_cancelled(servicer, 3)
