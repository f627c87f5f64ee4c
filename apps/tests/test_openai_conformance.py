"""The OpenAI-compatible routes as OpenAI clients expect them, against a live ``python -m ragkv_server.server``:
the official ``openai`` client and ``langchain-openai``'s ``ChatOpenAI``. Errors have OpenAI's shape
and statuses (400 for invalid requests, 400 ``context_length_exceeded`` on overflow, so ``ChatOpenAI``
raises ``ContextOverflowError``); options ragkv does not serve are refused, never ignored (structured
output and logprobs: apps/tests/test_structured_api.py);
``GET /v1/models/{id}``; ``usage.prompt_tokens_details.cached_tokens`` counts the reused rows."""

from __future__ import annotations

import functools
import json
import operator

import httpx
import pytest
from helpers_service import chat_openai, running_server
from helpers_service import service_docs as _docs

from ragkv.testing import check_stop_strings, musique_samples

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow  # live server processes (scripts/test.sh runs them in the native pass)

NEW = 8
MODEL = "stories260k"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("oai")) as base:
        yield base


@pytest.fixture(scope="module")
def chunk_ids(server) -> list[int]:
    docs = _docs(musique_samples(2))
    ids = []
    for part in (docs[:4], docs[4:]):
        r = httpx.post(server + "/v1/documents", json={"documents": part}, timeout=120)
        assert r.status_code == 200, r.text
        ids += [c for d in r.json()["documents"] for c in d["chunk_ids"]]
    return ids


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def _openai_error(r: httpx.Response, status: int, param: str | None, code: str) -> str:
    """OpenAI's error object: exactly message, type, param and a string code."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and err["type"] and err["param"] == param and err["code"] == code, err
    return err["message"]


def _chat(server: str, **body) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Once upon a time"}], **body}
    return httpx.post(server + "/v1/chat/completions", json=body, timeout=120)


def test_validation_errors_are_400_with_param_and_string_code(server, client):
    assert "max_tokens" in _openai_error(_chat(server, max_tokens=-1), 400, "max_tokens", "invalid_value")
    _openai_error(_chat(server, messages=[]), 400, "messages", "invalid_value")
    _openai_error(_chat(server, stream=0), 400, "stream", "invalid_type")
    no_user = _chat(server, model=MODEL + "+rag", messages=[{"role": "system", "content": "hi"}])
    assert "user message" in _openai_error(no_user, 400, "messages", "invalid_value")  # RAG: a question
    bad_json = httpx.post(
        server + "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    _openai_error(bad_json, 400, None, "invalid_json")
    with pytest.raises(openai.BadRequestError) as e:  # was UnprocessableEntityError (422)
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-1
        )
    assert e.value.code == "invalid_value" and e.value.param == "max_tokens"
    # /v1/completions too (vLLM also answers 400), and ragkv's own routes keep their shape
    r = httpx.post(server + "/v1/completions", json={"prompt": [1, 2], "stream": 0})
    _openai_error(r, 400, "stream", "invalid_type")
    r = httpx.post(server + "/v1/completions", json={"prompt": [1, 99999], "max_tokens": 2})
    assert "vocabulary" in _openai_error(r, 400, "prompt", "invalid_value")
    native = httpx.post(server + "/v1/query", json={"question": ""})
    assert native.status_code == 422 and native.json()["error"]["code"] == 422


def test_a_body_not_declared_json_is_415_in_openais_error_shape(server):
    """schemathesis (eval.fuzz_api): the content-type guard's 415 on an OpenAI route had ragkv's error
    shape (an integer code), outside the OpenAI error middleware."""
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = httpx.post(server + path, content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
        _openai_error(r, 415, None, "unsupported_media_type")
    assert (
        "415" in httpx.get(server + "/openapi.json").json()["paths"]["/v1/completions"]["post"]["responses"]
    )


def test_context_overflow_is_400_context_length_exceeded(server, client, chunk_ids):
    too_long = {"ragkv": {"chunk_ids": chunk_ids[:8]}}
    r = _chat(server, max_tokens=48, **too_long)
    _openai_error(r, 400, "messages", "context_length_exceeded")  # was 413
    r = httpx.post(server + "/v1/completions", json={"prompt": [5] * 500, "max_tokens": 48})
    _openai_error(r, 400, "prompt", "context_length_exceeded")
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=48, extra_body=too_long
        )
    # one message longer than the context: judged by its tokens (was invalid_value, a character cap)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Once upon a time. " * 200}], max_tokens=8
        )
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert "512" in e.value.message  # the numbers: the prompt's tokens and the context


def test_langchain_chat_openai_raises_context_overflow_error(server, chunk_ids):
    from langchain_core.exceptions import ContextOverflowError

    chat = chat_openai(server, MODEL, NEW)
    msg = chat.invoke("Once upon a time", extra_body={"ragkv": {"chunk_ids": chunk_ids[:3]}})
    assert msg.content and msg.usage_metadata["output_tokens"] == NEW
    assert msg.usage_metadata["input_token_details"]["cache_read"] > 0  # the chunks' reused rows
    with pytest.raises(ContextOverflowError):
        chat.invoke("q", max_tokens=48, extra_body={"ragkv": {"chunk_ids": chunk_ids[:8]}})


def test_unsupported_options_are_refused_not_ignored(server):
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    two = [tool, {"type": "function", "function": {"name": "sub"}}]
    for body, param, code, says in (
        ({"tools": [tool]}, "tool_choice", "unsupported_parameter", '"auto"'),  # auto: the default
        ({"tools": [tool], "tool_choice": "auto"}, "tool_choice", "unsupported_parameter", "not served"),
        ({"tools": two, "tool_choice": "required"}, "tool_choice", "unsupported_parameter", "one tool"),
        ({"tool_choice": "required"}, "tool_choice", "invalid_value", "needs tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
                "tool_choice": "required",
            },
            "tools",
            "invalid_value",
            "objectx",
        ),
        (
            {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "tool_choice",
            "invalid_value",
            "no tool named 'mul'",
        ),
    ):
        msg = _openai_error(_chat(server, max_tokens=2, **body), 400, param, code)
        assert says in msg, msg
    ok = _chat(
        server,
        max_tokens=2,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        logprobs=False,
        ragkv={"retrieve": False},
    )
    assert ok.status_code == 200, ok.text
    r = httpx.post(server + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "suffix": "x"})
    assert "not supported" in _openai_error(r, 400, "suffix", "unsupported_parameter")


def test_model_retrieve(server, client):
    assert client.models.retrieve(MODEL).id == MODEL  # was 404
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-nope")
    assert e.value.code == "model_not_found"


def test_usage_reports_cached_tokens(server, client, chunk_ids):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Who was it?"}],
        max_tokens=NEW,
        extra_body={"ragkv": {"chunk_ids": chunk_ids[:3], "mode": "blend"}},
    )
    stats = out.model_extra["ragkv"]["stats"]
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert cached == stats["num_reused_rows"] + stats["num_exact_rows"] and cached > 0
    assert cached < out.usage.prompt_tokens
    full = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Who was it?"}],
        max_tokens=NEW,
        extra_body={"ragkv": {"chunk_ids": chunk_ids[:3], "mode": "full"}},
    )
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Who was it?"}],
            max_tokens=NEW,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ragkv": {"chunk_ids": chunk_ids[:3], "mode": "blend"}},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2, temperature=0)
    assert done.usage.prompt_tokens_details.cached_tokens is not None


def test_streamed_completion_returns_its_prompt_and_answer_token_ids(server):
    """Issue 54 (the soak recomputes every served answer from its prompt ids): a streamed completion
    with ``return_token_ids`` gives the prompt's ids (in its last chunk's choice) and each token's id,
    the same as the completion not streamed; before, a stream gave no prompt ids."""
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "temperature": 0,
        "return_token_ids": True,
    }
    whole = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        data = [x[len("data: ") :] for x in r.iter_lines() if x.startswith("data: ")]
    assert data[-1] == "[DONE]"
    choices = [json.loads(x)["choices"][0] for x in data[:-1]]
    assert [c.get("prompt_token_ids") for c in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1]["prompt_token_ids"] == whole["prompt_token_ids"] and whole["prompt_token_ids"]
    assert sum((c["token_ids"] for c in choices), []) == whole["token_ids"]


# ---- stop strings: never emitted, finish_reason from the generation --------------------------------------
def test_completions_stop_strings_never_leak(server, client):
    n_max = 24

    def complete(stop, n, streamed):
        kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=n, temperature=0, stop=[stop])
        if not streamed:
            c = client.completions.create(**kw).choices[0]
            return c.text, c.finish_reason
        chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
        assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        return "".join(c.text for c in chunks), chunks[-1].finish_reason

    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=n_max, temperature=0, stream=True)
    chunks = [c.choices[0] for c in client.completions.create(**kw) if c.choices]
    pieces = [c.text for c in chunks if c.finish_reason is None]
    assert len(pieces) == n_max and chunks[-1].finish_reason == "length"
    check_stop_strings(pieces, n_max, complete)


def test_langchain_chat_openai_stop_strings_never_leak(server, chunk_ids):
    n_max = 24
    q, extra = "Once upon a time", {"ragkv": {"chunk_ids": chunk_ids[:3]}}

    def chat(stop, n, streamed):
        model = chat_openai(server, MODEL, n)
        if not streamed:
            msg = model.invoke(q, stop=[stop], extra_body=extra)
        else:
            msg = functools.reduce(operator.add, model.stream(q, stop=[stop], extra_body=extra))
        return msg.content, msg.response_metadata["finish_reason"]

    model = chat_openai(server, MODEL, n_max)
    chunks = list(model.stream(q, extra_body=extra))
    ends = [i for i, c in enumerate(chunks) if c.response_metadata.get("finish_reason")]
    pieces = [c.content for c in chunks[1 : ends[0]]]  # the tokens: after the role chunk, before the end
    assert len(pieces) == n_max
    check_stop_strings(pieces, n_max, chat)


def test_forced_function_calls_return_arguments_matching_the_schema(server, client):
    """``tool_choice`` naming a function (or ``"required"`` with one tool): the call's arguments are
    generated under its parameters' schema (vLLM's named function calling), streamed as OpenAI's
    ``tool_calls`` deltas; ``ChatOpenAI.with_structured_output(method="function_calling")`` works."""
    import json

    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "days": {"type": "integer", "minimum": 1, "maximum": 30},
        },
        "required": ["city", "days"],
    }
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": params}}]
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
        max_tokens=48,
        tools=tools,
        extra_body={"ragkv": {"retrieve": False}},
    )
    for choice in ({"type": "function", "function": {"name": "forecast"}}, "required"):
        out = client.chat.completions.create(**kw, tool_choice=choice)
        msg = out.choices[0].message
        assert msg.content is None and out.choices[0].finish_reason == "stop"
        (call,) = msg.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "forecast" and call.id.startswith("call_")
        assert set(args) == {"city", "days"} and isinstance(args["days"], int)
    parts = list(client.chat.completions.create(**kw, tool_choice="required", stream=True))
    deltas = [p.choices[0].delta.tool_calls for p in parts if p.choices and p.choices[0].delta.tool_calls]
    assert deltas[0][0].id.startswith("call_") and deltas[0][0].function.name == "forecast"
    assert json.loads("".join(d[0].function.arguments or "" for d in deltas)) == args  # greedy: the same call
    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: str = Field(max_length=20)
        days: int = Field(ge=1, le=30)

    chat = chat_openai(server, MODEL, 48)
    got = chat.with_structured_output(Forecast, method="function_calling").invoke(
        "Weather in Paris for 3 days?", extra_body={"ragkv": {"retrieve": False}}
    )
    assert isinstance(got, Forecast)
