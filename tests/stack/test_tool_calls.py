"""Tool calls (gateway/tools.py, gateway/forced_tool_calls.py, gateway/hermes_tool_parser.py):
tools / tool_choice validation, the grammars that force a call (checked by decoding a random
model under them), and the tool messages a template without tools renders (the parsers'
own tests are in tests/unit/test_tool_call_parsing.py)."""

from __future__ import annotations

import json

import pytest
from jinja2.exceptions import UndefinedError
from openai.types.chat import ChatCompletionMessageToolCall
from transformers import PreTrainedTokenizerFast

from gateway.forced_tool_calls import tool_calls_from_forced_output, tool_grammar
from gateway.hermes_tool_parser import TOOL_CALL_PARSERS, HermesToolParser, parse_hermes, tool_messages_as_text
from gateway.structured import grammar_from_request
from gateway.tools import ToolChoice, parse_tool_choice, parse_tools, template_accepts_tools
from specdec.errors import InvalidRequestError
from specdec.grammar_spec import check_grammar
from tests.support.grammar_decode import PADDED_VOCAB, make_padded_tiny_model, masked_decode
from tests.support.tiny_models import make_tokenizer
from verifier_svc.grammar import GrammarBackend

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                  "unit": {"enum": ["C", "F"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
NO_PARAMS = {"type": "function", "function": {"name": "ping"}}


# -- validation ------------------------------------------------------------------------------

def test_tools_parse() -> None:
    tools = parse_tools([WEATHER, TIME, NO_PARAMS])
    assert [tool.name for tool in tools] == ["get_weather", "get_time", "ping"]
    assert tools[2].parameters == {"type": "object", "properties": {}}
    assert parse_tools(None) == ()


@pytest.mark.parametrize("tools, param", [
    ("x", "tools"),
    ([{"type": "retrieval"}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tools[0].function.parameters"),
])
def test_bad_tools_are_400s_naming_the_field(tools, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_tools(tools)
    assert caught.value.param == param


def test_tool_choice_semantics() -> None:
    tools = parse_tools([WEATHER, TIME])
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, ()) == ToolChoice("none")
    assert parse_tool_choice("none", tools) == ToolChoice("none")
    assert parse_tool_choice("required", tools) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_time"}}
    assert parse_tool_choice(named, tools) == ToolChoice("function", "get_time")
    for bad, param in [("always", "tool_choice"), ({"type": "function", "function": {"name": "nope"}},
                                                   "tool_choice.function.name"),
                       ({"type": "function"}, "tool_choice.function.name"), (3, "tool_choice")]:
        with pytest.raises(InvalidRequestError) as caught:
            parse_tool_choice(bad, tools)
        assert caught.value.param == param
    with pytest.raises(InvalidRequestError):
        parse_tool_choice("required", ())
    assert tool_grammar(ToolChoice("auto"), tools) is None
    assert tool_grammar(ToolChoice("none"), tools) is None


# -- forced calls ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def backend(default_tokenizer) -> GrammarBackend:
    return GrammarBackend(default_tokenizer, PADDED_VOCAB)


@pytest.fixture(scope="module")
def model(default_tokenizer):
    return make_padded_tiny_model(default_tokenizer.eos_token_id, seed=1)


def test_named_function_forces_its_arguments(backend, model, default_tokenizer) -> None:
    tools = parse_tools([WEATHER, TIME])
    choice = parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools)
    grammar = tool_grammar(choice, tools)
    assert grammar is not None
    for seed in (None, 0, 1):
        text = masked_decode(backend, model, default_tokenizer, grammar.kind, grammar.value, sample_seed=seed)
        calls = tool_calls_from_forced_output(choice, text)
        assert len(calls) == 1
        call = ChatCompletionMessageToolCall.model_validate(calls[0])
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        assert arguments["city"] in ("Paris", "Oslo") and arguments["unit"] in ("C", "F")
        assert 1 <= arguments["days"] <= 7


def test_required_forces_one_or_more_valid_calls(backend, model, default_tokenizer) -> None:
    with_free_form = parse_tools([WEATHER, TIME, NO_PARAMS])
    grammar = tool_grammar(parse_tool_choice("required", with_free_form), with_free_form)
    assert grammar is not None
    check_grammar(grammar.kind, grammar.value)
    # Decoded with closed parameter schemas only: a random model fills a free-form object
    # with keys forever. The array itself is unbounded (as in vLLM): a bias on the tokens
    # that close it makes the random model stop within the budget.
    tools = parse_tools([WEATHER, TIME])
    choice = parse_tool_choice("required", tools)
    grammar = tool_grammar(choice, tools)
    assert grammar is not None
    closing = {token_id: 4.0 for token, token_id in default_tokenizer.get_vocab().items()
               if "]" in default_tokenizer.convert_tokens_to_string([token])}
    for seed in (None, 0, 1, 2):
        text = masked_decode(backend, model, default_tokenizer, grammar.kind, grammar.value, sample_seed=seed,
                             max_tokens=300, bias=closing)
        calls = tool_calls_from_forced_output(choice, text)
        assert calls
        ids = set()
        for raw in calls:
            call = ChatCompletionMessageToolCall.model_validate(raw)
            ids.add(call.id)
            arguments = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                assert arguments["city"] in ("Paris", "Oslo")
            elif call.function.name == "get_time":
                assert arguments["zone"] in ("UTC", "CET")
            else:
                assert call.function.name == "ping" and isinstance(arguments, dict)
        assert len(ids) == len(calls)


def test_tool_grammar_conflicts_are_the_lead_s_to_merge() -> None:
    # A request with response_format and tools gets both; structured.py sees only its fields.
    assert grammar_from_request({"tools": [WEATHER], "tool_choice": "required"}) is None


# -- chat templates --------------------------------------------------------------------------

def test_default_template_takes_no_tools(default_tokenizer) -> None:
    """SmolLM2's template ignores `tools`: "auto" cannot be offered with it (400 on tools)."""
    assert template_accepts_tools(default_tokenizer) is False


def test_a_template_that_renders_tools_is_detected() -> None:
    default_tokenizer: PreTrainedTokenizerFast = make_tokenizer(16)
    assert template_accepts_tools(default_tokenizer) is False
    default_tokenizer.chat_template = ("{% if tools %}TOOLS {{ tools | tojson }} {% endif %}"
                               "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    assert template_accepts_tools(default_tokenizer) is True


# -- conversations with tool messages ----------------------------------------------------

def test_tool_messages_render_through_a_template_without_tools(default_tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    with pytest.raises(UndefinedError):  # SmolLM2's template cannot take a null content
        default_tokenizer.apply_chat_template(messages, tokenize=False)
    text = default_tokenizer.apply_chat_template(tool_messages_as_text(messages), tokenize=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    # What the assistant said parses back to the same call.
    _, calls = parse_hermes(tool_messages_as_text(messages)[1]["content"])
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert TOOL_CALL_PARSERS["hermes"] is HermesToolParser
