"""Structured outputs end to end: the launcher's whole stack (gateway, verifier, ngram
drafter) on the real default model, through the official `openai` client.

A JSON schema with nested objects, arrays, enums and integers gives JSON that validates;
a named tool choice gives a valid call; greedy output is the same with speculation on and
off (`"speculation": false`), and the grammar's forced tokens are reported in usage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from specdec.models.model_files import DEFAULT_MODEL, resolve_model
from tests.support.served_stack import Stack, served_stack

# The default model is fetched and converted on first use, then the stack starts (eager
# fp32): longer than the suite's 300 s a test on a loaded machine, as in test_e2e.
pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Rome"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
        "sights": {"type": "array", "items": {"enum": ["museum", "park", "tower"]},
                   "minItems": 1, "maxItems": 2},
        "mayor": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18,
                                                           "maximum": 99}},
                  "required": ["age"], "additionalProperties": False},
    },
    "required": ["city", "population_millions", "sights", "mayor"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe Paris as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with served_stack(resolve_model(DEFAULT_MODEL), "--max-model-len", "1024",
                      "--served-model-name", DEFAULT_MODEL,
                      ready_timeout_s=600) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _schema_answer(client: openai.OpenAI, speculation: bool) -> tuple[str, dict]:
    completion = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
        extra_body={"speculation": speculation})
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    return choice.message.content or "", completion.usage.model_extra["speculation"]


def test_json_schema_validates_and_greedy_is_the_same_without_speculation(client) -> None:
    text, speculation = _schema_answer(client, True)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert speculation["num_forced_tokens"] > 0  # keys and punctuation the grammar forced
    plain, _ = _schema_answer(client, False)
    assert plain == text


def test_named_tool_choice_gives_a_valid_call(client) -> None:
    calls = []
    for speculation in (True, False):
        completion = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=MAX_TOKENS, temperature=0, extra_body={"speculation": speculation})
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        calls.append(call.function.arguments)
    assert calls[0] == calls[1]
