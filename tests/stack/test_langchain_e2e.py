"""LangChain against the whole stack on the real default model (SmolLM2, whose chat template
renders no tools), started as a user would for tools: `--enable-auto-tool-choice
--tool-call-parser hermes`.

`bind_tools` with tool_choice "auto" (served through specdec's fallback tool prompt), a
named tool and "any", and `with_structured_output` by all three methods
(function_calling, json_schema, json_mode) must give LangChain what it parses: a Weather
object, or tool calls named get_weather whose arguments are JSON of its schema.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from specdec.models.model_files import DEFAULT_MODEL, resolve_model
from tests.support.served_stack import Stack, served_stack

# The default model is fetched and converted on first use, then the stack starts (eager
# fp32): longer than the suite's 300 s a test on a loaded machine, as in test_e2e.
pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 32
QUESTION = "Weather in Paris for 3 days. Answer in JSON with keys city and days."


class Weather(BaseModel):
    """The weather forecast request for a city."""

    city: str = Field(description="the city", max_length=20)
    days: int = Field(description="how many days", ge=1, le=7)


@tool
def get_weather(city: str, days: int) -> str:
    """Get the weather forecast for a city for a number of days."""
    return "sunny"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with served_stack(resolve_model(DEFAULT_MODEL), "--max-model-len", "1024",
                      "--served-model-name", DEFAULT_MODEL, "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes", ready_timeout_s=600) as running:
        yield running


@pytest.fixture(scope="module")
def llm(stack: Stack) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", model=DEFAULT_MODEL,
                      temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=300)


def _assert_weather_call(message: AIMessage) -> None:
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    arguments = call["args"]  # LangChain parsed the arguments' JSON
    assert isinstance(arguments["city"], str) and isinstance(arguments["days"], int), arguments


@pytest.mark.parametrize("tool_choice", ["get_weather", "any"])
def test_bind_tools_forced_calls(llm: ChatOpenAI, tool_choice: str) -> None:
    message = llm.bind_tools([get_weather], tool_choice=tool_choice).invoke(
        "What is the weather in Paris for the next 3 days?")
    _assert_weather_call(message)
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_bind_tools_auto_is_served_on_a_template_without_tools(llm: ChatOpenAI) -> None:
    # Before the fallback tool prompt this was a 400 on SmolLM2 whatever the flags. Whether
    # a 135M model calls the tool is its own business; what it answers is parsed.
    message = llm.bind_tools([get_weather]).invoke("Call get_weather for Paris, 3 days.")
    assert message.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    assert message.content or message.tool_calls or message.invalid_tool_calls
    assert all(call["name"] == "get_weather" for call in message.tool_calls)
    assert all(call["name"] == "get_weather" for call in message.invalid_tool_calls)


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_with_structured_output_parses_a_weather_object(llm: ChatOpenAI, method: str) -> None:
    result = llm.with_structured_output(Weather, method=method, include_raw=True).invoke(QUESTION)
    assert result["parsing_error"] is None, result
    weather = result["parsed"]
    assert isinstance(weather, Weather)
    assert weather.city and 1 <= weather.days <= 7
