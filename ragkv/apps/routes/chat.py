"""``POST /v1/chat/completions``: OpenAI chat with retrieval and reused chunk KV (text or a forced tool call)."""

import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from ragkv.apps import openai_compat as oc
from ragkv.apps import schemas as sc
from ragkv.apps.answers import ragkv_info, usage
from ragkv.apps.deps import Auth, ServiceDep, SettingsDep
from ragkv.apps.routes.query import sampling
from ragkv.apps.service import Final, InvalidRequestError, QuerySpec
from ragkv.apps.sse import openai_events, sse, sse_response, start_stream
from ragkv.integrations.common import fold_messages

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
        summary="OpenAI chat completions with retrieval and reused chunk KV",
        dependencies=auth.read,
    )
    async def chat_completions(
        req: S.ChatCompletionRequest,
        request: Request,
        svc: ServiceDep,
        settings: SettingsDep,
        collection: Annotated[str, Depends(auth.collection)],
    ):
        """The last user message is the question (earlier turns are prepended to it). Retrieval is
        automatic unless ``ragkv.chunk_ids`` names the chunks or ``ragkv.retrieve`` is false; chunks
        and reused KV are the request's collection's (``X-Ragkv-Collection``)."""
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
            settings,
            req.max_completion_tokens or req.max_tokens,
            req.temperature,
            req.top_p,
            req.seed,
            req.stop,
            constraint,
            logprobs,
        )
        spec = QuerySpec(
            question, o.chunk_ids, o.retrieve, o.top_k, o.mode, o.ratio, params, collection, o.fidelity
        )
        model_name = settings.model_name()
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
            return oc.openai_object(
                "chat.completion", cid, created, model_name, [choice], usage=_usage(f), ragkv=ragkv_info(f)
            )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        it = svc.stream(spec)
        first, more = await start_stream(it)

        def chunk(choices: list, **extra) -> str:
            return sse(oc.openai_object("chat.completion.chunk", cid, created, model_name, choices, **extra))

        def choice(delta: dict, finish=None, lp: dict | None = None) -> list:
            return [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]

        def delta(text: str) -> dict:
            if call is None:
                return {"content": text}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}

        def render(item) -> Iterator[str]:
            if not isinstance(item, Final):
                if item.is_token or item.text:  # a closing event only when it releases text
                    yield chunk(choice(delta(item.text), lp=logprobs_of([item] if item.is_token else [])))
                return
            yield chunk(choice({}, item.finish_reason), ragkv=ragkv_info(item))
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
