"""engine/sse.py over real HTTP: a streamed answer is text/event-stream, one ``data:`` chunk per
event, ``data: [DONE]`` last (the rest of streaming: test_server.py)."""

from __future__ import annotations

import json

import httpx

from tests.serving import USER


def test_stream_raw_sse_and_done(live):
    body = {"messages": USER, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert (
            r.headers["x-tiered-kv-cache-tier"] in ("hot", "none")
            and "x-tiered-kv-cached-tokens" in r.headers
        )
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1] if line.startswith("data: ")]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert not any("usage" in e and e["usage"] for e in events)  # no include_usage → no usage chunk
