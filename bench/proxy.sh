#!/usr/bin/env bash
# Gateway overhead, side by side: the same fast upstream reached directly, through nginx as a
# plain reverse proxy, and through `backstop serve` (release build, realistic policy, audit on).
#
#   bench/proxy.sh            # from the repository root (builds, installs wrk and nginx if missing)
#
# Environment knobs (defaults in brackets):
#   BENCH_SECONDS [8]       length of each measured wrk run
#   (paths: direct, nginx and backstop GET the fast route; complete POSTs an LLM completion
#   through backstop (side_effect none), write a durable write (committed before its send))
#   BENCH_ROUNDS [3]        how many times the alternation direct, nginx, backstop is repeated
#   BENCH_CONNECTIONS [32]  wrk connections of the saturation runs
#   BENCH_PATHS [direct nginx backstop complete write]  the paths measured, in this order of
#                           alternation (direct, nginx and backstop are always needed): e.g.
#                           "direct nginx backstop complete" leaves the durable writes' store
#                           work out of the rounds
#   BENCH_PROFILE_DIR [unset]  a directory: after the measured runs, each backstop path is run
#                           once more alone (wrk, BENCH_SECONDS) under `perf record -F 999 -g`
#                           on the serving process, and `perf report` of it is written there
#                           as PATH.txt (flat, self time) and PATH-children.txt (with callees)
#   BENCH_NO_BUILD [unset]  set to 1 to use the binaries already in target/ as they are
#   CARGO_TARGET_DIR [target/]  where cargo builds, and so where the binaries are looked for
#   BENCH_BACKSTOP_ALT [unset]  more backstop binaries, `:`-separated (e.g. builds without the
#                           change under test), each served beside the first with its own store
#                           and measured as path alt1, alt2, … in the same alternating rounds
#   BENCH_OHA [unset]       the oha binary for the constant-rate runs; when unset, `oha` on PATH,
#                           else it is installed once from crates.io (`cargo install --locked oha`,
#                           about ten minutes on two cores) into $CARGO_TARGET_DIR/bench-tools
#
# What it prints: per path the median over the rounds of requests/s, p50 and p99 latency at
# saturation, then the ratios backstop/direct and backstop/nginx; then the same paths at a
# constant offered rate of half of backstop's own saturation rate (oha -q, latencies counted from
# when each request was due, so a stalled path is not excused by sending less), with backstop's
# added latency (backstop − direct) at p50 and p99; then, for nginx and each backstop, the CPU
# time per request and the mean run-queue wait per time slice of each of its threads during
# those runs (from /proc/PID/task/*/schedstat: how long a runnable thread waited for a core,
# which a request carried by it waits too). Method and caveats: bench/HISTORY.md, "Gateway
# overhead".
#
# Every process it starts (upstream, nginx, backstop) is stopped on exit, also on Ctrl-C.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_PER_RUN="${BENCH_SECONDS:-8}"
ROUNDS="${BENCH_ROUNDS:-3}"
CONNECTIONS="${BENCH_CONNECTIONS:-32}"

log() { printf '%s\n' "$*" >&2; }
die() { log "proxy.sh: $*"; exit 1; }

# --- tools ---------------------------------------------------------------------------------
install_missing() {
    local missing=()
    command -v wrk >/dev/null || missing+=(wrk)
    command -v nginx >/dev/null && [ -x "$(command -v nginx)" ] || missing+=(nginx-light)
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" -eq 0 ] || die "needs ${missing[*]} (apt-get install ${missing[*]}) and is not root"
    log "installing ${missing[*]} from Debian's packages"
    # Keep the package's own nginx service from starting on port 80: a policy-rc.d that refuses
    # every start, only when the machine has none (and removed again afterwards).
    local own_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        own_policy=1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    [ "$own_policy" -eq 1 ] && rm -f /usr/sbin/policy-rc.d
    return 0
}
install_missing
command -v wrk >/dev/null || die "wrk is not installed"
command -v nginx >/dev/null || die "nginx is not installed"

TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"

# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"
OHA="$(find_oha "$TARGET_DIR")"
BACKSTOP="$TARGET_DIR/release/backstop"
if [ "${BENCH_NO_BUILD:-}" = 1 ]; then
    UPSTREAM_BIN="$(ls -t "$TARGET_DIR"/release/deps/upstream-* 2>/dev/null | grep -v '\.d$' | head -n1)"
else
    log "building backstop (release) and the upstream"
    (cd "$ROOT" && cargo build --quiet --release -p backstop --bin backstop)
    UPSTREAM_BIN="$(cd "$ROOT" && cargo build --quiet --profile bench -p backstop-gateway --bench upstream \
        --message-format=json | sed -n 's/.*"executable":"\([^"]*upstream[^"]*\)".*/\1/p' | tail -n1)"
fi
[ -x "$BACKSTOP" ] || die "no backstop binary at $BACKSTOP"
[ -x "$UPSTREAM_BIN" ] || die "could not find the upstream bench binary"

# --- processes -----------------------------------------------------------------------------
WORK="$(mktemp -d /tmp/backstop-proxy-bench.XXXXXX)"
PIDS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

UP_PORT="$(free_port)"
"$UPSTREAM_BIN" --listen "127.0.0.1:$UP_PORT" --threads 1 >"$WORK/upstream.log" 2>&1 &
PIDS+=($!)
wait_listening "$UP_PORT" upstream

NGINX_PORT="$(free_port)"
mkdir -p "$WORK/nginx/logs"
cat >"$WORK/nginx/nginx.conf" <<EOF
# A plain reverse proxy: keep-alive to the upstream, no buffering of small answers on disk,
# no access log (backstop's audit is its own cost and is counted; nginx's log would be too).
worker_processes auto;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/logs/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $WORK/nginx/body;
    proxy_temp_path $WORK/nginx/proxy;
    fastcgi_temp_path $WORK/nginx/fastcgi;
    uwsgi_temp_path $WORK/nginx/uwsgi;
    scgi_temp_path $WORK/nginx/scgi;
    upstream fast { server 127.0.0.1:$UP_PORT; keepalive 256; }
    server {
        listen 127.0.0.1:$NGINX_PORT;
        location /fast/ {
            proxy_pass http://fast/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
}
EOF
nginx -p "$WORK/nginx" -e "$WORK/nginx/logs/error.log" -c "$WORK/nginx/nginx.conf" -g 'daemon off;' >"$WORK/nginx/logs/stdout.log" 2>&1 &
PIDS+=($!)
NGINX_PID=$!
wait_listening "$NGINX_PORT" nginx

BACKSTOP_PORT="$(free_port)"
export BENCH_TOKEN="bench-agent-token-$RANDOM$RANDOM"
sed "s/@UPSTREAM@/127.0.0.1:$UP_PORT/" "$ROOT/bench/backstop-bench.yaml" >"$WORK/backstop.yaml"
BENCH_AGENT_TOKEN="$BENCH_TOKEN" BENCH_PROVIDER_KEY="bench-provider-key" BENCH_OPERATOR_TOKEN="bench-operator-$RANDOM" \
    "$BACKSTOP" serve --config "$WORK/backstop.yaml" --listen "127.0.0.1:$BACKSTOP_PORT" \
    --store "$WORK/backstop.db" >"$WORK/backstop.log" 2>&1 &
PIDS+=($!)
BACKSTOP_PID=$!
wait_listening "$BACKSTOP_PORT" backstop

# The GET path on each proxy; then backstop's POST paths: an LLM completion (side_effect none,
# recorded like a read) and a durable write (committed before its send), each a new action.
# Each completion differs (@N@ is numbered by wrk, the query by oha): identical calls in flight
# would be joined into one upstream call (docs/llm-calls.md), which is not what is measured.
COMPLETION_BODY='{"model":"bench","messages":[{"role":"user","content":"hi @N@"}]}'
declare -A URL=(
    [direct]="http://127.0.0.1:$UP_PORT/v1/fast"
    [nginx]="http://127.0.0.1:$NGINX_PORT/fast/v1/fast"
    [backstop]="http://127.0.0.1:$BACKSTOP_PORT/fast/v1/fast"
    [complete]="http://127.0.0.1:$BACKSTOP_PORT/fast/v1/chat/completions"
    [write]="http://127.0.0.1:$BACKSTOP_PORT/fast/v1/transfers"
)
declare -A METHOD=([complete]=POST [write]=POST)
declare -A BODY=([complete]="$COMPLETION_BODY" [write]='{"amount":5}')
declare -A PID_OF
read -r -a PATHS <<<"${BENCH_PATHS:-direct nginx backstop complete write}"
for needed in direct nginx backstop; do
    [[ " ${PATHS[*]} " == *" $needed "* ]] || die "BENCH_PATHS must hold $needed (it holds: ${PATHS[*]})"
done
for p in "${PATHS[@]}"; do
    [ -n "${URL[$p]:-}" ] || die "BENCH_PATHS: unknown path $p (known: ${!URL[*]})"
done
PID_OF=([nginx]=$NGINX_PID [backstop]=$BACKSTOP_PID [complete]=$BACKSTOP_PID [write]=$BACKSTOP_PID)

ALTS=()
if [ -n "${BENCH_BACKSTOP_ALT:-}" ]; then
    IFS=: read -r -a alt_bins <<<"$BENCH_BACKSTOP_ALT"
    for i in "${!alt_bins[@]}"; do
        bin="${alt_bins[$i]}"
        name="alt$((i + 1))"
        [ -x "$bin" ] || die "BENCH_BACKSTOP_ALT: no executable at $bin"
        port="$(free_port)"
        BENCH_AGENT_TOKEN="$BENCH_TOKEN" BENCH_PROVIDER_KEY="bench-provider-key" BENCH_OPERATOR_TOKEN="bench-operator-$RANDOM" \
            "$bin" serve --config "$WORK/backstop.yaml" --listen "127.0.0.1:$port" \
            --store "$WORK/$name.db" >"$WORK/$name.log" 2>&1 &
        PIDS+=($!)
        PID_OF[$name]=$!
        wait_listening "$port" "$name ($bin)"
        log "$name = $bin"
        URL[$name]="http://127.0.0.1:$port/fast/v1/fast"
        PATHS+=("$name")
        ALTS+=("$name")
    done
fi

# Each path must answer 200 before anything is measured.
for p in "${PATHS[@]}"; do
    post=()
    if [ -n "${BODY[$p]:-}" ]; then post=(-X POST -H 'content-type: application/json' --data "${BODY[$p]}"); fi
    code="$(curl -s -o /dev/null -w '%{http_code}' "${post[@]}" \
        -H "Authorization: Bearer $BENCH_TOKEN" "${URL[$p]}")"
    [ "$code" = 200 ] || die "$p answered $code at ${URL[$p]} (logs in $WORK)"
done

# run_wrk PATH CONNECTIONS SECONDS -> "rps p50_us p99_us errors"
run_wrk() {
    local out line
    out="$(BENCH_METHOD="${METHOD[$1]:-GET}" BENCH_BODY="${BODY[$1]:-}" wrk -t1 -c"$2" -d"${3}s" --timeout 5s \
        -s "$ROOT/bench/wrk_report.lua" "${URL[$1]}")"
    line="$(grep '^RESULT' <<<"$out")" || die "wrk printed no result for $1: $out"
    awk '{for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
          print v["rps"], v["p50_us"], v["p99_us"], v["errors"]}' <<<"$line"
}

median() { sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }

declare -A RPS P50 P99
# measure_rounds RUNNER LABEL: runs `RUNNER PATH` (printing "rps p50_us p99_us errors") for every
# path, ROUNDS times alternating, and leaves each path's medians in RPS, P50 and P99; then
# prints them as a table under "== LABEL ==".
measure_rounds() {
    local round p out
    for p in "${PATHS[@]}"; do RPS[$p]=""; P50[$p]=""; P99[$p]=""; done
    for round in $(seq 1 "$ROUNDS"); do
        for p in "${PATHS[@]}"; do
            # A runner that dies stops the script here, not only its own subshell.
            out="$("$1" "$p")" || exit 1
            read -r rps p50 p99 errors <<<"$out"
            [ "$errors" = 0 ] || log "warning: $p round $round: $errors errors (non-2xx or socket)"
            log "  round $round $(printf '%-8s' "$p") $(printf '%9.0f req/s  p50 %7.0f µs  p99 %7.0f µs' "$rps" "$p50" "$p99")"
            RPS[$p]+="$rps"$'\n'; P50[$p]+="$p50"$'\n'; P99[$p]+="$p99"$'\n'
        done
    done
    for p in "${PATHS[@]}"; do
        RPS[$p]="$(printf '%s' "${RPS[$p]}" | median)"
        P50[$p]="$(printf '%s' "${P50[$p]}" | median)"
        P99[$p]="$(printf '%s' "${P99[$p]}" | median)"
    done
    echo "== $2 =="
    printf '%-9s %12s %10s %10s\n' path 'req/s' 'p50 µs' 'p99 µs'
    for p in "${PATHS[@]}"; do
        printf '%-9s %12.0f %10.0f %10.0f\n' "$p" "${RPS[$p]}" "${P50[$p]}" "${P99[$p]}"
    done
}

log "warming up each path (2 s)"
for p in "${PATHS[@]}"; do run_wrk "$p" "$CONNECTIONS" 2 >/dev/null; done

log "saturation: wrk -t1 -c$CONNECTIONS -d${SECONDS_PER_RUN}s, $ROUNDS rounds alternating ${PATHS[*]}"
saturated() { run_wrk "$1" "$CONNECTIONS" "$SECONDS_PER_RUN"; }
measure_rounds saturated "saturation (wrk -t1 -c$CONNECTIONS, median of $ROUNDS alternating rounds)"
SAT_BACKSTOP="${RPS[backstop]}"
awk -v b="${RPS[backstop]}" -v d="${RPS[direct]}" -v n="${RPS[nginx]}" -v c="${RPS[complete]:-0}" -v w="${RPS[write]:-0}" \
    'BEGIN { printf "throughput ratio backstop/direct = %.3f, backstop/nginx = %.3f (target >= 0.5)\n", b / d, b / n
             if (c > 0) printf "completion POST: complete/backstop GET = %.3f (target >= 0.9), complete/nginx = %.3f (target >= 0.5)\n", c / b, c / n
             if (w > 0) printf "durable write POST: write/nginx = %.3f, write/backstop GET = %.3f\n", w / n, w / b }'
for a in "${ALTS[@]}"; do
    awk -v name="$a" -v b="${RPS[backstop]}" -v a="${RPS[$a]}" -v n="${RPS[nginx]}" \
        'BEGIN { printf "%s/nginx = %.3f, backstop/%s = %.3f\n", name, a / n, name, b / a }'
done

# Half of backstop's saturation rate, offered at a constant rate by oha: each request is due at
# its slot of the schedule, and its latency counts from then (--latency-correction), so a path
# that stalls is charged for the requests it kept waiting. Up to HALF_CONNECTIONS are open at
# once: far more than the rate needs at sub-millisecond latencies.
HALF_RATE="$(awk -v s="$SAT_BACKSTOP" 'BEGIN { printf "%.0f", s / 2 }')"
HALF_CONNECTIONS=64

# schedstat PID -> one line per thread name of PID's process and its child processes (nginx's
# workers, or the binary a wrapper script runs): "name cpu_ns runqueue_wait_ns timeslices",
# summed over the threads of that name, from /proc/*/task/*/schedstat (time on a CPU, time
# runnable but waiting for one, slices run).
schedstat() {
    python3 - "$1" <<'PY'
import os, sys
pids = [sys.argv[1]]
for tid in os.listdir(f"/proc/{pids[0]}/task"):
    try:
        pids += open(f"/proc/{pids[0]}/task/{tid}/children").read().split()
    except OSError:
        pass
sums = {}
for pid in pids:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        continue
    for tid in tids:
        try:
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            cpu, wait, slices = (int(x) for x in open(f"/proc/{pid}/task/{tid}/schedstat").read().split())
        except (OSError, ValueError):
            continue
        s = sums.setdefault(name.replace(" ", "_"), [0, 0, 0])
        s[0] += cpu; s[1] += wait; s[2] += slices
for name, (cpu, wait, slices) in sorted(sums.items()):
    print(name, cpu, wait, slices)
PY
}

# sched_delta BEFORE AFTER REQUESTS PATH: appends to $WORK/sched.txt, per thread name, the CPU
# time per request (µs) and the mean wait on the run queue per slice run (µs).
sched_delta() {
    python3 - "$1" "$2" "$3" "$4" >>"$WORK/sched.txt" <<'PY'
import sys
def parse(text):
    return {l.split()[0]: [int(x) for x in l.split()[1:]] for l in text.splitlines() if l.strip()}
before, after = parse(sys.argv[1]), parse(sys.argv[2])
requests, path = max(float(sys.argv[3]), 1.0), sys.argv[4]
for name, (cpu, wait, slices) in after.items():
    b = before.get(name, [0, 0, 0])
    dcpu, dwait, dslices = cpu - b[0], wait - b[1], slices - b[2]
    if dslices > 0:
        print(path, name, f"{dcpu / requests / 1e3:.1f}", f"{dwait / dslices / 1e3:.1f}")
PY
}

# run_oha PATH -> "rps p50_us p99_us errors"; for the nginx and backstop paths, their threads'
# CPU and run-queue waits go to $WORK/sched.txt (sched_delta).
run_oha() {
    local before="" after requests
    if [ -n "${PID_OF[$1]:-}" ]; then before="$(schedstat "${PID_OF[$1]}")"; fi
    local post=() url="${URL[$1]}"
    if [ -n "${BODY[$1]:-}" ]; then post=(-m POST -T application/json -d "${BODY[$1]}"); fi
    if [ "$1" = complete ]; then post+=(--rand-regex-url); url="$url\\?n=[0-9]{12}"; fi
    "$OHA" --no-tui --output-format json -q "$HALF_RATE" --latency-correction -z "${SECONDS_PER_RUN}s" \
        -c "$HALF_CONNECTIONS" -H "Authorization: Bearer $BENCH_TOKEN" -H "X-Backstop-Task: bench-run" \
        "${post[@]}" "$url" >"$WORK/oha.json" 2>"$WORK/oha.err" || die "oha failed for $1: $(cat "$WORK/oha.err")"
    if [ -n "$before" ]; then
        after="$(schedstat "${PID_OF[$1]}")"
        requests="$(python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))["summary"]; print(r["requestsPerSec"] * r["total"])' "$WORK/oha.json")"
        sched_delta "$before" "$after" "$requests" "$1"
    fi
    python3 - "$WORK/oha.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
p = r["latencyPercentiles"]
codes = r.get("statusCodeDistribution", {})
errors = sum(n for c, n in codes.items() if c != "200") + sum(r.get("errorDistribution", {}).values())
print(r["summary"]["requestsPerSec"], p["p50"] * 1e6, p["p99"] * 1e6, errors)
PY
}

log "half saturation: $HALF_RATE req/s offered at a constant rate (oha -q, up to $HALF_CONNECTIONS connections)"
measure_rounds run_oha "half of backstop's saturation rate ($HALF_RATE req/s offered at a constant rate by oha, latency from each request's due time, median of $ROUNDS rounds)"
awk -v b50="${P50[backstop]}" -v d50="${P50[direct]}" -v b99="${P99[backstop]}" -v d99="${P99[direct]}" \
    -v n50="${P50[nginx]}" -v n99="${P99[nginx]}" 'BEGIN {
    printf "added latency backstop - direct: p50 %.0f µs (target <= 300), p99 %.0f µs (target <= 1000)\n", b50 - d50, b99 - d99
    printf "added latency nginx - direct:    p50 %.0f µs, p99 %.0f µs\n", n50 - d50, n99 - d99 }'
for a in "${ALTS[@]}"; do
    awk -v name="$a" -v a50="${P50[$a]}" -v d50="${P50[direct]}" -v a99="${P99[$a]}" -v d99="${P99[direct]}" \
        'BEGIN { printf "added latency %s - direct:     p50 %.0f µs, p99 %.0f µs\n", name, a50 - d50, a99 - d99 }'
done

# Where added latency goes: a thread that is runnable but waits for a CPU (on the run queue)
# adds that wait to the latency of the requests it carries. Median over the rounds.
if [ -s "$WORK/sched.txt" ]; then
    echo "== the proxies' threads during the constant-rate runs (median of $ROUNDS rounds) =="
    python3 - "$WORK/sched.txt" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    path, name, cpu, wait = line.split()
    rows.setdefault((path, name), []).append((float(cpu), float(wait)))
print(f"{'path':<9} {'thread':<16} {'CPU µs/request':>15} {'run-queue wait µs/slice':>24}")
for (path, name), values in sorted(rows.items()):
    cpu = statistics.median(v[0] for v in values)
    wait = statistics.median(v[1] for v in values)
    print(f"{path:<9} {name:<16} {cpu:>15.1f} {wait:>24.1f}")
PY
fi

# Profiles of the backstop paths, each run alone: what one path spends its CPU on, beside the
# other's, from the same build and store.
if [ -n "${BENCH_PROFILE_DIR:-}" ]; then
    command -v perf >/dev/null || die "BENCH_PROFILE_DIR needs perf"
    mkdir -p "$BENCH_PROFILE_DIR"
    for p in "${PATHS[@]}"; do
        [ "${PID_OF[$p]:-}" = "$BACKSTOP_PID" ] || continue
        perf record -q -F 999 -g -p "$BACKSTOP_PID" -o "$WORK/perf-$p.data" 2>/dev/null &
        perf_pid=$!
        sleep 0.5
        read -r rps _ <<<"$(run_wrk "$p" "$CONNECTIONS" "$SECONDS_PER_RUN")"
        kill -INT "$perf_pid"; wait "$perf_pid" 2>/dev/null || true
        log "profiled $p alone: $(printf '%.0f' "$rps") req/s under perf"
        { echo "# $p alone under perf record -F 999 -g: $(printf '%.0f' "$rps") req/s"
          perf report -i "$WORK/perf-$p.data" --stdio --no-children --percent-limit 0.5 2>/dev/null \
              | grep -v '^$' | grep -E '^ +[0-9]' ; } >"$BENCH_PROFILE_DIR/$p.txt"
        perf report -i "$WORK/perf-$p.data" --stdio --children --percent-limit 2 -g none 2>/dev/null \
            | grep -E '^ +[0-9]' >"$BENCH_PROFILE_DIR/$p-children.txt" || true
    done
fi

errors_logged="$(grep -c ' ERROR ' "$WORK/backstop.log" || true)"
echo "backstop log: $(wc -l <"$WORK/backstop.log") lines, $errors_logged ERROR lines; store $(du -h "$WORK/backstop.db" 2>/dev/null | cut -f1) (+WAL)"
