"""`bench compare`'s figures: per prompt and system, tokens/s, ratios and the identity check.

tokens/s is the median over the timed runs of output tokens / wall seconds (prefill
included). A ratio to a baseline is the median over the repeats of the two systems'
tokens/s in the same repeat (runs a few seconds apart), not the ratio of the medians: this
machine's speed drifts by up to 1.5x within a minute, and two medians taken over different
runs can land in different phases (ngram on open, six repeats, four runs: 0.94-1.00x by
medians). Outputs are compared with specdec plain's first run: by token ids where both
sides have them, else by text with the whitespace at the ends ignored.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from specdec.bench.compare_systems import Generation, Unavailable


def _tokens_per_s(runs: list[Generation]) -> float:
    return statistics.median(g.num_output_tokens / g.seconds for g in runs)


def _ratio(runs: list[Generation], baseline: list[Generation]) -> float:
    """The median over the repeats of the runs' tokens/s over the baseline's in the same
    repeat; the ratio of the medians where the two did not run the same repeats."""
    if len(runs) != len(baseline):
        return _tokens_per_s(runs) / _tokens_per_s(baseline)
    return statistics.median((run.num_output_tokens / run.seconds) / (base.num_output_tokens / base.seconds)
                             for run, base in zip(runs, baseline))


def same_output(run: Generation, reference: Generation) -> tuple[bool, int | None]:
    """(identical, first differing token index) — by token ids where both have them."""
    if run.token_ids is not None and reference.token_ids is not None:
        pairs = zip(run.token_ids, reference.token_ids)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        if first is None and len(run.token_ids) != len(reference.token_ids):
            first = min(len(run.token_ids), len(reference.token_ids))
        return first is None, first
    return run.text.strip() == reference.text.strip(), None


def summarise(results: dict[str, dict[str, list[Generation]]],
              kinds: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    for prompt, by_system in results.items():
        reference = by_system.get("specdec")
        baselines = {name: by_system[name] for name in ("specdec", "transformers") if name in by_system}
        for name, runs in by_system.items():
            tokens_per_s = _tokens_per_s(runs)
            ratios = {f"vs_{base}": round(_ratio(runs, baseline_runs), 3)
                      for base, baseline_runs in baselines.items()}
            identical, first = None, None
            if reference is not None:
                checks = [same_output(run, reference[0]) for run in runs]
                identical = all(same for same, _ in checks)
                first = next((index for same, index in checks if not same), None)
            spec_runs = [run.spec for run in runs if run.spec is not None]
            drafts = sum(spec.num_drafts for spec in spec_runs)
            accepted = sum(spec.num_accepted_tokens for spec in spec_runs)
            rows.append({
                "prompt": prompt, "system": name, "kind": kinds[name],
                "output_tokens": runs[-1].num_output_tokens,
                "tokens_per_s": round(tokens_per_s, 2),
                "vs_specdec": ratios.get("vs_specdec"),
                "vs_transformers": ratios.get("vs_transformers"),
                "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
                "identical_to_specdec": identical,
                "first_difference": first,
                "compared_by": "token ids" if runs[-1].token_ids is not None else "text",
                "output_text": runs[-1].text,
            })
    return rows


def format_table(rows: list[dict[str, Any]], unavailable: list[Unavailable],
                 prompts: Sequence[str]) -> str:
    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    def identical(row: dict[str, Any]) -> str:
        if row["identical_to_specdec"] is None:
            return "-"
        if row["identical_to_specdec"]:
            return "yes" if row["system"] != "specdec" else "yes (reference)"
        where = f", first at token {row['first_difference']}" if row["first_difference"] is not None else ""
        return f"no{where} ({row['compared_by']})"

    width = max([len(r["system"]) for r in rows] + [len(u.name) for u in unavailable] + [6])
    lines = [f"{'prompt':8} {'system':{width}} {'tokens':>6} {'tok/s':>8} {'vs specdec':>10} "
             f"{'vs transformers':>15} {'accept len':>10}  identical to specdec"]
    for prompt in prompts:
        for row in (r for r in rows if r["prompt"] == prompt):
            accept = row["mean_acceptance_length"]
            lines.append(f"{prompt:8} {row['system']:{width}} {row['output_tokens']:>6} "
                         f"{row['tokens_per_s']:>8.2f} {ratio(row['vs_specdec']):>10} "
                         f"{ratio(row['vs_transformers']):>15} "
                         f"{'-' if accept is None else f'{accept:.2f}':>10}  {identical(row)}")
        for missing in unavailable:
            lines.append(f"{prompt:8} {missing.name:{width}} {'-':>6} {'-':>8} {'-':>10} "
                         f"{'-':>15} {'-':>10}  skipped: {missing.reason}")
    return "\n".join(lines)
