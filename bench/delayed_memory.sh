#!/usr/bin/env bash
# Resident memory per delayed action in the whole `backstop serve` process, not only in its
# scheduler (which `cargo bench -p backstop-gateway --bench scheduler_scale` measures alone).
#
#   bench/delayed_memory.sh [BACKSTOP_BINARY ...]   # default: $CARGO_TARGET_DIR/release/backstop
#
# For each binary, in a fresh process: a policy whose one scope is paced at 20 requests/s, so
# actions submitted at once are held by the scheduler, spaced 0.05 s apart, for up to an hour.
# Reads are submitted with `Prefer: respond-async` (each answered 202 at once, the action going
# on in the background, as an agent that does not wait on the call would use it): a warm-up,
# then BENCH_FILL actions, then BENCH_ACTIONS more. After each batch, `GET /v1/scopes` tells how
# many are delayed and /proc/PID/status the anonymous resident memory (RssAnon). The fill is
# large enough that the store writer's page cache (64 MiB, which the actions' rows fill and no
# more) is full before the second batch, so the second batch's growth divided by the actions it
# added is what one more delayed action holds: its engine task (the action's future), its
# scheduler entry and its slot for the completion. The first batch's figure includes the cache.
#
# Environment knobs (defaults in brackets):
#   BENCH_FILL [40000]     actions of the first batch
#   BENCH_ACTIONS [20000]  actions of the second, measured batch (the last of all waits
#                          (BENCH_FILL + BENCH_ACTIONS) / 20 s: keep it under an hour)
#   BENCH_WARMUP [500]     actions submitted before the first reading
#
# Needs oha (BENCH_OHA, else `oha` on PATH, else installed once from crates.io as
# `bench/proxy.sh` does), curl, python3 and the upstream bench binary
# (`cargo build --profile bench -p backstop-gateway --bench upstream`).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
ACTIONS="${BENCH_ACTIONS:-20000}"
FILL="${BENCH_FILL:-40000}"
WARMUP="${BENCH_WARMUP:-500}"
[ "$#" -gt 0 ] || set -- "$TARGET_DIR/release/backstop"

die() { printf 'delayed_memory.sh: %s\n' "$*" >&2; exit 1; }
# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"
OHA="$(find_oha "$TARGET_DIR")"
UPSTREAM_BIN="$(ls -t "$TARGET_DIR"/release/deps/upstream-* 2>/dev/null | grep -v '\.d$' | head -n1)"
[ -x "$UPSTREAM_BIN" ] || die "no upstream bench binary under $TARGET_DIR/release/deps"
command -v python3 >/dev/null || die "needs python3"
command -v curl >/dev/null || die "needs curl"

WORK="$(mktemp -d /tmp/backstop-delayed-memory.XXXXXX)"
PIDS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT

rss_kib() { awk '/^RssAnon:/ {print $2}' "/proc/$1/status"; }

UP_PORT="$(free_port)"
"$UPSTREAM_BIN" --listen "127.0.0.1:$UP_PORT" --threads 1 >"$WORK/upstream.log" 2>&1 &
PIDS+=($!)
wait_listening "$UP_PORT" upstream

TOKEN="bench-agent-token-$RANDOM$RANDOM"
cat >"$WORK/backstop.yaml" <<EOF
# One scope paced at 20 requests/s (1,200 a minute, no headroom kept back): actions submitted
# at once wait their turn in the scheduler, 0.05 s apart, up to the hour a read may wait.
request_classes:
  read:             { max_attempts: 4, max_wait_seconds: 3600, retry_statuses: [429, 503] }
  idempotent_write: { max_attempts: 3, max_wait_seconds: 120, retry_statuses: [429, 503] }
  uncertain_write:  { max_attempts: 1, max_wait_seconds: 0, retry_statuses: [] }
shared_scope:
  max_delayed_requests: 1000000
  max_concurrent_requests: 1000000
agents:
  bench-agent: { token_env: BENCH_AGENT_TOKEN }
providers:
  fast:
    base_url: http://127.0.0.1:$UP_PORT
    credential: { secret_env: BENCH_PROVIDER_KEY }
    dialect: generic
    scopes:
      account: { limit: 1200, window_seconds: 60, headroom: 1.0 }
    routes:
      "GET /v1/fast": { class: read, scopes: [account] }
EOF

printf '%-40s %10s %12s %12s %12s %12s\n' binary "fill: held" "KiB growth" "B/action" "then held" "B/action"
for bin in "$@"; do
    [ -x "$bin" ] || die "no backstop binary at $bin"
    port="$(free_port)"
    rm -f "$WORK"/b.db*
    BENCH_AGENT_TOKEN="$TOKEN" BENCH_PROVIDER_KEY="bench-provider-key" \
        "$bin" serve --config "$WORK/backstop.yaml" --listen "127.0.0.1:$port" \
        --store "$WORK/b.db" >"$WORK/backstop.log" 2>&1 &
    pid=$!
    PIDS+=("$pid")
    wait_listening "$port" "backstop ($bin)"
    url="http://127.0.0.1:$port/fast/v1/fast"
    submit() { # N
        "$OHA" --no-tui -n "$1" -c 16 -H "Authorization: Bearer $TOKEN" \
            -H "X-Backstop-Task: delayed-memory" -H "Prefer: respond-async" "$url" \
            >"$WORK/oha.txt" 2>&1 || die "oha failed: $(tail -n 5 "$WORK/oha.txt")"
        grep -q '\[202\]' "$WORK/oha.txt" || die "no 202 answers: $(grep -A3 'Status code' "$WORK/oha.txt")"
    }
    delayed() {
        curl -s -H "Authorization: Bearer $TOKEN" "http://127.0.0.1:$port/v1/scopes" |
            python3 -c 'import json, sys; print(sum(s.get("delayed", 0) for s in json.load(sys.stdin)))'
    }
    submit "$WARMUP"
    sleep 1
    d0="$(delayed)"
    k0="$(rss_kib "$pid")"
    submit "$FILL"
    sleep 2
    d1="$(delayed)"
    k1="$(rss_kib "$pid")"
    submit "$ACTIONS"
    sleep 2
    d2="$(delayed)"
    k2="$(rss_kib "$pid")"
    [ $((d1 - d0)) -gt 0 ] && [ $((d2 - d1)) -gt 0 ] ||
        die "actions were not delayed (delayed: $d0, $d1, $d2); log: $(tail -n 5 "$WORK/backstop.log")"
    printf '%-40s %10d %12d %12d %12d %12d\n' "$bin" $((d1 - d0)) $((k1 - k0)) \
        $(((k1 - k0) * 1024 / (d1 - d0))) $((d2 - d1)) $(((k2 - k1) * 1024 / (d2 - d1)))
    kill "$pid"
    wait "$pid" 2>/dev/null || true
done
