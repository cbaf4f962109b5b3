"""`python -m specdec train`: turn the target into drafts for it.

Phases, each resumable and each reading the previous one's files in `--work-dir`:

    train data        the target answers the training instructions   -> distill.jsonl
    train features    target features and top-K labels, once          -> features.pt
    train eagle3      an EAGLE-3 head      -> runs/eagle3/      -> --output (a draft directory)
    train eagle       an EAGLE-1 head      -> runs/eagle/
    train draft_model a few-layer draft    -> runs/draft_model/
    train all         all of the above, exporting into specdec/drafts/ under the shipped names

A trainer stops at `--max-minutes` (summed over reruns of the same run directory) or
`--max-steps`, exports the draft in its published layout and writes its card.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from specdec.models.model_files import DEFAULT_MODEL, default_cache_dir, resolve_model

logger = logging.getLogger(__name__)

METHODS = ("eagle3", "eagle", "draft_model")
SHIPPED_NAMES = {"eagle3": "smollm2-135m-instruct-eagle3", "eagle": "smollm2-135m-instruct-eagle",
                 "draft_model": "smollm2-135m-instruct-draft"}
# Per-method defaults, the ones the shipped drafts were trained with.
DEFAULT_LR = {"eagle3": 1e-3, "eagle": 5e-4, "draft_model": 2e-4}


def add_train_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("phase", choices=("data", "features", *METHODS, "token-map", "all"))
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the target")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="data, features and run states (default: <cache>/train/<model>)")
    parser.add_argument("--output", type=Path, default=None,
                        help="where the trained draft goes (default: <work-dir>/drafts/<name>)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    data = parser.add_argument_group("data")
    data.add_argument("--num-prompts", type=int, default=1200)
    data.add_argument("--sampled-fraction", type=float, default=0.25,
                      help="share of prompts answered at --temperature (the rest greedily)")
    data.add_argument("--temperature", type=float, default=0.7)
    data.add_argument("--max-tokens", type=int, default=160)
    data.add_argument("--batch-size", type=int, default=96, help="sequences the engine runs at once")
    data.add_argument("--text-records", type=int, default=0,
                      help="features: also teacher-force this many passages of text installed "
                           "packages ship (cheaper than decoding; see data.text_records)")
    training = parser.add_argument_group("training")
    training.add_argument("--max-minutes", type=float, default=20.0,
                          help="time budget of each phase (data included)")
    training.add_argument("--max-steps", type=int, default=None)
    training.add_argument("--lr", type=float, default=None, help="peak learning rate (default per method)")
    training.add_argument("--batch-sequences", type=int, default=8)
    training.add_argument("--warmup-steps", type=int, default=10)
    training.add_argument("--max-len", type=int, default=320)
    training.add_argument("--ttt-steps", type=int, default=None, help="unroll steps (eagle3: 4, eagle: 3)")
    training.add_argument("--draft-vocab-size", type=int, default=8192,
                          help="eagle3's draft vocabulary, the other losses' vocabulary, and the "
                               "size of `train token-map`'s map")
    training.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _work_dir(args: argparse.Namespace) -> Path:
    if args.work_dir is not None:
        return Path(args.work_dir)
    return default_cache_dir() / "train" / Path(str(args.model)).name


def run_data(args: argparse.Namespace) -> None:
    from specdec.train.data import GenerateOptions, generate, read_records
    from specdec.train.prompts import training_prompts

    options = GenerateOptions(model=args.model, output=_work_dir(args) / "distill.jsonl",
                              num_prompts=args.num_prompts, sampled_fraction=args.sampled_fraction,
                              temperature=args.temperature, max_tokens=args.max_tokens,
                              batch_size=args.batch_size, max_minutes=args.max_minutes, seed=args.seed)
    written = generate(options, training_prompts(args.seed))
    logger.info("wrote %d answers to %s", written, options.output)
    # How the answers were made, for the cards (`features` copies it into features.json).
    (options.output.parent / "data.json").write_text(json.dumps({
        "num_prompts": options.num_prompts, "sampled_fraction": options.sampled_fraction,
        "temperature": options.temperature, "max_tokens": options.max_tokens,
        "batch_size": options.batch_size, "max_minutes": options.max_minutes,
        "num_answers": len(read_records(options.output))}, indent=2) + "\n")


def _load_target(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    from specdec.models.loader import load_model

    target_dir = resolve_model(args.model)
    target = load_model(target_dir, torch.float32, torch.device("cpu"))
    return target, json.loads((target_dir / "config.json").read_text())


def run_features(args: argparse.Namespace) -> None:
    from specdec.models.eagle3 import default_aux_layer_ids
    from specdec.train.data import read_records
    from specdec.train.features import extract_features

    work_dir = _work_dir(args)
    records = read_records(work_dir / "distill.jsonl")
    if not records:
        raise SystemExit(f"no data in {work_dir / 'distill.jsonl'}: run `train data` first")
    if args.text_records:
        from specdec.models.model_files import load_tokenizer
        from specdec.train.data import text_records

        records += text_records(load_tokenizer(resolve_model(args.model)), args.text_records, seed=args.seed)
    target, _ = _load_target(args)
    features = extract_features(target, records, default_aux_layer_ids(target.config.num_hidden_layers))
    (work_dir / "features.json").write_text(json.dumps({
        "num_sequences": len(records), "num_tokens": features.num_tokens,
        "num_greedy": sum(1 for r in records if r["temperature"] == 0),
        "num_sampled": sum(1 for r in records if r["temperature"]),
        "num_text": sum(1 for r in records if r["temperature"] is None),
        "sampled_temperature": max((r["temperature"] or 0.0 for r in records), default=0.0),
        **({"generation": json.loads((work_dir / "data.json").read_text())}
           if (work_dir / "data.json").is_file() else {})}, indent=2))
    features.save(work_dir / "features.pt")
    logger.info("features of %d conversations, %d tokens -> %s", features.num_sequences,
                features.num_tokens, work_dir / "features.pt")


def make_trainer(method: str, target: Any, target_raw: dict[str, Any], features: Any,
                 args: argparse.Namespace) -> Any:
    if method == "eagle3":
        from specdec.train.eagle3_trainer import Eagle3Trainer

        return Eagle3Trainer(target, target_raw, features, draft_vocab_size=args.draft_vocab_size,
                             ttt_steps=args.ttt_steps or 4, seed=args.seed)
    if method == "eagle":
        from specdec.train.eagle_trainer import EagleTrainer

        return EagleTrainer(target, target_raw, features, ttt_steps=args.ttt_steps or 3,
                            loss_vocab_size=args.draft_vocab_size, seed=args.seed)
    from specdec.train.draft_model_trainer import DraftModelTrainer

    return DraftModelTrainer(target, target_raw, features, loss_vocab_size=args.draft_vocab_size,
                             target_name=str(args.model), seed=args.seed)


def run_method(method: str, args: argparse.Namespace) -> Path:
    from specdec.train.card import write_card
    from specdec.train.features import FeatureSet
    from specdec.train.loop import TrainOptions, train

    work_dir = _work_dir(args)
    features = FeatureSet.load(work_dir / "features.pt")
    target, target_raw = _load_target(args)
    trainer = make_trainer(method, target, target_raw, features, args)
    del target
    options = TrainOptions(run_dir=work_dir / "runs" / method, max_minutes=args.max_minutes,
                           max_steps=args.max_steps, lr=args.lr or DEFAULT_LR[method],
                           batch_sequences=args.batch_sequences, max_len=args.max_len,
                           warmup_steps=args.warmup_steps, seed=args.seed)
    summary = train(trainer, features, options)
    output = args.output or work_dir / "drafts" / SHIPPED_NAMES[method]
    weight_bytes = trainer.export(output)
    training = {
        "method": method, "target": str(args.model),
        "data": json.loads((work_dir / "features.json").read_text()),
        "options": {key: (str(value) if isinstance(value, Path) else value)
                    for key, value in asdict(options).items() if key != "run_dir"}
                   | {"ttt_steps": getattr(trainer, "ttt_steps", 1),
                      "draft_vocab_size": args.draft_vocab_size},
        "validation_sequences": options.validation_sequences,
        "summary": asdict(summary), "weight_bytes": weight_bytes,
    }
    (Path(output) / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    write_card(output)
    logger.info("exported %s (%.1f MiB) to %s", method, weight_bytes / 2**20, output)
    return Path(output)


def run_token_map(args: argparse.Namespace) -> Path:
    """Writes the --draft-vocab-size target ids the target says most in the features (the
    ids eagle3's d2t takes) as a token map for eagle / draft_model (specdec/models/token_map.py)."""
    from specdec.train.features import FeatureSet, choose_draft_vocab, token_frequencies

    work_dir = _work_dir(args)
    features = FeatureSet.load(work_dir / "features.pt")
    vocab_size = json.loads((resolve_model(args.model) / "config.json").read_text())["vocab_size"]
    d2t, _ = choose_draft_vocab(token_frequencies(features, vocab_size), args.draft_vocab_size)
    ids = (torch.arange(d2t.shape[0]) + d2t).tolist()
    output = Path(args.output) if args.output else work_dir / "token-map.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(ids) + "\n")
    logger.info("token map of %d target ids (of %d) -> %s", len(ids), vocab_size, output)
    return output


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    if args.phase in ("data", "all"):
        run_data(args)
    if args.phase in ("features", "all") and (args.phase == "features"
                                              or not (_work_dir(args) / "features.pt").is_file()):
        run_features(args)
    if args.phase in METHODS:
        run_method(args.phase, args)
    if args.phase == "token-map":
        run_token_map(args)
    if args.phase == "all":
        from specdec.drafts import drafts_root

        for method in METHODS:
            args.output = drafts_root() / SHIPPED_NAMES[method]
            run_method(method, args)
    return 0
