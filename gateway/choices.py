"""A request's n choices: one verifier call each, collected or streamed together.

Choice 0 opens first and the others once it has answered, on the same verifier: by then
the prompt is prefilled and its full KV blocks sit in that verifier's prefix cache, so
the n choices share one prefill (each recomputes at most the prompt's last partial block,
as in vLLM v1, whose n is the same fan-out over prefix caching). Each call keeps its own
stop strings and is cancelled alone when its stop string appears.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from gateway.generation import GenerationResult, TextDelta, stream_text
from gateway.generation_stream import GenerationStream
from gateway.request_options import OutputOptions
from gateway.verifier_client import VerifierClient
from specdec.v1 import specdec_pb2


@dataclass(slots=True)
class Choice:
    index: int
    result: GenerationResult
    deltas: AsyncGenerator[TextDelta, None]  # closed by close_choices


@dataclass(slots=True)
class CollectedChoice:
    """A non-streamed choice: all its text, tokens and logprobs."""

    choice: Choice
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[specdec_pb2.TokenLogprob] = field(default_factory=list)


async def open_choices(verifier: VerifierClient, requests: list[specdec_pb2.GenerateRequest],
                       tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...],
                       started_at: float, min_tokens: int = 0,
                       output: OutputOptions | None = None) -> list[Choice]:
    """Starts every choice's call; each waits for its first response, so an unreachable
    verifier is still a plain error before any byte is sent."""
    streams: list[GenerationStream] = [await verifier.generate(requests[0])]
    try:
        if len(requests) > 1:
            opened = await asyncio.gather(
                *(verifier.generate(request, prefer=streams[0].address)
                  for request in requests[1:]), return_exceptions=True)
            streams += [stream for stream in opened if isinstance(stream, GenerationStream)]
            failure = next((item for item in opened if isinstance(item, BaseException)), None)
            if failure is not None:
                raise failure
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    output = output or OutputOptions()
    choices = []
    for index, stream in enumerate(streams):
        result = GenerationResult(num_prompt_tokens=len(prompt_token_ids), started_at=started_at)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                             output.skip_special_tokens,
                                             output.spaces_between_special_tokens)
        deltas = stream_text(stream, detokenizer,
                             StopStringMatcher(stop, output.include_stop_str_in_output), result,
                             min_tokens)
        choices.append(Choice(index, result, deltas))
    return choices


async def close_choices(choices: list[Choice]) -> None:
    """Ends every choice's generator, which cancels its verifier call if it still runs.

    No generator may be running in a task then: cancel and await the tasks that iterate
    them first (an `aclose` of a running generator raises instead of closing it)."""
    for choice in choices:
        await choice.deltas.aclose()


async def collect_choice(choice: Choice) -> CollectedChoice:
    collected = CollectedChoice(choice)
    texts = []
    async for delta in choice.deltas:
        texts.append(delta.text)
        collected.token_ids.extend(delta.token_ids)
        collected.logprobs.extend(delta.logprobs)
    collected.text = "".join(texts)
    return collected


async def collect_until_disconnect(choices: list[Choice],
                                   disconnected: Callable[[], Awaitable[None]],
                                   ) -> list[CollectedChoice] | None:
    """Every choice collected; None (and every call cancelled) if the client left first.

    The first choice that fails ends the request with its own error: the other choices'
    tasks are cancelled and awaited (their verifier calls cancelled) before it is raised."""
    tasks = [asyncio.ensure_future(collect_choice(choice)) for choice in choices]
    watch_task = asyncio.ensure_future(disconnected())
    try:
        pending: set[asyncio.Future[Any]] = set(tasks)
        while pending:
            done, _ = await asyncio.wait({*pending, watch_task},
                                         return_when=asyncio.FIRST_COMPLETED)
            if watch_task in done:
                return None
            pending -= done
            failed = next((task for task in done if task.exception() is not None), None)
            if failed is not None:
                raise failed.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        watch_task.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, watch_task, return_exceptions=True)
        await close_choices(choices)


async def merged_deltas(choices: list[Choice]) -> AsyncIterator[tuple[Choice, TextDelta | None]]:
    """Every choice's deltas as they come, then (choice, None) when that choice ends. A
    failing choice raises here, after the others are cancelled."""
    if len(choices) == 1:
        async for delta in choices[0].deltas:
            yield choices[0], delta
        yield choices[0], None
        return
    queue: asyncio.Queue[tuple[Choice, TextDelta | None] | BaseException] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for delta in choice.deltas:
                await queue.put((choice, delta))
            await queue.put((choice, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(choice)) for choice in choices]
    try:
        remaining = len(choices)
        while remaining:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item[1] is None:
                remaining -= 1
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_choices(choices)
