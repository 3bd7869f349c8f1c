#!/usr/bin/env bash
# The wheels a lent CUDA machine lacks after the device hook's two halves (mlx-cuda, mlx-lm and the server's
# runtime): zstandard (engine/content_coding.py imports it: without it the server and every HTTP test fail at
# import), the shared tier's redis / hiredis, structured output's llguidance, and what the tests and benches import (pytest, hypothesis, openai,
# anthropic, httpx, psutil). Downloaded here for the device's Python (3.12, manylinux x86_64), less those the
# halves already hold, into DEST (default scratch/device-wheels, ~14 MB; git ignores it). Carry DEST in a call of
# its own once the machine is warm (the halves fill the 64 MiB a call carries), and install it there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site DEST/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-scratch/device-wheels}
PY=${PY:-.venv/bin/python}
mkdir -p "$dest"
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
  -d "$dest" zstandard redis hiredis llguidance openai anthropic httpx pytest hypothesis psutil 2>&1 | grep -v '^WARNING' || true
for f in "$dest"/*.whl; do  # what the hook's halves carry already
  for half in .mlxcuda-1 .mlxcuda-2; do
    if [ -e "$half/$(basename "$f")" ]; then rm -f "$f"; fi
  done
done
ls "$dest"
du -sh "$dest"
