"""``POST /v1/chat/completions``: OpenAI chat as vLLM serves it, stored chunk KV reused inside the
messages; retrieval on request (text or a forced tool call)."""

import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from ragkv.generate import SamplingParams
from ragkv_server import openai_compat as oc
from ragkv_server import schemas as sc
from ragkv_server.answers import ragkv_info, usage
from ragkv_server.deps import Auth, ServiceDep, SettingsDep
from ragkv_server.routes.query import sampling
from ragkv_server.service import Final, QuerySpec
from ragkv_server.sse import openai_events, sse, sse_response, start_stream

#: the OpenAI routes' error statuses plus their streamed 200
OPENAI_RESPONSES = {
    **oc.OPENAI_ERRORS,
    200: {"content": {"text/event-stream": {}}, "description": "the completion (or SSE chunks)"},
}


def router(S: SimpleNamespace, auth: Auth) -> APIRouter:
    """``/v1/chat/completions`` with ``S``'s request model."""
    r = APIRouter(tags=["openai"])

    @r.post(
        "/v1/chat/completions",
        response_model=sc.ChatCompletion,
        responses=OPENAI_RESPONSES,
        summary="OpenAI chat completions: the messages as sent, stored chunk KV reused; retrieval on request",
        dependencies=auth.read,
    )
    async def chat_completions(
        req: S.ChatCompletionRequest,
        request: Request,
        svc: ServiceDep,
        settings: SettingsDep,
        collection: Annotated[str, Depends(auth.collection)],
    ):
        """OpenAI semantics: the messages rendered by the model's chat template exactly as vLLM's
        OpenAI server renders them, the stored chunks found inside them reused (the request's
        collection's, ``X-Ragkv-Collection``). Retrieval only on request: ``ragkv.retrieve`` (with
        ``top_k``), ``ragkv.chunk_ids``, or the model id ``<model>+rag``; the passages then go in the
        last user message, as ``/v1/query`` puts them (docs/API.md)."""
        use_rag = oc.chat_model(settings, req.model)  # 404 model_not_found for an id not served
        call = oc.chat_tool_call(req)  # a forced function call; what is not served: 400, never ignored
        oc.check_generation_options(req, settings.generation)
        # 400 for a refused schema
        constraint = call.constraint if call else oc.response_constraint(req.response_format, req.stop)
        call_id = "call_" + uuid.uuid4().hex[:24]
        logprobs = oc.chat_logprobs(req)
        o = req.ragkv or S.RagkvOptions()
        params = sampling(
            settings,
            req.max_completion_tokens or req.max_tokens,
            req.temperature,
            req.top_p,
            req.seed,
            req.stop,
            constraint,
            logprobs,
        )
        spec = chat_spec(req, o, use_rag, params, collection)
        model_name = req.model or settings.model_name()
        cid = "chatcmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())

        def logprobs_of(events: list) -> dict | None:
            """``choices[].logprobs`` of these token events (None when not asked for)."""
            if logprobs is None:
                return None
            return {"content": oc.chat_logprob_content(svc.rag.model, events), "refusal": None}

        if not req.stream:
            events: list = []
            text, f = await svc.answer(spec, request.is_disconnected, events)
            choice = {
                "index": 0,
                "message": _message(call, call_id, text),
                "logprobs": logprobs_of(events),
                "finish_reason": f.finish_reason,
            }
            ids = {}
            if req.return_token_ids:  # vLLM's option
                choice["token_ids"] = f.answer.token_ids
                ids["prompt_token_ids"] = f.answer.prompt_ids
            return oc.openai_object(
                "chat.completion",
                cid,
                created,
                model_name,
                [choice],
                usage=_usage(f),
                ragkv=ragkv_info(f),
                **ids,
            )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        it = svc.stream(spec)
        first, more = await start_stream(it)

        def chunk(choices: list, **extra) -> str:
            return sse(oc.openai_object("chat.completion.chunk", cid, created, model_name, choices, **extra))

        def choice(delta: dict, finish=None, lp: dict | None = None, tids: list | None = None) -> list:
            c = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            if req.return_token_ids and tids is not None:
                c["token_ids"] = tids
            return [c]

        def delta(text: str) -> dict:
            if call is None:
                return {"content": text}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}

        def render(item) -> Iterator[str]:
            if not isinstance(item, Final):
                if item.is_token or item.text:  # a closing event only when it releases text
                    tids = [item.token_id] if item.is_token else []
                    lp = logprobs_of([item] if item.is_token else [])
                    yield chunk(choice(delta(item.text), lp=lp, tids=tids))
                return
            ids = {"prompt_token_ids": item.answer.prompt_ids} if req.return_token_ids else {}
            yield chunk(choice({}, item.finish_reason), ragkv=ragkv_info(item), **ids)
            if include_usage:
                yield chunk([], usage=_usage(item))

        if call is None:
            opening = {"role": "assistant", "content": ""}
        else:  # the call's id and name first, then its arguments as they are generated
            (tool,) = oc.tool_call_message(call, call_id, "")
            opening = {"role": "assistant", "content": None, "tool_calls": [{"index": 0, **tool}]}
        return sse_response(openai_events(it, first, more, render, [chunk(choice(opening))]))

    return r


def _message(call: oc.ForcedCall | None, call_id: str, text: str) -> dict:
    """The assistant message of a finished chat completion: its text, or the forced call's arguments."""
    if call is None:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": None, "tool_calls": oc.tool_call_message(call, call_id, text)}


def _usage(f: Final) -> dict:
    """OpenAI's ``usage`` with ``prompt_tokens_details.cached_tokens``."""
    return oc.usage_with_details(usage(f), f.answer.stats)


def chat_spec(req, o, use_rag: bool, params: SamplingParams, collection: str) -> QuerySpec:
    """The work of a chat request. By default its messages as sent (:attr:`QuerySpec.messages`);
    with retrieval (``ragkv.retrieve``, or the ``<model>+rag`` model unless ``retrieve`` is false)
    or ``ragkv.chunk_ids``, the RAG prompt: the last message, a user message, is the question and
    its turn carries the passages, the earlier messages stay turns (:func:`ragkv.prompt.prompt_parts`).
    Options that would be ignored are refused (400 naming ``ragkv``)."""
    retrieve = use_rag if o.retrieve is None else o.retrieve
    if o.chunk_ids is not None and o.retrieve:
        raise oc.invalid_value("ragkv", "give ragkv.chunk_ids (these chunks) or retrieve: true, not both")
    if o.top_k is not None and not retrieve:
        raise oc.invalid_value(
            "ragkv", "ragkv.top_k applies to retrieval: add retrieve: true (or use the model '<model>+rag')"
        )
    if not retrieve and o.chunk_ids is None:
        messages = [m.template_message() for m in req.messages]
        return QuerySpec("", None, False, None, o.request_settings(), params, collection, messages=messages)
    *earlier, last = req.messages
    if last.role != "user" or not last.text().strip():
        raise oc.invalid_value(
            "messages",
            "with retrieval or ragkv.chunk_ids the last message must be a user message with text: the "
            "question, whose turn carries the passages",
        )
    conversation = [(m.role, m.text()) for m in earlier]
    return QuerySpec(
        last.text(),
        o.chunk_ids,
        retrieve,
        o.top_k,
        o.request_settings(),
        params,
        collection,
        conversation,
    )
