#!/usr/bin/env bash
# End-to-end server check on MLX's default device: `bash scripts/smoke.sh MODEL_DIR [--no-peer] [...]`.
# One line per step; non-zero exit on any failure (see `tiered-kv smoke --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
preload=$("$PY" -m engine.blas --preload-env 2>/dev/null || true)
exec env $preload "$PY" -m engine.cli smoke "$@"
