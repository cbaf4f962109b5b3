"""`specdec train` on a tiny random target: data through the engine, features, each trainer.

Each trainer runs a few steps and exports a checkpoint; the checkpoint must load through
the same loader a third-party draft goes through and draft through the real drafter and
verifier, with greedy output unchanged. Also: the reduced vocabulary maps back to the right
target ids, training lowers the loss, a rerun resumes, and the training prompts never
overlap the prompts used for measuring.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.models.eagle import load_target_parts
from specdec.models.eagle3 import default_aux_layer_ids, load_eagle3_head
from specdec.models.loader import load_model
from specdec.train.batches import make_batch
from specdec.train.data import GenerateOptions, generate, read_records
from specdec.train.draft_model_trainer import DraftModelTrainer
from specdec.train.eagle3_trainer import Eagle3Trainer
from specdec.train.eagle_trainer import EagleTrainer
from specdec.train.features import FeatureSet, choose_draft_vocab, extract_features
from specdec.train.loop import TrainOptions, train
from specdec.bench.serve_requests import load_requests
from specdec.train.prompts import heldout_prompts, training_prompts
from tests.support.model_drafting import NUM_LAYERS, K, serve_and_generate
from tests.support.tiny_models import make_tiny_llama

DRAFT_VOCAB = 40


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Tied embedding / lm_head, as the default model: draft_model training borrows it.
    return make_tiny_llama(tmp_path_factory.mktemp("target"), num_layers=NUM_LAYERS, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def plain(target: Path, device) -> list[list[int]]:
    import asyncio

    outputs, _ = asyncio.run(serve_and_generate(target, str(device), None))
    return outputs


@pytest.fixture(scope="module")
def features(target: Path, tmp_path_factory: pytest.TempPathFactory) -> FeatureSet:
    """Self-distilled conversations answered by the tiny target through the engine."""
    data = tmp_path_factory.mktemp("data") / "distill.jsonl"
    prompts = [" ".join(f"w{(7 * i + j) % 90 + 3}" for j in range(4 + i % 5)) for i in range(16)]
    options = GenerateOptions(model=str(target), output=data, num_prompts=16, max_tokens=24,
                              batch_size=8, dtype="float32", sampled_fraction=0.25)
    assert generate(options, prompts) == 16
    assert generate(options, prompts) == 0  # resumable: nothing left to answer
    records = read_records(data)
    assert sum(1 for r in records if r["temperature"] > 0) == 4
    model = load_model(target, torch.float32, torch.device("cpu"))
    return extract_features(model, records, default_aux_layer_ids(NUM_LAYERS), top_k=4)


def _trainer(method: str, target: Path, features: FeatureSet):
    model = load_model(target, torch.float32, torch.device("cpu"))
    raw = json.loads((target / "config.json").read_text())
    if method == "eagle3":
        return Eagle3Trainer(model, raw, features, draft_vocab_size=DRAFT_VOCAB, ttt_steps=3)
    if method == "eagle":
        return EagleTrainer(model, raw, features, ttt_steps=2, loss_vocab_size=DRAFT_VOCAB)
    return DraftModelTrainer(model, raw, features, loss_vocab_size=DRAFT_VOCAB)


def _options(run_dir: Path, max_steps: int, lr: float = 3e-3) -> TrainOptions:
    return TrainOptions(run_dir=run_dir, max_steps=max_steps, lr=lr, warmup_steps=1,
                        batch_sequences=4, validation_sequences=2, max_minutes=5)


def test_features_line_up_with_the_target(target: Path, features: FeatureSet) -> None:
    model = load_model(target, torch.float32, torch.device("cpu"))
    assert features.aux.shape == (features.num_tokens, 3 * model.config.hidden_size)
    # The stored top-1 of a position is the target's greedy next token: answers at
    # temperature 0 are exactly those tokens.
    start, end = int(features.seq_starts[0]), int(features.seq_starts[1])
    prompt_len = int(features.prompt_lens[0])
    assert torch.equal(features.topk_ids[start + prompt_len - 1:end - 1, 0],
                       features.token_ids[start + prompt_len:end])


@pytest.mark.parametrize("method", ["eagle3", "eagle", "draft_model"])
async def test_a_trained_checkpoint_loads_and_drafts(method, target, features, plain, device,
                                                     tmp_path) -> None:
    trainer = _trainer(method, target, features)
    summary = train(trainer, features, _options(tmp_path / "run", max_steps=3))
    assert summary.steps == 3 and summary.validation
    output = tmp_path / "draft"
    trainer.export(output)
    names = set(json.loads((output / "config.json").read_text()))
    assert "vocab_size" in names
    from safetensors import safe_open

    with safe_open(str(output / "model.safetensors"), framework="pt") as reader:
        keys = set(reader.keys())
        assert all(reader.get_tensor(k).dtype in (torch.bfloat16, torch.int64, torch.bool) for k in keys)
    assert not any("embed_tokens" in key for key in keys)  # borrowed from the target
    spec = {"method": method, "model": str(output), "num_speculative_tokens": K}
    outputs, engine = await serve_and_generate(target, str(device), spec)
    assert outputs == plain
    assert engine.spec.num_draft_tokens > 0


def test_reduced_vocabulary_maps_back_to_target_ids(target, features, tmp_path) -> None:
    counts = torch.zeros(96, dtype=torch.int64)
    counts[[5, 90, 17, 3]] = torch.tensor([10, 9, 8, 1])
    d2t, t2d = choose_draft_vocab(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [5, 17, 90]  # the three most frequent, sorted
    assert t2d.nonzero().flatten().tolist() == [5, 17, 90]

    trainer = _trainer("eagle3", target, features)
    trainer.export(tmp_path / "head")
    parts = load_target_parts(target, torch.float32, torch.device("cpu"))
    head, _ = load_eagle3_head(tmp_path / "head", parts, torch.float32, torch.device("cpu"), 128)
    target_ids = head.to_target_ids(torch.arange(DRAFT_VOCAB))
    assert torch.equal(target_ids, trainer.vocab.vocab_ids)
    assert torch.equal(head.t2d.nonzero().flatten(), target_ids)
    # lm_head row i of the draft vocabulary starts as the target's row of target id d2t-mapped i.
    model = load_model(target, torch.float32, torch.device("cpu"))
    assert torch.allclose(head.lm_head.weight.float(), model.lm_head.weight[target_ids].bfloat16().float())
    # The most frequent answer tokens are in the draft vocabulary.
    answer_top1 = features.topk_ids[:, 0]
    most_common = torch.bincount(answer_top1, minlength=96).argmax()
    assert bool(head.t2d[most_common])


def test_the_token_map_phase_writes_eagle3s_draft_vocabulary(target, features, tmp_path) -> None:
    """`train token-map` writes the ids an eagle3 head of the same size would draft among,
    as a map specdec's loader reads (specdec/models/token_map.py)."""
    import argparse

    from specdec.models.token_map import load_token_map
    from specdec.train.cli import run_token_map

    features.save(tmp_path / "features.pt")
    args = argparse.Namespace(model=str(target), work_dir=tmp_path, output=None, draft_vocab_size=DRAFT_VOCAB)
    path = run_token_map(args)
    assert path == tmp_path / "token-map.json"
    trainer = _trainer("eagle3", target, features)
    assert torch.equal(load_token_map(str(path), 96), trainer.vocab.vocab_ids)


@pytest.mark.parametrize("method", ["eagle3", "eagle", "draft_model"])
def test_training_lowers_the_loss(method, target, features, tmp_path) -> None:
    trainer = _trainer(method, target, features)
    batch = make_batch(features, list(range(features.num_sequences)), 320, trainer.needs_features)
    with torch.no_grad():
        before = float(trainer.loss(batch)[0])
    train(trainer, features, _options(tmp_path / "run", max_steps=12, lr=5e-3))
    with torch.no_grad():
        after = float(trainer.loss(batch)[0])
    assert after < 0.95 * before


def test_a_rerun_resumes_where_the_last_stopped(target, features, tmp_path) -> None:
    run_dir = tmp_path / "run"
    first = train(_trainer("eagle3", target, features), features, _options(run_dir, max_steps=2))
    assert first.steps == 2 and (run_dir / "train_state.pt").is_file()
    trainer = _trainer("eagle3", target, features)
    second = train(trainer, features, _options(run_dir, max_steps=5))
    assert second.steps == 5  # three more steps, not five
    saved = torch.load(run_dir / "train_state.pt", weights_only=False)
    assert torch.equal(saved["module"]["fc.weight"], trainer.module.fc.weight)


def test_training_prompts_are_disjoint_from_the_measuring_prompts() -> None:
    training = training_prompts()
    assert len(training) > 1000 and len(set(training)) == len(training)
    # What `bench serve` sends by default, read by its own loader.
    builtin = [request.messages[-1]["content"] for request in load_requests("builtin", None)
               if request.messages]
    measuring = heldout_prompts() + builtin
    assert len(heldout_prompts()) >= 16
    lowered = [prompt.lower() for prompt in training]
    for prompt in measuring:
        key = prompt.lower()
        assert not any(key in text or text in key for text in lowered), prompt


def test_the_card_gives_the_runs_own_data_command(tmp_path: Path) -> None:
    """`train data` records its flags (data.json -> features.json -> training.json); the card's
    reproduce block shows them, and the first shipped drafts' flags where none were recorded."""
    from specdec.train.card import render_card

    generation = {"num_prompts": 4904, "sampled_fraction": 0.25, "temperature": 0.7, "max_tokens": 256,
                  "batch_size": 96, "max_minutes": 40, "num_answers": 2649}
    training = {"method": "eagle3", "data": {"num_sequences": 2749, "generation": generation},
                "options": {"max_minutes": 60, "lr": 0.002}}
    (tmp_path / "training.json").write_text(json.dumps(training))
    card = render_card(tmp_path)
    assert ("python -m specdec train data --work-dir W --num-prompts 4904 --batch-size 96 --max-tokens 256 "
            "--max-minutes 40\n") in card
    del training["data"]["generation"]
    (tmp_path / "training.json").write_text(json.dumps(training))
    assert "--num-prompts 1200 --batch-size 64 --max-tokens 128 --max-minutes 6\n" in render_card(tmp_path)
