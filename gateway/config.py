"""One gateway's start-up configuration (`GatewayConfig`), validated; `python -m gateway`'s
flags are derived from its fields (specdec.config_flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.hermes_tool_parser import TOOL_CALL_PARSERS
from gateway.spec_decode_metrics import MODES as SPEC_DECODE_METRICS_MODES
from gateway.spec_decode_metrics import check_mode as check_spec_decode_metrics_mode
from specdec.cli import DEFAULT_PORTS, served_model_name
from specdec.config_flags import flag, nested
from specdec.errors import ConfigError
from specdec.grammar_checker import GrammarLimits
from specdec.rpc.address import parse_host_port


@dataclass(frozen=True)
class GatewayConfig:
    """Validated start-up configuration of one gateway; `python -m gateway`'s flags are its
    fields' (specdec.config_flags)."""

    model: str = field(metadata=flag(
        "model whose tokenizer and chat template to load (a path or a shipped model name, as "
        "given to the verifier)"))
    verifier_addresses: tuple[str, ...] = field(default=(), metadata=flag(
        "verifier gRPC address; repeat for several (round-robin)", name="--verifier",
        metavar="HOST:PORT", repeated=True, required=True))
    # Defaults to `model` as given (vLLM), a path named by its last component (the rule of
    # specdec.cli.served_model_name, which the verifier follows too).
    served_model_name: str | None = field(default=None, metadata=flag(
        "model name in the API (default: --model as given; a path by its last component)"))
    # vLLM names a model --served-model-name, else --model as given, so a client moving from
    # vLLM may send a path; that name is accepted in requests though the API lists the served
    # name (the launcher passes the user's --model here, the gateway's own being the
    # resolved files).
    model_alias: str | None = field(default=None, metadata=flag(
        "another name requests may give the model by (default: --model as given)"))
    # Defaults to the verifier's (GetInfo).
    max_model_len: int | None = field(default=None, metadata=flag(
        "context length limit (default: the verifier's)"))
    trust_remote_code: bool = field(default=False, metadata=flag(
        "accepted for vLLM compatibility"))
    # From --api-key, --api-key-file or the environment (gateway.__main__), never a flag of
    # its own here: a child's argv is visible to every local user.
    api_key: str | None = field(default=None, repr=False)
    host: str = field(default="127.0.0.1", metadata=flag("address to bind"))
    port: int = field(default=DEFAULT_PORTS["gateway"], metadata=flag("HTTP port to bind"))
    max_request_bytes: int = 32 * 1024 * 1024
    # vLLM's flags: tool_choice "auto" needs both (and a chat template that renders tools).
    enable_auto_tool_choice: bool = field(default=False, metadata=flag(
        'allow tool_choice "auto" (the default when a request has tools): the tools go through '
        "the chat template (or specdec's own system prompt where it renders none), and the "
        "output is parsed by --tool-call-parser (vLLM's flag)"))
    tool_call_parser: str | None = field(default=None, metadata=flag(
        'how tool_choice "auto" output is read for tool calls (vLLM\'s flag; hermes: '
        "<tool_call>{...}</tool_call> blocks)", choices=tuple(sorted(TOOL_CALL_PARSERS))))
    # vLLM's per-request speculative metrics in responses (gateway.spec_decode_metrics).
    per_request_spec_decode_metrics: str = field(default="none", metadata=flag(
        "vLLM's per-request speculative metrics in each response's top-level `metrics` "
        "(summary: acceptance length and rate, acceptance histogram; detailed: also each "
        "drafting step's drafted and accepted counts)", choices=SPEC_DECODE_METRICS_MODES))
    # What one structured-output constraint may cost (specdec.grammar_checker).
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits, metadata=nested())

    def __post_init__(self) -> None:
        check_spec_decode_metrics_mode(self.per_request_spec_decode_metrics)
        if not self.model:
            raise ConfigError("--model must not be empty", param="model")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                              f"got {self.tool_call_parser!r}", param="tool_call_parser")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser",
                              param="tool_call_parser")
        object.__setattr__(self, "verifier_addresses", tuple(self.verifier_addresses))
        for address in self.verifier_addresses:
            parse_host_port(address, "--verifier")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1, got {self.max_model_len}",
                              param="max_model_len")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key must not be empty", param="api_key")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}", param="port")

    @property
    def model_name(self) -> str:
        """The name the API answers to and the metrics' model_name label."""
        return served_model_name(self.model, self.served_model_name)

    def names_model(self, name: str) -> bool:
        """Whether a request's `model` names this gateway's model: the served name, or the
        model as given (`model_alias`, else `model`), vLLM's name for it."""
        return name in (self.model_name, self.model_alias or self.model)
