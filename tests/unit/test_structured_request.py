"""Request fields -> GrammarSpec (gateway/structured.py): every accepted form, conflicts and
bad constraints as 400s naming the field."""

from __future__ import annotations

import json

import pytest

from gateway.errors import error_payload
from gateway.structured import GrammarRequest, grammar_from_request
from specdec.errors import InvalidRequestError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("body, expected", [
    ({}, None),
    ({"response_format": None}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ("json_object", "", "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     ("json_schema", json.dumps(SCHEMA), "response_format.json_schema.schema")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     ("json_object", "", "response_format.json_schema")),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", json.dumps(SCHEMA), "structured_outputs.json")),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}},
     ("json_schema", json.dumps(SCHEMA), "structured_outputs.json")),
    ({"structured_outputs": {"regex": "[0-9]+"}}, ("regex", "[0-9]+", "structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, ("choice", '["a", "b"]', "structured_outputs.choice")),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, ("grammar", 'root ::= "a"', "structured_outputs.grammar")),
    ({"structured_outputs": {"json_object": True, "disable_fallback": True}},
     ("json_object", "", "structured_outputs.json_object")),
    ({"guided_json": SCHEMA}, ("json_schema", json.dumps(SCHEMA), "guided_json")),
    ({"guided_regex": "a|b"}, ("regex", "a|b", "guided_regex")),
    ({"guided_choice": ["x"]}, ("choice", '["x"]', "guided_choice")),
    ({"guided_grammar": 'start: "x"'}, ("grammar", 'start: "x"', "guided_grammar")),
])
def test_each_form_gives_its_grammar(body: dict, expected: tuple | None) -> None:
    request = grammar_from_request(body)
    if expected is None:
        assert request is None
    else:
        assert isinstance(request, GrammarRequest)
        assert (request.kind, request.value, request.param) == expected


def test_schema_name_and_strict_are_kept() -> None:
    request = grammar_from_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA, "strict": False}}})
    assert request is not None and request.schema_name == "person" and request.strict is False


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
])
def test_conflicting_fields_are_a_400_naming_them(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        grammar_from_request(body)
    assert caught.value.param == param
    assert "only one" in caught.value.message or "exactly one" in caught.value.message


@pytest.mark.parametrize("body, param, why", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": "json"}, "response_format", "object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}},
     "response_format.json_schema.schema", "minimum"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "JSON Schema"),
    ({"guided_json": "{nope"}, "guided_json", "JSON"),
    ({"guided_regex": "(["}, "guided_regex", "regex"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_choice": ["a", 3]}, "guided_choice", "strings"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "nothing_here"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "not a known field"),
    ({"structured_outputs": {}}, "structured_outputs", "needs one"),
])
def test_bad_constraint_is_a_400_naming_the_field(body: dict, param: str, why: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        grammar_from_request(body)
    assert caught.value.param == param
    assert why.lower() in caught.value.message.lower()
    status, payload = error_payload(caught.value)
    assert status == 400 and payload["error"]["param"] == param


def test_validation_can_be_left_to_the_verifier() -> None:
    request = grammar_from_request({"guided_regex": "(["}, validate=False)
    assert request is not None and request.value == "(["
