"""Features of the core seen through the service: the fidelity gate's operating point and the blend
self-check on /healthz and /metrics, one chunk-KV resolver for the engine mode, a chunk-KV writer named in
the settings, the engine mode on the RAG's query path, and /v1/completions parsing kv_transfer_params with
the wire format's owner. (Their library-level tests are the core's: tests/unit/<package>/.)"""

from __future__ import annotations

import asyncio

import pytest
from helpers_service import metric, tiny_settings

from ragkv import LLM
from ragkv.adapter.writer import WriterLoRA
from ragkv.blend import DEFAULT_RATIO
from ragkv.blend.spans import ChunkRef
from ragkv.fidelity.plan import RequestSettings
from ragkv.fidelity.report import cache_path, save_report
from ragkv.generate import SamplingParams
from ragkv.rag import RAG, EngineGenerator, ThreadGenerator
from ragkv.remote.wire import BlendParams
from ragkv.testing import fidelity_ladder, fidelity_report, stories_model, stories_path, writer_file
from ragkv_server import openai_compat as oc
from ragkv_server.config import Settings
from ragkv_server.service import QuerySpec, Service

QUESTION = "What did Lily hold?"
CHUNKS = ["Lily had a red ball. She liked to play with it.", "Tom ran in the park with his dog."]
PROMPT = (
    "",
    ["Lily had a red ball. She played in the park.", "Tom ran to the shop with his dog."],
    "What did Lily have?",
)
TEXTS = [
    "Tom had a big red kite. He flew it in the park every day after school. " * 3,
    "Lily found a little cat under the old tree. The cat was hungry and sad. " * 3,
    "Ben built a tall tower of blocks. It fell down when the dog ran past. " * 3,
]


@pytest.fixture
def rag(tmp_path, embedder, one_thread):
    """A RAG over three short stories on the tiny model (blend at an explicit ratio)."""
    r = RAG(LLM(stories_model()), tmp_path, embedder=embedder, chunk_tokens=32, top_k=3, ratio=DEFAULT_RATIO)
    r.ingest([{"id": f"d{i}", "text": t} for i, t in enumerate(TEXTS)], show_progress=False)
    yield r
    r.close()


def test_the_service_says_its_operating_point_and_refuses_bad_settings(fidelity_cache, tmp_path):
    """/healthz, /metrics and every answer's stats name the point; a bad ``fidelity`` is a 400 (query)
    and a settings error; an explicit ratio is marked outside the gate."""
    from fastapi.testclient import TestClient
    from helpers_service import tiny_settings
    from pydantic import ValidationError

    from ragkv_server.config import Settings
    from ragkv_server.server import create_app
    from ragkv_server.service import Service, build_rag

    m = stories_model()
    save_report(fidelity_report(m, fidelity_ladder()), cache_path(m.fingerprint))
    with pytest.raises(ValidationError, match="fidelity"):
        Settings(model=str(stories_path()), data_dir=tmp_path / "x", fidelity="sometimes")
    s = tiny_settings(tmp_path / "data")
    svc = Service(s, build_rag(s))
    svc.start()
    c = TestClient(create_app(s, svc), base_url="http://testserver")
    try:
        r = c.post("/v1/documents", json={"documents": [{"id": "d", "text": " ".join(CHUNKS)}]})
        assert r.status_code == 200, r.text
        health = c.get("/healthz").json()["fidelity"]
        assert (health["target"], health["point"], health["ratio"]) == ("floor", "blend@0.8", 0.8)
        labels = {"target": "floor", "point": "blend@0.8", "mode": "blend", "figure": "same_as_full"}
        assert metric(c.get("/metrics").text, "ragkv_fidelity", **labels) == 0.82
        r = c.post("/v1/query", json={"question": QUESTION})
        assert r.status_code == 200, r.text
        got = r.json()["stats"]
        assert got["mode"] == "blend" and got["fidelity"]["point"] == "blend@0.8"
        r = c.post("/v1/query", json={"question": QUESTION, "fidelity": "exact"})
        assert r.json()["stats"]["mode"] == "prefix" and r.json()["stats"]["fidelity"]["target"] == "exact"
        r = c.post("/v1/query", json={"question": QUESTION, "ratio": 0.3})
        assert r.json()["stats"]["fidelity"]["outside_gate"] is True
        for bad in ("sometimes", 1.5, "fast:1"):
            r = c.post("/v1/query", json={"question": QUESTION, "fidelity": bad})
            assert r.status_code in (400, 422) and "fidelity" in r.text, (bad, r.text)
        body = {"model": s.model_name(), "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2}
        r = c.post("/v1/chat/completions", json={**body, "ragkv": {"fidelity": "exact"}})
        assert r.status_code == 200, r.text
    finally:
        svc.close()


def test_service_engine_mode_uses_the_rags_resolver(rag):
    from ragkv_server.config import Settings
    from ragkv_server.service import Service

    svc = Service(Settings(generation="engine", max_new_tokens=2, allowed_hosts=["testserver"]), rag)
    svc.start()
    try:
        assert svc.rag.generator.engine.resolver is rag.resolver
    finally:
        svc.rag.generator.close()


def test_healthz_and_metrics_show_the_gate(rag):
    from fastapi.testclient import TestClient

    from ragkv_server.config import Settings
    from ragkv_server.server import create_app
    from ragkv_server.service import Service

    s = Settings(max_new_tokens=2, allowed_hosts=["testserver"])
    svc = Service(s, rag)
    svc.start()
    with TestClient(create_app(s, svc), base_url="http://testserver") as c:
        state = c.get("/healthz").json()["blend_gate"]
        assert state in ("passed", "pending")
        c.post("/v1/query", json={"question": "kite?", "max_tokens": 1})
        assert c.get("/healthz").json()["blend_gate"] == "passed"
        assert metric(c.get("/metrics").text, "ragkv_blend_gate", state="passed") == 1


def test_service_in_engine_mode_goes_through_the_rag_query_path(rag, tmp_path):
    """Bug: ``generation=engine`` had its own service path (its own retrieval and prompt, no queue
    deadline, no cancellation); now the RAG's generator is the engine and the path is the same."""
    s = Settings(data_dir=str(tmp_path), generation="engine", engine_max_seqs=4, max_queue=4)
    svc = Service(s, rag)
    svc.start()
    try:
        # the service generates through a view of the RAG; the RAG itself keeps its own generator
        assert isinstance(svc.rag.generator, EngineGenerator) and isinstance(rag.generator, ThreadGenerator)
        spec = QuerySpec(question="What did Tom fly?", params=SamplingParams(max_new_tokens=10))
        text, final = asyncio.run(svc.answer(spec))
        local = rag.answer("What did Tom fly?", max_new_tokens=10)
        assert text == local.text and final.answer.stats["kv_hits"] == 3
        assert [r.chunk_id for r in final.answer.sources] == [r.chunk_id for r in local.sources]
        auto = RequestSettings(ratio="auto")
        bad = QuerySpec(question="What did Tom fly?", settings=auto, params=SamplingParams(max_new_tokens=2))
        with pytest.raises(Exception, match="auto") as e:
            asyncio.run(svc.answer(bad))
        assert getattr(e.value, "status", None) == 422  # an invalid request, as on every path
    finally:
        svc.rag.close()  # the view: its engine (Service.close would close the given RAG too)


@pytest.mark.slow  # the service end to end (the embedder's load, twice): the whole suite's tier
@pytest.mark.parametrize("generation", ["threads", "engine"])
def test_the_service_serves_a_writer_named_in_its_settings(tmp_path, generation):
    """The service's ``adapter`` setting takes a writer file: ingest stores the writer's KV, answers
    read it (their stats name the writer); with ``generation='vllm'`` it is a clear error."""
    from fastapi.testclient import TestClient

    from ragkv.blend import DEFAULT_RATIO
    from ragkv_server.server import create_app
    from ragkv_server.service import Service, build_generator, build_rag

    m, path = writer_file(tmp_path)
    w = WriterLoRA.load(path, m)
    s = tiny_settings(tmp_path / "data", adapter=str(path), ratio=DEFAULT_RATIO, generation=generation)
    rag = build_rag(s)
    svc = Service(s, rag)
    svc.start()
    c = TestClient(create_app(s, svc), base_url="http://testserver")
    try:
        r = c.post("/v1/documents", json={"documents": [{"id": "d", "text": " ".join(PROMPT[1])}]})
        assert r.status_code == 200, r.text
        assert {rag.store.header(k).fingerprint for k in rag.store.keys()} == {w.kv_fingerprint(m)}
        r = c.post("/v1/query", json={"question": PROMPT[2]})
        assert r.status_code == 200, r.text
        stats = r.json()["stats"]
        assert stats["adapter"] == w.identity and stats["num_reused_rows"] > 0, stats
        with pytest.raises(ValueError, match="generation 'vllm'"):
            build_generator(
                tiny_settings(tmp_path / "v", generation="vllm", vllm_url="http://127.0.0.1:9"), rag
            )
    finally:
        c.close()
        svc.close()


def test_save_defaults_by_receiver():
    """Absent ``save``: the vLLM connector saves missed chunks, the service does not (a read must not write)."""
    wire = {"ragkv": {"chunks": ["k1"]}}
    assert BlendParams.from_kv_transfer_params(wire).save is True
    assert oc.blend_params(wire, num_layers=30).save is False
    assert oc.blend_params({"ragkv": {"chunks": ["k1"], "save": True}}, num_layers=30).save is True


def test_the_service_parses_with_the_owner():
    """``/v1/completions`` gets the owner's type and reasons (400, naming kv_transfer_params)."""
    wire = {"ragkv": {"chunks": [{"key": "k", "start": 3, "length": 4}], "ratio": 0.3}}
    got = oc.blend_params(wire, num_layers=30)
    assert isinstance(got, BlendParams) and got.chunks == (ChunkRef("k", 3, 4),)
    assert oc.blend_params(None, 30) is None and oc.blend_params({"other": 1}, 30) is None
    for body, reason in (({"chunks": "abc"}, "chunks"), ({"chunks": [], "ratio": 2}, "ratio")):
        with pytest.raises(oc.BadRequestError, match=f"^kv_transfer_params: .*{reason}"):
            oc.blend_params({"ragkv": body}, 30)
    with pytest.raises(oc.BadRequestError, match="layers of the model"):
        oc.blend_params({"ragkv": {"chunks": [], "check_layers": [30]}}, 30)
