"""Chat messages refused before they cost anything (issue 44, item 9): a tool message
whose tool_call_id answers no earlier call is a 400 naming it (OpenAI's rule), and a prompt
longer than the context can hold however it tokenizes (10 MB of tool-call arguments) is a
400 before it is tokenized. Through the official openai client against the gateway."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.support.fake_verifier import (
    MAX_MODEL_LEN,
    SERVED_MODEL,
    FakeVerifier,
    live_gateway,
    openai_client,
)

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}


class CountingTokenizer:
    """Records the length of every text the gateway encodes."""

    def __init__(self, tokenizer: Any) -> None:
        self.encoded_lengths: list[int] = []
        encode = tokenizer.encode

        def counting(text: Any, *args: Any, **kwargs: Any) -> Any:
            self.encoded_lengths.append(len(text))
            return encode(text, *args, **kwargs)

        tokenizer.encode = counting


@pytest.fixture(scope="module")
def live(tokenizer) -> Iterator[tuple[openai.OpenAI, FakeVerifier, CountingTokenizer]]:
    counter = CountingTokenizer(tokenizer)
    with live_gateway(tokenizer) as (gateway, servicer):
        yield openai_client(gateway, timeout=60), servicer, counter


def _messages(call_id: str, arguments: str = CALL["function"]["arguments"]) -> list[dict]:
    call = {**CALL, "function": {**CALL["function"], "arguments": arguments}}
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]


def test_a_tool_message_must_answer_an_earlier_call(live) -> None:
    client, _, _ = live
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=SERVED_MODEL, max_tokens=4,
                                       messages=_messages("call_unknown"))
    assert refused.value.body["param"] == "messages[2].tool_call_id"
    assert "'call_unknown' answers no tool call" in refused.value.message
    answer = client.chat.completions.create(model=SERVED_MODEL, max_tokens=4,
                                            messages=_messages("call_1"))
    assert answer.choices[0].message.content


def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized(live) -> None:
    client, servicer, counter = live
    num_requests = len(servicer.requests)
    arguments = json.dumps({"city": "x" * (10 << 20)})
    counter.encoded_lengths.clear()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=SERVED_MODEL, max_tokens=4,
                                       messages=_messages("call_1", arguments))
    assert refused.value.body["param"] == "messages"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in refused.value.message
    assert max(counter.encoded_lengths, default=0) < 10 << 20
    assert len(servicer.requests) == num_requests
