"""The card (README.md) next to a shipped draft: how it was trained, what it reaches.

Training figures come from `training.json` (written at export), benchmark figures from
`bench.json` (written by `python -m specdec bench --write-cards`); the card is rendered
from both whenever either changes, so it never disagrees with them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_METHOD_TEXT = {
    "eagle3": ("EAGLE-3 head (Li et al. 2025, arXiv:2503.01840) in the published layout: fc over the "
               "target's low / mid / high features, one decoder layer, a reduced draft vocabulary "
               "(d2t / t2d). Trained with training-time test (unrolled on its own outputs, loss "
               "weighted by step). The target's embedding is borrowed and not stored."),
    "eagle": ("EAGLE-1 head (Li et al. 2024, arXiv:2401.15077) in the published layout: fc over "
              "(embedding, final feature), one decoder layer whose output goes into the target's "
              "lm_head. Feature regression plus token loss, the target's embedding and lm_head "
              "frozen and not stored; unrolled on its own outputs while training."),
    "draft_model": ("A small Llama model for the target's tokenizer: some of the target's own layers "
                    "plus its final norm, distilled on the target's outputs. The embedding / lm_head "
                    "(tied) and the tokenizer are the target's, read from it at load time."),
}


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _data_flags(generation: dict[str, Any] | None) -> str:
    """The `train data` flags of the run (`data.json`); the first shipped drafts' otherwise."""
    generation = generation or {"num_prompts": 1200, "batch_size": 64, "max_tokens": 128, "max_minutes": 6}
    return " ".join(f"--{key.replace('_', '-')} {generation[key]}"
                    for key in ("num_prompts", "batch_size", "max_tokens", "max_minutes") if key in generation)


def render_card(draft_dir: Path) -> str:
    draft_dir = Path(draft_dir)
    training = _read(draft_dir / "training.json") or {}
    method = training.get("method", "?")
    name = draft_dir.name
    lines = [f"# {name}", "",
             f"A draft of method `{method}` for `{training.get('target', 'smollm2-135m-instruct')}` "
             "(SmolLM2-135M-Instruct), trained and shipped by specdec.", "",
             _METHOD_TEXT.get(method, ""), "", "```bash",
             "python -m specdec serve --speculative-config \\",
             f"  '{{\"method\": \"{method}\", \"model\": \"{name}\", \"num_speculative_tokens\": 4}}'",
             "```", "", "## Training", ""]
    lines += _training_lines(training, name, method)
    lines += _acceptance_lines(_read(draft_dir / "bench.json"))
    return "\n".join(lines) + "\n"


def _training_lines(training: dict[str, Any], name: str, method: str) -> list[str]:
    """The card's training section: the data, the run, its losses and how to reproduce it."""
    data = training.get("data", {})
    summary = training.get("summary", {})
    return [
        f"- Data: {data.get('num_sequences', '?')} conversations, {data.get('num_tokens', '?')} tokens. "
        f"Self-distillation: {data.get('num_greedy', 0)} answers the target itself wrote through "
        f"specdec's engine at temperature 0 and {data.get('num_sampled', 0)} at temperature "
        f"{data.get('sampled_temperature', '?')}, for instructions generated from templates "
        "(`specdec/train/prompts.py`, disjoint from the benchmark's held-out prompts); plus "
        f"{data.get('num_text', 0)} teacher-forced passages of text installed packages ship "
        "(`data.text_records`). Every label is the target's own: its top-8 next tokens at each "
        "position, from one fp32 forward.",
        f"- Run: {summary.get('steps', '?')} steps, {summary.get('minutes', '?')} minutes on the "
        f"CPU, {summary.get('epochs', '?')} epochs over {summary.get('train_sequences', '?')} "
        f"training conversations; options {json.dumps(training.get('options', {}))}.",
        f"- Final training loss {summary.get('final_loss', '?')}; last batch {summary.get('metrics', {})}.",
        f"- Held-out conversations ({training.get('validation_sequences', '?')}): "
        f"{summary.get('validation', {})} (`accN`: share of positions where unroll step N's "
        "argmax is the target's top-1).",
        f"- Weights: {training.get('weight_bytes', 0) / 2**20:.1f} MiB, bfloat16.",
        *([f"- {training['notes']}"] if training.get("notes") else []),
        "", "Reproduce (each phase resumes; `--max-minutes` is each phase's budget):", "", "```bash",
        "python -m specdec train data --work-dir W " + _data_flags(data.get("generation")),
        f"python -m specdec train features --work-dir W --text-records {data.get('num_text', 0)}",
        f"python -m specdec train {method} --work-dir W --max-minutes "
        f"{training.get('options', {}).get('max_minutes', '?')} --lr {training.get('options', {}).get('lr', '?')} "
        f"--threads 1 --output specdec/drafts/{name}",
        "```", ""]


def _acceptance_lines(bench: dict[str, Any] | None) -> list[str]:
    """The card's acceptance section: the shipped bench's rows, or how to measure them."""
    lines = ["## Acceptance", ""]
    if bench is None:
        lines.append("Not measured yet: `python -m specdec bench --drafts shipped --write-cards`.")
    else:
        lines += [f"`python -m specdec bench` on {bench.get('num_prompts', '?')} held-out chat prompts, "
                  f"{bench.get('max_tokens', '?')} tokens each, k = {bench.get('k', '?')} as a chain, "
                  f"{bench.get('dtype', 'float32')} on {bench.get('device', 'cpu')}; speedup is against "
                  "plain decoding measured in the same run.", "",
                  "| temperature | acceptance rate | mean acceptance length | per-position acceptance "
                  "| tokens/s | plain tokens/s | speedup | output identical to plain |",
                  "|---|---|---|---|---|---|---|---|"]
        mapped = []
        for row in bench.get("rows", []):
            identical = {True: "yes", False: "no"}.get(row.get("identical_output"), "?")
            if float(row["temperature"]) > 0:
                identical = "n/a (sampled: same distribution, other draws)"
            temperature = row["temperature"]
            if row.get("token_map"):  # the LM head cut to a token map (specdec/models/token_map.py)
                temperature = f"{temperature}, token map"
                mapped.append(str(row["token_map"]))
            lines.append(f"| {temperature} | {row['acceptance_rate']} | {row['mean_acceptance_length']} "
                         f"| {row['per_position_acceptance']} | {row['spec_tokens_per_s']} "
                         f"| {row['plain_tokens_per_s']} | {row['speedup']}x | {identical} |")
        for token_map in dict.fromkeys(mapped):
            lines += ["", f"\"token map\" rows: `\"speculative_token_map\": \"{token_map}\"` in "
                      "`--speculative-config`, the draft's LM head cut to those target tokens, measured "
                      "in the same run."]
        if bench.get("note"):
            lines += ["", bench["note"]]
    return lines


def write_card(draft_dir: Path) -> None:
    (Path(draft_dir) / "README.md").write_text(render_card(draft_dir))
