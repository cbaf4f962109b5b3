"""deploy/swarm/docker-stack.yml deploys what docker-compose.yml runs, the swarm way: deploy
sections, dnsrr discovery, secrets as files, rolling updates that start the new task first.
No Docker engine needed (the one test that runs `docker stack config` skips without the CLI);
scripts/swarm-smoke.sh runs the stack for real."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
STACK = ROOT / "deploy" / "swarm" / "docker-stack.yml"
TOKEN_PATH = "/run/secrets/specdec_internal_token"
VERIFIERS = ("verifier-0", "verifier-1")
SERVICES = ("drafter", *VERIFIERS, "gateway")


def interpolate(text: str) -> str:
    """`${NAME:-default}` -> default (as with an empty environment); the default may hold braces."""
    out, index = [], 0
    while (start := text.find("${", index)) != -1:
        out.append(text[index:start])
        depth, end = 1, start + 2
        while depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        name, _, default = text[start + 2:end - 1].partition(":-")
        assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", name), name
        out.append(default)
        index = end
    return "".join(out) + text[index:]


@pytest.fixture(scope="module")
def stack() -> dict:
    return yaml.safe_load(interpolate(STACK.read_text()))


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(interpolate((ROOT / "docker-compose.yml").read_text()))


def command_of(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def flag(command: list[str], name: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command) if arg == name]


def test_the_stack_has_the_services_and_no_compose_only_keys(stack: dict) -> None:
    assert set(stack["services"]) == set(SERVICES)
    for name, service in stack["services"].items():
        # Keys `docker stack deploy` ignores would promise what swarm never does.
        assert not {"build", "depends_on", "pull_policy", "restart", "container_name"} & set(service), name
        assert service["image"] == "specdec:latest" and service["init"] is True, name


def test_every_service_is_deployed_with_restarts_limits_and_dnsrr(stack: dict) -> None:
    for name, service in stack["services"].items():
        deploy = service["deploy"]
        assert deploy["replicas"] >= 1, name
        # The VIP does not route everywhere; the names resolve to every task's own address.
        assert deploy["endpoint_mode"] == "dnsrr", name
        assert deploy["restart_policy"]["condition"] == "any", name
        assert deploy["resources"]["limits"]["memory"] and deploy["resources"]["reservations"]["memory"], name
        assert deploy["update_config"]["failure_action"] == "rollback", name
        assert deploy["update_config"]["parallelism"] == 1, name
        check = service["healthcheck"]
        assert check["test"][0] == "CMD", name
        # Swarm replaces a task whose check fails `retries` times in a row: a check that times
        # out on a busy node must not kill a serving task.
        assert seconds(check["timeout"]) >= 10 and check["retries"] >= 5, name
        assert seconds(check["interval"]) * check["retries"] >= 60, name
    for name in ("drafter", *VERIFIERS):
        # The new task serves before the old one stops: no gap in drafting or verifying.
        assert stack["services"][name]["deploy"]["update_config"]["order"] == "start-first", name
        assert stack["services"][name]["deploy"]["rollback_config"]["order"] == "start-first", name


def test_the_gateway_publishes_its_port_in_host_mode(stack: dict) -> None:
    gateway = stack["services"]["gateway"]
    port = int(flag(command_of(gateway), "--port")[0])
    (published,) = gateway["ports"]
    # Ingress publishing goes through the routing mesh's VIP, which dnsrr services lack.
    assert published == {"target": port, "published": port, "protocol": "tcp", "mode": "host"}
    # A second task on the node could not bind the port: the old one stops first.
    assert gateway["deploy"]["update_config"]["order"] == "stop-first"


def test_services_find_each_other_by_service_name_and_port(stack: dict) -> None:
    services = stack["services"]
    drafter_port = flag(command_of(services["drafter"]), "--port")[0]
    for name, service in services.items():
        if name != "gateway":
            assert service["environment"]["HEALTH_PORT"] == flag(command_of(service), "--port")[0], name
    for name in VERIFIERS:
        # One name, every drafter replica: the verifier re-resolves it and connects to each.
        assert flag(command_of(services[name]), "--drafter") == [f"drafter:{drafter_port}"], name
    gateway_targets = flag(command_of(services["gateway"]), "--verifier")
    # One address per verifier service (each placed and rolled on its own).
    assert gateway_targets == [f"{name}:{flag(command_of(services[name]), '--port')[0]}" for name in VERIFIERS]
    for service in services.values():
        assert service["networks"] == ["specdec"]
    assert stack["networks"]["specdec"]["driver"] == "overlay"


def seconds(duration: str) -> float:
    return float(duration.removesuffix("s"))


def mounted_secrets(service: dict) -> dict[str, dict]:
    return {"/run/secrets/" + s["target"]: s for s in service["secrets"]}


def test_secrets_are_swarm_secrets_mounted_as_files(stack: dict) -> None:
    defined = stack["secrets"]
    for name, service in stack["services"].items():
        command = command_of(service)
        mounts = mounted_secrets(service)
        for mount in mounts.values():
            assert mount["source"] in defined and mount["mode"] == 0o400, name
        assert flag(command, "--internal-token-file") == [TOKEN_PATH], name
        assert mounts[TOKEN_PATH]["source"] == "specdec_internal_token", name
        # Secrets never on a command line or in the environment (`docker inspect` shows both).
        assert not {"--api-key", "--internal-token"} & set(command), name
        assert not {"SPECDEC_INTERNAL_TOKEN", "SPECDEC_API_KEY"} & set(service["environment"]), name
        # No volume at /run/secrets: it would hide the secrets swarm mounts there.
        assert not any(v.split(":")[1].startswith("/run/secrets") for v in service["volumes"]), name
    (key_file,) = flag(command_of(stack["services"]["gateway"]), "--api-key-file")
    assert mounted_secrets(stack["services"]["gateway"])[key_file]["source"] == "specdec_api_key"
    # Created by the operator (`docker secret create`), never from a file in the repository.
    assert all(secret == {"external": True} for secret in defined.values())
    used = {s["source"] for service in stack["services"].values() for s in service["secrets"]}
    assert used == set(defined)


def test_the_verifier_drains_before_swarm_kills_it(stack: dict) -> None:
    for name in VERIFIERS:
        service = stack["services"][name]
        grace = float(flag(command_of(service), "--shutdown-grace-s")[0])
        assert seconds(service["stop_grace_period"]) > grace, name


def test_the_stack_runs_the_commands_compose_runs(stack: dict, compose: dict) -> None:
    def without(command: list[str], *flags: str) -> list[str]:
        out, skip = [], False
        for arg in command:
            if skip:
                skip = False
            elif arg in flags:
                skip = True
            else:
                out.append(arg)
        return out

    assert command_of(stack["services"]["drafter"]) == command_of(compose["services"]["drafter"])
    compose_verifier = without(command_of(compose["services"]["verifier"]), "--drafter")
    for name in VERIFIERS:
        assert (without(command_of(stack["services"][name]), "--shutdown-grace-s", "--threads", "--drafter")
                == compose_verifier)
    assert (without(command_of(stack["services"]["gateway"]), "--verifier", "--api-key-file")
            == without(command_of(compose["services"]["gateway"]), "--verifier"))


TLS_OVERLAY = STACK.with_name("docker-stack.tls.yml")
SERVER_TLS = ["--grpc-tls-cert", "/run/secrets/specdec_tls_cert", "--grpc-tls-key", "/run/secrets/specdec_tls_key",
              "--grpc-tls-ca", "/run/secrets/specdec_tls_ca"]
CLIENT_TLS = ["--grpc-tls-ca", "/run/secrets/specdec_tls_ca", "--grpc-tls-client-cert", "/run/secrets/specdec_tls_cert",
              "--grpc-tls-client-key", "/run/secrets/specdec_tls_key", "--grpc-tls-server-name", "specdec.internal"]


def test_the_tls_overlay_adds_only_tls_to_the_stack(stack: dict) -> None:
    overlay = yaml.safe_load(interpolate(TLS_OVERLAY.read_text()))
    assert set(overlay["services"]) == set(SERVICES)
    tls_secrets = {"specdec_tls_ca", "specdec_tls_cert", "specdec_tls_key"}
    assert overlay["secrets"] == {name: {"external": True} for name in tls_secrets}
    for name, service in overlay["services"].items():
        base = command_of(stack["services"][name])
        # A merge replaces the command whole: the overlay's is the stack's plus the TLS flags.
        added = command_of(service)[len(base):]
        assert command_of(service)[:len(base)] == base, name
        if name == "drafter":
            assert added == SERVER_TLS, name
        elif name == "gateway":
            assert added == CLIENT_TLS, name
        else:  # a verifier serves the gateway and calls the drafters
            assert added == SERVER_TLS + CLIENT_TLS[2:], name
        mounts = mounted_secrets(service)
        assert {mount["source"] for mount in mounts.values()} == tls_secrets, name
        for flag_value in added:
            if flag_value.startswith("/run/secrets/"):
                assert flag_value in mounts, (name, flag_value)
        # A stack merge appends a health-check command to the stack's instead of replacing it:
        # the stack's own check switches to TLS when the secrets are mounted.
        assert "healthcheck" not in service, name
        if name != "gateway":
            # The servers accept TLS only, so their health checks speak it, with the same name.
            check = stack["services"][name]["healthcheck"]["test"][-1]
            assert "ssl_channel_credentials" in check and "/run/secrets/specdec_tls_ca" in check, name
            assert service["environment"]["TLS_SERVER_NAME"] == "specdec.internal", name


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI here")
def test_docker_stack_config_accepts_the_stack_without_any_environment() -> None:
    # The CLI's own schema check and interpolation, as `docker stack deploy` runs them.
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    result = subprocess.run(["docker", "stack", "config", "-c", str(STACK)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0 and "unknown command" in result.stderr:
        pytest.skip("this docker CLI has no `docker stack config`")
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert config["services"]["drafter"]["deploy"]["endpoint_mode"] == "dnsrr"
    assert config["volumes"]["model-cache"]["name"] == "specdec_model-cache"
    # With the TLS overlay: swarm merges the secret lists by source, so the token stays.
    merged = subprocess.run(["docker", "stack", "config", "-c", str(STACK), "-c", str(TLS_OVERLAY)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=60, check=False)
    assert merged.returncode == 0, merged.stderr
    verifier = yaml.safe_load(merged.stdout)["services"]["verifier-0"]
    assert {s["source"] for s in verifier["secrets"]} == {
        "specdec_internal_token", "specdec_tls_ca", "specdec_tls_cert", "specdec_tls_key"}
    assert verifier["command"][-1] == "specdec.internal" and verifier["deploy"]["endpoint_mode"] == "dnsrr"
    assert len(verifier["healthcheck"]["test"]) == 4
    assert verifier["environment"]["TLS_SERVER_NAME"] == "specdec.internal"


@pytest.mark.parametrize("serving", [True, False])
def test_the_grpc_health_check_script_reports_the_servers_state(stack: dict, serving: bool) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    servicer.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        # Without the TLS secrets in /run/secrets, the check speaks plaintext.
        assert not Path("/run/secrets/specdec_tls_ca").exists()
        command = stack["services"]["drafter"]["healthcheck"]["test"]
        result = subprocess.run([sys.executable, *command[2:]], env={**os.environ, "HEALTH_PORT": str(port)},
                                capture_output=True, text=True, timeout=60, check=False)
    finally:
        server.stop(None)
    assert result.returncode == (0 if serving else 1), result.stderr


# --- scripts/swarm-load.py: the smoke's verdict -------------------------------------------------


def run_report(tmp_path: Path, results: list[dict]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "baseline.json").write_text(json.dumps({"0": "Paris.", "1": "Four."}))
    (tmp_path / "phases").write_text("0 10 drafter 1 -> 3\n20 30 verifier-0 restarted\n")
    defaults = {"stream": False, "cut": False, "error": "", "start": 0.0, "seconds": 0.5}
    (tmp_path / "load.jsonl").write_text("".join(json.dumps({**defaults, **result}) + "\n" for result in results))
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "swarm-load.py"), "report",
                           str(tmp_path / "baseline.json"), str(tmp_path / "load.jsonl"), str(tmp_path / "phases")],
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_load_report_allows_only_streams_cut_with_an_error_event(tmp_path: Path) -> None:
    passed = run_report(tmp_path, [
        {"prompt": 0, "ok": True, "text": "Paris."},
        {"prompt": 1, "ok": True, "text": "Four.", "stream": True},
        {"prompt": 1, "ok": False, "cut": True, "stream": True, "text": "Fo", "error": "verifier stopped",
         "start": 25.0},
    ])
    assert passed.returncode == 0, passed.stdout
    assert "3 requests (2 streamed), 2 ok, 0 failed, 1 streams cut" in passed.stdout
    assert "identical to the undisturbed baseline: 2/2" in passed.stdout
    # The requests each change ran under, from the smoke's windows.
    assert "during drafter 1 -> 3: 2 requests, 0 not ok" in passed.stdout
    assert "during verifier-0 restarted: 1 requests, 1 not ok" in passed.stdout


def test_the_load_report_fails_on_an_error_or_another_greedy_answer(tmp_path: Path) -> None:
    failed = run_report(tmp_path, [{"prompt": 0, "ok": True, "text": "Paris."},
                                   {"prompt": 0, "ok": False, "error": "HTTP 503: no verifier"}])
    assert failed.returncode == 1 and "FAILED" in failed.stdout and "HTTP 503" in failed.stdout
    differs = run_report(tmp_path, [{"prompt": 1, "ok": True, "text": "Five."}])
    assert differs.returncode == 1 and "DIFFERS" in differs.stdout
