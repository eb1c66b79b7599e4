"""The HTTP gate of ``treerl serve``: :class:`Guard`, an ASGI middleware in front of the app.

In this order, per request:

1. **API key** (``treerl serve --api-key`` or ``TREERL_API_KEY``): every route but
   ``GET /health`` needs ``Authorization: Bearer KEY`` (compared in constant time);
   otherwise 401 ``invalid_api_key``.
2. **Body size** (:attr:`ServeLimits.max_body_bytes <treerl.serve.limits.ServeLimits>`): a
   ``Content-Length`` above it gets 413 before the body is read; a body without one is
   counted as it arrives and refused once past the limit. The guard reads the body (the
   handlers read it whole anyway) and hands it on.
3. **Admission** (:attr:`ServeLimits.max_queued`): at most that many generation requests
   (``POST /v1/completions``, ``/v1/chat/completions``) are inside the server at once,
   waiting or running; another gets 429 with ``Retry-After`` (the ``openai`` client waits
   that long and retries).

Every refusal has the OpenAI error shape ``{"error": {"message", "type", "param", "code"}}``.
:func:`exposure_warning` is the line ``treerl serve`` prints when it listens beyond loopback
without a key.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import secrets
from dataclasses import dataclass
from typing import Any

from .limits import ServeLimits

API_KEY_ENV = "TREERL_API_KEY"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = ("/health",)


@dataclass
class GuardStats:
    """Requests refused by the guard since the server started."""

    unauthorized: int = 0
    too_large: int = 0
    busy: int = 0


class _TooLarge:
    pass


class Guard:
    """ASGI middleware (module docstring). ``api_key``: None serves without authentication.
    ``active``: generation requests inside the app now."""

    def __init__(self, app: Any, *, api_key: str | None = None, limits: ServeLimits | None = None):
        if api_key is not None and not api_key.strip():
            raise ValueError("the API key is empty: pass a non-empty --api-key (or unset TREERL_API_KEY)")
        self.app, self.limits = app, limits or ServeLimits()
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.active = 0
        self.stats = GuardStats()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":  # the API has none: refused before the app sees it
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if self._expected is not None and path not in OPEN_PATHS and not self._authorized(scope):
            self.stats.unauthorized += 1
            await _refuse(send, 401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with "
                                     "the key this server was started with", "authentication_error", "invalid_api_key",
                          [(b"www-authenticate", b"Bearer")])
            return
        limit = self.limits.max_body_bytes
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            self.stats.too_large += 1
            await _refuse(send, 413, _too_large(limit), "invalid_request_error", "request_too_large")
            return
        generation = scope.get("method") == "POST" and path in GENERATION_PATHS
        if generation and self.active >= self.limits.max_queued:
            self.stats.busy += 1
            await _refuse(send, 429, f"the server is busy: {self.active} requests are waiting or running (its limit, "
                                     f"treerl serve --max-queued); retry after {self.limits.retry_after_s} s",
                          "rate_limit_error", "server_busy",
                          [(b"retry-after", str(self.limits.retry_after_s).encode())])
            return
        if generation:
            self.active += 1
        try:
            body = await _read_body(receive, limit)
            if body is None:  # the client left before sending it all
                return
            if isinstance(body, _TooLarge):
                self.stats.too_large += 1
                await _refuse(send, 413, _too_large(limit), "invalid_request_error", "request_too_large")
                return
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # after the body: the client's disconnect

            await self.app(scope, replay, send)
        finally:
            if generation:
                self.active -= 1

    def _authorized(self, scope) -> bool:
        got = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                got = value
                break
        return hmac.compare_digest(got, self._expected)


def new_api_key() -> str:
    """A random key (the ``serve`` rollout backend's loopback server uses one per run)."""
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, port: int) -> str:
    """The warning for listening on ``host`` (not loopback) without an API key."""
    try:
        unspecified = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        unspecified = False
    who = (f"any host that can reach this machine on port {port} (all network interfaces)" if unspecified
           else f"any host that can reach {host}:{port}")
    return (f"treerl serve: WARNING: listening on {host}:{port} without an API key: {who} can generate and call "
            f"/update_weights_from_disk; "
            f"set {API_KEY_ENV} (or --api-key), or bind 127.0.0.1")


async def _read_body(receive, limit: int) -> bytes | _TooLarge | None:
    """The whole request body (the app reads it whole anyway), or :class:`_TooLarge` as soon
    as it passes ``limit`` bytes, or None if the client disconnected."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return _TooLarge()
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def _too_large(limit: int) -> str:
    return f"the request body is larger than this server takes ({limit} bytes, treerl serve --max-body-bytes)"


async def _refuse(send, status: int, message: str, type_: str, code: str, headers: list | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


__all__ = ["API_KEY_ENV", "Guard", "GuardStats", "exposure_warning", "is_loopback", "new_api_key"]
