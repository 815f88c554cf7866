"""Middlewares for `test_middleware.py`: a class and an async function, as vLLM's
--middleware takes them."""

from __future__ import annotations


class TagMiddleware:
    """An ASGI middleware that adds `x-tag: class` to every response."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-tag", b"class")]
            await send(message)

        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


async def tag_function(request, call_next):
    response = await call_next(request)
    response.headers["x-fn"] = "function"
    return response


NOT_A_MIDDLEWARE = 3
