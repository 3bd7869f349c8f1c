"""engine/http_edge.py over real HTTP: the API key guards everything but /health; a body over
``max_body_bytes`` is a 413 (an encoded body: test_content_coding.py; the server and its other
errors: test_server.py)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serving import AUTH


def test_oversize_body_413(guarded):
    body = {"messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(guarded.url + "/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_api_key_required_except_health(guarded):
    assert httpx.get(guarded.url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = httpx.get(guarded.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(guarded.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(guarded.url + "/metrics", headers={}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="nope", max_retries=0).models.list()
