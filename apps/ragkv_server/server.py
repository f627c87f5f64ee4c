"""The ragkv HTTP service (FastAPI): ingest, query, an OpenAI-compatible chat endpoint, health, metrics.

``python -m ragkv_server.server [--config FILE] [--host H] [--port P] ...`` or ``ragkv-server serve``; API reference
in docs/API.md. Errors are ``{"error": {"message", "type", "code"}}`` with 401 / 403 / 404 / 408 / 413 /
422 / 429 / 503 for a missing or wrong API key, a key without write scope, unknown ids, a body too slow
to arrive, too-large bodies or prompts, bad input and a busy or stopping server.

The routes are one ``APIRouter`` per concern (:mod:`ragkv_server.routes`); auth scopes, the service and the
settings reach them as FastAPI dependencies (:mod:`ragkv_server.deps`). With API keys configured every route
but ``/healthz`` needs one (``Authorization: Bearer KEY`` or ``X-API-Key: KEY``): reads a read or
write key, anything that writes (ingest, delete, completions with ``save``) a write key. POST bodies
must declare a JSON (or, for uploads, NDJSON) content type, so a web page cannot post a "simple"
cross-site request (415); the Host header is checked against ``allowed_hosts`` (Starlette's
``TrustedHostMiddleware``, against DNS rebinding). Responses are strict JSON (non-finite numbers
become null) and error bodies never carry the text of an unexpected exception.
"""

import argparse
import asyncio
import functools
import gc
import logging
from contextlib import asynccontextmanager
from types import SimpleNamespace

from fastapi import FastAPI
from starlette.middleware.trustedhost import TrustedHostMiddleware

from ragkv_server import openai_compat as oc
from ragkv_server import schemas as sc
from ragkv_server.config import ConfigError, Settings, load_settings
from ragkv_server.deps import Auth
from ragkv_server.errors import StrictJSONResponse, classify, install_error_handlers, report
from ragkv_server.middleware import BodyLimitMiddleware, ContentTypeMiddleware, MetricsMiddleware
from ragkv_server.routes import chat, completions, documents, flat_routes, ops, query
from ragkv_server.service import DataDirLocked, Service, lock_data_dir
from ragkv_server.sse import sse as _sse

# what callers and tests import from here (their homes are ragkv_server.errors and ragkv_server.sse)
__all__ = ["StrictJSONResponse", "_sse", "build_parser", "classify", "create_app", "main", "report"]
log = logging.getLogger("ragkv.server")


@asynccontextmanager
async def lifespan(app: FastAPI):
    """Start the service (load the model), then close it when the server stops."""
    svc, settings = app.state.service, app.state.settings
    await asyncio.to_thread(svc.start)
    # the start-up objects (model, tokenizers, embedder, modules: ~0.5M) leave the collector's
    # scans: a full collection over them held the GIL ~0.35 s, freezing /healthz during ingest
    gc.collect()
    gc.freeze()
    log.info("ragkv service ready: model %s, data %s", settings.model, settings.data_dir)
    warn_exposure(settings)
    yield
    await asyncio.to_thread(svc.close)


def create_app(settings: Settings | None = None, service: Service | None = None) -> FastAPI:
    """The FastAPI app; the model loads at startup (or pass a ready ``service``)."""
    settings = settings or (service.settings if service else load_settings())
    svc = service or Service(settings)
    app = FastAPI(
        title="ragkv",
        version="0.1.0",
        lifespan=lifespan,
        default_response_class=StrictJSONResponse,
        description="RAG with reused, blended chunk KV. Errors: {error: {message, type, code}}.",
    )
    app.state.service, app.state.settings = svc, settings
    install_error_handlers(app)
    S, auth = sc.build_schemas(settings), Auth.of(settings)
    app.include_router(documents.router(S, auth))
    app.include_router(query.router(S, auth))
    app.include_router(chat.router(S, auth))
    app.include_router(completions.router(settings, auth))
    app.include_router(ops.router(auth))
    app.openapi = functools.partial(openapi, app, S)
    app.add_middleware(
        BodyLimitMiddleware,
        max_body=settings.max_body_bytes,
        max_upload=settings.max_upload_bytes,
        body_timeout_s=settings.body_timeout_s,
    )
    # outside the body limit: a body of the wrong type is refused before it is buffered
    posts = frozenset(
        r.path for r in flat_routes(app.routes) if "POST" in (getattr(r, "methods", None) or ())
    )
    app.add_middleware(ContentTypeMiddleware, json_paths=posts)
    # outside the content-type check too: its 415 on an OpenAI route has OpenAI's error shape
    app.add_middleware(oc.OpenAIErrorMiddleware)  # OpenAI routes: OpenAI's error shape and statuses
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=settings.host_allow_list())
    app.add_middleware(MetricsMiddleware, service=svc)
    return app


def openapi(app: FastAPI, S: SimpleNamespace) -> dict:
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


# ---- command line ------------------------------------------------------------------------------------
def build_parser(prog: str = "python -m ragkv_server.server") -> argparse.ArgumentParser:
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


#: the flags of :func:`build_parser` that override the Settings field of the same name (all but --config)
SERVER_FLAGS = (
    "host",
    "port",
    "model",
    "data_dir",
    "store",
    "max_concurrency",
    "max_queue",
    "torch_threads",
    "prompt_file",
    "generation",
    "vllm_url",
    "log_level",
)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from ``--config`` (or ``$RAGKV_CONFIG``), env vars and the flags given (file < env < flags)."""
    return load_settings(args.config, **{k: getattr(args, k) for k in SERVER_FLAGS})


def main(argv: list[str] | None = None, prog: str = "python -m ragkv_server.server") -> int:
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
    from ragkv_server.protocol import header_timeout_protocol

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
