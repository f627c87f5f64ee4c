"""``POST /v1/query``: answer a question over retrieved (or given) chunks, as JSON or token events."""

import uuid
from types import SimpleNamespace
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from ragkv.generate import SamplingParams, request_params
from ragkv_server import schemas as sc
from ragkv_server.answers import query_body
from ragkv_server.config import Settings
from ragkv_server.deps import Auth, ServiceDep, SettingsDep
from ragkv_server.errors import ERRORS, error_json, report
from ragkv_server.service import Final, QuerySpec
from ragkv_server.sse import relay, sse, sse_response, start_stream


def sampling(
    settings: Settings, max_tokens, temperature, top_p, seed, stop, constraint=None, logprobs=None
) -> SamplingParams:
    """A ragkv request's sampling (``/v1/query``, chat), with the service's default ``max_tokens``."""
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


def router(S: SimpleNamespace, auth: Auth) -> APIRouter:
    """``/v1/query`` with ``S``'s request model."""
    r = APIRouter(tags=["query"])

    @r.post(
        "/v1/query",
        response_model=sc.QueryResponse,
        responses={
            **ERRORS,
            200: {"content": {"text/event-stream": {}}, "description": "the answer (or SSE when stream)"},
        },
        summary="Answer a question over retrieved (or given) chunks",
        dependencies=auth.read,
    )
    async def query(
        req: S.QueryRequest,
        request: Request,
        svc: ServiceDep,
        settings: SettingsDep,
        collection: Annotated[str, Depends(auth.collection)],
    ):
        """Retrieve ``top_k`` chunks (or use ``chunk_ids``) of the request's collection and answer with
        their stored KV reused (``mode``); ``stream=true`` sends ``token`` events then one ``answer``
        event."""
        spec = QuerySpec(
            req.question,
            req.chunk_ids,
            True,
            req.top_k,
            req.request_settings(),
            sampling(settings, req.max_tokens, req.temperature, req.top_p, req.seed, req.stop),
            collection,
        )
        rid = "q-" + uuid.uuid4().hex[:16]
        if not req.stream:
            text, final = await svc.answer(spec, request.is_disconnected)
            return query_body(rid, text, final)
        it = svc.stream(spec)
        first, more = await start_stream(it)
        parts: list[str] = []

        def render(item):
            if isinstance(item, Final):
                yield sse(query_body(rid, "".join(parts), item), "answer")
            elif item.is_token or item.text:  # a closing event only when it releases text
                parts.append(item.text)
                yield sse({"text": item.text, "index": item.index, "token_id": item.token_id}, "token")

        def error_event(e: Exception) -> str:
            status, kind, message = report(e, request)
            return sse(error_json(status, message, kind), "error")

        return sse_response(relay(it, first, more, render, error_event))

    return r
