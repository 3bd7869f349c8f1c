"""Agent session with a restart after every turn: how many entry files are on disk at the end?"""
import sys, tempfile
from pathlib import Path
from engine.generate import Engine, SamplingParams
from engine.models.tiny import build
from tiered_kv.config import Config

tmp = Path(tempfile.mkdtemp())
model = build(tmp / "tiny", size="test", seed=0)
cfg = Config(cache_dir=tmp / "kv", block_tokens=16, min_continuation_tokens=16)
msgs = [{"role": "system", "content": "You are a coding agent. " * 20},
        {"role": "user", "content": "Read setup.sh and tell me what it installs."}]
for turn in range(1, 7):
    engine = Engine(model, cfg)
    ids = engine.encode_chat(msgs)
    *_, last = list(engine.generate(ids, SamplingParams(max_tokens=24)))
    engine.close()
    files = sorted((tmp / "kv").glob("*/*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    print(f"turn {turn}: prompt {len(ids)} tokens, cached {last.usage.cached_tokens}, files {len(files)}, {size/1e6:.2f} MB", flush=True)
    # the client sends the answer back re-rendered (not the ids the model generated), then a new question
    msgs += [{"role": "assistant", "content": f"It installs OpenBLAS and the package (turn {turn})."},
             {"role": "user", "content": f"Now check file number {turn}."}]
