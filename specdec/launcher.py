"""`python -m specdec serve`: drafter, verifier and gateway as local processes.

The launcher resolves the model once (downloading and converting the default model on
first use), then starts each service with the flags that concern it. The served name
defaults to `--model` as given, so a client can send back exactly what the operator typed.
The verifier waits for the drafter before it serves, so the first requests are already
speculated. Ctrl-C or SIGTERM stops all three. A drafter that dies is restarted with
backoff: it costs speed only (the verifier decodes without drafts and reconnects); if the
verifier or the gateway dies, the others are stopped too.

Secrets travel in the children's environment, never in their argv (which `ps` shows to
every local user): a random internal token made for this run (SPECDEC_INTERNAL_TOKEN,
see specdec.rpc.internal_auth) for all three, and the API key (SPECDEC_API_KEY) for the
gateway only.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import cast

from drafter_svc.proposer import ModelOptions
from gateway.config import GatewayConfig
from specdec.cli import add_logging_args, add_shutdown_args, served_model_name
from specdec.config import SpeculativeConfig
from specdec.config_flags import add_config_args, build_config, config_argv
from specdec.models.loader import load_model_config
from specdec.models.model_files import DEFAULT_MODEL, resolve_model
from specdec.models.parallel import check_tensor_parallel
from specdec.rpc.internal_auth import (
    API_KEY_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    VLLM_API_KEY_ENV,
    add_api_key_args,
    generate_token,
    load_api_key,
)
from specdec.rpc.tls import add_grpc_tls_args, grpc_tls_flags, grpc_tls_from_args
from specdec.startup_health import PHASE_STARTING_SERVICES, StartupHealth
from verifier_svc.builder import VerifierConfig

logger = logging.getLogger(__name__)

# How long a child may take to stop beyond the verifier's --shutdown-grace-s.
STOP_MARGIN_S = 5.0
READY_TIMEOUT_S = 600.0
# How long the verifier waits for its drafter before serving, so that "ready" means
# speculating; a drafter that cannot start costs speed only after this.
DRAFTER_WAIT_S = 120.0
# A dead drafter's restart delay (first, most) and the run time that resets it.
RESTART_BACKOFF_S = (0.5, 30.0)
RESTART_RESET_S = 60.0


# What the launcher sets itself rather than take from its command line: the verifier's
# drafters (the one it starts), and the gateway's model, verifiers and context length
# (the verifier's, from GetInfo); the grammar limits are the verifier's flags too.
VERIFIER_FIELDS_SET = ("drafter_targets", "drafter_wait_s")
GATEWAY_FIELDS_SET = ("model", "served_model_name", "verifier_addresses", "max_model_len",
                      "trust_remote_code", "grammar_limits")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, VerifierConfig, exclude=VERIFIER_FIELDS_SET)
    add_config_args(parser, GatewayConfig, exclude=GATEWAY_FIELDS_SET)
    add_api_key_args(parser)
    parser.add_argument("--enable-reflection", action="store_true",
                        help="serve gRPC reflection on the verifier and the drafter (off by "
                             "default)")
    parser.add_argument("--verifier-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--drafter-metrics-port", type=int, default=None,
                        help="serve the drafter's Prometheus metrics over HTTP on this port")
    parser.add_argument("--verifier-metrics-port", type=int, default=None,
                        help="serve the verifier's Prometheus metrics (KV blocks, speculation, "
                             "latency) over HTTP on this port")
    parser.add_argument("--drafter-port", type=int, default=0, help="0: a free port")
    add_shutdown_args(parser)
    add_logging_args(parser)
    add_grpc_tls_args(parser)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def verifier_model(model: str, model_path: str) -> str:
    """The verifier's --model: a GGUF as the user named it (the default model's name, or the
    file's absolute path), so that the verifier can serve the file's blocks
    (`specdec.models.gguf_model.native_gguf_file` needs the file, not its conversion); else
    the resolved directory. The verifier's own resolve_model finds the launcher's conversion."""
    if model.strip().lower() == DEFAULT_MODEL:
        return DEFAULT_MODEL
    path = Path(model).expanduser()
    return str(path.resolve()) if path.is_file() and path.suffix.lower() == ".gguf" else model_path


def _child_commands(args: argparse.Namespace, model_path: str) -> list[tuple[str, list[str]]]:
    """Each child's command, from the configs the launcher's flags make (specdec.config_flags):
    a child gets every setting that differs from its own default."""
    python = sys.executable
    spec = SpeculativeConfig.parse(args.speculative_config)
    verifier_port = args.verifier_port or _free_port()
    drafter_port = (args.drafter_port or _free_port()) if spec is not None else 0
    # The model as the user named it (not the resolved path) names the served model.
    served_name = served_model_name(args.model, args.served_model_name)
    verifier = build_config(
        VerifierConfig, args, model=verifier_model(args.model, model_path), served_model_name=served_name,
        drafter_targets=(f"127.0.0.1:{drafter_port}",) if spec is not None else (),
        drafter_wait_s=DRAFTER_WAIT_S if spec is not None else 0.0)
    gateway = build_config(GatewayConfig, args, model=model_path,
                           served_model_name=served_name,
                           verifier_addresses=(f"127.0.0.1:{verifier_port}",),
                           max_model_len=None, grammar_limits=verifier.grammar_limits)
    common = ["--log-level", args.log_level]
    reflection = ["--enable-reflection"] if args.enable_reflection else []
    commands: list[tuple[str, list[str]]] = []
    if spec is not None:
        # Model drafters run on the same device and dtype as the target; EAGLE heads also
        # read the target's embedding, head and tokenizer.
        drafter = ModelOptions(target_model=model_path, dtype=verifier.dtype,
                               device=verifier.device)
        commands.append(("drafter", [
            python, "-m", "drafter_svc", "--port", str(drafter_port),
            "--speculative-config", spec.to_json(), *config_argv(drafter), *reflection,
            *_optional("--metrics-port", args.drafter_metrics_port), *common]))
    commands.append(("verifier", [
        python, "-m", "verifier_svc", *config_argv(verifier), "--port", str(verifier_port),
        "--shutdown-grace-s", str(args.shutdown_grace_s), *reflection,
        *_optional("--metrics-port", args.verifier_metrics_port), *common]))
    commands.append(("gateway", [python, "-m", "gateway", *config_argv(gateway), *common]))
    # gRPC TLS: each child gets the flags of its sides (drafter: server; gateway: client).
    tls = grpc_tls_from_args(args)
    sides = {"drafter": (True, False), "verifier": (True, True), "gateway": (False, True)}
    for name, command in commands:
        server, client = sides[name]
        command += grpc_tls_flags(tls, server=server, client=client)
    return commands


def _optional(flag: str, value: object | None) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _child_environments(api_key: str | None, internal_token: str) -> dict[str, dict[str, str]]:
    """Each child's environment: this one's, with the secrets it needs and no others."""
    inherited = {name: value for name, value in os.environ.items()
                 if name not in (TOKEN_ENV, TOKEN_FILE_ENV, API_KEY_ENV, VLLM_API_KEY_ENV)}
    inherited[TOKEN_ENV] = internal_token
    environments = {name: dict(inherited) for name in ("drafter", "verifier", "gateway")}
    if api_key is not None:
        environments["gateway"][API_KEY_ENV] = api_key
    return environments


def _stop_all(children: list[tuple[str, subprocess.Popen[bytes]]], timeout_s: float) -> None:
    """Stops the children in the reverse of their start order, each once the one started
    after it (its caller) has exited: the gateway drains its in-flight requests with the
    verifier still serving them, the verifier with drafts still coming, and no stop of a
    normal run logs a service that vanished under its caller. All within `timeout_s`, then
    killed."""
    deadline = time.monotonic() + timeout_s
    for name, proc in reversed(children):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %.0f s; killing it", name, timeout_s)
            proc.kill()
            proc.wait()
        _kill_leftovers(proc.pid)


def _kill_leftovers(group_id: int) -> None:
    """Kills what a stopped child left in its process group (each child leads its own):
    a compiler of a kernel build it was stopped in, a worker it could not reap. A pid is
    never reused while a group of that id has members, so this reaches only the child's."""
    try:
        os.killpg(group_id, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left


def serve(args: argparse.Namespace, started: float | None = None) -> int:
    """Runs the stack until SIGTERM or SIGINT. `started`: the command's start
    (time.monotonic()), from which "ready in N s" counts; default now."""
    started = time.monotonic() if started is None else started
    api_key = _checked_api_key(args)
    # /health answers from the first instant; the gateway takes the address over.
    startup_health = StartupHealth(args.host, args.port)
    try:
        model_dir = resolve_model(args.model, enter_phase=startup_health.enter)
        # The verifier starts the other tensor-parallel ranks itself; refuse a size the
        # model's heads do not divide before any child starts.
        check_tensor_parallel(load_model_config(model_dir), args.tensor_parallel_size)
    except BaseException:
        startup_health.close()
        raise
    startup_health.enter(PHASE_STARTING_SERVICES)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    environments = _child_environments(api_key, generate_token())
    try:
        _start_children(args, str(model_dir), environments, startup_health, stop, children)
        return _supervise(args, children, environments, started, stop)
    finally:
        startup_health.close()
        _stop_all(children, args.shutdown_grace_s + STOP_MARGIN_S)


def _checked_api_key(args: argparse.Namespace) -> str | None:
    """Validates every child's arguments before anything starts; the API key to use."""
    _child_commands(args, args.model)
    grpc_tls_from_args(args)
    if args.api_key is not None:
        logger.warning("--api-key on the command line is visible to every local user (ps); "
                       "prefer $SPECDEC_API_KEY or --api-key-file")
    return load_api_key(args.api_key, args.api_key_file)


def _start_children(args: argparse.Namespace, model_path: str, environments: dict[str, dict[str, str]],
                    startup_health: StartupHealth, stop: threading.Event,
                    children: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    """Starts the drafter, the verifier and the gateway in turn, appending each to
    `children` as it starts (so that a failure stops those already running)."""
    for name, command in _child_commands(args, model_path):
        listen_fd: int | None = None  # the launcher's /health socket, handed to the gateway
        if name == "gateway":
            # Once the verifier listens, so that the gateway's /health tells its start-up
            # phase from the first answer, never "unreachable" on a normal start.
            verifier = children[-1][1]
            verifier_args = _command_of(verifier)
            _wait_until_listening(int(verifier_args[verifier_args.index("--port") + 1]),
                                  verifier, stop.is_set)
            listen_fd = startup_health.hand_over()
            if listen_fd is not None:
                command = [*command, "--listen-fd", str(listen_fd)]
        logger.info("starting %s: %s", name, " ".join(command))
        # Own process group: a terminal's Ctrl-C reaches the launcher, which stops
        # the children in order.
        children.append((name, subprocess.Popen(
            command, env=environments[name], start_new_session=True,
            pass_fds=(listen_fd,) if listen_fd is not None else ())))
        if name == "gateway":
            startup_health.close()


def _supervise(args: argparse.Namespace, children: list[tuple[str, subprocess.Popen[bytes]]],
               environments: dict[str, dict[str, str]], started: float, stop: threading.Event) -> int:
    """Watches the children until a stop is asked for (0) or one that must not die did, or
    the gateway never became healthy (1). A dead drafter is restarted, never a reason to
    stop the stack."""
    ready = False
    children_started = time.monotonic()
    health_url = f"http://{args.host}:{args.port}/health"
    drafter_restarts = _RestartWithBackoff("drafter", environments["drafter"])
    while not stop.is_set():
        children[:] = [(name, drafter_restarts.check(proc) if name == "drafter" else proc)
                       for name, proc in children]
        dead = [(name, proc.returncode) for name, proc in children
                if name != "drafter" and proc.poll() is not None]
        if dead:
            logger.error("%s exited with code %s; stopping the others", *dead[0])
            return 1
        if not ready:
            ready = _healthy(health_url)
            if ready:
                logger.info("specdec ready in %.1f s: http://%s:%d/v1 serving %r",
                            time.monotonic() - started, args.host, args.port,
                            served_model_name(args.model, args.served_model_name))
            elif time.monotonic() - children_started > READY_TIMEOUT_S:
                logger.error("the gateway did not become healthy in %.0f s", READY_TIMEOUT_S)
                return 1
        time.sleep(0.5)  # not stop.wait: a signal handler's set() inside it could deadlock
    logger.info("stopping")
    return 0


def _command_of(proc: subprocess.Popen[bytes]) -> list[str]:
    """The command a child was started with (always a list of str here)."""
    return cast(list[str], proc.args)


def _wait_until_listening(port: int, proc: subprocess.Popen[bytes],
                          stopped: Callable[[], bool]) -> None:
    """Returns once 127.0.0.1:`port` accepts a connection, `proc` has exited (the main
    loop reports it) or a stop was asked for."""
    while proc.poll() is None and not stopped():
        with socket.socket() as sock:
            sock.settimeout(1.0)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


class _RestartWithBackoff:
    """Restarts a child that exited, with the same command, after a doubling delay.

    The delay starts at RESTART_BACKOFF_S[0] and doubles up to RESTART_BACKOFF_S[1]; a
    child that ran for RESTART_RESET_S before dying starts the count afresh.
    """

    def __init__(self, name: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.env = env  # the first start's environment (it carries the internal token)
        self.num_restarts = 0
        self._backoff_s = RESTART_BACKOFF_S[0]
        self._started_at = time.monotonic()
        self._restart_at: float | None = None

    def check(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        """`proc` while it runs or waits for its restart; the new process once restarted."""
        if proc.poll() is None:
            return proc
        now = time.monotonic()
        if self._restart_at is None:
            if now - self._started_at >= RESTART_RESET_S:
                self._backoff_s = RESTART_BACKOFF_S[0]
            self._restart_at = now + self._backoff_s
            logger.warning("%s exited with code %s; restarting it in %.1f s (speculation is "
                           "off until it is back)", self.name, proc.returncode, self._backoff_s)
            return proc
        if now < self._restart_at:
            return proc
        self._restart_at = None
        self._started_at = now
        self._backoff_s = min(2 * self._backoff_s, RESTART_BACKOFF_S[1])
        self.num_restarts += 1
        logger.info("restarting %s (restart %d): %s", self.name, self.num_restarts,
                    " ".join(_command_of(proc)))
        return subprocess.Popen(proc.args, env=self.env, start_new_session=True)
