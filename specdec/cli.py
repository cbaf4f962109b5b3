"""vLLM-style flags shared by the launcher and the services, defined once."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from specdec.config import DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD
from specdec.models.model_files import DEFAULT_MODEL

ADDITIONAL_CONFIG_KEYS: tuple[str, ...] = ()
# The gateway's HTTP port however it is started (`python -m specdec serve`, `python -m
# gateway`, the images), and so the port of every client example and benchmark default.
DEFAULT_GATEWAY_PORT = 18080


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`--help` shows every option's default (every specdec command uses it), unless its
    help already tells it in words or there is none to show (None, a plain switch); the
    description keeps its own line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (text == argparse.SUPPRESS or "default" in text.lower() or action.nargs == 0
                or action.default in (None, argparse.SUPPRESS)):
            return action.help
        return f"{text} (default: %(default)s)".lstrip()


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"HF directory, .gguf file or {DEFAULT_MODEL!r} (default)")
    parser.add_argument("--served-model-name", default=None,
                        help="name clients use in 'model' (default: --model as given; the "
                             "verifier names a path by its last component)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM compatibility; specdec never runs model code")


def served_model_name(model: str, served_model_name: str | None = None) -> str:
    """What the verifier calls its model (GetInfo, the metrics' model_name label):
    --served-model-name, else --model as given, except that a filesystem path is named by
    its last component: a name must not tell a client where the files live."""
    if served_model_name:
        return served_model_name
    name = model.strip()
    path = Path(name).expanduser()
    if os.sep in name or name.startswith("~") or path.exists():
        path = path.resolve()
        name = path.stem if path.suffix.lower() == ".gguf" else path.name
    return name or "model"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="auto",
                        help="auto | float32 | bfloat16 | float16 (auto: bfloat16; float32 on a cpu "
                             "without bf16 kernels; float32 makes greedy speculation bit-exact)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | npu")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens per engine step; longer prompts prefill in chunks")
    parser.add_argument("--long-prefill-token-threshold", type=int,
                        default=DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
                        help="the largest prefill chunk of a step that also decodes, so running "
                             "decodes keep their pace beside a long prompt; 0: no cap "
                             "(default %(default)s)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of device memory (RAM on cpu) for weights, activations "
                             "and the KV cache")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="KV blocks to allocate, bypassing the memory budget")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV cache size; default: from --gpu-memory-utilization (on cpu "
                             "capped at VLLM_CPU_KVCACHE_SPACE GiB, default 4)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="keep full KV blocks of finished requests by content hash and "
                             "reuse them for any request with the same prefix (default: on; "
                             "--no-enable-prefix-caching turns it off)")
    parser.add_argument("--logprobs-mode", choices=["raw_logprobs", "processed_logprobs"],
                        default="raw_logprobs",
                        help="what logprobs report: the model's log-probabilities before any "
                             "sampling parameter (default, as vLLM) or after the request's "
                             "penalties, bias, temperature and top-k/top-p/min-p")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--draft-timeout-ms", type=float, default=None,
                        help="per-step deadline for drafter proposals (default: 50 for ngram, "
                             "2000 for the model methods)")
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="requests that may wait beyond --max-num-seqs; one more is "
                             "refused with RESOURCE_EXHAUSTED (HTTP 429) (default: 4 x "
                             "--max-num-seqs; 0: no queue)")
    parser.add_argument("--request-timeout-s", type=float, default=None,
                        help="end a request that runs longer with DEADLINE_EXCEEDED (default: "
                             "no limit; a client's gRPC deadline applies either way)")
    parser.add_argument("--quantization", choices=["int8"], default=None,
                        help="int8: weight-only int8 linears, quantised at load per output "
                             "channel (CPU; lossy against the checkpoint, speculation stays "
                             "lossless against the quantised model)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="never compile. By default, on the CPU with one rank and a C++ "
                             "compiler at hand, the verifier compiles its forward with "
                             "torch.compile at start-up (about a minute and a half for the "
                             "default model on 2 cores; steps are then ~1.3x faster) and "
                             "falls back to eager if compiling fails")
    parser.add_argument("--speculation-policy", choices=["adaptive", "fixed"], default="adaptive",
                        help="adaptive: each step drafts per sequence only as many tokens as "
                             "measured acceptance and step cost make worthwhile (0 included); "
                             "fixed: always num_speculative_tokens")
    parser.add_argument("--additional-config", default=None, help="JSON object")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative-config", default=None,
                        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                             '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\'')


DEFAULT_SHUTDOWN_GRACE_S = 10.0


def add_shutdown_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shutdown-grace-s", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                        help="on SIGTERM: report NOT_SERVING, refuse new requests, give "
                             "in-flight ones this long to finish, then abort them "
                             f"(default: {DEFAULT_SHUTDOWN_GRACE_S:g})")


def add_spec_decode_metrics_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--per-request-spec-decode-metrics", default="none",
                        choices=["none", "summary", "detailed"],
                        help="vLLM's per-request speculative metrics in each response's "
                             "top-level `metrics` (summary: acceptance length and rate, "
                             "acceptance histogram; detailed: also each drafting step's "
                             "drafted and accepted counts)")


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
