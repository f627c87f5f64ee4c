"""``RagkvLLM``: a LangChain completion ``LLM`` whose prompts are answered by ragkv with reused chunk KV.

``llm.invoke(question, chunks=docs)`` answers ``question`` over the documents as chunks (their stored
KV reused or blended); ``chunk_ids=[...]`` names indexed chunks; ``retrieve=True`` retrieves from
ragkv's index. A plain prompt is completed as is: the stored chunks inside it (a chain's formatted
documents) are given as themselves, their KV reused; text between ``CHUNK_SEPARATOR`` markers becomes
chunks. ``generate()`` / ``stream()`` expose the reuse statistics in ``generation_info["ragkv"]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.llms import LLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict

from langchain_ragkv._base import RagkvParams
from ragkv_frameworks import Completion


def _chunk(text: str) -> GenerationChunk:
    return GenerationChunk(text=text)


def _last(c: Completion) -> GenerationChunk:
    """The closing chunk: no text, the finish reason and ragkv's statistics."""
    return GenerationChunk(text="", generation_info={"finish_reason": c.finish_reason, "ragkv": c.info()})


class RagkvLLM(RagkvParams, LLM):
    """Completion model backed by ragkv (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    @property
    def _llm_type(self) -> str:
        return "ragkv"

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        yield from self._chunks(self._events(None, prompt, stop, kwargs), _chunk, _last, run_manager)

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        async for chunk in self._achunks(
            lambda: self._events(None, prompt, stop, kwargs), _chunk, _last, run_manager
        ):
            yield chunk

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        return "".join(c.text for c in self._stream(prompt, stop, run_manager, **kwargs))

    async def _acall(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        return "".join([c.text async for c in self._astream(prompt, stop, run_manager, **kwargs)])

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        return _result([list(self._stream(p, stop, run_manager, **kwargs)) for p in prompts])

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        per_prompt = []
        for p in prompts:
            per_prompt.append([c async for c in self._astream(p, stop, run_manager, **kwargs)])
        return _result(per_prompt)


def _merge(chunks: list[GenerationChunk]) -> Generation:
    info = next((c.generation_info for c in reversed(chunks) if c.generation_info), None)
    return Generation(text="".join(c.text for c in chunks), generation_info=info)


def _result(per_prompt: list[list[GenerationChunk]]) -> LLMResult:
    """One generation per prompt, merged from its streamed chunks."""
    return LLMResult(generations=[[_merge(chunks)] for chunks in per_prompt])
