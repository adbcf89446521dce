#!/usr/bin/env bash
# The prepared GPU check (issue 38): assemble the project on a bare GPU machine, then run
# `leyline check gpu` (experiments/check/gpu_check.py), every figure recorded under OUTDIR.
#
#   scripts/gpu_check.sh --wheels          here (with a registry): fill .gpu-wheels/
#   scripts/gpu_check.sh OUTDIR            there: install the wheels, assemble, run (<= 8 min)
#   scripts/gpu_check.sh OUTDIR --dry-run  the same on this CPU, shrunk shapes (the suite's test)
#
# What travels to the GPU machine: the working tree (the source) and .gpu-wheels/ (ignored,
# carried): the wheels the machine lacks (it has torch, triton, transformers, tokenizers,
# safetensors, numpy, httpx, anyio, pyyaml: see docs/gpu.md) and COMMIT, the commit they were
# fetched at (the copy there has no .git). The project is assembled as the installed package
# is (pyproject's package-dir: kernels/, policies/, experiments/ inside leyline_agent/) in a
# temporary folder put on PYTHONPATH, and run from outside the checkout so that the root's
# folders shadow nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/.gpu-wheels"
PY="${PYTHON:-python3}"
[ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"
# name==version of each wheel the GPU machine lacks (versions from scripts/constraints.txt)
NEEDED="pydantic pydantic_core annotated-types typing-inspection typing_extensions structlog
tenacity openai distro jiter sniffio fastapi starlette uvicorn h11 click google-re2"
LIMIT_MB=48  # the source and the wheels travel together in at most 64 MiB

if [ "${1:-}" = "--wheels" ]; then
    mkdir -p "$WHEELS"
    rm -f "$WHEELS"/*.whl
    pins=()
    for name in $NEEDED; do
        pin=$(grep -i "^${name}==" "$ROOT/scripts/constraints.txt" || true)
        [ -n "$pin" ] || { echo "gpu_check: $name is not pinned in scripts/constraints.txt" >&2; exit 1; }
        pins+=("$pin")
    done
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" "${pins[@]}"
    dirty=$(git -C "$ROOT" status --porcelain --untracked-files=no | head -1)
    echo "$(git -C "$ROOT" rev-parse --short HEAD)${dirty:++uncommitted-tree}" > "$WHEELS/COMMIT"
    mb=$(du -sm "$WHEELS" | cut -f1)
    ls -1 "$WHEELS"
    echo "gpu_check: $(ls "$WHEELS"/*.whl | wc -l) wheels, ${mb} MB in $WHEELS"
    [ "$mb" -le "$LIMIT_MB" ] || { echo "gpu_check: wheels over ${LIMIT_MB} MB" >&2; exit 1; }
    exit 0
fi

OUT="${1:?usage: scripts/gpu_check.sh OUTDIR [--dry-run] | --wheels}"
shift
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/leyline-gpu.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# 1. the wheels, where the interpreter lacks the modules (the GPU machine; never this venv)
SITE=""
if ! "$PY" -c "import pydantic, structlog, tenacity, fastapi, openai" 2>/dev/null; then
    ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "gpu_check: no wheels: run --wheels here first" >&2; exit 1; }
    SITE="$WORK/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        "$WHEELS"/*.whl
fi

# 2. the package, laid out as pyproject's package-dir installs it
PKG="$WORK/pkg"
mkdir -p "$PKG"
cp -r "$ROOT/leyline_agent" "$PKG/leyline_agent"
for sub in kernels policies experiments; do
    rm -rf "$PKG/leyline_agent/$sub"
    cp -r "$ROOT/$sub" "$PKG/leyline_agent/$sub"
done
find "$PKG" -name __pycache__ -prune -exec rm -rf {} +

# 3. the check, from outside the checkout
export PYTHONPATH="$PKG${SITE:+:$SITE}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false LITELLM_LOCAL_MODEL_COST_MAP=True
export PYTHONUNBUFFERED=1
if [ -z "${LEYLINE_COMMIT:-}" ]; then  # the GPU machine's copy: COMMIT (its .git is not ours)
    if [ -n "$SITE" ]; then LEYLINE_COMMIT=$(cat "$WHEELS/COMMIT" 2>/dev/null || true)
    else LEYLINE_COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || true); fi
    export LEYLINE_COMMIT
fi
cd "$WORK"
"$PY" -c "import leyline_agent, sys; assert leyline_agent.__file__.startswith('$PKG'), leyline_agent.__file__"
exec "$PY" -m leyline_agent.cli check gpu "$OUT" "$@"
