"""OpenAI response objects, in the exact shapes the OpenAI API returns."""

from __future__ import annotations

import time
import uuid

from gateway.generation import GenerationResult, usage


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def chat_completion(response_id: str, created: int, model: str, text: str,
                    result: GenerationResult) -> dict:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": result.finish_reason,
        }],
        "usage": usage(result),
    }


def chat_chunk(response_id: str, created: int, model: str, delta: dict,
               finish_reason: str | None, include_usage: bool) -> dict:
    chunk = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None,
                     "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def text_completion(response_id: str, created: int, model: str, text: str,
                    result: GenerationResult) -> dict:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None,
                     "finish_reason": result.finish_reason}],
        "usage": usage(result),
    }


def completion_chunk(response_id: str, created: int, model: str, text: str,
                     finish_reason: str | None, include_usage: bool) -> dict:
    chunk = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None,
                     "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(response_id: str, created: int, model: str, object_name: str,
                result: GenerationResult) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices."""
    return {"id": response_id, "object": object_name, "created": created, "model": model,
            "choices": [], "usage": usage(result)}


def model_list(model_name: str, root: str, created: int, max_model_len: int | None) -> dict:
    card = {"id": model_name, "object": "model", "created": created, "owned_by": "specdec",
            "root": root, "parent": None}
    if max_model_len:
        card["max_model_len"] = max_model_len
    return {"object": "list", "data": [card]}
