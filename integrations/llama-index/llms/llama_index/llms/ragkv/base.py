"""``RagkvLlamaLLM``: a LlamaIndex ``CustomLLM`` answered by ragkv with reused chunk KV.

``complete(q, chunks=nodes)`` / ``chunk_ids=[...]`` / ``retrieve=True`` answers over chunks with
ragkv's RAG prompt (``system_prompt`` is folded into the question, as earlier chat turns are). A plain
prompt follows LlamaIndex's conventions: ``formatted=True`` is completed as is; otherwise a custom
``completion_to_prompt`` formats it (after ``system_prompt``), else an instruct model's chat template
renders it as a user turn (with ``system_prompt`` as the system turn), else ``system_prompt`` is
prepended. ``chat()`` renders with ``messages_to_prompt`` when one is given, else the chat template;
with chunk options the last user message is the question. In a plain prompt (a query engine's
flat prompt) the stored chunks inside it are given as themselves, their KV reused, and
``CHUNK_SEPARATOR`` markers split out chunks. The async methods generate in a worker thread (the event loop stays free).
Statistics are in ``response.raw["ragkv"]`` (and ``additional_kwargs``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.llms import CustomLLM
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import default_completion_to_prompt
from pydantic import ConfigDict

from ragkv.aio import iterate_in_thread
from ragkv.model.chat import has_chat_template
from ragkv_frameworks import (
    Completion,
    RagkvOptions,
    call_events,
    fold_messages,
    render_chat,
)

CHUNK_KEYS = ("chunks", "chunk_ids", "nodes")


def message_pairs(messages: Sequence[ChatMessage]) -> list[tuple[str, str]]:
    role = {MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant", MessageRole.SYSTEM: "system"}
    return [(role.get(m.role, str(m.role.value)), m.content or "") for m in messages]


def _final(responses: CompletionResponseGen) -> CompletionResponse:
    """The last response of a stream (it carries the whole text and the statistics)."""
    last = None
    for last in responses:  # noqa: B007 - only the last one is wanted
        pass
    return last


def _done(last: CompletionResponse) -> CompletionResponse:
    return CompletionResponse(text=last.text, raw=last.raw, additional_kwargs=last.additional_kwargs)


def _chat_response(r: CompletionResponse, delta: bool) -> ChatResponse:
    msg = ChatMessage(role=MessageRole.ASSISTANT, content=r.text, additional_kwargs=r.additional_kwargs)
    return ChatResponse(
        message=msg, delta=r.delta if delta else None, raw=r.raw, additional_kwargs=r.additional_kwargs
    )


class RagkvLlamaLLM(RagkvOptions, CustomLLM):
    """LlamaIndex LLM backed by a ``ragkv.rag.RAG`` (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def class_name(cls) -> str:
        return "ragkv_llm"

    @property
    def metadata(self) -> LLMMetadata:
        m = self.rag.model
        return LLMMetadata(
            context_window=m.config.max_position,
            num_output=self.max_new_tokens,
            is_chat_model=has_chat_template(m),
            model_name=self.model_label(),
        )

    # ---- prompts ------------------------------------------------------------------------------------
    def _chunked(self, kwargs: dict) -> bool:
        return any(kwargs.get(k) is not None for k in CHUNK_KEYS) or bool(
            kwargs.get("retrieve", self.retrieve)
        )

    def _with_system(self, text: str) -> str:
        return f"{self.system_prompt}\n\n{text}" if self.system_prompt else text

    def completion_prompt(self, prompt: str, formatted: bool = False) -> str:
        """The prompt a plain (chunk-less) completion of ``prompt`` sends (see the module docstring)."""
        if formatted:
            return prompt
        if self.completion_to_prompt is not default_completion_to_prompt:
            return self.completion_to_prompt(self._with_system(prompt))
        if has_chat_template(self.rag.model):
            system = [("system", self.system_prompt)] if self.system_prompt else []
            return render_chat(self.rag.model, [*system, ("user", prompt)])
        return self._with_system(prompt)

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt a plain (chunk-less) chat sends: ``messages_to_prompt`` if given, else the template."""
        messages = self._extend_messages(list(messages))
        if self.messages_to_prompt is not generic_messages_to_prompt:
            return self.messages_to_prompt(messages)
        return render_chat(self.rag.model, message_pairs(messages))

    def _complete_args(self, prompt: str, formatted: bool, kwargs: dict) -> tuple[str | None, str]:
        if self._chunked(kwargs):
            return (prompt if formatted else self._with_system(prompt)), ""
        return None, self.completion_prompt(prompt, formatted)

    def _chat_args(self, messages: Sequence[ChatMessage], kwargs: dict) -> tuple[str | None, str]:
        if self._chunked(kwargs):
            return fold_messages(message_pairs(self._extend_messages(list(messages)))), ""
        return None, self.chat_prompt(messages)

    # ---- generation ---------------------------------------------------------------------------------
    def _events(self, question: str | None, prompt: str, kwargs: dict):
        kwargs = dict(kwargs)
        nodes = kwargs.pop("nodes", None)  # alias: LlamaIndex code speaks of nodes
        if nodes is not None:
            kwargs["chunks"] = nodes
        return self.guarded(
            lambda: call_events(self.rag, self.call_defaults(), question, prompt, None, kwargs)
        )

    @staticmethod
    def _extra(c: Completion) -> dict:
        return {"ragkv": c.info(), "finish_reason": c.finish_reason}

    def _stream(self, question: str | None, prompt: str, kwargs: dict) -> Iterator[CompletionResponse]:
        text = ""
        for ev in self._events(question, prompt, kwargs):
            if isinstance(ev, Completion):
                extra = self._extra(ev)
                yield CompletionResponse(text=text, delta="", raw=extra, additional_kwargs=extra)
                return
            text += ev.text
            yield CompletionResponse(text=text, delta=ev.text)

    async def _astream(self, question: str | None, prompt: str, kwargs: dict) -> CompletionResponseAsyncGen:
        """:meth:`_stream` run in a worker thread: the event loop stays free while tokens are generated."""
        async for r in iterate_in_thread(lambda: self._stream(question, prompt, kwargs)):
            yield r

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return _done(_final(self._stream(*self._complete_args(prompt, formatted, kwargs), kwargs)))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream(*self._complete_args(prompt, formatted, kwargs), kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _chat_response(_final(self._stream(*self._chat_args(messages, kwargs), kwargs)), delta=False)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        responses = self._stream(*self._chat_args(messages, kwargs), kwargs)
        return (_chat_response(r, delta=True) for r in responses)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        last = None
        async for last in self._astream(*self._complete_args(prompt, formatted, kwargs), kwargs):  # noqa: B007
            pass
        return _done(last)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return self._astream(*self._complete_args(prompt, formatted, kwargs), kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        last = None
        async for last in self._astream(*self._chat_args(messages, kwargs), kwargs):  # noqa: B007
            pass
        return _chat_response(last, delta=False)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        responses = self._astream(*self._chat_args(messages, kwargs), kwargs)

        async def gen() -> ChatResponseAsyncGen:
            async for r in responses:
                yield _chat_response(r, delta=True)

        return gen()
