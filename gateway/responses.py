"""OpenAI response objects, in the exact shapes the OpenAI API returns, and the builders
that turn a request's choices into them (whole, or as SSE chunks)."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gateway.choices import Choice, CollectedChoice, merged_deltas
from gateway.generation import GenerationResult, TextDelta, sum_speculation, usage
from gateway.logprobs import CompletionLogprobs, TokenTexts, chat_logprobs_content
from gateway.spec_decode_metrics import metrics_body
from gateway.tool_chat import ToolOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def chat_choice(index: int, message: dict, logprobs: dict | None,
                finish_reason: str | None) -> dict:
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chat_completion(response_id: str, created: int, model: str, choices: list[dict],
                    results: list[GenerationResult]) -> dict:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(results),
    }


def chat_chunk(response_id: str, created: int, model: str, delta: dict,
               finish_reason: str | None, include_usage: bool, *, index: int = 0,
               logprobs: dict | None = None) -> dict:
    chunk = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                     "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def completion_choice(index: int, text: str, logprobs: dict | None,
                      finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def text_completion(response_id: str, created: int, model: str, choices: list[dict],
                    results: list[GenerationResult]) -> dict:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(results),
    }


def completion_chunk(response_id: str, created: int, model: str, text: str,
                     finish_reason: str | None, include_usage: bool, *, index: int = 0,
                     logprobs: dict | None = None) -> dict:
    chunk = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs,
                     "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(response_id: str, created: int, model: str, object_name: str,
                results: list[GenerationResult]) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices."""
    return {"id": response_id, "object": object_name, "created": created, "model": model,
            "choices": [], "usage": usage(results)}


def model_list(model_name: str, root: str, created: int, max_model_len: int | None) -> dict:
    card = {"id": model_name, "object": "model", "created": created, "owned_by": "specdec",
            "root": root, "parent": None}
    if max_model_len:
        card["max_model_len"] = max_model_len
    return {"object": "list", "data": [card]}


@dataclass(slots=True)
class Output:
    """How one request's choices become OpenAI objects."""

    response_id: str
    created: int
    model: str
    chat: bool
    token_texts: TokenTexts | None  # None: no logprobs asked
    # Makes each choice's tool-call reader; None: the text is the content.
    tool_output: Callable[[], ToolOutput | None] | None = None
    # --per-request-spec-decode-metrics, and the server's k (the histogram's length - 1).
    spec_decode_metrics: str = "none"
    num_speculative_tokens: int = 0

    def with_metrics(self, body: dict, results: list[GenerationResult]) -> dict:
        """`body` with vLLM's per-request `metrics` when asked for (gateway.spec_decode_metrics)."""
        metrics = metrics_body(self.spec_decode_metrics, sum_speculation(results),
                               self.num_speculative_tokens)
        if metrics is not None:
            body["metrics"] = metrics
        return body

    def chat_logprobs(self, delta: TextDelta) -> dict | None:
        if self.token_texts is None:
            return None
        return {"content": chat_logprobs_content(delta.logprobs, delta.token_ids,
                                                 self.token_texts)}

    def new_tool_output(self) -> ToolOutput | None:
        return self.tool_output() if self.tool_output is not None else None


async def chat_chunks(output: Output, choices: list[Choice],
                      include_usage: bool) -> AsyncIterator[dict]:
    chunk = functools.partial(chat_chunk, output.response_id, output.created, output.model)
    readers = {choice.index: output.new_tool_output() for choice in choices}
    for choice in choices:
        yield chunk({"role": "assistant", "content": ""}, None, include_usage,
                    index=choice.index)
    async for choice, delta in merged_deltas(choices):
        reader = readers[choice.index]
        reason = choice.result.finish_reason
        if delta is None:
            if reader is not None:
                rest = reader.finish()
                if rest:
                    yield chunk(rest, None, include_usage, index=choice.index)
                reason = reader.finish_reason(reason)
            yield chunk({}, reason, include_usage, index=choice.index)
            continue
        fields = {"content": delta.text} if reader is None else reader.feed(delta.text)
        logprobs = output.chat_logprobs(delta)
        if fields or logprobs is not None:
            yield chunk(fields, None, include_usage, index=choice.index, logprobs=logprobs)
    if include_usage:
        results = [c.result for c in choices]
        yield output.with_metrics(usage_chunk(output.response_id, output.created, output.model,
                                              "chat.completion.chunk", results), results)


async def completion_chunks(output: Output, choices: list[Choice],
                            include_usage: bool) -> AsyncIterator[dict]:
    chunk = functools.partial(completion_chunk, output.response_id, output.created, output.model)
    texts = output.token_texts
    builders = ({choice.index: CompletionLogprobs(texts) for choice in choices}
                if texts is not None else None)
    async for choice, delta in merged_deltas(choices):
        if delta is None:
            yield chunk("", choice.result.finish_reason, include_usage, index=choice.index)
        else:
            logprobs = (builders[choice.index].build(delta.logprobs, delta.token_ids)
                        if builders is not None else None)
            yield chunk(delta.text, None, include_usage, index=choice.index, logprobs=logprobs)
    if include_usage:
        results = [c.result for c in choices]
        yield output.with_metrics(usage_chunk(output.response_id, output.created, output.model,
                                              "text_completion", results), results)


def response_body(output: Output, collected: list[CollectedChoice]) -> dict:
    body = []
    for item in collected:
        reason = item.choice.result.finish_reason
        if output.chat:
            logprobs = output.chat_logprobs(TextDelta(item.text, item.token_ids, item.logprobs))
            reader = output.new_tool_output()
            message = {"role": "assistant", "content": item.text}
            if reader is not None:
                message = reader.message(item.text)
                reason = reader.finish_reason(reason)
            body.append(chat_choice(item.choice.index, message, logprobs, reason))
        else:
            logprobs = (CompletionLogprobs(output.token_texts).build(item.logprobs, item.token_ids)
                        if output.token_texts is not None else None)
            body.append(completion_choice(item.choice.index, item.text, logprobs, reason))
    build = chat_completion if output.chat else text_completion
    results = [item.choice.result for item in collected]
    return output.with_metrics(build(output.response_id, output.created, output.model, body,
                                     results), results)
