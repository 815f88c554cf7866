"""The server's API keys (`--api-key`, else `VLLM_API_KEY`, else `JLLM_API_KEY`): every route
that renders a template or runs the model answers 401 without `Authorization: Bearer <key>`
(or Anthropic's `x-api-key: <key>`).

vLLM guards the paths under /v1, /v2, /inference and /cohere; jllm guards every path except
the probes and documentation listed in `OPEN_PATHS` (and CORS preflights), so /tokenize,
/detokenize and any route added later are covered too. Keys are compared as sha256 digests
with `secrets.compare_digest`, against every key, so the time taken says nothing about how
much of a key was right (vLLM's fix for CVE-2025-59425).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets

from starlette.datastructures import Headers

from jllm.entrypoints.anthropic.protocol import route_error_response, route_path

# Liveness, version and metrics probes and the API's own documentation need no key.
OPEN_PATHS = frozenset(
    {
        "/health",
        "/ping",
        "/version",
        "/load",
        "/metrics",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
    }
)


def api_keys(args: argparse.Namespace) -> list[str]:
    """The accepted keys: `--api-key` (one or several), else the VLLM_API_KEY environment
    variable (vLLM's precedence), else JLLM_API_KEY; empty values do not count."""
    given = args.api_key
    if isinstance(given, str):
        given = [given]
    keys = given or [os.environ.get("VLLM_API_KEY") or os.environ.get("JLLM_API_KEY")]
    return [k for k in keys if k]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class AuthenticationMiddleware:
    """Pure ASGI middleware: a guarded request without one of `keys` as its bearer token
    gets an OpenAI-style 401 body and never reaches a handler."""

    def __init__(self, app, keys: list[str]) -> None:
        self.app = app
        self.digests = [_digest(k) for k in keys]

    def authorized(self, headers: Headers) -> bool:
        scheme, _, token = (headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            # Anthropic's clients send the key as `x-api-key`.
            scheme, token = "bearer", headers.get("x-api-key") or ""
            if not token:
                return False
        digest = _digest(token.strip())
        match = False
        for known in self.digests:  # no early exit: every key is compared
            match |= secrets.compare_digest(digest, known)
        return match

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = route_path(scope)
        if path.rstrip("/") in OPEN_PATHS or self.authorized(Headers(scope=scope)):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})  # policy violation
        message = "Unauthorized: a valid API key is required."
        response = route_error_response(scope, message, 401)
        return await response(scope, receive, send)
