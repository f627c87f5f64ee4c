"""``POST /v1/completions``: vLLM's completions, ``kv_transfer_params`` chunks served from the chunk store.

A drop-in for a vLLM server with the ragkv plugin; the request logic is in :mod:`ragkv_server.openai_compat`.
"""

import time
import uuid
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from ragkv_server import openai_compat as oc
from ragkv_server.config import Settings
from ragkv_server.deps import Auth, Caller, ServiceDep, SettingsDep
from ragkv_server.errors import ForbiddenError
from ragkv_server.routes.chat import OPENAI_RESPONSES
from ragkv_server.service import NotFoundError
from ragkv_server.sse import openai_events, sse, sse_response, start_stream


def router(limits: Settings, auth: Auth) -> APIRouter:
    """``/v1/completions`` with the request bounded by ``limits`` (the app's settings)."""
    r = APIRouter(tags=["openai"])
    CompletionRequest = oc.build_completion_request(limits)

    @r.post(
        "/v1/completions",
        responses=OPENAI_RESPONSES,
        summary="OpenAI / vLLM completions; kv_transfer_params chunks served from the chunk store",
        dependencies=auth.read,
    )
    async def completions(
        req: CompletionRequest,
        request: Request,
        svc: ServiceDep,
        settings: SettingsDep,
        caller: Annotated[Caller, Depends(auth.scope)],
        collection: Annotated[str, Depends(auth.collection)],
    ):
        """vLLM's ``/v1/completions``: a token-id or text prompt; ``kv_transfer_params["ragkv"]`` names
        stored chunks (key, start, length) whose KV is blended in (docs/API.md); ``save`` (storing the
        KV of chunks computed here) needs a write key when keys are configured. A key limited to
        collections reuses only chunk KV that the request's collection uses (other references are
        prompt text: what happens depends on its own collection, never on what the store holds);
        other callers reuse any stored chunk, as a vLLM server with the ragkv plugin does (this route
        may serve another ragkv whose index is not this one's)."""
        model_name = settings.model_name()
        if req.model == model_name + oc.RAG_MODEL_SUFFIX:
            raise oc.invalid_value(
                "model",
                f"`{req.model}` (retrieval) is served on /v1/chat/completions; /v1/completions completes "
                f"the prompt as sent: use `{model_name}`",
            )
        if req.model and req.model != model_name:
            raise NotFoundError(f"The model `{req.model}` does not exist.")
        oc.check_generation_options(req, settings.generation)
        rag = svc.rag
        blend = oc.blend_params(req.kv_transfer_params, rag.model.config.num_layers)
        if blend is not None and blend.save and caller.scope == "read":
            raise ForbiddenError(
                "kv_transfer_params save=true writes to the chunk store: it needs a write key"
            )
        params = oc.sampling(req, rag.model)
        cid = "cmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())
        tids = bool(req.return_token_ids)
        kv_scope = collection if caller.collections is not None else None
        # tokenized in the worker, after admission (its length was bounded by the schema), so big text
        # prompts queue like any other work instead of running on a shared pool ahead of it
        it = svc.run_stream(
            lambda wait: oc.completion_events(
                rag, oc.prompt_ids(rag.model, req.prompt), blend, params, kv_scope
            ),
            request.is_disconnected if not req.stream else None,
        )
        first, more = await start_stream(it)

        def finished(done: oc.Done) -> None:
            svc.answers.inc(done.stats.get("mode", "full"))
            svc.tokens.inc(n=len(done.token_ids))

        if not req.stream:
            item, has = first, more
            try:
                while has and not isinstance(item, oc.Done):
                    item = await it.__anext__()
            finally:
                await it.aclose()
            finished(item)
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
                    yield sse(oc.completion_chunk(cid, created, model_name, item.text, None, tok, lp))
                return
            finished(item)
            end = oc.completion_chunk(cid, created, model_name, "", item.finish_reason, [] if tids else None)
            if (
                tids
            ):  # the prompt as prefilled (vLLM sends it in its first chunk; it is known at the end here)
                end["choices"][0]["prompt_token_ids"] = item.prompt_ids
            yield sse({**end, "ragkv": item.stats})
            if include_usage:
                yield sse(oc.usage_chunk(cid, created, model_name, item))

        return sse_response(openai_events(it, first, more, render, path="/v1/completions"))

    return r
