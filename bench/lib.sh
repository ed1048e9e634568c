# Helpers shared by the scripts of bench/ (sourced, not run). The sourcing script defines
# `die MESSAGE` (print and exit) and `WORK` (its scratch directory, named in errors).

# free_port -> a TCP port on 127.0.0.1 that nothing listens on.
free_port() {
    local port
    for _ in $(seq 1 200); do
        port=$((20000 + RANDOM % 40000))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$port"
            return 0
        fi
    done
    die "no free port found"
}

# wait_listening PORT NAME: returns once something accepts connections on PORT (10 s at most).
wait_listening() {
    for _ in $(seq 1 200); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
        sleep 0.05
    done
    die "$2 did not start listening on port $1 (logs in $WORK)"
}

# find_oha TARGET_DIR -> the oha binary: BENCH_OHA, else `oha` on PATH, else installed once
# from crates.io into TARGET_DIR/bench-tools. oha offers a constant rate (wrk only closes the
# loop: each connection waits for its answer, so a slower path is offered less). Plain HTTP is
# all it needs here; its TLS through the system's OpenSSL keeps the build free of cmake.
find_oha() {
    local oha="${BENCH_OHA:-$(command -v oha || true)}"
    if [ -z "$oha" ]; then
        oha="$1/bench-tools/bin/oha"
        if [ ! -x "$oha" ]; then
            printf 'installing oha from crates.io into %s/bench-tools (once)\n' "$1" >&2
            cargo install --quiet --locked oha --no-default-features --features native-tls \
                --root "$1/bench-tools" >&2 || die "could not install oha (set BENCH_OHA to a binary)"
        fi
    fi
    [ -x "$oha" ] || die "BENCH_OHA: no executable at $oha"
    echo "$oha"
}
