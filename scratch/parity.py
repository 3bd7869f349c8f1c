"""Same request to ours and mlx_lm.server (SmolLM2, greedy): do the sampling fields give the same text?"""
import json, sys, tempfile
from pathlib import Path
import httpx
from bench.servers import ServerProcess, ours_spec, peer_spec

model = Path.home() / ".cache/tiered-kv/models/smollm2-135m-instruct"
tmp = Path(tempfile.mkdtemp())
ours = ServerProcess(ours_spec("ours", model, {"TIERED_KV_DIR": str(tmp / "kv")}), tmp / "ours.log")
peer = ServerProcess(peer_spec("peer", model, {}), tmp / "peer.log")
ours.start(); peer.start()
msgs = [{"role": "user", "content": "List the days of the week, then list them again, then again."}]
cases = {
    "plain": {},
    "repetition_penalty 1.3": {"repetition_penalty": 1.3},
    "presence 1.5": {"presence_penalty": 1.5},
    "frequency 1.0 ctx 64": {"frequency_penalty": 1.0, "frequency_context_size": 64},
    "logit_bias": {"logit_bias": {"28": -100, "216": 5}},
    "top_k 1 temp 1": {"temperature": 1.0, "top_k": 1},
}
try:
    for name, extra in cases.items():
        body = {"model": str(model), "messages": msgs, "max_tokens": 48, "temperature": 0, **extra}
        got = {}
        for s in (ours, peer):
            r = httpx.post(s.base_url + "/v1/chat/completions", json=body, timeout=300)
            got[s.spec.name] = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"HTTP {r.status_code} {r.text[:100]}"
        same = got["ours"] == got["peer"]
        print(f"{name:24s} same={same}  ours={got['ours'][:70]!r}" + ("" if same else f"\n{'':24s}           peer={got['peer'][:70]!r}"), flush=True)
finally:
    ours.stop(); peer.stop()
