#!/usr/bin/env bash
# On a GPU machine (CUDA or Metal; the H200 through the device tool, see README "Development"): build a random
# SIZE-shaped model (1b | 8b: Llama-3.2-1B / Llama-3.1-8B shapes, bf16), run `tiered-kv smoke` on it, then the
# agent-session replay against mlx_lm.server. Extra arguments go to `tiered-kv bench`. Output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
size=${1:-1b}; shift || true
out=${OUT:-/tmp/tiered-kv-gpu}; mkdir -p "$out"
model=${MODELS:-/tmp/models}/$size
PY=${PY:-python3}
[ -f "$model/config.json" ] || "$PY" -m engine.cli model tiny "$model" --size "$size" >/dev/null
echo "== smoke ($size)"
"$PY" -m engine.cli smoke "$model" --prefix-words "${SMOKE_WORDS:-6000}" --max-tokens 64 2>&1 \
  | grep -v " INFO " | tee "$out/smoke-$size.txt"
echo "== bench ($size)"
"$PY" -m engine.cli bench --model "$model" --out "$out/bench-$size" --no-micro "$@" 2>"$out/bench-$size.err" \
  | tee "$out/bench-$size.txt"
tail -5 "$out/bench-$size.err"
