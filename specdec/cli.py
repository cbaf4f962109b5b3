"""What every specdec command shares on its command line: the help format, the listening
address and its default port per role, the shutdown grace, logging, the served name.

Torch-free, so that the gateway and the ngram drafter start without loading it. The flags of
the services' configs are derived from the configs themselves (specdec.config_flags).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

ADDITIONAL_CONFIG_KEYS: tuple[str, ...] = ()
# Each service's port however it is started (`python -m <service>`, the images, the
# manifests); the gateway's is the port of every client example and benchmark default.
# Under `python -m specdec serve` the verifier and the drafter listen on free loopback
# ports unless --verifier-port/--drafter-port say otherwise: they are the stack's inside.
DEFAULT_PORTS = {"gateway": 18080, "verifier": 50051, "drafter": 50052}
DEFAULT_GATEWAY_PORT = DEFAULT_PORTS["gateway"]


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


DEFAULT_SHUTDOWN_GRACE_S = 10.0


def add_shutdown_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shutdown-grace-s", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                        help="on SIGTERM: report NOT_SERVING, refuse new requests, give "
                             "in-flight ones this long to finish, then abort them "
                             f"(default: {DEFAULT_SHUTDOWN_GRACE_S:g})")


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """--log-level, the same for every specdec process (the gateway passes it to uvicorn)."""
    parser.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)


def setup_logging(level: str, name: str) -> None:
    """The one log format of every specdec process; `name` says which (verifier, drafter,
    gateway), as the launcher interleaves their lines on one terminal."""
    logging.basicConfig(level=level.upper(),
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")


def add_listen_args(parser: argparse.ArgumentParser, role: str) -> None:
    """--host and --port of a service, the port's default its role's (DEFAULT_PORTS)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=DEFAULT_PORTS[role],
                        help="port to bind; 0 picks a free one")
    if role != "gateway":
        parser.add_argument("--metrics-port", type=int, default=None,
                            help="serve Prometheus metrics over HTTP at /metrics on this port")
