"""One request's failure is that request's alone (issue 44, item 2).

A constrained request whose grammar state raises at runtime (in its forced tokens, its
draft cut, its masks or its advance), or a request whose stop handling raises, beside 5
plain requests in the same engine batches, with ngram speculation: only it fails, with a
clear error; the others complete with the greedy outputs they have when served alone, and
no KV block stays taken. A grammar that goes past the grammar library's limits while
generating (llguidance's matcher in its error state in a mask, an accept, a validation or
a rollback; or a real grammar whose limit lies past the admission probe) fails as an
INVALID_ARGUMENT naming `grammar`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from specdec.engine.sampling_params import SamplingParams
from specdec.errors import InvalidRequestError, SpecdecError
from specdec.models.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model
from tests.support.engine_harness import served_engine
from specdec.grammar_probe import PROBE_DEPTH
from tests.support.grammar_decode import late_limit_grammar, make_padded_tiny_model
from verifier_svc.drafting.drafter_pool import Draft, DraftRequest
from specdec.engine.engine import Engine
from verifier_svc.grammar.matcher import GrammarLimitError, GrammarState
from verifier_svc.requests import EngineError, collect_outputs

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
NUM_BLOCKS = 512
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"},
                                                      "n": {"type": "integer"}},
                     "required": ["name", "n"], "additionalProperties": False})
PLAIN = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
CONSTRAINED = SamplingParams(temperature=0.0, max_tokens=16)
HANG_GUARD_S = 120.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    path = tmp_path_factory.mktemp("faults-target")
    make_padded_tiny_model(tokenizer.eos_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class FailingState:
    """A GrammarState whose `method` raises from its `after`-th call on."""

    def __init__(self, real: GrammarState, method: str, after: int, error: Exception) -> None:
        self._real = real
        self._method = method
        self._calls_left = after
        self._error = error

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._real, name)
        if name != self._method:
            return attribute

        def failing(*args: object, **kwargs: object) -> object:
            if self._calls_left <= 0:
                raise self._error
            self._calls_left -= 1
            return attribute(*args, **kwargs)

        return failing


def prompt(index: int) -> list[int]:
    # Repeats, so that ngram drafts for every request.
    return [1] + [100 + index, 200 + index, 300 + index] * 6


async def outcome(engine: Engine, index: int, params: SamplingParams,
                  grammar: Any = None) -> tuple[int, Any]:
    seq_id, queue = engine.add_request(f"r{index}", prompt(index), params, grammar=grammar)
    return seq_id, queue


async def finish(queue: asyncio.Queue) -> list[int] | SpecdecError:
    try:
        tokens, _ = await asyncio.wait_for(collect_outputs(queue), HANG_GUARD_S)
    except SpecdecError as error:
        return error
    return tokens


async def run_beside_plain(engine: Engine, inject: Any, constraint: tuple[str, str] = (
        "json_schema", SCHEMA), params: SamplingParams = CONSTRAINED,
) -> tuple[list[list[int] | SpecdecError], list[int] | SpecdecError]:
    """5 plain requests and one faulty request (`inject(engine, seq_id)` sets the fault up),
    all at once; how each ended."""
    compiled = await engine.compile_grammar(*constraint)
    queues = []
    for index in range(5):
        queues.append((await outcome(engine, index, PLAIN))[1])
        if index == 2:  # in the middle of the batch
            seq_id, faulty = await outcome(engine, 9, params, compiled)
            inject(engine, seq_id)
    results = await asyncio.gather(*(finish(queue) for queue in [*queues, faulty]))
    return list(results[:5]), results[5]


def fail_state(method: str, after: int, error: Exception | None = None) -> Any:
    def inject(engine: Engine, seq_id: int) -> None:
        seq = engine._sequences[seq_id]
        seq.grammar = FailingState(seq.grammar, method, after,
                                   error or RuntimeError(f"injected in {method}"))
    return inject


class FailingMatcher:
    """An llguidance matcher that goes into its error state (as at a parser or lexer limit)
    at the `after`-th call of `method` on: the call then fails as llguidance's own does."""

    def __init__(self, real: Any, method: str, after: int) -> None:
        self._real = real
        self._method = method
        self._calls_left = after
        self._failed = False

    def is_error(self) -> bool:
        return self._failed or self._real.is_error()

    def get_error(self) -> str:
        if self._failed:
            return f"Parser Error: injected limit in {self._method}\n<non-verbose/>"
        return self._real.get_error()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._real, name)
        if name != self._method:
            return attribute

        def failing(*args: object, **kwargs: object) -> object:
            if self._calls_left <= 0 or self._failed:
                self._failed = True
                return False  # consume_token, rollback; a mask call's result is unused
            self._calls_left -= 1
            return attribute(*args, **kwargs)

        return failing


def fail_matcher(method: str, after: int) -> Any:
    def inject(engine: Engine, seq_id: int) -> None:
        state = engine._sequences[seq_id].grammar
        state._matcher = FailingMatcher(state._matcher, method, after)
    return inject


def no_fault(engine: Engine, seq_id: int) -> None:
    pass


def fail_draft_cut(engine: Engine, seq_id: int) -> None:
    """The drafter proposes for the constrained request too, whose grammar then raises
    cutting the draft."""
    fail_state("valid_prefix_len", 0)(engine, seq_id)
    pool = engine.drafter_pool
    assert pool is not None
    propose = pool.propose

    async def proposing(requests: list[DraftRequest], *args: Any) -> dict[int, Draft]:
        drafts = await propose(requests, *args)
        if any(request.seq_id == seq_id for request in requests):
            drafts[seq_id] = Draft(token_ids=[100, 101], probs=None)
        return drafts

    pool.propose = proposing  # type: ignore[method-assign]


def fail_stop_handling(engine: Engine, seq_id: int) -> None:
    append = engine.appender.append_tokens

    def failing(seq: Any, *args: Any, **kwargs: Any) -> None:
        if seq.seq_id == seq_id and seq.num_output_tokens >= 2:
            raise RuntimeError("injected in stop handling")
        append(seq, *args, **kwargs)

    engine.appender.append_tokens = failing  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def alone(model_dir: Path) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with served_engine(model_dir, NGRAM, "cpu", max_model_len=256,
                                 num_kv_blocks=NUM_BLOCKS) as engine:
            return [await finish((await outcome(engine, index, PLAIN))[1])  # type: ignore[misc]
                    for index in range(5)]
    return asyncio.run(run())


@pytest.mark.parametrize("inject", [
    fail_state("fill_masks", 2),
    fail_state("forced_tokens", 1),
    fail_draft_cut,
    fail_state("accept_tokens", 1),
    fail_stop_handling,
], ids=["fill_masks", "forced_tokens", "valid_prefix_len", "advance", "stop_handling"])
async def test_a_failing_sequence_fails_alone(model_dir: Path, alone, inject) -> None:
    async with served_engine(model_dir, NGRAM, "cpu", max_model_len=256,
                             num_kv_blocks=NUM_BLOCKS) as engine:
        plain, faulty = await run_beside_plain(engine, inject)
        assert plain == alone
        assert isinstance(faulty, EngineError), faulty
        assert "RuntimeError" in faulty.message and "injected" not in faulty.message
        assert engine.faults.num_failed == 1
        assert engine.num_requests == 0
        assert engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("method,after", [
    ("unsafe_compute_mask_ptr", 3),  # a mask (fill_masks, forced tokens)
    ("consume_token", 2),  # an accept (advance, a draft's masks, forced tokens)
    ("rollback", 1),  # the rollback after a draft's masks or forced tokens
    ("validate_tokens", 1),  # a draft's cut, an accept's check
])
async def test_the_grammar_library_failing_fails_its_sequence_alone(
        model_dir: Path, alone, method: str, after: int) -> None:
    """llguidance's matcher reaching its error state in any call the engine makes through
    GrammarState: the sequence fails alone, naming its grammar."""
    async with served_engine(model_dir, NGRAM, "cpu", max_model_len=256,
                             num_kv_blocks=NUM_BLOCKS) as engine:
        plain, faulty = await run_beside_plain(engine, fail_matcher(method, after))
        assert plain == alone
        assert isinstance(faulty, InvalidRequestError) and faulty.param == "grammar", faulty
        assert f"injected limit in {method}" in faulty.message
        assert engine.faults.num_failed == 1
        assert engine.num_requests == 0
        assert engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS


async def test_a_real_grammar_past_its_limits_mid_generation_fails_alone(model_dir: Path,
                                                                        alone) -> None:
    """A grammar the admission probe passes (its limit lies past the probe's walk) that
    llguidance gives up on mid-generation, beside 5 plain requests."""
    params = SamplingParams(temperature=0.0, max_tokens=PROBE_DEPTH + 12)
    async with served_engine(model_dir, NGRAM, "cpu", max_model_len=256,
                             num_kv_blocks=NUM_BLOCKS) as engine:
        plain, faulty = await run_beside_plain(
            engine, no_fault, ("grammar", late_limit_grammar(PROBE_DEPTH + 4)), params)
        assert plain == alone
        assert isinstance(faulty, InvalidRequestError) and faulty.param == "grammar", faulty
        assert "too many expressions" in faulty.message and "non-verbose" not in faulty.message
        assert engine.faults.num_failed == 1
        assert engine.num_requests == 0
        assert engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS


async def test_a_grammar_past_its_limits_is_an_invalid_request_naming_it(model_dir: Path,
                                                                       alone) -> None:
    limit = GrammarLimitError("Parser Error: Current row has 20001 items; max is 2000\n"
                              "<non-verbose/>")
    async with served_engine(model_dir, NGRAM, "cpu", max_model_len=256,
                             num_kv_blocks=NUM_BLOCKS) as engine:
        plain, faulty = await run_beside_plain(engine, fail_state("fill_masks", 1, limit))
    assert plain == alone
    assert isinstance(faulty, InvalidRequestError) and faulty.param == "grammar"
    assert "row has 20001 items" in faulty.message and "non-verbose" not in faulty.message
