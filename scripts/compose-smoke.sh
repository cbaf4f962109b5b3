#!/usr/bin/env bash
# Runs the docker compose stack for real and checks it (not part of CI: it builds the image):
#  1. build, start, answer the README's chat request;
#  2. the services authenticate each other: a call to the verifier without the internal
#     token is refused (UNAUTHENTICATED);
#  3. one behaviour wherever it runs: a native `python -m specdec serve` started here with the
#     same settings reports the same C++ kernel variant and forward path as the container's
#     verifier and gives the same greedy answer; the time of a 128-token request in both is
#     printed side by side (SKIP_NATIVE=1 skips this step);
#  4. scale the drafter to 3 replicas, check the verifier connected to all of them, answer 6
#     concurrent requests identically; no ERROR in the logs; stop.
# Needs a Docker engine with Compose v2 (scripts/install-compose.sh installs Compose), a CPU
# torch 2.13.0 wheel for CPython 3.11 in wheels/ or TORCH_INDEX_URL (see the Dockerfile), and
# for step 3 this checkout installed here (`make install`).
set -euo pipefail
cd "$(dirname "$0")/.."
URL=http://127.0.0.1:18080
NATIVE_PORT=${NATIVE_PORT:-18099}
NATIVE_URL=http://127.0.0.1:$NATIVE_PORT
SPEC='{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":2,"prompt_lookup_max":5}'
# With SPECDEC_API_KEY set, compose and the native start both require it.
auth=()
[ -n "${SPECDEC_API_KEY:-}" ] && auth=(-H "authorization: Bearer $SPECDEC_API_KEY")
if ! ls wheels/torch-2.13.0*.whl >/dev/null 2>&1 && [ -z "${TORCH_INDEX_URL:-}" ]; then
  echo "compose-smoke: put a CPU torch-2.13.0 wheel in wheels/ or set TORCH_INDEX_URL (see the Dockerfile)" >&2
  exit 1
fi
work=$(mktemp -d)
native_pid=""
cleanup() {
  [ -n "$native_pid" ] && kill "$native_pid" 2>/dev/null && wait "$native_pid" 2>/dev/null
  docker compose down --timeout 20 >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# The README's request (greedy: temperature 0); `ask URL [max_tokens] [ignore_eos]`.
ask() {
  curl -sf --max-time 300 "${auth[@]}" "$1/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role":"user","content":"Who is the current US president?"}],
         "max_tokens":'"${2:-128}"', "top_k":-1, "top_p":0.1, "temperature":0, "stream":false,
         "repetition_penalty":1.0, "ignore_eos":'"${3:-false}"'}'
}
field() {  # field JSON PYTHON-EXPRESSION-ON-a
  python3 -c 'import json,sys; a=json.loads(sys.argv[1]); print(eval(sys.argv[2]))' "$1" "$2"
}
# "variant avx512-bf16-vbmi / torch.bfloat16 (C++ decoder stack)" from a verifier's log.
kernel_path() {
  local variant forward
  variant=$(grep -o "C++ CPU kernels: variant [a-z0-9-]*\|C++ CPU kernels could not be built\|holds no build of these sources" <<<"$1" | head -n1)
  forward=$(grep -o "verifier: model .* on [a-z:0-9]* in [a-z0-9.]* ([^)]*)" <<<"$1" | sed 's/.* in //' | head -n1)
  echo "${variant:-no kernel line} / ${forward:-no forward line}"
}
median_time() {  # median_time URL N: seconds of N 128-token requests, the median
  for _ in $(seq "$2"); do
    curl -sf -o /dev/null -w '%{time_total}\n' --max-time 300 "${auth[@]}" "$1/v1/chat/completions" \
      -H 'content-type: application/json' \
      -d '{"model": "smollm2-135m-instruct", "messages": [{"role":"user","content":"Who is the current US president?"}],
           "max_tokens":128, "temperature":0, "ignore_eos":true}'
  done | sort -n | awk '{t[NR]=$1} END {print t[int((NR+1)/2)]}'
}

started=$(date +%s)
docker compose up --build -d --wait --wait-timeout 1800
echo "stack healthy in $(( $(date +%s) - started )) s"
docker compose logs internal-token 2>&1 | grep -o "internal token: .*"
first=$(ask "$URL")
echo "answer ($(field "$first" 'a["usage"]["completion_tokens"]') tokens): $(field "$first" 'a["choices"][0]["message"]["content"]')"

# 2. Without the token the verifier answers nothing but its health check.
docker compose exec -T gateway python3 -c '
import grpc
from specdec.v1 import specdec_pb2 as pb, specdec_pb2_grpc as rpc
try:
    rpc.VerifierStub(grpc.insecure_channel("verifier:50051")).GetInfo(pb.GetVerifierInfoRequest(), timeout=10)
except grpc.RpcError as error:
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error.code()
    print("verifier without the internal token:", error.code().name)
else:
    raise SystemExit("the verifier answered a call without the internal token")'

# 3. The same kernels and the same greedy answer as a native start.
container_path=$(kernel_path "$(docker compose logs verifier 2>&1)")
echo "container verifier: $container_path"
if [ "${SKIP_NATIVE:-0}" != 1 ]; then
  python3 -m specdec serve --port "$NATIVE_PORT" --max-model-len 4096 --enforce-eager \
    --speculative-config "$SPEC" >"$work/native.log" 2>&1 &
  native_pid=$!
  for _ in $(seq 600); do
    curl -sf "$NATIVE_URL/health" >/dev/null 2>&1 && break
    kill -0 "$native_pid" 2>/dev/null || { cat "$work/native.log" >&2; echo "native start failed" >&2; exit 1; }
    sleep 1
  done
  native_path=$(kernel_path "$(cat "$work/native.log")")
  echo "native verifier:    $native_path"
  [ "$container_path" = "$native_path" ] || { echo "the container runs another kernel path" >&2; exit 1; }
  native=$(ask "$NATIVE_URL")
  native_text=$(field "$native" 'a["choices"][0]["message"]["content"]')
  [ "$native_text" = "$(field "$first" 'a["choices"][0]["message"]["content"]')" ] || {
    echo "greedy answers differ: native ($(field "$native" 'a["usage"]["completion_tokens"]') tokens): $native_text" >&2
    exit 1
  }
  echo "greedy answer: identical in the container and natively"
  # Alternating, so that load from elsewhere on the machine weighs on both alike.
  for _ in 1 2 3; do
    median_time "$URL" 1 >>"$work/container.times"
    median_time "$NATIVE_URL" 1 >>"$work/native.times"
  done
  echo "128-token request, median of 3 (s): container $(sort -n "$work/container.times" | sed -n 2p)," \
       "native $(sort -n "$work/native.times" | sed -n 2p)"
  kill "$native_pid"; wait "$native_pid" 2>/dev/null || true; native_pid=""
fi

# 4. Three drafters.
docker compose up -d --wait --wait-timeout 300 --scale drafter=3
for _ in $(seq 60); do
  connected=$(docker compose logs verifier 2>&1 | grep -c "connected: method=" || true)
  [ "$connected" -ge 3 ] && break
  sleep 1
done
echo "verifier connections to drafter replicas: $connected"
[ "$connected" -ge 3 ] || { echo "the verifier did not connect to 3 drafters" >&2; exit 1; }

pids=()
for i in $(seq 6); do ask "$URL" > "$work/answer-$i.json" & pids+=($!); done
for pid in "${pids[@]}"; do wait "$pid"; done
for i in $(seq 6); do
  python3 -c 'import json,sys; a=json.load(open(sys.argv[1])); assert a["choices"][0]["message"]["content"] == json.loads(sys.argv[2])["choices"][0]["message"]["content"]' \
    "$work/answer-$i.json" "$first"
done
echo "6 concurrent answers with 3 drafters: identical to the first (greedy)"
docker compose logs 2>&1 | grep -E " (ERROR|CRITICAL) " && { echo "errors in the logs" >&2; exit 1; }
echo "compose smoke test passed"
