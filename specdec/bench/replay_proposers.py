"""The proposers `bench replay` drives: specdec's suffix method and, where it is installed,
arctic-inference's `SuffixDecodingCache` (the reference behind vLLM's `"method": "suffix"`).

Both are driven as served: a request starts with its prompt, each step drafts from the
context so far and then learns the tokens the target appended, and a finished answer
becomes a draft source for later requests. specdec's method learns a finished answer as
the verifier sends it (`learn`, behind the prompt's last PROMPT_TAIL_TOKENS tokens); the
reference is driven as vLLM's proposer drives it (`start_request` with the prompt,
`add_active_response` with each step's tokens, which also grows the answer in its global
tree, `speculate` on the last max_tree_depth tokens, `stop_request`).

arctic-inference is optional and never a dependency: where it does not import,
`reference_available()` is False and the tool replays specdec's method alone.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from drafter_svc.suffix_proposer import SuffixMethod, build_suffix_method
from specdec.config import SpeculativeConfig
from verifier_svc.drafting.finished_outputs import PROMPT_TAIL_TOKENS

REFERENCE_MODULE = "arctic_inference.suffix_decoding"


@dataclass(frozen=True, slots=True)
class SuffixSettings:
    """The settings both proposers run with (vLLM's suffix_decoding_* fields)."""

    num_speculative_tokens: int
    max_tree_depth: int = 24
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    max_cached_requests: int = 10000
    use_tree_spec: bool = False

    def speculative_config(self) -> SpeculativeConfig:
        config = SpeculativeConfig.parse({
            "method": "suffix", "num_speculative_tokens": self.num_speculative_tokens,
            "suffix_decoding_max_tree_depth": self.max_tree_depth,
            "suffix_decoding_max_spec_factor": self.max_spec_factor,
            "suffix_decoding_min_token_prob": self.min_token_prob,
            "suffix_decoding_max_cached_requests": self.max_cached_requests,
            "suffix_decoding_use_tree_spec": self.use_tree_spec})
        assert config is not None
        return config


@dataclass(slots=True)
class ReplayDraft:
    """A step's draft: its tokens and, for a tree draft, their parents
    (specdec/engine/draft_tree.py); None for a flat one."""

    token_ids: list[int]
    parents: list[int] | None = None


class ReplayProposer(Protocol):
    """One request at a time: start, then (propose, extend) per step, then finish."""

    name: str

    def start(self, request_id: int, prompt_ids: Sequence[int]) -> None: ...

    def propose(self, max_tokens: int) -> ReplayDraft: ...

    def extend(self, token_ids: Sequence[int]) -> None: ...

    def finish(self) -> None: ...


class SpecdecSuffix:
    """drafter_svc/suffix_proposer.py's method, fed as the verifier feeds it."""

    name = "specdec"

    def __init__(self, settings: SuffixSettings) -> None:
        self._method: SuffixMethod = build_suffix_method(settings.speculative_config())
        self._request_id = -1
        self._prompt_ids: list[int] = []
        self._answer_ids: list[int] = []

    def start(self, request_id: int, prompt_ids: Sequence[int]) -> None:
        self._request_id, self._prompt_ids, self._answer_ids = request_id, list(prompt_ids), []
        self._method.add_sequence(request_id)
        self._method.append_tokens(request_id, self._prompt_ids, None)

    def propose(self, max_tokens: int) -> ReplayDraft:
        proposal = self._method.propose([self._request_id], [max_tokens])[0]
        return ReplayDraft(list(proposal.draft_token_ids), proposal.parents)

    def extend(self, token_ids: Sequence[int]) -> None:
        self._answer_ids.extend(token_ids)
        self._method.append_tokens(self._request_id, token_ids, None)

    def finish(self) -> None:
        # The verifier sends the finished output before it removes the sequence.
        self._method.learn(self._request_id, self._prompt_ids[-PROMPT_TAIL_TOKENS:],
                           self._answer_ids)
        self._method.remove_sequence(self._request_id)


class ReferenceSuffix:
    """arctic-inference's SuffixDecodingCache, driven as vLLM's suffix proposer drives it."""

    name = "reference"

    def __init__(self, settings: SuffixSettings) -> None:
        module: Any = importlib.import_module(REFERENCE_MODULE)
        self._settings = settings
        self._cache = module.SuffixDecodingCache(max_tree_depth=settings.max_tree_depth,
                                                 max_cached_requests=settings.max_cached_requests)
        self._request_id = -1
        self._context: list[int] = []

    def start(self, request_id: int, prompt_ids: Sequence[int]) -> None:
        self._request_id, self._context = request_id, list(prompt_ids)
        self._cache.start_request(request_id, self._context)

    def propose(self, max_tokens: int) -> ReplayDraft:
        settings = self._settings
        draft = self._cache.speculate(self._request_id, self._context[-settings.max_tree_depth:],
                                      max_spec_tokens=max_tokens,
                                      max_spec_factor=settings.max_spec_factor,
                                      min_token_prob=settings.min_token_prob,
                                      use_tree_spec=settings.use_tree_spec)
        return ReplayDraft(list(draft.token_ids),
                           list(draft.parents) if settings.use_tree_spec else None)

    def extend(self, token_ids: Sequence[int]) -> None:
        self._context.extend(token_ids)
        self._cache.add_active_response(self._request_id, list(token_ids))

    def finish(self) -> None:
        self._cache.stop_request(self._request_id)


def reference_available() -> bool:
    try:
        return importlib.util.find_spec(REFERENCE_MODULE) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False
