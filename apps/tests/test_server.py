"""The HTTP service end to end: a real ``python -m ragkv_server.server`` (uvicorn) on a loopback port, driven by
httpx, the ``openai`` client and schemathesis."""

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from helpers_service import LIMITS, NEW, metric, running_server
from helpers_service import service_docs as _docs

from ragkv.testing import check_stop_strings, free_port, musique_samples, stories_path
from ragkv_server.config import ConfigError, Settings, load_settings

pytestmark = pytest.mark.slow  # live server processes (scripts/test.sh runs them in the native pass)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("server")) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def samples():
    return musique_samples(2)


def _ingest(client: httpx.Client, samples) -> list[dict]:
    docs = _docs(samples)
    out = []
    for part in (docs[:4], docs[4:]):  # RAGKV_MAX_DOCUMENTS=4 per request
        r = client.post("/v1/documents", json={"documents": part})
        assert r.status_code == 200, r.text
        out += r.json()["documents"]
    return out


@pytest.fixture(scope="module")
def ingested(client, samples):
    return _ingest(client, samples)


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == status and body["message"] and body["type"]
    return body["message"]


# ---- settings -------------------------------------------------------------------------------------------
def test_settings_precedence_file_env_flags(tmp_path, monkeypatch):
    cfg = tmp_path / "ragkv.toml"
    cfg.write_text('top_k = 3\nport = 9000\nstore = "redis://localhost:6379/0"\n')
    monkeypatch.setenv("RAGKV_PORT", "9100")
    s = load_settings(cfg, max_queue=7)
    assert (s.top_k, s.port, s.max_queue, s.store) == (3, 9100, 7, "redis://localhost:6379/0")
    (tmp_path / "bad.toml").write_text("bogus = 1\n")
    with pytest.raises(ConfigError, match="bogus"):
        load_settings(tmp_path / "bad.toml")
    with pytest.raises(ConfigError):
        load_settings(cfg, top_k=1000)  # beyond max_top_k


# ---- documents ------------------------------------------------------------------------------------------
def test_ingest_returns_ids_and_is_idempotent(client, ingested, samples):
    assert [d["id"] for d in ingested] == [f"s{i}-p{j}" for i in range(2) for j in range(3)]
    assert all(d["status"] == "added" and d["chunk_ids"] for d in ingested)
    again = client.post(
        "/v1/documents",
        json={
            "documents": [
                {
                    "id": "s0-p0",
                    "text": samples[0]["ctxs"][0]["text"][:300],
                    "metadata": {"title": samples[0]["ctxs"][0]["title"]},
                }
            ]
        },
    )
    assert again.status_code == 200
    body = again.json()
    assert body["documents"][0]["status"] == "unchanged" and body["kv_computed"] == 0
    assert body["documents"][0]["chunk_ids"] == ingested[0]["chunk_ids"]
    assert set(client.get("/v1/documents").json()["ids"]) >= {d["id"] for d in ingested}


def test_ndjson_upload_streams_and_delete(client):
    lines = [
        json.dumps({"id": f"up-{i}", "text": f"Lily had {i} red balls. She played in the park."})
        for i in range(3)
    ]

    def body():  # a generator: sent chunked, without Content-Length, read by the server as it arrives
        for line in lines:
            yield (line + "\n").encode()

    r = client.post("/v1/documents", content=body(), headers={"content-type": "application/x-ndjson"})
    assert r.status_code == 200, r.text
    docs = r.json()["documents"]
    assert [d["id"] for d in docs] == ["up-0", "up-1", "up-2"] and all(d["status"] == "added" for d in docs)
    changed = client.post("/v1/documents", json={"documents": [{"id": "up-0", "text": "Tom had a dog."}]})
    assert changed.json()["documents"][0]["status"] == "replaced"
    bad = client.post(
        "/v1/documents", content=lines[0] + "\n{not json\n", headers={"content-type": "application/x-ndjson"}
    )
    assert "line 2" in _error(bad, 422)
    for d in ("up-0", "up-1", "up-2"):
        assert client.delete(f"/v1/documents/{d}").json() == {"id": d, "deleted": True}
    assert "unknown document" in _error(client.delete("/v1/documents/up-0"), 404)
    gone = client.post("/v1/query", json={"question": "x", "chunk_ids": docs[1]["chunk_ids"]})
    _error(gone, 404)
    big = (lines[0] + "\n").encode() * 5000  # > 256 KiB: refused whether its length is declared or not
    ndjson = {"content-type": "application/x-ndjson"}
    assert "larger than" in _error(client.post("/v1/documents", content=big, headers=ndjson), 413)
    streamed = client.post(
        "/v1/documents", content=(big[i : i + 8192] for i in range(0, len(big), 8192)), headers=ndjson
    )
    assert "larger than" in _error(streamed, 413)


# ---- query ----------------------------------------------------------------------------------------------
def test_query_answers_with_sources_timings_and_reuse(client, ingested, samples):
    q = samples[0]["question"]
    r = client.post("/v1/query", json={"question": q})
    assert r.status_code == 200, r.text
    a = r.json()
    assert a["answer"] and a["mode"] == "blend" and len(a["sources"]) == 3
    assert set(a["timings"]) == {"queue_s", "retrieval_s", "kv_fetch_s", "ttft_s", "total_s"}
    assert 0 < a["timings"]["ttft_s"] <= a["timings"]["total_s"]
    assert a["stats"]["kv_hits"] == 3 and a["stats"]["num_reused_rows"] > 0
    assert a["usage"]["completion_tokens"] == NEW and a["finish_reason"] == "length"
    known = {c for d in ingested for c in d["chunk_ids"]}
    assert all(s["chunk_id"] in known and s["kv_key"] and s["text"] for s in a["sources"])
    ids = [s["chunk_id"] for s in a["sources"]]
    full = client.post("/v1/query", json={"question": q, "chunk_ids": ids, "mode": "full"}).json()
    assert full["stats"]["kv_hits"] == 0 and full["stats"]["num_reused_rows"] == 0
    one = client.post("/v1/query", json={"question": q, "chunk_ids": ids, "ratio": 1.0}).json()
    assert one["answer"] == full["answer"]  # blend at ratio 1 is full prefill, through the service
    assert [s["chunk_id"] for s in one["sources"]] == ids


def _stream_events(client: httpx.Client, body: dict, on_event=None) -> list[tuple[str, dict]]:
    """``(event, data)`` of a ``/v1/query`` SSE stream, ``on_event(event)`` called as each arrives."""
    events = []
    with client.stream("POST", "/v1/query", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                events.append((event, json.loads(line[6:])))
                if on_event is not None:
                    on_event(event)
    return events


def test_query_stream_events_make_up_the_answer(client, ingested, samples):
    """The real server's stream: token events, then one answer whose text they add up to."""
    events = _stream_events(client, {"question": samples[1]["question"], "max_tokens": 48})
    kinds = [e for e, _ in events]
    assert kinds[-1] == "answer" and kinds.count("token") >= 2 and "error" not in kinds
    tokens = [d["text"] for e, d in events if e == "token"]
    final = events[-1][1]
    assert "".join(tokens) == final["answer"] and final["usage"]["completion_tokens"] == len(tokens)


@contextlib.contextmanager
def serving_in_process(app) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port in a thread of this process (so a test can
    hold the generation with an event it controls); yields the base URL."""
    import threading

    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:  # a deadline for start-up, not a measure
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("the in-process server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_query_stream_delivers_tokens_incrementally(tmp_path, embedder, one_thread, samples, monkeypatch):
    """Streaming streams: the generation is held before its second token until the client has
    received the first token's event (an event the client sets), so a buffered answer, sent when
    the generation ends, would never arrive in time (the hold gives up after 60 s: a failure).
    Ordering, not arrival times; the served service in process with the tiny model."""
    import threading

    from ragkv import LLM
    from ragkv.generate import Detokenizer
    from ragkv.rag import RAG
    from ragkv_server.server import create_app
    from ragkv_server.service import Service

    rag = RAG(
        LLM(str(stories_path())),
        tmp_path / "data",
        embedder=embedder,
        chunk_tokens=int(LIMITS["RAGKV_CHUNK_TOKENS"]),
        top_k=int(LIMITS["RAGKV_TOP_K"]),
    )
    rag.ingest(_docs(samples), show_progress=False)
    settings = Settings(max_new_tokens=NEW, max_new_tokens_limit=48, allowed_hosts=["127.0.0.1"])
    svc = Service(settings, rag)
    svc.start()  # the RAG is given: this picks the generator (no lifespan)
    received = threading.Event()  # set by the client when the first token event has arrived
    held: list[bool] = []
    accept = Detokenizer.accept

    def held_accept(self, tok):
        if len(self.ids) == 1:  # the second token: not before the client has the first
            held.append(received.wait(60))
        return accept(self, tok)

    monkeypatch.setattr(Detokenizer, "accept", held_accept)

    def on_event(event: str) -> None:
        if event == "token":
            received.set()

    try:
        with (
            serving_in_process(create_app(settings, svc)) as base,
            httpx.Client(base_url=base, timeout=120) as c,
        ):
            body = {"question": samples[1]["question"], "max_tokens": 48}
            events = _stream_events(c, body, on_event)
    finally:
        svc.close()
    kinds = [e for e, _ in events]
    assert kinds[-1] == "answer" and kinds.count("token") >= 2 and "error" not in kinds
    assert held == [True]  # the first token reached the client while the generation waited for it
    tokens = [d["text"] for e, d in events if e == "token"]
    assert "".join(tokens) == events[-1][1]["answer"]


def test_client_that_goes_away_stops_its_generation(client, ingested, samples):
    def cancelled() -> float:
        line = next(
            x
            for x in client.get("/metrics").text.splitlines()
            if x.startswith("ragkv_cancelled_streams_total")
        )
        return float(line.split()[-1])

    before = cancelled()
    body = {"question": samples[0]["question"], "stream": True, "max_tokens": 48, "stop": None}
    with client.stream("POST", "/v1/query", json=body) as r:
        for line in r.iter_lines():
            if line == "event: token":
                break  # leave after the first token: the connection closes with the block
    deadline = time.time() + 10
    while cancelled() == before and time.time() < deadline:
        time.sleep(0.05)
    assert cancelled() == before + 1


# ---- OpenAI compatibility -------------------------------------------------------------------------------
def test_openai_client_chat_completions(server, ingested, samples):
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    q = samples[0]["question"]
    assert [m.id for m in oc.models.list().data] == ["stories260k", "stories260k+rag"]
    out = oc.chat.completions.create(  # the RAG model id: retrieval without extra_body
        model="stories260k+rag", messages=[{"role": "user", "content": q}], max_tokens=NEW
    )
    assert out.choices[0].message.content and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == NEW
    extra = out.model_extra["ragkv"]
    assert extra["stats"]["kv_hits"] == len(extra["sources"]) == 3
    ids = [s["chunk_id"] for s in extra["sources"]]
    stream = oc.chat.completions.create(
        model="stories260k",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}],
        max_tokens=NEW,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ragkv": {"chunk_ids": ids, "mode": "blend"}},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals and finals[0].model_extra["ragkv"]["stats"]["kv_hits"] == 3
    assert [s["chunk_id"] for s in finals[0].model_extra["ragkv"]["sources"]] == ids
    assert chunks[-1].usage.completion_tokens == len(pieces)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # OpenAI's 400 (test_openai_conformance)
        oc.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], max_tokens=-1)
    with pytest.raises(openai.NotFoundError, match="unknown chunk id"):
        oc.chat.completions.create(
            model="stories260k",
            messages=[{"role": "user", "content": q}],
            extra_body={"ragkv": {"chunk_ids": [987654]}},
        )


def test_a_clients_own_rag_prompt_reuses_the_stored_chunks_inside_it(server, ingested, samples):
    """Transparent reuse on the standard endpoints: a prompt the client formatted itself (documents
    joined by blank lines, no ragkv option) reuses the stored KV of the documents inside it, on
    ``/v1/completions`` and on chat (retrieval is off unless asked for); ``usage`` reports the reused
    rows. Naming no chunks (``kv_transfer_params`` with ``chunks: []``) is an exact full prefill."""
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    docs = _docs(samples)[:2]  # the test model has 512 positions
    n_chunks = sum(len(d["chunk_ids"]) for d in ingested if d["id"] in {x["id"] for x in docs})
    prompt = (
        "Context:\n\n"
        + "\n\n".join(d["text"] for d in docs)
        + f"\n\nQuestion: {samples[0]['question']}\nAnswer:"
    )
    out = oc.completions.create(model="stories260k", prompt=prompt, max_tokens=NEW)
    stats = out.model_extra["ragkv"]
    assert stats["mode"] == "blend" and stats["kv_hits"] == n_chunks
    assert out.usage.prompt_tokens_details.cached_tokens >= 0.5 * out.usage.prompt_tokens
    full = oc.completions.create(
        model="stories260k",
        prompt=prompt,
        max_tokens=NEW,
        extra_body={"kv_transfer_params": {"ragkv": {"chunks": []}}},
    )
    assert full.model_extra["ragkv"]["mode"] == "full"
    assert full.model_extra["ragkv"]["num_reused_rows"] == 0
    assert not (full.usage.prompt_tokens_details and full.usage.prompt_tokens_details.cached_tokens)
    chat = oc.chat.completions.create(  # over the 400-character question cap: messages are not capped
        model="stories260k", messages=[{"role": "user", "content": prompt}], max_tokens=NEW
    )
    assert chat.model_extra["ragkv"]["stats"]["kv_hits"] == n_chunks
    assert chat.model_extra["ragkv"]["sources"] == []  # nothing retrieved
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0.5 * chat.usage.prompt_tokens


# ---- bad input --------------------------------------------------------------------------------------------
def test_bad_inputs_get_4xx_with_a_message(client, ingested):
    post = client.post
    assert "question" in _error(post("/v1/query", json={"question": ""}), 422)
    assert "question" in _error(post("/v1/query", json={"question": "   "}), 422)
    assert "unknown chunk id" in _error(post("/v1/query", json={"question": "q", "chunk_ids": [987654]}), 404)
    assert "max_tokens" in _error(post("/v1/query", json={"question": "q", "max_tokens": -1}), 422)
    assert "mode" in _error(post("/v1/query", json={"question": "q", "mode": "turbo"}), 422)
    assert "JSON" in _error(
        post("/v1/query", content=b'{"question": ', headers={"content-type": "application/json"}), 422
    )
    assert "larger than" in _error(post("/v1/query", json={"question": "q" * (70 << 10)}), 413)
    assert "unknown_field" in _error(post("/v1/query", json={"question": "q", "unknown_field": 1}), 422)
    assert "context" in _error(
        post(
            "/v1/query",
            json={
                "question": "q",
                "max_tokens": 48,
                "chunk_ids": [c for d in ingested for c in d["chunk_ids"]][:8],
            },
        ),
        413,
    )
    # the OpenAI routes answer invalid requests with OpenAI's 400 and error object (string code)
    for body in (
        {"model": "stories260k+rag", "messages": [{"role": "system", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}], "n": 2},
        {"messages": []},
    ):
        r = post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text
    _error(post("/v1/documents", json={"documents": [{"text": "   "}]}), 422)
    _error(post("/v1/documents", json={"documents": [{"id": "a/b", "text": "x"}]}), 422)
    _error(post("/v1/documents", content=b"text", headers={"content-type": "text/plain"}), 415)
    _error(client.get("/v1/nope"), 404)
    _error(client.put("/v1/query", json={}), 405)


# ---- concurrency, backpressure, metrics ----------------------------------------------------------------------
def test_32_concurrent_queries_all_succeed(server, ingested, samples):
    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=300) as c:
            qs = [samples[i % 2]["question"] for i in range(32)]
            return await asyncio.gather(
                *(c.post("/v1/query", json={"question": q, "stream": i % 4 == 0}) for i, q in enumerate(qs))
            )

    rs = asyncio.run(run())
    assert [r.status_code for r in rs] == [200] * 32
    by_question: dict[int, set] = {0: set(), 1: set()}
    for i, r in enumerate(rs):
        if r.headers["content-type"].startswith("application/json"):
            by_question[i % 2].add(r.json()["answer"])
        else:
            assert "event: answer" in r.text and "event: error" not in r.text
    assert [len(v) for v in by_question.values()] == [1, 1]  # greedy: one question, one answer, under load


def test_overload_gets_429_not_500(server, ingested, samples):
    async def run():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server, timeout=300, limits=limits) as c:
            return await asyncio.gather(
                *(
                    c.post("/v1/query", json={"question": samples[0]["question"], "max_tokens": 32})
                    for _ in range(64)
                )
            )

    rs = asyncio.run(run())
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 36
    busy = next(r for r in rs if r.status_code == 429)
    assert "busy" in _error(busy, 429) and busy.headers["retry-after"] == "1"


def test_metrics_prometheus_text(client, ingested):
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = r.text
    for name in (
        "ragkv_http_requests_total",
        "ragkv_ttft_seconds_bucket",
        "ragkv_kv_hit_rate",
        "ragkv_store_bytes",
        "ragkv_requests_queued",
        "ragkv_rejected_requests_total",
    ):
        assert f"# TYPE {name.removesuffix('_bucket')} " in text, name
    samples = {
        line.split(" ")[0]: float(line.split(" ")[-1])
        for line in text.splitlines()
        if line and line[0] != "#"
    }
    assert samples['ragkv_ttft_seconds_count{mode="blend"}'] >= 32
    assert samples["ragkv_store_bytes"] > 0 and samples["ragkv_kv_hit_rate"] == 1.0
    assert samples['ragkv_http_requests_total{method="POST",route="/v1/query",status="200"}'] >= 32
    assert samples['ragkv_rejected_requests_total{pool="query",reason="busy"}'] >= 1
    assert client.get("/healthz").json()["chunks"] > 0


# ---- schemathesis (last: it ingests random documents) --------------------------------------------------------
@pytest.mark.slow
def test_schemathesis_finds_no_server_errors(server, ingested):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(server + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {f"{o.method.upper()} {o.path}" for o in ops} >= {
        "POST /v1/query",
        "POST /v1/chat/completions",
        "POST /v1/documents",
        "DELETE /v1/documents/{doc_id}",
    }
    seen = []
    for op in ops:
        cases = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))

        @settings(
            max_examples=int(os.environ.get("RAGKV_SCHEMATHESIS_EXAMPLES", "10")),
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=cases)
        def check(case):
            resp = case.call(base_url=server, timeout=120)
            seen.append(resp.status_code)
            case.validate_response(resp, checks=[not_a_server_error])

        check()
    assert seen and max(seen) < 500


# ---- generation through ragkv.engine (continuous batching) ------------------------------------------------
@pytest.fixture(scope="module")
def engine_client(request, tmp_path_factory, samples):
    """A second server: generation through ragkv.engine, chunk KV in Redis when redis-server is installed."""
    pytest.importorskip("ragkv.engine")
    from ragkv.testing.fixtures import REDIS_BIN

    env = {"RAGKV_GENERATION": "engine"}
    if REDIS_BIN is not None:
        redis_url = request.getfixturevalue("redis_server").url
        env["RAGKV_STORE"] = f"{redis_url}?prefix=ragkv-server-{uuid.uuid4().hex[:8]}:"
    with running_server(tmp_path_factory.mktemp("engine"), **env) as base:
        with httpx.Client(base_url=base, timeout=120) as c:
            c.store_url = env.get("RAGKV_STORE")
            _ingest(c, samples)
            yield c


def test_engine_server_store_is_selectable(engine_client):
    if engine_client.store_url is None:
        pytest.skip("redis-server not installed: the engine server uses the local-directory store")
    import redis

    url, prefix = engine_client.store_url.split("?prefix=")
    keys = redis.Redis.from_url(url).hlen(f"{prefix}@index")  # the store's index of stored chunk KV
    assert keys > 0
    metrics = engine_client.get("/metrics").text
    assert metric(metrics, "ragkv_store_ops", op="puts") == keys


def test_engine_generation_reuses_kv_streams_and_matches_full(engine_client, samples):
    q = samples[0]["question"]
    a = engine_client.post("/v1/query", json={"question": q}).json()
    assert a["mode"] == "blend" and len(a["sources"]) == 3 and a["usage"]["completion_tokens"] == NEW
    assert a["stats"]["kv_hits"] == 3 and a["stats"]["num_reused_rows"] > 0
    assert 0 < a["timings"]["ttft_s"] <= a["timings"]["total_s"]
    ids = [s["chunk_id"] for s in a["sources"]]
    full = engine_client.post("/v1/query", json={"question": q, "chunk_ids": ids, "mode": "full"}).json()
    one = engine_client.post("/v1/query", json={"question": q, "chunk_ids": ids, "ratio": 1.0}).json()
    assert full["stats"]["num_reused_rows"] == 0 and one["answer"] == full["answer"]
    with engine_client.stream("POST", "/v1/query", json={"question": q, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("event: ")]
    assert lines.count("event: token") == NEW and lines[-1] == "event: answer"
    _error(engine_client.post("/v1/query", json={"question": q, "chunk_ids": [987654]}), 404)
    _error(
        engine_client.post("/v1/query", json={"question": q, "max_tokens": 48, "chunk_ids": (ids * 3)[:8]}),
        413,
    )


def test_engine_generation_32_concurrent_queries(engine_client, samples):
    base = str(engine_client.base_url)
    # each question asked alone first: the serial reference every concurrent answer must equal
    serial = [engine_client.post("/v1/query", json={"question": samples[i]["question"]}) for i in (0, 1)]
    assert [r.status_code for r in serial] == [200, 200]
    want = [r.json()["answer"] for r in serial]

    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=300) as c:
            return await asyncio.gather(
                *(c.post("/v1/query", json={"question": samples[i % 2]["question"]}) for i in range(32))
            )

    rs = asyncio.run(run())
    assert [r.status_code for r in rs] == [200] * 32
    # batching (and the prefix blocks shared between the requests) does not change a greedy answer
    assert [r.json()["answer"] for r in rs] == [want[i % 2] for i in range(32)]


@pytest.mark.parametrize("cmd", ["demo", "ingest", "ask", "serve", "eval"])
# ---- stop strings: never emitted, finish_reason from the generation --------------------------------------
def _query_sse(client: httpx.Client, body: dict) -> list[tuple[str, dict]]:
    """The ``(event, data)`` pairs of a streamed ``/v1/query``."""
    out, event = [], None
    with client.stream("POST", "/v1/query", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                out.append((event, json.loads(line[6:])))
    return out


def _check_query_stops(client: httpx.Client, q: str, n_max: int = 24) -> list[int]:
    """``/v1/query`` (streamed and not) never emits a stop string; returns the chunk ids it used."""
    ids = [s["chunk_id"] for s in client.post("/v1/query", json={"question": q}).json()["sources"]]

    def query(stop, n, streamed):
        body = {"question": q, "chunk_ids": ids, "max_tokens": n, "stop": [stop]}
        if not streamed:
            a = client.post("/v1/query", json=body).json()
            return a["answer"], a["finish_reason"]
        events = _query_sse(client, body)
        (kind, final) = events[-1]
        assert kind == "answer" and final["answer"] == "".join(d["text"] for e, d in events[:-1])
        return "".join(d["text"] for e, d in events if e == "token"), final["finish_reason"]

    events = _query_sse(client, {"question": q, "chunk_ids": ids, "max_tokens": n_max})
    pieces = [d["text"] for e, d in events if e == "token"]
    assert len(pieces) == n_max
    check_stop_strings(pieces, n_max, query)
    return ids


def test_query_and_chat_stop_strings_never_leak(server, client, ingested, samples):
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    q = samples[0]["question"]
    n_max = 24
    ids = _check_query_stops(client, q, n_max)

    def chat(stop, n, streamed):
        kw = dict(
            model="stories260k",
            messages=[{"role": "user", "content": q}],
            max_tokens=n,
            stop=[stop],
            extra_body={"ragkv": {"chunk_ids": ids}},
        )
        if not streamed:
            out = oc.chat.completions.create(**kw)
            return out.choices[0].message.content, out.choices[0].finish_reason
        chunks = [c for c in oc.chat.completions.create(**kw, stream=True) if c.choices]
        finals = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        assert len(finals) == 1 and chunks[-1].choices[0].finish_reason
        return "".join(c.choices[0].delta.content or "" for c in chunks), finals[0]

    head, *rest = oc.chat.completions.create(
        model="stories260k",
        messages=[{"role": "user", "content": q}],
        max_tokens=n_max,
        stream=True,
        extra_body={"ragkv": {"chunk_ids": ids}},
    )
    pieces = [c.choices[0].delta.content for c in rest if c.choices and not c.choices[0].finish_reason]
    assert head.choices[0].delta.role == "assistant" and len(pieces) == n_max
    check_stop_strings(pieces, n_max, chat)


def test_engine_generation_stop_strings_never_leak(engine_client, samples):
    _check_query_stops(engine_client, samples[0]["question"])


def test_one_source_of_generation_defaults():
    from ragkv.cli import build_parser
    from ragkv.defaults import DEFAULT_MAX_NEW_TOKENS
    from ragkv.generate import SamplingParams
    from ragkv.remote.client import completion_body
    from ragkv_server.cli import build_parser as server_cli

    n = DEFAULT_MAX_NEW_TOKENS
    assert SamplingParams().max_new_tokens == n
    assert Settings.model_fields["max_new_tokens"].default == n
    assert completion_body("m", [1], None)["max_tokens"] == n
    assert build_parser().parse_args(["demo"]).max_new_tokens == n  # was 24 (ask: 32, RAG.answer: 32)
    assert server_cli().parse_args(["ask", "q"]).max_new_tokens is None  # the settings' (shared with serve)
