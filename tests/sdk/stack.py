"""Real processes for the SDK suite: a `backstop fake-api` and a `backstop serve` in front of it.

Each test gets its own pair (`stack` fixture): the fake's YAML config and the gateway's policy
are written to the test's tmp dir, both listen on a free loopback port (port 0, the address read
from the line each prints when it listens), the gateway's store is a file in that tmp dir, and
both are stopped when the test ends. Attempts are counted at the fake (`GET /__fake/attempts`),
never inside backstop.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
BACKSTOP_BIN = Path(os.environ.get("BACKSTOP_BIN", REPO / "target" / "debug" / "backstop"))

AGENT_TOKEN = "sdk-suite-agent-token"
OPERATOR_TOKEN = "sdk-suite-operator-token"
CHAT_ROUTE = "POST /v1/chat/completions"
MESSAGES_ROUTE = "POST /v1/messages"

# The SDKs read these; the suite passes every credential explicitly.
for _name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN",
              "ANTHROPIC_BASE_URL", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy",
              "https_proxy", "all_proxy"):
    os.environ.pop(_name, None)
os.environ["NO_PROXY"] = "127.0.0.1,localhost"
# LiteLLM: use the model cost map it ships instead of fetching one at import, send nothing out.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LITELLM_TELEMETRY"] = "False"


def _request(method: str, url: str, token: str | None = None, timeout: float = 10.0):
    """One plain HTTP request (no retries): `(status, parsed JSON or text)`."""
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode("utf-8", "replace")


class Process:
    """A child process whose stderr goes to a log file; started with port 0, it is ready once it
    has printed `listening on http://ADDR`."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path):
        self.name = name
        self.log = log
        self._log_file = open(log, "wb")
        self.proc = subprocess.Popen(
            args, env=env, stdin=subprocess.DEVNULL, stdout=self._log_file,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.addr = self._wait_listening(60.0)

    def text(self) -> str:
        return self.log.read_text("utf-8", "replace")

    def _wait_listening(self, limit: float) -> str:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            for line in self.text().splitlines():
                if "listening on http://" in line:
                    return line.split("listening on http://", 1)[1].split()[0]
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode} before listening:\n{self.text()}")
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.name} did not say where it listens within {limit} s:\n{self.text()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; waits for the exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log_file.close()


def wait_answers(url: str, limit: float = 30.0) -> None:
    """Waits until `url` gives any HTTP answer."""
    deadline = time.monotonic() + limit
    while True:
        try:
            _request("GET", url, timeout=2.0)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def completion_route(route: str, api: str, script: list | None = None,
                     faults: list | None = None) -> dict[str, Any]:
    """A fake route answering LLM completions in `api`'s shapes (3 tokens, 20 ms apart when
    streamed), with an optional response script and fault rules."""
    config: dict[str, Any] = {
        "route": route,
        "handler": {"kind": "completion", "api": api, "events": 3, "interval_ms": 20},
    }
    if script:
        config["script"] = script
    if faults:
        config["faults"] = faults
    return config


def policy(fake_url: str) -> dict[str, Any]:
    """The gateway's policy: providers `openai` and `anthropic` at the fake, their completion
    routes in the `llm_call` class, one agent (token from the environment) and one operator."""
    return {
        "request_classes": {
            "llm_call": {"max_attempts": 3, "max_wait_seconds": 60,
                         "retry_statuses": [429, 500, 502, 503, 529]},
        },
        # Short waits keep the suite fast; each retry still waits for the provider's boundary.
        "backoff": {"base_seconds": 0.2, "max_seconds": 2, "boundary_spread_seconds": 0.5},
        "agents": {"sdk-agent": {"token_env": "BACKSTOP_SDK_AGENT_TOKEN"}},
        "operators": {"oncall": {"token_sha256": hashlib.sha256(OPERATOR_TOKEN.encode()).hexdigest()}},
        "providers": {
            "openai": {
                "base_url": fake_url,
                "credential": {"secret_env": "FAKE_OPENAI_KEY"},
                "dialect": "openai",
                "routes": {CHAT_ROUTE: {"class": "llm_call"}},
            },
            "anthropic": {
                "base_url": fake_url,
                "credential": {"secret_env": "FAKE_ANTHROPIC_KEY", "header": "x-api-key", "scheme": ""},
                "dialect": "anthropic",
                "routes": {MESSAGES_ROUTE: {"class": "llm_call"}},
            },
        },
    }


@dataclass
class Stack:
    """A fake provider and a gateway in front of it, as real processes."""

    tmp: Path
    fake: Process
    gateway: Process
    task: str
    notes: list[str] = field(default_factory=list)

    @property
    def fake_url(self) -> str:
        return f"http://{self.fake.addr}"

    @property
    def gateway_url(self) -> str:
        return f"http://{self.gateway.addr}"

    def attempts(self, route: str | None = None) -> list[dict[str, Any]]:
        """The fake's attempt records (of `route` only, when given)."""
        status, records = _request("GET", f"{self.fake_url}/__fake/attempts")
        assert status == 200, records
        return [r for r in records if route is None or r["route"] == route]

    def settled_attempts(self, route: str, quiet: float = 1.0, limit: float = 20.0) -> list[dict[str, Any]]:
        """The attempts of `route` once none is pending and none has arrived for `quiet`
        seconds: a count taken while the gateway still works would be too early."""
        deadline = time.monotonic() + limit
        last, since = None, time.monotonic()
        while True:
            records = self.attempts(route)
            shape = [(r["seq"], r["outcome"]) for r in records]
            if shape != last:
                last, since = shape, time.monotonic()
            pending = any(r["outcome"] == "pending" for r in records)
            if (not pending and time.monotonic() - since >= quiet) or time.monotonic() > deadline:
                return records
            time.sleep(0.05)

    def reset(self) -> None:
        status, _ = _request("POST", f"{self.fake_url}/__fake/reset")
        assert status == 204

    def open_escalations(self) -> list[dict[str, Any]]:
        """`GET /v1/escalations` with the operator's token: the open ones."""
        status, body = _request("GET", f"{self.gateway_url}/v1/escalations", token=OPERATOR_TOKEN)
        assert status == 200, body
        return body["escalations"]

    def call(self, fn: Callable[[], Any], limit: float = 90.0) -> Any:
        """Runs `fn` (an SDK call at its default timeouts) and returns its result or raises its
        exception. When it has not returned after `limit` seconds the gateway is stopped (so
        the SDK's connection closes) and the test fails, instead of waiting out the SDK's
        ten-minute default timeout."""
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = fn()
            except BaseException as err:  # handed to the test thread
                outcome["error"] = err

        started = time.monotonic()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(limit)
        if thread.is_alive():
            self.gateway.stop()
            thread.join(30)
            pytest.fail(f"the SDK call had not returned after {limit} s\n{self.describe()}")
        self.notes.append(f"SDK call returned after {time.monotonic() - started:.2f} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def describe(self, route: str | None = None) -> str:
        """What the fake saw, for assertion messages."""
        lines = [f"notes: {'; '.join(self.notes)}", "fake attempts:"]
        for r in self.attempts(route):
            lines.append(f"  #{r['seq']} {r['at']} {r['route']} call={r['call']} -> "
                         f"{r['status']} {r['outcome']} fault={r['fault']}")
        return "\n".join(lines)

    def stop(self) -> None:
        self.gateway.stop()
        self.fake.stop()


def exchange(err: Exception) -> str:
    """The gateway's final answer behind an SDK status error: status and the retry headers."""
    name = f"{type(err).__module__}.{type(err).__name__}"
    response = getattr(err, "response", None)
    if response is None:
        return f"{name}: {str(err)[:300]}"
    keep = ("x-should-retry", "retry-after", "backstop-attempts", "backstop-action-id",
            "content-type")
    headers = {k: v for k, v in response.headers.items() if k.lower() in keep}
    return (f"{name} (str: {str(err)[:200]!r}) status={response.status_code} headers={headers} "
            f"body={response.text[:600]}")


@pytest.fixture
def make_stack(tmp_path: Path, request: pytest.FixtureRequest):
    """`make_stack(chat=..., messages=..., attempt_timeout=...)`: starts a fake whose chat
    route (`POST /v1/chat/completions`, OpenAI shapes) and messages route (`POST /v1/messages`,
    Anthropic shapes) follow the given `{script, faults}`, and a gateway in front of it."""
    stacks: list[Stack] = []
    if not BACKSTOP_BIN.is_file():
        pytest.fail(f"no backstop binary at {BACKSTOP_BIN}: build it with `cargo build -p backstop` "
                    f"or set BACKSTOP_BIN")

    def make(chat: dict | None = None, messages: dict | None = None,
             attempt_timeout: int | None = None) -> Stack:
        fake_config = {
            "seed": 7,
            "routes": [
                completion_route(CHAT_ROUTE, "openai", **(chat or {})),
                completion_route(MESSAGES_ROUTE, "anthropic", **(messages or {})),
            ],
        }
        fake_yaml = tmp_path / "fake.yaml"
        # JSON is YAML: the files are written with the standard library alone.
        fake_yaml.write_text(json.dumps(fake_config, indent=2))
        env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
        fake = Process("fake-api", [str(BACKSTOP_BIN), "fake-api", "--config", str(fake_yaml),
                                    "--listen", "127.0.0.1:0", "--shutdown-grace-seconds", "1"],
                       env, tmp_path / "fake.log")
        try:
            wait_answers(f"http://{fake.addr}/__fake/attempts")
            policy_yaml = tmp_path / "backstop.yaml"
            policy_yaml.write_text(json.dumps(policy(f"http://{fake.addr}"), indent=2))
            args = [str(BACKSTOP_BIN), "serve", "--config", str(policy_yaml),
                    "--listen", "127.0.0.1:0", "--store", str(tmp_path / "backstop.db"),
                    "--seed", "7", "--shutdown-grace-seconds", "1"]
            if attempt_timeout is not None:
                args += ["--attempt-timeout-seconds", str(attempt_timeout)]
            gateway_env = dict(env, BACKSTOP_SDK_AGENT_TOKEN=AGENT_TOKEN,
                               FAKE_OPENAI_KEY="fake-openai-key", FAKE_ANTHROPIC_KEY="fake-anthropic-key")
            gateway = Process("backstop serve", args, gateway_env, tmp_path / "gateway.log")
        except BaseException:
            fake.stop()
            raise
        stack = Stack(tmp=tmp_path, fake=fake, gateway=gateway, task=f"sdk-{request.node.name}"[:100])
        stacks.append(stack)
        try:
            wait_answers(f"{stack.gateway_url}/metrics")
        except BaseException:
            stack.stop()
            raise
        return stack

    yield make
    for stack in stacks:
        stack.stop()
        # Shown by pytest for a failing test (and with -rA for every test).
        print(f"--- gateway log ({stack.gateway.log})\n{stack.gateway.text()[-6000:]}")
        print(f"--- fake log ({stack.fake.log})\n{stack.fake.text()[-3000:]}")
