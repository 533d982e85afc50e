"""The HTTP transport of `agentree serve`: FastAPI routes over `OpenAIServer`, request bodies
parsed into its pydantic models, OpenAI-style errors for every failure, and a body-size limit
checked before a body is read, and a request whose client hangs up before its answer stops
there. `agentree.commands.serve.ServerHandle` runs it on uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from agentree.commands.serve_api import (
    MAX_BODY_BYTES,
    APIError,
    ChatRequest,
    CompletionRequest,
    OpenAIServer,
    SamplingRequest,
)

log = logging.getLogger("agentree.commands.serve")

RequestT = TypeVar("RequestT", bound=SamplingRequest)


def build_app(api: OpenAIServer, max_body_bytes: int = MAX_BODY_BYTES) -> Any:
    """The FastAPI application answering the OpenAI routes (with and without `/v1`)."""
    app = FastAPI(title="agentree serve", docs_url=None, redoc_url=None)

    def error(e: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(_request: Any, e: APIError) -> JSONResponse:
        return error(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Any, e: HTTPException) -> JSONResponse:
        kind = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        text = f"no route {request.url.path}" if e.status_code == 404 else str(e.detail)
        return error(APIError(e.status_code, text, kind), getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def failed(request: Any, e: Exception) -> JSONResponse:
        # the server stays up; the client learns what happened, the log keeps the traceback
        log.error("request to %s failed", request.url.path, exc_info=e)
        return error(APIError(500, f"{type(e).__name__}: {e}", "server_error"))

    # The body is parsed here rather than by FastAPI's parameter binding, which reads JSON only
    # under a JSON Content-Type: `curl -d` (form-encoded by default) must work as it always did.
    async def completions(request: Request) -> Any:
        req = _parse(CompletionRequest, await request.body())
        if req.stream:
            return _Events(api.stream(req))
        return await _unless_hung_up(request, api.completions(req))

    async def chat(request: Request) -> Any:
        req = _parse(ChatRequest, await request.body())
        if req.stream:
            return _Events(api.stream(req))
        return await _unless_hung_up(request, api.chat(req))

    for prefix in ("/v1", ""):
        for path, endpoint, method in (
            ("/models", api.models, "GET"),
            ("/health", _health, "GET"),
            ("/completions", completions, "POST"),
            ("/chat/completions", chat, "POST"),
        ):
            # response_model=None: the builders' dicts go out as they are, unvalidated
            app.add_api_route(prefix + path, endpoint, methods=[method], response_model=None)
    return _BodyLimit(app, max_body_bytes)


async def _health() -> dict[str, str]:
    return {"status": "ok"}


class _Events(StreamingResponse):
    """A stream's chunks as server-sent events, then `[DONE]` (`OpenAIServer.stream`; the
    request was checked before this, so an invalid one is still answered with its status).
    However the response ends (Starlette stops it when the client hangs up), the chunks are
    closed, which abandons a request not yet done."""

    def __init__(self, chunks: AsyncIterator[dict[str, Any]]) -> None:
        async def lines() -> AsyncIterator[str]:
            async with contextlib.aclosing(chunks):
                async for c in chunks:
                    yield f"data: {json.dumps(c)}\n\n"
            yield "data: [DONE]\n\n"

        self._lines = lines()
        super().__init__(self._lines, media_type="text/event-stream")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._lines.aclose()


async def _unless_hung_up(request: Request, answer: Awaitable[dict[str, Any]]) -> Any:
    """`answer`'s response; if the client hangs up first, `answer` is cancelled, which abandons
    its request (`OpenAIServer._generate`), and the reply goes nowhere."""
    work = asyncio.ensure_future(answer)
    hung_up = asyncio.ensure_future(_hang_up(request.receive))
    try:
        await asyncio.wait((work, hung_up), return_when=asyncio.FIRST_COMPLETED)
    finally:
        hung_up.cancel()
        work.cancel()  # a no-op once it is done
        await asyncio.wait((work,))
    if work.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return work.result()


async def _hang_up(receive: Any) -> None:
    """Returns when the client has closed the connection (its body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _parse(model: type[RequestT], raw: bytes) -> RequestT:
    """The request model of a body: 400 when it is not a JSON object, 422 (naming the field)
    when a field has the wrong type or is out of range."""
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(x) for x in first["loc"]]
        if first["type"] == "json_invalid":
            raise APIError(400, "request body is not valid JSON") from None
        if not loc:
            raise APIError(400, "request body must be a JSON object") from None
        raise APIError(422, f"{'.'.join(loc)}: {first['msg']}", param=loc[0]) from None


class _BodyLimit:
    """ASGI middleware: a Content-Length that is not a count is a 400 and one over the limit a
    413, answered before the body is read; a chunked body is cut off at the limit the same way."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and not length.isdigit():
            await _reply(send, APIError(400, "Content-Length must be a non-negative integer"))
            return
        if length is not None and int(length) > self.limit:
            await _reply(send, self._too_large())
            return
        seen = 0

        async def counted() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # answered by the app's APIError handler
                raise self._too_large()
            return message

        await self.app(scope, counted, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body is larger than {self.limit} bytes")


async def _reply(send: Any, e: APIError) -> None:
    data = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    # the unread body stays on the socket: the connection cannot be reused
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
