-- wrk script of bench/proxy.sh: sends GET /v1/fast with the agent's token and prints one
-- machine-readable line at the end (latencies in microseconds, from wrk's own histogram).
--
-- With the environment variable BENCH_DELAY_MS set, every connection waits that many
-- milliseconds after each response before sending its next request (wrk's delay() hook): a
-- paced, fixed-rate-per-connection load used for the "added latency at half saturation" runs.

local delay_ms = tonumber(os.getenv("BENCH_DELAY_MS") or "")

wrk.method = "GET"
wrk.headers["Authorization"] = "Bearer " .. (os.getenv("BENCH_TOKEN") or "")
wrk.headers["X-Backstop-Task"] = "bench-run"

if delay_ms and delay_ms > 0 then
  function delay()
    return delay_ms
  end
end

function done(summary, latency, requests)
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.status + summary.errors.timeout
  io.write(string.format(
    "RESULT requests=%d duration_us=%d rps=%.1f p50_us=%.1f p99_us=%.1f max_us=%.1f errors=%d status_errors=%d\n",
    summary.requests, summary.duration, summary.requests / (summary.duration / 1e6),
    latency:percentile(50), latency:percentile(99), latency.max, errors, summary.errors.status))
end
