#!/usr/bin/env bash
# Runs the docker compose stack for real and checks it: build, start, answer the README's
# chat request, scale the drafter to 3 replicas, check the verifier connected to all of
# them, answer 6 concurrent requests, stop. Needs a Docker engine with Compose v2
# (../shared/tools/docker-local.sh sets one up where no registry is reachable) and a CPU
# torch wheel in wheels/ (copied from /opt/wheels when present) or TORCH_INDEX_URL.
set -euo pipefail
cd "$(dirname "$0")/.."
URL=http://127.0.0.1:18080
if ! ls wheels/torch-2.13.0*.whl >/dev/null 2>&1 && ls /opt/wheels/torch-2.13.0*.whl >/dev/null 2>&1; then
  cp /opt/wheels/torch-2.13.0*.whl wheels/
fi
cleanup() { docker compose down --timeout 20 >/dev/null 2>&1 || true; }
trap cleanup EXIT

ask() {
  curl -sf --max-time 120 "$URL/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role":"user","content":"Who is the current US president?"}], "max_tokens":64, "temperature":0}'
}

started=$(date +%s)
docker compose up --build -d --wait --wait-timeout 900
echo "stack healthy in $(( $(date +%s) - started )) s"
first=$(ask)
python3 -c 'import json,sys; a=json.loads(sys.argv[1]); print("answer:", a["choices"][0]["message"]["content"]); print("usage:", a["usage"])' "$first"

docker compose up -d --wait --wait-timeout 300 --scale drafter=3
for _ in $(seq 60); do
  connected=$(docker compose logs verifier 2>&1 | grep -c "connected: method=" || true)
  [ "$connected" -ge 3 ] && break
  sleep 1
done
echo "verifier connections to drafter replicas: $connected"
[ "$connected" -ge 3 ] || { echo "the verifier did not connect to 3 drafters" >&2; exit 1; }

pids=()
for i in $(seq 6); do ask > "/tmp/compose-smoke-$i.json" & pids+=($!); done
for pid in "${pids[@]}"; do wait "$pid"; done
for i in $(seq 6); do
  python3 -c 'import json,sys; a=json.load(open(sys.argv[1])); assert a["choices"][0]["message"]["content"] == json.loads(sys.argv[2])["choices"][0]["message"]["content"]' \
    "/tmp/compose-smoke-$i.json" "$first"
done
echo "6 concurrent answers with 3 drafters: identical to the first (greedy)"
docker compose logs 2>&1 | grep -E " (ERROR|CRITICAL) " && { echo "errors in the logs" >&2; exit 1; }
echo "compose smoke test passed"
