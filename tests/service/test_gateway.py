"""The gateway through the real OpenAI client, against a fake verifier on real gRPC."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.fake_verifier import (
    MAX_MODEL_LEN,
    REPLY_TEXT,
    SERVED_MODEL,
    FakeVerifier,
    LiveGateway,
    live_gateway,
)


MESSAGES = [{"role": "user", "content": "What is the answer?"}]


@pytest.fixture(scope="module")
def live(tokenizer) -> Iterator[tuple[LiveGateway, FakeVerifier]]:
    with live_gateway(tokenizer) as live:
        yield live


@pytest.fixture()
def fake(live) -> Iterator[FakeVerifier]:
    servicer = live[1]
    servicer.delay_s = 0.0
    servicer.abort_code = None
    yield servicer
    servicer.delay_s = 0.0


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED_MODEL]
    assert models.data[0].object == "model"


def test_chat_non_streaming(client, fake, tokenizer):
    completion = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES)
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion"
    assert completion.model == SERVED_MODEL
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == REPLY_TEXT
    assert choice.finish_reason == "stop"
    num_reply_tokens = len(tokenizer.encode(REPLY_TEXT, add_special_tokens=False)) + 1  # EOS
    prompt_ids = tokenizer.encode(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)
    assert completion.usage.prompt_tokens == len(prompt_ids)
    assert completion.usage.completion_tokens == num_reply_tokens
    assert completion.usage.total_tokens == len(prompt_ids) + num_reply_tokens
    request = fake.requests[-1]
    assert list(request.prompt_token_ids) == prompt_ids
    # vLLM's default max_tokens: whatever the context leaves.
    assert request.sampling.max_tokens == MAX_MODEL_LEN - len(prompt_ids)
    assert request.sampling.temperature == pytest.approx(1.0)
    speculation = completion.usage.model_extra["speculation"]
    assert speculation["num_drafts"] > 0
    assert speculation["num_accepted_tokens"] == num_reply_tokens - speculation["num_drafts"]
    assert speculation["acceptance_rate"] == pytest.approx(
        speculation["num_accepted_tokens"] / speculation["num_draft_tokens"])
    assert speculation["mean_acceptance_length"] == pytest.approx(
        num_reply_tokens / speculation["num_drafts"])


def test_chat_streaming_with_usage(client, fake):
    stream = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.id.startswith("chatcmpl-") for c in chunks)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(content) == REPLY_TEXT
    # Incremental detokenization never sends a partial multi-byte character.
    assert not any("\ufffd" in piece for piece in content)
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish_reasons[-1] == "stop" and set(finish_reasons[:-1]) == {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done(base_url, fake):
    body = {"model": SERVED_MODEL, "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert raw.endswith("data: [DONE]\n\n")
    json.loads(events[-2][len("data: "):])  # every other event is a JSON chunk


def test_completion_text_prompt(client, fake, tokenizer):
    completion = client.completions.create(model=SERVED_MODEL, prompt="Hello world",
                                           max_tokens=5, temperature=0, seed=7,
                                           top_p=0.5, extra_body={"top_k": 20})
    assert completion.id.startswith("cmpl-")
    assert completion.object == "text_completion"
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 5
    reply_ids = tokenizer.encode(REPLY_TEXT, add_special_tokens=False)
    assert choice.text == tokenizer.decode(reply_ids[:5])
    request = fake.requests[-1]
    assert list(request.prompt_token_ids) == tokenizer.encode("Hello world")
    assert request.sampling.max_tokens == 5
    assert request.sampling.temperature == 0.0
    assert request.sampling.seed == 7
    assert request.sampling.top_k == 20
    assert request.sampling.top_p == pytest.approx(0.5)


def test_completion_token_prompt_streaming(client, fake):
    stream = client.completions.create(model=SERVED_MODEL, prompt=[5, 6, 7], stream=True,
                                       max_tokens=64, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY_TEXT
    assert chunks[-1].usage.prompt_tokens == 3
    assert list(fake.requests[-1].prompt_token_ids) == [5, 6, 7]


def test_max_tokens_defaults_as_in_vllm(client, fake):
    """A text completion without max_tokens gets 16 (vLLM's and OpenAI's default), at most
    the room left; a chat completion gets the room left in the context."""
    client.completions.create(model=SERVED_MODEL, prompt=[5, 6, 7])
    assert fake.requests[-1].sampling.max_tokens == 16
    client.completions.create(model=SERVED_MODEL, prompt=[5] * (MAX_MODEL_LEN - 10))
    assert fake.requests[-1].sampling.max_tokens == 10
    client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES)
    num_prompt_tokens = len(fake.requests[-1].prompt_token_ids)
    assert fake.requests[-1].sampling.max_tokens == MAX_MODEL_LEN - num_prompt_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=SERVED_MODEL, prompt=[5, 6, 7], extra_body={"min_tokens": 17})
    assert refused.value.body["param"] == "min_tokens"


def test_max_completion_tokens_wins_over_max_tokens(client, fake):
    completion = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, max_tokens=10, max_completion_tokens=3)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 3
    assert fake.requests[-1].sampling.max_tokens == 3


def test_extension_fields_reach_the_verifier(client, fake):
    client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, max_tokens=2,
        extra_body={"speculation": 2, "repetition_penalty": 1.3, "ignore_eos": True,
                    "stop_token_ids": [9, 10]})
    request = fake.requests[-1]
    assert request.speculation.enabled is True
    assert request.speculation.num_speculative_tokens == 2
    assert request.sampling.repetition_penalty == pytest.approx(1.3)
    assert request.sampling.ignore_eos is True
    assert list(request.sampling.stop_token_ids) == [9, 10]
    client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=2,
                                   extra_body={"speculation": False})
    assert fake.requests[-1].speculation.enabled is False
    client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=2)
    assert not fake.requests[-1].speculation.HasField("enabled")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_tokens_cancels_the_call(client, fake, tokenizer, stream):
    stop = "lo again"  # "Hello" + " again": starts inside one token, ends in the next
    assert len(tokenizer.encode(stop, add_special_tokens=False)) > 1
    fake.delay_s = 0.02  # the reply is still streaming when the stop string shows up
    kwargs = dict(model=SERVED_MODEL, messages=MESSAGES, stop=[stop, "never"],
                  extra_body={"ignore_eos": True}, max_tokens=200)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        pieces = [c.choices[0].delta.content or "" for c in chunks]
        text = "".join(pieces)
        finish_reason = chunks[-1].choices[0].finish_reason
        assert not any("again" in piece for piece in pieces)
    else:
        completion = client.chat.completions.create(**kwargs)
        text = completion.choices[0].message.content
        finish_reason = completion.choices[0].finish_reason
    assert text == REPLY_TEXT[:REPLY_TEXT.index(stop)]
    assert finish_reason == "stop"
    assert fake.wait_cancelled(fake.requests[-1].request_id)


def test_stop_string_in_completions(client, fake):
    completion = client.completions.create(model=SERVED_MODEL, prompt="Hi", stop="café")
    assert completion.choices[0].text == REPLY_TEXT[:REPLY_TEXT.index("café")]
    assert completion.choices[0].finish_reason == "stop"


def _request_id_with_max_tokens(fake, max_tokens: int) -> str:
    """The id of the call that asked for `max_tokens`: a marker, since a straggler of an
    earlier test (a client's retry) may reach the fake verifier first."""
    return next(request.request_id for request in reversed(fake.requests)
                if request.sampling.max_tokens == max_tokens)


def test_client_disconnect_cancels_the_call(base_url, fake):
    fake.delay_s = 0.05
    body = {"model": SERVED_MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 201,
            "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        next(response.iter_lines())
    request_id = _request_id_with_max_tokens(fake, 201)
    assert fake.wait_cancelled(request_id)
    assert request_id not in fake.completed_ids


def test_non_streaming_disconnect_cancels_the_call(base_url, fake):
    # Slow enough that the reply cannot complete before a loaded machine sees the client go.
    fake.delay_s = 0.2
    body = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 202, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=0.3)
    request_id = _request_id_with_max_tokens(fake, 202)
    assert fake.wait_cancelled(request_id, timeout_s=15.0)
    assert request_id not in fake.completed_ids


def test_health_and_metrics(client, base_url, fake):
    health = httpx.get(f"{base_url}/health").json()
    assert health["status"] == "ok"
    assert list(health["verifiers"].values()) == ["serving"]
    assert health["deterministic"] is True  # every verifier says it is
    client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES)
    text = httpx.get(f"{base_url}/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    label = f'{{model_name="{SERVED_MODEL}"}}'
    assert samples[f"vllm:spec_decode_num_drafts_total{label}"] > 0
    assert samples[f"vllm:spec_decode_num_draft_tokens_total{label}"] > 0
    assert samples[f"vllm:spec_decode_num_accepted_tokens_total{label}"] > 0
    assert samples[f"vllm:time_to_first_token_seconds_count{label}"] > 0
    assert samples[f"vllm:e2e_request_latency_seconds_count{label}"] > 0
    assert samples[f"vllm:time_per_output_token_seconds_count{label}"] > 0
    assert samples['specdec:gateway_http_requests_total{endpoint="/v1/chat/completions",'
                   'status="200"}'] > 0


def test_served_model_name_is_optional_in_requests(base_url, fake):
    response = httpx.post(f"{base_url}/v1/chat/completions",
                          json={"messages": MESSAGES, "max_tokens": 1})
    assert response.status_code == 200
    assert response.json()["model"] == SERVED_MODEL


def test_stop_strings_wait_for_min_tokens(client, fake, tokenizer):
    """As vLLM: no stop condition is checked before min_tokens tokens are out, so a stop
    string in the first tokens is output text and the next occurrence stops."""
    first = REPLY_TEXT.index("world")
    assert REPLY_TEXT.count("world") == 2
    min_tokens = len(tokenizer.encode(REPLY_TEXT[:first + len("world")], add_special_tokens=False)) + 1
    completion = client.completions.create(model=SERVED_MODEL, prompt="Hi", stop="world",
                                           max_tokens=64, extra_body={"min_tokens": min_tokens})
    assert completion.choices[0].text == REPLY_TEXT[:REPLY_TEXT.index("world", first + 1)]
    assert completion.choices[0].finish_reason == "stop"
    plain = client.completions.create(model=SERVED_MODEL, prompt="Hi", stop="world")
    assert plain.choices[0].text == REPLY_TEXT[:first]
