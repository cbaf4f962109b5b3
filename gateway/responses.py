"""OpenAI response objects, in the exact shapes the OpenAI API returns, and the builders
that turn a request's choices into them (whole, or as SSE chunks)."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from gateway.choices import Choice, CollectedChoice, merged_deltas
from gateway.generation import GenerationResult, TextDelta, usage
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


def _with_token_ids(choice: dict, token_ids: list[int] | None) -> dict:
    """vLLM's return_token_ids: each choice (or chunk choice) carries its tokens."""
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


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
               logprobs: dict | None = None, token_ids: list[int] | None = None) -> dict:
    chunk = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [_with_token_ids({"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish_reason}, token_ids)],
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
                     logprobs: dict | None = None, token_ids: list[int] | None = None) -> dict:
    chunk = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_with_token_ids({"index": index, "text": text, "logprobs": logprobs,
                                     "finish_reason": finish_reason}, token_ids)],
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
    # echo: text every choice starts with (the prompt, or the assistant message continued).
    echo_text: str = ""
    # return_token_ids: the prompt's ids (then every choice carries its own); None: not asked.
    prompt_token_ids: list[int] | None = None

    def with_metrics(self, body: dict, results: list[GenerationResult]) -> dict:
        """`body` with vLLM's per-request `metrics` when asked for (gateway.spec_decode_metrics)."""
        metrics = metrics_body(self.spec_decode_metrics, results, self.num_speculative_tokens)
        if metrics is not None:
            body["metrics"] = metrics
        return body

    def token_ids(self, token_ids: list[int]) -> list[int] | None:
        return list(token_ids) if self.prompt_token_ids is not None else None

    def first_chunk(self, chunk: dict) -> dict:
        """The response's first chunk carries the prompt's ids (vLLM's return_token_ids)."""
        if self.prompt_token_ids is not None:
            chunk["prompt_token_ids"] = self.prompt_token_ids
        return chunk

    def chat_logprobs(self, delta: TextDelta) -> dict | None:
        if self.token_texts is None:
            return None
        return {"content": chat_logprobs_content(delta.logprobs, delta.token_ids,
                                                 self.token_texts)}

    def new_tool_output(self) -> ToolOutput | None:
        return self.tool_output() if self.tool_output is not None else None


async def chat_chunks(output: Output, choices: list[Choice],
                      include_usage: bool) -> AsyncGenerator[dict, None]:
    chunk = functools.partial(chat_chunk, output.response_id, output.created, output.model)
    readers = {choice.index: output.new_tool_output() for choice in choices}
    for choice in choices:
        first = chunk({"role": "assistant", "content": ""}, None, include_usage,
                      index=choice.index, token_ids=output.token_ids([]))
        yield output.first_chunk(first) if choice.index == 0 else first
        if output.echo_text:
            yield chunk({"content": output.echo_text}, None, include_usage, index=choice.index,
                        token_ids=output.token_ids([]))
    async for choice, delta in merged_deltas(choices):
        reader = readers[choice.index]
        reason = choice.result.finish_reason
        if delta is None:
            if reader is not None:
                rest = reader.finish()
                if rest:
                    yield chunk(rest, None, include_usage, index=choice.index,
                                token_ids=output.token_ids([]))
                reason = reader.finish_reason(reason)
            yield chunk({}, reason, include_usage, index=choice.index,
                        token_ids=output.token_ids([]))
            continue
        fields = {"content": delta.text} if reader is None else reader.feed(delta.text)
        logprobs = output.chat_logprobs(delta)
        token_ids = output.token_ids(delta.token_ids)
        if fields or logprobs is not None or token_ids:
            yield chunk(fields, None, include_usage, index=choice.index, logprobs=logprobs,
                        token_ids=token_ids)
    if include_usage:
        results = [c.result for c in choices]
        yield output.with_metrics(usage_chunk(output.response_id, output.created, output.model,
                                              "chat.completion.chunk", results), results)


async def completion_chunks(output: Output, choices: list[Choice],
                            include_usage: bool) -> AsyncGenerator[dict, None]:
    chunk = functools.partial(completion_chunk, output.response_id, output.created, output.model)
    texts = output.token_texts
    builders = ({choice.index: CompletionLogprobs(texts) for choice in choices}
                if texts is not None else None)
    echoed: set[int] = set()  # choices whose first chunk (with the echo) went out
    async for choice, delta in merged_deltas(choices):
        prefix = "" if choice.index in echoed else output.echo_text
        if delta is None:
            made = chunk(prefix, choice.result.finish_reason, include_usage, index=choice.index,
                         token_ids=output.token_ids([]))
        else:
            logprobs = (builders[choice.index].build(delta.logprobs, delta.token_ids)
                        if builders is not None else None)
            made = chunk(prefix + delta.text, None, include_usage, index=choice.index,
                         logprobs=logprobs, token_ids=output.token_ids(delta.token_ids))
        yield output.first_chunk(made) if not echoed else made
        echoed.add(choice.index)
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
            if output.echo_text:
                message["content"] = output.echo_text + (message["content"] or "")
            choice = chat_choice(item.choice.index, message, logprobs, reason)
        else:
            logprobs = (CompletionLogprobs(output.token_texts).build(item.logprobs, item.token_ids)
                        if output.token_texts is not None else None)
            choice = completion_choice(item.choice.index, output.echo_text + item.text, logprobs,
                                       reason)
        body.append(_with_token_ids(choice, output.token_ids(item.token_ids)))
    build = chat_completion if output.chat else text_completion
    results = [item.choice.result for item in collected]
    response = output.with_metrics(build(output.response_id, output.created, output.model, body,
                                         results), results)
    if output.prompt_token_ids is not None:
        response["prompt_token_ids"] = output.prompt_token_ids
    return response
