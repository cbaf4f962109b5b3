"""Tree drafts verified by the engine on a tiny model: the same tokens as plain decoding.

Checked with the suffix drafter's own trees and with a scripted drafter that knows the
plain output and sends each step a tree whose first branch at every depth is wrong and
whose second holds the right token: every accepted token then comes from a node that is not
where a flat draft's would be, so its K/V must be moved into place and its siblings must
stay out of its attention, or the output changes. Run with the plain-torch attention, the
C++ kernel and the C++ decoder stack.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.engine.engine import Engine
from specdec.engine.sampling_params import SamplingParams
from tests.support.cpu_kernels import extension_or_skip
from tests.support.engine_harness import PROMPTS, SMALL_ENGINE, generate, greedy, served_engine
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.drafting.drafter_pool import Draft, DraftRequest

K = 7
TREE_SPEC = {"method": "suffix", "num_speculative_tokens": K, "suffix_decoding_use_tree_spec": True}
# (attention backend, C++ decoder stack)
FORWARDS = [("torch", False), ("cpu", False), ("cpu", True)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def wrong_first_tree(true_next: list[int], num_nodes: int, vocab_size: int) -> tuple[list[int], list[int]]:
    """At each depth a wrong token (with a wrong child of its own) and then the right one,
    the right one the parent of the next depth's pair."""
    tokens: list[int] = []
    parents: list[int] = []
    parent = -1
    for depth, token in enumerate(true_next):
        if len(tokens) + 3 > num_nodes:
            break
        wrong = (token + 1 + depth) % vocab_size
        tokens += [wrong, (wrong + 1) % vocab_size, token]
        parents += [parent, len(tokens) - 3, parent]
        parent = len(tokens) - 1
    return tokens, parents


def script_drafter(engine: Engine, outputs_by_prompt: dict[tuple[int, ...], list[int]],
                   vocab_size: int) -> None:
    """Replaces the engine's drafter round trip with wrong_first_tree of the known output."""

    async def propose(requests: list[DraftRequest], finished: list[int], timeout_s: float) -> dict[int, Draft]:
        drafts = {}
        for request in requests:
            for prompt, output in outputs_by_prompt.items():
                context = list(request.token_ids)
                if tuple(context[:len(prompt)]) == prompt and request.num_speculative_tokens:
                    produced = len(context) - len(prompt)
                    tokens, parents = wrong_first_tree(output[produced:], request.num_speculative_tokens,
                                                       vocab_size)
                    if tokens:
                        drafts[request.seq_id] = Draft(tokens, None, parents=parents)
        return drafts

    pool = engine.drafter_pool
    assert pool is not None
    pool.propose = propose  # type: ignore[method-assign]


async def _outputs(tiny_model: Path, device: str, params: SamplingParams, backend: str, cpu_stack: bool,
                   tree_outputs: dict[tuple[int, ...], list[int]] | None) -> tuple[list[list[int]], Engine]:
    spec = TREE_SPEC if tree_outputs is not None else None
    async with served_engine(tiny_model, spec, device, drafter_knows_target=False, attention_backend=backend,
                             cpu_stack=cpu_stack, **SMALL_ENGINE) as engine:
        if tree_outputs is not None:
            script_drafter(engine, tree_outputs, engine.vocab_size)
        outputs = [await generate(engine, prompt, params) for prompt in PROMPTS]
    return outputs, engine


@pytest.mark.parametrize("backend,cpu_stack", FORWARDS)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
async def test_tree_drafts_give_the_plain_tokens(tiny_model: Path, device, backend: str, cpu_stack: bool,
                                                 sampled: bool) -> None:
    if backend == "cpu":
        extension_or_skip()
    params = (SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=24, ignore_eos=True)
              if sampled else greedy())
    plain, _ = await _outputs(tiny_model, str(device), params, backend, cpu_stack, None)
    by_prompt = {tuple(prompt): output for prompt, output in zip(PROMPTS, plain)}
    speculative, engine = await _outputs(tiny_model, str(device), params, backend, cpu_stack, by_prompt)
    assert speculative == plain
    spec = engine.spec
    # Every accepted token sat on a second branch: accepted at all means moved and attended.
    assert spec.num_accepted_tokens >= sum(len(output) for output in plain) // 2, spec
    assert engine.num_steps < sum(len(output) for output in plain)


# Prompts whose tokens go on in more than one way, so that the suffix trie drafts trees.
BRANCHING_PROMPTS = [
    [1, 2, 3, 5, 6, 7, 8, 4, 5, 6, 9, 10, 4, 5, 6, 7, 11, 2, 5, 6],
    [20, 21, 22, 30, 24, 20, 21, 23, 31, 25, 20, 21, 22, 32, 26, 20, 21],
]


@pytest.mark.parametrize("backend,cpu_stack", FORWARDS)
async def test_suffix_tree_drafts_keep_greedy_outputs(tiny_model: Path, device, backend: str,
                                                      cpu_stack: bool) -> None:
    if backend == "cpu":
        extension_or_skip()
    async with served_engine(tiny_model, None, str(device), attention_backend=backend, cpu_stack=cpu_stack,
                             **SMALL_ENGINE) as engine:
        plain = [await generate(engine, prompt, greedy(48)) for prompt in BRANCHING_PROMPTS]
    # Long drafts from short matches: the trie's short matches are where it branches.
    spec = {**TREE_SPEC, "suffix_decoding_max_spec_factor": 4.0}
    async with served_engine(tiny_model, spec, str(device), drafter_knows_target=False,
                             attention_backend=backend, cpu_stack=cpu_stack, **SMALL_ENGINE) as engine:
        pool = engine.drafter_pool
        assert pool is not None
        propose = pool.propose
        num_trees = 0

        async def counting(requests: list[DraftRequest], finished: list[int], timeout_s: float) -> dict[int, Draft]:
            nonlocal num_trees
            drafts = await propose(requests, finished, timeout_s)
            num_trees += sum(1 for draft in drafts.values() if draft.parents is not None)
            return drafts

        pool.propose = counting  # type: ignore[method-assign]
        outputs = [await generate(engine, prompt, greedy(48)) for prompt in BRANCHING_PROMPTS]
    assert outputs == plain
    assert num_trees > 0, "the suffix drafter sent no tree"
    assert engine.spec.num_accepted_tokens > 0
