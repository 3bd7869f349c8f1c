"""The API's errors, as OpenAI shapes them (no transport, no MLX, no request schemas).

Every client mistake becomes an :class:`ApiError` carrying the HTTP status and the OpenAI error
body ``{"error": {"message", "type", "param", "code"}}``; the HTTP edge turns it into a response
(``engine/http_edge.py``). The engine thread and the transport raise :class:`ShuttingDown` and
:class:`ClientClosed` (worker, batch loop, SSE pump), so the errors live apart from the schemas.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the server refuses: ``status`` 4xx for client errors, 5xx for ours."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class ShuttingDown(ApiError):
    """The server stops before it served the request (or all of it): a 503 to retry elsewhere or
    later. Raised by the worker for queued and running requests alike (a running one's cache is
    stored first)."""

    def __init__(self) -> None:
        super().__init__(503, "the server is shutting down; retry the request",
                         code="server_shutting_down", type_="server_error")  # fmt: skip


class ClientClosed(ApiError):
    """The client went away (before its body was whole, before its job started, or while it ran):
    a 499 nobody reads, counted as such."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the request", code="client_closed")


def invalid(message: str, param: str) -> ApiError:
    """A 400 for a value the client sent that the server cannot take."""
    return ApiError(400, message, param=param, code="invalid_value")


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}

