"""The client side of one benchmark request: datasets, the HTTP call, its timings.

`send_request` streams (SSE) or posts one OpenAI request and fills a `RequestResult`;
any failure (refused connection, HTTP error, error event, timeout, bad JSON) is recorded
in it, never raised, so one bad request cannot end a benchmark.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

from specdec.bench.workloads import WORKLOADS, transcript

DEFAULT_MAX_TOKENS = 128
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: chat `messages` or a completions `prompt`, plus any extra body fields."""

    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stream: bool = True
    # temperature, seed, top_p, top_k, stop, repetition_penalty, speculation, ...
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert (self.messages is None) != (self.prompt is None), "messages xor prompt"


@dataclass(slots=True)
class RequestResult:
    index: int
    success: bool = False
    error: str = ""
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    start_s: float = 0.0            # since the start of the run
    e2e_s: float = 0.0
    ttft_s: float | None = None     # streamed requests that produced text only
    itls_s: list[float] = field(default_factory=list)
    speculation: dict[str, Any] | None = None  # usage.speculation


# ------------------------------------------------------------------ datasets

# Prompt sets shipped with specdec, by --dataset name: varied chat prompts (open-ended,
# explanations, lists, one repeat), and eight "repeat this paragraph" prompts (text a
# lookup drafter predicts, to see speculation pay under concurrency); then the workloads
# generated from templates (specdec/bench/workloads.py: agent tool loops, code edits, RAG,
# JSON extraction, multi-turn chats, open questions).
SHIPPED_DATASETS = {"builtin": "prompts/builtin.jsonl", "repeat": "prompts/repeat.jsonl",
                    **{name: f"prompts/{name}.jsonl" for name in WORKLOADS}}


def load_requests(dataset: str, num_prompts: int | None, *, endpoint: str = "chat",
                  max_tokens: int | None = None, options: dict[str, Any] | None = None,
                  response_format: bool = True) -> list[BenchRequest]:
    """A shipped dataset (SHIPPED_DATASETS) or a JSONL path: {"prompt": ...} or
    {"messages": [...]}, optional "max_tokens" and "response_format".

    Lines are taken in order, cycling when num_prompts exceeds them (None: each line once).
    `max_tokens` overrides the lines' own. A line's "response_format" goes into chat
    requests unless `response_format` is False (servers without structured outputs refuse
    it); completions requests never carry it. A shipped workload's conversation goes to the
    completions endpoint as plain text (`workloads.transcript`). Raises ValueError naming the
    line of a bad one.
    """
    if dataset in SHIPPED_DATASETS:
        source = dataset
        text = resources.files("specdec").joinpath(SHIPPED_DATASETS[dataset]).read_text("utf-8")
    else:
        source = dataset
        try:
            text = Path(dataset).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--dataset {dataset}: {exc}") from None
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            lines.append(_parse_line(line, f"{source} line {number}", endpoint, max_tokens,
                                     options or {}, response_format=response_format,
                                     as_transcript=dataset in WORKLOADS))
    if not lines:
        raise ValueError(f"--dataset {source} has no prompts")
    count = len(lines) if num_prompts is None else num_prompts
    return [lines[i % len(lines)] for i in range(count)]


def _parse_line(line: str, where: str, endpoint: str, max_tokens: int | None,
                options: dict[str, Any], *, response_format: bool = True,
                as_transcript: bool = False) -> BenchRequest:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a JSON object")
    messages, prompt = item.get("messages"), item.get("prompt")
    options = dict(options)
    if "response_format" in item:
        if not isinstance(item["response_format"], dict):
            raise ValueError(f'{where}: "response_format" must be a JSON object')
        if response_format and endpoint == "chat":
            options["response_format"] = item["response_format"]
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}}')
        if endpoint != "chat":
            if not as_transcript:
                raise ValueError(f'{where}: "messages" needs --endpoint chat')
            prompt = transcript(messages)
            messages = None
    elif isinstance(prompt, str) and prompt:
        if endpoint == "chat":
            messages, prompt = [{"role": "user", "content": prompt}], None
    elif (isinstance(prompt, list) and prompt and endpoint == "completions"
          and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        pass  # token ids, as the completions API takes them
    else:
        raise ValueError(f'{where}: needs "prompt" (a non-empty string; token ids with '
                         '--endpoint completions) or "messages"')
    line_max_tokens = item.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not isinstance(line_max_tokens, int) or isinstance(line_max_tokens, bool) or line_max_tokens < 1:
        raise ValueError(f'{where}: "max_tokens" must be an integer >= 1')
    return BenchRequest(messages=messages, prompt=prompt if messages is None else None,
                        max_tokens=max_tokens or line_max_tokens, options=options)


# ------------------------------------------------------------------ one request

class RequestFailed(Exception):
    pass


def request_body(request: BenchRequest, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {**request.options, "max_tokens": request.max_tokens,
                            "stream": request.stream}
    if model is not None:
        body["model"] = model
    if request.messages is not None:
        body["messages"] = request.messages
    else:
        body["prompt"] = request.prompt
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def send_request(client: httpx.AsyncClient, request: BenchRequest, model: str | None,
                       result: RequestResult) -> RequestResult:
    """Fills `result`; a failure of any kind is recorded in it, never raised."""
    chat = request.messages is not None
    url = ENDPOINTS["chat" if chat else "completions"]
    started = time.perf_counter()
    try:
        if request.stream:
            await _stream(client, url, request_body(request, model), chat, started, result)
        else:
            response = await client.post(url, json=request_body(request, model))
            if response.status_code != 200:
                raise RequestFailed(_http_error(response))
            answer = response.json()
            choice = answer["choices"][0]
            result.text = choice["message"]["content"] if chat else choice["text"]
            result.finish_reason = choice.get("finish_reason")
            _take_usage(answer.get("usage"), result)
        result.success = True
    except Exception as exc:
        result.success = False
        result.error = describe_error(exc)
    result.e2e_s = time.perf_counter() - started
    return result


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], chat: bool,
                  started: float, result: RequestResult) -> None:
    pieces: list[str] = []
    last_chunk_at: float | None = None
    num_text_chunks = 0
    usage = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RequestFailed(_http_error(response))
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RequestFailed(f"error event: {_error_message(chunk)}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if not text:
                    continue
                now = time.perf_counter()
                if last_chunk_at is None:
                    result.ttft_s = now - started
                else:
                    result.itls_s.append(now - last_chunk_at)
                last_chunk_at = now
                num_text_chunks += 1
                pieces.append(text)
        else:
            raise RequestFailed("the stream ended without [DONE]")
    result.text = "".join(pieces)
    result.num_output_tokens = num_text_chunks  # a lower bound when usage is missing
    _take_usage(usage, result)


def _take_usage(usage: dict[str, Any] | None, result: RequestResult) -> None:
    if not usage:
        return
    result.num_prompt_tokens = usage.get("prompt_tokens") or 0
    result.num_output_tokens = usage.get("completion_tokens") or result.num_output_tokens
    result.speculation = usage.get("speculation")


def _http_error(response: httpx.Response) -> str:
    try:
        message = _error_message(response.json())
    except ValueError:
        message = response.text[:200]
    return f"HTTP {response.status_code}: {message}"


def _error_message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error if error is not None else body)[:200]


def describe_error(exc: Exception) -> str:
    if isinstance(exc, RequestFailed):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
