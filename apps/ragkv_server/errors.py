"""The service's error answers: the ``{"error": {...}}`` body, exception -> status, strict JSON, handlers.

Errors are ``{"error": {"message", "type", "code"}}``; a 5xx is logged (a 500 with its traceback) and
its body never carries the text of an unexpected exception.
"""

import json
import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from ragkv.kv import KVMismatchError
from ragkv.model import PromptTooLongError
from ragkv.rag import IndexFullError
from ragkv.rag.quotas import QuotaExceededError
from ragkv.remote.client import VllmServerError, VllmUnavailableError
from ragkv_server import schemas as sc
from ragkv_server.routes import flat_routes

log = logging.getLogger("ragkv.server")
#: the error statuses of ragkv's own routes, for their OpenAPI schema
ERRORS = {
    status: {"model": sc.ErrorResponse, "description": text}
    for status, text in {
        401: "API keys are configured: missing or unknown key",
        403: "the key has no write scope",
        404: "unknown document or chunk id",
        413: "request body, or prompt + max_tokens, too large",
        415: "a POST body not declared JSON (or NDJSON for uploads)",
        422: "invalid input",
        429: "busy: the queue is full, retry later",
        502: "generation 'vllm': the vLLM server answered with an error",
        503: "waited too long for a worker, shutting down, or vLLM down",
        507: "the data folder's disk is full: nothing of the write was committed; retry once space is freed",
    }.items()
}


def error_json(status: int, message: str, type_: str, details=None) -> dict:
    """The service's error body: ``{"error": {"message", "type", "code", "details"?}}``."""
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


class ServiceError(Exception):
    """An error with its HTTP status and OpenAI-style type; a subclass names both as class keywords:
    ``class BusyError(ServiceError, status=429, type="rate_limit_exceeded")``."""

    status = 500
    type = "internal_error"

    def __init_subclass__(cls, status: int | None = None, type: str | None = None, **kw) -> None:
        super().__init_subclass__(**kw)
        if status is not None:
            cls.status = status
        if type is not None:
            cls.type = type


class BadRequestError(ServiceError, status=400, type="BadRequestError"):
    """A request vLLM would refuse with 400: bad ``kv_transfer_params`` or chunk spans, bad token ids."""


class UnauthorizedError(ServiceError, status=401, type="authentication_error"):
    """API keys are configured and the request has none, or an unknown one."""


class ForbiddenError(ServiceError, status=403, type="permission_error"):
    """The key may not do this (read-only, or limited to other collections)."""


class NotFoundError(ServiceError, status=404, type="not_found"):
    """An unknown document or chunk id."""


class RequestTimeoutError(ServiceError, status=408, type="request_timeout"):
    """The request body did not arrive in time."""


class TooLargeError(ServiceError, status=413, type="context_length_exceeded"):
    """Prompt + max_tokens over what the engine can hold."""


class TooLargeBodyError(ServiceError, status=413, type="request_too_large"):
    """An upload (or one of its lines) over the configured size."""


class InvalidRequestError(ServiceError, status=422, type="invalid_request_error"):
    """A request that is well-formed JSON but asks for something the service does not serve."""


class BusyError(ServiceError, status=429, type="rate_limit_exceeded"):
    """Admission: every worker busy and the queue full."""


class ClientGoneError(ServiceError, status=499, type="client_closed_request"):
    """The client disconnected; its work was dropped (nobody reads this answer)."""


class UnavailableError(ServiceError, status=503, type="service_unavailable"):
    """Waited too long for a worker, or the server is shutting down."""


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
    if isinstance(exc, IndexFullError):  # rolled back whole: the client may retry once space is freed
        return (
            507,
            "insufficient_storage",
            "the data folder's disk is full: nothing was committed; retry later",
        )
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
    return module.split(".")[0] == "ragkv"


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


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error with the service's JSON body: validation (422), HTTP errors, typed errors, crashes."""

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
                for r in flat_routes(request.app.routes)
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
    for cls in (
        ServiceError,
        VllmServerError,
        PromptTooLongError,
        ValueError,
        ConnectionError,
        IndexFullError,
    ):
        app.add_exception_handler(cls, _known)

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception):
        status, kind, message = report(exc, request)
        return error_response(status, message, kind)


def quota_response(exc: QuotaExceededError) -> JSONResponse:
    """An ingest refused by a quota (nothing of it written): 413 for a document over
    ``max_document_tokens``, 429 for a collection it would take over a limit; ``type: quota_exceeded``,
    ``details`` the limit, its value, the usage and what was asked. No ``Retry-After``: retrying the
    same request does not help (a delete, a smaller request or a larger limit does)."""
    return StrictJSONResponse(
        error_json(exc.status, str(exc), "quota_exceeded", exc.details()), status_code=exc.status
    )
