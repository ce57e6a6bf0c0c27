"""Who may reach the server, and how much of a body it reads: the checks every request passes
before a route sees it, as an ASGI middleware around the app (`Guards`). Each refusal is an
OpenAI error body, and closes the connection (a body the client is still sending is not read).

- Host: a request that arrives on a loopback address must name the loopback in its Host header
  (`localhost`, `127.0.0.1`, `[::1]`, any port), else 421. A page whose DNS name an attacker
  rebinds to 127.0.0.1 reaches the server under its own name (DNS rebinding), and is refused.
- Origin: a browser names the page that sends a request; a page other than the server's own and
  those the operator allows (`allowed_origins`, which also turns CORS on: server.py) gets 403.
- API key: with one set, every `/v1/` route wants `Authorization: Bearer KEY`, else 401 (as
  llama-server and vLLM do); `/health` stays open.
- Content type: a body must be `application/json`, else 415. A page can send text/plain, a form
  or bytes with no type to any address without a CORS preflight, never JSON.
- Size: a body over `max_body_bytes` gets 413 as it arrives: at once when its Content-Length
  says so, else as soon as the bytes read pass the cap, chunked or not. uvicorn reads a body
  only as fast as the app takes it, so a body of any size costs the server about the cap.
"""

from __future__ import annotations

import hmac
import ipaddress

from .errors import BadRequest, error_bytes

BODY_METHODS = {"POST", "PUT", "PATCH"}


class BodyTooLarge(Exception):
    """Raised from `receive` once a body passes the cap; `Guards` answers 413."""


def is_loopback(name: str) -> bool:
    """Whether a host name or address literal names the loopback."""
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)         # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def host_name(host: str) -> str:
    """The name in a Host header, without its port (an IPv6 literal without its brackets)."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def same_origin(origin: str, host: str) -> bool:
    """Whether `origin` (scheme://host[:port]) is the server's own page, as the Host names it."""
    return "://" in origin and origin.split("://", 1)[1].lower() == host.strip().lower()


class Guards:
    def __init__(self, app, max_body_bytes: int, api_key: str | None = None,
                 allowed_origins: tuple[str, ...] = ()):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key
        self.allowed_origins = set(allowed_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self.check(scope)
        except BadRequest as exc:
            extra = [(b"www-authenticate", b"Bearer")] if exc.status == 401 else []
            return await refuse(send, exc, extra)
        started = False

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        read = 0

        async def counted_receive():
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_body_bytes:
                    raise BodyTooLarge
            return message

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge:
            if started:
                raise
            await refuse(send, self.too_large())

    def too_large(self) -> BadRequest:
        return BadRequest(f"the request body is over {self.max_body_bytes} bytes", status=413)

    def check(self, scope) -> None:
        """BadRequest for a request the module docstring's rules refuse."""
        headers: dict[str, list[str]] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), []).append(value.decode("latin-1"))
        hosts = headers.get("host", [])
        server = scope.get("server")
        if server and is_loopback(str(server[0])) and \
                (not hosts or not all(is_loopback(host_name(host)) for host in hosts)):
            raise BadRequest(f"this server answers on the loopback only to a Host naming it "
                             f"(localhost, 127.0.0.1, [::1]), got {', '.join(hosts) or 'none'}",
                             status=421)
        for origin in headers.get("origin", []):
            if not ("*" in self.allowed_origins or origin in self.allowed_origins or
                    any(same_origin(origin, host) for host in hosts)):
                raise BadRequest(f"requests from the page {origin!r} are not allowed "
                                 "(vocabspec serve --allowed-origins names those that are)",
                                 status=403)
        path, method = scope.get("path", ""), scope.get("method", "")
        if self.api_key is not None and method != "OPTIONS" and (path == "/v1" or path.startswith("/v1/")):
            given = " ".join(headers.get("authorization", []))
            scheme, _, key = given.partition(" ")
            # Header bytes came in as latin-1: back to those bytes, against the key's UTF-8.
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode("latin-1"),
                                                                     self.api_key.encode()):
                raise BadRequest("a valid API key is required: Authorization: Bearer KEY", status=401,
                                 code="invalid_api_key")
        if method in BODY_METHODS:
            kinds = headers.get("content-type", [])
            kind = kinds[0].split(";")[0].strip().lower() if len(kinds) == 1 else None
            if kind != "application/json":
                raise BadRequest("the request body must be JSON, sent as Content-Type: application/json "
                                 f"(got {', '.join(kinds) or 'no Content-Type'})", status=415)
            lengths = headers.get("content-length", [])
            if lengths and lengths[0].strip().isdigit() and int(lengths[0]) > self.max_body_bytes:
                raise self.too_large()


async def refuse(send, exc: BadRequest, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Send `exc` as the response and close the connection, whatever of the body is unread."""
    body = error_bytes(exc)
    await send({"type": "http.response.start", "status": exc.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})
