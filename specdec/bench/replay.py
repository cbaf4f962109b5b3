"""`python -m specdec bench replay`: suffix drafts replayed offline against known answers.

A stream is a list of requests, each its prompt ids and the target's greedy answer ids
(collected from a server with speculation off, or generated here from a built-in workload:
specdec/bench/replay_workloads.py). The requests are replayed one after another through each
proposer (specdec/bench/replay_proposers.py), which learns from the earlier answers as a
served one does, and every draft is verified greedily against the answer: a draft's
accepted tokens are its longest prefix that the answer continues with, and the step yields
them plus the target's own token. Deterministic and model-free, so proposers compare on
exactly the same text, which a served benchmark cannot do.

Counted per proposer, as the verifier would count them:
- steps: target forwards, the prefill's (which yields the answer's first token, undrafted)
  included, so tokens per step = answer tokens / steps (1.0: no draft ever accepted);
- drafted rows: draft tokens verified; wasted rows: those rejected (a verified row costs
  about as much as an accepted one on a CPU, so wasted rows are lost time);
- a tree draft (`--tree`) counts all its nodes as drafted rows and its longest root path
  that the answer continues with as accepted;
- a draft never runs past the answer: at most min(k, tokens left - 1) long, as the verifier
  caps a draft by the tokens a request may still produce;
- ms per step: the proposer's time to learn a step's tokens and draft the next.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specdec.bench.replay_proposers import (
    ReferenceSuffix,
    ReplayDraft,
    ReplayProposer,
    SpecdecSuffix,
    SuffixSettings,
    reference_available,
)
from specdec.bench.replay_stream import StreamRequest, load_stream
from specdec.cli import DefaultsHelpFormatter, add_logging_args, setup_logging
from specdec.engine.tree_sampler import walk_tree

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ReplayCounts:
    """One proposer's figures over a stream."""

    num_requests: int = 0
    num_tokens: int = 0
    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    proposer_seconds: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.num_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def num_wasted(self) -> int:
        return self.num_drafted - self.num_accepted

    def summary(self) -> dict[str, float | int]:
        return {"requests": self.num_requests, "tokens": self.num_tokens,
                "steps": self.num_steps, "tokens_per_step": round(self.tokens_per_step, 4),
                "drafted_rows": self.num_drafted, "wasted_rows": self.num_wasted,
                "ms_per_step": round(1000 * self.proposer_seconds / max(1, self.num_steps), 4)}


def num_accepted(draft_ids: Sequence[int], answer_ids: Sequence[int], position: int) -> int:
    """How many of the draft's tokens the answer continues with from `position` (greedy)."""
    count = 0
    for token, expected in zip(draft_ids, answer_ids[position:]):
        if token != expected:
            break
        count += 1
    return count


def num_accepted_tree(draft_ids: list[int], parents: list[int], answer_ids: Sequence[int],
                      position: int) -> int:
    """A tree draft's accepted tokens: its longest root path the answer continues with."""
    return len(walk_tree(draft_ids, parents,
                         lambda row, emitted: answer_ids[position + len(emitted)]).path)


def replay(stream: Sequence[StreamRequest], proposer: ReplayProposer,
           num_speculative_tokens: int) -> ReplayCounts:
    counts = ReplayCounts()
    clock = time.perf_counter
    for request_id, request in enumerate(stream):
        answer_ids = request.answer_ids
        if not answer_ids:
            continue
        counts.num_requests += 1
        counts.num_tokens += len(answer_ids)
        started = clock()
        proposer.start(request_id, request.prompt_ids)
        proposer.extend(answer_ids[:1])  # the prefill's token
        position = 1
        counts.num_steps += 1
        while position < len(answer_ids):
            max_tokens = min(num_speculative_tokens, len(answer_ids) - position - 1)
            draft = proposer.propose(max_tokens) if max_tokens > 0 else ReplayDraft([])
            draft_ids = draft.token_ids[:max_tokens]
            if draft.parents is None:
                accepted = num_accepted(draft_ids, answer_ids, position)
            else:
                accepted = num_accepted_tree(draft_ids, draft.parents[:max_tokens], answer_ids,
                                             position)
            counts.num_drafted += len(draft_ids)
            counts.num_accepted += accepted
            counts.num_steps += 1
            appended = answer_ids[position:position + accepted + 1]
            proposer.extend(appended)
            position += len(appended)
        proposer.finish()
        counts.proposer_seconds += clock() - started
    return counts


ProposerFactory = Callable[[SuffixSettings], ReplayProposer]


def proposer_factories(with_reference: bool, with_trees: bool = False) -> dict[str, ProposerFactory]:
    factories: dict[str, ProposerFactory] = {"specdec": SpecdecSuffix}
    if with_trees:
        factories["spec-tree"] = lambda settings: SpecdecSuffix(replace(settings, use_tree_spec=True))
    if with_reference:
        factories["reference"] = ReferenceSuffix
        if with_trees:
            factories["ref-tree"] = lambda settings: ReferenceSuffix(replace(settings, use_tree_spec=True))
    return factories


def compare(streams: dict[str, list[StreamRequest]], ks: Sequence[int],
            factories: dict[str, ProposerFactory],
            settings: Callable[[int], SuffixSettings] = SuffixSettings) -> list[dict[str, object]]:
    """One row per stream, k and proposer: its summary figures."""
    rows: list[dict[str, object]] = []
    for stream_name, stream in streams.items():
        for k in ks:
            for proposer_name, factory in factories.items():
                counts = replay(stream, factory(settings(k)), k)
                rows.append({"stream": stream_name, "k": k, "proposer": proposer_name,
                             **counts.summary()})
    return rows


def format_rows(rows: list[dict[str, object]]) -> str:
    header = (f"{'stream':<22} {'k':>3} {'proposer':<10} {'tok/step':>8} {'steps':>6} "
              f"{'drafted':>8} {'wasted':>7} {'ms/step':>8}")
    lines = [header]
    for row in rows:
        lines.append(f"{row['stream']:<22} {row['k']:>3} {row['proposer']:<10} "
                     f"{row['tokens_per_step']:>8.3f} {row['steps']:>6} {row['drafted_rows']:>8} "
                     f"{row['wasted_rows']:>7} {row['ms_per_step']:>8.3f}")
    return "\n".join(lines)


def add_replay_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stream", action="append", default=None, metavar="FILE",
                        help="a JSONL stream of {\"prompt_ids\", \"answer_ids\"} lines "
                             "(repeatable)")
    parser.add_argument("--workload", action="append", default=None, metavar="NAME",
                        help="a built-in workload (agent, code-edit, rag, extract, multi-turn, "
                             "chat) or 'all': its prompts with the target's greedy answers, "
                             "generated (--model) or read from --stream-dir")
    parser.add_argument("--stream-dir", default=None,
                        help="with --workload: read NAME.jsonl here when present, else "
                             "generate it and write it here")
    parser.add_argument("--synthetic", action="store_true",
                        help="also replay the synthetic streams (specdec/bench/replay_synthetic.py)")
    parser.add_argument("--num-speculative-tokens", default="8,24",
                        help="comma-separated k values")
    parser.add_argument("--tree", action="store_true",
                        help="also replay each proposer with tree drafts "
                             "(suffix_decoding_use_tree_spec): a draft's accepted tokens are "
                             "its longest root path the answer continues with, its rows all its "
                             "nodes")
    parser.add_argument("--no-reference", action="store_true",
                        help="replay specdec's proposer only, even where arctic-inference imports")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--save-reference", default=None, metavar="FILE",
                        help="write the reference's rows here (what tests compare specdec's "
                             "proposer with where arctic-inference is not installed)")
    parser.add_argument("--model", default=None,
                        help="the target that answers --workload prompts (default: the default "
                             "model)")
    parser.add_argument("--max-num-seqs", type=int, default=8,
                        help="requests generated at once with --workload")
    add_logging_args(parser)


def _streams(args: argparse.Namespace) -> dict[str, list[StreamRequest]]:
    streams = {Path(path).stem: load_stream(Path(path)) for path in args.stream or ()}
    if args.workload:
        from specdec.bench import replay_workloads
        names = replay_workloads.workload_names(args.workload)
        stream_dir = Path(args.stream_dir) if args.stream_dir else None
        streams.update(replay_workloads.workload_streams(names, stream_dir, args.model,
                                                      args.max_num_seqs))
    if args.synthetic:
        from specdec.bench.replay_synthetic import synthetic_streams
        streams.update(synthetic_streams())
    return streams


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec bench replay",
                                     formatter_class=DefaultsHelpFormatter,
                                     description=__doc__.split("\n\n")[0])
    add_replay_args(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level, "specdec")
    try:
        ks = [int(value) for value in args.num_speculative_tokens.split(",")]
        streams = _streams(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not streams:
        parser.error("give --stream, --workload or --synthetic")
    with_reference = not args.no_reference and reference_available()
    if not args.no_reference and not with_reference:
        logger.info("arctic-inference does not import: replaying specdec's proposer alone")
    rows = compare(streams, ks, proposer_factories(with_reference, args.tree))
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", "utf-8")
    if args.save_reference:
        if not with_reference:
            parser.error("--save-reference: arctic-inference does not import")
        reference_rows = [row for row in rows if row["proposer"] == "reference"]
        Path(args.save_reference).write_text(json.dumps(
            {"made_by": "python -m specdec bench replay " + " ".join(argv),
             "settings": asdict(SuffixSettings(0)) | {"num_speculative_tokens": ks},
             "rows": reference_rows}, indent=1) + "\n", "utf-8")
    return 0
