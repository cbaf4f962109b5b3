"""`python -m specdec serve`: drafter, verifier and gateway as local processes.

The launcher resolves the model once (downloading and converting the default model on
first use), then starts each service with the flags that concern it. The served name
defaults to `--model` as given, so a client can send back exactly what the operator typed.
Ctrl-C or SIGTERM stops all three; if one dies, the others are stopped too.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from specdec.cli import (ADDITIONAL_CONFIG_KEYS, add_engine_args, add_logging_args,
                         add_model_args, add_speculative_args)
from specdec.config import SpeculativeConfig, parse_additional_config
from specdec.models.model_files import resolve_model

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0
READY_TIMEOUT_S = 600.0


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    add_engine_args(parser)
    add_speculative_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="gateway host")
    parser.add_argument("--port", type=int, default=8000, help="gateway (HTTP) port")
    parser.add_argument("--api-key", default=None, help="required Bearer key for /v1 routes")
    parser.add_argument("--verifier-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--drafter-port", type=int, default=0, help="0: a free port")
    add_logging_args(parser)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child_commands(args: argparse.Namespace, model_path: str) -> list[tuple[str, list[str]]]:
    python = sys.executable
    served_name = args.served_model_name or args.model
    verifier_port = args.verifier_port or _free_port()
    spec = SpeculativeConfig.parse(args.speculative_config)
    common = ["--log-level", args.log_level]
    commands: list[tuple[str, list[str]]] = []
    verifier = [python, "-m", "verifier_svc", "--model", model_path,
                "--port", str(verifier_port), "--dtype", args.dtype, "--device", args.device,
                "--max-num-seqs", str(args.max_num_seqs),
                "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                "--block-size", str(args.block_size),
                "--tensor-parallel-size", str(args.tensor_parallel_size),
                *common]
    for flag, value in (("--max-model-len", args.max_model_len),
                        ("--num-gpu-blocks-override", args.num_gpu_blocks_override),
                        ("--kv-cache-memory-bytes", args.kv_cache_memory_bytes),
                        ("--draft-timeout-ms", args.draft_timeout_ms),
                        ("--threads", args.threads),
                        ("--additional-config", args.additional_config)):
        if value is not None:
            verifier += [flag, str(value)]
    if spec is not None:
        drafter_port = args.drafter_port or _free_port()
        # Model drafters run on the same device and dtype as the target; EAGLE heads also
        # read the target's embedding, head and tokenizer.
        commands.append(("drafter", [python, "-m", "drafter_svc", "--port", str(drafter_port),
                                     "--speculative-config", spec.to_json(),
                                     "--target-model", model_path, "--dtype", args.dtype,
                                     "--device", args.device, *common]))
        verifier += ["--speculative-config", spec.to_json(),
                     "--drafter", f"127.0.0.1:{drafter_port}"]
    commands.append(("verifier", verifier))
    gateway = [python, "-m", "gateway", "--model", model_path, "--served-model-name", served_name,
               "--verifier", f"127.0.0.1:{verifier_port}", "--host", args.host,
               "--port", str(args.port), *common]
    if args.api_key:
        gateway += ["--api-key", args.api_key]
    commands.append(("gateway", gateway))
    return commands


def _stop_all(children: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    for _, proc in reversed(children):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for name, proc in children:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %.0f s; killing it", name, STOP_TIMEOUT_S)
            proc.kill()
            proc.wait()


def serve(args: argparse.Namespace) -> int:
    # Validate everything before starting anything.
    SpeculativeConfig.parse(args.speculative_config)
    parse_additional_config(args.additional_config, ADDITIONAL_CONFIG_KEYS)
    if args.tensor_parallel_size != 1:
        logger.error("--tensor-parallel-size %d is not supported yet; only 1 is",
                     args.tensor_parallel_size)
        return 2
    model_path = str(resolve_model(args.model))
    stop_requested = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        for name, command in _child_commands(args, model_path):
            logger.info("starting %s: %s", name, " ".join(command))
            # Own process group: a terminal's Ctrl-C reaches the launcher, which stops
            # the children in order.
            children.append((name, subprocess.Popen(command, start_new_session=True)))
        ready = False
        started = time.monotonic()
        health_url = f"http://{args.host}:{args.port}/health"
        while not stop_requested:
            dead = [(name, proc.returncode) for name, proc in children if proc.poll() is not None]
            if dead:
                logger.error("%s exited with code %s; stopping the others", *dead[0])
                return 1
            if not ready:
                ready = _healthy(health_url)
                if ready:
                    logger.info("specdec ready in %.1f s: http://%s:%d/v1 serving %r",
                                time.monotonic() - started, args.host, args.port,
                                args.served_model_name or args.model)
                elif time.monotonic() - started > READY_TIMEOUT_S:
                    logger.error("the gateway did not become healthy in %.0f s", READY_TIMEOUT_S)
                    return 1
            time.sleep(0.5)
        logger.info("stopping")
        return 0
    finally:
        _stop_all(children)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False
