"""Drafts that specdec trained for its default model and ships, resolvable by name.

Each subdirectory is one draft in its published layout (config.json, model.safetensors in
bfloat16, README.md: how it was trained and the acceptance it reaches), small because it
leaves out what its loader takes from the target (embedding, lm_head). Use one with
`--speculative-config '{"method": "eagle3", "model": "smollm2-135m-instruct-eagle3",
"num_speculative_tokens": 4}'`; `specdec.models.model_files.resolve_model` looks names up
here first. `python -m specdec train` makes them (specdec/train/).

`smollm2-135m-instruct-token-map.json` lists the 8,192 target token ids of the eagle3
draft's vocabulary (the most frequent in the drafts' training data; `python -m specdec train
token-map --work-dir W` writes it from the same features): pass it as
`"speculative_token_map": "smollm2-135m-instruct-token-map"` to cut an eagle or
draft_model draft's LM head to them (specdec/models/token_map.py).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# name -> speculative method
SHIPPED_DRAFTS: dict[str, str] = {
    "smollm2-135m-instruct-eagle3": "eagle3",
    "smollm2-135m-instruct-eagle": "eagle",
    "smollm2-135m-instruct-draft": "draft_model",
}


# The token map shipped for eagle / draft_model drafts of the default model (see the docstring).
SHIPPED_TOKEN_MAP = "smollm2-135m-instruct-token-map"


def drafts_root() -> Path:
    return Path(str(resources.files("specdec.drafts")))


def shipped_draft_dir(name: str) -> Path | None:
    """The directory of the shipped draft called `name` (case-insensitive), or None."""
    key = name.strip().lower()
    if key not in SHIPPED_DRAFTS:
        return None
    directory = drafts_root() / key
    return directory if (directory / "config.json").is_file() else None
