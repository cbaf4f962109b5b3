"""A draft's vocabulary cut to the tokens the target writes most (FR-Spec; SGLang's
`--speculative-token-map`).

Why: a draft_model or an EAGLE-1 head ends each draft step with the full LM head, which for
the default model is 49,152 rows, a fifth of the target's weights: on a CPU, where a step
costs what it reads, that head is most of a draft step (draft_model: 57 of its 78 MB).
With `"speculative_token_map": <file>` in `--speculative-config`, the drafter keeps only
the head rows of the listed target token ids and drafts among them; a token outside the
map is never proposed, which can cost acceptance but never correctness (the target
verifies every draft, and a sampled draft's distribution is reported over the target's
vocabulary, zero outside the map, so rejection sampling stays exact).

The file lists target token ids: a JSON list, a torch file holding a list or a 1-D integer
tensor (the format FR-Spec publishes), or whitespace-separated integers; a name of a map
shipped in `specdec/drafts/` (e.g. `smollm2-135m-instruct-token-map`) also works.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdec.errors import ConfigError
from specdec.models.linear import Linear

PARAM = "speculative_token_map"


def resolve_token_map_path(value: str) -> Path:
    """The file `value` names: a path, or a map shipped in specdec/drafts/."""
    path = Path(value).expanduser()
    if path.is_file():
        return path
    if "/" not in value and "\\" not in value:
        from specdec.drafts import drafts_root

        for candidate in (drafts_root() / value, drafts_root() / f"{value}.json"):
            if candidate.is_file():
                return candidate
    raise ConfigError(f"speculative config: speculative_token_map {value!r} is neither a file nor a "
                      "token map shipped with specdec", param=PARAM)


def _read_ids(path: Path) -> list[object]:
    if path.suffix in (".pt", ".pth", ".bin"):
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # a corrupt or foreign file: say which and why
            raise ConfigError(f"cannot read the token map {path}: {error}", param=PARAM) from None
        return loaded.tolist() if isinstance(loaded, torch.Tensor) else loaded
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read the token map {path}: {error}", param=PARAM) from None
    if path.suffix == ".json" or text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"the token map {path} is not valid JSON: {error}", param=PARAM) from None
    return [*text.split()]


def load_token_map(value: str, vocab_size: int) -> torch.Tensor:
    """The target token ids `value` lists, unique and ascending, as int64; ConfigError when
    the file cannot be read or an entry is not a token id of a `vocab_size` vocabulary."""
    path = resolve_token_map_path(value)
    raw = _read_ids(path)
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"the token map {path} must list target token ids (a non-empty list)", param=PARAM)
    ids: list[int] = []
    for entry in raw:
        try:
            token_id = int(entry)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise ConfigError(f"the token map {path} holds {entry!r}, not a token id", param=PARAM) from None
        if isinstance(entry, float) and entry != token_id or isinstance(entry, bool):
            raise ConfigError(f"the token map {path} holds {entry!r}, not a token id", param=PARAM)
        if not 0 <= token_id < vocab_size:
            raise ConfigError(f"the token map {path} holds token id {token_id}, outside the target's "
                              f"vocabulary of {vocab_size}", param=PARAM)
        ids.append(token_id)
    return torch.tensor(sorted(set(ids)), dtype=torch.int64)


def restrict_lm_head(module: Any, token_ids: torch.Tensor) -> None:
    """Replaces `module.lm_head` by one holding only the rows of `token_ids` (a copy: a tied
    embedding stays whole), so `module.compute_logits` scores the map's tokens, in its order."""
    head = module.lm_head
    weight = head.weight.detach()
    index = token_ids.to(weight.device)
    bias = getattr(head, "bias", None)
    restricted = Linear(weight.shape[1], len(token_ids), bias=bias is not None,
                        device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        restricted.weight.copy_(weight.index_select(0, index))
        if bias is not None:
            restricted.bias.copy_(bias.detach().index_select(0, index))
    restricted.requires_grad_(False)
    module.lm_head = restricted
