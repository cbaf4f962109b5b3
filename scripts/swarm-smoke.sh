#!/usr/bin/env bash
# Runs the stack on Docker Swarm for real and disturbs it under load (not part of CI: it needs
# a Docker engine; docs/deployment.md says how to get one, also with no container registry):
#  1. joins a single-node swarm (`docker swarm init --advertise-addr 127.0.0.1`) unless this
#     engine is in one, creates the secrets, deploys deploy/swarm/docker-stack.yml as the stack
#     `specdec` and answers the README's chat request;
#  2. records each prompt's greedy answer undisturbed, then starts a background load of greedy
#     requests (scripts/swarm-load.py; WORKERS threads, MAX_TOKENS tokens, PAUSE_S apart, at
#     most MAX_REQUESTS requests: the script fails if they run out before the last change);
#  3. under that load: scales the drafter 1 -> 3 -> 1, rolls it to a new image tag, kills its
#     task's container with `docker kill`, and force-updates verifier-0 while verifier-1 serves;
#     prints the seconds each change took to settle (swarm's tasks running and healthy, and
#     both verifiers connected to the new drafter replicas / the gateway serving both);
#  4. reports the failed requests (none allowed, except streams cut by the stopped verifier,
#     which must end with an error event) and that every greedy answer equals the undisturbed
#     one; removes the stack, its secrets and the extra tag, and leaves the swarm it joined.
# Needs the image (SPECDEC_IMAGE, default specdec:latest; BUILD=1 builds it with
# `docker compose build` first, see scripts/compose-smoke.sh for the torch wheel).
# SPECDEC_MODEL_CACHE_VOLUME names an existing model-cache volume to reuse (e.g. compose's).
# LOGS_DIR=DIR keeps every service's log there. TLS=1 also deploys
# deploy/swarm/docker-stack.tls.yml, with a CA and a certificate made here (openssl) as its
# secrets: every gRPC link is then mutual TLS.
set -euo pipefail
cd "$(dirname "$0")/.."
STACK=specdec
URL=http://127.0.0.1:18080
export SPECDEC_IMAGE=${SPECDEC_IMAGE:-specdec:latest}
# 1 GiB of KV cache per verifier: three verifiers run at once during the rolling restart.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# One torch thread per verifier: two verifiers share this machine's cores, and more threads
# than cores between them stall both.
export VERIFIER_THREADS=${VERIFIER_THREADS:-1}
export WORKERS=${WORKERS:-4} MAX_TOKENS=${MAX_TOKENS:-12} MAX_REQUESTS=${MAX_REQUESTS:-1500} PAUSE_S=${PAUSE_S:-0.5}
ROLL_TAG=${SPECDEC_IMAGE%:*}:swarm-smoke-roll
SETTLE_TIMEOUT_S=${SETTLE_TIMEOUT_S:-300}

work=$(mktemp -d)
chmod 700 "$work"
joined=0
created_secrets=()
load_pid=""
cleanup() {
  [ -n "$load_pid" ] && { touch "$work/stop"; wait "$load_pid" 2>/dev/null || true; }
  if [ -n "${LOGS_DIR:-}" ]; then  # every service's log, kept for a look after the stack is gone
    mkdir -p "$LOGS_DIR"
    for service in gateway verifier-0 verifier-1 drafter; do
      docker service logs "${STACK}_$service" >"$LOGS_DIR/$service.log" 2>&1 || true
    done
  fi
  docker stack rm "$STACK" >/dev/null 2>&1 || true
  # Secrets and the network go once the stack's tasks are gone.
  for _ in $(seq 60); do
    [ -z "$(docker ps -q --filter "label=com.docker.stack.namespace=$STACK")" ] && break
    sleep 1
  done
  docker stack rm "$STACK" >/dev/null 2>&1 || true  # the network, now that no task uses it
  for secret in "${created_secrets[@]}"; do docker secret rm "$secret" >/dev/null 2>&1 || true; done
  docker image rm "$ROLL_TAG" >/dev/null 2>&1 || true
  [ "$joined" = 1 ] && docker swarm leave --force >/dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 143' INT TERM  # through the EXIT trap: the stack never outlives the script

if [ "${BUILD:-0}" = 1 ]; then docker compose build; fi
docker image inspect "$SPECDEC_IMAGE" >/dev/null || { echo "no image $SPECDEC_IMAGE (BUILD=1 builds it)" >&2; exit 1; }
if [ "$(docker info --format '{{.Swarm.LocalNodeState}}')" != active ]; then
  docker swarm init --advertise-addr 127.0.0.1 >/dev/null
  joined=1
fi
docker stack ls --format '{{.Name}}' | grep -qx "$STACK" && { echo "a stack $STACK runs already" >&2; exit 1; }

# Secrets: new random ones, unless the caller's exist (then SPECDEC_API_KEY must be its key).
python3 -c 'import secrets; print(secrets.token_urlsafe(32), end="")' >"$work/internal_token"
python3 -c 'import secrets; print(secrets.token_urlsafe(24), end="")' >"$work/api_key"
names=(specdec_internal_token specdec_api_key)
stack_files=(-c deploy/swarm/docker-stack.yml)
if [ "${TLS:-0}" = 1 ]; then
  # One CA; one certificate for every service, server and client, named specdec.internal.
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=specdec-smoke-ca \
    -keyout "$work/ca.key" -out "$work/tls_ca" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj /CN=specdec.internal -keyout "$work/tls_key" \
    -out "$work/tls.csr" 2>/dev/null
  printf 'subjectAltName=DNS:specdec.internal\nextendedKeyUsage=serverAuth,clientAuth\n' >"$work/ext"
  openssl x509 -req -in "$work/tls.csr" -CA "$work/tls_ca" -CAkey "$work/ca.key" -CAcreateserial \
    -days 2 -extfile "$work/ext" -out "$work/tls_cert" 2>/dev/null
  names+=(specdec_tls_ca specdec_tls_cert specdec_tls_key)
  stack_files+=(-c deploy/swarm/docker-stack.tls.yml)
fi
for name in "${names[@]}"; do
  if docker secret inspect "$name" >/dev/null 2>&1; then
    [ "$name" = specdec_api_key ] && [ -z "${SPECDEC_API_KEY:-}" ] && {
      echo "the secret specdec_api_key exists: set SPECDEC_API_KEY to its value, or remove it" >&2; exit 1; }
  else
    docker secret create "$name" "$work/${name#specdec_}" >/dev/null
    created_secrets+=("$name")
  fi
done
export SPECDEC_API_KEY=${SPECDEC_API_KEY:-$(cat "$work/api_key")}

# --- helpers -------------------------------------------------------------------------------
now() { date +%s.%N; }
elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }
# Tasks of SERVICE that should run and do (healthy: swarm reports Running only after the
# health check passes), optionally only those on IMAGE.
running_tasks() {
  docker service ps "${STACK}_$1" --filter desired-state=running --format '{{.Image}} {{.CurrentState}}' \
    | grep -c "^${2:-}[^ ]* Running" || true
}
all_tasks() { docker service ps "${STACK}_$1" --filter desired-state=running -q | wc -l; }
# Lines matching PATTERN in SERVICE's logs since the RFC 3339 time SINCE.
log_count() { docker service logs --since "$2" "${STACK}_$1" 2>&1 | grep -c "$3" || true; }
# wait_until DESCRIPTION COMMAND...: polls COMMAND once a second, fails after SETTLE_TIMEOUT_S.
wait_until() {
  local what=$1; shift
  for _ in $(seq "$SETTLE_TIMEOUT_S"); do "$@" && return 0; sleep 1; done
  echo "timed out waiting for: $what" >&2; exit 1
}
drafters_settled() {  # drafters_settled N [IMAGE]: N tasks, all running (on IMAGE)
  [ "$(all_tasks drafter)" -eq "$1" ] && [ "$(running_tasks drafter "${2:-}")" -eq "$1" ]
}
verifiers_saw() {  # verifiers_saw SINCE PATTERN N: each verifier logged PATTERN N times since SINCE
  local v
  for v in verifier-0 verifier-1; do [ "$(log_count "$v" "$1" "$2")" -ge "$3" ] || return 1; done
}
gateway_serves_both() {
  curl -sf "$URL/health" | grep -q '"verifier-0":"serving","verifier-1":"serving"'
}
update_done() {  # the service's last update completed (not paused, not rolled back)
  local state
  state=$(docker service inspect -f '{{if .UpdateStatus}}{{.UpdateStatus.State}}{{end}}' "${STACK}_$1")
  case "$state" in
    completed|"") return 0 ;;
    rollback_*|paused) echo "update of $1 ended $state" >&2; exit 1 ;;
    *) return 1 ;;
  esac
}
settled=()
# report_settle NAME START: prints and records the seconds since START (and the window, for
# the load report's requests per change).
report_settle() {
  local seconds
  seconds=$(elapsed "$2")
  settled+=("$1: $seconds s"); echo "$1: settled in $seconds s"
  echo "$2 $(now) $1" >>"$work/phases"
}

# --- 1. deploy -----------------------------------------------------------------------------
started=$(now)
docker stack deploy --resolve-image never --detach=true "${stack_files[@]}" "$STACK" >/dev/null
wait_until "the gateway serving both verifiers" gateway_serves_both
report_settle "deploy (all services healthy, gateway serving both verifiers)" "$started"
: >"$work/phases"  # the load's windows only
first=$(curl -sf --max-time 300 -H "authorization: Bearer $SPECDEC_API_KEY" "$URL/v1/chat/completions" \
  -H 'content-type: application/json' \
  -d '{"model": "smollm2-135m-instruct", "messages": [{"role":"user","content":"Who is the current US president?"}],
       "max_tokens":128, "top_k":-1, "top_p":0.1, "temperature":0, "stream":false, "repetition_penalty":1.0}')
python3 -c 'import json,sys; a=json.loads(sys.argv[1]); print("answer (%d tokens): %s" % (a["usage"]["completion_tokens"], a["choices"][0]["message"]["content"]))' "$first"
code=$(curl -s -o /dev/null -w '%{http_code}' "$URL/v1/models")
[ "$code" = 401 ] || { echo "the gateway answered /v1/models without the API key: $code" >&2; exit 1; }
echo "without the API key: HTTP $code"

# --- 2. baseline, then the load --------------------------------------------------------------
python3 scripts/swarm-load.py baseline "$URL" "$work/baseline.json"
python3 scripts/swarm-load.py load "$URL" "$work/load.jsonl" "$work/stop" &
load_pid=$!
sleep 5

# --- 3. changes under load -------------------------------------------------------------------
since=$(date -u +%Y-%m-%dT%H:%M:%SZ); started=$(now)
docker service scale --detach=true "${STACK}_drafter=3" >/dev/null
wait_until "3 drafters" drafters_settled 3
wait_until "both verifiers connected to 2 new drafters" verifiers_saw "$since" "connected: method=" 2
report_settle "drafter 1 -> 3 (tasks healthy, both verifiers connected)" "$started"

since=$(date -u +%Y-%m-%dT%H:%M:%SZ); started=$(now)
docker service scale --detach=true "${STACK}_drafter=1" >/dev/null
wait_until "1 drafter" drafters_settled 1
wait_until "both verifiers dropped 2 drafters" verifiers_saw "$since" "is gone from DNS" 2
report_settle "drafter 3 -> 1 (tasks stopped, both verifiers dropped them)" "$started"

docker tag "$SPECDEC_IMAGE" "$ROLL_TAG"
since=$(date -u +%Y-%m-%dT%H:%M:%SZ); started=$(now)
docker service update --detach=true --no-resolve-image --image "$ROLL_TAG" "${STACK}_drafter" >/dev/null
wait_until "the drafter on $ROLL_TAG" drafters_settled 1 "$ROLL_TAG"
wait_until "both verifiers connected to the new drafter" verifiers_saw "$since" "connected: method=" 1
report_settle "drafter rolled to $ROLL_TAG (new task healthy, both verifiers connected)" "$started"
wait_until "the drafter update completed" update_done drafter

container=$(docker ps -q --filter "label=com.docker.swarm.service.name=${STACK}_drafter" | head -n1)
since=$(date -u +%Y-%m-%dT%H:%M:%SZ); started=$(now)
docker kill "$container" >/dev/null
sleep 2
wait_until "a new drafter task" drafters_settled 1
wait_until "both verifiers connected to the replacement" verifiers_saw "$since" "connected: method=" 1
report_settle "drafter task killed (replacement healthy, both verifiers connected)" "$started"

since=$(date -u +%Y-%m-%dT%H:%M:%SZ); started=$(now)
docker service update --detach=true --force "${STACK}_verifier-0" >/dev/null
sleep 2
wait_until "the verifier-0 update completed" update_done verifier-0
wait_until "the gateway serving both verifiers again" gateway_serves_both
report_settle "verifier-0 restarted (new task healthy, old one drained, gateway serving both)" "$started"
sleep 5
kill -0 "$load_pid" 2>/dev/null || { echo "the load ended before the last change: raise MAX_REQUESTS" >&2; exit 1; }

# --- 4. the verdict --------------------------------------------------------------------------
touch "$work/stop"; wait "$load_pid"; load_pid=""
echo "--- settle times"
printf '  %s\n' "${settled[@]}"
echo "--- errors logged by the services (a killed drafter and a restarted verifier log some)"
for service in gateway verifier-0 verifier-1 drafter; do docker service logs "${STACK}_$service" 2>&1; done \
  | grep -E " (ERROR|CRITICAL) " | cut -c1-300 | head -n 10 || echo "  none"
if python3 scripts/swarm-load.py report "$work/baseline.json" "$work/load.jsonl" "$work/phases"; then
  echo "swarm smoke test passed"
else
  echo "swarm smoke test FAILED" >&2
  exit 1
fi
