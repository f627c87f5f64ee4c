"""``ChatRagkv``: a LangChain ``BaseChatModel`` answered by ragkv with reused chunk KV.

With ``chunks=docs`` / ``chunk_ids=[...]`` / ``retrieve=True`` the last user message is the question
(earlier turns are prepended to it) and the documents are chunks whose stored KV is reused. Without
them the conversation is rendered with the model's chat template (``Role: text`` lines when it has
none) and completed: the stored chunks inside it (a chain's formatted documents) are given as
themselves, their KV reused, and ``CHUNK_SEPARATOR`` markers still split out chunks. The reply's
``response_metadata["ragkv"]`` has the reuse statistics (``kv_hits``, ``num_reused_rows`` ...).

``with_structured_output(schema)`` constrains the generation itself to JSON matching the schema
(``response_format``, :mod:`ragkv.constrain`): methods ``"json_schema"`` (the default) and
``"json_mode"``; no tool calling.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field

from langchain_ragkv._base import RagkvParams
from ragkv_frameworks import Completion, fold_messages, render_chat

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "tool"}


def message_pairs(messages: list[BaseMessage]) -> list[tuple[str, str]]:
    """``(role, text)`` of LangChain messages (text blocks of multi-part contents joined)."""
    out = []
    for m in messages:
        content = m.content
        if not isinstance(content, str):
            content = "".join(
                b if isinstance(b, str) else str(b.get("text", ""))
                for b in content
                if isinstance(b, str) or b.get("type") == "text"
            )
        out.append((_ROLES.get(m.type, m.type), content))
    return out


class ChatRagkv(RagkvParams, BaseChatModel):
    """Chat model backed by ragkv (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    streaming: bool = Field(False, description="invoke() streams internally (LangChain's switch)")

    @property
    def _llm_type(self) -> str:
        return "ragkv-chat"

    def chat_prompt(self, messages: list[BaseMessage]) -> str:
        """The flat prompt a chat without chunk options completes: the conversation rendered with the
        model's chat template (``Role: text`` lines when it has none). Stored chunks inside it (a
        chain's formatted documents) are found and their KV reused."""
        return render_chat(self.rag.model, message_pairs(messages))

    def _chat_events(self, messages: list[BaseMessage], stop, kwargs):
        wants_chunks = any(kwargs.get(k) is not None for k in ("chunks", "chunk_ids")) or kwargs.get(
            "retrieve", self.retrieve
        )
        if wants_chunks:
            return self._events(fold_messages(message_pairs(messages)), "", stop, kwargs)
        return self._events(None, self.chat_prompt(messages), stop, kwargs)

    def _last(self, c: Completion) -> ChatGenerationChunk:
        prompt_tokens = int(c.stats.get("num_tokens", 0))
        meta = {"finish_reason": c.finish_reason, "model_name": self.model_label(), "model_provider": "ragkv"}
        msg = AIMessageChunk(
            content="",
            response_metadata={**meta, "ragkv": c.info()},
            usage_metadata={
                "input_tokens": prompt_tokens,
                "output_tokens": c.num_tokens,
                "total_tokens": prompt_tokens + c.num_tokens,
            },
        )
        return ChatGenerationChunk(message=msg, generation_info={"finish_reason": c.finish_reason})

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        yield from self._chunks(self._chat_events(messages, stop, kwargs), _chunk, self._last, run_manager)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in self._achunks(
            lambda: self._chat_events(messages, stop, kwargs), _chunk, self._last, run_manager
        ):
            yield chunk

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return _result(list(self._stream(messages, stop, run_manager, **kwargs)))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return _result([c async for c in self._astream(messages, stop, run_manager, **kwargs)])

    def with_structured_output(
        self,
        schema: dict | type | None = None,
        *,
        method: Literal["json_schema", "json_mode", "function_calling"] = "json_schema",
        include_raw: bool = False,
        **kwargs: Any,
    ) -> Runnable:
        """This model with its output constrained to JSON matching ``schema`` and parsed: into the
        Pydantic class when ``schema`` is one, else into a dict (streamed as growing partial dicts).

        ``schema``: a Pydantic class (v2 or v1), a TypedDict or a JSON schema with a ``title``.
        ``method="json_schema"`` (default) constrains decoding to the schema; ``"json_mode"`` to any JSON
        object, or to the schema when one is given (ragkv can always enforce it); ``"function_calling"``
        is taken as ``"json_schema"`` (ragkv has no tool calls: the same object comes from constrained
        JSON). ``strict`` is accepted: the output always matches the schema. ``include_raw``: a dict
        ``{"raw", "parsed", "parsing_error"}`` instead, as LangChain's chat models give it."""
        if kwargs.pop("strict", None) not in (None, True, False):
            raise ValueError("strict must be a bool")
        if kwargs:
            raise ValueError(f"unexpected arguments {sorted(kwargs)}")
        if method not in ("json_schema", "json_mode", "function_calling"):
            raise ValueError(
                f"unknown method {method!r}; use 'json_schema', 'json_mode' or 'function_calling'"
            )
        if schema is None and method != "json_mode":
            raise ValueError(f"method {method!r} needs a schema")
        json_schema = convert_to_json_schema(schema) if schema is not None else None
        fmt = (
            {
                "type": "json_schema",
                "json_schema": {"name": json_schema.get("title", "output"), "schema": json_schema},
            }
            if json_schema is not None
            else {"type": "json_object"}
        )
        bound = self.bind(
            response_format=fmt,
            ls_structured_output_format={"kwargs": {"method": method}, "schema": schema},
        )
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser: Runnable = (
            RunnableLambda(PydanticOutputParser(pydantic_object=schema).invoke)
            if pydantic
            else JsonOutputParser()
        )
        if not include_raw:
            return bound | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=bound) | parsed.with_fallbacks([fallback], exception_key="parsing_error")


def _chunk(text: str) -> ChatGenerationChunk:
    return ChatGenerationChunk(message=AIMessageChunk(content=text))


def _result(chunks: list[ChatGenerationChunk]) -> ChatResult:
    last = chunks[-1].message
    msg = AIMessage(
        content="".join(str(c.message.content) for c in chunks),
        response_metadata=last.response_metadata,
        usage_metadata=last.usage_metadata,
    )
    return ChatResult(generations=[ChatGeneration(message=msg, generation_info=chunks[-1].generation_info)])
