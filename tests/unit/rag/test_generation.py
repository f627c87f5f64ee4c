"""Generation as a strategy of the RAG: threads, the batching engine (and a vLLM server, in
test_vllm_client.py) all take the same retrieval, prompt, chunk lookup, cancellation and reporting."""

from __future__ import annotations

import time

import pytest

from ragkv import LLM
from ragkv.blend import (
    DEFAULT_RATIO,  # tests of blending mechanics: an explicit ratio (outside the fidelity gate)
)
from ragkv.blend.core import BlendSchedule
from ragkv.blend.locate import Located
from ragkv.blend.plan import BlendPlan
from ragkv.blend.spans import SearchCancelled, cancel_scope
from ragkv.engine import Engine, EngineConfig
from ragkv.fidelity.plan import RequestSettings
from ragkv.generate import SamplingParams
from ragkv.rag import RAG, EngineGenerator, OptionNotServedError, RagAnswer
from ragkv.rag.embedder import Embedder
from tests.helpers import stories_model

TEXTS = [
    "Tom had a big red kite. He flew it in the park every day after school. " * 3,
    "Lily found a little cat under the old tree. The cat was hungry and sad. " * 3,
    "Ben built a tall tower of blocks. It fell down when the dog ran past. " * 3,
]


@pytest.fixture(scope="module")
def rag(tmp_path_factory):
    r = RAG(
        LLM(stories_model()),
        tmp_path_factory.mktemp("gen"),
        embedder=Embedder(),
        chunk_tokens=32,
        top_k=3,
        ratio=DEFAULT_RATIO,
    )
    r.ingest([{"id": f"d{i}", "text": t} for i, t in enumerate(TEXTS)], show_progress=False)
    yield r
    r.close()


@pytest.fixture(scope="module")
def engine_rag(rag):
    view = rag.using(
        EngineGenerator(
            Engine(
                rag.model,
                EngineConfig(num_blocks=400, settings=RequestSettings(ratio=DEFAULT_RATIO)),
                resolver=rag.resolver,
            )
        )
    )
    yield view
    view.close()  # the view's close stops its engine; the RAG is closed by its own fixture


def _run(r: RAG, question: str, **kw) -> tuple[list[int], RagAnswer]:
    evs = list(r.answer_stream(question, max_new_tokens=12, **kw))
    return [e.token_id for e in evs[:-1] if e.is_token], evs[-1]


@pytest.mark.parametrize("mode,ratio", [("full", None), ("blend", 1.0), ("blend", None), ("reuse", None)])
def test_engine_generator_answers_as_the_threads_do(rag, engine_rag, mode, ratio):
    """One query path: the same retrieval, prompt and chunk KV, so the same greedy tokens."""
    q = "What did Tom fly in the park?"
    ids, ans = _run(rag, q, mode=mode, ratio=ratio)
    eids, eans = _run(engine_rag, q, mode=mode, ratio=ratio)
    assert eids == ids and eans.text == ans.text and len(ids) > 0
    assert [s.chunk_id for s in eans.sources] == [s.chunk_id for s in ans.sources] and len(ans.sources) == 3
    assert eans.mode == ans.mode == mode
    if mode in ("blend", "reuse"):
        assert eans.stats["num_reused_rows"] == ans.stats["num_reused_rows"] > 0
    assert 0 < eans.timings["ttft_s"] <= eans.timings["total_s"] and "engine_queue_s" in eans.timings


def test_flat_framework_prompt_reuses_stored_chunks_in_the_engine(rag, engine_rag):
    """``stream_parts`` with no chunk markers locates the stored chunks in the prompt on every generator."""
    recs = rag.retrieve("Where was the cat?")
    body = [t for r in recs for t in r.token_ids]
    prefix = rag.model.encode("Read this.\n", add_bos=True)
    q = rag.model.encode("\nWhere was the cat? Answer:")
    params = SamplingParams(max_new_tokens=8)
    local = list(rag.stream_parts(prefix + body + q, [], [], params=params))[-1]
    served = list(engine_rag.stream_parts(prefix + body + q, [], [], params=params))[-1]
    assert served.text == local.text
    assert local.stats["num_reused_rows"] > 0 and served.stats["num_reused_rows"] > 0


def _plan(schedule: BlendSchedule) -> BlendPlan:
    """A job's plan with an explicit blend schedule (what ``/v1/completions`` may send)."""
    return BlendPlan("blend", schedule.target_ratio, schedule)


def test_engine_refuses_what_it_cannot_honour(rag, engine_rag):
    """Options the engine has no equivalent for are refused, never silently dropped."""
    with pytest.raises(OptionNotServedError, match="auto"):
        list(engine_rag.answer_stream("What did Tom fly?", ratio="auto", max_new_tokens=2))
    job = rag.job(
        rag.model.encode("Tom", add_bos=True),
        [],
        RequestSettings("blend"),
        params=SamplingParams(max_new_tokens=2),
    )
    job.plan = _plan(BlendSchedule((1, 3), (0.3, 0.2), selector="kdev"))
    with pytest.raises(OptionNotServedError, match="check_layers"):
        list(engine_rag.generate(job))
    job.plan = _plan(BlendSchedule.single(0.3))  # a ratio alone is served
    assert list(engine_rag.generate(job))[-1].finish_reason == "length"
    job.plan = _plan(BlendSchedule.single(0.3, ape_temperature=0.8))
    with pytest.raises(OptionNotServedError, match="APE"):
        list(engine_rag.generate(job))


def test_vllm_generator_refuses_ape_tempering(rag):
    """The vLLM hook decodes on its own pages: an APE schedule is refused there, not silently dropped."""
    from ragkv.remote.client import VllmClient, VllmGenerator

    ids = rag.model.encode("Tom flew a kite.", add_bos=True)
    job = rag.job(
        ids,
        [Located("k", tuple(ids[1:]), 1, 0, len(ids) - 1)],
        RequestSettings("blend"),
        params=SamplingParams(),
    )
    gen = VllmGenerator(VllmClient("http://127.0.0.1:9", model="m"))
    job.plan = _plan(BlendSchedule.single(0.3, selector="kdev"))
    assert gen.kv_transfer_params(job)["ragkv"]["chunks"]
    job.plan = _plan(BlendSchedule.single(0.3, selector="kdev", ape_scale=0.8))
    with pytest.raises(OptionNotServedError, match="APE"):
        gen.kv_transfer_params(job)


def test_engine_request_is_cancelled_when_the_caller_gives_up(rag, engine_rag):
    """Bug: the service's engine path had no cancellation while a request waited; a cancelled caller's
    request now ends in the engine too (its blocks freed), from the wait for the next token."""
    eng = engine_rag.generator.engine
    before = eng.metrics().requests_cancelled
    gave_up = {"now": False}
    it = None
    with pytest.raises(SearchCancelled), cancel_scope(lambda: gave_up["now"]):
        it = engine_rag.answer_stream("What did Ben build?", max_new_tokens=200)
        next(it)
        gave_up["now"] = True
        for _ in it:
            pass
    deadline = time.monotonic() + 10
    while eng.metrics().requests_cancelled == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.metrics().requests_cancelled == before + 1 and not eng.has_unfinished()
