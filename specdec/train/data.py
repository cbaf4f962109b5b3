"""Self-distillation data: the target answers the training instructions through our own engine.

Each record is one conversation the target produced itself: `{"prompt": str, "prompt_ids":
[...], "output_ids": [...], "temperature": float}`, where `prompt_ids` is the chat template
applied to the instruction and `output_ids` the target's answer (greedy at temperature 0, or
sampled). Training on the target's own answers teaches a draft what the target will say,
which is what acceptance measures.

Requests go to one in-process `Engine` (no drafter) with a large `max_num_seqs`, so the
verifier's continuous batching does the work; the records are written as they finish, and
a rerun skips prompts already answered (resumable).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.config_flags import build_config
from specdec.engine.sampling_params import SamplingParams
from specdec.models.loader import load_model_config
from specdec.models.model_files import load_tokenizer, resolve_model
from specdec.train.progress import Progress
from verifier_svc.builder import VerifierConfig, build_engine
from specdec.engine.engine import Engine
from verifier_svc.requests import collect_outputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateOptions:
    model: str
    output: Path
    num_prompts: int = 1200
    sampled_fraction: float = 0.25  # answered at `temperature`, the rest greedily
    temperature: float = 0.7
    max_tokens: int = 256
    batch_size: int = 64  # max_num_seqs of the engine
    dtype: str = "auto"
    max_minutes: float | None = None
    seed: int = 0


def read_records(path: Path) -> list[dict]:
    """The records of a data file (one JSON object per line)."""
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plan_requests(prompts: list[str], options: GenerateOptions) -> list[tuple[str, float]]:
    """(prompt, temperature) pairs: every k-th prompt sampled so both kinds span all subjects."""
    chosen = prompts[:options.num_prompts]
    every = round(1 / options.sampled_fraction) if options.sampled_fraction > 0 else 0
    return [(prompt, options.temperature if every and index % every == every - 1 else 0.0)
            for index, prompt in enumerate(chosen)]


async def _answer(engine: Engine, index: int, prompt_ids: list[int], params: SamplingParams
                  ) -> tuple[int, list[int]]:
    _, queue = engine.add_request(f"distill-{index}", prompt_ids, params, 0)
    output_ids, _ = await collect_outputs(queue)
    return index, output_ids


async def _generate(options: GenerateOptions, prompts: list[str]) -> int:
    model_dir = resolve_model(options.model)
    tokenizer = load_tokenizer(model_dir)
    done = {(record["prompt"], record["temperature"]) for record in read_records(options.output)}
    requests = [request for request in plan_requests(prompts, options) if request not in done]
    if not requests:
        logger.info("all %d answers already in %s", len(done), options.output)
        return 0
    max_model_len = min(1024, load_model_config(model_dir).max_position_embeddings)
    engine, _ = build_engine(build_config(VerifierConfig,
        model=str(model_dir), dtype=options.dtype, max_model_len=max_model_len,
        max_num_seqs=options.batch_size, max_num_batched_tokens=4096,
        num_kv_blocks=options.batch_size * (max_model_len // 16) + 64))
    await engine.start()
    deadline = time.monotonic() + 60 * options.max_minutes if options.max_minutes else None
    progress = Progress("generate", total=len(requests), unit="answers")
    options.output.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    try:
        pending: set[asyncio.Task[tuple[int, list[int]]]] = set()
        encoded: dict[int, list[int]] = {}
        next_request = 0
        with open(options.output, "a") as handle:
            while next_request < len(requests) or pending:
                # Keep the engine full but queue nothing, so a deadline stops within one answer.
                out_of_time = deadline is not None and time.monotonic() > deadline
                while (not out_of_time and next_request < len(requests)
                       and len(pending) < options.batch_size):
                    prompt, temperature = requests[next_request]
                    encoded[next_request] = tokenizer.apply_chat_template(
                        [{"role": "user", "content": prompt}], add_generation_prompt=True,
                        tokenize=True, return_dict=False)
                    params = SamplingParams(temperature=temperature, max_tokens=options.max_tokens,
                                            seed=options.seed + next_request if temperature else None)
                    pending.add(asyncio.create_task(
                        _answer(engine, next_request, encoded[next_request], params)))
                    next_request += 1
                if not pending:
                    break
                finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    index, output_ids = task.result()
                    prompt, temperature = requests[index]
                    handle.write(json.dumps({"prompt": prompt, "prompt_ids": encoded.pop(index),
                                             "output_ids": output_ids, "temperature": temperature}) + "\n")
                    handle.flush()
                    written += 1
                    progress.update(1, tokens=len(output_ids))
                if out_of_time and pending:
                    logger.info("--max-minutes reached: finishing %d answers in flight", len(pending))
    finally:
        progress.close()
        await engine.stop()
    return written


def generate(options: GenerateOptions, prompts: list[str]) -> int:
    """Answers `prompts` with the target (see module docstring); returns how many were written."""
    return asyncio.run(_generate(options, prompts))


def text_records(tokenizer: object, num_records: int, max_answer_tokens: int = 224, seed: int = 0) -> list[dict]:
    """Teacher-forcing records from text installed packages ship (their PyPI descriptions).

    Each is a chat turn whose answer is a passage the target did NOT write: cheaper than
    decoding (one forward per passage, no generation), so it stretches a small CPU budget.
    The labels are still the target's own (its top-K at every position, see features.py);
    only the context differs from the target's own answers. `temperature` is None.
    """
    import importlib.metadata
    import random

    passages: list[tuple[str, str]] = []
    for distribution in importlib.metadata.distributions():
        description = distribution.metadata.get_payload() or ""  # type: ignore[attr-defined]
        name = distribution.name or "this"
        paragraphs = [p.strip() for p in description.split("\n\n") if len(p.strip()) > 200]
        passages += [(name, p) for p in paragraphs]
    random.Random(seed).shuffle(passages)
    records = []
    for name, passage in passages[:num_records]:
        prompt = f"Tell me about the {name} Python package."
        prompt_ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False)
        output_ids = tokenizer.encode(passage, add_special_tokens=False)[:max_answer_tokens]  # type: ignore[attr-defined]
        records.append({"prompt": prompt, "prompt_ids": prompt_ids, "output_ids": output_ids,
                        "temperature": None, "source": f"text:{name}"})
    return records
