#!/usr/bin/env bash
# Runs the SDK suite: the official OpenAI and Anthropic Python SDKs and LiteLLM, pinned in
# tests/sdk/requirements.txt, at their default settings, through a real `backstop serve` to a
# real `backstop fake-api`, counting attempts at the fake.
#
#   tests/sdk/run.sh [pytest args…]
#
# Creates the venv .venv-sdk/ at the repository root when missing and installs the pinned
# packages into it (once per change of requirements.txt). Uses the binary named by
# BACKSTOP_BIN; without it, builds target/debug/backstop (`cargo build -p backstop`, quick when
# it is up to date) and uses that.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"

python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
venv="$root/.venv-sdk"
requirements="$root/tests/sdk/requirements.txt"

if [ ! -x "$venv/bin/python" ]; then
    echo "== creating $venv"
    "$python" -m venv "$venv"
fi
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$requirements" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    echo "== installing tests/sdk/requirements.txt into .venv-sdk"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements"
    echo "$want" >"$stamp"
fi

if [ -z "${BACKSTOP_BIN:-}" ]; then
    echo "== cargo build -p backstop"
    cargo build -p backstop
    export BACKSTOP_BIN="$root/target/debug/backstop"
fi

echo "== SDK suite (pytest tests/sdk) against $BACKSTOP_BIN"
export PYTHONDONTWRITEBYTECODE=1
exec "$venv/bin/python" -m pytest -p no:cacheprovider -ra --tb=short "$root/tests/sdk" "$@"
