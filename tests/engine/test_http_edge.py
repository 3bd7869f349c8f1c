"""engine/http_edge.py over real HTTP: CORS on every route and answer, errors included; the API key
guards everything but /health; a body over ``max_body_bytes`` is a 413 (an encoded body:
test_content_coding.py; the server and its other errors: test_server.py)."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine.generate import Engine
from tests.serving import AUTH, USER, hot_config, serve

PAGE = "http://localhost:3000"  # a web UI's origin


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


def preflight(url: str, method: str, origin: str = PAGE) -> httpx.Response:
    """A browser's CORS preflight of a ``method`` call with the API key and a JSON body."""
    return httpx.options(url, headers={"Origin": origin, "Access-Control-Request-Method": method,
                                       "Access-Control-Request-Headers": "authorization,content-type"})  # fmt: skip


def test_every_route_answers_a_cors_preflight_without_the_key(guarded):
    """A web UI's preflight (no key: browsers send none on it) of every route is a 200 allowing the
    page, the method and the key's header (it was a 405 or a 401: no browser could call us)."""
    routes = [r for r in guarded.app.routes if getattr(r, "methods", None)]
    assert len(routes) >= 9
    for route in routes:
        url = guarded.url + route.path.replace("{model_id:path}", "mlx-community/x")
        for method in route.methods - {"HEAD"}:
            r = preflight(url, method)
            assert r.status_code == 200, (route.path, method, r.status_code, r.text)
            assert r.headers["access-control-allow-origin"] == PAGE  # a page of this machine
            assert method in r.headers["access-control-allow-methods"]
            assert r.headers["access-control-allow-headers"] == "authorization,content-type"


def test_answers_and_errors_carry_cors_headers(guarded):
    """With an ``Origin``, every answer lets the page read it: a 200 (JSON or a stream), and the
    401, 404, 405, 400 and 413 errors, OpenAI's and Anthropic's."""
    u, page = guarded.url, {"Origin": PAGE}
    chat = {"messages": USER[:1], "max_tokens": 2}
    cases = [
        (200, httpx.get(u + "/v1/models", headers={**AUTH, **page})),
        (200, httpx.post(u + "/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": "hi"}]},
                         headers={**AUTH, **page}, timeout=60)),  # fmt: skip
        (200, httpx.post(u + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True},
                         headers={**AUTH, **page}, timeout=60)),  # fmt: skip
        (401, httpx.get(u + "/v1/models", headers=page)),
        (401, httpx.post(u + "/v1/messages", json={}, headers=page)),
        (404, httpx.get(u + "/v1/nothing", headers={**AUTH, **page})),
        (405, httpx.get(u + "/v1/chat/completions", headers={**AUTH, **page})),
        (400, httpx.post(u + "/v1/chat/completions", content=b"{", headers={**AUTH, **page})),
        (413, httpx.post(u + "/v1/chat/completions", content=b"x" * 5000, headers={**AUTH, **page})),
    ]
    for status, r in cases:
        assert r.status_code == status, (r.request.url, r.text)
        assert r.headers.get("access-control-allow-origin") == PAGE, (status, r.request.url, r.headers)
        exposed = r.headers["access-control-expose-headers"]
        assert "retry-after" in exposed and "x-tiered-kv-cache-tier" in exposed
    assert "access-control-allow-origin" not in httpx.get(u + "/health").headers  # no Origin: none


def test_allowed_origins_restrict_cors_and_none_turns_it_off(tiny_model_dir, tmp_path):
    """``TIERED_KV_ALLOWED_ORIGINS``: a listed origin is echoed (with ``Vary: Origin``), another
    one gets no CORS header and its preflight an OpenAI-shaped 400; none: no CORS at all."""
    config = hot_config(tmp_path / "a", allowed_origins=("http://ui.example",))
    with serve(lambda: Engine(tiny_model_dir, config), config) as live:
        url = live.url + "/v1/chat/completions"
        ok = preflight(url, "POST", "http://ui.example")
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://ui.example"
        r = httpx.get(live.url + "/v1/models", headers={"Origin": "http://ui.example"})
        assert r.headers["access-control-allow-origin"] == "http://ui.example"
        assert "Origin" in r.headers["vary"]
        refused = preflight(url, "POST", "http://elsewhere.example")
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "cors_disallowed"
        assert "access-control-allow-origin" not in refused.headers
        other = httpx.get(live.url + "/v1/models", headers={"Origin": "http://elsewhere.example"})
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    config = hot_config(tmp_path / "b", allowed_origins=())
    with serve(lambda: Engine(tiny_model_dir, config), config) as live:
        assert preflight(live.url + "/v1/chat/completions", "POST").status_code == 405
        r = httpx.get(live.url + "/v1/models", headers={"Origin": PAGE})
        assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("origins", [("local",), ("*",)])
def test_by_default_only_pages_of_this_machine_may_call_and_star_opens_it(tiny_model_dir, tmp_path, origins):
    """The default (``local``): pages served from this machine (any port, localhost, 127.0.0.1 or
    [::1]) may call; a site on the internet open in the same browser may not (with ``*`` it could
    use the model and, reading ``cached_tokens``, probe which prompts the cache holds). ``*``
    opens it to any page, as mlx_lm.server does."""
    config = hot_config(tmp_path, allowed_origins=origins)
    with serve(lambda: Engine(tiny_model_dir, config), config) as live:
        url = live.url + "/v1/chat/completions"
        for page in ("http://localhost:3000", "http://127.0.0.1:8080", "http://[::1]:5173", "tauri://localhost"):
            ok = preflight(url, "POST", page)
            assert ok.status_code == 200, (page, ok.text)
            assert ok.headers["access-control-allow-origin"] in (page, "*")
        for site in ("https://evil.example", "http://localhost.evil.example", "http://127.0.0.1.evil.example"):
            r = preflight(url, "POST", site)
            got = httpx.get(live.url + "/v1/models", headers={"Origin": site})
            if origins == ("*",):
                assert r.status_code == 200 and got.headers["access-control-allow-origin"] == "*"
            else:
                assert r.status_code == 400 and r.json()["error"]["code"] == "cors_disallowed", site
                assert "access-control-allow-origin" not in got.headers
