"""vLLM's routes beside the completions, against a fake verifier on real gRPC: the Responses
API through the official `openai` client (text, streaming events, instructions, input
messages, text.format, function tools, the fields it refuses), `/v1/models/{id}` through
the client, and `/tokenize`, `/detokenize`, `/version`, `/ping` with httpx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import httpx
import openai
import pytest

from tests.support.fake_verifier import (
    REPLY_TEXT,
    SERVED_MODEL,
    FakeVerifier,
    LiveGateway,
    live_gateway,
)

from specdec.v1 import specdec_pb2

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}
ARGUMENTS = '{"city": "Oslo"}'
HERMES_TEXT = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
               "\n</tool_call>")


@pytest.fixture(scope="module")
def live(tokenizer) -> Iterator[tuple[LiveGateway, FakeVerifier]]:
    # Room for the fallback tool prompt, which is long for the tiny tokenizer.
    with live_gateway(tokenizer, max_model_len=4096, enable_auto_tool_choice=True,
                      tool_call_parser="hermes") as live:
        yield live


@pytest.fixture()
def fake(live, tokenizer) -> Iterator[FakeVerifier]:
    yield live[1]
    live[1].reply_for = None


def _prompt(fake: FakeVerifier, tokenizer) -> str:
    return tokenizer.decode(list(fake.requests[-1].prompt_token_ids))


def _script(fake: FakeVerifier, tokenizer, text: str, grammar_text: str | None = None) -> None:
    def reply_for(request: specdec_pb2.GenerateRequest) -> list[int]:
        use = grammar_text if request.sampling.HasField("grammar") and grammar_text else text
        return tokenizer.encode(use, add_special_tokens=False)

    fake.reply_for = reply_for


def test_responses_text_with_instructions(client, fake, tokenizer):
    response = client.responses.create(model=SERVED_MODEL, input="What is the answer?",
                                       instructions="Be brief.", max_output_tokens=200)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.model == SERVED_MODEL
    assert response.output_text == REPLY_TEXT
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert _prompt(fake, tokenizer).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the answer?")
    assert fake.requests[-1].sampling.max_tokens == 200
    assert response.usage.input_tokens == len(fake.requests[-1].prompt_token_ids)
    assert response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_responses_cut_short_is_incomplete(client, fake):
    response = client.responses.create(model=SERVED_MODEL, input="Hi", max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_responses_input_messages_and_function_calls(client, fake, tokenizer):
    client.responses.create(model=SERVED_MODEL, max_output_tokens=5, input=[
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": ARGUMENTS},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
        {"role": "user", "content": "Thanks"},
    ])
    prompt = _prompt(fake, tokenizer)
    for piece in ("<|im_start|>system\nUse tools.", "<|im_start|>user\nWeather in Oslo?",
                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                  "<tool_response>\nsunny\n</tool_response>", "It is sunny.",
                  "<|im_start|>user\nThanks"):
        assert piece in prompt


def test_responses_streaming_events(client, fake):
    events = list(client.responses.create(model=SERVED_MODEL, input="Hi", stream=True,
                                          max_output_tokens=200))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == REPLY_TEXT == events[-4].text
    assert events[-1].response.output_text == REPLY_TEXT
    assert events[-1].response.usage.output_tokens > 0


def test_responses_structured_output_via_text_format(client, fake, tokenizer):
    _script(fake, tokenizer, REPLY_TEXT, grammar_text=ARGUMENTS)
    schema = WEATHER["parameters"]
    response = client.responses.create(
        model=SERVED_MODEL, input="Pick a city", max_output_tokens=50,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                         "strict": True}})
    grammar = fake.requests[-1].sampling.grammar
    assert grammar.kind == "json_schema" and json.loads(grammar.value) == schema
    assert json.loads(response.output_text) == {"city": "Oslo"}


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_tools(client, fake, tokenizer, stream):
    _script(fake, tokenizer, HERMES_TEXT, grammar_text=ARGUMENTS)
    kwargs: dict[str, Any] = dict(model=SERVED_MODEL, input="Weather?", tools=[WEATHER],
                                  max_output_tokens=200)
    forced = dict(kwargs, tool_choice={"type": "function", "name": "get_weather"})
    if not stream:
        response = client.responses.create(**kwargs)  # "auto": the fallback prompt, parsed
        assert "get_weather" in _prompt(fake, tokenizer)
        message, call = response.output
        assert message.type == "message" and response.output_text == "Checking."
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.call_id.startswith("call_") and json.loads(call.arguments) == {"city": "Paris"}
        [call] = client.responses.create(**forced).output
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
        return
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds
    done = events[-1].response
    assert [item.type for item in done.output] == ["message", "function_call"]
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == json.loads(done.output[1].arguments) == {"city": "Paris"}
    events = list(client.responses.create(stream=True, **forced))
    assert json.loads(events[-1].response.output[0].arguments) == {"city": "Oslo"}


@pytest.mark.parametrize("field, value", [
    ("previous_response_id", "resp_123"),
    ("store", True),
    ("background", True),
    ("include", ["reasoning.encrypted_content"]),
    ("reasoning", {"effort": "low"}),
    ("truncation", "auto"),
    ("tools", [{"type": "web_search"}]),
    ("input", [{"type": "input_image", "image_url": "x"}]),
    ("text", {"format": {"type": "yaml"}}),
])
def test_responses_fields_it_cannot_honour_are_400s(base_url, fake, field, value):
    before = len(fake.requests)
    response = httpx.post(f"{base_url}/v1/responses",
                          json={"model": SERVED_MODEL, "input": "Hi", field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].split(".")[0] == field and field in error["message"]
    assert len(fake.requests) == before


def test_models_retrieve(client):
    model = client.models.retrieve(SERVED_MODEL)
    assert model.id == SERVED_MODEL and model.object == "model"
    assert model.model_extra["max_model_len"] == 4096
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("other-model")
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["type"] == "invalid_request_error"
    assert "other-model" in caught.value.body["message"]


def test_tokenize_and_detokenize(base_url, tokenizer):
    text = "Hello world"
    body = httpx.post(f"{base_url}/tokenize", json={"model": SERVED_MODEL, "prompt": text,
                                                    "return_token_strs": True}).json()
    ids = tokenizer.encode(text)
    assert body == {"count": len(ids), "max_model_len": 4096, "tokens": ids,
                    "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)
    assert chat["token_strs"] is None
    back = httpx.post(f"{base_url}/detokenize", json={"tokens": ids}).json()
    assert back == {"prompt": text}
    bad = httpx.post(f"{base_url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    wrong_model = httpx.post(f"{base_url}/tokenize", json={"model": "x", "prompt": "a"})
    assert wrong_model.status_code == 404


def test_version_and_ping(base_url):
    assert httpx.get(f"{base_url}/version").json() == {"version": metadata.version("specdec")}
    for method in ("GET", "POST"):
        response = httpx.request(method, f"{base_url}/ping")
        assert response.status_code == 200 and response.content == b""

