"""The training loop every draft shares: AdamW, warmup + cosine, a time budget, checkpoints.

A `DraftTrainer` supplies the module (with only the draft's own weights trainable), the
loss on one `Batch`, and the export. The learning rate warms up linearly, then follows a
cosine to `min_lr_ratio` of its peak over the run, where the run's length is whichever of
`max_steps` and `max_minutes` comes first (so a time-budgeted run still anneals). The run
directory holds a resumable state (`checkpoint.py`); a rerun continues the same schedule.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from specdec.train.batches import Batch, make_batch
from specdec.train.checkpoint import load_state, save_state
from specdec.train.features import FeatureSet
from specdec.train.progress import Progress

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainOptions:
    run_dir: Path
    max_minutes: float = 20.0
    max_steps: int | None = None
    lr: float = 5e-4
    min_lr_ratio: float = 0.05
    warmup_steps: int = 30
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    batch_sequences: int = 8
    max_len: int = 320
    validation_sequences: int = 24
    checkpoint_every_s: float = 180.0
    seed: int = 0


@dataclass
class TrainSummary:
    """What a card reports about a run."""

    steps: int = 0
    minutes: float = 0.0
    epochs: float = 0.0
    train_sequences: int = 0
    train_tokens: int = 0
    final_loss: float = float("nan")
    metrics: dict[str, float] = field(default_factory=dict)  # last training batch
    validation: dict[str, float] = field(default_factory=dict)  # held-out sequences


class DraftTrainer(Protocol):
    module: nn.Module
    needs_features: bool

    def loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """The scalar loss to minimise and figures to show (per-step accuracies, losses)."""
        ...


def _lr_factor(step: int, fraction_done: float, options: TrainOptions) -> float:
    if step < options.warmup_steps:
        return (step + 1) / options.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, fraction_done)))
    return options.min_lr_ratio + (1 - options.min_lr_ratio) * cosine


def split_sequences(features: FeatureSet, options: TrainOptions) -> tuple[list[int], list[int]]:
    """(training, validation) sequence indices: a fixed seeded draw, the same on every rerun."""
    order = torch.randperm(features.num_sequences, generator=torch.Generator().manual_seed(options.seed))
    num_validation = min(options.validation_sequences, features.num_sequences // 5)
    return order[num_validation:].tolist(), order[:num_validation].tolist()


@torch.no_grad()
def evaluate(trainer: DraftTrainer, features: FeatureSet, indices: list[int],
             options: TrainOptions) -> dict[str, float]:
    """Mean figures over held-out sequences (weighted by batch)."""
    if not indices:
        return {}
    trainer.module.eval()
    totals: dict[str, float] = {}
    batches = [indices[i:i + options.batch_sequences] for i in range(0, len(indices), options.batch_sequences)]
    for chunk in batches:
        loss, metrics = trainer.loss(make_batch(features, chunk, options.max_len, trainer.needs_features))
        for key, value in {"loss": float(loss), **metrics}.items():
            totals[key] = totals.get(key, 0.0) + value / len(batches)
    trainer.module.train()
    return {key: round(value, 4) for key, value in totals.items()}


def _epoch_order(train_ids: list[int], lengths: list[int], batch_sequences: int,
                 generator: torch.Generator) -> list[int]:
    """One epoch's order of `train_ids`' indices: shuffled, then sorted by length within
    windows of 8 batches, so batches of similar lengths waste little on padding and their
    order stays random."""
    order = torch.randperm(len(train_ids), generator=generator).tolist()
    window = 8 * batch_sequences
    return [i for start in range(0, len(order), window)
            for i in sorted(order[start:start + window], key=lambda i: lengths[train_ids[i]])]


def _learning_rate(state: dict[str, Any], budget_s: float, options: TrainOptions) -> float:
    """The step's learning rate, scheduled over whichever budget (time or steps) runs out first."""
    fraction = state["seconds"] / budget_s
    if options.max_steps:
        fraction = max(fraction, state["step"] / options.max_steps)
    return options.lr * _lr_factor(state["step"], fraction, options)


def train(trainer: DraftTrainer, features: FeatureSet, options: TrainOptions) -> TrainSummary:
    """Trains until max_steps or max_minutes (counting earlier runs of the same run_dir)."""
    train_ids, validation_ids = split_sequences(features, options)
    params = [param for param in trainer.module.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=options.lr, betas=(0.9, 0.95),
                                  weight_decay=options.weight_decay)
    state = load_state(options.run_dir, trainer.module, optimizer) or {
        "step": 0, "seconds": 0.0, "epoch": 0, "cursor": 0, "final_loss": float("nan")}
    budget_s = 60 * options.max_minutes
    generator = torch.Generator().manual_seed(options.seed + 1)
    lengths = (features.seq_starts[1:] - features.seq_starts[:-1]).tolist()

    def epoch_order() -> list[int]:
        return _epoch_order(train_ids, lengths, options.batch_sequences, generator)

    # A resumed run draws the orders of the epochs before it, so its generator is where
    # the uninterrupted run's would be.
    order = [epoch_order() for _ in range(state["epoch"] + 1)][-1]
    progress = Progress(f"train {options.run_dir.name}", total=options.max_steps, unit="steps")
    summary = TrainSummary(train_sequences=len(train_ids),
                           train_tokens=sum(int(features.seq_starts[i + 1] - features.seq_starts[i])
                                            for i in train_ids))
    last_save = time.monotonic()
    trainer.module.train()
    metrics: dict[str, float] = {}
    while state["seconds"] < budget_s and (options.max_steps is None or state["step"] < options.max_steps):
        started = time.monotonic()
        if state["cursor"] >= len(order):
            state["epoch"] += 1
            state["cursor"] = 0
            order = epoch_order()
        chunk = [train_ids[i] for i in order[state["cursor"]:state["cursor"] + options.batch_sequences]]
        state["cursor"] += len(chunk)
        lr = _learning_rate(state, budget_s, options)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, metrics = trainer.loss(make_batch(features, chunk, options.max_len, trainer.needs_features))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, options.max_grad_norm)
        optimizer.step()
        state["step"] += 1
        state["seconds"] += time.monotonic() - started
        state["final_loss"] = float(loss.detach())
        progress.show(loss=state["final_loss"], lr=lr, **metrics)
        progress.update(1)
        if time.monotonic() - last_save > options.checkpoint_every_s:
            save_state(options.run_dir, trainer.module, optimizer, state)
            last_save = time.monotonic()
    progress.close()
    save_state(options.run_dir, trainer.module, optimizer, state)
    summary.steps, summary.minutes = state["step"], round(state["seconds"] / 60, 2)
    summary.epochs = round(state["epoch"] + state["cursor"] / max(1, len(order)), 2)
    summary.final_loss = round(state["final_loss"], 4)
    summary.metrics = {key: round(value, 4) for key, value in metrics.items()}
    summary.validation = evaluate(trainer, features, validation_ids, options)
    logger.info("trained %s: %d steps, %.1f min, %.2f epochs, loss %.4f, validation %s",
                options.run_dir, summary.steps, summary.minutes, summary.epochs, summary.final_loss,
                summary.validation)
    return summary
