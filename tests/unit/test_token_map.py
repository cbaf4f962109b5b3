"""Token maps (specdec/models/token_map.py): the files they come in, what is refused, and the cut
LM head scoring exactly the map's tokens. Serving with one: tests/stack/test_model_drafting.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from drafter_svc.model_proposer import ModelProposer
from specdec.config import SpeculativeConfig
from specdec.errors import ConfigError
from specdec.models.token_map import load_token_map, restrict_lm_head

VOCAB = 100


@pytest.mark.parametrize("kind", ["json", "text", "torch-list", "torch-tensor"])
def test_a_map_reads_from_each_format_unique_and_sorted(tmp_path, kind: str) -> None:
    ids = [42, 7, 99, 7, 0]
    if kind == "json":
        path = tmp_path / "map.json"
        path.write_text(json.dumps(ids))
    elif kind == "text":
        path = tmp_path / "map.txt"
        path.write_text("42 7\n99\n7 0\n")
    else:
        path = tmp_path / "freq.pt"
        torch.save(ids if kind == "torch-list" else torch.tensor(ids), path)
    token_map = load_token_map(str(path), VOCAB)
    assert token_map.dtype == torch.int64
    assert token_map.tolist() == [0, 7, 42, 99]


def test_the_shipped_map_resolves_by_name() -> None:
    token_map = load_token_map("smollm2-135m-instruct-token-map", 49152)
    assert len(token_map) == 8192 and int(token_map.max()) < 49152
    assert {1, 2} <= set(token_map.tolist())  # the chat template's start and end tokens


@pytest.mark.parametrize("content,message", [
    ("[]", "non-empty list"),
    ('{"ids": [1]}', "non-empty list"),
    ("[1, 100]", "outside the target's vocabulary of 100"),
    ("[1, -1]", "outside the target's vocabulary"),
    ("[1, 2.5]", "not a token id"),
    ("[1, true]", "not a token id"),
    ('[1, "x"]', "not a token id"),
    ("[1, 2", "not valid JSON"),
])
def test_a_bad_map_is_refused_with_the_reason(tmp_path, content: str, message: str) -> None:
    path = tmp_path / "map.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as caught:
        load_token_map(str(path), VOCAB)
    assert caught.value.param == "speculative_token_map"


def test_a_missing_or_unreadable_map_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="neither a file nor a token map shipped"):
        load_token_map(str(tmp_path / "nowhere.json"), VOCAB)
    with pytest.raises(ConfigError, match="neither a file nor a token map shipped"):
        load_token_map("no-such-shipped-map", VOCAB)
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match="cannot read the token map"):
        load_token_map(str(broken), VOCAB)


def test_the_cut_head_scores_exactly_the_maps_tokens() -> None:
    torch.manual_seed(0)
    module = nn.Module()
    module.lm_head = nn.Linear(16, VOCAB, bias=False)
    embedding = module.lm_head.weight  # a tied embedding must stay whole
    hidden = torch.randn(3, 16)
    full_weight = embedding.detach().clone()
    full = module.lm_head(hidden)
    token_map = torch.tensor([3, 10, 57, 99])
    restrict_lm_head(module, token_map)
    assert module.lm_head.out_features == 4 and torch.equal(embedding, full_weight)  # the tied tensor: untouched
    assert torch.equal(module.lm_head.weight, full_weight[token_map])
    torch.testing.assert_close(module.lm_head(hidden), full[:, token_map])  # summation order may differ


def test_draft_ids_and_probabilities_map_back_to_the_targets_vocabulary() -> None:
    token_map = torch.tensor([3, 10, 57])
    proposer = SimpleNamespace(_token_map=token_map, info=SimpleNamespace(vocab_size=VOCAB))
    assert ModelProposer._to_target_ids(proposer, torch.tensor([2, 0, 1])).tolist() == [57, 3, 10]
    probs = torch.tensor([[0.2, 0.5, 0.3]])
    target = ModelProposer._probs_to_target(proposer, probs)
    assert target.shape == (1, VOCAB) and float(target.sum()) == pytest.approx(1.0)
    assert target[0, token_map].tolist() == pytest.approx([0.2, 0.5, 0.3])
    assert float(target[0].sum() - target[0, token_map].sum()) == 0.0  # nothing outside the map


@pytest.mark.parametrize("spec,message", [
    ({"method": "eagle3", "model": "h", "speculative_token_map": "m"}, "carries its own draft vocabulary"),
    ({"method": "ngram", "speculative_token_map": "m"}, "has no LM head"),
    ({"method": "eagle", "model": "h", "speculative_token_map": ""}, "non-empty string"),
    ({"method": "draft_model", "model": "d", "speculative_token_map": ["m"]}, "non-empty string"),
])
def test_the_config_takes_a_map_only_where_it_applies(spec: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse({**spec, "num_speculative_tokens": 3})
    accepted = SpeculativeConfig.parse({"method": "draft_model", "model": "d", "num_speculative_tokens": 3,
                                        "speculative_token_map": "m.json"})
    assert accepted is not None and json.loads(accepted.to_json())["speculative_token_map"] == "m.json"
