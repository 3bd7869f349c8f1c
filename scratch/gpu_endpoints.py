"""On the GPU: tiered-kv serve answering /v1/messages and /v1/responses (streamed and not), twice (hot)."""
import json, subprocess, sys, time, os
import httpx
model, port = sys.argv[1], 8123
log = open("/tmp/serve_ep.log", "wb")
env = dict(os.environ, TIERED_KV_DIR="/tmp/kv_ep")
proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--model", model, "--port", str(port)],
                        stdout=log, stderr=subprocess.STDOUT, env=env)
url = f"http://127.0.0.1:{port}"
for _ in range(600):
    try:
        if httpx.get(url + "/health", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        time.sleep(0.5)
words = " ".join(f"word{i % 97}" for i in range(3000))
try:
    for rnd in range(2):
        m = {"max_tokens": 16, "temperature": 0, "system": "You are terse. " + words,
             "messages": [{"role": "user", "content": "Say hello."}]}
        t0 = time.time(); r = httpx.post(url + "/v1/messages", json=m, timeout=300)
        b = r.json(); print("messages", rnd, r.status_code, round(time.time() - t0, 3), b.get("usage"), b.get("stop_reason"), flush=True)
        with httpx.stream("POST", url + "/v1/messages", json={**m, "stream": True}, timeout=300) as s:
            ev = [l[7:] for l in s.iter_lines() if l.startswith("event: ")]
        print("messages stream", rnd, s.status_code, ev[:3], ev[-2:], len(ev), flush=True)
        q = {"max_output_tokens": 16, "temperature": 0, "instructions": "You are terse. " + words, "input": "Say hello."}
        t0 = time.time(); r = httpx.post(url + "/v1/responses", json=q, timeout=300)
        b = r.json(); print("responses", rnd, r.status_code, round(time.time() - t0, 3), b.get("usage"), b.get("status"), flush=True)
        with httpx.stream("POST", url + "/v1/responses", json={**q, "stream": True}, timeout=300) as s:
            ev = [l[7:] for l in s.iter_lines() if l.startswith("event: ")]
        print("responses stream", rnd, s.status_code, ev[:3], ev[-2:], len(ev), flush=True)
finally:
    proc.terminate(); proc.wait(60)
    print(open("/tmp/serve_ep.log").read()[-1500:])
