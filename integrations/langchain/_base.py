"""Fields and per-call options shared by the ragkv LangChain models."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from integrations.common import DEFAULT_KEYS, Completion, call_events
from ragkv.generate import TokenEvent


class RagkvParams(BaseModel):
    """Defaults of a ragkv-backed model; every one can be overridden per call (``invoke(q, mode=...)``)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    rag: Any = Field(exclude=True, description="the ragkv.rag.RAG that owns the model, index and KV store")
    mode: str | None = Field(None, description="prefill mode for chunked calls (None: the RAG's default)")
    ratio: float | None = Field(None, description="blend recompute ratio (None: the RAG's default)")
    k: int | None = Field(None, description="chunks to retrieve when retrieve=True (None: the RAG's top_k)")
    retrieve: bool = Field(False, description="retrieve chunks from ragkv's index when a call passes none")
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @classmethod
    def from_data_dir(cls, model: str, data_dir: str, rag_kwargs: dict | None = None, **kwargs):
        """Build the RAG (model path or hub id, data directory, ``RAG(...)`` options) and the wrapper."""
        from ragkv.rag import RAG

        return cls(rag=RAG(model, data_dir, **(rag_kwargs or {})), **kwargs)

    def _events(
        self, question: str | None, prompt: str, stop: list[str] | None, kwargs: dict
    ) -> Iterator[TokenEvent | Completion]:
        """Token events then a Completion: over chunks (given or retrieved) or on the flat prompt."""
        return call_events(
            self.rag, {k: getattr(self, k, None) for k in DEFAULT_KEYS}, question, prompt, stop, kwargs
        )

    def _params(self) -> dict:
        return {
            "model": str(getattr(self.rag.model, "name", "") or self.rag.model.fingerprint[:16]),
            "mode": self.mode or self.rag.mode,
            "ratio": self.ratio if self.ratio is not None else self.rag.ratio,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
        }
