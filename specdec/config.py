"""Start-up configuration: vLLM's `--speculative-config` and the engine's limits.

Built once at start-up, validated in `__post_init__`/`parse`, passed explicitly.
Every rejection raises `ConfigError` naming the field and, where there are any,
the allowed values.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, overload

from specdec.draft_caps import FIELD as DRAFT_CAPS_FIELD
from specdec import speculative_fields
from specdec.config_flags import flag
from specdec.draft_caps import DraftCaps
from specdec.errors import ConfigError

logger = logging.getLogger(__name__)

MODEL_METHODS = ("eagle", "eagle3", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """What `--speculative-config` says, validated and with vLLM's defaults filled in.

    ngram: `prompt_lookup_min`/`prompt_lookup_max` default to 5 and 5; when only one is
    given the other copies it. Model methods need `model` (a draft model or head).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # eagle, draft_model: a file of target token ids the draft's LM head is cut to (FR-Spec,
    # SGLang's --speculative-token-map); see specdec/models/token_map.py.
    speculative_token_map: str | None = None
    # vLLM's: a step whose batch holds more requests than this drafts nothing (no asks, no
    # probes), whatever the adaptive policy would do; None: no such limit.
    disable_by_batch_size: int | None = None
    # vLLM's num_speculative_tokens_per_batch_size: k by batch size (a cap for the
    # adaptive policy); None: num_speculative_tokens at every size.
    draft_caps: DraftCaps | None = None
    # suffix only (None for other methods): vLLM's suffix_decoding_* fields, defaults filled in.
    suffix_decoding_max_tree_depth: int | None = None
    suffix_decoding_max_cached_requests: int | None = None
    suffix_decoding_max_cached_tokens: int | None = None
    suffix_decoding_max_spec_factor: float | None = None
    suffix_decoding_min_token_prob: float | None = None

    # A dict is never "off": it parses to a config or raises.
    @overload
    @classmethod
    def parse(cls, text: dict[str, Any]) -> SpeculativeConfig: ...

    @overload
    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig | None: ...

    @classmethod
    def parse(cls, text: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """Parses the flag's JSON (or an already-decoded dict); None/empty means off."""
        raw = speculative_fields.decode_json(text)
        if raw is None:
            return None
        speculative_fields.check_known_fields(raw)
        model, method = speculative_fields.model_and_method(raw)
        suffix = speculative_fields.suffix_fields(raw, method)
        num_tokens = speculative_fields.num_speculative_tokens(raw, method, suffix)
        model, lookup_min, lookup_max = speculative_fields.model_and_prompt_lookup(raw, method, model)
        token_map = speculative_fields.token_map(raw, method)
        # vLLM's bound: a limit of 1 would switch speculation off for any batch at all.
        disable_by_batch_size = speculative_fields.require_int(raw, "disable_by_batch_size", 2)
        return cls(method=method, num_speculative_tokens=num_tokens, model=model,
                   prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max,
                   speculative_token_map=token_map, disable_by_batch_size=disable_by_batch_size,
                   draft_caps=DraftCaps.parse(raw.get(DRAFT_CAPS_FIELD), num_tokens), **suffix)

    def to_json(self) -> str:
        """The config as `--speculative-config` JSON, to pass to child processes."""
        raw: dict[str, Any] = {"method": self.method,
                               "num_speculative_tokens": self.num_speculative_tokens}
        if self.model is not None:
            raw["model"] = self.model
        if self.method == "ngram":
            raw["prompt_lookup_min"] = self.prompt_lookup_min
            raw["prompt_lookup_max"] = self.prompt_lookup_max
        if self.method == "suffix":
            for name in speculative_fields.SUFFIX_DEFAULTS:
                raw[name] = getattr(self, name)
        if self.speculative_token_map is not None:
            raw["speculative_token_map"] = self.speculative_token_map
        if self.disable_by_batch_size is not None:
            raw["disable_by_batch_size"] = self.disable_by_batch_size
        if self.draft_caps is not None:
            raw[DRAFT_CAPS_FIELD] = self.draft_caps.to_json()
        return json.dumps(raw)


# A model drafter runs k forwards per step, an ngram lookup takes microseconds: the
# per-step deadline for proposals defaults to what the method needs.
NGRAM_DRAFT_TIMEOUT_S = 0.05
MODEL_DRAFT_TIMEOUT_S = 2.0


def default_draft_timeout_s(spec: SpeculativeConfig | None) -> float:
    if spec is not None and spec.method in MODEL_METHODS:
        return MODEL_DRAFT_TIMEOUT_S
    return NGRAM_DRAFT_TIMEOUT_S


def parse_additional_config(text: str | None, used_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """Parses `--additional-config` JSON; keys specdec does not use are named in a warning."""
    if text is None or not text.strip():
        return {}
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--additional-config is not valid JSON: {exc}",
                          param="additional_config") from None
    if not isinstance(raw, dict):
        raise ConfigError("--additional-config must be a JSON object", param="additional_config")
    unused = sorted(set(raw) - set(used_keys))
    if unused:
        logger.warning("--additional-config: key(s) not used by specdec: %s", ", ".join(unused))
    return raw


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
SPECULATION_POLICIES = ("adaptive", "fixed")

# The default bound on waiting requests, per running slot: a full queue drains in about
# four times one request's latency, after which a client is better off told 429 at once.
DEFAULT_WAITING_PER_SEQ = 4


# vLLM's --long-prefill-token-threshold, here the largest prefill chunk of a step that also
# decodes, by device (default_long_prefill_token_threshold). A CPU's decode reads the weights
# (memory-bound) while its prefill computes at ~3 ms a token for 135M on 2 cores, a ratio
# the model's size hardly changes: beside a 6,000-token prompt a decode's median gap was
# 255 ms at 64, 406 at 128, 1,276 at 512, and the prompt's prefill 25.3, 19.2 and 16.4 s
# (docs/performance.md). An accelerator prefills hundreds of tokens in about a decode's time.
CPU_LONG_PREFILL_TOKEN_THRESHOLD = 128
ACCELERATOR_LONG_PREFILL_TOKEN_THRESHOLD = 512
# A decode's time between tokens beside a long prompt, in its own decode steps: "a few".
DEFAULT_PREFILL_CHUNK_DECODE_STEPS = 4.0


def default_long_prefill_token_threshold(device_type: str) -> int:
    return CPU_LONG_PREFILL_TOKEN_THRESHOLD if device_type == "cpu" else ACCELERATOR_LONG_PREFILL_TOKEN_THRESHOLD


@dataclass(frozen=True)
class EngineConfig:
    """The verifier engine's configuration, vLLM's flag names (`specdec.config_flags`
    derives the flags from the fields).

    Fields the command line leaves open (None: max_model_len, num_kv_blocks,
    draft_timeout_s) and those the speculative config implies are filled in by the builder
    (verifier_svc/builder.py) before the engine sees the config.
    """

    max_model_len: int | None = field(default=None, metadata=flag(
        "context length (default: the model's)"))
    max_num_seqs: int = field(default=256, metadata=flag("requests running at once"))
    max_num_batched_tokens: int = field(default=2048, metadata=flag(
        "tokens per engine step; longer prompts prefill in chunks"))
    # The largest prefill chunk in a step that also runs decodes (0: no cap): a decode's
    # time between tokens stays near its pace beside a long prompt; a prompt prefilled
    # alone still takes the whole budget. None: the device's default
    # (default_long_prefill_token_threshold), filled in by the builder; a scheduler given
    # None caps nothing.
    long_prefill_token_threshold: int | None = field(
        default=None, metadata=flag(
            "the largest prefill chunk of a step that also decodes, so running decodes keep "
            "their pace beside a long prompt; 0: no cap (default: "
            f"{CPU_LONG_PREFILL_TOKEN_THRESHOLD} on a CPU, "
            f"{ACCELERATOR_LONG_PREFILL_TOKEN_THRESHOLD} on an accelerator)"))
    # The prefill pacer's time budget (specdec.engine.prefill_pacer): a step that decodes
    # prefills only as much as keeps it within about this many measured decode steps, so
    # the token cap above need not fit every device and model. 0: the token cap alone.
    prefill_chunk_decode_steps: float = field(default=DEFAULT_PREFILL_CHUNK_DECODE_STEPS, metadata=flag(
        "a step that also decodes prefills only as many prompt tokens as keep it within about "
        "this many decode steps' time (measured as the server runs); 0: only "
        "--long-prefill-token-threshold caps the chunk"))
    block_size: int = field(default=16, metadata=flag("tokens per KV block"))
    # None: as many as the memory budget holds (verifier_svc/builder.py).
    num_kv_blocks: int | None = field(default=None, metadata=flag(
        "KV blocks to allocate, bypassing the memory budget", name="--num-gpu-blocks-override"))
    # Per-step deadline for drafter proposals; a late proposal means that sequence
    # decodes one token this step. None: the method's default (default_draft_timeout_s).
    draft_timeout_s: float | None = field(default=None, metadata=flag(
        "per-step deadline for drafter proposals (default: 50 for ngram, 2000 for the model "
        "methods)", name="--draft-timeout-ms", type=float,
        to_field=lambda ms: ms / 1000 if ms else None, to_flag=lambda s: s * 1000))
    # Requests that may wait beyond the max_num_seqs running ones; one more is refused
    # (RESOURCE_EXHAUSTED, HTTP 429). Always bounded: None means the default,
    # DEFAULT_WAITING_PER_SEQ x max_num_seqs; 0 means no queue at all.
    max_waiting_requests: int | None = field(default=None, metadata=flag(
        "requests that may wait beyond --max-num-seqs; one more is refused with "
        "RESOURCE_EXHAUSTED (HTTP 429) (default: 4 x --max-num-seqs; 0: no queue)"))
    # A request running longer than this ends with DEADLINE_EXCEEDED (None: no limit;
    # a client's gRPC deadline applies either way).
    request_timeout_s: float | None = field(default=None, metadata=flag(
        "end a request that runs longer with DEADLINE_EXCEEDED (default: no limit; a "
        "client's gRPC deadline applies either way)"))
    # Draft lengths chosen per step from measured acceptance and step cost
    # (verifier_svc.speculation.policy); False: always the request's k.
    adaptive_speculation: bool = field(default=True, metadata=flag(
        "adaptive: each step drafts per sequence only as many tokens as measured acceptance "
        "and step cost make worthwhile (0 included); fixed: always num_speculative_tokens",
        name="--speculation-policy", type=str, choices=SPECULATION_POLICIES,
        to_field=lambda policy: policy == "adaptive",
        to_flag=lambda adaptive: "adaptive" if adaptive else "fixed"))
    # The speculative config's disable_by_batch_size: a step whose running batch holds more
    # requests than this drafts for none of them. None: no limit.
    disable_by_batch_size: int | None = None
    # The speculative config's num_speculative_tokens_per_batch_size; None: no caps.
    draft_caps: DraftCaps | None = None
    # Automatic prefix caching (vLLM v1's default): full blocks of verified tokens are kept
    # by content hash after their request ends and reused by any later request sharing
    # the prefix (specdec/engine/block_manager.py).
    enable_prefix_caching: bool = field(default=True, metadata=flag(
        "keep full KV blocks of finished requests by content hash and reuse them for any "
        "request with the same prefix (default: on; --no-enable-prefix-caching turns it off)"))
    # What logprobs report: the model's raw log-probabilities, or those after the request's
    # logits processing (penalties, bias, temperature, top-k/top-p/min-p), as vLLM's
    # --logprobs-mode.
    logprobs_mode: str = field(default="raw_logprobs", metadata=flag(
        "what logprobs report: the model's log-probabilities before any sampling parameter "
        "(default, as vLLM) or after the request's penalties, bias, temperature and "
        "top-k/top-p/min-p", choices=LOGPROBS_MODES))
    # vLLM's --seed: seeds the random stream of the requests that give no seed of their own,
    # so a server started again answers the same requests, sent in the same order, alike.
    # A seeded request keeps its own stream (specdec/engine/position_random.py); greedy
    # requests draw nothing. None: unseeded requests differ from run to run.
    seed: int | None = field(default=None, metadata=flag(
        "random seed for the requests that give no seed of their own (default: none, a new "
        "stream each run)"))
    # The drafter matches text (ngram, suffix) rather than running a model. Such a drafter
    # takes a context in as it arrives, so a new request's prompt is sent to it as the
    # prefill starts (no drafts asked) and its first ask carries only the tokens verified
    # since (a model drafter prefills the context in its first ask whatever it was sent
    # before). It drafts any length at about one cost, with a per-token confidence, so
    # the adaptive policy asks it for the whole cap and verifies the prefix the evidence
    # pays for (verifier_svc/speculation/evidence.py).
    text_drafter: bool = True

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got "
                              f"{self.logprobs_mode!r}", param="logprobs_mode")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}", param=name)
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be >= 0 (0: no cap), got "
                              f"{self.long_prefill_token_threshold}",
                              param="long_prefill_token_threshold")
        if self.prefill_chunk_decode_steps != 0 and self.prefill_chunk_decode_steps < 1:
            raise ConfigError("prefill_chunk_decode_steps must be 0 (off) or >= 1 (a step is "
                              f"at least one decode step), got {self.prefill_chunk_decode_steps}",
                              param="prefill_chunk_decode_steps")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ConfigError("max_waiting_requests must be >= 0 (0: no queue beyond "
                              f"max_num_seqs), got {self.max_waiting_requests}",
                              param="max_waiting_requests")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be > 0, got {self.request_timeout_s}",
                              param="request_timeout_s")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks} (the "
                              "memory budget holds no KV block)", param="gpu_memory_utilization")
        if self.draft_timeout_s is not None and self.draft_timeout_s <= 0:
            raise ConfigError("draft timeout must be > 0", param="draft_timeout_ms")

    @property
    def context_len(self) -> int:
        """max_model_len, which the builder resolves before an engine runs."""
        if self.max_model_len is None:
            raise ConfigError("max_model_len is not resolved (verifier_svc/builder.py fills it in)",
                              param="max_model_len")
        return self.max_model_len

    @property
    def draft_deadline_s(self) -> float:
        """draft_timeout_s, which the builder resolves for a server with drafters."""
        if self.draft_timeout_s is None:
            raise ConfigError("draft_timeout_s is not resolved (verifier_svc/builder.py fills it in)",
                              param="draft_timeout_ms")
        return self.draft_timeout_s

    @property
    def waiting_limit(self) -> int:
        """Requests that may wait beyond the running ones, the default filled in."""
        if self.max_waiting_requests is None:
            return DEFAULT_WAITING_PER_SEQ * self.max_num_seqs
        return self.max_waiting_requests
