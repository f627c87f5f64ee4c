"""Structured output (``response_format``) and log-probabilities on the OpenAI routes, against a live
``python -m ragkv_server.server`` with the official ``openai`` client and ``langchain-openai``'s
``ChatOpenAI.with_structured_output``: JSON matching the schema whenever the finish reason is "stop",
"length" when the token limit cuts it, refused schemas as OpenAI's 400s naming ``response_format``,
``logprobs`` in OpenAI's chat shape and the legacy completions shape, streamed and not, on worker
threads and on the batching engine; and (slow) the issue's goal on the real SmolLM2 model:
``with_structured_output(schema, method="json_schema")`` gives a valid object on 10 of 10 schemas."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from helpers_service import chat_openai, running_server  # noqa: E402

from ragkv.testing import structured_schemas, worker_threads  # noqa: E402

pytestmark = pytest.mark.slow  # live server processes (scripts/test.sh runs them in the native pass)

MODEL = "stories260k"


def check_output(text: str, schema: dict) -> dict:
    """``text`` parsed, after checking it is JSON matching ``schema``."""
    obj = json.loads(text)
    jsonschema.validate(obj, schema)
    return obj


LONG = {"RAGKV_MAX_NEW_TOKENS": "120", "RAGKV_MAX_NEW_TOKENS_LIMIT": "200"}
NO_RAG = {"ragkv": {"retrieve": False}}
#: schemas the story model closes greedily within 120 tokens (it rambles on numbers of the others)
CLOSING = ("answer", "address", "rating")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("so"), **LONG) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def _case(name: str) -> dict:
    return next(c for c in structured_schemas() if c["name"] == name)


def _fmt(case: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": case["name"], "schema": case["schema"]}}


def _chat(client, case: dict, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": case["prompt"]}],
        max_tokens=kw.pop("max_tokens", 120),
        temperature=0,
        response_format=_fmt(case),
        extra_body=NO_RAG,
        **kw,
    )


def _error(r: httpx.Response, param: str, code: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["code"] == code, err
    return err["message"]


# ---- structured output ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CLOSING)
def test_json_schema_output_matches_the_schema_streamed_and_not(client, name):
    case = _case(name)
    out = _chat(client, case)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.logprobs is None
    check_output(choice.message.content, case["schema"])
    chunks = list(_chat(client, case, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content and chunks[-1].choices[0].finish_reason == "stop"


def test_the_token_limit_cuts_the_json_with_finish_reason_length(client):
    out = _chat(client, _case("answer"), max_tokens=5)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    assert out.choices[0].message.content.startswith("{")
    with pytest.raises(ValueError):
        json.loads(out.choices[0].message.content)


def test_every_schema_is_valid_whenever_it_stops(client):
    stopped = 0
    for case in structured_schemas():
        for stream in (False, True):
            if not stream:
                c = _chat(client, case).choices[0]
                text, reason = c.message.content, c.finish_reason
            else:
                chunks = [c.choices[0] for c in _chat(client, case, stream=True) if c.choices]
                text, reason = "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
            if reason == "stop":
                check_output(text, case["schema"])
                stopped += 1
            else:
                assert reason == "length"
    assert stopped >= 2 * len(CLOSING)


def test_json_object_and_the_openai_clients_parse(client):
    from pydantic import BaseModel, Field

    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a JSON object."}],
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_object"},
        extra_body=NO_RAG,
    )
    c = out.choices[0]
    assert c.message.content.startswith("{")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)

    class Answer(BaseModel):
        answer: str = Field(max_length=80)
        sure: bool

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    parsed = parse(
        model=MODEL,
        messages=[{"role": "user", "content": _case("answer")["prompt"]}],
        max_tokens=120,
        temperature=0,
        response_format=Answer,
        extra_body=NO_RAG,
    )
    msg = parsed.choices[0].message
    assert parsed.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Answer), msg.content


SCHEMA_ERRORS = [  # (response_format, code, a word of the message)
    (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
        "invalid_value",
        "objectx",
    ),
    (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
        "invalid_value",
        "unclosed group",
    ),
    (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"format": "no-such-format"}}},
        "invalid_value",
        "no-such-format",
    ),
    (
        {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
        "missing_required_parameter",
        "name",
    ),
    ({"type": "json_schema", "json_schema": {"name": "bad name!"}}, "invalid_value", "name"),
    ({"type": "xml"}, "invalid_value", "xml"),
    ({"type": "json_object", "schema": {}}, "unknown_parameter", "schema"),
]


@pytest.mark.parametrize("fmt, code, why", SCHEMA_ERRORS)
def test_invalid_response_formats_are_400_naming_response_format(server, fmt, code, why):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "response_format": fmt,
    }
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert why in _error(r, "response_format", code)
    r = httpx.post(
        server + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "response_format": fmt}, timeout=60
    )
    assert why in _error(r, "response_format", code)


def test_stop_strings_beside_a_json_format_are_refused(server, client):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_object"},
        "stop": ["}"],
    }
    assert "stop" in _error(
        httpx.post(server + "/v1/chat/completions", json=body, timeout=60), "stop", "invalid_value"
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="x", stop=["}"], extra_body={"response_format": {"type": "json_object"}}
        )
    assert e.value.param == "stop"


def test_completions_take_a_response_format_too(client):
    case = _case("rating")
    out = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=120,
        temperature=0,
        extra_body={"response_format": _fmt(case)},
    )
    c = out.choices[0]
    assert c.finish_reason == "stop", c.text
    check_output(c.text, case["schema"])


# ---- logprobs ---------------------------------------------------------------------------------------
def test_chat_logprobs_streamed_and_not(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=NO_RAG,
    )
    out = client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 12
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode("utf-8", "replace") == t.token
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the top one
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True
        )
    assert "".join(t.token for t in content).strip() == out.choices[0].message.content.strip()
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    streamed = [t for c in chunks if c.logprobs for t in c.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    # two runs of the same prefill may differ in the last float bits (kernel reduction order)
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    plain = client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    zero = client.chat.completions.create(**{**kw, "top_logprobs": 0}).choices[0].logprobs.content
    assert [t.logprob for t in zero] == pytest.approx([t.logprob for t in content], abs=1e-4) and all(
        t.top_logprobs == [] for t in zero
    )


def test_logprobs_with_structured_output_are_the_models(client):
    case = _case("answer")
    out = _chat(client, case, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(t.top_logprobs[0].logprob >= t.logprob for t in content)  # the model's, before the mask


@pytest.mark.parametrize(
    "body, param",
    [
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
    ],
)
def test_bad_logprobs_options_are_400(server, body, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_completions_logprobs_legacy_shape_streamed_and_not(server, client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=2)
    c = client.completions.create(**kw).choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for tok, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[tok] == p and len(top) <= 3 and max(top.values()) == p  # greedy: the best
    chunks = [x.choices[0] for x in client.completions.create(**kw, stream=True) if x.choices]
    streamed = [x.logprobs for x in chunks if x.logprobs and x.logprobs.tokens]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    r = httpx.post(server + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


# ---- LangChain's ChatOpenAI ---------------------------------------------------------------------------
def test_chat_openai_with_structured_output_is_valid_whenever_it_stops(server):
    """The story model: every object it returns is valid; the ones it closes parse, the others end
    with "length", which langchain-openai raises as the openai client's ``LengthFinishReasonError``."""
    chat = chat_openai(server, MODEL, 120, extra_body=NO_RAG)
    parsed = 0
    for case in structured_schemas():
        try:
            out = chat.with_structured_output(case["schema"], method="json_schema").invoke(case["prompt"])
        except openai.LengthFinishReasonError:
            continue
        jsonschema.validate(out, case["schema"])
        parsed += 1
    assert parsed >= len(CLOSING)


# ---- the batching engine ------------------------------------------------------------------------------
def test_engine_generation_serves_structured_output_and_logprobs(tmp_path, client):
    """generation="engine" gives what the worker threads give (greedy): the same JSON, the same logprobs."""
    case = _case("address")
    want = _chat(client, case, logprobs=True, top_logprobs=2).choices[0]
    with running_server(tmp_path, RAGKV_GENERATION="engine", **LONG) as base:
        eng = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        got = _chat(eng, case, logprobs=True, top_logprobs=2).choices[0]
        chunks = [c.choices[0] for c in _chat(eng, case, stream=True) if c.choices]
    assert got.finish_reason == "stop" and got.message.content == want.message.content
    check_output(got.message.content, case["schema"])
    assert [t.token for t in got.logprobs.content] == [t.token for t in want.logprobs.content]
    # the engine's batched prefill and the threads' differ in the last float bits (rounding to 3
    # decimals still flipped at a boundary: -7.3705 vs -7.3704): compare within a tolerance
    assert [t.logprob for t in got.logprobs.content] == pytest.approx(
        [t.logprob for t in want.logprobs.content], abs=1e-3
    )
    assert "".join(c.delta.content or "" for c in chunks) == want.message.content


# ---- the goal on the real model -----------------------------------------------------------------
@pytest.mark.slow
def test_chat_openai_structured_output_on_the_real_model_ten_of_ten(tmp_path):
    """SmolLM2-135M-Instruct behind the service: ``ChatOpenAI(...).with_structured_output(schema,
    method="json_schema")`` returns a valid object for each of the 10 schemas. The 10 clients ask at
    once, on the batching engine (one decode step serves all: ~3x less CPU than one after another on
    worker threads; the threads' constrained path runs these schemas on the tiny model above, and
    ``python -m eval.bench_structured --generate`` times them one by one on the real model)."""
    from concurrent.futures import ThreadPoolExecutor

    from ragkv.model import DEFAULT_MODEL
    from ragkv.model.registry import ModelFetchError, pull

    try:
        pull(DEFAULT_MODEL, quiet=True)
    except ModelFetchError as e:
        pytest.skip(f"default model not available: {e}")
    cases = structured_schemas()
    env = {
        **LONG,
        "RAGKV_MODEL": DEFAULT_MODEL,
        "RAGKV_TORCH_THREADS": str(worker_threads()),
        "RAGKV_MAX_NEW_TOKENS_LIMIT": "256",
        "RAGKV_GENERATION": "engine",
        "RAGKV_MAX_CONCURRENCY": str(len(cases)),
    }
    with running_server(tmp_path, **env) as base:
        chat = chat_openai(base, DEFAULT_MODEL, 256, extra_body=NO_RAG)

        def ask(case: dict):
            return chat.with_structured_output(case["schema"], method="json_schema").invoke(case["prompt"])

        with ThreadPoolExecutor(len(cases)) as pool:
            outs = list(pool.map(ask, cases))
    for case, out in zip(cases, outs, strict=True):
        assert isinstance(out, dict), case["name"]
        jsonschema.validate(out, case["schema"])
