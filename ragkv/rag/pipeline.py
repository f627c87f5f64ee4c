"""``RAG``: the corpus side and the answering side of the retriever-aware KV layer, composed.

:class:`~ragkv.rag.corpus.Corpus` ingests documents (split, embed, index, precompute chunk KV) and
keeps their KV in step (delete, GC, quotas, write-back, locks); :class:`~ragkv.rag.answering.Answerer`
retrieves and answers with the retrieved chunks' stored KV blended (or any other prefill mode), over
the corpus's chunk resolver, passed in. ``RAG`` builds both from one set of arguments and forwards
each name to the side that owns it, so callers keep one object.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

from ragkv.blend.controller import LoadingController
from ragkv.blend.kvtree import tree_store
from ragkv.blend.resolver import WarnThrottle
from ragkv.defaults import DEFAULT_CHUNK_ORDER
from ragkv.fidelity.plan import RequestSettings
from ragkv.llm import LLM
from ragkv.prompt import DEFAULT_INSTRUCTION, DEFAULT_QUESTION
from ragkv.rag.answering import Answerer, RagAnswer, RagPrompt
from ragkv.rag.corpus import Corpus, Document, IngestCancelled, IngestReport
from ragkv.rag.embedder import DEFAULT_EMBEDDER, Embedder
from ragkv.rag.first_level import precompute_first_level
from ragkv.rag.generation import Generator
from ragkv.rag.quotas import Quotas

__all__ = [
    "RAG",
    "Answerer",
    "Corpus",
    "Document",
    "IngestCancelled",
    "IngestReport",
    "RagAnswer",
    "RagPrompt",
    "WarnThrottle",
]

#: names ``RAG`` forwards to its corpus side (read and assigned)
CORPUS_NAMES = (
    "data_dir store embedder index chunk_tokens overlap quotas quota_refusals ingest_batch embed_step "
    "ingest delete_document list_documents collect_garbage usage kv_bytes_per_token chunk_locator "
    "kv_visible flush _kv_lock _ingest_lock _warn"
).split()
#: names ``RAG`` forwards to its answering side (read and assigned)
ANSWER_NAMES = (
    "llm model resolver generator settings planner mode ratio fidelity top_k order seed instruction "
    "question_template system examples controller retrieve chunks_by_id fit_chunks prompt_parts prompt "
    "answer answer_stream stream_ids stream_parts stream_text segment_text job generate counters"
).split()


def _forward(side: str, name: str) -> property:
    """A property reading and assigning ``name`` on the ``side`` attribute."""
    return property(
        lambda self: getattr(getattr(self, side), name),
        lambda self, value: setattr(getattr(self, side), name, value),
        doc=f"``{side}.{name}``",
    )


class RAG:
    """Ingest -> retrieve -> answer with reused chunk KV; everything persists under ``data_dir``.

    A facade: ``rag.corpus`` (:class:`Corpus`) and ``rag.answers`` (:class:`Answerer`) do the work.
    ``mode``, ``ratio`` and ``fidelity`` are parsed once into ``rag.settings`` (a
    :class:`~ragkv.fidelity.plan.RequestSettings`, every request's defaults over the LLM's);
    ``settings`` may be given whole instead."""

    def __init__(
        self,
        llm: LLM | str,
        data_dir: str | Path,
        store=None,
        embedder: Embedder | str = DEFAULT_EMBEDDER,
        chunk_tokens: int = 512,
        overlap: int = 0,
        top_k: int = 6,
        order: str = DEFAULT_CHUNK_ORDER,
        mode: str | None = None,
        ratio: float | str | None = None,
        instruction: str = DEFAULT_INSTRUCTION,
        question_template: str = DEFAULT_QUESTION,
        pipelined: bool = True,
        controller: LoadingController | None = None,
        metric: str = "cosine",
        seed: int = 0,
        ingest_batch: int = 32,
        system: str | None = None,
        examples: Sequence[tuple[str, str]] = (),
        collect_garbage_on_open: bool = False,
        generator: Generator | None = None,
        quotas: Quotas | None = None,
        fidelity: str | float | None = None,
        first_level: bool = True,
        settings: RequestSettings | None = None,
    ):
        if settings is None:  # the edge: loose keywords parsed once
            settings = RequestSettings(mode, ratio, fidelity=fidelity)
        llm = llm if isinstance(llm, LLM) else LLM(llm)
        self.corpus = Corpus(
            llm.kv_model,  # chunk KV is written (and keyed) by the LLM's KV writer: its model, or a writer
            data_dir,
            store,
            embedder,
            chunk_tokens,
            overlap,
            metric,
            ingest_batch,
            quotas,
            pipelined,
            collect_garbage_on_open,
        )
        resolver = self.corpus.resolver
        self.answers = Answerer(
            llm.with_resolver(resolver),  # the caller's LLM keeps its own resolver
            self.corpus,
            resolver,
            top_k=top_k,
            order=order,
            settings=settings,
            instruction=instruction,
            question_template=question_template,
            system=system,
            examples=examples,
            controller=controller,
            seed=seed,
            generator=generator,
        )
        #: the data folder's writer lock, when this RAG holds one (``ragkv_server.service.build_rag``)
        self.writer_lock = None
        #: the exact KV tree every answer reuses (the LLM's); unless the LLM's tree has a store tier,
        #: its pages go to a namespace of this RAG's store of their own (``store.sibling("tree")``):
        #: they outlive the process and are shared by the processes on that store
        self.kv_tree = llm.kv_tree
        if self.kv_tree.store is None:
            self.kv_tree.store = tree_store(self.corpus.store)
        #: ingest precomputes each chunk's exact KV after the prompt head (the tree's first level), so
        #: the first retrieved chunk of a request is an exact hit (docs/EXACT_REUSE.md)
        self.first_level = first_level
        self.corpus.chunk_hooks.append(self._precompute_first_level)

    def _precompute_first_level(self, token_ids: list[int]) -> None:
        """The chunk's exact KV after this RAG's prompt head, into the KV tree (pages to the store)."""
        if self.first_level:
            head, _ = self.answers.prompt_parts("?")  # the head does not depend on the question
            precompute_first_level(self.model, self.kv_tree, head, token_ids)

    def using(self, generator: Generator) -> RAG:
        """A view of this RAG that generates with ``generator``: e.g. one RAG answering both in process
        and on a vLLM server, or a service's engine over a RAG its caller keeps using. The view shares
        the corpus (index, store, resolver, locator); its settings (mode, ratio, prompt...) are this
        RAG's at the time of the call. Closing the view closes ``generator`` only."""
        view = copy.copy(self)
        view.answers = self.answers.using(generator)
        view.close = generator.close
        return view

    def close(self) -> None:
        """Finish write-backs, snapshot the index, close the store, release the data folder's writer
        lock if this RAG holds one (``ragkv_server.service.build_rag(writer=True)``)."""
        self.answers.generator.close()
        self.kv_tree.flush()
        self.corpus.close()
        lock = self.writer_lock
        if lock is not None:
            lock.close()
            self.writer_lock = None


for _side, _names in (("corpus", CORPUS_NAMES), ("answers", ANSWER_NAMES)):
    for _name in _names:
        setattr(RAG, _name, _forward(_side, _name))
