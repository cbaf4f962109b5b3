"""Request fields that constrain the output -> one GrammarSpec (kind, value) for the verifier.

Accepted, at most one of them per request (two -> 400 naming both):
- `response_format`: {"type": "text"} (no constraint), {"type": "json_object"},
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
- vLLM's `structured_outputs`: {"json": schema, "regex", "choice", "grammar", "json_object"},
  exactly one of them;
- vLLM's legacy `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

The constraint is checked here with the same llguidance translation the verifier compiles
(specdec/grammar_spec.py), so a bad schema, regex or grammar is a 400 naming its field before
the request is queued. Grammars are llguidance Lark, or GBNF (`root ::= ...`) converted.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from specdec.errors import InvalidRequestError
from specdec.grammar_spec import check_grammar

logger = logging.getLogger(__name__)

# OpenAI's rule for response_format.json_schema.name.
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                     "grammar": "grammar", "json_object": "json_object"}
# vLLM's structured_outputs options that tune its own backends; harmless to ignore here.
_STRUCTURED_IGNORED = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                       "_backend", "_backend_was_auto")
_STRUCTURED_REFUSED = ("structural_tag", "whitespace_pattern")
_LEGACY = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


@dataclass(frozen=True, slots=True)
class GrammarRequest:
    """The GrammarSpec to send (`kind`, `value` as in specdec.proto) and the request field it
    came from (`param`, for errors about it later)."""

    kind: str
    value: str
    param: str
    # response_format.json_schema.name / .strict, kept for the response; None elsewhere.
    schema_name: str | None = None
    strict: bool | None = None


def grammar_from_request(body: dict[str, Any], *, validate: bool = True) -> GrammarRequest | None:
    """The request's output constraint, or None; raises InvalidRequestError naming the field."""
    found: list[GrammarRequest] = []
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        found.append(response_format)
    structured = _structured_outputs(body.get("structured_outputs"))
    if structured is not None:
        found.append(structured)
    for field, kind in _LEGACY.items():
        value = body.get(field)
        if value is not None:
            found.append(_from_value(kind, value, field))
    if len(found) > 1:
        names = " and ".join(_top_field(request.param) for request in found)
        raise InvalidRequestError(f"{names} both constrain the output; give only one",
                                  param=_top_field(found[1].param))
    if not found:
        return None
    request = found[0]
    if validate:
        check_grammar(request.kind, request.value, param=request.param)
    return request


def _response_format(value: Any) -> GrammarRequest | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError("response_format must be an object", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarRequest("json_object", "", "response_format")
    if kind != "json_schema":
        raise InvalidRequestError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}",
            param="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("response_format.json_schema must be an object",
                                  param="response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise InvalidRequestError(
            "response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'",
            param="response_format.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError("response_format.json_schema.strict must be a boolean",
                                  param="response_format.json_schema.strict")
    schema = spec.get("schema")
    if schema is None:
        # OpenAI makes the schema optional: then any JSON object is the answer.
        return GrammarRequest("json_object", "", "response_format.json_schema", name, strict)
    if not isinstance(schema, dict):
        raise InvalidRequestError("response_format.json_schema.schema must be a JSON Schema object",
                                  param="response_format.json_schema.schema")
    return GrammarRequest("json_schema", json.dumps(schema), "response_format.json_schema.schema",
                          name, strict)


def _structured_outputs(value: Any) -> GrammarRequest | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
    for key in _STRUCTURED_REFUSED:
        if value.get(key) is not None:
            raise InvalidRequestError(f"structured_outputs.{key} is not supported",
                                      param=f"structured_outputs.{key}")
    unknown = sorted(set(value) - set(_STRUCTURED_KINDS) - set(_STRUCTURED_IGNORED)
                     - set(_STRUCTURED_REFUSED))
    if unknown:
        raise InvalidRequestError(f"structured_outputs.{unknown[0]} is not a known field",
                                  param=f"structured_outputs.{unknown[0]}")
    present = [key for key in _STRUCTURED_KINDS
               if value.get(key) is not None and value.get(key) is not False]
    if len(present) > 1:
        raise InvalidRequestError(
            f"structured_outputs sets {' and '.join(present)}; give exactly one",
            param=f"structured_outputs.{present[1]}")
    if not present:
        raise InvalidRequestError("structured_outputs needs one of json, regex, choice, grammar, "
                                  "json_object", param="structured_outputs")
    key = present[0]
    param = f"structured_outputs.{key}"
    if key == "json_object":
        if value[key] is not True:
            raise InvalidRequestError(f"{param} must be true", param=param)
        return GrammarRequest("json_object", "", param)
    return _from_value(_STRUCTURED_KINDS[key], value[key], param)


def _from_value(kind: str, value: Any, param: str) -> GrammarRequest:
    """A json schema (object or JSON text), regex, choice list or grammar text."""
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise InvalidRequestError(f"{param} is not valid JSON: {error}", param=param) from None
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{param} must be a JSON Schema object", param=param)
        return GrammarRequest(kind, json.dumps(value), param)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(item, str) and item for item in value)):
            raise InvalidRequestError(f"{param} must be a non-empty array of non-empty strings",
                                      param=param)
        return GrammarRequest(kind, json.dumps(value), param)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param} must be a non-empty string", param=param)
    return GrammarRequest(kind, value, param)


def _top_field(param: str) -> str:
    return param.split(".", 1)[0]
