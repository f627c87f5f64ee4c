"""What the server serves and how it is doing: ``/v1/models``, ``/healthz`` (always open), ``/metrics``."""

import asyncio

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from ragkv.blend.gate import gate_state
from ragkv_server import openai_compat as oc
from ragkv_server import schemas as sc
from ragkv_server.deps import Auth, ServiceDep, SettingsDep
from ragkv_server.metrics import CONTENT_TYPE
from ragkv_server.service import NotFoundError, Service


def served_model(model_id: str, svc: Service) -> dict:
    """A served model id as OpenAI lists it."""
    return {"id": model_id, "object": "model", "created": svc.started_at, "owned_by": "ragkv"}


def router(auth: Auth) -> APIRouter:
    """The model list, health and metrics routes."""
    r = APIRouter()

    @r.get(
        "/v1/models",
        response_model=sc.ModelList,
        tags=["openai"],
        summary="The served model, and its RAG variant '<model>+rag' (chat with retrieval)",
        dependencies=auth.read,
    )
    async def models(svc: ServiceDep, settings: SettingsDep):
        return {"object": "list", "data": [served_model(m, svc) for m in oc.served_model_ids(settings)]}

    @r.get(
        "/v1/models/{model_id:path}",
        response_model=sc.ModelCard,
        responses={404: oc.OPENAI_ERRORS[404]},
        tags=["openai"],
        summary="One served model id (404 for any other)",
        dependencies=auth.read,
    )
    async def model_card(model_id: str, svc: ServiceDep, settings: SettingsDep):
        if model_id not in oc.served_model_ids(settings):
            raise NotFoundError(f"The model `{model_id}` does not exist.")
        return served_model(model_id, svc)

    @r.get("/healthz", response_model=sc.Health, tags=["ops"], summary="Liveness and size")
    async def healthz(svc: ServiceDep, settings: SettingsDep):
        rag = svc.rag
        docs, chunks = rag.index.num_documents, len(rag.index)  # in-memory counts: no thread, no SQLite
        return {
            "status": "ok",
            "model": settings.model_name(),
            "generation": settings.generation,
            "documents": docs,
            "chunks": chunks,
            "running": svc.queries.running,
            "queued": svc.queries.queued,
            "blend_gate": gate_state(rag.model),
            "fidelity": rag.llm.operating_point(rag.planner.settings.fidelity).as_stats(),
        }

    @r.get(
        "/metrics",
        response_class=PlainTextResponse,
        tags=["ops"],
        summary="Prometheus metrics",
        dependencies=auth.read,
    )
    async def metrics(svc: ServiceDep):
        text = await asyncio.get_running_loop().run_in_executor(svc.ops_pool, svc.registry.render)
        return Response(text, media_type=CONTENT_TYPE)

    return r
