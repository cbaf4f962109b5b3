"""The fields of vLLM's `--speculative-config`, one by one: their names, defaults and
checks. `SpeculativeConfig.parse` (specdec/config.py) applies them in order; every
rejection raises `ConfigError` naming the field.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from specdec.draft_caps import FIELD as DRAFT_CAPS_FIELD
from specdec.errors import ConfigError

logger = logging.getLogger(__name__)

SPECULATIVE_METHODS = ("ngram", "eagle", "eagle3", "draft_model", "suffix")
DEFAULT_PROMPT_LOOKUP = 5
# Suffix decoding's fields and vLLM's defaults for them (drafter_svc/suffix_proposer.py).
SUFFIX_DEFAULTS: dict[str, int | float] = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    # specdec's own (vLLM bounds the global cache by requests only): the tokens it holds,
    # lead-ins included. A trie costs about 1.5 KB per token at depth 24.
    "suffix_decoding_max_cached_tokens": 1_000_000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}

# Fields vLLM's SpeculativeConfig knows that specdec accepts but does not use: a
# config written for vLLM keeps working, and start-up warns about each one given.
VLLM_FIELDS_UNUSED = (
    "draft_tensor_parallel_size",
    "quantization",
    "max_model_len",
    "revision",
    "code_revision",
    "disable_padded_drafter_batch",
    "speculative_token_tree",
    "disable_log_stats",
    "enforce_eager",
    "parallel_drafting",
)
# Methods whose draft ends in an LM head over the target's vocabulary, which a token map cuts.
TOKEN_MAP_METHODS = ("eagle", "draft_model")

KNOWN_FIELDS = (
    "method",
    "num_speculative_tokens",
    "model",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "speculative_token_map",
    "disable_by_batch_size",
    DRAFT_CAPS_FIELD,
    *SUFFIX_DEFAULTS,
)


def require_int(raw: dict[str, Any], field_name: str, minimum: int) -> int | None:
    value = raw.get(field_name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"speculative config: {field_name} must be an integer >= {minimum}, got {value!r}",
            param=field_name,
        )
    if value < minimum:
        raise ConfigError(
            f"speculative config: {field_name} must be >= {minimum}, got {value}",
            param=field_name,
        )
    return value


def decode_json(text: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """The flag's JSON (or an already-decoded dict) as a dict; None when off (None, empty,
    JSON null)."""
    if text is None:
        return None
    if isinstance(text, str):
        if not text.strip():
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"--speculative-config is not valid JSON: {exc}", param="speculative_config"
            ) from None
    else:
        raw = dict(text)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(
            "--speculative-config must be a JSON object, e.g. "
            '{"method": "ngram", "num_speculative_tokens": 3}',
            param="speculative_config",
        )
    return raw


def check_known_fields(raw: dict[str, Any]) -> None:
    """Refuses a field nobody knows; warns about each of vLLM's that specdec does not use."""
    unknown = sorted(set(raw) - set(KNOWN_FIELDS) - set(VLLM_FIELDS_UNUSED))
    if unknown:
        raise ConfigError(
            f"speculative config: unknown field(s) {', '.join(unknown)}; known fields are "
            f"{', '.join(KNOWN_FIELDS)}",
            param=unknown[0],
        )
    for name in sorted(set(raw) & set(VLLM_FIELDS_UNUSED)):
        logger.warning("speculative config: field %r is accepted for vLLM compatibility "
                       "but not used by specdec", name)


def model_and_method(raw: dict[str, Any]) -> tuple[str | None, str]:
    """`model` as given and `method`, inferred from the model where absent (vLLM's rule)."""
    model = raw.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ConfigError("speculative config: model must be a non-empty string (a path "
                          "or a shipped draft name)", param="model")
    method = raw.get("method")
    if method is None:
        method = _infer_method(model)
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(
            f"speculative config: method {method!r} is not supported; allowed values: "
            f"{', '.join(SPECULATIVE_METHODS)}",
            param="method",
        )
    return model, method


def num_speculative_tokens(raw: dict[str, Any], method: str, suffix: dict[str, Any]) -> int:
    """Required, but for suffix, whose default (vLLM's) is as long as the tree is deep."""
    if method == "suffix" and "num_speculative_tokens" not in raw:
        return int(suffix["suffix_decoding_max_tree_depth"])
    if "num_speculative_tokens" not in raw:
        raise ConfigError("speculative config: num_speculative_tokens is required "
                          "(an integer >= 1)", param="num_speculative_tokens")
    num_tokens = require_int(raw, "num_speculative_tokens", 1)
    if num_tokens is None:
        raise ConfigError("speculative config: num_speculative_tokens must be an integer "
                          ">= 1, got null", param="num_speculative_tokens")
    return num_tokens


def model_and_prompt_lookup(raw: dict[str, Any], method: str, model: str | None,
                            ) -> tuple[str | None, int | None, int | None]:
    """(model, prompt_lookup_min, prompt_lookup_max): ngram takes the lookup bounds
    (5 and 5 by default; one given, the other copies it) and no model, suffix neither,
    model methods need a model."""
    lookup_min = require_int(raw, "prompt_lookup_min", 1)
    lookup_max = require_int(raw, "prompt_lookup_max", 1)
    if method != "ngram":
        for name, value in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
            if value is not None:
                raise ConfigError(f"speculative config: {name} applies to method 'ngram' "
                                  f"only, not {method!r}", param=name)
        if method == "suffix":
            if model is not None:
                raise ConfigError("speculative config: model is not used by method "
                                  "'suffix'; leave it out", param="model")
        elif model is None:
            raise ConfigError(f"speculative config: method {method!r} needs model (the "
                              "draft model or head path)", param="model")
        return model, None, None
    if model is not None and model not in ("ngram", "[ngram]"):
        raise ConfigError("speculative config: model is not used by method 'ngram'; "
                          "leave it out", param="model")
    if lookup_min is None and lookup_max is None:
        lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
    elif lookup_min is None:
        lookup_min = lookup_max
    elif lookup_max is None:
        lookup_max = lookup_min
    assert lookup_min is not None and lookup_max is not None
    if lookup_min > lookup_max:
        raise ConfigError(
            f"speculative config: prompt_lookup_min ({lookup_min}) must be <= "
            f"prompt_lookup_max ({lookup_max})",
            param="prompt_lookup_min",
        )
    return None, lookup_min, lookup_max


def token_map(raw: dict[str, Any], method: str) -> str | None:
    """`speculative_token_map`: for the methods whose draft ends in the target's LM head."""
    path = raw.get("speculative_token_map")
    if path is None:
        return None
    if not isinstance(path, str) or not path:
        raise ConfigError("speculative config: speculative_token_map must be a non-empty "
                          "string (a file of target token ids)", param="speculative_token_map")
    if method not in TOKEN_MAP_METHODS:
        reason = ("an EAGLE-3 head carries its own draft vocabulary (d2t)" if method == "eagle3"
                  else f"method {method!r} has no LM head")
        raise ConfigError(f"speculative config: speculative_token_map applies to "
                          f"{' and '.join(TOKEN_MAP_METHODS)}, not {method!r}: {reason}",
                          param="speculative_token_map")
    return path


def suffix_fields(raw: dict[str, Any], method: str) -> dict[str, Any]:
    """The suffix_decoding_* fields, checked and defaulted for suffix; refused for others."""
    given = [name for name in SUFFIX_DEFAULTS if name in raw]
    if method != "suffix":
        if given:
            raise ConfigError(f"speculative config: {given[0]} applies to method 'suffix' "
                              f"only, not {method!r}", param=given[0])
        return {}
    values: dict[str, Any] = {}
    for name, minimum in (("suffix_decoding_max_tree_depth", 1),
                          ("suffix_decoding_max_cached_requests", 0),
                          ("suffix_decoding_max_cached_tokens", 0)):
        value = require_int(raw, name, minimum)
        values[name] = SUFFIX_DEFAULTS[name] if value is None else value
    for name, low, high in (("suffix_decoding_max_spec_factor", 0.0, None),
                            ("suffix_decoding_min_token_prob", 0.0, 1.0)):
        value = raw.get(name)
        if value is None:
            values[name] = SUFFIX_DEFAULTS[name]
            continue
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value < low or (high is not None and value > high)):
            raise ConfigError(f"speculative config: {name} must be a number {bounds}, "
                              f"got {value!r}", param=name)
        values[name] = float(value)
    return values


def _infer_method(model: str | None) -> str:
    """vLLM infers the method from `model` when `method` is absent."""
    if model is None:
        raise ConfigError("speculative config: method is required; allowed values: "
                          f"{', '.join(SPECULATIVE_METHODS)}", param="method")
    if model in ("ngram", "[ngram]"):
        return "ngram"
    lowered = model.lower()
    if "eagle3" in lowered:
        return "eagle3"
    if "eagle" in lowered:
        return "eagle"
    return "draft_model"
