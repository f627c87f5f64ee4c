"""The ragkv HTTP service (FastAPI): ingest, query, an OpenAI-compatible chat endpoint, health, metrics.

``python -m apps.server [--config FILE] [--host H] [--port P] ...`` or ``ragkv serve``; API reference
in docs/API.md. Errors are ``{"error": {"message", "type", "code"}}`` with 401 / 403 / 404 / 408 / 413 /
422 / 429 / 503 for a missing or wrong API key, a key without write scope, unknown ids, a body too slow
to arrive, too-large bodies or prompts, bad input and a busy or stopping server.

With API keys configured every route but ``/healthz`` needs one (FastAPI security dependencies:
``Authorization: Bearer KEY`` or ``X-API-Key: KEY``): reads a read or write key, anything that writes
(ingest, delete, completions with ``save``) a write key. POST bodies must declare a JSON (or, for
uploads, NDJSON) content type, so a web page cannot post a "simple" cross-site request (415); the
Host header is checked against ``allowed_hosts`` (Starlette's ``TrustedHostMiddleware``, against DNS
rebinding). Responses are strict JSON (non-finite numbers become null) and error bodies never carry
the text of an unexpected exception.
"""

import argparse
import asyncio
import gc
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request, Security
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.routing import Match

from apps import openai_compat as oc
from apps import schemas as sc
from apps.config import ConfigError, Settings, load_settings
from apps.metrics import CONTENT_TYPE
from apps.service import (
    STAT_KEYS,
    DataDirLocked,
    Final,
    InvalidRequestError,
    NotFoundError,
    QuerySpec,
    Service,
    ServiceError,
    lock_data_dir,
)
from integrations.common import fold_messages
from integrations.vllm.client import VllmServerError, VllmUnavailableError
from ragkv.blend.gate import gate_state
from ragkv.generate import SamplingParams, request_params
from ragkv.kv import KVMismatchError
from ragkv.model import PromptTooLongError

log = logging.getLogger("ragkv.server")
NDJSON = ("application/x-ndjson", "application/jsonl", "application/ndjson")
ERRORS = {
    401: {"model": sc.ErrorResponse, "description": "API keys are configured: missing or unknown key"},
    403: {"model": sc.ErrorResponse, "description": "the key has no write scope"},
    404: {"model": sc.ErrorResponse, "description": "unknown document or chunk id"},
    413: {"model": sc.ErrorResponse, "description": "request body, or prompt + max_tokens, too large"},
    415: {"model": sc.ErrorResponse, "description": "a POST body not declared JSON (or NDJSON for uploads)"},
    422: {"model": sc.ErrorResponse, "description": "invalid input"},
    429: {"model": sc.ErrorResponse, "description": "busy: the queue is full, retry later"},
    502: {
        "model": sc.ErrorResponse,
        "description": "generation 'vllm': the vLLM server answered with an error",
    },
    503: {
        "model": sc.ErrorResponse,
        "description": "waited too long for a worker, shutting down, or vLLM down",
    },
}


# ---- errors ------------------------------------------------------------------------------------------
def error_json(status: int, message: str, type_: str, details=None) -> dict:
    body = {"message": message, "type": type_, "code": status}
    if details is not None:
        body["details"] = details
    return {"error": body}


def error_response(
    status: int, message: str, type_: str, details=None, headers: dict | None = None
) -> JSONResponse:
    """The error body with its status (Retry-After on 429/503, WWW-Authenticate on 401)."""
    headers = dict(headers or {})
    if status in (429, 503):
        headers["Retry-After"] = "1"
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if status == 408:  # the rest of a late body is not waited for: the connection ends with this answer
        headers["Connection"] = "close"
    return StrictJSONResponse(
        error_json(status, message, type_, details), status_code=status, headers=headers or None
    )


class UnauthorizedError(ServiceError):
    status = 401
    type = "authentication_error"


class ForbiddenError(ServiceError):
    status = 403
    type = "permission_error"


class RequestTimeoutError(ServiceError):
    status = 408
    type = "request_timeout"


def classify(exc: BaseException) -> tuple[int, str, str]:
    """``(status, type, message)`` of an exception raised while serving a request."""
    if isinstance(exc, ServiceError):
        return exc.status, exc.type, str(exc)
    if isinstance(exc, VllmUnavailableError):  # backend 'vllm': the server is down or too slow
        return 503, "service_unavailable", f"the vLLM server is unavailable: {exc}"
    if isinstance(exc, VllmServerError):  # it answered with an error or a malformed response
        return 502, "bad_gateway", f"the vLLM server failed: {exc}"
    if isinstance(exc, PromptTooLongError):
        return 413, "context_length_exceeded", str(exc)
    if isinstance(exc, KVMismatchError):  # stored KV of another model or shape: the server's data
        return 500, "internal_error", "stored KV does not fit the served model; see the server log"
    if isinstance(exc, ValueError):  # ragkv's typed input errors (unknown mode, empty question ...)
        if _raised_by_us(exc):
            return 422, "invalid_request_error", str(exc)
        # raised inside a library (torch, numpy ...): a fault of the server, not of the request
        return 500, "internal_error", f"internal error ({type(exc).__name__}); see the server log"
    if isinstance(exc, ConnectionError):  # e.g. the Redis store is down (its address stays in the log)
        return 503, "service_unavailable", "a backend is unreachable; see the server log"
    return 500, "internal_error", f"internal error ({type(exc).__name__}); see the server log"


def report(exc: BaseException, request: Request | None = None) -> tuple[int, str, str]:
    """:func:`classify` ``exc`` and log it when it is the server's side (5xx; a 500, a fault of ours,
    with its traceback): a request's error is the client's business, a server's must reach the operator."""
    status, kind, message = classify(exc)
    where = f"{request.method} {request.url.path}" if request is not None else "a request"
    if status == 500:
        log.error("error serving %s: %s", where, message, exc_info=exc)
    elif status > 500:  # a backend down or busy (502/503): an operational event, not a bug
        log.warning("error serving %s: %s: %s", where, message, exc)
    return status, kind, message


def _raised_by_us(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by ragkv's own code (its message is meant for users), not deep inside
    a library (torch, numpy, the stdlib ...), whose text may describe internals."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return True
    module = last.tb_frame.f_globals.get("__name__", "")
    return module.split(".")[0] in ("ragkv", "apps", "integrations")


def _finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, inf) replaced by None: JSON has no such numbers."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def strict_json(obj: Any) -> str:
    """Strict JSON text of ``obj`` (non-finite floats as null; never ``NaN`` or ``Infinity``)."""
    return json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class StrictJSONResponse(JSONResponse):
    """Every JSON response of the service: strict JSON (see :func:`strict_json`)."""

    def render(self, content: Any) -> bytes:
        return strict_json(content).encode()


def _validation_message(errors: list) -> str:
    parts = []
    for e in errors[:3]:
        if (
            e.get("type") == "json_invalid"
        ):  # loc holds a character offset: keep only named parts (NDJSON line)
            loc = ".".join(str(x) for x in e.get("loc", ()) if isinstance(x, str) and x != "body")
            msg = f"not valid JSON ({(e.get('ctx') or {}).get('error', 'decode error')})"
        else:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            msg = e.get("msg", "invalid")
        parts.append(f"{loc or 'body'}: {msg}")
    more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
    return "invalid request: " + "; ".join(parts) + more


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = jsonable_encoder(exc.errors(), custom_encoder={Exception: str, bytes: lambda b: repr(b)})
        for e in errors:
            e.pop("input", None)  # do not echo (possibly huge) input back
        return error_response(422, _validation_message(errors), "invalid_request_error", errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if (
            exc.status_code == 400
        ):  # FastAPI's "error parsing the body" (e.g. not UTF-8): bad input, like bad JSON
            return error_response(422, f"invalid request body: {exc.detail}", "invalid_request_error")
        kind = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status_code, "http_error"
        )
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # every method the path allows, not just its first route's
            methods = {
                m
                for r in request.app.routes
                if r.matches(request.scope)[0] != Match.NONE
                for m in getattr(r, "methods", None) or ()
            }
            if methods:
                headers["Allow"] = ", ".join(sorted(methods))
        return error_response(exc.status_code, str(exc.detail), kind, headers=headers)

    async def _known(request: Request, exc: Exception):
        status, kind, message = report(exc, request)
        return error_response(status, message, kind)

    # typed errors are answered by the inner exception middleware (not re-raised, not logged as crashes)
    for cls in (ServiceError, VllmServerError, PromptTooLongError, ValueError, ConnectionError):
        app.add_exception_handler(cls, _known)

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception):
        status, kind, message = report(exc, request)
        return error_response(status, message, kind)


# ---- ASGI middleware ---------------------------------------------------------------------------------
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


# ---- helpers -----------------------------------------------------------------------------------------
def _source(r) -> dict:
    return {
        "chunk_id": r.chunk_id,
        "doc_id": r.doc_id,
        "seq": r.seq,
        "kv_key": r.kv_key,
        "score": float(r.score),
        "text": r.text,
        "metadata": r.metadata,
    }


def _stats(f: Final) -> dict:
    return jsonable_encoder({k: f.answer.stats[k] for k in STAT_KEYS if k in f.answer.stats})


def _timings(f: Final) -> dict:
    t = f.answer.timings
    return {
        "queue_s": f.queue_s,
        "retrieval_s": t["retrieval_s"],
        "kv_fetch_s": t["kv_fetch_s"],
        "ttft_s": t["ttft_s"],
        "total_s": t["total_s"],
    }


def _usage(f: Final) -> dict:
    return {
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    }


def _sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else strict_json(data)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


async def _answer_events(svc: Service, spec: QuerySpec, disconnected) -> tuple[str, Final, list]:
    """``svc.answer`` keeping the token events (their log-probabilities): text, :class:`Final`, events."""
    parts, events, final = [], [], None
    async for item in svc.stream(spec, disconnected):
        if isinstance(item, Final):
            final = item
        else:
            parts.append(item.text)
            if item.is_token:
                events.append(item)
    assert final is not None
    return "".join(parts), final, events


async def _start_stream(it: AsyncIterator) -> tuple[object | None, bool]:
    """The first item of a stream (errors surface here, before any byte is sent) and whether there is one."""
    try:
        return await it.__anext__(), True
    except StopAsyncIteration:
        return None, False


async def _openai_events(
    it: AsyncIterator,
    first,
    more: bool,
    render: Callable[[Any], Iterator[str]],
    head: list[str] | None = None,
    path: str = "/v1/chat/completions",
) -> AsyncIterator[str]:
    """An OpenAI SSE stream: ``head``, ``render(item)`` for each item, then ``data: [DONE]``; an error
    after the headers becomes an error chunk. Closes ``it`` (which stops a generation that is cut off)."""
    item, has = first, more
    try:
        for line in head or ():
            yield line
        while has:
            for line in render(item):
                yield line
            try:
                item = await it.__anext__()
            except StopAsyncIteration:
                has = False
        yield _sse("[DONE]")
    except Exception as e:  # noqa: BLE001 - after the headers, errors become an error chunk
        status, kind, message = report(e)
        yield _sse(oc.stream_error(status, message, kind, path))
    finally:
        await it.aclose()


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---- authentication ----------------------------------------------------------------------------------
_bearer = HTTPBearer(auto_error=False, description="API key: `Authorization: Bearer KEY`")
_api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="API key: `X-API-Key: KEY`")


def scope_of(settings: Settings, key: str) -> str | None:
    """'write', 'read' or None (unknown) for a presented key; constant-time comparisons, all keys tried."""
    found = None
    for scope, keys in (("write", settings.api_keys), ("read", settings.read_api_keys)):
        for k in keys:
            if hmac.compare_digest(k.get_secret_value().encode(), key.encode()) and found is None:
                found = scope
    return found


def auth_dependency(settings: Settings, need: str) -> Callable:
    """A FastAPI security dependency: ``need`` ('write' or 'read') scope when keys are configured;
    returns the caller's scope.

    No keys configured: everything is open (the service then warns when bound beyond loopback).
    With keys, every route that uses it needs one: writes a write key, reads a read or write key.
    Missing or unknown key: 401; a read-only key on a write: 403."""
    required = bool(settings.api_keys or settings.read_api_keys)

    async def check(
        bearer: HTTPAuthorizationCredentials | None = Security(_bearer),
        header_key: str | None = Security(_api_key_header),
    ) -> str | None:
        if not required:
            return None
        key = bearer.credentials if bearer is not None else header_key
        if not key:
            raise UnauthorizedError("this endpoint needs an API key (Authorization: Bearer KEY or X-API-Key)")
        scope = scope_of(settings, key)
        if scope is None:
            raise UnauthorizedError("unknown API key")
        if need == "write" and scope != "write":
            raise ForbiddenError("this API key is read-only; ingest and delete need a write key")
        return scope

    return check


async def _open_scope() -> None:
    """No API keys configured: every caller may write (loopback development)."""
    return None


# ---- the app -----------------------------------------------------------------------------------------
def create_app(settings: Settings | None = None, service: Service | None = None) -> FastAPI:
    """The FastAPI app; the model loads at startup (or pass a ready ``service``)."""
    settings = settings or (service.settings if service else load_settings())
    svc = service or Service(settings)
    S = sc.build_schemas(settings)
    model_name = settings.model_name()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(svc.start)
        # the start-up objects (model, tokenizers, embedder, modules: ~0.5M) leave the collector's
        # scans: a full collection over them held the GIL ~0.35 s, freezing /healthz during ingest
        gc.collect()
        gc.freeze()
        log.info("ragkv service ready: model %s, data %s", settings.model, settings.data_dir)
        warn_exposure(settings)
        yield
        await asyncio.to_thread(svc.close)

    app = FastAPI(
        title="ragkv",
        version="0.1.0",
        lifespan=lifespan,
        default_response_class=StrictJSONResponse,
        description="RAG with reused, blended chunk KV. Errors: {error: {message, type, code}}.",
    )
    app.state.service = svc
    _install_error_handlers(app)
    # an endpoint that needs no key declares no security scheme (open reads are not "ignored auth")
    keys = bool(settings.api_keys or settings.read_api_keys)
    can_write = [Depends(auth_dependency(settings, "write"))] if keys else []
    can_read = [Depends(auth_dependency(settings, "read"))] if keys else []
    caller_scope = auth_dependency(settings, "read") if keys else _open_scope

    def sampling(
        max_tokens, temperature, top_p, seed, stop, constraint=None, logprobs=None
    ) -> SamplingParams:
        return request_params(
            max_tokens,
            temperature,
            top_p,
            seed=seed,
            stop=stop,
            constraint=constraint,
            logprobs=logprobs,
            default_max_tokens=settings.max_new_tokens,
        )

    # -- documents
    upload_body = {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/IngestRequest"}},
                "application/x-ndjson": {
                    "schema": {"type": "string", "description": "one DocumentIn JSON per line"}
                },
            },
        }
    }

    @app.post(
        "/v1/documents",
        response_model=sc.IngestResponse,
        responses=ERRORS,
        openapi_extra=upload_body,
        tags=["documents"],
        summary="Ingest documents (idempotent; all or none)",
        dependencies=can_write,
    )
    async def ingest(request: Request):
        """JSON ``{"documents": [{id?, text, metadata?}]}``, or NDJSON (one document per line, for large
        uploads: read as it streams in). Re-sending an unchanged document changes nothing."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype in NDJSON:
            docs = await _read_ndjson(
                request, S.DocumentIn, settings.max_upload_bytes, settings.max_upload_line_bytes
            )
        else:  # application/json (ContentTypeMiddleware refused anything else); parsed off the loop
            docs = await asyncio.to_thread(_parse_ingest_json, S.IngestRequest, await request.body())
        return await svc.run_ingest(lambda cancel: svc.ingest(docs, cancel), request.is_disconnected)

    @app.get(
        "/v1/documents",
        response_model=sc.DocumentList,
        tags=["documents"],
        summary="List document ids",
        dependencies=can_read,
    )
    async def list_documents():
        ids = await asyncio.get_running_loop().run_in_executor(svc.read_pool, svc.rag.index.document_ids)
        return {"ids": ids, "total": len(ids)}

    @app.delete(
        "/v1/documents/{doc_id}",
        response_model=sc.DeleteResponse,
        responses=ERRORS,
        tags=["documents"],
        summary="Delete a document, its chunks and their KV",
        dependencies=can_write,
    )
    async def delete_document(doc_id: str, request: Request):
        await svc.run_ingest(lambda cancel: svc.delete(doc_id), request.is_disconnected)
        return {"id": doc_id, "deleted": True}

    @app.post(
        "/v1/admin/gc",
        response_model=sc.GarbageReport,
        responses=ERRORS,
        tags=["documents"],
        summary="Delete stored chunk KV that no document references",
        dependencies=can_write,
    )
    async def collect_garbage(request: Request):
        """Collect the chunk store: KV no chunk of the index references is deleted (runs in the
        ingest queue, so never beside an ingest). Only for a store this service owns."""
        return await svc.run_ingest(lambda cancel: svc.rag.collect_garbage(), request.is_disconnected)

    # -- query
    @app.post(
        "/v1/query",
        response_model=sc.QueryResponse,
        responses={
            **ERRORS,
            200: {"content": {"text/event-stream": {}}, "description": "the answer (or SSE when stream)"},
        },
        tags=["query"],
        summary="Answer a question over retrieved (or given) chunks",
        dependencies=can_read,
    )
    async def query(req: S.QueryRequest, request: Request):
        """Retrieve ``top_k`` chunks (or use ``chunk_ids``) and answer with their stored KV reused
        (``mode``); ``stream=true`` sends ``token`` events then one ``answer`` event."""
        spec = QuerySpec(
            req.question,
            req.chunk_ids,
            True,
            req.top_k,
            req.mode,
            req.ratio,
            sampling(req.max_tokens, req.temperature, req.top_p, req.seed, req.stop),
        )
        rid = "q-" + uuid.uuid4().hex[:16]
        if not req.stream:
            text, final = await svc.answer(spec, request.is_disconnected)
            return _query_body(rid, text, final)
        it = svc.stream(spec)
        first, more = await _start_stream(it)

        async def events():
            parts = []
            item, has = first, more
            try:
                while has:
                    if isinstance(item, Final):
                        yield _sse(_query_body(rid, "".join(parts), item), "answer")
                    elif item.is_token or item.text:  # a closing event only when it releases text
                        parts.append(item.text)
                        yield _sse(
                            {"text": item.text, "index": item.index, "token_id": item.token_id}, "token"
                        )
                    try:
                        item = await it.__anext__()
                    except StopAsyncIteration:
                        has = False
            except Exception as e:  # noqa: BLE001 - after the headers, errors become an event
                status, kind, message = report(e, request)
                yield _sse(error_json(status, message, kind), "error")
            finally:
                await it.aclose()

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    def _query_body(rid: str, text: str, f: Final) -> dict:
        return {
            "id": rid,
            "answer": text,
            "mode": f.answer.mode,
            "finish_reason": f.finish_reason,
            "sources": [_source(r) for r in f.answer.sources],
            "timings": _timings(f),
            "stats": _stats(f),
            "usage": _usage(f),
        }

    # -- OpenAI-compatible chat
    @app.post(
        "/v1/chat/completions",
        response_model=sc.ChatCompletion,
        responses={
            **oc.OPENAI_ERRORS,
            200: {"content": {"text/event-stream": {}}, "description": "the completion (or SSE chunks)"},
        },
        tags=["openai"],
        summary="OpenAI chat completions with retrieval and reused chunk KV",
        dependencies=can_read,
    )
    async def chat_completions(req: S.ChatCompletionRequest, request: Request):
        """The last user message is the question (earlier turns are prepended to it). Retrieval is
        automatic unless ``ragkv.chunk_ids`` names the chunks or ``ragkv.retrieve`` is false."""
        call = oc.chat_tool_call(req)  # a forced function call; what is not served: 400, never ignored
        oc.check_generation_options(req, settings.generation)
        # 400 for a refused schema
        constraint = call.constraint if call else oc.response_constraint(req.response_format, req.stop)
        call_id = "call_" + uuid.uuid4().hex[:24]
        logprobs = oc.chat_logprobs(req)
        pairs = [(m.role, m.text()) for m in req.messages]
        if not any(r == "user" and t.strip() for r, t in pairs):
            raise InvalidRequestError("messages must contain a user message with text")
        question = fold_messages(pairs)
        if len(question) > settings.max_question_chars:
            raise InvalidRequestError(f"conversation longer than {settings.max_question_chars} characters")
        o = req.ragkv or S.RagkvOptions()
        params = sampling(
            req.max_completion_tokens or req.max_tokens,
            req.temperature,
            req.top_p,
            req.seed,
            req.stop,
            constraint,
            logprobs,
        )
        spec = QuerySpec(question, o.chunk_ids, o.retrieve, o.top_k, o.mode, o.ratio, params)
        cid = "chatcmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())

        def logprobs_of(events: list) -> dict | None:
            """``choices[].logprobs`` of these token events (None when not asked for)."""
            if logprobs is None:
                return None
            return {"content": oc.chat_logprob_content(svc.rag.model, events), "refusal": None}

        if not req.stream:
            text, f, events = await _answer_events(svc, spec, request.is_disconnected)
            return {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text}
                        if call is None
                        else {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": oc.tool_call_message(call, call_id, text),
                        },
                        "logprobs": logprobs_of(events),
                        "finish_reason": f.finish_reason,
                    }
                ],
                "usage": oc.usage_with_details(_usage(f), f.answer.stats),
                "ragkv": _ragkv_info(f),
            }
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        it = svc.stream(spec)
        first, more = await _start_stream(it)

        def chunk(delta: dict, finish=None, lp: dict | None = None, **extra) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return _sse(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model_name,
                    "choices": [choice],
                    **extra,
                }
            )

        def delta(text: str) -> dict:
            if call is None:
                return {"content": text}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}

        def render(item) -> Iterator[str]:
            if not isinstance(item, Final):
                if item.is_token or item.text:  # a closing event only when it releases text
                    yield chunk(delta(item.text), lp=logprobs_of([item] if item.is_token else []))
                return
            yield chunk({}, item.finish_reason, ragkv=_ragkv_info(item))
            if include_usage:
                yield _sse(
                    {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model_name,
                        "choices": [],
                        "usage": oc.usage_with_details(_usage(item), item.answer.stats),
                    }
                )

        if call is None:
            head = [chunk({"role": "assistant", "content": ""})]
        else:  # the call's id and name first, then its arguments as they are generated
            (opening,) = oc.tool_call_message(call, call_id, "")
            head = [chunk({"role": "assistant", "content": None, "tool_calls": [{"index": 0, **opening}]})]
        return StreamingResponse(
            _openai_events(it, first, more, render, head), media_type="text/event-stream", headers=SSE_HEADERS
        )

    # -- OpenAI / vLLM-compatible completions (a drop-in for a vLLM server with the ragkv plugin)
    CompletionRequest = _bounded(oc.build_completion_request(settings))

    @app.post(
        "/v1/completions",
        responses={
            **oc.OPENAI_ERRORS,
            200: {"content": {"text/event-stream": {}}, "description": "the completion (or SSE chunks)"},
        },
        tags=["openai"],
        summary="OpenAI / vLLM completions; kv_transfer_params chunks served from the chunk store",
        dependencies=can_read,
    )
    async def completions(
        req: CompletionRequest, request: Request, scope: str | None = Depends(caller_scope)
    ):
        """vLLM's ``/v1/completions``: a token-id or text prompt; ``kv_transfer_params["ragkv"]`` names
        stored chunks (key, start, length) whose KV is blended in (docs/API.md); ``save`` (storing the
        KV of chunks computed here) needs a write key when keys are configured."""
        if req.model and req.model != model_name:
            raise NotFoundError(f"The model `{req.model}` does not exist.")
        oc.check_generation_options(req, settings.generation)
        rag = svc.rag
        blend = oc.blend_params(req.kv_transfer_params)
        if blend is not None and (
            len(blend.check_layers) > rag.model.config.num_layers
            or any(layer >= rag.model.config.num_layers for layer in blend.check_layers)
        ):
            raise oc.BadRequestError(
                f"kv_transfer_params: check_layers must be layers of the model (< {rag.model.config.num_layers})"
            )
        if blend is not None and blend.save and keys and scope != "write":
            raise ForbiddenError(
                "kv_transfer_params save=true writes to the chunk store: it needs a write key"
            )
        params = oc.sampling(req, rag.model)
        cid = "cmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())
        tids = bool(req.return_token_ids)
        # tokenized in the worker, after admission (its length was bounded by the schema), so big text
        # prompts queue like any other work instead of running on a shared pool ahead of it
        it = svc.run_stream(
            lambda wait: oc.completion_events(rag, oc.prompt_ids(rag.model, req.prompt), blend, params),
            request.is_disconnected if not req.stream else None,
        )
        first, more = await _start_stream(it)
        if not req.stream:
            item, has, parts = first, more, []
            try:
                while has and not isinstance(item, oc.Done):
                    parts.append(item)
                    item = await it.__anext__()
            finally:
                await it.aclose()
            svc.answers.inc(item.stats.get("mode", "full"))
            svc.tokens.inc(n=len(item.token_ids))
            lp = oc.completion_logprobs(rag.model, item.events) if params.logprobs is not None else None
            return oc.completion_response(cid, created, model_name, item, tids, lp)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        streamed = [0]  # characters of token text reported so far: the next text_offset

        def token_logprobs(item) -> dict | None:
            if params.logprobs is None:
                return None
            lp = oc.completion_logprobs(rag.model, [item] if item.is_token else [], streamed[0])
            streamed[0] += sum(len(t) for t in lp["tokens"])
            return lp

        def render(item) -> Iterator[str]:
            if not isinstance(item, oc.Done):
                if item.is_token or item.text:  # a closing event only when it releases text
                    tok = ([item.token_id] if item.is_token else []) if tids else None
                    lp = token_logprobs(item)
                    yield _sse(oc.completion_chunk(cid, created, model_name, item.text, None, tok, lp))
                return
            svc.answers.inc(item.stats.get("mode", "full"))
            svc.tokens.inc(n=len(item.token_ids))
            end = oc.completion_chunk(cid, created, model_name, "", item.finish_reason, [] if tids else None)
            yield _sse({**end, "ragkv": item.stats})
            if include_usage:
                yield _sse(oc.usage_chunk(cid, created, model_name, item))

        return StreamingResponse(
            _openai_events(it, first, more, render, path="/v1/completions"),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    def _ragkv_info(f: Final) -> dict:
        return {"sources": [_source(r) for r in f.answer.sources], "timings": _timings(f), "stats": _stats(f)}

    @app.get(
        "/v1/models",
        response_model=sc.ModelList,
        tags=["openai"],
        summary="The served model",
        dependencies=can_read,
    )
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": svc.started_at, "owned_by": "ragkv"}],
        }

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=sc.ModelCard,
        responses={404: oc.OPENAI_ERRORS[404]},
        tags=["openai"],
        summary="One served model (404 for any other id)",
        dependencies=can_read,
    )
    async def model_card(model_id: str):
        if model_id != model_name:
            raise NotFoundError(f"The model `{model_id}` does not exist.")
        return {"id": model_name, "object": "model", "created": svc.started_at, "owned_by": "ragkv"}

    # -- operations
    @app.get("/healthz", response_model=sc.Health, tags=["ops"], summary="Liveness and size")
    async def healthz():
        rag = svc.rag
        docs, chunks = rag.index.num_documents, len(rag.index)  # in-memory counts: no thread, no SQLite
        return {
            "status": "ok",
            "model": model_name,
            "generation": settings.generation,
            "documents": docs,
            "chunks": chunks,
            "running": svc.queries.running,
            "queued": svc.queries.queued,
            "blend_gate": gate_state(rag.model),
        }

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        tags=["ops"],
        summary="Prometheus metrics",
        dependencies=can_read,
    )
    async def metrics():
        text = await asyncio.get_running_loop().run_in_executor(svc.ops_pool, svc.registry.render)
        return Response(text, media_type=CONTENT_TYPE)

    def openapi() -> dict:
        """The generated schema plus the ingest body models (read by hand, so FastAPI does not list them)."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            comps = doc.setdefault("components", {}).setdefault("schemas", {})
            ingest_schema = S.IngestRequest.model_json_schema(ref_template="#/components/schemas/{model}")
            comps.update(ingest_schema.pop("$defs", {}))
            comps["IngestRequest"] = ingest_schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(
        BodyLimitMiddleware,
        max_body=settings.max_body_bytes,
        max_upload=settings.max_upload_bytes,
        body_timeout_s=settings.body_timeout_s,
    )
    app.add_middleware(oc.OpenAIErrorMiddleware)  # OpenAI routes: OpenAI's error shape and statuses
    # outside the body limit: a body of the wrong type is refused before it is buffered
    posts = frozenset(r.path for r in app.routes if "POST" in (getattr(r, "methods", None) or ()))
    app.add_middleware(ContentTypeMiddleware, json_paths=posts)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=settings.host_allow_list())
    app.add_middleware(MetricsMiddleware, service=svc)
    return app


def warn_exposure(settings: Settings) -> None:
    """Warn when the service is reachable beyond this machine and anyone may write to it."""
    if not settings.is_loopback() and not settings.api_keys:
        log.warning(
            "serving on %s without API keys: anyone who can reach this address can ingest and delete "
            "documents; set api_keys (RAGKV_API_KEYS) or bind to 127.0.0.1",
            settings.host,
        )
    if "*" in settings.host_allow_list() and settings.allowed_hosts is None:
        log.info(
            "Host header not checked (host %s is not loopback); set allowed_hosts to check it", settings.host
        )


async def _read_ndjson(request: Request, model, limit: int, line_limit: int) -> list[dict]:
    """An NDJSON upload, one document per line: read as it streams in (at most ``limit`` bytes, lines
    of at most ``line_limit``), each piece scanned once for newlines and each line joined once (linear
    time), then validated off the event loop."""
    lines: list[bytes] = []
    partial: list[bytes] = []
    partial_len = size = 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise _TooLarge(f"upload larger than {limit} bytes")
        start = 0
        while (nl := piece.find(b"\n", start)) >= 0:
            partial_len += nl - start
            if partial_len > line_limit:
                raise _TooLarge(f"upload line {len(lines) + 1} longer than {line_limit} bytes")
            partial.append(piece[start:nl])
            lines.append(b"".join(partial))
            partial, partial_len, start = [], 0, nl + 1
        partial_len += len(piece) - start
        if partial_len > line_limit:
            raise _TooLarge(f"upload line {len(lines) + 1} longer than {line_limit} bytes")
        partial.append(piece[start:])
    lines.append(b"".join(partial))
    return await asyncio.to_thread(_parse_ndjson_lines, model, lines)


def _parse_ndjson_lines(model, lines: list[bytes]) -> list[dict]:
    """Validate NDJSON lines as documents (blank lines skipped); 422 naming the first bad line."""
    docs = []
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            docs.append(model.model_validate_json(line).model_dump())
        except ValidationError as e:
            errors = [
                {**err, "loc": ["body", f"line {line_no}", *err.get("loc", ())]}
                for err in e.errors(include_url=False)
            ]
            raise RequestValidationError(errors) from None
    if not docs:
        raise InvalidRequestError("the upload holds no documents")
    return docs


def _parse_ingest_json(model, raw: bytes) -> list[dict]:
    """Validate a JSON ingest body (run off the event loop: a body of megabytes takes a while)."""
    try:
        req = model.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None
    return [d.model_dump() for d in req.documents]


class _TooLarge(ServiceError):
    status = 413
    type = "request_too_large"


#: most stop strings a completion may carry (each is searched in the text after every token)
MAX_STOPS = 4
_Stop = Annotated[str, Field(min_length=1, max_length=64)]


def _bounded(model: type[BaseModel]) -> type[BaseModel]:
    """``/v1/completions``' request model with a bounded ``stop`` list (stated in the schema)."""

    class CompletionRequest(model):
        stop: _Stop | Annotated[list[_Stop], Field(max_length=MAX_STOPS)] | None = Field(
            None, description=f"at most {MAX_STOPS} stop strings"
        )

    CompletionRequest.__doc__ = model.__doc__
    return CompletionRequest


# ---- command line ------------------------------------------------------------------------------------
def build_parser(prog: str = "python -m apps.server") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog, description="Serve ragkv over HTTP (settings: file < env < flags)."
    )
    ap.add_argument("--config", help="settings file (.toml/.yaml/.json); default $RAGKV_CONFIG")
    ap.add_argument("--host")
    ap.add_argument("--port", type=int)
    ap.add_argument("--model", help="local folder or hub id")
    ap.add_argument("--data-dir", help="index and (default) KV store directory")
    ap.add_argument("--store", help="chunk KV store URL: file:///dir, redis://host:6379/0, memory://")
    ap.add_argument("--max-concurrency", type=int)
    ap.add_argument("--max-queue", type=int)
    ap.add_argument(
        "--generation",
        choices=["threads", "engine", "vllm"],
        help="where answers are generated: worker threads, ragkv.engine batching, or a vLLM server",
    )
    ap.add_argument("--vllm-url", help="base URL of the vLLM server (--generation vllm)")
    ap.add_argument("--torch-threads", type=int)
    ap.add_argument(
        "--prompt-file",
        help="JSON with the RAG prompt settings (instruction, question_template, system, examples), "
        "e.g. the demo corpus ragkv/demo/corpus.json",
    )
    ap.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    return ap


def settings_from_args(args: argparse.Namespace) -> Settings:
    return load_settings(
        args.config,
        host=args.host,
        port=args.port,
        model=args.model,
        data_dir=args.data_dir,
        store=args.store,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        torch_threads=args.torch_threads,
        prompt_file=args.prompt_file,
        generation=args.generation,
        vllm_url=args.vllm_url,
        log_level=args.log_level,
    )


def main(argv: list[str] | None = None, prog: str = "python -m apps.server") -> int:
    import uvicorn

    args = build_parser(prog).parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ConfigError as e:
        print(f"error: {e}")
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:  # a clear message now rather than a traceback from the lifespan (the server takes it for good)
        settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_data_dir(settings.data_dir).close()
    except DataDirLocked as e:
        print(f"error: {e}")
        return 2
    uvicorn.run(create_app(settings), **uvicorn_options(settings))
    return 0


def uvicorn_options(settings: Settings) -> dict:
    """uvicorn's limits from the settings: connection cap, head/keep-alive deadlines, head size, and a
    bounded graceful shutdown (streams still open after ``shutdown_timeout_s`` are cut)."""
    from apps.protocol import header_timeout_protocol

    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "http": header_timeout_protocol(settings.header_timeout_s, settings.max_pending_connections),
        "limit_concurrency": settings.max_connections,
        "timeout_keep_alive": settings.keep_alive_timeout_s,
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "timeout_graceful_shutdown": settings.shutdown_timeout_s,
    }


if __name__ == "__main__":
    raise SystemExit(main())
