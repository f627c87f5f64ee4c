"""``POST /v1/completions`` as vLLM's OpenAI server has it, with ``kv_transfer_params`` served by ragkv.

This makes ragkv's HTTP service a drop-in for a vLLM server running the ragkv plugin, for any
OpenAI-protocol client (``ragkv.remote.client.VllmGenerator``, the ``openai`` package, curl): the
prompt (token ids or text) is prefilled in process, and the chunks that ``kv_transfer_params``
names (``{"ragkv": {"chunks": [{"key", "start", "length"}], "mode", "ratio", ...}}``, the format of
integrations/vllm/README.md) take their rows from the service's chunk store, blended with HKVD
selective recompute (``mode: "blend"``) or reused as is (``"reuse"``). A chunk whose stored KV is
missing, of another model, or fails to load is computed alone and used instead (and saved when
``save`` is set): never silently wrong KV. Without ``kv_transfer_params`` the prompt is fully
prefilled. Responses and streamed chunks follow vLLM's shapes; ragkv adds a ``ragkv`` field with
the reuse statistics. The route itself is in :mod:`ragkv_server.routes.completions`; the logic is here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
)
from pydantic_core import PydanticCustomError

from ragkv.blend.locate import Located
from ragkv.blend.spans import SpanError, expect_model, request_spans
from ragkv.constrain import ConstraintError, JsonConstraint, json_constraint, token_bytes
from ragkv.defaults import COMPLETIONS_MAX_TOKENS, COMPLETIONS_TEMPERATURE, Mode
from ragkv.fidelity.plan import RequestSettings
from ragkv.generate import SamplingParams, TokenEvent, request_params
from ragkv.rag.generation import Generated
from ragkv.remote.wire import BlendParams, KVParamsError
from ragkv_server.config import Settings
from ragkv_server.errors import BadRequestError
from ragkv_server.schemas import MAX_INT, MAX_TOP_LOGPROBS, ResponseFormat
from ragkv_server.service import STAT_KEYS as SERVICE_STAT_KEYS

log = logging.getLogger("ragkv.server")
#: one warning per kind and interval, with the count held back (a store outage fails every chunk)

#: most stop strings a completion may carry (each is searched in the text after every token)
MAX_STOPS = 4
STAT_KEYS = (*SERVICE_STAT_KEYS, "kv_misses", "kv_recomputed_bad", "kv_saved")


def _only(value: bool | int) -> Any:
    """A field that takes exactly ``value``: ``Literal`` alone also takes 0 for False, True for 1."""

    def check(v: Any) -> Any:
        if v is not None and (type(v) is not type(value) or v != value):
            raise ValueError(f"only {value!r} is supported")
        return v

    return Annotated[Literal[value], BeforeValidator(check)]


def _refused(what: str) -> Any:
    """A field refused whenever given (not null): ``unsupported_parameter``, with the reason."""

    def check(v: Any) -> Any:
        if v is not None:
            raise PydanticCustomError(
                "unsupported_parameter", "{what} not supported by this server", {"what": what}
            )
        return v

    return Annotated[Any, BeforeValidator(check)]


def build_completion_request(s: Settings) -> type[BaseModel]:
    """The request model of ``/v1/completions`` with ``s``'s limits (vLLM's fields that ragkv serves)."""

    class StreamOptions(BaseModel):
        model_config = ConfigDict(strict=True)
        include_usage: bool = False

    Stop = Annotated[str, Field(min_length=1, max_length=64)]
    Text = Annotated[str, Field(min_length=1, max_length=s.max_prompt_chars)]
    Ids = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=s.max_prompt_tokens)]

    class CompletionRequest(BaseModel):
        """vLLM's completion request: one prompt (token ids or text); unsupported options only at their
        defaults; ``kv_transfer_params`` in the ragkv connector's format."""

        # strict: "stream": 0, "temperature": false, "prompt": [false] are refused, not coerced
        model_config = ConfigDict(extra="ignore", strict=True)
        model: str | None = Field(None, max_length=256)
        prompt: (
            Ids
            | Text
            | Annotated[list[Ids], Field(min_length=1, max_length=1)]
            | Annotated[list[Text], Field(min_length=1, max_length=1)]
        ) = Field(
            description="token ids or text (bounded: tokenized after admission); a list of one prompt "
            "is accepted (one prompt per request)"
        )
        max_tokens: int | None = Field(
            COMPLETIONS_MAX_TOKENS, ge=1, le=s.max_new_tokens_limit, description="tokens to generate at most"
        )
        temperature: float | None = Field(None, ge=0.0, le=2.0, description="default 1 (0: greedy)")
        top_p: float | None = Field(None, gt=0.0, le=1.0)
        top_k: int | None = Field(None, ge=-1, description="-1 or 0: off")
        seed: int | None = Field(None, ge=0, le=MAX_INT)
        stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOPS)] | None = Field(
            None, description=f"at most {MAX_STOPS} stop strings"
        )
        stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=16)
        stream: bool | None = False
        stream_options: StreamOptions | None = None
        return_token_ids: bool | None = Field(
            None, description="add token_ids (and prompt_token_ids) to choices"
        )
        kv_transfer_params: Any = Field(  # checked by blend_params (400 with the reason), not by the schema
            None, description='{"ragkv": {"chunks": [{"key", "start", "length"}], "mode", "ratio", ...}}'
        )
        user: str | None = Field(None, max_length=256)
        n: _only(1) | None = Field(None, description="only 1")
        best_of: _only(1) | None = Field(None, description="only 1")
        echo: _only(False) | None = Field(None, description="not supported")
        logprobs: int | None = Field(
            None,
            ge=0,
            le=MAX_TOP_LOGPROBS,
            description="each token's log-probability and this many alternatives",
        )
        response_format: ResponseFormat | None = Field(
            None, description="text, json_object or json_schema: the completion is JSON (matching the schema)"
        )
        suffix: _refused("suffix is") = Field(None, description="not supported")
        presence_penalty: float | None = Field(None, ge=0.0, le=0.0, description="only 0")
        frequency_penalty: float | None = Field(None, ge=0.0, le=0.0, description="only 0")

    return CompletionRequest


def prompt_ids(model, prompt) -> list[int]:
    """The token ids of a request's prompt (text is tokenized with BOS, as vLLM does for Llama)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        if len(prompt) != 1:
            raise BadRequestError(f"one prompt per request, got {len(prompt)}")
        prompt = prompt[0]
    # a completions prompt is the model's raw input (as vLLM reads it): special tokens' text is parsed
    ids = (
        model.encode(prompt, add_bos=True, specials=True)
        if isinstance(prompt, str)
        else [int(t) for t in prompt]
    )
    if not ids:
        raise BadRequestError("empty prompt")
    vocab = model.config.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequestError(f"token id {bad} is outside the vocabulary of {vocab}")
    return ids


def blend_params(raw: Any, num_layers: int) -> BlendParams | None:
    """The ragkv part of ``kv_transfer_params`` in its one wire format (:mod:`ragkv.remote.wire`;
    None: no chunks to reuse); 400 with the reason when malformed or naming layers the model lacks.
    ``save`` defaults to false here: a read must not write (issue 24; save=true needs a write key)."""
    try:
        blend = BlendParams.from_kv_transfer_params(raw, save_default=False)
    except KVParamsError as e:
        raise BadRequestError(f"kv_transfer_params: {e}") from None
    if blend is not None and any(layer >= num_layers for layer in blend.check_layers):
        raise BadRequestError(
            f"kv_transfer_params: check_layers must be layers of the model (< {num_layers})"
        )
    return blend


def sampling(req, model) -> SamplingParams:
    """ragkv sampling of an OpenAI request (OpenAI's defaults: temperature 1, top_p 1, 16 tokens);
    ``stop_token_ids`` stop in addition to the model's EOS, as in vLLM; ``response_format`` and
    ``logprobs`` as the library takes them (400 naming them when refused)."""
    constraint = response_constraint(req.response_format, req.stop)
    return request_params(
        req.max_tokens,
        req.temperature,
        req.top_p,
        req.top_k,
        req.seed,
        req.stop,
        req.stop_token_ids or None,
        constraint=constraint,
        logprobs=req.logprobs,
        default_max_tokens=COMPLETIONS_MAX_TOKENS,
        default_temperature=COMPLETIONS_TEMPERATURE,
        eos_token_ids=model.config.eos_token_ids,
    )


@dataclass
class Done:
    """The end of a completion: what the final response / chunk reports."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)
    #: the token events (with their log-probabilities) when the request asked for logprobs
    events: list[TokenEvent] = field(default_factory=list)

    @property
    def usage(self) -> dict:
        n, p = len(self.token_ids), len(self.prompt_ids)
        return usage_with_details(
            {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}, self.stats
        )


def completion_events(
    rag, ids: list[int], blend: BlendParams | None, params: SamplingParams, collection: str | None = None
) -> Iterator[TokenEvent | Done]:
    """Complete ``ids`` through the RAG's generator (:meth:`ragkv.rag.RAG.generate`, whatever its
    generation setting) with ``blend``'s stored chunks: token events, then :class:`Done`.

    Runs in a worker thread. A chunk is reused only where its key is ``chunk_key(its prompt tokens,
    model fingerprint)`` and its stored header agrees (:func:`ragkv.blend.spans.request_spans`);
    others are computed. Nothing computed here is stored unless ``save`` asks (a writer's request).
    No ``kv_transfer_params``: the stored chunks inside the prompt are located and reused with the
    service's mode and ratio (transparent reuse); ``{"ragkv": {"chunks": []}}`` asks for a full prefill.
    ``collection``: only chunk KV that collection uses is reused (:meth:`ragkv.rag.RAG.kv_visible`):
    references to other keys are dropped before the store is read (their rows are prompt text), and
    only that collection's chunks are located; None: any stored chunk.
    """
    refs = list(blend.chunks) if blend is not None else []
    spans = []
    if refs:
        expect_model(rag.store, rag.resolver.model)  # the model (or chunk-KV writer) stored KV is keyed by
        shown = refs
        if collection is not None:
            keep = rag.index.referenced_keys((r.key for r in refs), collection)
            shown = [r for r in refs if r.key in keep]
        try:
            spans = request_spans(ids, shown, rag.store, rag.resolver.model.fingerprint)
        except SpanError as e:
            raise BadRequestError(f"kv_transfer_params: {e}") from None
    found = [Located(s.key, tuple(ids[s.start : s.stop]), s.start, 0, s.length) for s in spans]
    if blend is None:  # no chunks named: the stored ones inside the prompt, the service's mode
        job = rag.job(ids, [], params=params, write_back=False, kv_collection=collection)
    else:
        settings = blend.request_settings() if found else RequestSettings(Mode.FULL)
        job = rag.job(ids, found, settings, params, locate=False, write_back=False, save=blend.save)
    events: list[TokenEvent] = []  # kept for the response's logprobs
    for item in rag.generate(job):
        if not isinstance(item, Generated):
            if item.is_token and params.logprobs is not None:
                events.append(item)
            yield item
            continue
        stats = dict(item.stats)
        if refs:  # references not found in the prompt are misses too (computed as text)
            stats["kv_misses"] = stats.get("kv_misses", 0) + len(refs) - len(spans)
            stats.setdefault("kv_hits", 0)
        if stats.get("kv_misses"):
            log.info("completion: %d chunk(s) computed (missing or unreadable stored KV)", stats["kv_misses"])
        yield Done(
            item.text,
            item.token_ids,
            ids,
            item.finish_reason,
            jsonable_encoder({k: stats[k] for k in STAT_KEYS if k in stats}),
            events,
        )


def _choice(text: str, finish: str | None, token_ids: list[int] | None, logprobs: dict | None = None) -> dict:
    c: dict = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": None}
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c


def openai_object(kind: str, cid: str, created: int, model: str, choices: list, **extra) -> dict:
    """An OpenAI response or stream chunk: ``{id, object, created, model, choices, **extra}``."""
    return {"id": cid, "object": kind, "created": created, "model": model, "choices": choices, **extra}


def completion_response(
    cid: str, created: int, model: str, done: Done, return_token_ids: bool, logprobs: dict | None = None
) -> dict:
    """vLLM's ``CompletionResponse`` of a finished completion (plus ``ragkv``: reuse statistics);
    ``logprobs``: :func:`completion_logprobs` of its tokens when asked for."""
    choice = _choice(done.text, done.finish_reason, done.token_ids if return_token_ids else None, logprobs)
    if return_token_ids:
        choice["prompt_token_ids"] = done.prompt_ids
    return openai_object(
        "text_completion",
        cid,
        created,
        model,
        [choice],
        usage=done.usage,
        kv_transfer_params=None,
        ragkv=done.stats,
    )


def completion_chunk(
    cid: str,
    created: int,
    model: str,
    text: str,
    finish: str | None = None,
    token_ids: list[int] | None = None,
    logprobs: dict | None = None,
) -> dict:
    """vLLM's ``CompletionStreamResponse`` with one choice."""
    return openai_object("text_completion", cid, created, model, [_choice(text, finish, token_ids, logprobs)])


def usage_chunk(cid: str, created: int, model: str, done: Done) -> dict:
    """The last streamed chunk when ``stream_options.include_usage``: no choices, the usage."""
    return openai_object("text_completion", cid, created, model, [], usage=done.usage)


# ---- OpenAI conformance of the OpenAI routes: errors, unsupported options, usage details ----------------
#: the routes that speak OpenAI's protocol (ragkv's own routes keep ragkv's error shape)
OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models")
#: pydantic error types -> OpenAI's ``code`` of an invalid parameter
VALIDATION_CODES = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
    "unsupported_parameter": "unsupported_parameter",
    "too_short": "invalid_value",
    "too_long": "invalid_value",
    "literal_error": "invalid_value",
    "enum": "invalid_value",
    "json_invalid": "invalid_json",
}


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorResponse(BaseModel):
    """An error of the OpenAI routes: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape)."""

    error: OpenAIError


#: the error statuses of the OpenAI routes, for their OpenAPI schema
OPENAI_ERRORS: dict[int | str, dict] = {
    status: {"model": OpenAIErrorResponse, "description": text}
    for status, text in {
        400: "invalid request (code: invalid_value, invalid_type, unsupported_parameter, ...), bad "
        "kv_transfer_params or token ids, or prompt + max_tokens over the context (context_length_exceeded)",
        401: "API keys are configured: missing or unknown key",
        404: "unknown chunk id, or a model other than the served one (model_not_found)",
        408: "the request body arrived too slowly",
        413: "request body too large",
        415: "a POST body not declared application/json (a cross-site form cannot post)",
        429: "busy: the queue is full, retry later",
        502: "generation 'vllm': the vLLM server answered with an error",
        503: "waited too long for a worker, shutting down, or vLLM down",
    }.items()
}


def is_openai_route(path: str) -> bool:
    """Whether ``path`` is one of :data:`OPENAI_ROUTES` (or below one: ``/v1/models/{id}``)."""
    return any(path == r or path.startswith(r + "/") for r in OPENAI_ROUTES)


def openai_error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``: OpenAI's error object (``code`` a string)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _param(loc: list) -> str | None:
    """The request parameter a validation error's ``loc`` names (``messages.0.role`` -> ``messages``)."""
    names = [str(x) for x in loc if x != "body" and isinstance(x, str) and not x.startswith("line ")]
    return names[0] if names else None


def to_openai_error(status: int, error: dict, path: str) -> tuple[int, dict]:
    """``(status, body)`` of ragkv's error ``{message, type, code, details?}`` as OpenAI answers it: 400 for
    invalid requests (not 422), 400 ``context_length_exceeded`` for prompts over the context (not 413),
    the parameter in ``param``, a string ``code``."""
    message, kind = str(error.get("message", "")), str(error.get("type", "error"))
    details = error.get("details") or []
    prompt_param = "prompt" if path.startswith("/v1/completions") else "messages"
    if kind == "context_length_exceeded":
        # the code in the message too: the openai client's str(error) is the message alone, and that is
        # what langchain-openai searches for "context_length_exceeded" (-> ContextOverflowError)
        if "context_length_exceeded" not in message:
            message = f"{message} (context_length_exceeded)"
        return 400, openai_error_body(
            message, "invalid_request_error", prompt_param, "context_length_exceeded"
        )
    if status == 422 or (status == 400 and kind in ("BadRequestError", "invalid_request_error")):
        first = details[0] if details and isinstance(details[0], dict) else {}
        param = _param(first.get("loc", []))
        if param is None and message.startswith("kv_transfer_params"):
            param = "kv_transfer_params"
        elif param is None and ("vocabulary" in message or "empty prompt" in message):
            param = "prompt"
        elif param is None and "message" in message:
            param = "messages"
        etype = str(first.get("type", ""))
        code = VALIDATION_CODES.get(etype) or ("invalid_type" if etype.endswith("_type") else "invalid_value")
        return 400, openai_error_body(message, "invalid_request_error", param, code)
    if status == 404:
        code = "model_not_found" if "model" in message else "not_found"
        return 404, openai_error_body(
            message, "invalid_request_error", "model" if "model" in message else None, code
        )
    if status == 401:
        return 401, openai_error_body(message, "invalid_request_error", None, "invalid_api_key")
    if status == 429:
        return 429, openai_error_body(message, "requests", None, "rate_limit_exceeded")
    if status >= 500:
        return status, openai_error_body(message, "server_error", None, kind)
    return status, openai_error_body(message, "invalid_request_error", None, kind)


class OpenAIErrorMiddleware:
    """Rewrites the JSON error responses of :data:`OPENAI_ROUTES` into OpenAI's shape and statuses
    (:func:`to_openai_error`), whoever produced them (validation, handlers, the body-size limit, auth).
    Successful responses, streams included, pass through untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not is_openai_route(scope["path"]):
            return await self.app(scope, receive, send)
        held: dict = {}
        parts: list[bytes] = []

        async def rewrite(msg):
            if msg["type"] == "http.response.start" and msg["status"] >= 400:
                held["start"] = msg
                return
            if "start" not in held or msg["type"] != "http.response.body":
                return await send(msg)
            parts.append(msg.get("body", b""))
            if msg.get("more_body", False):
                return
            start, raw = held.pop("start"), b"".join(parts)
            status, body = start["status"], raw
            try:
                err = json.loads(raw)["error"]
                status, out = to_openai_error(start["status"], err, scope["path"])
                body = json.dumps(out).encode()
            except (ValueError, KeyError, TypeError):
                pass  # not ragkv's JSON error (e.g. plain text): as it was
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)


def stream_error(status: int, message: str, kind: str, path: str) -> dict:
    """The error chunk of an OpenAI stream that fails after its first bytes."""
    return to_openai_error(status, {"message": message, "type": kind}, path)[1]


def unsupported(param: str, message: str) -> RequestValidationError:
    """A 400 naming ``param`` (OpenAI's ``unsupported_parameter``): what ragkv cannot do is refused, never ignored."""
    return RequestValidationError(
        [{"type": "unsupported_parameter", "loc": ("body", param), "msg": message, "input": None}]
    )


def invalid_value(param: str, message: str) -> RequestValidationError:
    """A 400 naming ``param`` with OpenAI's ``invalid_value`` code."""
    return RequestValidationError(
        [{"type": "value_error", "loc": ("body", param), "msg": message, "input": None}]
    )


@dataclass(frozen=True)
class ForcedCall:
    """A chat request's forced function call: the function's name and its arguments' constraint."""

    name: str
    constraint: JsonConstraint


#: what the model id of the served model's RAG variant adds to its name (``GET /v1/models`` lists both)
RAG_MODEL_SUFFIX = "+rag"


def served_model_ids(settings: Settings) -> list[str]:
    """The model ids the OpenAI routes serve: the model (the messages as sent), and
    ``<model>+rag`` (chat with retrieval, for clients that cannot send ``extra_body``)."""
    name = settings.model_name()
    return [name, name + RAG_MODEL_SUFFIX]


def chat_model(settings: Settings, model: str | None) -> bool:
    """Whether a chat request's ``model`` selects the RAG variant; 404 ``model_not_found`` for an id
    that is not served (as vLLM answers), none: the served model."""
    from ragkv_server.errors import NotFoundError

    if model is None or model == settings.model_name():
        return False
    if model == settings.model_name() + RAG_MODEL_SUFFIX:
        return True
    raise NotFoundError(f"The model `{model}` does not exist.")


def chat_tool_call(req) -> ForcedCall | None:
    """The function call a chat request forces (``tool_choice`` naming a function, or ``"required"``
    with one tool), generated as JSON arguments constrained by its ``parameters`` schema (vLLM's
    named function calling), or None (no tools, or ``tool_choice: "none"``: plain text).
    ``"auto"`` (the default beside tools) would need the model to decide whether to call: refused
    with 400, never ignored; so are several tools under ``"required"`` and ``response_format`` beside a call.

    The function's name and description are not added to the prompt (this model's chat template has
    no tool section): a system line "Reply with the JSON arguments of the function ..." was tried and
    made SmolLM2-135M loop inside a string until ``max_tokens`` on the standard suite's Joke schema."""
    tools = getattr(req, "tools", None) or []
    choice = getattr(req, "tool_choice", None)
    if not tools:
        if choice not in (None, "none"):
            raise invalid_value("tool_choice", "tool_choice needs tools")
        return None
    if choice == "none":
        return None
    if choice in (None, "auto"):
        raise unsupported(
            "tool_choice",
            'this server calls a tool only when tool_choice names it ({"type": "function", "function": '
            '{"name": ...}}) or is "required" with one tool; "auto" (the default beside tools) is not served',
        )
    by_name = {t.function.name: t.function for t in tools}
    if choice == "required":
        if len(tools) != 1:
            raise unsupported("tool_choice", '"required" is served with one tool; name the function to call')
        fn = tools[0].function
    else:
        fn = by_name.get(choice.function.name)
        if fn is None:
            raise invalid_value("tool_choice", f"no tool named {choice.function.name!r} in tools")
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        raise invalid_value(
            "response_format", "a forced tool call's arguments are its JSON: send no response_format"
        )
    if getattr(req, "stop", None):
        raise invalid_value(
            "stop", "stop sequences cannot be combined with a tool call (they would cut its JSON)"
        )
    try:
        return ForcedCall(fn.name, json_constraint(fn.parameters or {"type": "object"}))
    except ConstraintError as e:
        raise invalid_value("tools", f"function {fn.name!r}: {e}") from None


def tool_call_message(call: ForcedCall, call_id: str, arguments: str) -> list[dict]:
    """``message.tool_calls`` of a forced call (the streamed deltas carry ``index`` too)."""
    return [{"id": call_id, "type": "function", "function": {"name": call.name, "arguments": arguments}}]


def check_generation_options(req, generation: str) -> None:
    """Structured output and logprobs are computed where tokens are sampled: in this process (threads
    or the engine), not on a vLLM server (the client does not forward them), so with generation
    'vllm' they are refused, never ignored."""
    if generation != "vllm":
        return
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        raise unsupported("response_format", "structured output is not available with generation 'vllm'")
    if getattr(req, "logprobs", None) or getattr(req, "top_logprobs", None) is not None:
        raise unsupported("logprobs", "logprobs are not available with generation 'vllm'")
    if getattr(req, "tools", None) and getattr(req, "tool_choice", None) not in (None, "none"):
        raise unsupported(
            "tools", "tool calls (constrained arguments) are not available with generation 'vllm'"
        )


def response_constraint(fmt, stop=None) -> JsonConstraint | None:
    """The constraint of a ``response_format`` (None for text). An invalid or unsupported schema, or
    stop strings beside it (they would cut the JSON), is a 400 naming the parameter."""
    if fmt is None or fmt.type == "text":
        return None
    if stop:
        raise invalid_value("stop", "stop sequences cannot be combined with a JSON response_format")
    try:
        if fmt.type == "json_object":
            return json_constraint()
        return json_constraint(fmt.json_schema.schema_)
    except ConstraintError as e:
        raise invalid_value("response_format", str(e)) from None


def chat_logprobs(req) -> int | None:
    """The number of alternatives per token a chat request asks for (None: no logprobs); 400 for
    ``top_logprobs`` without ``logprobs: true``, as OpenAI answers."""
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid_value("top_logprobs", "top_logprobs needs logprobs: true")
    return (req.top_logprobs or 0) if req.logprobs else None


def _token_text(model, token_id: int) -> tuple[str, list[int]]:
    """A token's text and its bytes (a token may hold part of a character: its text has U+FFFD there)."""
    raw = token_bytes(model, token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprob_content(model, events: list[TokenEvent]) -> list[dict]:
    """OpenAI's ``logprobs.content`` of token events: ``{token, logprob, bytes, top_logprobs}``."""
    out = []
    for ev in events:
        if ev.logprob is None:
            continue
        token, raw = _token_text(model, ev.token_id)
        top = []
        for tid, lp in ev.top_logprobs or ():
            t, b = _token_text(model, tid)
            top.append({"token": t, "logprob": lp, "bytes": b})
        out.append({"token": token, "logprob": ev.logprob, "bytes": raw, "top_logprobs": top})
    return out


def completion_logprobs(model, events: list[TokenEvent], offset: int = 0) -> dict:
    """The legacy ``logprobs`` of ``/v1/completions`` (vLLM's): ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (token text -> logprob; the chosen token included) and ``text_offset`` (each token's
    start in the completion text, from ``offset``: the text already streamed)."""
    tokens, lps, tops, offsets = [], [], [], []
    for ev in events:
        if ev.logprob is None:
            continue
        token = _token_text(model, ev.token_id)[0]
        top = {_token_text(model, tid)[0]: lp for tid, lp in ev.top_logprobs or ()}
        top.setdefault(token, ev.logprob)
        tokens.append(token)
        lps.append(ev.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def cached_tokens(stats: dict) -> int | None:
    """Prompt rows not prefilled from scratch: reused from stored chunk KV or exact from the prefix cache."""
    if "num_reused_rows" not in stats and "num_exact_rows" not in stats:
        return None
    return int(stats.get("num_reused_rows", 0)) + int(stats.get("num_exact_rows", 0))


def usage_with_details(usage: dict, stats: dict) -> dict:
    """``usage`` plus ``prompt_tokens_details.cached_tokens`` (when the prefill statistics tell it)."""
    n = cached_tokens(stats)
    return {**usage, "prompt_tokens_details": {"cached_tokens": n} if n is not None else None}
