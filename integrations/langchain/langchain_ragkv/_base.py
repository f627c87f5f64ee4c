"""Fields and per-call options shared by the ragkv LangChain models."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from langchain_core.language_models import BaseChatModel, LangSmithParams

from ragkv.aio import iterate_in_thread
from ragkv.defaults import DEFAULT_FIDELITY, DEFAULT_MODE
from ragkv.generate import TokenEvent
from ragkv_frameworks import Completion, RagkvOptions, call_events


class RagkvParams(RagkvOptions):
    """Defaults of a ragkv-backed LangChain model; every one can be overridden per call (``invoke(q, mode=...)``).

    LangChain's standard parameters are honoured: ``max_tokens`` (alias of ``max_new_tokens``),
    ``temperature``, ``stop``, ``timeout``, ``max_retries``; any unknown one is a validation error."""

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

        rag_kwargs = dict(rag_kwargs or {})
        if vllm_url is not None:
            from ragkv.remote.client import VllmClient, VllmGenerator

            rag_kwargs["generator"] = VllmGenerator(VllmClient(vllm_url, **(vllm_kwargs or {})))
        rag = RAG(model, data_dir, **rag_kwargs)
        return cls(rag=rag, **kwargs)

    def _events(
        self, question: str | None, prompt: str, stop: list[str] | None, kwargs: dict
    ) -> Iterator[TokenEvent | Completion]:
        """Token events then a Completion: over chunks (given or retrieved) or on the flat prompt;
        under the model's ``timeout`` and ``max_retries``."""
        kwargs = {k: v for k, v in kwargs.items() if k != "stream"}  # BaseChatModel's streaming switch
        return self.guarded(
            lambda: call_events(self.rag, self.call_defaults(), question, prompt, stop, kwargs)
        )

    @staticmethod
    def _chunks(events: Iterator, chunk: Callable, last: Callable, run_manager) -> Iterator:
        """LangChain's chunks of :meth:`_events`: ``chunk(text)`` per token (told to ``run_manager``),
        then ``last(completion)``."""
        for ev in events:
            if isinstance(ev, Completion):
                yield last(ev)
                return
            out = chunk(ev.text)
            if run_manager:
                run_manager.on_llm_new_token(ev.text, chunk=out)
            yield out

    @staticmethod
    async def _achunks(
        events: Callable[[], Iterator], chunk: Callable, last: Callable, run_manager
    ) -> AsyncIterator:
        """:meth:`_chunks` with an async ``run_manager``; ``events()`` is iterated in a worker thread."""
        async for ev in iterate_in_thread(events):
            if isinstance(ev, Completion):
                yield last(ev)
                return
            out = chunk(ev.text)
            if run_manager:
                await run_manager.on_llm_new_token(ev.text, chunk=out)
            yield out

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._params()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        """LangSmith's standard tracing parameters: provider, model, type (chat or llm, as the model's
        LangChain base class), temperature, max tokens, stop."""
        model_type = "chat" if isinstance(self, BaseChatModel) else "llm"
        temperature = kwargs.get("temperature", self.temperature)
        max_tokens = kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_new_tokens))
        params = LangSmithParams(
            ls_provider="ragkv",
            ls_model_name=self.model_label(kwargs.get("model")),
            ls_model_type=model_type,
            ls_temperature=temperature,
            ls_max_tokens=max_tokens,
        )
        stops = stop if stop is not None else self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    def _params(self) -> dict:
        s = self.request_settings().over(self.rag.planner.settings)  # this model's over the RAG's
        return {
            "model": self.model_label(),
            "generation": self.rag.generator.name,
            "mode": str(s.mode or DEFAULT_MODE),
            "ratio": s.ratio,
            "fidelity": s.fidelity or DEFAULT_FIDELITY,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
        }
