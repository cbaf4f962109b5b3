"""vLLM's request fields on both completion routes, against a fake verifier on real gRPC:
every field vLLM's ChatCompletionRequest and CompletionRequest know is honoured or refused
with a 400 naming it (the walk below), and the honoured ones do what vLLM does: the chat
template's switches, echo, return_token_ids, include_stop_str_in_output, special tokens,
prompt truncation and request_id."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tokenizers import processors

from tests.support.fake_verifier import (
    REPLY_TEXT,
    SERVED_MODEL,
    FakeVerifier,
    LiveGateway,
    build_tiny_tokenizer,
    live_gateway,
)

MESSAGES = [{"role": "user", "content": "What is the answer?"}]
CONTINUED = [*MESSAGES, {"role": "assistant", "content": "The answer"}]
CHAT = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 4}
COMPLETION = {"model": SERVED_MODEL, "prompt": "the quick brown fox", "max_tokens": 4}

# vLLM's ChatCompletionRequest fields (vllm/entrypoints/openai/chat_completion/protocol.py),
# each with a value other than its default, and what specdec does with it. A request
# carrying the value must be answered (honoured) or be a 400 naming the field (refused).
# Fields a test elsewhere covers in depth still appear here, so none can be dropped.
HONOURED, REFUSED = "honoured", "refused"
SHARED_FIELDS: dict[str, tuple[str, Any]] = {
    "model": (HONOURED, SERVED_MODEL),
    "frequency_penalty": (HONOURED, 0.5),
    "logit_bias": (HONOURED, {"7": 1.0}),
    "max_tokens": (HONOURED, 3),
    "n": (HONOURED, 2),
    "presence_penalty": (HONOURED, 0.5),
    "response_format": (HONOURED, {"type": "json_object"}),
    "seed": (HONOURED, 7),
    "stop": (HONOURED, ["world"]),
    "stream": (HONOURED, True),
    "stream_options": (HONOURED, {"include_usage": True}),
    "temperature": (HONOURED, 0.0),
    "top_p": (HONOURED, 0.5),
    "user": (HONOURED, "someone"),  # a label, as in vLLM
    "use_beam_search": (REFUSED, True),
    "top_k": (HONOURED, 5),
    "min_p": (HONOURED, 0.1),
    "repetition_penalty": (HONOURED, 1.2),
    "watermarking": (REFUSED, True),
    "length_penalty": (REFUSED, 0.5),
    "stop_token_ids": (HONOURED, [9]),
    "include_stop_str_in_output": (HONOURED, True),
    "ignore_eos": (HONOURED, True),
    "min_tokens": (HONOURED, 2),
    "skip_special_tokens": (HONOURED, False),
    "spaces_between_special_tokens": (HONOURED, False),
    "truncate_prompt_tokens": (HONOURED, 3),
    "truncation_side": (HONOURED, "right"),
    "prompt_logprobs": (REFUSED, 1),
    "logprob_token_ids": (REFUSED, [1]),
    "allowed_token_ids": (REFUSED, [1, 2]),
    "bad_words": (REFUSED, ["x"]),
    "echo": (HONOURED, True),
    "add_special_tokens": (HONOURED, True),
    "structured_outputs": (HONOURED, {"regex": "[a-z]+"}),
    "priority": (REFUSED, 1),
    "request_id": (HONOURED, "my-request-1"),
    "session_id": (HONOURED, "session-1"),  # a label, as `user`
    "return_tokens_as_token_ids": (REFUSED, True),
    "return_token_ids": (HONOURED, True),
    "routed_experts_prompt_start": (REFUSED, 1),
    "return_token_offsets": (REFUSED, True),
    "return_mm_kwargs": (REFUSED, False),
    "cache_salt": (HONOURED, "salt-of-sixteen-chars-at-least-0123456789abcdef"),
    "kv_transfer_params": (REFUSED, {"do_remote_decode": True}),
    "ec_transfer_params": (REFUSED, {"x": 1}),
    "vllm_xargs": (REFUSED, {"x": 1}),
    "repetition_detection": (REFUSED, {"max_pattern_size": 4}),
    "stream_interval": (REFUSED, 4),
    "thinking_token_budget": (REFUSED, 16),
    # vLLM's older names.
    "guided_json": (HONOURED, {"type": "object"}),
    "guided_regex": (HONOURED, "[a-z]+"),
    "guided_choice": (HONOURED, ["yes", "no"]),
    "guided_grammar": (HONOURED, 'root ::= "yes"'),
    "guided_whitespace_pattern": (REFUSED, " "),
    "logits_processors": (REFUSED, ["my.module:Processor"]),
}
CHAT_FIELDS: dict[str, tuple[str, Any]] = {
    **SHARED_FIELDS,
    "messages": (HONOURED, CONTINUED),
    "logprobs": (HONOURED, True),
    "top_logprobs": (HONOURED, 2),
    "max_completion_tokens": (HONOURED, 3),
    "tools": (HONOURED, [{"type": "function", "function": {"name": "f"}}]),
    "tool_choice": (HONOURED, "none"),
    "reasoning_effort": (REFUSED, "low"),
    "include_reasoning": (REFUSED, False),
    "parallel_tool_calls": (HONOURED, False),
    "add_generation_prompt": (HONOURED, False),
    "continue_final_message": (HONOURED, True),
    "documents": (HONOURED, [{"title": "t", "text": "x"}]),
    "chat_template": (REFUSED, "{{ messages }}"),
    "chat_template_kwargs": (HONOURED, {"enable_thinking": False}),
    "media_io_kwargs": (REFUSED, {"image": {}}),
    "mm_processor_kwargs": (REFUSED, {"x": 1}),
    "return_prompt_text": (REFUSED, True),
}
COMPLETION_FIELDS: dict[str, tuple[str, Any]] = {
    **SHARED_FIELDS,
    "prompt": (HONOURED, [5, 6, 7, 8]),
    "logprobs": (HONOURED, 2),
    "suffix": (REFUSED, "x"),
    "prompt_embeds": (REFUSED, "AAAA"),
}
# What a field needs beside it to be meaningful (a continued message needs its switch off).
COMPANIONS: dict[str, dict[str, Any]] = {
    "stream_options": {"stream": True},
    "top_logprobs": {"logprobs": True},
    "continue_final_message": {"messages": CONTINUED, "add_generation_prompt": False},
    "truncation_side": {"truncate_prompt_tokens": 3},
    # "auto" (the default with tools) needs the gateway's flag: tests/service/test_tool_calls_gateway.py.
    "tools": {"tool_choice": "required"},
}


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_tiny_tokenizer()
    # A BOS on plain text, so that add_special_tokens has something to add.
    bos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos_id)])
    return tokenizer


@pytest.fixture(scope="module")
def live(tokenizer) -> Iterator[tuple[LiveGateway, FakeVerifier]]:
    with live_gateway(tokenizer) as live:
        yield live


@pytest.fixture(scope="module")
def fake(live) -> FakeVerifier:
    return live[1]


def _post(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    if body.get("stream"):
        with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=30) as response:
            response.read()
            return response
    return httpx.post(f"{base_url}{path}", json=body, timeout=30)


@pytest.mark.parametrize("path,fields,base", [
    ("/v1/chat/completions", CHAT_FIELDS, CHAT),
    ("/v1/completions", COMPLETION_FIELDS, COMPLETION),
], ids=["chat", "completions"])
def test_every_vllm_field_is_honoured_or_refused_naming_it(base_url, fake, path, fields, base):
    wrong = []
    for name, (kind, value) in fields.items():
        body = {**base, **COMPANIONS.get(name, {}), name: value}
        num_requests = len(fake.requests)
        response = _post(base_url, path, body)
        if kind == HONOURED:
            if response.status_code != 200:
                wrong.append(f"{name}: {response.status_code} {response.text[:200]}")
            continue
        error = response.json().get("error", {}) if response.status_code == 400 else {}
        if error.get("param") != name or name not in error.get("message", ""):
            wrong.append(f"{name}: expected a 400 naming it, got {response.status_code} "
                         f"{response.text[:200]}")
        elif len(fake.requests) != num_requests:
            wrong.append(f"{name}: refused but sent to the verifier")
    assert not wrong, "\n".join(wrong)


def _prompt_text(fake: FakeVerifier, tokenizer) -> str:
    return tokenizer.decode(fake.requests[-1].prompt_token_ids)


def test_continue_final_message_leaves_the_assistant_message_open(client, fake, tokenizer):
    client.chat.completions.create(
        model=SERVED_MODEL, messages=CONTINUED, max_tokens=2,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    prompt = _prompt_text(fake, tokenizer)
    assert prompt.endswith("<|im_start|>assistant\nThe answer"), prompt
    client.chat.completions.create(model=SERVED_MODEL, messages=CONTINUED, max_tokens=2)
    assert _prompt_text(fake, tokenizer).endswith("The answer<|im_end|>\n<|im_start|>assistant\n")


def test_continue_final_message_needs_add_generation_prompt_off(base_url):
    response = httpx.post(f"{base_url}/v1/chat/completions",
                          json={**CHAT, "messages": CONTINUED, "continue_final_message": True})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "continue_final_message"
    assert "add_generation_prompt" in response.json()["error"]["message"]


def test_add_generation_prompt_false_renders_no_assistant_turn(client, fake, tokenizer):
    client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=2,
                                   extra_body={"add_generation_prompt": False})
    assert _prompt_text(fake, tokenizer).endswith("What is the answer?<|im_end|>\n")


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(client, stream):
    def content(**extra: Any) -> tuple[str, str]:
        kwargs = dict(model=SERVED_MODEL, messages=MESSAGES, stop=["world!"], max_tokens=40,
                      extra_body=extra)
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            return choice.message.content, choice.finish_reason
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        return text, chunks[-1].choices[0].finish_reason

    assert content() == ("Hello ", "stop")
    assert content(include_stop_str_in_output=True) == ("Hello world!", "stop")


def test_include_stop_str_with_stop_token_ids_is_refused(base_url):
    response = httpx.post(f"{base_url}/v1/chat/completions",
                          json={**CHAT, "include_stop_str_in_output": True,
                                "stop_token_ids": [9]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "include_stop_str_in_output"


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_prepends_the_prompt(client, stream):
    kwargs = dict(model=SERVED_MODEL, prompt="the quick brown fox", max_tokens=3, echo=True)
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    else:
        text = client.completions.create(**kwargs).choices[0].text
    plain = client.completions.create(**{**kwargs, "echo": False}).choices[0].text
    assert text == "the quick brown fox" + plain


def test_completion_echo_of_token_ids_decodes_the_truncated_prompt(client, tokenizer, fake):
    prompt_ids = tokenizer.encode("the quick brown fox", add_special_tokens=False)
    completion = client.completions.create(
        model=SERVED_MODEL, prompt=prompt_ids, max_tokens=2, echo=True,
        extra_body={"truncate_prompt_tokens": 2})
    assert list(fake.requests[-1].prompt_token_ids) == prompt_ids[-2:]
    assert completion.choices[0].text.startswith(tokenizer.decode(prompt_ids[-2:]))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_repeats_the_continued_assistant_message(client, stream):
    kwargs = dict(model=SERVED_MODEL, messages=CONTINUED, max_tokens=3,
                  extra_body={"echo": True, "continue_final_message": True,
                              "add_generation_prompt": False})
    if stream:
        text = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(stream=True, **kwargs))
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    assert text.startswith("The answer") and len(text) > len("The answer")
    # Echo needs the last message to be the assistant's: a user's is not repeated.
    plain = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=3,
                                           extra_body={"echo": True})
    assert not plain.choices[0].message.content.startswith("What is")


def test_echo_with_logprobs_is_refused(base_url):
    response = httpx.post(f"{base_url}/v1/completions",
                          json={**COMPLETION, "echo": True, "logprobs": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_return_token_ids_in_vllm_shape(base_url, fake, tokenizer, path):
    base = CHAT if path == "/v1/chat/completions" else COMPLETION
    body = {**base, "max_tokens": 6, "return_token_ids": True}
    whole = httpx.post(f"{base_url}{path}", json=body).json()
    reply_ids = tokenizer.encode(REPLY_TEXT, add_special_tokens=False)
    assert whole["prompt_token_ids"] == list(fake.requests[-1].prompt_token_ids)
    assert whole["choices"][0]["token_ids"] == reply_ids[:6]
    with httpx.stream("POST", f"{base_url}{path}", json={**body, "stream": True}) as response:
        events = [line[len("data: "):] for line in response.iter_lines()
                  if line.startswith("data: ")]
    chunks = [httpx.Response(200, content=event).json() for event in events[:-1]]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert not any("prompt_token_ids" in chunk for chunk in chunks[1:])
    streamed = [token for chunk in chunks for token in chunk["choices"][0]["token_ids"]]
    assert streamed == reply_ids[:6]
    plain = httpx.post(f"{base_url}{path}", json=base).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_skip_special_tokens_false_shows_the_eos_text(client):
    kwargs = dict(model=SERVED_MODEL, messages=MESSAGES, max_tokens=100)
    assert client.chat.completions.create(**kwargs).choices[0].message.content == REPLY_TEXT
    shown = client.chat.completions.create(**kwargs, extra_body={"skip_special_tokens": False})
    assert shown.choices[0].message.content == REPLY_TEXT + "<|im_end|>"


@pytest.mark.parametrize("side,expected", [("left", slice(-3, None)), ("right", slice(0, 3))])
def test_truncate_prompt_tokens_keeps_the_side_asked(client, fake, side, expected):
    prompt_ids = [5, 6, 7, 8, 9, 10]
    client.completions.create(model=SERVED_MODEL, prompt=prompt_ids, max_tokens=2,
                              extra_body={"truncate_prompt_tokens": 3, "truncation_side": side})
    assert list(fake.requests[-1].prompt_token_ids) == prompt_ids[expected]


def test_truncate_prompt_tokens_over_the_context_is_a_400(base_url):
    response = httpx.post(f"{base_url}/v1/completions",
                          json={**COMPLETION, "truncate_prompt_tokens": 10_000})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "truncate_prompt_tokens"


def test_request_id_names_the_response(client):
    completion = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES,
                                                max_tokens=2, extra_body={"request_id": "abc-1"})
    assert completion.id == "chatcmpl-abc-1"


def test_chat_template_kwargs_cannot_set_apply_chat_template_arguments(base_url):
    response = httpx.post(f"{base_url}/v1/chat/completions",
                          json={**CHAT, "chat_template_kwargs": {"tokenize": True}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_add_special_tokens(base_url, fake, tokenizer):
    bos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text_ids = tokenizer.encode("the quick brown fox", add_special_tokens=False)
    httpx.post(f"{base_url}/v1/completions", json=COMPLETION)
    assert list(fake.requests[-1].prompt_token_ids) == [bos_id, *text_ids]
    httpx.post(f"{base_url}/v1/completions", json={**COMPLETION, "add_special_tokens": False})
    assert list(fake.requests[-1].prompt_token_ids) == text_ids
    # Chat: the template writes the special tokens; the request may ask for the BOS too.
    httpx.post(f"{base_url}/v1/chat/completions", json=CHAT)
    assert fake.requests[-1].prompt_token_ids[0] != bos_id
    httpx.post(f"{base_url}/v1/chat/completions", json={**CHAT, "add_special_tokens": True})
    assert fake.requests[-1].prompt_token_ids[0] == bos_id
