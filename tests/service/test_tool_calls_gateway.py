"""Tool calls through the gateway with the official `openai` client, against a fake verifier
that answers what a grammar-masked model would: named and required tool choice (forced by
the tool grammar the verifier receives), "auto" (the tools rendered by a chat template that
takes them, the Hermes output parsed), "none", conversations carrying tool calls and tool
results, and the 400s for what a gateway or template cannot do."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.fake_verifier import (
    REPLY_TEXT,
    SERVED_MODEL,
    FakeVerifier,
    FakeVerifierServer,
    LiveGateway,
    build_tiny_tokenizer,
    gateway_config,
)

from gateway.__main__ import build_parser
from gateway.config import GatewayConfig
from specdec import launcher
from specdec.errors import ConfigError
from specdec.v1 import specdec_pb2

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                       "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARGUMENTS = '{"city": "Paris", "days": 2}'
REQUIRED_TEXT = ('[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}, '
                 '{"name": "get_time", "parameters": {"zone": "CET"}}]')
HERMES_TEXT = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
               '"arguments": {"zone": "UTC"}}\n</tool_call>')
# A template that renders tools (and an assistant's tool calls), as Hermes-style models do.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS {% for t in tools %}{{ t.function.name }} "
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
    "{{ c.function.arguments.city }}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _reply(tokenizer: Any, text_for_grammar: dict[str, str], plain: str | None):
    """The fake's script: a tool grammar's answer, else `plain` (None: the fixed reply)."""

    def reply_for(request: specdec_pb2.GenerateRequest) -> list[int] | None:
        if request.sampling.HasField("grammar"):
            schema = json.loads(request.sampling.grammar.value)
            text = text_for_grammar["array" if schema.get("type") == "array" else "object"]
        elif plain is None:
            return None
        else:
            text = plain
        return tokenizer.encode(text, add_special_tokens=False)

    return reply_for


@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, Any]]:
    tokenizer = build_tiny_tokenizer()
    tools_tokenizer = build_tiny_tokenizer()
    tools_tokenizer.chat_template = TOOLS_TEMPLATE
    fake = FakeVerifier(tokenizer.encode(REPLY_TEXT, add_special_tokens=False),
                        tokenizer.eos_token_id)
    server = FakeVerifierServer(fake)
    server.start()
    auto = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    gateways = {
        "plain": LiveGateway(gateway_config(server.address), tokenizer),
        # specdec's fallback tool prompt is long for the tiny tokenizer: room for it.
        "auto_no_template": LiveGateway(gateway_config(server.address, max_model_len=4096,
                                                       **auto), tokenizer),
        "auto": LiveGateway(gateway_config(server.address, **auto), tools_tokenizer),
    }
    for gateway in gateways.values():
        gateway.start()
    yield {"fake": fake, "tokenizer": tokenizer, "gateways": gateways,
           "clients": {name: openai.OpenAI(base_url=f"{g.base_url}/v1", api_key="unused",
                                           max_retries=0) for name, g in gateways.items()}}
    for gateway in gateways.values():
        gateway.stop()
    server.close()


@pytest.fixture()
def fake(stack) -> Iterator[FakeVerifier]:
    stack["fake"].reply_for = _reply(stack["tokenizer"],
                                     {"object": ARGUMENTS, "array": REQUIRED_TEXT}, None)
    yield stack["fake"]
    stack["fake"].reply_for = None


def _prompt_text(stack, fake: FakeVerifier) -> str:
    return stack["tokenizer"].decode(list(fake.requests[-1].prompt_token_ids))


def _reassemble(chunks) -> tuple[str, list[dict[str, str]], str | None]:
    """Streamed deltas -> (content, calls, finish_reason), as a client accumulates them."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            if delta.id:
                assert call["id"] is None, "the id comes once, in the call's first delta"
                call["id"] = delta.id
                assert delta.type == "function" and delta.function.name
                call["name"] = delta.function.name
            else:
                assert call["id"] is not None, "a call's first delta carries its id and name"
            call["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, [calls[index] for index in sorted(calls)], reason


def test_named_tool_choice_gives_its_call(stack, fake):
    completion = stack["clients"]["plain"].chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=100)
    grammar = fake.requests[-1].sampling.grammar
    assert grammar.kind == "json_schema"
    assert json.loads(grammar.value) == WEATHER["function"]["parameters"]
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == json.loads(ARGUMENTS)
    assert "get_weather" not in _prompt_text(stack, fake)  # forced: nothing to render


def test_named_tool_choice_streams_openai_deltas(stack, fake):
    chunks = stack["clients"]["plain"].chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=100,
        stream=True)
    content, calls, reason = _reassemble(chunks)
    assert content == "" and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", json.loads(ARGUMENTS))]
    assert calls[0]["id"].startswith("call_")


@pytest.mark.parametrize("stream", [False, True])
def test_required_gives_one_or_more_calls(stack, fake, stream):
    client = stack["clients"]["plain"]
    result = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS,
                                            tool_choice="required", max_tokens=200, stream=stream)
    schema = json.loads(fake.requests[-1].sampling.grammar.value)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    if stream:
        content, calls, reason = _reassemble(result)
        calls = [(c["name"], json.loads(c["arguments"]), c["id"]) for c in calls]
    else:
        message = result.choices[0].message
        content, reason = message.content, result.choices[0].finish_reason
        calls = [(c.function.name, json.loads(c.function.arguments), c.id)
                 for c in message.tool_calls]
    assert not content and reason == "tool_calls"
    assert [(name, arguments) for name, arguments, _ in calls] == [
        ("get_weather", {"city": "Oslo", "days": 1}), ("get_time", {"zone": "CET"})]
    ids = [call_id for _, _, call_id in calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2


def test_required_without_parallel_calls_allows_one(stack, fake):
    stack["clients"]["plain"].chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=200)
    assert json.loads(fake.requests[-1].sampling.grammar.value)["maxItems"] == 1


def test_named_call_in_every_choice(stack, fake):
    completion = stack["clients"]["plain"].chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=100, n=2)
    assert [c.finish_reason for c in completion.choices] == ["tool_calls"] * 2
    ids = {c.message.tool_calls[0].id for c in completion.choices}
    assert len(ids) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_auto_renders_the_tools_and_parses_hermes_calls(stack, fake, stream):
    fake.reply_for = _reply(stack["tokenizer"], {}, HERMES_TEXT)
    result = stack["clients"]["auto"].chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, stream=stream)
    assert not fake.requests[-1].sampling.HasField("grammar")
    assert "TOOLS get_weather get_time" in _prompt_text(stack, fake)
    if stream:
        content, calls, reason = _reassemble(result)
        calls = [(c["name"], json.loads(c["arguments"])) for c in calls]
    else:
        message = result.choices[0].message
        content, reason = message.content, result.choices[0].finish_reason
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
        assert all(c.id.startswith("call_") for c in message.tool_calls)
    assert content == "Let me look." and reason == "tool_calls"
    assert calls == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC"})]


def test_auto_without_a_call_is_text_and_parallel_false_keeps_one_call(stack, fake):
    client = stack["clients"]["auto"]
    completion = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES,
                                                tools=TOOLS, tool_choice="auto", max_tokens=200)
    assert completion.choices[0].message.content == REPLY_TEXT
    assert completion.choices[0].message.tool_calls is None
    assert completion.choices[0].finish_reason == "stop"
    fake.reply_for = _reply(stack["tokenizer"], {}, HERMES_TEXT)
    completion = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES,
                                                tools=TOOLS, parallel_tool_calls=False,
                                                max_tokens=200)
    assert [c.function.name for c in completion.choices[0].message.tool_calls] == ["get_weather"]


def test_auto_needs_the_flag_and_says_which_to_add(stack, fake):
    before = len(fake.requests)
    for tool_choice in ("auto", openai.omit):
        with pytest.raises(openai.BadRequestError) as caught:
            stack["clients"]["plain"].chat.completions.create(
                model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice)
        assert caught.value.body["param"] == "tool_choice"
        assert "--enable-auto-tool-choice --tool-call-parser hermes" in caught.value.body["message"]
    assert len(fake.requests) == before


@pytest.mark.parametrize("stream", [False, True])
def test_auto_on_a_template_without_tools_uses_the_fallback_prompt(stack, fake, stream):
    fake.reply_for = _reply(stack["tokenizer"], {}, HERMES_TEXT)
    system = {"role": "system", "content": "Be brief."}
    result = stack["clients"]["auto_no_template"].chat.completions.create(
        model=SERVED_MODEL, messages=[system, *MESSAGES], tools=TOOLS, max_tokens=200,
        stream=stream)
    assert not fake.requests[-1].sampling.HasField("grammar")
    prompt = _prompt_text(stack, fake)
    # One system message: the client's text, then every function's schema and the format.
    assert prompt.count("<|im_start|>system") == 1
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou may call")
    tools_text = prompt[prompt.index("<tools>\n") + 8:prompt.index("\n</tools>")]
    assert [json.loads(line) for line in tools_text.split("\n")] == [
        {"type": "function", "function": {"name": t["function"]["name"],
                                          "parameters": t["function"]["parameters"],
                                          **({"description": t["function"]["description"]}
                                             if "description" in t["function"] else {})}}
        for t in TOOLS]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in prompt
    if stream:
        content, calls, reason = _reassemble(result)
        calls = [(c["name"], json.loads(c["arguments"])) for c in calls]
    else:
        message = result.choices[0].message
        content, reason = message.content, result.choices[0].finish_reason
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert content == "Let me look." and reason == "tool_calls"
    assert calls == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC"})]


CUT_HERMES = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice, reply, expected", [
    ("auto", CUT_HERMES, [("get_weather", '{"city": "Pa')]),
    ("required", REQUIRED_TEXT[:108], [("get_weather", '{"city": "Oslo", "days": 1}'),
                                      ("get_time", '{"zo')]),
    (NAMED, ARGUMENTS[:12], [("get_weather", ARGUMENTS[:12])]),
], ids=["auto", "required", "named"])
def test_a_call_cut_by_max_tokens_is_returned_as_generated(stack, fake, stream, tool_choice,
                                                          reply, expected):
    """The partial call comes back with finish_reason "length", never dropped."""
    tokenizer = stack["tokenizer"]
    num_tokens = len(tokenizer.encode(reply, add_special_tokens=False))
    fake.reply_for = _reply(tokenizer, {"object": ARGUMENTS, "array": REQUIRED_TEXT}, CUT_HERMES)
    result = stack["clients"]["auto_no_template"].chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
        max_tokens=num_tokens, stream=stream)
    if stream:
        _, calls, reason = _reassemble(result)
        calls = [(c["name"], c["arguments"]) for c in calls]
    else:
        message = result.choices[0].message
        reason = result.choices[0].finish_reason
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert reason == "length"
    assert calls == expected


def test_none_ignores_the_tools(stack, fake):
    completion = stack["clients"]["auto"].chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=200)
    assert not fake.requests[-1].sampling.HasField("grammar")
    assert "TOOLS" not in _prompt_text(stack, fake)
    assert completion.choices[0].message.content == REPLY_TEXT
    assert completion.choices[0].message.tool_calls is None


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.mark.parametrize("gateway, expected", [
    ("plain", ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}',
               "<tool_response>\nsunny\n</tool_response>"]),
    ("auto", ["CALL get_weather Paris", "<|im_start|>tool\nsunny"]),
])
def test_conversations_with_tool_calls_and_results_render(stack, fake, gateway, expected):
    completion = stack["clients"][gateway].chat.completions.create(
        model=SERVED_MODEL, messages=CONVERSATION, tools=TOOLS, tool_choice="none", max_tokens=90)
    assert completion.choices[0].message.content == REPLY_TEXT
    prompt = _prompt_text(stack, fake)
    for piece in expected:
        assert piece in prompt


@pytest.mark.parametrize("body, param, why", [
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
     "response_format", "response_format both constrain"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex",
     "'required' and guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters", "nope"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
     "tool_choice.function.name", "missing"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages", "tool_calls"),
])
def test_tool_requests_a_gateway_cannot_honour_are_400s(stack, fake, body, param, why):
    before = len(fake.requests)
    response = httpx.post(f"{stack['gateways']['plain'].base_url}/v1/chat/completions",
                          json={"model": SERVED_MODEL, "messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and why in error["message"], error
    assert len(fake.requests) == before


def test_completions_take_no_tools(stack, fake):
    url = f"{stack['gateways']['plain'].base_url}/v1/completions"
    for field, value in (("tools", TOOLS), ("tool_choice", "required")):
        response = httpx.post(url, json={"model": SERVED_MODEL, "prompt": "Hi", field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_tool_flags() -> None:
    args = build_parser().parse_args(["--model", "m", "--verifier", "h:1",
                                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    with pytest.raises(ConfigError) as caught:
        GatewayConfig(model="m", enable_auto_tool_choice=True)
    assert caught.value.param == "tool_call_parser"
    with pytest.raises(ConfigError):
        GatewayConfig(model="m", tool_call_parser="mistral")
    # `python -m specdec serve` passes them to its gateway.
    parser = argparse.ArgumentParser()
    launcher.add_serve_args(parser)
    args = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    [gateway] = [command for name, command in launcher._child_commands(args, "/m")
                 if name == "gateway"]
    start = gateway.index("--enable-auto-tool-choice")
    assert gateway[start:start + 3] == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    # The launcher's flag is the gateway config's: a bad name fails at once, not in the child.
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "mistral"])
