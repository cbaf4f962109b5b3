"""Structured outputs through the gateway (the official `openai` client and raw HTTP against
a fake verifier): every request form reaches the verifier as SamplingParams.grammar, for
chat and completions, streaming or not; a constraint the compiler rejects is a 400 naming
its field before anything is queued; concurrent requests keep their own grammars."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import grpc
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

MESSAGES = [{"role": "user", "content": "What is the answer?"}]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
PERSON_TEXT = '{"name": "Ann", "age": 3, "tags": ["a"]}'


def scripted_text(grammar: specdec_pb2.GrammarSpec) -> str:
    """An answer that satisfies the grammar (what a masked verifier would produce)."""
    if grammar.kind == "json_schema":
        return PERSON_TEXT if json.loads(grammar.value) == PERSON else "{}"
    if grammar.kind == "json_object":
        return "{}"
    if grammar.kind == "choice":
        return json.loads(grammar.value)[-1]
    if grammar.kind == "regex":
        return grammar.value.replace("\\", "")  # the tests' regexes are escaped literals
    return "yes"


@pytest.fixture(scope="module")
def live(tokenizer) -> Iterator[tuple[LiveGateway, FakeVerifier]]:
    servicer = FakeVerifier(tokenizer.encode(REPLY_TEXT, add_special_tokens=False),
                            tokenizer.eos_token_id)

    def reply_for(request: specdec_pb2.GenerateRequest) -> list[int] | None:
        if not request.sampling.HasField("grammar"):
            return None
        return tokenizer.encode(scripted_text(request.sampling.grammar), add_special_tokens=False)

    servicer.reply_for = reply_for
    with live_gateway(tokenizer, servicer) as live:
        yield live


@pytest.fixture()
def fake(live) -> Iterator[FakeVerifier]:
    live[1].abort_code = None
    live[1].abort_param = None
    yield live[1]
    live[1].abort_code = None
    live[1].abort_param = None


def test_json_schema_reaches_the_verifier_and_the_answer_is_its_json(client, fake):
    completion = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, max_tokens=100,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    grammar = fake.requests[-1].sampling.grammar
    assert (grammar.kind, json.loads(grammar.value)) == ("json_schema", PERSON)
    assert json.loads(completion.choices[0].message.content or "") == json.loads(PERSON_TEXT)
    assert completion.choices[0].finish_reason == "stop"
    # The next request, without a constraint, sends none.
    client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=4,
                                   response_format={"type": "text"})
    assert not fake.requests[-1].sampling.HasField("grammar")


FORMS = [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"structured_outputs": {"json": PERSON}}, "json_schema", json.dumps(PERSON)),
    ({"structured_outputs": {"regex": "id-7"}}, "regex", "id-7"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes", "no"]'),
    ({"structured_outputs": {"grammar": 'root ::= "yes"'}}, "grammar", 'root ::= "yes"'),
    ({"guided_json": json.dumps(PERSON)}, "json_schema", json.dumps(PERSON)),
    ({"guided_regex": "id-7"}, "regex", "id-7"),
    ({"guided_choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
    ({"guided_grammar": 'start: "yes"'}, "grammar", 'start: "yes"'),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("fields, kind, value", FORMS,
                         ids=[f"{next(iter(f))}-{k}" for f, k, _ in FORMS])
def test_every_form_reaches_the_verifier(client, fake, fields, kind, value, chat, stream):
    extra = {"model": SERVED_MODEL, "max_tokens": 100, "extra_body": fields, "stream": stream}
    if chat:
        result = client.chat.completions.create(messages=MESSAGES, **extra)
    else:
        result = client.completions.create(prompt="Hello", **extra)
    if stream:
        pieces = [c.choices[0] for c in result if c.choices]
        text = "".join((p.delta.content or "") if chat else p.text for p in pieces)
    else:
        choice = result.choices[0]
        text = choice.message.content if chat else choice.text
    grammar = fake.requests[-1].sampling.grammar
    assert (grammar.kind, grammar.value) == (kind, value)
    assert text == scripted_text(grammar)


@pytest.mark.parametrize("body, param, why", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}},
     "response_format.json_schema.schema", "minimum"),
    ({"guided_regex": "(["}, "guided_regex", "unclosed character class"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar",
     "undefined_rule"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_constraint_that_cannot_compile_is_a_400_before_the_verifier(live, fake, body, param,
                                                                       why, path):
    before = len(fake.requests)
    prompt = {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "Hi"}
    response = httpx.post(f"{live[0].base_url}{path}",
                          json={"model": SERVED_MODEL, **prompt, **body, "stream": True})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and why in error["message"].lower()
    assert len(fake.requests) == before


def test_a_bad_schema_is_a_bad_request_error_through_the_client(client, fake):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=SERVED_MODEL, messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}})
    assert caught.value.body["param"] == "response_format.json_schema.schema"
    assert "nope" in caught.value.body["message"]


def test_a_grammar_the_verifier_refuses_is_a_400_naming_the_field(client, fake):
    """The verifier names `grammar` (all it knows: a GrammarSpec); the client is told the
    field it sent the constraint in."""
    fake.abort_code = grpc.StatusCode.INVALID_ARGUMENT
    fake.abort_param = "grammar"
    before = len(fake.requests)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES,
                                       extra_body={"guided_regex": "id-7"})
    assert fake.requests[before].sampling.grammar.value == "id-7"  # the verifier's own 400
    assert refused.value.body["param"] == "guided_regex"
    assert refused.value.body["message"] == "fake verifier failure"
    fake.abort_param = "max_tokens"  # a refusal about another field keeps its name
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES,
                                       extra_body={"guided_regex": "id-7"})
    assert refused.value.body["param"] == "max_tokens"


def test_many_concurrent_requests_keep_their_own_grammars(live, fake):
    aclient = openai.AsyncOpenAI(base_url=f"{live[0].base_url}/v1", api_key="unused",
                                 max_retries=0)
    num_requests = 24

    async def one(index: int) -> tuple[str, str]:
        regex = f"answer-{index}"
        if index % 3 == 0:
            extra = {"structured_outputs": {"regex": regex}}
        elif index % 3 == 1:
            extra = {"guided_choice": [f"no-{index}", regex]}
        else:
            extra = {"response_format": {"type": "json_schema", "json_schema": {
                "name": f"s{index}", "schema": {"enum": [regex]}}}}
        if index % 2:
            stream = await aclient.chat.completions.create(
                model=SERVED_MODEL, messages=MESSAGES, max_tokens=60, stream=True,
                extra_body=extra)
            text = "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])
        else:
            result = await aclient.completions.create(
                model=SERVED_MODEL, prompt=f"Q{index}", max_tokens=60, extra_body=extra)
            text = result.choices[0].text
        return regex, text

    async def run_all() -> list[tuple[str, str]]:
        try:
            return await asyncio.gather(*(one(index) for index in range(num_requests)))
        finally:
            await aclient.close()

    before = len(fake.requests)
    results = asyncio.run(run_all())
    for index, (regex, text) in enumerate(results):
        expected = "{}" if index % 3 == 2 else regex  # the fake's json_schema answer is "{}"
        assert text == expected, (index, text)
    sent = [request.sampling.grammar for request in fake.requests[before:]]
    assert len(sent) == num_requests
    values = sorted(grammar.value for grammar in sent)
    assert len(set(values)) == num_requests  # every request's own grammar, none shared
