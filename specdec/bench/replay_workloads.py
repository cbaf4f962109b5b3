"""Replay streams from the built-in workloads: each request's prompt ids as the gateway
renders them, and the target's greedy answer with speculation off, generated in-process
(an engine as `serve` builds it, no drafter). A stream is written to a directory as
NAME.jsonl once and read from there afterwards, so proposers are compared on one answer
set however often the replay runs.

Chat requests are rendered with the model's chat template; an `extract` line's
response_format is left out (the answer is the model's unconstrained greedy text: a
replay has no grammar to apply).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.chat import render_chat_prompt
from specdec.bench.replay_stream import StreamRequest, load_stream, save_stream
from specdec.bench.serve_requests import load_requests
from specdec.bench.workloads import WORKLOADS
from specdec.config_flags import build_config
from specdec.engine.sampling_params import SamplingParams
from specdec.models.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model
from verifier_svc.builder import VerifierConfig, build_engine
from specdec.engine.engine import Engine
from verifier_svc.requests import collect_outputs

logger = logging.getLogger(__name__)


def workload_names(values: Sequence[str]) -> list[str]:
    names: list[str] = []
    for value in values:
        for name in (WORKLOADS if value == "all" else value.split(",")):
            if name not in WORKLOADS:
                raise ValueError(f"--workload {name}: not one of {', '.join(WORKLOADS)}, all")
            if name not in names:
                names.append(name)
    return names


def workload_streams(names: Sequence[str], stream_dir: Path | None, model: str | None,
                     max_num_seqs: int) -> dict[str, list[StreamRequest]]:
    streams: dict[str, list[StreamRequest]] = {}
    missing = []
    for name in names:
        path = stream_dir / f"{name}.jsonl" if stream_dir else None
        if path is not None and path.exists():
            streams[name] = load_stream(path)
        else:
            missing.append(name)
    if missing:
        streams.update(asyncio.run(_generate_streams(missing, model or DEFAULT_MODEL,
                                                     max_num_seqs, stream_dir)))
    return {name: streams[name] for name in names}


async def _generate_streams(names: Sequence[str], model: str, max_num_seqs: int,
                            stream_dir: Path | None) -> dict[str, list[StreamRequest]]:
    """Each stream is written to `stream_dir` (when given) as soon as it is complete."""
    model_dir = resolve_model(model)
    tokenizer = load_tokenizer(model_dir)
    engine, _ = build_engine(build_config(VerifierConfig, model=str(model_dir), device="cpu",
                                          max_model_len=4096, max_num_seqs=max_num_seqs,
                                          adaptive_speculation=False))
    await engine.start()
    try:
        streams = {}
        for name in names:
            streams[name] = await _answer_all(engine, tokenizer, name, max_num_seqs)
            logger.info("generated %s: %d requests, %d answer tokens", name, len(streams[name]),
                        sum(len(request.answer_ids) for request in streams[name]))
            if stream_dir is not None:
                stream_dir.mkdir(parents=True, exist_ok=True)
                save_stream(streams[name], stream_dir / f"{name}.jsonl")
        return streams
    finally:
        await engine.stop()


async def _answer_all(engine: Engine, tokenizer: Any, name: str,
                      max_num_seqs: int) -> list[StreamRequest]:
    requests = load_requests(name, None, response_format=False)  # chat requests
    prompts = []
    for request in requests:
        assert request.messages is not None
        prompts.append(render_chat_prompt(tokenizer, request.messages))
    limit = asyncio.Semaphore(max_num_seqs)

    async def answer(index: int) -> list[int]:
        async with limit:
            params = SamplingParams(temperature=0.0, max_tokens=requests[index].max_tokens)
            _, queue = engine.add_request(f"replay-{name}-{index}", prompts[index], params)
            token_ids, _ = await collect_outputs(queue)
            logger.debug("%s request %d: %d answer tokens", name, index, len(token_ids))
            return list(token_ids)

    answers = await asyncio.gather(*(answer(index) for index in range(len(prompts))))
    return [StreamRequest(list(prompt), answer) for prompt, answer in zip(prompts, answers)]
