"""gemma3-shaped random bf16 model: engine decode vs generate_step vs engine with mlx-lm's
BatchRotatingKVCache mask (the state before DecodeRotatingKVCache)."""
import json, shutil, sys, statistics, time
from pathlib import Path
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text
from mlx_lm.models import cache as C
from bench import decode_loop as D, step_shapes
from engine import decoding
from engine.generate import Engine
from tiered_kv import Config

SHAPES = {
    "t": dict(hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4,
              head_dim=16, num_key_value_heads=2, sliding_window=64, query_pre_attn_scalar=16),
    "1b": dict(hidden_size=1152, num_hidden_layers=26, intermediate_size=6912, num_attention_heads=4,
               head_dim=256, num_key_value_heads=1, sliding_window=512, query_pre_attn_scalar=256),
    "4b": dict(hidden_size=2560, num_hidden_layers=34, intermediate_size=10240, num_attention_heads=8,
               head_dim=256, num_key_value_heads=4, sliding_window=1024, query_pre_attn_scalar=256),
}

def build(src: Path, out: Path, size: str) -> Path:
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    cfg = dict(model_type="gemma3_text", vocab_size=vocab, sliding_window_pattern=6, rope_theta=1e6,
               rope_local_base_freq=1e4, rms_norm_eps=1e-6, max_position_embeddings=131072,
               torch_dtype="bfloat16", **SHAPES[size])
    mx.random.seed(0)
    m = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(cfg))
    m.set_dtype(mx.bfloat16)
    w = dict(tree_flatten(m.parameters()))
    w = {k: (v * 0.5 if v.ndim == 2 else v) for k, v in w.items()}
    mx.eval(w)
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out

def old_rotating(engine, prompt, tokens):
    keep = decoding.DecodeRotatingKVCache.make_mask
    decoding.DecodeRotatingKVCache.make_mask = C.BatchRotatingKVCache.make_mask
    try:
        return D._engine(engine, prompt, tokens)
    finally:
        decoding.DecodeRotatingKVCache.make_mask = keep

WAYS = {"generate_step": D._generate_step, "engine": D._engine, "engine, mlx-lm's rotating mask": old_rotating}

def main():
    src, size, contexts, tokens, rounds = Path(sys.argv[1]), sys.argv[2], [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4]), int(sys.argv[5])
    t = time.time()
    model = build(src, Path(f"/tmp/models/gemma3-{size}"), size)
    print(f"built {model} in {time.time()-t:.0f}s", flush=True)
    engine = Engine(model, Config(tiers=()))
    engine.tokenizer.eos_token_ids = []
    engine.warm_up()
    for ctx in contexts:
        res = {w: [] for w in WAYS}
        for r in range(rounds):
            for k, (w, fn) in enumerate(WAYS.items()):
                ids = step_shapes.prompt(ctx, r * len(WAYS) + k)
                res[w].append(fn(engine, ids, tokens))
        base = statistics.median(res["generate_step"])
        print(f"\ngemma3-{size} {ctx} ctx, {tokens} tokens, device {mx.default_device()}")
        for w, runs in res.items():
            med = statistics.median(runs)
            print(f"| {w} | {med:.1f} | {' '.join(f'{x:.1f}' for x in runs)} | {med/base:.2f} |", flush=True)
    engine.close()

def check(src, size):
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from engine.events import SamplingParams
    model = build(src, Path(f"/tmp/models/gemma3-{size}"), size)
    engine = Engine(model, Config(tiers=()))
    engine.tokenizer.eos_token_ids = []
    for ctx in (600, 3000):
        ids = step_shapes.prompt(ctx, 7)
        got = [c.token for c in engine.generate(ids, SamplingParams(max_tokens=48)) if c.token is not None]
        cache = make_prompt_cache(engine.model)
        want = [int(t) for t, _ in generate_step(mx.array(ids), engine.model, max_tokens=48, prompt_cache=cache)]
        same = sum(a == b for a, b in zip(got, want))
        print(f"gemma3-{size} greedy {ctx} ctx: engine == generate_step for {same}/{len(want)} tokens (first diff at {next((i for i,(a,b) in enumerate(zip(got,want)) if a!=b), None)})")
    engine.close()

if sys.argv[1] == "check":
    check(Path(sys.argv[2]), sys.argv[3])
else:
    main()
