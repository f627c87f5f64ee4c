"""The vLLM client path over real HTTP, with ragkv's own service as the OpenAI / vLLM server.

``python -m ragkv_server.server`` (uvicorn, loopback) serves ``/v1/completions`` with ``kv_transfer_params``
exactly as a vLLM server with the ragkv plugin is asked; ``VllmClient`` / ``VllmGenerator``, the LangChain
and LlamaIndex wrappers over it, and a second service with ``generation=vllm`` talk to it. Every served
answer must equal the in-process ``RAG`` answer token for token (greedy), and the chunk KV must come
from the shared store (or be recomputed when it is missing or corrupt).
"""

import json
from pathlib import Path

import httpx
import pytest
from helpers_service import LIMITS

from ragkv import LLM, compute_chunk_kv
from ragkv.generate import TokenEvent
from ragkv.rag import RAG, Embedder, RagAnswer
from ragkv.remote.client import (
    VllmClient,
    VllmGenerator,
    VllmHTTPError,
    VllmServerError,
    VllmUnavailableError,
    build_prompt,
)
from ragkv.testing import free_port, musique_samples, stories_model
from ragkv_server.testing import spawn_server, stop_server, wait_for_server

pytestmark = pytest.mark.slow  # live server processes (scripts/test.sh runs them in the native pass)

NEW = 8


class Server:
    """``python -m ragkv_server.server`` with ``env`` on a free loopback port (forked: ``spawn_server``);
    started now, waited for by ``ready``."""

    def __init__(self, folder: Path, **env: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / "server.log"
        env = {**LIMITS, "RAGKV_DATA_DIR": str(folder / "data"), **env}
        self.proc, self.url = spawn_server(env, self.log_path, fork=True)

    def ready(self) -> "Server":
        try:
            wait_for_server(self.proc, self.url, self.log_path, 180)
        except RuntimeError as e:
            pytest.fail(str(e))
        return self

    def stop(self) -> None:
        stop_server(self.proc, 30)
        log = self.log_path.read_text()
        assert "Traceback" not in log, log[-3000:]


@pytest.fixture(scope="module")
def samples():
    return musique_samples(2)


def _docs(samples) -> list[dict]:
    return [
        {"id": f"s{i}-p{j}", "text": c["text"][:300]}
        for i, s in enumerate(samples)
        for j, c in enumerate(s["ctxs"][:3])
    ]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both services boot in parallel: ``served`` (generation threads: the "vLLM server") and ``app`` (generation
    vllm, generating on ``served``); they share one chunk store, as ragkv and a vLLM connector would."""
    root = tmp_path_factory.mktemp("vllm")
    # lossless: the tests compare KV recomputed after a failed load with stored KV, token for token
    store = f"file://{root / 'kv'}?codec=raw"
    served = Server(root / "served", RAGKV_STORE=store)
    app = Server(
        root / "app",
        RAGKV_STORE=store,
        RAGKV_GENERATION="vllm",
        RAGKV_VLLM_URL=served.url,
        RAGKV_VLLM_TIMEOUT_S="60",
    )
    try:
        yield {"root": root, "store": store, "served": served.ready(), "app": app.ready()}
    finally:
        app.stop()
        served.stop()


@pytest.fixture(scope="module")
def rag(servers, one_thread, samples):
    """The in-process reference, ingesting into the store the served app reads."""
    r = RAG(
        LLM(stories_model()),
        servers["root"] / "local",
        store=servers["store"],
        embedder=Embedder(),
        chunk_tokens=int(LIMITS["RAGKV_CHUNK_TOKENS"]),
        top_k=int(LIMITS["RAGKV_TOP_K"]),
        ratio=float(LIMITS["RAGKV_RATIO"]),  # as the served app (an explicit ratio: the blend path)
    )
    assert r.ingest(_docs(samples), show_progress=False).chunks_added > 0
    yield r
    r.close()


@pytest.fixture(scope="module")
def vrag(rag, servers):
    return rag.using(VllmGenerator(VllmClient(servers["served"].url, timeout=60)))


def _local_tokens(rag, q, recs, **kw) -> tuple[list[int], RagAnswer]:
    evs = list(rag.answer_stream(q, chunks=recs, max_new_tokens=NEW, **kw))
    return [e.token_id for e in evs if isinstance(e, TokenEvent) and e.is_token], evs[-1]


# ---- the client against the served app ----------------------------------------------------------
@pytest.mark.parametrize("mode,ratio", [("blend", None), ("blend", 0.5), ("reuse", None), ("full", None)])
def test_served_answers_equal_in_process_token_for_token(rag, vrag, samples, mode, ratio):
    q = samples[0]["question"]
    recs = rag.retrieve(q)
    ids, local = _local_tokens(rag, q, recs, mode=mode, ratio=ratio)
    plain = vrag.answer(q, chunks=recs, mode=mode, ratio=ratio, max_new_tokens=NEW)
    assert plain.text == local.text and plain.stats["completion_tokens"] == len(ids) == NEW
    assert plain.stats["backend"] == "vllm" and plain.stats["mode"] == local.stats["mode"] == mode
    evs = list(vrag.answer_stream(q, chunks=recs, mode=mode, ratio=ratio, max_new_tokens=NEW))
    assert [e.token_id for e in evs[:-1] if e.is_token] == ids  # streamed, token for token
    assert "".join(e.text for e in evs[:-1]) == local.text == evs[-1].text
    # the finish reason comes with the last event (a closing one: the server's last chunk has no text)
    assert [e.finish_reason for e in evs[:-1]] == [None] * (len(evs) - 2) + ["length"]
    stats = evs[-1].stats
    assert stats["num_tokens"] == local.stats["num_tokens"]
    if mode == "full":
        assert stats["kv_hits"] == 0 and stats["num_reused_rows"] == 0
    else:  # every chunk's rows came from the store, as in process
        assert stats["kv_hits"] == len(recs) and stats["num_reused_rows"] == local.stats["num_reused_rows"]
        # in process, the instruction head comes from the prefix cache (exact rows, not recomputed)
        extra = local.stats["num_exact_rows"] - stats.get("num_exact_rows", 0)
        assert stats["recomputed_per_layer"] == [n + extra for n in local.stats["recomputed_per_layer"]]


def test_retrieval_and_seeded_sampling_match(rag, vrag, samples):
    q = samples[1]["question"]
    assert [r.chunk_id for r in vrag.retrieve(q)] == [r.chunk_id for r in rag.retrieve(q)]
    kw = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7, "max_new_tokens": NEW}
    assert vrag.answer(q, **kw).text == rag.answer(q, **kw).text


def _served_hits(servers) -> float:
    text = httpx.get(servers["served"].url + "/metrics").text
    return float(next(x for x in text.splitlines() if x.startswith("ragkv_kv_chunk_hits ")).split()[-1])


def test_missing_corrupt_and_mismatched_chunks_are_recomputed(rag, vrag, servers, samples):
    q = samples[1]["question"]
    recs = rag.retrieve(q)
    before = _served_hits(servers)
    good = vrag.answer(q, chunks=recs, max_new_tokens=NEW)
    assert (
        good.stats["kv_hits"] == 3 and _served_hits(servers) == before + 3
    )  # the server's metrics count them
    missing, corrupt = recs[0].kv_key, recs[1].kv_key
    assert rag.store.delete(missing)
    path = rag.store.path_of(corrupt)
    blob = bytearray(path.read_bytes())
    blob[-64:] = bytes(64)  # zero the last layer's data: its checksum fails when the layer is read
    path.write_bytes(bytes(blob))
    bad = vrag.answer(q, chunks=recs, max_new_tokens=NEW)
    assert bad.text == good.text == rag.answer(q, chunks=recs, max_new_tokens=NEW).text
    assert (bad.stats["kv_hits"], bad.stats["kv_misses"], bad.stats["kv_recomputed_bad"]) == (1, 1, 1)
    assert bad.stats["kv_saved"] >= 1 and rag.store.contains(
        missing
    )  # ``save``: the missing one is stored again
    # a key that is not the span's content (another chunk's KV) is never used
    prefix_ids = [rag.model.config.bos_token_id, 5, 6]
    pairs = [(recs[2].kv_key, recs[0].token_ids), (recs[0].kv_key, recs[2].token_ids)]
    prompt, kv = build_prompt(prefix_ids, pairs, [7, 8])
    out = vrag.generator.client.complete(prompt, kv, max_new_tokens=2)
    assert out.ragkv["kv_hits"] == 0 and out.ragkv["kv_misses"] == 2
    rag.store.delete(corrupt)  # a corrupt blob stays until replaced (put never overwrites): restore it
    assert rag.store.put(compute_chunk_kv(rag.model, recs[1].token_ids))


def test_key_only_chunks_are_found_in_the_prompt(rag, vrag, samples):
    q = samples[0]["question"]
    recs = rag.retrieve(q)
    prompt, kv = build_prompt([rag.model.config.bos_token_id], [(r.kv_key, r.token_ids) for r in recs], [9])
    spans = vrag.generator.client.complete(prompt, kv, max_new_tokens=NEW)
    for c in kv["ragkv"]["chunks"]:
        del c["start"], c["length"]
    keys = vrag.generator.client.complete(prompt, kv, max_new_tokens=NEW)
    assert keys.ragkv["kv_hits"] == 3 and keys.text == spans.text


def test_bad_requests_get_400_with_the_reason(servers, rag, vrag):
    url = servers["served"].url + "/v1/completions"

    def post(**body):
        return httpx.post(url, json={"prompt": [1, 5, 6, 7], "max_tokens": 2, **body}, timeout=30)

    cases = {
        "chunks": {"ragkv": {"chunks": "abc"}},
        "ratio": {"ragkv": {"chunks": [], "ratio": 2}},
        "unknown": {"ragkv": {"chunks": [], "turbo": 1}},
        "overlap": {
            "ragkv": {
                "chunks": [{"key": "a", "start": 0, "length": 3}, {"key": "b", "start": 2, "length": 1}]
            }
        },
        "outside": {"ragkv": {"chunks": [{"key": "a", "start": 2, "length": 9}]}},
        "must be a dict": ["x"],
    }
    for reason, params in cases.items():
        r = post(kv_transfer_params=params)
        assert r.status_code == 400, r.text
        assert reason in r.json()["error"]["message"] and "kv_transfer_params" in r.json()["error"]["message"]
    r = post(prompt=[1, 10**6])
    assert r.status_code == 400 and "vocabulary" in r.text
    assert post(model="other").status_code == 404
    with pytest.raises(VllmHTTPError) as e:
        vrag.generator.client.complete([1, 5, 6], {"ragkv": {"chunks": "abc"}}, max_new_tokens=2)
    assert e.value.status == 400 and "chunks" in e.value.message


def test_openai_shapes_text_prompt_and_models(servers):
    base = servers["served"].url
    models = httpx.get(base + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "stories260k"
    body = {"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    r = httpx.post(base + "/v1/completions", json=body, timeout=30).json()
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and r["model"] == "stories260k"
    choice = r["choices"][0]
    assert set(choice) >= {"index", "text", "logprobs", "finish_reason"} and choice["logprobs"] is None
    assert r["usage"]["completion_tokens"] == 4 and choice["finish_reason"] == "length"
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=30) as s:
        lines = [x for x in s.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    out = oc.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=4, temperature=0)
    assert out.choices[0].text == choice["text"]


# ---- the wrappers over the vLLM backend ------------------------------------------------------------
def test_langchain_over_vllm_backend(rag, vrag, samples):
    pytest.importorskip("langchain_core")
    from langchain_ragkv import ChatRagkv, RagkvLLM, format_docs

    q = samples[0]["question"]
    ids = [f"ragkv:{r.chunk_id}" for r in rag.retrieve(q)]
    local, served = RagkvLLM(rag=rag, max_new_tokens=NEW), RagkvLLM(rag=vrag, max_new_tokens=NEW)
    gen = served.generate([q], chunk_ids=ids).generations[0][0]
    assert gen.text == local.invoke(q, chunk_ids=ids)
    info = gen.generation_info["ragkv"]
    assert info["kv_hits"] == 3 and info["num_reused_rows"] > 0 and info["completion_tokens"] == NEW
    parts = list(served.stream(q, chunk_ids=ids))
    assert len([p for p in parts if p]) > 1 and "".join(parts) == gen.text
    chat = ChatRagkv(rag=vrag, max_new_tokens=NEW)
    pieces = [m.content for m in chat.stream(q, chunk_ids=ids) if m.content]
    assert (
        len(pieces) > 1
        and "".join(pieces) == ChatRagkv(rag=rag, max_new_tokens=NEW).invoke(q, chunk_ids=ids).content
    )
    # a flattened prompt: its chunks go to the server by content key
    prompt = "Passages:" + format_docs([r.text for r in rag.retrieve(q)]) + f"Question: {q}\nAnswer:"
    flat = served.generate([prompt]).generations[0][0]
    assert flat.text == local.invoke(prompt) and flat.generation_info["ragkv"]["num_chunks"] == 3
    with pytest.raises(ValueError, match="not a ragkv RAG"):
        RagkvLLM(rag=object())
    # structured output is computed in process: the vLLM generator refuses it, never drops it
    with pytest.raises(ValueError, match="structured output"):
        chat.invoke(q, chunk_ids=ids, response_format={"type": "json_object"})


def test_llama_index_over_vllm_backend(rag, vrag, samples):
    pytest.importorskip("llama_index.core")
    from llama_index.llms.ragkv import RagkvLlamaLLM
    from llama_index.retrievers.ragkv import RagkvLlamaRetriever, RagkvQueryEngine

    q = samples[1]["question"]
    nodes = RagkvLlamaRetriever(vrag, k=3).retrieve(q)
    served = RagkvLlamaLLM(rag=vrag, max_new_tokens=NEW)
    done = served.complete(q, chunks=nodes)
    assert done.text == RagkvLlamaLLM(rag=rag, max_new_tokens=NEW).complete(q, chunks=nodes).text
    assert done.raw["ragkv"]["kv_hits"] == 3
    deltas = [r.delta for r in served.stream_complete(q, chunks=nodes)]
    assert len([d for d in deltas if d]) > 1 and "".join(deltas) == done.text
    resp = RagkvQueryEngine(retriever=RagkvLlamaRetriever(vrag, k=3), llm=served).query(q)
    assert resp.response == done.text and resp.metadata["ragkv"]["kv_hits"] == 3


# ---- the FastAPI app with backend=vllm ---------------------------------------------------------------
def test_app_with_vllm_backend_serves_query(servers, rag, samples):
    app = httpx.Client(base_url=servers["app"].url, timeout=60)
    docs = _docs(samples)
    for part in (docs[:4], docs[4:]):
        r = app.post("/v1/documents", json={"documents": part})
        assert r.status_code == 200 and r.json()["kv_computed"] == 0  # same keys: already in the shared store
    assert app.get("/healthz").json()["generation"] == "vllm"
    q = samples[0]["question"]
    a = app.post("/v1/query", json={"question": q, "max_tokens": NEW}).json()
    local = rag.answer(q, max_new_tokens=NEW)
    assert a["answer"] == local.text and a["mode"] == "blend"
    assert [s["kv_key"] for s in a["sources"]] == [r.kv_key for r in local.sources]
    assert a["stats"]["kv_hits"] == 3 and a["usage"]["completion_tokens"] == NEW
    metrics = app.get("/metrics").text  # the server's chunk hits reach the app's metrics too
    assert (
        float(next(x for x in metrics.splitlines() if x.startswith("ragkv_kv_chunk_hits ")).split()[-1]) >= 3
    )
    with app.stream("POST", "/v1/query", json={"question": q, "max_tokens": NEW, "stream": True}) as r:
        events = [x for x in r.iter_lines() if x.startswith("event: ")]
    assert events.count("event: token") == NEW and events[-1] == "event: answer"
    # /v1/completions goes through the same generator: forwarded to the vLLM server, same tokens
    ids = [int(t) for t in rag.model.encode(q, add_bos=True)]
    r = app.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    )
    direct = httpx.post(
        servers["served"].url + "/v1/completions",
        json={"prompt": ids, "max_tokens": 4, "temperature": 0, "return_token_ids": True},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]


def test_server_down_is_a_typed_error_and_503(servers, rag, samples):
    dead = rag.using(
        VllmGenerator(VllmClient(f"http://127.0.0.1:{free_port()}", model="m", connect_timeout=2))
    )
    with pytest.raises(VllmUnavailableError):
        dead.answer(samples[0]["question"], max_new_tokens=2)
    with pytest.raises(VllmServerError):
        VllmClient(servers["served"].url + "/nothing").models()
    servers["served"].stop()  # last test: the app's vLLM server goes away
    app = httpx.Client(base_url=servers["app"].url, timeout=60)
    r = app.post("/v1/query", json={"question": samples[0]["question"], "max_tokens": NEW})
    assert r.status_code == 503 and "vLLM server is unavailable" in r.json()["error"]["message"]
    r = app.post("/v1/query", json={"question": samples[0]["question"], "stream": True})
    assert r.status_code == 503
    assert app.get("/healthz").status_code == 200  # retrieval and the index still work
