"""Fields and per-call options shared by the ragkv LangChain models."""

from __future__ import annotations

from collections.abc import Iterator

from integrations.common import DEFAULT_KEYS, Completion, RagkvOptions, call_events
from ragkv.generate import TokenEvent


class RagkvParams(RagkvOptions):
    """Defaults of a ragkv-backed LangChain model; every one can be overridden per call (``invoke(q, mode=...)``)."""

    @classmethod
    def from_data_dir(
        cls,
        model: str,
        data_dir: str,
        rag_kwargs: dict | None = None,
        vllm_url: str | None = None,
        vllm_kwargs: dict | None = None,
        **kwargs,
    ):
        """Build the RAG (model path or hub id, data directory, ``RAG(...)`` options) and the wrapper;
        with ``vllm_url`` generation goes to that vLLM server (``VllmClient(vllm_url, **vllm_kwargs)``)."""
        from ragkv.rag import RAG

        rag = RAG(model, data_dir, **(rag_kwargs or {}))
        if vllm_url is not None:
            from integrations.vllm.client import VllmClient, VllmRAG

            rag = VllmRAG(rag, VllmClient(vllm_url, **(vllm_kwargs or {})))
        return cls(rag=rag, **kwargs)

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
            "backend": getattr(self.rag, "backend", "local"),
            "mode": self.mode or self.rag.mode,
            "ratio": self.ratio if self.ratio is not None else self.rag.ratio,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
        }
