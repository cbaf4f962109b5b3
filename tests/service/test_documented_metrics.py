"""The metrics reference in docs/deployment.md is what each service's /metrics serves.

Each service is started for real (the gateway in front of a fake verifier, a verifier on a
tiny model, an ngram drafter) and scraped over HTTP. Every metric its table names is served
with that type, and every metric served is in its table: a renamed, added or dropped metric
fails here until the reference says so.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from drafter_svc.server import start_drafter_server, stop_drafter_server
from specdec.config import SpeculativeConfig
from specdec.config_flags import build_config
from tests.support.fake_verifier import SERVED_MODEL, free_port, live_gateway
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.builder import VerifierConfig
from verifier_svc.server import start_verifier

DEPLOYMENT = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
METRIC_TYPES = ("counter", "gauge", "histogram")
NGRAM = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_min": 1, "prompt_lookup_max": 3})


def documented() -> dict[str, dict[str, str]]:
    """Per service ("Gateway", "Verifier", "Drafter"), the names its table gives (as served:
    counters with `_total`, labels left out) and their types."""
    section = DEPLOYMENT.read_text("utf-8").split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    tables: dict[str, dict[str, str]] = {}
    table: dict[str, str] | None = None
    for line in section.splitlines():
        heading = re.match(r"(\w+) \(label", line)
        if heading:
            table = tables.setdefault(heading[1], {})
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if table is not None and line.startswith("|") and len(cells) == 3 and cells[1] in METRIC_TYPES:
            for name in re.findall(r"`([^`{]+)(?:\{[^`}]*\})?`", cells[0]):
                table[name] = cells[1]
    return tables


def served(metrics_text: str) -> dict[str, str]:
    """The families in a Prometheus text exposition and their types, leaving out the
    `_created` timestamps prometheus_client adds beside each counter and histogram."""
    families = dict(re.findall(r"^# TYPE (\S+) (\S+)$", metrics_text, re.M))
    timestamped = {name.removesuffix("_total") for name, kind in families.items()
                   if kind in ("counter", "histogram")}
    return {name: kind for name, kind in families.items()
            if not (kind == "gauge" and name.removesuffix("_created") in timestamped
                    and name.endswith("_created"))}


def scrape(url: str) -> dict[str, str]:
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200
    return served(response.text)


def test_the_reference_has_a_table_per_service() -> None:
    tables = documented()
    assert set(tables) == {"Gateway", "Verifier", "Drafter"}
    assert all(tables.values()), tables
    # Names inside one cell, labels left out, counters as served.
    assert tables["Verifier"]["vllm:num_requests_waiting"] == "gauge"
    assert tables["Verifier"]["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == "counter"


def test_served_families_leave_out_only_the_created_timestamps() -> None:
    text = ("# TYPE vllm:x_total counter\n# TYPE vllm:x_created gauge\n"
            "# TYPE vllm:y_seconds histogram\n# TYPE vllm:y_seconds_created gauge\n"
            "# TYPE vllm:z gauge\n# TYPE vllm:w_created gauge\n")
    assert served(text) == {"vllm:x_total": "counter", "vllm:y_seconds": "histogram",
                            "vllm:z": "gauge", "vllm:w_created": "gauge"}


def test_the_gateway_serves_what_is_documented(tokenizer) -> None:
    with live_gateway(tokenizer) as (gateway, _):
        # One generation, so every labelled family has a child as in production.
        httpx.post(f"{gateway.base_url}/v1/completions", timeout=30,
                   json={"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 4}).raise_for_status()
        assert scrape(f"{gateway.base_url}/metrics") == documented()["Gateway"]


async def test_the_verifier_serves_what_is_documented(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    config = build_config(VerifierConfig, model=str(model), device="cpu", dtype="float32",
                          max_model_len=128, block_size=4, num_kv_blocks=64)
    running = await start_verifier(config, "127.0.0.1", 0, metrics_port=0)
    try:
        assert running.engine.metrics is not None and running.engine.metrics.port is not None
        assert scrape(f"http://127.0.0.1:{running.engine.metrics.port}/metrics") \
            == documented()["Verifier"]
    finally:
        await running.stop()


async def test_the_drafter_serves_what_is_documented() -> None:
    metrics_port = free_port()
    assert NGRAM is not None
    server, _ = await start_drafter_server(NGRAM, "127.0.0.1", 0, metrics_port=metrics_port)
    try:
        assert scrape(f"http://127.0.0.1:{metrics_port}/metrics") == documented()["Drafter"]
    finally:
        await stop_drafter_server(server)
