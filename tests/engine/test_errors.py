"""engine/errors.py: the OpenAI error body and the errors the server raises itself."""

from __future__ import annotations

from engine.errors import ApiError, ClientClosed, ShuttingDown, invalid


def test_error_body_shape():
    body = ApiError(400, "bad", "messages", "invalid_value").body()
    assert body == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "invalid_value",
        }
    }


def test_invalid_and_the_servers_own_errors():
    e = invalid("bad", "messages.0")
    assert (e.status, e.param, e.code) == (400, "messages.0", "invalid_value")
    assert e.type == "invalid_request_error"
    assert (ShuttingDown().status, ShuttingDown().body()["error"]["type"]) == (503, "server_error")
    assert (ClientClosed().status, ClientClosed().code) == (499, "client_closed")
