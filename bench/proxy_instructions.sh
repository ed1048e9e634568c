#!/usr/bin/env bash
# Instructions per proxied request: `backstop serve` (release, bench policy) under callgrind,
# a fixed number of keep-alive GETs through it, and the instruction count divided by them.
# Instruction counts hold still on a shared VM where wall-clock figures do not.
#
#   bench/proxy_instructions.sh [BACKSTOP_BINARY]   # default: $CARGO_TARGET_DIR/release/backstop
#   bench/proxy_instructions.sh --cpu [BACKSTOP_BINARY]
#
# With --cpu, backstop runs natively instead and `wrk -t1 -c32` loads it for BENCH_SECONDS
# [8] after a 2-s warm-up; the user and system CPU time of each thread (/proc/PID/task/*/stat)
# is divided by the requests wrk counted: µs of CPU per request, a figure that moves less with
# the neighbours' load than throughput does (needs wrk).
#
# Environment knobs (defaults in brackets):
#   BENCH_REQUESTS [3000]   measured requests (`ab -k -c BENCH_CONNECTIONS -n N`)
#   BENCH_WARMUP [500]      requests sent before the counters are zeroed
#   BENCH_CONNECTIONS [8]   keep-alive connections
#   BENCH_KEEP [unset]      a directory to keep the callgrind output in
#   BENCH_TASK [unset]      a task id sent as `X-Backstop-Task` on every request (as the
#                           half-rate runs of bench/proxy.sh do); unset, each request opens a
#                           task of its own
#
# Prints the instructions per request over all threads, and split into the tokio workers
# (door, engine, upstream client), the store writer thread and everything else (watchdog,
# blocking pool). Needs valgrind and ab (Debian's apache2-utils); the upstream is the bench
# binary of crates/gateway/benches/upstream.rs, built by `bench/proxy.sh` or
# `cargo build --profile bench -p backstop-gateway --bench upstream`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
CPU=0
if [ "${1:-}" = --cpu ]; then
    CPU=1
    shift
fi
BACKSTOP="${1:-$TARGET_DIR/release/backstop}"
REQUESTS="${BENCH_REQUESTS:-3000}"
WARMUP="${BENCH_WARMUP:-500}"
CONNECTIONS="${BENCH_CONNECTIONS:-8}"
TASK_HEADER=()
[ -n "${BENCH_TASK:-}" ] && TASK_HEADER=(-H "X-Backstop-Task: $BENCH_TASK")

die() { printf 'proxy_instructions.sh: %s\n' "$*" >&2; exit 1; }
if [ "$CPU" = 1 ]; then
    command -v wrk >/dev/null || die "needs wrk (apt-get install wrk)"
else
    command -v valgrind >/dev/null || die "needs valgrind (apt-get install valgrind)"
    command -v callgrind_control >/dev/null || die "needs callgrind_control (valgrind)"
    command -v ab >/dev/null || die "needs ab (apt-get install apache2-utils)"
fi
[ -x "$BACKSTOP" ] || die "no backstop binary at $BACKSTOP"
UPSTREAM_BIN="$(ls -t "$TARGET_DIR"/release/deps/upstream-* 2>/dev/null | grep -v '\.d$' | head -n1)"
[ -x "$UPSTREAM_BIN" ] || die "no upstream bench binary under $TARGET_DIR/release/deps"

WORK="$(mktemp -d /tmp/backstop-instructions.XXXXXX)"
PIDS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    if [ -n "${BENCH_KEEP:-}" ]; then mkdir -p "$BENCH_KEEP" && cp "$WORK"/callgrind.out* "$BENCH_KEEP"/ 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A port the kernel has just handed out and released.
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
# Waits until something answers HTTP on the port (valgrind makes backstop slow to start).
wait_answering() { # port name
    local i
    for i in $(seq 1 1200); do
        curl -s -o /dev/null "http://127.0.0.1:$1/" && return 0
        sleep 0.05
    done
    die "$2 did not answer on port $1 (logs in $WORK)"
}

# The fast upstream on its own port, one runtime thread, as in bench/proxy.sh.
UP_PORT="$(free_port)"
{ "$UPSTREAM_BIN" --listen "127.0.0.1:$UP_PORT" --threads 1 >"$WORK/upstream.log" 2>&1 & } && PIDS+=($!)
wait_answering "$UP_PORT" upstream

PORT="$(free_port)"
TOKEN="bench-agent-token-$RANDOM$RANDOM"
sed "s/@UPSTREAM@/127.0.0.1:$UP_PORT/" "$ROOT/bench/backstop-bench.yaml" >"$WORK/backstop.yaml"
PROFILER=(valgrind --tool=callgrind --separate-threads=yes --dump-instr=no
    --callgrind-out-file="$WORK/callgrind.out")
[ "$CPU" = 1 ] && PROFILER=()
BENCH_AGENT_TOKEN="$TOKEN" BENCH_PROVIDER_KEY="bench-provider-key" \
    "${PROFILER[@]}" "$BACKSTOP" serve --config "$WORK/backstop.yaml" --listen "127.0.0.1:$PORT" \
    --store "$WORK/backstop.db" >"$WORK/backstop.log" 2>&1 &
VG=$!
PIDS+=($VG)
wait_answering "$PORT" backstop
URL="http://127.0.0.1:$PORT/fast/v1/fast"
code="$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $TOKEN" "$URL")"
[ "$code" = 200 ] || die "backstop answered $code at $URL (logs in $WORK)"

if [ "$CPU" = 1 ]; then
    # Per thread: class, utime, stime (clock ticks). The runtime's workers and its blocking
    # pool (the watchdog's reads) share one thread name; the first two by id are taken for the
    # workers, which is not always right: their sum, `tokio threads`, is.
    threads() {
        local tid comm workers=0
        for tid in $(ls "/proc/$VG/task" | sort -n); do
            comm="$(tr ' ' _ <"/proc/$VG/task/$tid/comm")"
            if [ "$comm" = tokio-rt-worker ]; then
                workers=$((workers + 1))
                [ "$workers" -le 2 ] && comm=tokio-workers || comm=blocking-pool
            fi
            echo "$comm $(awk '{print $14, $15}' "/proc/$VG/task/$tid/stat")"
        done
    }
    wrk -t1 -c32 -d2s -H "Authorization: Bearer $TOKEN" "${TASK_HEADER[@]}" "$URL" >/dev/null
    threads >"$WORK/before"
    wrk -t1 -c32 -d"${BENCH_SECONDS:-8}s" -H "Authorization: Bearer $TOKEN" "${TASK_HEADER[@]}" \
        "$URL" >"$WORK/wrk.txt"
    threads >"$WORK/after"
    python3 - "$WORK" "$(getconf CLK_TCK)" <<'PY'
import re, sys
work, tick = sys.argv[1], float(sys.argv[2])
text = open(f"{work}/wrk.txt").read()
n = int(re.search(r"(\d+) requests in", text).group(1))
rate = re.search(r"Requests/sec:\s*([\d.]+)", text).group(1)
def load(name):
    sums = {}
    for line in open(f"{work}/{name}"):
        role, user, system = line.split()
        u, s = sums.get(role, (0, 0))
        sums[role] = (u + int(user), s + int(system))
    return sums
before, after = load("before"), load("after")
print(f"{n} requests, {rate} req/s: µs of CPU per request, user + system")
total_u = total_s = 0.0
for role in sorted(after):
    u = (after[role][0] - before.get(role, (0, 0))[0]) / tick / n * 1e6
    s = (after[role][1] - before.get(role, (0, 0))[1]) / tick / n * 1e6
    total_u, total_s = total_u + u, total_s + s
    if u + s > 0:
        print(f"  {role:16s} {u:6.1f} + {s:6.1f}")
tokio = [r for r in ("tokio-workers", "blocking-pool") if r in after]
tokio_u = sum((after[r][0] - before.get(r, (0, 0))[0]) / tick / n * 1e6 for r in tokio)
tokio_s = sum((after[r][1] - before.get(r, (0, 0))[1]) / tick / n * 1e6 for r in tokio)
print(f"  {'tokio threads':16s} {tokio_u:6.1f} + {tokio_s:6.1f}")
print(f"  {'whole process':16s} {total_u:6.1f} + {total_s:6.1f}")
PY
    exit 0
fi

ab -q -k -c "$CONNECTIONS" -n "$WARMUP" -H "Authorization: Bearer $TOKEN" "${TASK_HEADER[@]}" \
    "$URL" >"$WORK/warmup.txt" 2>&1
sleep 2
callgrind_control -z "$VG" >/dev/null 2>&1
ab -k -c "$CONNECTIONS" -n "$REQUESTS" -H "Authorization: Bearer $TOKEN" "${TASK_HEADER[@]}" \
    "$URL" >"$WORK/ab.txt" 2>&1
# Let the store writer commit what the measured requests queued.
sleep 3
callgrind_control -d "$VG" >/dev/null 2>&1
sleep 1
failed="$(awk '/^Failed requests:/ {print $3}' "$WORK/ab.txt")"
non2xx="$(awk '/^Non-2xx responses:/ {print $3}' "$WORK/ab.txt")"
complete="$(awk '/^Complete requests:/ {print $3}' "$WORK/ab.txt")"
[ "$complete" = "$REQUESTS" ] || die "ab completed ${complete:-none} of $REQUESTS (see $WORK/ab.txt)"
[ "${failed:-0}" = 0 ] && [ -z "$non2xx" ] || die "ab saw $failed failed, ${non2xx:-0} non-2xx responses"

# One file per thread after the zeroing dump: sum their totals by the thread's role.
python3 - "$WORK" "$REQUESTS" <<'PY'
import glob, os, re, sys
work, n = sys.argv[1], int(sys.argv[2])
groups = {}
# The dump after the zeroing is part 1: one file per thread (`callgrind.out.1-TT`).
for path in sorted(glob.glob(os.path.join(work, "callgrind.out.1-*"))):
    text = open(path, errors="replace").read()
    m = re.search(r"^totals: (\d+)", text, re.M)
    if not m:
        continue
    # A thread's role, told by what ran in it.
    if "multi_thread::worker::run" in text:
        role = "tokio workers"
    elif "writer_loop" in text:
        role = "store writer"
    else:
        role = "other"
    groups[role] = groups.get(role, 0) + int(m.group(1))
total = sum(groups.values())
print(f"{n} requests: {total / n:,.0f} instructions per request (all threads)")
for role in ("tokio workers", "store writer", "other"):
    if role in groups:
        print(f"  {role:14s} {groups[role] / n:12,.0f}")
PY
