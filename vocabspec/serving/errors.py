"""A refused request as OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.

Every answer the server gives other than a completion is one of these, with its status: a 4xx
for anything the client sent (a field out of range, a body too large, a missing API key), a 503
while the server is busy or stopping, a 500 only for a failure of the server's own.
"""

from __future__ import annotations

import json


class BadRequest(Exception):
    """A request the server refuses: `status` (400 unless said), the field at fault (`param`)
    and OpenAI's error `code` where it has one."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_kind(status: int) -> str:
    """OpenAI's error `type` for a status (a missing API key is an invalid request there too,
    its code "invalid_api_key")."""
    if status == 503:
        return "server_busy"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(exc: BadRequest) -> dict:
    return {"error": {"message": readable(exc.message), "type": error_kind(exc.status),
                      "param": readable(exc.param), "code": exc.code}}


def readable(text: str | None) -> str | None:
    """Text that UTF-8 can carry: a message quoting the client's field names or values may hold
    a lone surrogate they sent, written out here as its escape (\\ud800)."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_bytes(exc: BadRequest) -> bytes:
    return json.dumps(error_body(exc)).encode()
