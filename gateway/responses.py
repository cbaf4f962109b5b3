"""OpenAI response objects, in the exact shapes the OpenAI API returns."""

from __future__ import annotations

import time
import uuid

from gateway.generation import GenerationResult, usage


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
