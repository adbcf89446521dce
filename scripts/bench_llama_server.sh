#!/usr/bin/env bash
# The side-by-side replay against llama-server (outside CI: building llama.cpp takes ~17 min on
# 2 cores). Needs a llama-server binary built with -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF
# -DLLAMA_USE_PREBUILT_UI=OFF, and the model converted to GGUF with llama.cpp's
# convert_hf_to_gguf.py (map the project tokenizer's pre-tokenizer hash to "gpt-2" first).
#
#   LLAMA_SERVER=/path/to/llama-server GGUF=llama-mini.gguf scripts/bench_llama_server.sh
#
# --cache-reuse shifts the cached tail after a deletion but never after a replacement, so a
# stale-tool stub re-prefills the tail there too: the radix arm is the one to compare.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}"
: "${GGUF:?set GGUF to the model converted to GGUF}"
PORT="${PORT:-8089}"
"$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$PORT" --cache-reuse 256 -c 8192 -np 16 \
    > /tmp/llama-server.log 2>&1 &
PID=$!
trap 'kill $PID' EXIT
for _ in $(seq 1 120); do curl -sf "127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
"$ROOT/.venv/bin/leyline" bench http --base-url "http://127.0.0.1:$PORT/v1" \
    --served-model "$(basename "$GGUF")" --label llama-server --arms radix \
    --concurrency "${CONCURRENCY:-1,4,8,16}" --quick --out "${OUT:-runs/llama-server}"
