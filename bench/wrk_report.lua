-- wrk script of bench/proxy.sh: sends GET (or BENCH_METHOD with BENCH_BODY as a JSON body)
-- with the agent's token and prints one machine-readable line at the end (latencies in
-- microseconds, from wrk's own histogram).

wrk.method = os.getenv("BENCH_METHOD") or "GET"
local body = os.getenv("BENCH_BODY")
if body and body ~= "" then
  wrk.body = body
  wrk.headers["Content-Type"] = "application/json"
end

-- A body with @N@ gets a number of its own per request: identical LLM calls in flight would be
-- joined into one upstream call, which is not the path being measured.
local n = 0
if body and body:find("@N@", 1, true) then
  request = function()
    n = n + 1
    return wrk.format(nil, nil, nil, (body:gsub("@N@", tostring(n))))
  end
end
wrk.headers["Authorization"] = "Bearer " .. (os.getenv("BENCH_TOKEN") or "")
wrk.headers["X-Backstop-Task"] = "bench-run"

function done(summary, latency, requests)
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.status + summary.errors.timeout
  io.write(string.format(
    "RESULT requests=%d duration_us=%d rps=%.1f p50_us=%.1f p99_us=%.1f max_us=%.1f errors=%d status_errors=%d\n",
    summary.requests, summary.duration, summary.requests / (summary.duration / 1e6),
    latency:percentile(50), latency:percentile(99), latency.max, errors, summary.errors.status))
end
