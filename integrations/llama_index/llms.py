"""``RagkvLlamaLLM``: a LlamaIndex ``CustomLLM`` answered by ragkv with reused chunk KV.

``complete(q, chunks=nodes)`` / ``chunk_ids=[...]`` / ``retrieve=True`` answers over chunks; a plain
prompt is completed as is (``CHUNK_SEPARATOR`` markers split out chunks). ``chat()`` and
``stream_chat()`` are written out here because CustomLLM's derived ones render the messages into
one prompt, so chunk options would no longer reach the RAG prompt: with chunk options the last user
message is the question. Statistics are in ``response.raw["ragkv"]`` (and ``additional_kwargs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.llms import CustomLLM
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback

from integrations.common import (
    DEFAULT_KEYS,
    Completion,
    RagkvOptions,
    call_events,
    fold_messages,
    render_chat,
)


def message_pairs(messages: Sequence[ChatMessage]) -> list[tuple[str, str]]:
    role = {MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant", MessageRole.SYSTEM: "system"}
    return [(role.get(m.role, str(m.role.value)), m.content or "") for m in messages]


def _final(responses: CompletionResponseGen) -> CompletionResponse:
    """The last response of a stream (it carries the whole text and the statistics)."""
    last = None
    for last in responses:  # noqa: B007 - only the last one is wanted
        pass
    return last


class RagkvLlamaLLM(RagkvOptions, CustomLLM):
    """LlamaIndex LLM backed by a ``ragkv.rag.RAG`` (see the module docstring)."""

    @classmethod
    def class_name(cls) -> str:
        return "ragkv_llm"

    @property
    def metadata(self) -> LLMMetadata:
        m = self.rag.model
        return LLMMetadata(
            context_window=m.config.max_position,
            num_output=self.max_new_tokens,
            is_chat_model=False,
            model_name=m.name or "ragkv",
        )

    def _events(self, question: str | None, prompt: str, kwargs: dict):
        kwargs = dict(kwargs)
        kwargs.pop("formatted", None)
        nodes = kwargs.pop("nodes", None)  # alias: LlamaIndex code speaks of nodes
        if nodes is not None:
            kwargs["chunks"] = nodes
        return call_events(
            self.rag, {k: getattr(self, k, None) for k in DEFAULT_KEYS}, question, prompt, None, kwargs
        )

    @staticmethod
    def _extra(c: Completion) -> dict:
        return {"ragkv": c.info(), "finish_reason": c.finish_reason}

    def _stream(self, question: str | None, prompt: str, kwargs: dict) -> CompletionResponseGen:
        text = ""
        for ev in self._events(question, prompt, kwargs):
            if isinstance(ev, Completion):
                extra = self._extra(ev)
                yield CompletionResponse(text=text, delta="", raw=extra, additional_kwargs=extra)
                return
            text += ev.text
            yield CompletionResponse(text=text, delta=ev.text)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        last = _final(self._stream(None, prompt, kwargs))
        return CompletionResponse(text=last.text, raw=last.raw, additional_kwargs=last.additional_kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream(None, prompt, kwargs)

    def _chat_args(self, messages: Sequence[ChatMessage], kwargs: dict) -> tuple[str | None, str]:
        pairs = message_pairs(messages)
        chunked = any(kwargs.get(k) is not None for k in ("chunks", "chunk_ids", "nodes")) or kwargs.get(
            "retrieve", self.retrieve
        )
        if chunked:
            return fold_messages(pairs), ""
        return None, render_chat(self.rag.model, pairs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        question, prompt = self._chat_args(messages, kwargs)
        last = _final(self._stream(question, prompt, kwargs))
        msg = ChatMessage(
            role=MessageRole.ASSISTANT, content=last.text, additional_kwargs=last.additional_kwargs
        )
        return ChatResponse(message=msg, raw=last.raw, additional_kwargs=last.additional_kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        question, prompt = self._chat_args(messages, kwargs)

        def gen() -> ChatResponseGen:
            for r in self._stream(question, prompt, kwargs):
                msg = ChatMessage(
                    role=MessageRole.ASSISTANT, content=r.text, additional_kwargs=r.additional_kwargs
                )
                yield ChatResponse(
                    message=msg, delta=r.delta, raw=r.raw, additional_kwargs=r.additional_kwargs
                )

        return gen()
