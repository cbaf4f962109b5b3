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
lead-in match can already be k long. The lead-ins and the outputs' first tokens are held in
a trie of their own (`lead_in_tree`), drafted from only by a match that reaches back into
the prompt, and only while the path's probability stays at LEAD_IN_MIN_PROB or above; the
outputs' trie holds the outputs alone, so a prompt's text never counts as an answer's.
Only the lead-in of an output is held: a prompt is not otherwise a global source.

Each step drafts from the per-sequence trie, from the lead-in trie (pooled with the
per-sequence one, below), and from the outputs' trie pooled with a trie of the sequence's
own output so far, and keeps the proposal with the higher score (expected accepted tokens;
ties go to the per-sequence one). Pooled tries count as one (drafter_svc/suffix_tree.py's
`speculate_pooled`): the context's own last occurrence, which does not go on yet, weighs
against what earlier answers did next, as in the reference, whose global tree holds the
running answers too. The draft is greedy (no probs) and at most
min(num_speculative_tokens, max_spec_factor x match length) tokens long.

With `suffix_decoding_use_tree_spec` each source's winning match is expanded into a tree
draft instead (drafter_svc/suffix_tree_drafts.py): the most probable nodes below it, up to
the same token budget, branching where the text went on in more than one way; the scores
compared are the trees'. The verifier checks every branch in one forward.

`python -m specdec bench replay` (specdec/bench/replay.py) replays the built-in workloads'
greedy answers through this method and the reference's; docs/performance.md has the table.

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
from drafter_svc.suffix_tree import SCORE_TOLERANCE, Draft, SuffixTree, speculate_pooled
from drafter_svc.suffix_tree_drafts import pooled_tree_draft, tree_draft
from specdec.config import SpeculativeConfig
from specdec.engine.draft_tree import is_chain

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# The least path probability of a draft from a match that reaches back into the prompt
# (the lead-in; see SuffixMethod._propose_one). In an offline replay of the built-in
# workloads, 0.5 still wasted 10% more rows than the reference on `chat`; 0.9 gave up
# tokens on `extract` and `code-edit`.
LEAD_IN_MIN_PROB = 0.7


class GlobalSuffixCache:
    """The server-wide trie over finished outputs, FIFO-bounded by request and token count."""

    def __init__(self, max_depth: int, max_cached_requests: int,
                 max_cached_tokens: int = 1 << 62) -> None:
        self.tree = SuffixTree(max_depth)  # the outputs
        # Each output's lead-in and its first max_depth - 1 tokens: every substring that
        # starts in a lead-in (a match reaching back into the prompt, as an answer starts).
        self.lead_in_tree = SuffixTree(max_depth)
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.num_tokens = 0  # held, lead-ins and the lead-in trie's output heads included
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
        num_held = self._num_held(tokens, len(lead_in))
        if num_held > self.max_cached_tokens:
            return  # would evict everything and still not fit
        self._insert(tokens, len(lead_in))
        self._outputs[output_id] = (tokens, len(lead_in))
        self.num_tokens += num_held
        while (len(self._outputs) > self.max_cached_requests
               or self.num_tokens > self.max_cached_tokens):
            _, (oldest, oldest_lead_in) = self._outputs.popitem(last=False)
            self._remove(oldest, oldest_lead_in)
            self.num_tokens -= self._num_held(oldest, oldest_lead_in)
        self.version += 1

    def _num_held(self, tokens: list[int], lead_in_len: int) -> int:
        """Tokens an output holds: lead-in and output, and the output's head again in the
        lead-in trie."""
        if not lead_in_len:
            return len(tokens)
        return len(tokens) + min(len(tokens) - lead_in_len, self.tree.max_depth - 1)

    def _insert(self, tokens: list[int], lead_in_len: int) -> None:
        self.tree.insert(tokens[lead_in_len:])
        if lead_in_len:
            self.lead_in_tree.insert(tokens[:lead_in_len + self.tree.max_depth - 1])

    def _remove(self, tokens: list[int], lead_in_len: int) -> None:
        self.tree.remove(tokens[lead_in_len:])
        if lead_in_len:
            self.lead_in_tree.remove(tokens[:lead_in_len + self.tree.max_depth - 1])


@dataclass(slots=True)
class _SequenceState:
    history: TokenHistory
    prompt_len: int | None = None  # set by the first append
    local_matches: list[int] = field(default_factory=list)  # node ids
    global_matches: list[int] = field(default_factory=list)
    global_version: int = -1
    lead_in_matches: list[int] = field(default_factory=list)  # in the cache's lead_in_tree
    output_tree: SuffixTree | None = None  # the output so far, without the prompt
    output_matches: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SuffixParams:
    max_tree_depth: int
    max_spec_factor: float
    min_token_prob: float
    num_speculative_tokens: int
    use_tree_spec: bool = False

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
            state.output_tree = SuffixTree(self.params.max_tree_depth)
        else:
            assert state.output_tree is not None
            state.output_matches = state.output_tree.extend(state.output_matches, token_ids)
        state.local_matches = self._trees[seq_id].extend(state.local_matches, token_ids)
        if self.cache.enabled and state.global_version == self.cache.version:
            state.global_matches = self.cache.tree.follow(state.global_matches, token_ids)
            if self._output_len(state) < self.params.max_tree_depth:
                state.lead_in_matches = self.cache.lead_in_tree.follow(state.lead_in_matches,
                                                                       token_ids)
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
            tree = draft.parents is not None and not is_chain(draft.parents)
            proposals.append(Proposal(draft.token_ids, confidence=draft.confidence or None,
                                      parents=draft.parents if tree else None))
        return proposals

    def _propose_one(self, seq_id: int, num_tokens: int) -> Draft:
        params = self.params
        max_tokens = min(num_tokens, params.num_speculative_tokens)
        if max_tokens <= 0:
            return Draft([])
        state = self._states[seq_id]
        local_tree = self._trees[seq_id]
        draft = local_tree.speculate(state.local_matches, max_tokens,
                                     params.max_spec_factor, params.min_token_prob)
        if params.use_tree_spec and draft.token_ids:
            draft = tree_draft(local_tree, state.local_matches[draft.match_len - 1],
                               self._limit(draft.match_len, max_tokens), params.min_token_prob,
                               draft.match_len)
        cache = self.cache
        sources = []
        output_len = self._output_len(state)
        if cache.enabled and len(cache):
            if state.global_version != cache.version:
                context = state.history.view()[-params.max_tree_depth:].tolist()
                state.global_matches = cache.tree.match(context)
                state.lead_in_matches = (cache.lead_in_tree.match(context)
                                         if output_len < params.max_tree_depth else [])
                state.global_version = cache.version
            sources.append((cache.tree, state.global_matches))
            if output_len < params.max_tree_depth:
                # Only a match that reaches back into the prompt (one within the output is the
                # outputs tree's), pooled with the sequence's own context: where the prompt
                # itself shows what followed its end elsewhere, a few earlier answers that
                # went on alike do not make the draft sure. Its path's probability must stay
                # at LEAD_IN_MIN_PROB or above: a chat template's header, the same before
                # every answer, makes a long match that says little about how far the
                # answers behind it agree (at min_token_prob they wasted a third more rows
                # on `chat` for no more tokens).
                lead_in_sources = [(cache.lead_in_tree, state.lead_in_matches),
                                   (local_tree, state.local_matches)]
                lead_in_min_prob = max(params.min_token_prob, LEAD_IN_MIN_PROB)
                lead_in_draft = speculate_pooled(lead_in_sources, max_tokens,
                                                 params.max_spec_factor, lead_in_min_prob,
                                                 min_match_len=output_len + 1)
                if params.use_tree_spec and lead_in_draft.token_ids:
                    lead_in_draft = self._pooled_tree(lead_in_sources, lead_in_draft.match_len,
                                                      max_tokens, lead_in_min_prob)
                if lead_in_draft.score > draft.score + SCORE_TOLERANCE:
                    draft = lead_in_draft
        if state.output_tree is not None:
            sources.append((state.output_tree, state.output_matches))
        global_draft = speculate_pooled(sources, max_tokens, params.max_spec_factor,
                                        params.min_token_prob)
        if params.use_tree_spec and global_draft.token_ids:
            global_draft = self._pooled_tree(sources, global_draft.match_len, max_tokens,
                                             params.min_token_prob)
        return global_draft if global_draft.score > draft.score + SCORE_TOLERANCE else draft

    def _limit(self, match_len: int, max_tokens: int) -> int:
        """The most tokens a draft from a match of `match_len` may hold."""
        return min(max_tokens, int(match_len * self.params.max_spec_factor + 1e-6))

    def _pooled_tree(self, sources: list[tuple[SuffixTree, list[int]]], match_len: int,
                     max_tokens: int, min_token_prob: float) -> Draft:
        """The tree draft below the pooled nodes of the sources' matches of `match_len`
        (the match length their flat draft won with)."""
        pool = [(tree, matches[match_len - 1]) for tree, matches in sources
                if len(matches) >= match_len]
        return pooled_tree_draft(pool, self._limit(match_len, max_tokens), min_token_prob,
                                 match_len)

    @staticmethod
    def _output_len(state: _SequenceState) -> int:
        return 0 if state.prompt_len is None else len(state.history) - state.prompt_len

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
                          num_speculative_tokens=config.num_speculative_tokens,
                          use_tree_spec=bool(config.suffix_decoding_use_tree_spec))
    cache = GlobalSuffixCache(params.max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_cached_tokens)
    logger.info("suffix decoding: tree depth %d, up to %d cached outputs and %d tokens, spec "
                "factor %g, min token prob %g, %s drafts", params.max_tree_depth,
                cache.max_cached_requests, cache.max_cached_tokens, params.max_spec_factor,
                params.min_token_prob, "tree" if params.use_tree_spec else "flat")
    return SuffixMethod(params, cache, ProposerInfo(
        method="suffix", max_num_speculative_tokens=config.num_speculative_tokens,
        vocab_size=vocab_size, max_model_len=max_model_len,
        wants_finished_outputs=cache.enabled))
