"""What the LangChain and LlamaIndex wrappers (``langchain-ragkv``, ``llama-index-*-ragkv``) share: turning
their documents into ragkv chunks and answering over them with the chunks' stored KV reused.

Its own distribution (``ragkv-frameworks``), not the core's: only the integrations and the checkout's
``eval/`` use it, and it needs pydantic, which both frameworks bring and the core does not.

A framework document reaches ragkv in one of three ways:

* a document ragkv produced (its metadata carries ``ragkv_chunk_id`` and its text is the chunk's
  text): the indexed chunk, whose KV was stored at ingest, is used as is;
* a chunk id (``int``, ``"ragkv:<id>"`` or a numeric string): looked up in ragkv's index;
* any other document (e.g. from a foreign vector store): if ragkv already holds its text (a chunk
  with the same content key, or a document with exactly this text) those chunks are used, never a
  copy; otherwise it is ingested on first use under the id ``ext-<sha256 of the text>``; ingest is
  idempotent, so later uses find it and its KV stored.

Flattened prompts work too. A framework's own flat prompt (a standard LCEL chain's
``"\n\n".join(page_content)``, LlamaIndex's question-answering template) is searched for stored
chunks, and each one found is given as itself (:meth:`ragkv.rag.RAG.stream_text`): the same job as
the same text with those chunks given explicitly. Text between :data:`CHUNK_SEPARATOR` markers (what
:func:`format_docs` produces) is split out as chunks whose KV is looked up by content and stored
after first use, the text before the first marker is the prefix and the text after the last one
the question.

Generation runs wherever the wrapper's :class:`ragkv.rag.RAG` runs it: its generator
(:mod:`ragkv.rag.generation`) prefills and decodes in this process, in ragkv's batching engine, or on
a vLLM server (``ragkv.remote.client.VllmGenerator``, chunk keys in ``kv_transfer_params``).
"""

from __future__ import annotations

import hashlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from ragkv.constrain import JsonConstraint, json_constraint
from ragkv.defaults import DEFAULT_MAX_NEW_TOKENS
from ragkv.fidelity import parse_fidelity
from ragkv.fidelity.plan import RequestSettings
from ragkv.generate import SamplingParams, TokenEvent, request_params
from ragkv.rag import RAG, ChunkRecord, Document, RagAnswer
from ragkv.rag.collections import collection_name
from ragkv.remote.client import VllmUnavailableError


def check_backend(rag: Any) -> RAG:
    """``rag`` if it is a :class:`ragkv.rag.RAG`, else a TypeError saying what to pass."""
    if not isinstance(rag, RAG):
        raise TypeError(
            f"{type(rag).__name__} is not a ragkv RAG; pass a ragkv.rag.RAG (its generator decides "
            "where it generates: threads, the engine, or a vLLM server)"
        )
    return rag


CHUNK_SEPARATOR = "\n<ragkv:chunk>\n"
"""Marks chunk boundaries in a flattened prompt: ``prefix SEP chunk1 SEP chunk2 SEP question``."""

CHUNK_ID_PREFIX = "ragkv:"
#: the framework sampling options, in :func:`ragkv.generate.request_params`' argument order
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")
_ingest_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def ingest_lock(rag: RAG) -> threading.Lock:
    """One lock per RAG serialising ingest/delete (two first uses of one document must not race)."""
    with _locks_guard:
        lock = _ingest_locks.get(rag)
        if lock is None:
            lock = _ingest_locks[rag] = threading.Lock()
        return lock


def format_docs(docs: Sequence[Any]) -> str:
    """Join documents' texts with :data:`CHUNK_SEPARATOR` so a flattened prompt keeps its chunks."""
    texts = [doc_fields(d)[0] for d in docs]
    return CHUNK_SEPARATOR + CHUNK_SEPARATOR.join(texts) + CHUNK_SEPARATOR if texts else ""


def split_prompt(prompt: str) -> tuple[str, list[str], str]:
    """``(prefix, chunks, question)`` of a prompt with separators; no separator: ``("", [], prompt)``."""
    parts = prompt.split(CHUNK_SEPARATOR)
    if len(parts) == 1:
        return "", [], prompt
    chunks = [p for p in parts[1:-1] if p.strip()]
    return parts[0], chunks, parts[-1]


def chunk_metadata(rec: ChunkRecord) -> dict:
    """Metadata a framework document carries for a ragkv chunk (ids, KV key, score, source metadata)."""
    return {
        **rec.metadata,
        "ragkv_chunk_id": rec.chunk_id,
        "ragkv_kv_key": rec.kv_key,
        "ragkv_doc_id": rec.doc_id,
        "ragkv_seq": rec.seq,
        "score": rec.score,
    }


def ragkv_metadata(rec: ChunkRecord) -> dict:
    """A chunk's ragkv ids (``ragkv_chunk_id``, ``ragkv_kv_key``, ``ragkv_doc_id``, ``ragkv_seq``) for
    a framework document made from it by a splitter (no score: nothing was retrieved)."""
    return {k: v for k, v in chunk_metadata(rec).items() if k.startswith("ragkv_")}


def doc_fields(doc: Any) -> tuple[str, dict, str | None]:
    """``(text, metadata, id)`` of a LangChain ``Document``, a LlamaIndex node / ``NodeWithScore``,
    a ``ChunkRecord``, a ``dict`` with ``text``/``page_content`` or a plain string."""
    if isinstance(doc, ChunkRecord):
        return doc.text, chunk_metadata(doc), f"{CHUNK_ID_PREFIX}{doc.chunk_id}"
    if isinstance(doc, str):
        return doc, {}, None
    if isinstance(doc, dict):
        text = doc.get("text", doc.get("page_content"))
        return text, dict(doc.get("metadata") or {}), doc.get("id")
    node = getattr(doc, "node", None)  # LlamaIndex NodeWithScore
    if node is not None and hasattr(node, "get_content"):
        doc = node
    if hasattr(doc, "page_content"):  # LangChain Document
        return doc.page_content, dict(doc.metadata or {}), getattr(doc, "id", None)
    if hasattr(doc, "get_content"):  # LlamaIndex BaseNode
        from llama_index.core.schema import MetadataMode

        return doc.get_content(metadata_mode=MetadataMode.NONE), dict(doc.metadata or {}), doc.node_id
    raise TypeError(
        f"cannot use {type(doc).__name__} as a chunk; pass documents, nodes, chunk ids or strings"
    )


def foreign_id(text: str) -> str:
    """The document id a foreign document's text is ingested under (content-addressed: idempotent)."""
    return "ext-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def parse_chunk_id(value: Any) -> int | None:
    """A chunk id from ``int``, ``"ragkv:<id>"`` or ``"<digits>"``; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        s = value[len(CHUNK_ID_PREFIX) :] if value.startswith(CHUNK_ID_PREFIX) else value
        value = int(s) if s.isascii() and s.isdigit() else None
    if isinstance(value, int):
        return value if 0 <= value < 2**63 else -1  # out of SQLite's range: an id no chunk has
    return None


class RagkvOptions(BaseModel):
    """Options every ragkv-backed framework model carries (LangChain and LlamaIndex wrappers alike).

    Unknown constructor arguments are an error (``extra="forbid"``), never silently dropped."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", populate_by_name=True)

    rag: Any = Field(
        exclude=True,
        description="the ragkv.rag.RAG (its generator runs in process, in the engine or on a vLLM server)",
    )
    mode: str | None = Field(None, description="prefill mode for chunked calls (None: the RAG's default)")
    ratio: float | None = Field(None, description="blend recompute ratio (None: the RAG's default)")
    fidelity: str | float | None = Field(
        None,
        description="where blend without a ratio runs (ragkv.fidelity): floor, exact, fast, fast:X or a "
        "same-answer rate; None: the RAG's setting. The point used is in the answer's stats['fidelity']",
    )
    k: int | None = Field(
        None, ge=1, description="chunks to retrieve when retrieve=True (None: the RAG's top_k)"
    )
    retrieve: bool = Field(False, description="retrieve chunks from ragkv's index when a call passes none")
    collection: str | None = Field(
        None,
        description="the collection whose documents, chunks and stored KV calls use, and where foreign "
        "documents are ingested (None: the default collection; any stored chunk in a flat prompt)",
    )
    max_new_tokens: int = Field(
        DEFAULT_MAX_NEW_TOKENS,
        ge=1,
        validation_alias=AliasChoices("max_new_tokens", "max_tokens"),
        description="tokens to generate at most (``max_tokens`` is accepted too)",
    )
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: list[str] | None = Field(None, description="stop sequences (a call's own ``stop`` replaces them)")
    timeout: float | None = Field(
        None, gt=0, description="seconds a call may take; checked between tokens (TimeoutError)"
    )
    max_retries: int = Field(
        0, ge=0, description="retries of a call whose backend was unreachable before its first token"
    )

    @model_validator(mode="before")
    @classmethod
    def _one_max_tokens(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_tokens" in data and "max_new_tokens" in data:
            if data["max_tokens"] != data["max_new_tokens"]:
                raise ValueError("give max_tokens or max_new_tokens, not both")
            data = {k: v for k, v in data.items() if k != "max_new_tokens"}
        return data

    @field_validator("fidelity")
    @classmethod
    def _fidelity(cls, v: Any) -> Any:
        return None if v is None else parse_fidelity(v)

    @field_validator("rag")
    @classmethod
    def _backend(cls, v: Any) -> Any:
        try:
            return check_backend(v)
        except TypeError as e:
            raise ValueError(str(e)) from None

    @property
    def max_tokens(self) -> int:
        """``max_new_tokens`` under the name LangChain's tracing and OpenAI use."""
        return self.max_new_tokens

    def model_label(self, override: Any = None) -> str:
        """The served model's name (a call's ``model`` kwarg wins): for tracing and metadata."""
        if isinstance(override, str) and override:
            return override
        m = self.rag.model
        return str(getattr(m, "name", "") or m.fingerprint[:16])

    def request_settings(self) -> RequestSettings:
        """This model's ``mode``, ``ratio`` and ``fidelity`` as one value (unset: the RAG's)."""
        return RequestSettings(self.mode, self.ratio, fidelity=self.fidelity)

    def call_defaults(self) -> dict:
        """The per-call option defaults this model carries."""
        return {k: getattr(self, k, None) for k in DEFAULT_KEYS}

    def guarded(self, make: Callable[[], Iterator]) -> Iterator:
        """``make()``'s items under this model's ``timeout`` and ``max_retries``."""
        return guarded(make, self.timeout, self.max_retries)


#: errors worth a retry: the backend (a vLLM server, the Redis store) could not be reached
TRANSIENT = (ConnectionError, TimeoutError)


def _transient(e: BaseException) -> bool:
    if isinstance(e, TRANSIENT):
        return True
    return isinstance(e, VllmUnavailableError)


def guarded(make: Callable[[], Iterator], timeout: float | None, max_retries: int = 0) -> Iterator:
    """Iterate ``make()``: a backend that is unreachable before the first item is retried up to
    ``max_retries`` times (0.1 s, 0.2 s, ... apart); past ``timeout`` seconds (checked at each item,
    so a long prefill finishes first) the call stops with :class:`TimeoutError`."""
    t0 = time.monotonic()
    attempt = 0
    while True:
        started = False
        it = None
        try:
            it = make()
            for item in it:
                started = True
                if timeout is not None and time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"the call took longer than its timeout of {timeout} s")
                yield item
            return
        except Exception as e:
            if started or attempt >= max_retries or not _transient(e):
                raise
            attempt += 1
            time.sleep(min(0.1 * 2 ** (attempt - 1), 2.0))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()


@dataclass
class Completion:
    """A finished answer with what the frameworks expose as metadata."""

    text: str
    finish_reason: str  # the generation's last event's: "stop" | "length"
    num_tokens: int
    mode: str
    stats: dict
    timings: dict
    sources: list[ChunkRecord] = field(default_factory=list)
    ingested: list[str] = field(default_factory=list)

    def info(self) -> dict:
        """JSON-able summary: mode, reuse statistics, timings, source chunk ids and keys."""
        keep = (
            "num_tokens",
            "num_reused_rows",
            "num_computed_rows",
            "recompute_fraction",
            "recomputed_per_layer",
            "kv_hits",
            "num_chunks",
            "fallback",
        )
        return {
            "mode": self.mode,
            "finish_reason": self.finish_reason,
            "completion_tokens": self.num_tokens,
            **{k: self.stats[k] for k in keep if k in self.stats},
            "timings": dict(self.timings),
            "chunk_ids": [r.chunk_id for r in self.sources],
            "kv_keys": [r.kv_key for r in self.sources],
            "ingested_documents": list(self.ingested),
        }


class RagkvRunner:
    """Resolve framework documents to ragkv chunks and stream answers over them (thread-safe)."""

    def __init__(self, rag: RAG, collection: str | None = None):
        self.rag = check_backend(rag)
        #: None: the default collection, and any stored chunk inside a flat prompt (the library's reuse)
        self.collection = collection
        self.coll = collection_name(collection)

    # ---- documents -> chunks --------------------------------------------------------------------
    def resolve(
        self, chunks: Sequence[Any] | None = None, chunk_ids: Sequence[Any] | None = None
    ) -> tuple[list[ChunkRecord], list[str]]:
        """Index records for ``chunks`` (documents, nodes, records, ids) and ``chunk_ids``; foreign
        documents are ingested first. Returns ``(records, ingested document ids)``."""
        groups, ingested = self.resolve_each(list(chunk_ids or []) + list(chunks or []))
        return [r for g in groups for r in g], ingested

    def resolve_each(self, items: Sequence[Any]) -> tuple[list[list[ChunkRecord]], list[str]]:
        """The index records of each item (a document, node, record or chunk id), in order: one
        chunk, or the chunks of the document that holds the item's text; foreign documents are
        ingested first (together). Returns ``(records per item, ingested document ids)``."""
        slots: list[list[ChunkRecord] | None] = []
        foreign: dict[int, Document] = {}
        for i, item in enumerate(items):
            held = self.lookup(item, i)
            if held is None:
                text, meta, _ = doc_fields(item)
                clean = {k: v for k, v in meta.items() if not k.startswith("ragkv_") and _jsonable(v)}
                foreign[i] = Document(text, foreign_id(text), clean)
            slots.append(held)
        ingested: list[str] = []
        if foreign:
            with ingest_lock(self.rag):
                todo = {d.id: d for d in foreign.values() if not self.rag.index.has_document(d.id, self.coll)}
                if todo:
                    self.rag.ingest(list(todo.values()), show_progress=False, collection=self.coll)
                    ingested = list(todo)
            for i, d in foreign.items():
                slots[i] = self.rag.index.chunks_of(d.id, self.coll)
        return [s or [] for s in slots], ingested

    def lookup(self, item: Any, i: int = 0) -> list[ChunkRecord] | None:
        """The index records ``item`` (a document, node, record or chunk id) stands for, without
        ingesting anything: None for a foreign document ragkv does not hold yet. KeyError for an
        unknown chunk id, ValueError for a document without text (``i``: its place, for the message)."""
        if isinstance(item, ChunkRecord):
            return [item]
        cid = parse_chunk_id(item)
        if cid is not None:
            if cid < 0:
                raise KeyError(f"unknown chunk id {item!r}")
            return self.rag.chunks_by_id([cid], self.coll)  # KeyError: unknown, or another collection's
        if isinstance(item, str) and (item.startswith(CHUNK_ID_PREFIX) or not item.strip()):
            raise KeyError(f"unknown chunk id {item!r}")
        text, meta, _ = doc_fields(item)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"chunk {i} has no text")
        rec = self._known(meta, text)
        if rec is not None:
            return [rec]
        doc_id = foreign_id(text)
        if self.rag.index.has_document(doc_id, self.coll):
            return self.rag.index.chunks_of(doc_id, self.coll)
        return self.held(text) or None

    def held(self, text: str) -> list[ChunkRecord]:
        """The indexed chunks that already hold ``text``: a chunk with its content key (the same token
        ids under this model), else the chunks of a document with exactly this text, else the one
        chunk whose text it is (found by the chunk locator); [] if none."""
        index = self.rag.index
        model, resolver = self.rag.model, self.rag.resolver
        for t in dict.fromkeys((text, text.strip())):
            key = resolver.key(model.encode(t))  # under the fingerprint the RAG's KV is written with
            recs = index.chunks_with_key(key, self.coll)
            if recs:
                return recs[:1]
        for t in dict.fromkeys((text, text.strip())):
            for doc_id in index.documents_with_text(t, self.coll):
                recs = index.chunks_of(doc_id, self.coll)
                if recs:
                    return recs
        # a chunk's own text taken out of its document (a splitter's piece, a node): tokenized apart,
        # its first tokens can merge differently, so its key differs; the locator still finds it
        locator = self.rag.chunk_locator()
        if locator is not None:
            found = locator.find(model.encode(text))
            if len(found) == 1:
                for rec in index.chunks_with_key(found[0].key, self.coll):
                    if rec.text.strip() == text.strip():
                        return [rec]
        return []

    def _known(self, meta: dict, text: str) -> ChunkRecord | None:
        """The indexed chunk a ragkv-made document names, if it still exists with the same text."""
        cid = parse_chunk_id(meta.get("ragkv_chunk_id"))
        if cid is None:
            return None
        rec = self.rag.index.chunk(cid, self.coll)
        return rec if rec is not None and rec.text == text else None

    # ---- answering ----------------------------------------------------------------------------
    def stream_answer(
        self,
        question: str,
        records: list[ChunkRecord] | None,
        settings: RequestSettings | None = None,
        k: int | None = None,
        ingested: list[str] | None = None,
        **sampling,
    ) -> Iterator[TokenEvent | Completion]:
        """Answer ``question`` over ``records`` (None: retrieve ``k``) with ragkv's RAG prompt and the
        call's ``settings`` (None: the RAG's)."""
        params = make_params(sampling)
        n, reason = 0, None
        for item in self.rag.answer_stream(
            question, k=k, params=params, chunks=records, collection=self.coll, settings=settings
        ):
            if isinstance(item, RagAnswer):
                yield Completion(
                    item.text,
                    reason,
                    n,
                    item.mode,
                    item.stats,
                    item.timings,
                    list(item.sources),
                    list(ingested or []),
                )
            else:
                n += item.is_token
                reason = item.finish_reason or reason
                yield item

    def stream_prompt(
        self, prompt: str, settings: RequestSettings | None = None, **sampling
    ) -> Iterator[TokenEvent | Completion]:
        """Complete a flattened prompt; text between :data:`CHUNK_SEPARATOR` markers becomes chunks."""
        prefix, chunk_texts, question = split_prompt(prompt)
        return self.stream_parts(prefix, chunk_texts, question, settings, **sampling)

    def stream_parts(
        self,
        prefix: str,
        chunk_texts: list[str],
        question: str,
        settings: RequestSettings | None = None,
        **sampling,
    ) -> Iterator[TokenEvent | Completion]:
        """Complete ``prefix + chunks + question`` (text); chunk KV is looked up by content, stored after
        use. The stored chunks a framework formatted into the prefix or question (its own context
        format) are found and given as themselves (:meth:`ragkv.rag.RAG.stream_text`), so a flat
        prompt is the same job as the same text with those chunks given explicitly."""
        params = make_params(sampling)
        items = self.rag.stream_text(
            prefix, chunk_texts, question, params=params, collection=self.collection, settings=settings
        )
        n, reason = 0, None
        for item in items:
            if isinstance(item, RagAnswer):
                yield Completion(item.text, reason, n, item.mode, item.stats, item.timings)
            else:
                n += item.is_token
                reason = item.finish_reason or reason
                yield item


def make_params(sampling: dict) -> SamplingParams:
    """SamplingParams from framework kwargs (``max_tokens`` is accepted for ``max_new_tokens``;
    ``constraint``: a :class:`~ragkv.constrain.JsonConstraint`, see :func:`format_constraint`)."""
    s = {k: v for k, v in sampling.items() if v is not None}
    if "max_tokens" in s:
        s.setdefault("max_new_tokens", s.pop("max_tokens"))
    constraint = s.pop("constraint", None)
    unknown = set(s) - set(SAMPLING_KEYS)
    if unknown:
        raise TypeError(f"unknown generation options {sorted(unknown)}; use {SAMPLING_KEYS}")
    return request_params(*(s.get(k) for k in SAMPLING_KEYS), constraint=constraint)  # request_params' order


def format_constraint(response_format: Any) -> JsonConstraint | None:
    """The constraint of a call's ``response_format``, in OpenAI's shape (``{"type": "text"}``: none;
    ``{"type": "json_object"}``: any JSON object; ``{"type": "json_schema", "json_schema": {"schema":
    ...}}``: JSON matching the schema), or a ready :class:`~ragkv.constrain.JsonConstraint`.
    ValueError (a :class:`~ragkv.constrain.ConstraintError`) for anything else or a refused schema."""
    if response_format is None or isinstance(response_format, JsonConstraint):
        return response_format
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_constraint()
    if kind == "json_schema" and isinstance(response_format.get("json_schema"), dict):
        return json_constraint(response_format["json_schema"].get("schema"))
    raise ValueError(
        'response_format must be {"type": "text" | "json_object"} or {"type": "json_schema", '
        f'"json_schema": {{"schema": ...}}}}, got {response_format!r}'
    )


def _jsonable(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None), list, dict))


def fold_messages(messages: Sequence[tuple[str, str]]) -> str:
    """The question of a conversation: the last user turn, earlier turns prepended as ``Role: text`` lines.

    ragkv's RAG prompt has one question slot, so history (system prompts included) goes there.
    """
    turns = [(r, t) for r, t in messages if t and t.strip()]
    if not turns:
        raise ValueError("no message with text")
    last = max((i for i, (r, _) in enumerate(turns) if r in ("user", "human")), default=len(turns) - 1)
    history = [f"{r.capitalize()}: {t.strip()}" for r, t in turns[:last]]
    return "\n".join([*history, turns[last][1].strip()])


def render_chat(model, messages: Sequence[tuple[str, str]]) -> str:
    """A conversation as one prompt: the tokenizer's chat template, else ``Role: text`` lines.

    A template that starts with the BOS token's text loses it here only when the prompt's encoding
    adds BOS itself (``model.adds_bos``), so it is there exactly once. A ChatML tokenizer whose BOS
    is ``<|im_start|>`` (SmolLM2) adds none: stripping it lost the first turn's ``<|im_start|>``."""
    tok = model.tokenizer
    roles = {"human": "user", "ai": "assistant"}
    msgs = [{"role": roles.get(r, r), "content": t} for r, t in messages]
    if tok is not None and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        bos = getattr(tok, "bos_token", None)
        if bos and text.startswith(bos) and getattr(model, "adds_bos", True):
            return text[len(bos) :]  # the encoding adds BOS itself
        return text
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in msgs) + "Assistant:"


CALL_KEYS = (
    "chunks",
    "chunk_ids",
    "mode",
    "ratio",
    "fidelity",
    "k",
    "retrieve",
    "collection",
    "max_tokens",
    "response_format",
    *SAMPLING_KEYS,
)
DEFAULT_KEYS = ("mode", "ratio", "fidelity", "k", "retrieve", "collection", *SAMPLING_KEYS)


def call_events(
    rag: RAG,
    defaults: dict,
    question: str | None,
    prompt: str,
    stop: Sequence[str] | None,
    kwargs: dict,
) -> Iterator[TokenEvent | Completion]:
    """One framework call: per-call ``kwargs`` over the wrapper's ``defaults``; answers over chunks
    (``chunks`` / ``chunk_ids`` / ``retrieve``) with ``question or prompt`` as the question, else
    completes ``prompt``; ``response_format`` constrains the output (:func:`format_constraint`).
    Raises TypeError on an unknown option."""
    opts = {k: v for k, v in kwargs.items() if not k.startswith("ls_")}  # LangChain tracing hints
    unknown = set(opts) - set(CALL_KEYS)
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)} for a ragkv model; use {CALL_KEYS}")
    o = {k: defaults.get(k) for k in DEFAULT_KEYS}
    if "max_tokens" in opts:
        opts["max_new_tokens"] = opts.pop("max_tokens")
    o.update({k: v for k, v in opts.items() if k in DEFAULT_KEYS})
    sampling = {k: o[k] for k in SAMPLING_KEYS}
    if stop:
        sampling["stop"] = tuple(stop)
    constraint = format_constraint(opts.get("response_format"))
    if constraint is not None:  # a generator that cannot serve it (vLLM) refuses it: OptionNotServedError
        sampling["constraint"] = constraint
    settings = RequestSettings(o["mode"], o["ratio"], fidelity=o["fidelity"])  # parsed once, here
    runner = RagkvRunner(rag, o["collection"])
    chunks, chunk_ids = opts.get("chunks"), opts.get("chunk_ids")
    if chunks is not None or chunk_ids is not None:
        records, ingested = runner.resolve(chunks, chunk_ids)
        return runner.stream_answer(question or prompt, records, settings, ingested=ingested, **sampling)
    if o["retrieve"]:
        return runner.stream_answer(question or prompt, None, settings, k=o["k"], **sampling)
    return runner.stream_prompt(prompt, settings, **sampling)
