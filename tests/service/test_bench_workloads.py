"""The built-in workloads (`bench serve --dataset agent | code-edit | rag | extract |
multi-turn | chat`): shipped as generated, deterministic, the right shapes, disjoint from the
tests' prompts, accepted by every bench command, and served through the real gateway."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from specdec.bench import compare as bench_compare
from specdec.bench import concurrency as bench_concurrency
from specdec.bench import serve as bench_serve
from specdec.bench.compare import COMPARE_PROMPTS
from specdec.bench.serve_requests import (
    SHIPPED_DATASETS,
    BenchRequest,
    load_requests,
    request_body,
)
from specdec.bench.workloads import WORKLOADS, generate, to_jsonl, transcript
from specdec.bench.workloads_json import AGENT_SYSTEM, AGENT_SYSTEM_INTRO, TOOLS
from specdec.errors import ConfigError
from specdec.v1 import specdec_pb2
from tests.support.fake_verifier import REPLY_TEXT, FakeVerifier, build_tiny_tokenizer, live_gateway
from tests.support.tiny_models import make_tiny_llama

TESTS = Path(__file__).resolve().parents[1]
NAMES = ["agent", "code-edit", "rag", "extract", "multi-turn", "chat"]


def test_every_workload_is_a_shipped_dataset() -> None:
    assert list(WORKLOADS) == NAMES
    assert set(NAMES) <= set(SHIPPED_DATASETS)


@pytest.mark.parametrize("name", NAMES)
def test_shipped_file_is_the_generators_deterministic_output(name: str) -> None:
    shipped = resources.files("specdec").joinpath(SHIPPED_DATASETS[name]).read_text("utf-8")
    assert shipped == to_jsonl(generate(name)), (
        f"specdec/prompts/{name}.jsonl is stale: run python -m specdec.bench.workloads")
    assert generate(name) == generate(name)
    assert generate(name, seed=1) != generate(name)  # the seed, not the word lists alone, draws


@pytest.mark.parametrize("name", NAMES)
def test_loads_for_both_endpoints(name: str) -> None:
    chat = load_requests(name, None)
    completions = load_requests(name, None, endpoint="completions")
    assert len(chat) == len(completions) >= 24
    assert all(request.messages and request.prompt is None for request in chat)
    for chat_request, completions_request in zip(chat, completions):
        assert completions_request.messages is None
        assert completions_request.prompt == transcript(chat_request.messages)
        assert completions_request.prompt.endswith("\n\nAssistant:")
        assert "response_format" not in completions_request.options
        assert chat_request.max_tokens == completions_request.max_tokens
    assert len({json.dumps(request.messages) for request in chat}) == len(chat)
    # Each line its own max_tokens, suited to the task; --max-tokens overrides them all.
    assert all(32 <= request.max_tokens <= 256 for request in chat)
    assert {request.max_tokens for request in load_requests(name, 5, max_tokens=7)} == {7}


def test_max_tokens_suit_the_task() -> None:
    assert max(request.max_tokens for request in load_requests("chat", None)) <= 64
    assert min(request.max_tokens for request in load_requests("code-edit", None)) >= 128


def test_agent_repeats_one_system_prompt_with_tool_schemas_and_json_turns() -> None:
    requests = load_requests("agent", None)
    assert {request.messages[0]["content"] for request in requests} == {AGENT_SYSTEM}
    tools = json.loads(AGENT_SYSTEM.removeprefix(AGENT_SYSTEM_INTRO))
    assert tools == TOOLS and all(tool["type"] == "function" for tool in tools)
    names = {tool["function"]["name"] for tool in tools}
    calls_before = []
    for request in requests:
        system, user, *turns = request.messages
        assert (system["role"], user["role"]) == ("system", "user")
        assert [turn["role"] for turn in turns] == ["assistant", "tool"] * (len(turns) // 2)
        for call, result in zip(turns[::2], turns[1::2]):
            parsed = json.loads(call["content"])
            assert parsed["name"] in names and isinstance(parsed["arguments"], dict)
            assert isinstance(json.loads(result["content"]), dict)
        calls_before.append(len(turns) // 2)
    assert min(calls_before) == 0 and max(calls_before) >= 3  # from the first call to the last


def test_extract_carries_a_json_schema_response_format_unless_switched_off() -> None:
    requests = load_requests("extract", None)
    for request in requests:
        response_format = request.options["response_format"]
        assert response_format["type"] == "json_schema"
        schema = response_format["json_schema"]["schema"]
        assert schema["type"] == "object" and set(schema["required"]) <= set(schema["properties"])
        assert json.dumps(schema) in request.messages[0]["content"]  # the prompt names it too
        assert request_body(request, None)["response_format"] == response_format
    for request in requests:
        jsonschema.Draft202012Validator.check_schema(request.options["response_format"]["json_schema"]["schema"])
    assert all("response_format" not in request.options and
               "response_format" not in request_body(request, None)
               for request in load_requests("extract", None, response_format=False))


def test_multi_turn_later_turns_quote_earlier_ones() -> None:
    requests = load_requests("multi-turn", None)
    assert {len(request.messages) for request in requests} == {3, 5}
    for request in requests:
        roles = [message["role"] for message in request.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        for index in range(2, len(roles), 2):
            quotes = re.findall(r'"([^"]+)"', request.messages[index]["content"])
            earlier = " ".join(message["content"] for message in request.messages[:index])
            assert quotes and all(quote in earlier for quote in quotes), request.messages[index]


def test_code_edit_gives_a_function_that_parses() -> None:
    for request in load_requests("code-edit", None):
        content = request.messages[0]["content"]
        code = content.split("```python\n", 1)[1].split("```", 1)[0]
        function = ast.parse(code).body[0]
        assert isinstance(function, ast.FunctionDef) and len(code.splitlines()) >= 5


def test_rag_quotes_a_long_context() -> None:
    for request in load_requests("rag", None):
        content = request.messages[0]["content"]
        document = content.split("Document:\n", 1)[1].split("\n\nQuestion:", 1)[0]
        assert len(document.split("\n\n")) >= 5 and len(document) > 1000
        assert content.startswith("Answer the question using only the document below, quoting")


# ------------------------------------------------------------------ disjoint from the tests

def _test_prompts() -> set[str]:
    """Every string of four words or more in tests/**/*.py (prompts among them), and the prompts
    of the other shipped sets, which tests use too."""
    texts = {text for text in COMPARE_PROMPTS.values()}
    for path in TESTS.rglob("*.py"):
        if path.name == Path(__file__).name:
            continue
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.add(node.value.strip())
    for dataset in ("builtin", "repeat", "prompts/heldout_chat.jsonl", "evals/tasks.jsonl"):
        path = SHIPPED_DATASETS.get(dataset, dataset)
        for line in resources.files("specdec").joinpath(path).read_text("utf-8").splitlines():
            item = json.loads(line)
            texts.update(m["content"] for m in item.get("messages", []))
            texts.add(item.get("prompt", ""))
    # Four words or more: a prompt, not a field name or a phrase any English text may hold.
    return {text for text in texts if len(text.split()) >= 4 and len(text) >= 20}


def test_no_workload_prompt_equals_or_contains_a_test_prompt() -> None:
    known = _test_prompts()
    assert "Write a short story about a robot who learns to paint." in known
    assert len(known) > 300
    for name in NAMES:
        for request in load_requests(name, None):
            for message in request.messages:
                clashes = [text for text in known if text in message["content"]]
                assert not clashes, (name, clashes[:3])


# ------------------------------------------------------------------ the bench commands

@pytest.mark.parametrize("name", NAMES)
def test_every_bench_command_takes_the_name(name: str) -> None:
    assert bench_serve.build_parser().parse_args(["--dataset", name]).dataset == name
    assert bench_concurrency.build_parser().parse_args(["--dataset", name]).dataset == name
    args = bench_compare.build_parser().parse_args(["--dataset", name, "--num-prompts", "3"])
    conversations = bench_compare.prompt_messages(args)
    assert list(conversations) == [f"{name}-1", f"{name}-2", f"{name}-3"]
    assert list(conversations.values()) == [r.messages for r in load_requests(name, 3)]
    # bench concurrency renders each request through the chat template, tool turns included.
    tokenizer = build_tiny_tokenizer()
    assert all(bench_concurrency._prompt_ids(request, tokenizer)
               for request in load_requests(name, None, max_tokens=128))


def test_compare_refuses_prompt_with_dataset() -> None:
    args = bench_compare.build_parser().parse_args(["--dataset", "rag", "--prompt", "open"])
    with pytest.raises(ConfigError, match="--prompt or --dataset"):
        bench_compare.prompt_messages(args)


class _LongContextVerifier(FakeVerifier):
    """The fake verifier with room for the agent prompts in the tiny byte-level tokenizer."""

    async def GetInfo(self, request: Any, context: Any) -> specdec_pb2.VerifierInfo:
        info = await super().GetInfo(request, context)
        info.max_model_len = 1 << 15
        return info


@pytest.fixture(scope="module")
def gateway(tokenizer) -> Iterator[tuple[str, FakeVerifier]]:
    servicer = _LongContextVerifier(tokenizer.encode(REPLY_TEXT, add_special_tokens=False),
                                    tokenizer.eos_token_id)
    with live_gateway(tokenizer, servicer) as (live, _):
        yield live.base_url, servicer


@pytest.mark.parametrize("flags,max_tokens", [
    (["--dataset", "agent"], 96),
    (["--dataset", "multi-turn", "--endpoint", "completions", "--max-tokens", "5"], 5),
    (["--dataset", "extract", "--no-response-format"], 160),
])
def test_bench_serve_runs_a_workload_through_the_gateway(gateway, flags: list[str], max_tokens: int,
                                                         tmp_path: Path) -> None:
    base_url, servicer = gateway
    seen = len(servicer.requests)
    output = tmp_path / "result.json"
    code = bench_serve.main(["--base-url", base_url, *flags, "--num-prompts", "2",
                             "--disable-tqdm", "--output-json", str(output)])
    summary = json.loads(output.read_text())
    assert code == 0, summary["errors"]
    assert (summary["completed"], summary["failed"]) == (2, 0)
    # Each line's own max_tokens reached the verifier, or --max-tokens over them.
    assert [r.sampling.max_tokens for r in servicer.requests[seen:]] == [max_tokens] * 2


def test_request_body_of_a_workload_request() -> None:
    (request,) = load_requests("agent", 1, options={"temperature": 0.0})
    body = request_body(request, "m")
    assert body["messages"][0] == {"role": "system", "content": AGENT_SYSTEM}
    assert (body["max_tokens"], body["temperature"], body["model"]) == (96, 0.0, "m")
    assert isinstance(request, BenchRequest)


def test_bench_compare_runs_a_workload(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "target")
    output = tmp_path / "compare.json"
    code = bench_compare.main([
        "--model", str(model), "--dtype", "float32", "--max-tokens", "4", "--repeats", "1",
        "--dataset", "chat", "--num-prompts", "2", "--systems", "specdec", "--threads", "1",
        "--enforce-eager", "--disable-tqdm", "--json", str(output)])
    assert code == 0
    report = json.loads(output.read_text())
    assert list(report["prompts"]) == ["chat-1", "chat-2"]
    assert report["prompts"]["chat-1"] == load_requests("chat", 1)[0].messages
    assert {row["prompt"] for row in report["rows"]} == {"chat-1", "chat-2"}
