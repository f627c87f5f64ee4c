"""KV lifecycle as a property: random sequences of ingest, delete, query (threads and engine),
completions (with ``save``) and restarts never leave stored KV no document references, and never
serve a deleted document."""

from __future__ import annotations

import random

import pytest
from fastapi.testclient import TestClient

from ragkv import LLM
from ragkv.rag import RAG
from ragkv.remote.client import build_prompt
from ragkv.testing import stories_model
from ragkv_server.config import Settings
from ragkv_server.server import create_app
from ragkv_server.service import Service

WORDS = "Tom Lily kite ball park river red blue big small ran sat jumped the a on in".split()


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 90))) + "."


class World:
    """A RAG under a data folder and two services over it: worker threads and the engine."""

    def __init__(self, path, embedder, model):
        self.path, self.embedder, self.model = path, embedder, model
        self.open()

    def open(self) -> None:
        self.rag = RAG(
            LLM(self.model),
            self.path,
            embedder=self.embedder,
            chunk_tokens=32,
            top_k=3,
            collect_garbage_on_open=True,  # a writer of its own default store
        )
        self.clients = {}
        self.services = []
        for gen in ("threads", "engine"):
            s = Settings(max_new_tokens=2, allowed_hosts=["testserver"], generation=gen)
            svc = Service(s, self.rag)
            svc.start()
            self.services.append(svc)
            self.clients[gen] = TestClient(create_app(s, svc), base_url="http://testserver")

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        for svc in self.services:
            svc.rag.generator.close()  # the view's (threads: nothing; the engine: its loop)
        self.rag.flush()
        self.rag.close()

    def check(self, live: dict[str, str]) -> None:
        """Stored KV is exactly what the live documents reference (after pending write-backs)."""
        self.rag.flush()
        referenced = {r.kv_key for r in self.rag.index.all_chunks()}
        assert set(self.rag.index.document_ids()) == set(live)
        assert set(self.rag.store.keys()) <= referenced, "stored KV that no document references"


@pytest.mark.parametrize(
    "seed", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)]
)
def test_random_operations_keep_stored_kv_referenced_and_never_serve_deleted(tmp_path, embedder, seed):
    rng = random.Random(seed)
    w = World(tmp_path, embedder, stories_model())
    live: dict[str, str] = {}
    deleted_keys: set[str] = set()
    try:
        for step in range(30):
            op = rng.choice(["ingest", "ingest", "delete", "query", "query", "complete", "restart"])
            if op == "ingest" or not live and op != "restart":
                doc = f"d{step}"
                live[doc] = _text(rng)
                r = w.clients["threads"].post(
                    "/v1/documents", json={"documents": [{"id": doc, "text": live[doc]}]}
                )
                assert r.status_code == 200, r.text
            elif op == "delete":
                doc = rng.choice(sorted(live))
                keys = {c.kv_key for c in w.rag.index.chunks_of(doc)}
                assert w.clients["threads"].delete(f"/v1/documents/{doc}").status_code == 200
                del live[doc]
                deleted_keys |= keys - {c.kv_key for c in w.rag.index.all_chunks()}
            elif op == "query":
                gen = rng.choice(["threads", "engine"])
                if rng.random() < 0.5:  # a lost blob: the query may recompute it and write it back
                    w.rag.store.delete(rng.choice(sorted(c.kv_key for c in w.rag.index.all_chunks())))
                r = w.clients[gen].post(
                    "/v1/query", json={"question": rng.choice(WORDS) + "?", "max_tokens": 2}
                )
                assert r.status_code == 200, r.text
                assert {s["doc_id"] for s in r.json()["sources"]} <= set(live)  # never a deleted document
            elif op == "complete":
                recs = w.rag.index.all_chunks()[:2]
                prompt, params = build_prompt([1], [(c.kv_key, c.token_ids) for c in recs], [5], save=True)
                r = w.clients["threads"].post(
                    "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": params}
                )
                assert r.status_code == 200, r.text
            else:
                w.close()
                w.open()
            w.check(live)
            deleted_keys -= {c.kv_key for c in w.rag.index.all_chunks()}  # the same text ingested again
            assert not (deleted_keys & set(w.rag.store.keys())), "a deleted document's KV is stored again"
    finally:
        w.close()
