"""The structured-output constraint kinds of `GrammarSpec`, turned into llguidance grammars.

Shared by both sides: the gateway checks a request's constraint here (a 400 before anything
is queued) and the verifier's grammar backend (`verifier_svc/grammar/`) compiles the same
text against the model's tokenizer. Kinds, as in protos/specdec/v1/specdec.proto:

- "json_object": any JSON object (value ignored);
- "json_schema": value is a JSON Schema (an object) as JSON text;
- "regex": value is a regular expression (Rust `regex` syntax, anchored at both ends);
- "choice": value is a JSON array of strings, the output is exactly one of them;
- "grammar": value is an llguidance Lark grammar (`start: ...`); a GBNF / llama.cpp EBNF
  grammar (`root ::= ...`, the dialect vLLM's xgrammar backend takes) is converted to Lark.

JSON is generated compact on one line, with Python's `json.dumps` separators (", " and
": "): free whitespace lets a small model loop on newlines forever, and a fixed layout makes
more of the output forced (grammar-forced drafts).
"""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING, Any

from specdec.errors import InvalidRequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the stub only

logger = logging.getLogger(__name__)

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")

# llguidance's JSON compiler options; see JsonCompileOptions in llguidance/_lib.pyi.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

# A constraint longer than this is refused before it reaches the compiler (the compiler
# has its own limits on the compiled size; this bounds the text we parse and cache). The
# servers' --max-grammar-chars.
MAX_GRAMMAR_CHARS = 1 << 20
# llguidance's parser allows at most this many items in one row (LLParserLimits'
# max_items_in_row): a choice of more strings compiles, then fails at its first token.
MAX_CHOICES = 2000
MAX_ERROR_CHARS = 400
_CARET_LINE = re.compile(r"^[\^~\s]+$")
_SOURCE_LINE = re.compile(r"^\d+ \|")


def grammar_text(kind: str, value: str, *, param: str = "grammar",
                 whitespace_flexible: bool = False, max_chars: int = MAX_GRAMMAR_CHARS) -> str:
    """The llguidance grammar for a (kind, value); raises InvalidRequestError naming `param`.

    This checks the syntax that needs no tokenizer only as far as the translation goes;
    `check_grammar` runs llguidance's own validation.
    """
    import llguidance  # imported here: the drafter and CLI never need it

    if len(value) > max_chars:
        raise InvalidRequestError(f"the {kind.replace('_', ' ')} is longer than {max_chars} "
                                  "characters", param=param)
    options: JsonCompileOptions = {**JSON_OPTIONS, "whitespace_flexible": whitespace_flexible}
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if kind == "json_schema":
        schema = _load_json(value, param, "a JSON Schema")
        if isinstance(schema, bool):
            # JSON Schema allows `true` (anything) and `false` (nothing); neither is an answer
            # shape a model can be steered to.
            raise InvalidRequestError("the JSON Schema must be an object, not a boolean", param=param)
        if not isinstance(schema, dict):
            raise InvalidRequestError("the JSON Schema must be a JSON object", param=param)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except (ValueError, TypeError) as error:
            raise InvalidRequestError(f"invalid JSON Schema: {error}", param=param) from None
    if kind == "regex":
        if not value:
            raise InvalidRequestError("the regex is empty", param=param)
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        choices = _load_json(value, param, "a JSON array of strings")
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(choice, str) and choice for choice in choices)):
            raise InvalidRequestError("the choice must be a non-empty array of non-empty strings",
                                      param=param)
        if len(set(choices)) > MAX_CHOICES:
            raise InvalidRequestError(f"the choice has {len(set(choices))} strings; at most "
                                      f"{MAX_CHOICES}", param=param)
        # Lark string literals are JSON strings, so json.dumps escapes them exactly.
        alternatives = " | ".join(json.dumps(choice) for choice in dict.fromkeys(choices))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    if kind == "grammar":
        if not value.strip():
            raise InvalidRequestError("the grammar is empty", param=param)
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(value)
        except Exception as error:
            raise InvalidRequestError(f"invalid grammar: {error}", param=param) from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise InvalidRequestError(
        f"unknown grammar kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}", param=param)


def check_grammar(kind: str, value: str, *, param: str = "grammar",
                  tokenizer: Any | None = None, max_chars: int = MAX_GRAMMAR_CHARS) -> str:
    """The grammar text, validated by llguidance (with `tokenizer`, an LLTokenizer, when
    given); raises InvalidRequestError saying why and naming `param`."""
    import llguidance

    text = grammar_text(kind, value, param=param, max_chars=max_chars)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        text, tokenizer, limits=parser_limits())
    if is_error:
        raise InvalidRequestError(f"invalid {kind.replace('_', ' ')}: {_one_line(messages)}",
                                  param=param)
    return text


def compiled_matcher(kind: str, text: str, tokenizer: Any) -> Any:
    """llguidance's matcher for the grammar `text` (from `grammar_text`) and `tokenizer` (an
    LLTokenizer), at its start; raises InvalidRequestError (param `grammar`) saying why when
    it does not compile."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise InvalidRequestError(f"invalid {kind.replace('_', ' ')}: "
                                  f"{_one_line([matcher.get_error()])}", param="grammar")
    return matcher


def parser_limits() -> Any:
    """llguidance's limits, at their defaults but for errors that would quote the client's
    grammar (they end up in logs)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def _one_line(messages: list[str]) -> str:
    """llguidance's error on one line, without the quoted source lines and carets under
    them (an API error is read as one line)."""
    if not messages:
        return "rejected by the grammar compiler"
    lines = [line.strip() for line in messages[0].splitlines()]
    kept = [line for line in lines
            if line and not _CARET_LINE.match(line) and not _SOURCE_LINE.match(line)]
    return " ".join(kept)[:MAX_ERROR_CHARS]


def _load_json(value: str, param: str, what: str) -> Any:
    try:
        return json.loads(value)
    except (TypeError, ValueError) as error:
        raise InvalidRequestError(f"expected {what} as JSON text: {error}", param=param) from None
