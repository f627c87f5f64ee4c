"""Documents: ingest (JSON, or NDJSON streamed in), list, delete, and collecting unreferenced KV."""

import asyncio
from types import SimpleNamespace
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from ragkv.rag.collections import COLLECTION_PATTERN
from ragkv.rag.quotas import QuotaExceededError
from ragkv_server import schemas as sc
from ragkv_server.deps import Auth, Caller, ServiceDep, SettingsDep, collection_of
from ragkv_server.errors import ERRORS, TooLargeBodyError, quota_response
from ragkv_server.middleware import NDJSON
from ragkv_server.service import InvalidRequestError

#: the ingest route's error statuses: 413 and 429 are quota refusals too (type quota_exceeded)
INGEST_ERRORS = {
    **ERRORS,
    413: {
        "model": sc.ErrorResponse,
        "description": "request body too large, or a document over max_document_tokens (quota_exceeded)",
    },
    429: {
        "model": sc.ErrorResponse,
        "description": "busy (retry later), or the collection would go over a quota (quota_exceeded: "
        "no Retry-After)",
    },
}

#: the ingest body as the OpenAPI schema states it (the endpoint reads the body itself)
UPLOAD_BODY = {
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


def router(S: SimpleNamespace, auth: Auth) -> APIRouter:
    """``/v1/documents`` and ``/v1/admin/gc`` with ``S``'s document model."""
    r = APIRouter(tags=["documents"])
    Collection = Annotated[str, Depends(auth.collection)]

    @r.post(
        "/v1/documents",
        response_model=sc.IngestResponse,
        responses=INGEST_ERRORS,
        openapi_extra=UPLOAD_BODY,
        summary="Ingest documents (idempotent; all or none)",
        dependencies=auth.write,
    )
    async def ingest(request: Request, svc: ServiceDep, settings: SettingsDep, collection: Collection):
        """JSON ``{"documents": [{id?, text, metadata?}]}``, or NDJSON (one document per line, for large
        uploads: read as it streams in), into the request's collection. Re-sending an unchanged
        document changes nothing."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype in NDJSON:
            docs = await read_ndjson(
                request, S.DocumentIn, settings.max_upload_bytes, settings.max_upload_line_bytes
            )
        else:  # application/json (ContentTypeMiddleware refused anything else); parsed off the loop
            docs = await asyncio.to_thread(parse_ingest_json, S.IngestRequest, await request.body())
        try:
            return await svc.run_ingest(
                lambda cancel: svc.ingest(docs, cancel, collection), request.is_disconnected
            )
        except QuotaExceededError as e:  # refused before anything was written: the whole request
            return quota_response(e)

    @r.get(
        "/v1/documents",
        response_model=sc.DocumentList,
        summary="List the collection's document ids",
        dependencies=auth.read,
    )
    async def list_documents(svc: ServiceDep, collection: Collection):
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(svc.read_pool, svc.rag.list_documents, collection)
        return {"ids": ids, "total": len(ids)}

    @r.delete(
        "/v1/documents/{doc_id}",
        response_model=sc.DeleteResponse,
        responses=ERRORS,
        summary="Delete a document, its chunks and their KV",
        dependencies=auth.write,
    )
    async def delete_document(doc_id: str, request: Request, svc: ServiceDep, collection: Collection):
        """404 for an id that is unknown in the request's collection (another collection's too)."""
        await svc.run_ingest(lambda cancel: svc.delete(doc_id, collection), request.is_disconnected)
        return {"id": doc_id, "deleted": True}

    @r.get(
        "/v1/collections/{name}/usage",
        response_model=sc.CollectionUsage,
        responses={k: v for k, v in ERRORS.items() if k in (401, 403, 422)},
        summary="A collection's usage and quotas",
        dependencies=auth.read,
    )
    async def collection_usage(
        name: Annotated[str, Path(pattern=COLLECTION_PATTERN)],
        svc: ServiceDep,
        caller: Annotated[Caller, Depends(auth.scope)],
    ):
        """Documents, chunks, tokens and accounted KV bytes of collection ``name``, with the quotas in
        force (a collection with nothing in it: zeros). A key limited to collections may read only
        its own (another: 403, existing or not)."""
        coll = collection_of(caller, name)
        loop = asyncio.get_running_loop()
        u = await loop.run_in_executor(svc.read_pool, svc.rag.usage, coll)
        return {
            "collection": u.collection,
            "documents": u.documents,
            "chunks": u.chunks,
            "tokens": u.tokens,
            "kv_bytes": u.kv_bytes,
            "kv_bytes_per_token": u.kv_bytes_per_token,
            "limits": svc.rag.quotas.limits(),
        }

    @r.post(
        "/v1/admin/gc",
        response_model=sc.GarbageReport,
        responses=ERRORS,
        summary="Delete stored chunk KV that no document references",
        dependencies=auth.admin,
    )
    async def collect_garbage(request: Request, svc: ServiceDep):
        """Collect the chunk store: KV no chunk of the index references is deleted (runs in the
        ingest queue, so never beside an ingest). Only for a store this service owns; spans every
        collection, so a key limited to collections gets 403."""
        return await svc.run_ingest(lambda cancel: svc.rag.collect_garbage(), request.is_disconnected)

    @r.post(
        "/v1/admin/reload",
        response_model=sc.ReloadReport,
        responses=ERRORS,
        summary="Take in documents other writers of the data folder committed (no restart)",
        dependencies=auth.admin,
    )
    async def reload(request: Request, svc: ServiceDep):
        """See what other processes writing this data folder (another service, ``ragkv-server ingest
        [--ray]``) committed or deleted since: the in-memory index is reconciled with the chunk table
        (ragkv.rag.writers). Runs in the ingest queue; queries go on meanwhile."""

        def refresh(cancel) -> dict:
            got = svc.rag.corpus.refresh()
            return {**got, "documents": svc.rag.index.num_documents, "chunks": len(svc.rag.index)}

        return await svc.run_ingest(refresh, request.is_disconnected)

    return r


async def read_ndjson(request: Request, model, limit: int, line_limit: int) -> list[dict]:
    """An NDJSON upload, one document per line: read as it streams in (at most ``limit`` bytes, lines
    of at most ``line_limit``), each piece scanned once for newlines and each line joined once (linear
    time), then validated off the event loop."""
    lines: list[bytes] = []
    partial: list[bytes] = []
    partial_len = size = 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise TooLargeBodyError(f"upload larger than {limit} bytes")
        start = 0
        while (nl := piece.find(b"\n", start)) >= 0:
            partial_len += nl - start
            if partial_len > line_limit:
                raise TooLargeBodyError(f"upload line {len(lines) + 1} longer than {line_limit} bytes")
            partial.append(piece[start:nl])
            lines.append(b"".join(partial))
            partial, partial_len, start = [], 0, nl + 1
        partial_len += len(piece) - start
        if partial_len > line_limit:
            raise TooLargeBodyError(f"upload line {len(lines) + 1} longer than {line_limit} bytes")
        partial.append(piece[start:])
    lines.append(b"".join(partial))
    return await asyncio.to_thread(parse_ndjson_lines, model, lines)


def parse_ndjson_lines(model, lines: list[bytes]) -> list[dict]:
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


def parse_ingest_json(model, raw: bytes) -> list[dict]:
    """Validate a JSON ingest body (run off the event loop: a body of megabytes takes a while)."""
    try:
        req = model.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None
    return [d.model_dump() for d in req.documents]
