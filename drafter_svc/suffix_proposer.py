"""Suffix decoding (arXiv 2411.04975; vLLM's `"method": "suffix"`) as a `Proposer`.

Two tries (drafter_svc/suffix_tree.py), as in the reference:

- a per-sequence trie over the sequence's prompt and verified output, grown as the
  verifier's updates arrive (the drafter never holds its own drafts, so nothing is rolled
  back);
- one server-wide global trie over the outputs of finished sequences (each behind its
  prompt's lead-in, below), shared by every Propose stream of this drafter, so the next
  request drafts from the previous ones' answers. It holds at most
  `suffix_decoding_max_cached_requests` outputs and `suffix_decoding_max_cached_tokens`
  tokens (lead-ins included), the oldest dropped first (FIFO); 0 disables it. An output
  longer than the token bound on its own is not held.

How an output enters the global trie, exactly once:
- the verifier sends every finished output to every replica of this drafter
  (`learn`, from ProposeRequest.finished_outputs; GetInfo says wants_finished_outputs),
  whichever replica drafted it, so with N replicas each trie learns from all requests.
  The output id is unique per verifier start: a replay of outputs already held (the
  catch-up after a mere stream reconnect) is skipped;
- a stream that has never received a finished output (a client that does not send them)
  publishes its own finished sequences instead, at `remove_sequence`. Once its verifier
  has sent one, the stream stops doing so: the verifier's copy covers it (complete, up to
  the last token, which a drafter never receives) and counting both would count it twice.
  The verifier sends an output no later than the finished_seq_ids entry of its sequence
  (the same message, or an earlier one), and the servicer learns before it removes.

Each output enters the global trie behind the last `lead_in` tokens of its prompt
(ceil(k / max_spec_factor), at most the tree depth; the verifier sends 64): without them an
answer's first tokens match nothing in the global trie, and since a draft is at most
max_spec_factor x the match length long, the next few drafts stay short until the
answer's own text matches. With them, the end of the prompt (the chat template's
assistant header and the end of the last turn) matches at once, and the answers that
followed prompts ending alike draft the new one's first tokens; a draft from a full
lead-in match can already be k long. In an offline replay of the built-in workloads' greedy
answers (one request after another) this took the steps spent on an answer's first 8 tokens
from 3.0 to 2.0 (agent), 4.9 to 3.2 (code-edit) and 4.7 to 2.4 (extract), and tokens per
step up 1.5-6.5% on every workload (chat 1.8%). Only the lead-in of an output is held: a
prompt is not otherwise a global source.

Each step drafts from both tries and keeps the proposal with the higher score (expected
accepted tokens; ties go to the per-sequence one). The draft is greedy (no probs) and at
most min(num_speculative_tokens, max_spec_factor x match length) tokens long.

Locally published, the output of a sequence is what arrived after its first update: a
first update is the whole context, normally the prompt. After a resync the whole context
counts as prompt, so that sequence's earlier output does not reach the global trie (a
missed draft source, not a wrong draft).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from drafter_svc.proposer import (
    DEFAULT_NGRAM_MAX_MODEL_LEN,
    ModelOptions,
    Proposal,
    ProposerInfo,
    TokenHistory,
    target_limits,
)
from drafter_svc.suffix_tree import Draft, SuffixTree
from specdec.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class GlobalSuffixCache:
    """The server-wide trie over finished outputs, FIFO-bounded by request and token count."""

    def __init__(self, max_depth: int, max_cached_requests: int,
                 max_cached_tokens: int = 1 << 62) -> None:
        self.tree = SuffixTree(max_depth)
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.num_tokens = 0  # held, lead-ins included
        # Keyed by output id (the verifier's, >= 0) or, for locally published outputs, by a
        # negative counter: a key already held is not inserted again. Each value: the tokens
        # inserted (lead-in and output) and how many of them are the lead-in.
        self._outputs: OrderedDict[int, tuple[list[int], int]] = OrderedDict()
        self._next_local_key = -1
        # Bumped on every change: a sequence's incremental match list is valid only for the
        # version it was computed at (a removal frees nodes it may point to).
        self.version = 0

    @property
    def enabled(self) -> bool:
        return self.max_cached_requests > 0 and self.max_cached_tokens > 0

    def __len__(self) -> int:
        return len(self._outputs)

    def outputs(self) -> dict[int, list[int]]:
        """The outputs held (without their lead-ins), oldest first, by output id."""
        return {key: tokens[lead_in:] for key, (tokens, lead_in) in self._outputs.items()}

    def add(self, output: Sequence[int], output_id: int | None = None,
            lead_in: Sequence[int] = ()) -> None:
        """Inserts one finished output behind `lead_in` (the end of its prompt); output_id
        None: a local one (always new)."""
        if not self.enabled or not output:
            return
        if output_id is None:
            output_id = self._next_local_key
            self._next_local_key -= 1
        elif output_id in self._outputs:
            return  # replayed: held already
        tokens = [int(token) for token in (*lead_in, *output)]
        if len(tokens) > self.max_cached_tokens:
            return  # would evict everything and still not fit
        self.tree.insert(tokens)
        self._outputs[output_id] = (tokens, len(lead_in))
        self.num_tokens += len(tokens)
        while (len(self._outputs) > self.max_cached_requests
               or self.num_tokens > self.max_cached_tokens):
            _, (oldest, _) = self._outputs.popitem(last=False)
            self.tree.remove(oldest)
            self.num_tokens -= len(oldest)
        self.version += 1


@dataclass(slots=True)
class _SequenceState:
    history: TokenHistory
    prompt_len: int | None = None  # set by the first append
    local_matches: list[int] = field(default_factory=list)  # node ids
    global_matches: list[int] = field(default_factory=list)
    global_version: int = -1


@dataclass(frozen=True, slots=True)
class SuffixParams:
    max_tree_depth: int
    max_spec_factor: float
    min_token_prob: float
    num_speculative_tokens: int

    @property
    def lead_in(self) -> int:
        """Prompt tokens held in front of each output in the global trie: as many as a
        k-token draft needs as its match (k / max_spec_factor), at most the tree depth."""
        if self.max_spec_factor <= 0:
            return 0
        return min(self.max_tree_depth,
                   math.ceil(self.num_speculative_tokens / self.max_spec_factor - 1e-9))


@dataclass(slots=True)
class SuffixMethod:
    """One stream's sequences; `cache` is the server's, shared by all streams."""

    params: SuffixParams
    cache: GlobalSuffixCache
    info: ProposerInfo
    _trees: dict[int, SuffixTree] = field(default_factory=dict)
    _states: dict[int, _SequenceState] = field(default_factory=dict)
    # The stream's verifier sends finished outputs: its own finishes are not published.
    _verifier_shares: bool = False

    def context_len(self, seq_id: int) -> int | None:
        state = self._states.get(seq_id)
        return None if state is None else len(state.history)

    def add_sequence(self, seq_id: int) -> None:
        # A restart (resync) drops the old state without publishing it: the verifier resends
        # the whole context, which may differ from what was held.
        self._states[seq_id] = _SequenceState(TokenHistory())
        self._trees[seq_id] = SuffixTree(self.params.max_tree_depth)

    def append_tokens(self, seq_id: int, token_ids: Sequence[int],
                      hidden_states: torch.Tensor | None) -> None:
        state = self._states[seq_id]
        state.history.extend(token_ids)
        if state.prompt_len is None:
            state.prompt_len = len(state.history)
        state.local_matches = self._trees[seq_id].extend(state.local_matches, token_ids)
        if self.cache.enabled and state.global_version == self.cache.version:
            state.global_matches = self.cache.tree.follow(state.global_matches, token_ids)
        # Otherwise the global list is recomputed at the next propose.

    def rollback(self, seq_id: int, num_accepted_tokens: int) -> None:
        # Drafts never enter the history or the tries, so there is nothing to undo.
        pass

    def learn(self, output_id: int, prompt_token_ids: Sequence[int],
              output_token_ids: Sequence[int]) -> None:
        # Of the prompt only the lead-in (the verifier sends the last 64 tokens) is held.
        self._verifier_shares = True
        self.cache.add(output_token_ids, output_id, lead_in=self._lead_in(prompt_token_ids))

    def remove_sequence(self, seq_id: int) -> None:
        state = self._states.pop(seq_id, None)
        self._trees.pop(seq_id, None)
        if state is None or state.prompt_len is None or self._verifier_shares:
            return
        # A finished (or evicted) sequence's verified output becomes a draft source.
        history = state.history.view()
        self.cache.add(history[state.prompt_len:].tolist(),
                       lead_in=self._lead_in(history[:state.prompt_len].tolist()))

    def _lead_in(self, prompt_token_ids: Sequence[int]) -> Sequence[int]:
        count = self.params.lead_in
        return prompt_token_ids[-count:] if count else ()

    def propose(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> list[Proposal]:
        proposals = []
        for seq_id, count in zip(seq_ids, num_tokens):
            draft = self._propose_one(seq_id, count)
            proposals.append(Proposal(draft.token_ids, confidence=draft.confidence or None))
        return proposals

    def _propose_one(self, seq_id: int, num_tokens: int) -> Draft:
        params = self.params
        max_tokens = min(num_tokens, params.num_speculative_tokens)
        if max_tokens <= 0:
            return Draft([])
        state = self._states[seq_id]
        draft = self._trees[seq_id].speculate(state.local_matches, max_tokens,
                                              params.max_spec_factor, params.min_token_prob)
        cache = self.cache
        if cache.enabled and len(cache):
            if state.global_version != cache.version:
                state.global_matches = cache.tree.match(
                    state.history.view()[-params.max_tree_depth:].tolist())
                state.global_version = cache.version
            global_draft = cache.tree.speculate(state.global_matches, max_tokens,
                                                params.max_spec_factor, params.min_token_prob)
            if global_draft.score > draft.score:
                draft = global_draft
        return draft

    def close(self) -> None:
        # The stream broke: its running sequences did not finish, so nothing is published.
        self._states.clear()
        self._trees.clear()


def build_suffix_method(config: SpeculativeConfig,
                        options: ModelOptions | None = None) -> SuffixMethod:
    """The server's template: the factory makes each stream's method from its params,
    cache (shared) and info."""
    assert config.suffix_decoding_max_tree_depth is not None
    assert config.suffix_decoding_max_cached_requests is not None
    assert config.suffix_decoding_max_cached_tokens is not None
    assert config.suffix_decoding_max_spec_factor is not None
    assert config.suffix_decoding_min_token_prob is not None
    vocab_size, target_len = (0, 0) if options is None else target_limits(options.target_model)
    max_model_len = ((options.max_model_len if options is not None else None)
                     or target_len or DEFAULT_NGRAM_MAX_MODEL_LEN)
    params = SuffixParams(max_tree_depth=config.suffix_decoding_max_tree_depth,
                          max_spec_factor=config.suffix_decoding_max_spec_factor,
                          min_token_prob=config.suffix_decoding_min_token_prob,
                          num_speculative_tokens=config.num_speculative_tokens)
    cache = GlobalSuffixCache(params.max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_cached_tokens)
    logger.info("suffix decoding: tree depth %d, up to %d cached outputs and %d tokens, spec "
                "factor %g, min token prob %g", params.max_tree_depth,
                cache.max_cached_requests, cache.max_cached_tokens, params.max_spec_factor, params.min_token_prob)
    return SuffixMethod(params, cache, ProposerInfo(
        method="suffix", max_num_speculative_tokens=config.num_speculative_tokens,
        vocab_size=vocab_size, max_model_len=max_model_len,
        wants_finished_outputs=cache.enabled))
