"""`ModelConfig`: the architecture numbers the engine needs, read from a Hugging Face config.

Built once from a `config.json` (a dict) or a transformers `PretrainedConfig`, validated,
frozen. Only the Llama family is supported (see `SUPPORTED_MODEL_TYPES`); everything else is
refused with a `ConfigError` naming the field and the allowed values.

Terms:
- *head_dim*: width of one attention head; the config's `head_dim` when present (Qwen3 sets
  it != hidden_size / num_attention_heads), else hidden_size // num_attention_heads.
- *GQA*: num_key_value_heads < num_attention_heads; each KV head serves
  num_attention_heads // num_key_value_heads query heads.
- *qk_norm*: Qwen3's RMSNorm over head_dim applied to q and k before RoPE.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import ConfigError

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is one of SUPPORTED_ROPE_TYPES other than default.

    linear: every inverse frequency divided by `factor`.
    llama3: Llama 3.1's piecewise scaling of low frequencies (uses all fields).
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one Llama-family checkpoint. See the module docstring for terms."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2: always)
    o_proj_bias: bool = False  # bias on the output projection (Llama attention_bias=True)
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {self.model_type!r}; allowed: {', '.join(SUPPORTED_MODEL_TYPES)}",
                param="model_type",
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}", param=name)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})",
                param="num_key_value_heads",
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}", param="head_dim")

    @property
    def q_size(self) -> int:
        """Width of the query projection output: num_attention_heads * head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection output: num_key_value_heads * head_dim."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf_config: Any, extra_eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """Build from a transformers `PretrainedConfig` or a parsed `config.json` dict.

        `extra_eos_token_ids` adds stop ids found elsewhere (generation_config.json).
        """
        raw: dict[str, Any] = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; allowed: {', '.join(SUPPORTED_MODEL_TYPES)}",
                param="model_type",
            )
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ConfigError(f"unsupported hidden_act {hidden_act!r}; allowed: silu", param="hidden_act")

        def required(name: str) -> Any:
            if raw.get(name) is None:
                raise ConfigError(f"config.json lacks {name!r}", param=name)
            return raw[name]

        hidden_size = int(required("hidden_size"))
        num_heads = int(required("num_attention_heads"))
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        rope_theta, rope_scaling = _parse_rope(raw)
        attention_bias = bool(raw.get("attention_bias", False))
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2 has q/k/v bias and no o_proj bias
        else:
            qkv_bias, o_bias = attention_bias, attention_bias
        if raw.get("use_sliding_window") or (model_type == "mistral" and raw.get("sliding_window")):
            logger.warning(
                "sliding_window=%s is ignored: attention is full, exact only up to the window length",
                raw.get("sliding_window"),
            )
        eos = raw.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        eos_ids += [i for i in extra_eos_token_ids if i not in eos_ids]
        return cls(
            model_type=model_type,
            vocab_size=int(required("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(required("intermediate_size")),
            num_hidden_layers=int(required("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            rope_scaling=rope_scaling,
            eos_token_ids=tuple(int(i) for i in eos_ids),
        )


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Read rope_theta and scaling from either layout: transformers 5 `rope_parameters` (theta
    inside) or the older top-level `rope_theta` plus `rope_scaling`."""
    params: dict[str, Any] = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = raw.get("rope_theta") or params.get("rope_theta") or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"unsupported rope scaling type {rope_type!r}; allowed: {', '.join(SUPPORTED_ROPE_TYPES)}",
            param="rope_scaling",
        )
    if rope_type == "default":
        return float(theta), None
    if params.get("factor") is None:
        raise ConfigError(f"rope scaling {rope_type!r} lacks 'factor'", param="rope_scaling")
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 8192)
        ),
    )
    return float(theta), scaling
