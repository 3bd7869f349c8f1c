"""Regenerate cache_dir.example/: a small real cold tier made with the tiny test model.

    python scripts/make_cache_example.py [OUT_DIR]

Two conversations (an agent-style chat with a tool call, and a title request) are generated with
the tiny test model (seed 0), then the engine closes, which spills the hot tier to disk.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from engine.generate import Engine, SamplingParams
from engine.models.tiny import build
from tiered_kv.config import Config

MESSAGES = [
    {"role": "system", "content": "You are a coding agent. Use the tools to read files."},
    {"role": "user", "content": "What does setup.sh install?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "read_file", "arguments": "{\"path\": \"scripts/setup.sh\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "apt-get install libopenblas0-pthread\npip install -e '.[test]'"},
]
TITLE = [
    {"role": "system", "content": "Generate a short title for the conversation."},
    {"role": "user", "content": "What does setup.sh install?"},
]


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "cache_dir.example")
    keep = out / "README.md"
    readme = keep.read_text() if keep.exists() else None
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "tiny-test", size="test", seed=0)
        engine = Engine(model, Config(cache_dir=out, block_tokens=16, min_continuation_tokens=16))
        for msgs in (MESSAGES, TITLE):
            ids = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
            for _ in engine.generate(ids, SamplingParams(max_tokens=8)):
                pass
        engine.close()
    if readme is not None:
        keep.write_text(readme)


if __name__ == "__main__":
    main()
