"""The service's ASGI middleware: body-size and body-time limits, JSON-only POSTs, request metrics.

Pure ASGI (not ``BaseHTTPMiddleware``) so streamed answers pass through unbuffered.
"""

import asyncio
import time

from ragkv_server.errors import RequestTimeoutError, error_response
from ragkv_server.service import Service

#: the content types of an NDJSON document upload
NDJSON = ("application/x-ndjson", "application/jsonl", "application/ndjson")


class BodyLimitMiddleware:
    """413 for bodies over ``max_body`` (JSON) or ``max_upload`` (NDJSON document uploads, streamed).

    JSON bodies are read here (bounded), so a chunked body without Content-Length is refused too;
    upload bodies pass through with a byte count the endpoint checks as it reads.
    """

    def __init__(self, app, max_body: int, max_upload: int, body_timeout_s: float = 30.0):
        self.app, self.max_body, self.max_upload = app, max_body, max_upload
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        receive = self._timed(receive, scope, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        upload = scope["method"] == "POST" and scope["path"] == "/v1/documents" and ctype in NDJSON
        limit = self.max_upload if upload else self.max_body
        try:
            declared = int(headers["content-length"]) if "content-length" in headers else None
        except ValueError:
            declared = None
        if declared is not None and declared > limit:
            await self._drain(receive, min(declared, 32 << 20))
            return await self._too_large(scope, send, limit)
        if upload:
            return await self.app(scope, receive, send)
        body, more, size = [], True, 0
        while more:
            try:
                msg = await receive()
            except RequestTimeoutError as e:
                resp = error_response(408, str(e), RequestTimeoutError.type)
                return await resp(scope, None, send)
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            more = msg.get("more_body", False)
            if size > limit:
                if more:
                    await self._drain(receive, 4 * limit)
                return await self._too_large(scope, send, limit)
            body.append(chunk)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _timed(self, receive, scope, send):
        """``receive`` that raises :class:`RequestTimeoutError` when the next body piece is late."""
        limit = self.body_timeout_s
        done = False

        async def timed():
            nonlocal done
            if done:  # the body has been read: later calls wait for a disconnect (no deadline)
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), limit)
            except TimeoutError:
                raise RequestTimeoutError(f"request body not received within {limit} s") from None
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                done = True
            return msg

        return timed

    @staticmethod
    async def _drain(receive, cap: int) -> None:
        """Read (and drop) up to ``cap`` bytes so the client can read the 413 instead of a reset."""
        n = 0
        while n <= cap:
            try:
                msg = await receive()
            except RequestTimeoutError:
                return
            if msg["type"] != "http.request":
                return
            n += len(msg.get("body", b""))
            if not msg.get("more_body", False):
                return

    @staticmethod
    async def _too_large(scope, send, limit: int) -> None:
        resp = error_response(413, f"request body larger than {limit} bytes", "request_too_large")
        await resp(scope, None, send)


class ContentTypeMiddleware:
    """415 for a POST whose body is not declared JSON (``application/json``, ``application/*+json``),
    or NDJSON on the upload route: a cross-site web page can only send "simple" requests
    (``text/plain``, forms, or no type), which must never be parsed as JSON and acted upon."""

    def __init__(self, app, json_paths: frozenset[str], ndjson_paths: tuple[str, ...] = ("/v1/documents",)):
        self.app, self.json_paths, self.ndjson_paths = app, json_paths, ndjson_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.json_paths:
            return await self.app(scope, receive, send)
        ctype = ""
        for k, v in scope["headers"]:
            if k.lower() == b"content-type":
                ctype = v.decode("latin-1").split(";")[0].strip().lower()
        ok = ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json"))
        if not ok and scope["path"] in self.ndjson_paths:
            ok = ctype in NDJSON
        if ok:
            return await self.app(scope, receive, send)
        allowed = "application/json" + (
            " or application/x-ndjson" if scope["path"] in self.ndjson_paths else ""
        )
        resp = error_response(
            415, f"unsupported content type {ctype or 'none'!r}; send {allowed}", "unsupported_media_type"
        )
        await resp(scope, receive, send)


class MetricsMiddleware:
    """Counts requests by method, route template and status; times them to the end of the body."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(msg):
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.service.http_requests.inc(scope["method"], path, str(status["code"]))
            self.service.http_latency.observe(time.perf_counter() - t0, path)
