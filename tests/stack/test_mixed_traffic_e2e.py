"""Mixed traffic end to end (issue 44): the launcher's whole stack on the real default
model, through the official `openai` client, with ngram and with suffix speculation.

24 requests at concurrency 8, half constrained (a JSON schema, a regex, a choice, a named
tool call) and half plain, interleaved so that constrained and plain rows share batches in
every order: all succeed, every constrained output is valid, and every greedy output is
the same as that request's sent alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from specdec.models.model_files import DEFAULT_MODEL, resolve_model
from tests.support.served_stack import NGRAM_SPEC, served_stack

# The default model is fetched and converted on first use, then the stack starts (eager
# fp32): longer than the suite's 300 s a test on a loaded machine, as in test_e2e.
pytestmark = pytest.mark.timeout(1200)

SUFFIX_SPEC = '{"method": "suffix", "num_speculative_tokens": 4}'
NUM_REQUESTS = 24
CONCURRENCY = 8
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1,
                                                    "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,2}"
CHOICES = ["yes", "no", "maybe"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": SCHEMA}}
TOPICS = ["Paris", "the sea", "a robot", "Oslo", "tea", "a river", "music", "Rome", "snow",
          "a cat", "bread", "the moon"]


def _request(index: int) -> dict[str, Any]:
    """Even indices plain, odd ones constrained (cycling through the four kinds)."""
    topic = TOPICS[index // 2 % len(TOPICS)]
    body: dict[str, Any] = {"model": DEFAULT_MODEL, "temperature": 0, "max_tokens": 16,
                            "messages": [{"role": "user", "content": f"Tell me about {topic}."}]}
    if index % 2 == 0:
        return body
    kind = ("json_schema", "regex", "choice", "tool")[index // 2 % 4]
    body["max_tokens"] = 40
    if kind == "json_schema":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "trip", "schema": SCHEMA}}
    elif kind == "regex":
        body["extra_body"] = {"structured_outputs": {"regex": REGEX}}
    elif kind == "choice":
        body["extra_body"] = {"structured_outputs": {"choice": CHOICES}}
    else:
        body["tools"] = [WEATHER]
        body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    body["kind"] = kind
    return body


def _answer(client: openai.OpenAI, index: int) -> str:
    body = _request(index)
    kind = body.pop("kind", None)
    choice = client.chat.completions.create(**body).choices[0]
    if kind == "tool":
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
        return call.function.arguments
    text = choice.message.content or ""
    if kind == "json_schema":
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert text
    return text


@pytest.fixture(scope="module", params=[NGRAM_SPEC, SUFFIX_SPEC], ids=["ngram", "suffix"])
def client(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    with served_stack(resolve_model(DEFAULT_MODEL), "--max-model-len", "1024",
                      "--served-model-name", DEFAULT_MODEL,
                      "--speculative-config", request.param, ready_timeout_s=600) as stack:
        yield openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused",
                            max_retries=0, timeout=600)


def test_mixed_constrained_and_plain_requests(client: openai.OpenAI) -> None:
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        mixed = list(pool.map(lambda index: _answer(client, index), range(NUM_REQUESTS)))
    alone = [_answer(client, index) for index in range(NUM_REQUESTS)]
    assert mixed == alone
