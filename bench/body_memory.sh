#!/usr/bin/env bash
# Peak resident memory of `backstop serve` under concurrent large uploads, with and without the
# cap on buffered request bodies (`--buffered-body-bytes`).
#
#   bench/body_memory.sh [BACKSTOP_BINARY]   # default: $CARGO_TARGET_DIR/release/backstop
#
# Starts the bundled fake provider (`backstop fake-api`, a POST route that holds its answers
# 3 s) and, for each cap below, a fresh `backstop serve` in front of it; sends BENCH_UPLOADS
# concurrent uploads of BENCH_MIB MiB each (curl, one connection each) and prints the serve
# process's start and peak resident memory (VmRSS, VmHWM) and the answers' statuses. The fake
# keeps bodies up to 1 MiB only, so it answers most uploads 413 or drops them; backstop has
# buffered each body whole by then, which is what is measured.
#
# Environment knobs (defaults in brackets): BENCH_UPLOADS [20], BENCH_MIB [30],
# BENCH_CAPS ["17179869184 268435456 67108864"] (16 GiB stands for no cap).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
BACKSTOP="${1:-$TARGET_DIR/release/backstop}"
UPLOADS="${BENCH_UPLOADS:-20}"
MIB="${BENCH_MIB:-30}"
CAPS="${BENCH_CAPS:-17179869184 268435456 67108864}"
WORK="$(mktemp -d)"
trap 'kill "${FAKE:-}" 2>/dev/null || true; rm -rf "$WORK"' EXIT

cat > "$WORK/fake.yaml" <<'YAML'
routes:
  - route: POST /v1/uploads
    faults:
      - { probability: 1.0, fault: { kind: slow, hold_ms: 3000 } }
YAML
cat > "$WORK/gw.yaml" <<'YAML'
listen: 127.0.0.1:18480
agents:
  a: { token_env: BM_TOKEN }
providers:
  fake:
    base_url: http://127.0.0.1:18481
    credential: { secret_env: FAKE_API_KEY }
    idempotency_header: Idempotency-Key
    scopes:
      account: { limit: 1000, window_seconds: 60 }
    routes:
      "POST /v1/uploads": { class: idempotent_write, scopes: [account] }
YAML
head -c $((MIB * 1024 * 1024)) /dev/urandom > "$WORK/body.bin"
"$BACKSTOP" fake-api --config "$WORK/fake.yaml" --listen 127.0.0.1:18481 > "$WORK/fake.log" 2>&1 &
FAKE=$!
sleep 1
export BM_TOKEN=bm-token FAKE_API_KEY=k
for cap in $CAPS; do
  rm -f "$WORK"/bm.db*
  "$BACKSTOP" serve --config "$WORK/gw.yaml" --store "$WORK/bm.db" \
    --max-body-bytes $((32 * 1024 * 1024)) --buffered-body-bytes "$cap" > "$WORK/serve.log" 2>&1 &
  serve=$!
  sleep 1.5
  start=$(awk '/VmRSS/ {print $2}' /proc/$serve/status)
  curls=()
  for i in $(seq 1 "$UPLOADS"); do
    curl -s -o /dev/null -w "%{http_code}\n" -H "Authorization: Bearer bm-token" \
      -H "Idempotency-Key: k-$cap-$i" --data-binary @"$WORK/body.bin" \
      http://127.0.0.1:18480/fake/v1/uploads >> "$WORK/statuses-$cap" &
    curls+=($!)
  done
  wait "${curls[@]}"
  sleep 0.5
  peak=$(awk '/VmHWM/ {print $2}' /proc/$serve/status)
  statuses=$(sort "$WORK/statuses-$cap" | uniq -c | awk '{printf "%s×%s ", $1, $2}')
  echo "--buffered-body-bytes $cap: VmRSS at start $((start / 1024)) MiB, peak $((peak / 1024)) MiB; answers: $statuses"
  kill -TERM "$serve"
  wait "$serve" || true
done
