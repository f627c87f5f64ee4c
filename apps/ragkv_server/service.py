"""The service core: one ``ragkv.rag.RAG`` behind bounded worker pools, with admission control and metrics.

Generation never runs on the event loop: each query runs ``RAG.answer_stream`` in a worker thread
(``max_concurrency`` of them; ``engine_max_seqs`` with ``generation="engine"``, whose workers wait
on the shared batching engine; the RAG's generator decides where tokens are computed); at most ``max_queue`` more wait (then :class:`BusyError`, HTTP 429), and
a request that waits longer than ``queue_timeout_s`` gets :class:`UnavailableError` (503) at that
moment, and its work is dropped before it starts. Ingest and delete run one at a time on their own
thread, so queries go on while documents arrive; an ingest whose client goes away (or a server that
stops) is cancelled at its next batch, before it commits anything. Streams hand tokens from the worker
to the loop as they are produced; a client that goes away stops its generation at the next token.
Health and metrics run on their own small pool, so no amount of query, ingest or tokenization work
can starve them; :meth:`Service.close` waits at most ``shutdown_timeout_s`` for running work.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragkv.aio import ThreadItems
from ragkv.attention.buffers import KV_BUFFERS
from ragkv.blend.gate import gate_state
from ragkv.blend.spans import SearchCancelled, cancel_scope, expect_model
from ragkv.fidelity.plan import RequestSettings
from ragkv.generate import SamplingParams, TokenEvent
from ragkv.rag import RAG, ChunkRecord, Document, IngestCancelled, RagAnswer
from ragkv.rag.collections import DEFAULT_COLLECTION
from ragkv.rag.index import text_sha
from ragkv.rag.quotas import STATUS as QUOTA_LIMITS
from ragkv_server.config import ConfigError, Settings
from ragkv_server.errors import (
    BusyError,
    ClientGoneError,
    InvalidRequestError,
    NotFoundError,
    TooLargeError,
    UnavailableError,
)
from ragkv_server.errors import (
    ServiceError as ServiceError,
)  # its home is ragkv_server.errors; importable from here too
from ragkv_server.metrics import Counter, Gauge, Histogram, Registry

log = logging.getLogger("ragkv.server")


#: how often a waiting request checks its queue deadline and whether its client is still there
POLL_S = 0.25
Disconnected = Callable[[], Awaitable[bool]]


class _Ticket:
    """One piece of work through a gate: queued -> running, or queued -> dropped (timeout, client gone)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = "queued"
        self.cancel = threading.Event()  # set when the work should stop (checked between its steps)

    def start(self) -> bool:
        """In the worker: True when the work may run (it was not dropped while queued)."""
        with self._lock:
            if self.state != "queued" or self.cancel.is_set():
                self.state = "dropped"
                return False
            self.state = "running"
            return True

    def drop(self) -> bool:
        """On the loop: True when the work had not started (and now never will)."""
        self.cancel.set()
        with self._lock:
            if self.state == "queued":
                self.state = "dropped"
                return True
            return False


#: prefill statistics the API reports (``stats`` of /v1/query, ``ragkv.stats`` of the OpenAI endpoints)
STAT_KEYS = (
    "mode",
    "ratio",
    "num_tokens",
    "num_reused_rows",
    "num_computed_rows",
    "num_exact_rows",
    "cached_tokens",  # exact prompt rows reused from the KV tree (ragkv.blend.kvtree)
    "computed_tokens",
    "tree_depth",  # KV tree nodes matched
    "store_tokens",  # of the cached rows, read from the tree's store tier
    "recompute_fraction",
    "recomputed_per_layer",
    "kv_hits",
    "num_chunks",
    "fallback",
    "fidelity",
    "adapter",  # the KV adapter or chunk-KV writer reused rows went through (its identity; None: none)
    "decode_weights",  # what decode steps ran on: "gguf" (the GGUF file's blocks) or "float32"
    "t_prefill_s",
    "t_load_wait_s",
    "controller",
)


@dataclass
class Final:
    """The end of an answer stream: the RAG answer plus what the API reports around it."""

    answer: RagAnswer
    completion_tokens: int
    finish_reason: str  # the generation's last event's (the engine's own on the engine path)
    queue_s: float

    @property
    def prompt_tokens(self) -> int:
        return int(self.answer.stats.get("num_tokens", 0))


@dataclass
class QuerySpec:
    """One question: chunks by id (or none, or retrieved), prefill mode, sampling, and the collection
    it is asked in (retrieval, chunk ids and reused chunk KV are that collection's).

    ``conversation``: a chat's ``(role, text)`` turns before the question, kept as turns around the
    RAG prompt. ``messages``: an OpenAI chat to complete as sent instead (``{"role", "content",
    "name"?}``, rendered by the model's chat template as vLLM renders it, tokenized in the worker;
    ``question``, ``chunk_ids`` and ``retrieve`` are then unused): the stored chunks inside it are
    reused, nothing is retrieved. ``settings``: the request's prefill settings (mode, ratio,
    fidelity), parsed once by its route; what they leave unset is the service's (:meth:`RAG.job`)."""

    question: str
    chunk_ids: list[int] | None = None
    retrieve: bool = True
    top_k: int | None = None
    settings: RequestSettings | None = None
    params: SamplingParams | None = None
    collection: str = DEFAULT_COLLECTION
    conversation: list[tuple[str, str]] | None = None
    messages: list[dict] | None = None


class _Gate:
    """Admission: ``limit`` running + ``queue`` waiting; beyond that :class:`BusyError`."""

    def __init__(self, name: str, running: int, queue: int):
        self.name, self.capacity, self.workers = name, running + queue, running
        self.pending = 0
        self.running = 0
        self._lock = threading.Condition()

    def admit(self) -> None:
        with self._lock:
            if self.pending >= self.capacity:
                raise BusyError(
                    f"server busy: {self.pending} {self.name} requests in flight (limit {self.capacity}); retry later"
                )
            self.pending += 1

    def started(self) -> None:
        with self._lock:
            self.running += 1

    def finished(self, started: bool) -> None:
        with self._lock:
            self.pending -= 1
            if started:
                self.running -= 1
            if not self.pending:
                self._lock.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until nothing is in flight, at most ``timeout_s``; whether it is idle."""
        with self._lock:
            return self._lock.wait_for(lambda: not self.pending, timeout_s)

    @property
    def queued(self) -> int:
        return max(0, self.pending - self.running)


class Service:
    """Owns the RAG, the worker pools and the metrics registry of one server."""

    def __init__(self, settings: Settings, rag: RAG | None = None):
        self.settings = settings
        self._given = rag  # a RAG handed in: served through a view with this service's generator
        self.rag = rag
        # every query holds a worker while it runs; with the engine, workers only wait on its batches
        running = settings.engine_max_seqs if settings.generation == "engine" else settings.max_concurrency
        self.queries = _Gate("query", running, settings.max_queue)
        self.ingests = _Gate("ingest", 1, settings.max_ingest_queue)
        self._pool = ThreadPoolExecutor(running, thread_name_prefix="ragkv-gen")
        self._ingest_pool = ThreadPoolExecutor(
            1,
            thread_name_prefix="ragkv-ingest",
            initializer=_lower_priority,
            initargs=(settings.ingest_nice,),
        )
        # health, metrics: never behind queries, ingest or tokenization in a shared pool
        self.ops_pool = ThreadPoolExecutor(2, thread_name_prefix="ragkv-ops")
        self.read_pool = ThreadPoolExecutor(2, thread_name_prefix="ragkv-read")  # document listing
        self._closed = False
        self._stopping = threading.Event()  # running work stops at its next step
        self.started_at = int(time.time())
        self.registry = Registry()
        self._setup_metrics()

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the model, embedder, index and store (slow: call it off the event loop)."""
        s = self.settings
        if self._given is not None:
            expect_model(self._given.store, self._given.resolver.model)
        else:
            if s.torch_threads:
                import torch

                torch.set_num_threads(s.torch_threads)
            self.rag = build_rag(s, writer=True)
        generator = build_generator(s, self.rag)
        if self._given is None:
            self.rag.generator = generator
        else:  # a given RAG keeps its own generator (other services or callers may share it)
            self.rag = self._given.using(generator)

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop: queued work is dropped, running work is told to stop (an ingest at its next batch,
        before committing; a generation at its next token) and waited for at most ``timeout_s``
        (default ``settings.shutdown_timeout_s``). Returns whether everything finished; if not, the
        index and store are left open (the index is crash-consistent, so exiting now loses nothing
        that was acknowledged)."""
        timeout_s = self.settings.shutdown_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        self._closed = True
        self._stopping.set()
        if self.rag is not None:  # running generations end now (the engine: cancelled; threads: at a token)
            self.rag.generator.close()
        pools = (self._pool, self._ingest_pool, self.ops_pool, self.read_pool)
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
        threads = [t for pool in pools for t in list(getattr(pool, "_threads", ()))]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        busy = [t.name for t in threads if t.is_alive()]
        if busy:
            log.warning("shutdown: %s still running after %.1f s; exiting without waiting", busy, timeout_s)
            return False
        base = self._given or self.rag
        if base is not None:
            if base is not self.rag:
                self.rag.close()  # the view: its generator
            base.flush()
            base.close()  # releases the data folder's writer lock too
        return True

    # ---- running work off the loop ----------------------------------------------------------------
    async def _run(
        self,
        gate: _Gate,
        pool: ThreadPoolExecutor,
        fn: Callable[[threading.Event], Any],
        disconnected: Disconnected | None = None,
    ) -> Any:
        """``fn(cancel)`` on ``pool`` under ``gate``: 429 when full, 503 as soon as it has waited
        ``queue_timeout_s`` for a worker (the work is then dropped), and ``cancel`` set when the client
        goes away (``disconnected``) or the server stops; ``fn`` checks it between its steps."""
        if self._closed:
            raise UnavailableError("server is shutting down")
        try:
            gate.admit()
        except BusyError:
            self.rejected.inc(gate.name, "busy")
            raise
        t_in = time.perf_counter()
        ticket = _Ticket()

        def job():
            started = ticket.start()
            try:
                if not started:
                    return None
                gate.started()
                self.queue_wait.observe(time.perf_counter() - t_in, gate.name)
                return fn(ticket.cancel)
            finally:
                gate.finished(started)

        try:
            fut = asyncio.wrap_future(pool.submit(job))
        except RuntimeError as e:  # pool shut down
            gate.finished(False)
            raise UnavailableError("server is shutting down") from e
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "exception not retrieved"
        deadline = t_in + self.settings.queue_timeout_s
        while True:
            done, _ = await asyncio.wait({fut}, timeout=POLL_S)
            if done:
                if ticket.state == "dropped":  # stopped while queued (shutdown)
                    raise UnavailableError("server is shutting down")
                try:
                    return fut.result()
                except IngestCancelled:
                    if self._stopping.is_set():
                        raise UnavailableError(
                            "server is shutting down; the ingest was not committed"
                        ) from None
                    raise ClientGoneError("client went away; the ingest was not committed") from None
            if self._stopping.is_set():
                ticket.cancel.set()
            if ticket.state == "queued" and time.perf_counter() > deadline and ticket.drop():
                self.rejected.inc(gate.name, "timeout")
                raise UnavailableError(
                    f"waited {time.perf_counter() - t_in:.1f} s for a worker (limit {self.settings.queue_timeout_s} s)"
                )
            if disconnected is not None and not ticket.cancel.is_set() and await disconnected():
                ticket.drop()
                self.cancelled.inc()
                raise ClientGoneError("client went away")

    async def run_ingest(
        self, fn: Callable[[threading.Event], Any], disconnected: Disconnected | None = None
    ) -> Any:
        """Ingest or delete work, one at a time: ``fn(cancel)`` (see :meth:`_run`)."""
        return await self._run(self.ingests, self._ingest_pool, fn, disconnected)

    async def stream(
        self, spec: QuerySpec, disconnected: Disconnected | None = None
    ) -> AsyncIterator[TokenEvent | Final]:
        """Token events then a :class:`Final`: ``RAG.answer_stream`` in a worker thread (its generator
        computes in that thread, in the batching engine or on a vLLM server). The stream ends at the
        Final: what the worker does after it (committing the answer's KV to the KV tree for the next
        turn) runs after the response is out, the worker held until it is done."""
        async for item in self.run_stream(lambda wait: self._answer_iter(spec, wait), disconnected, Final):
            yield item
            if isinstance(item, Final):
                return

    async def run_stream(
        self,
        make_iter: Callable[[float], Iterator[Any]],
        disconnected: Disconnected | None = None,
        last: type | None = None,
    ) -> AsyncIterator[Any]:
        """The items of ``make_iter(queue seconds)``, produced in a worker thread under the query gate
        (admission, queue deadline enforced while waiting, cancellation when the consumer stops, the
        client goes away or the server stops). A consumer that stops after an item of type ``last``
        (the answer) does not cancel the worker: it finishes what follows (the answer's KV commit)."""
        if self._closed:
            raise UnavailableError("server is shutting down")
        try:
            self.queries.admit()
        except BusyError:
            self.rejected.inc("query", "busy")
            raise
        items: ThreadItems[Any] = ThreadItems()
        ticket = _Ticket()
        cancel = ticket.cancel
        t_in = time.perf_counter()

        def job() -> None:
            started = ticket.start()
            try:
                if not started:
                    return
                wait = time.perf_counter() - t_in
                self.queries.started()
                self.queue_wait.observe(wait, "query")
                stop = lambda: cancel.is_set() or self._stopping.is_set()  # noqa: E731
                # a chunk search or recompute before the first item stops too (ragkv.blend.spans)
                with cancel_scope(stop), self._generator_errors():
                    if not items.drain(make_iter(wait), stop):
                        self.cancelled.inc()
                        items.finish(UnavailableError("server is shutting down"))
                        return
            except SearchCancelled:
                self.cancelled.inc()
                items.finish(ClientGoneError("client went away, or the server is stopping"))
                return
            except BaseException as e:  # noqa: BLE001 - delivered to the request
                items.finish(e)
                return
            finally:
                self.queries.finished(started)
            items.finish()

        try:
            self._pool.submit(job)
        except RuntimeError as e:  # pool shut down
            self.queries.finished(False)
            raise UnavailableError("server is shutting down") from e
        deadline = t_in + self.settings.queue_timeout_s
        answered = False
        try:
            while True:
                try:
                    item = await items.get(POLL_S)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if ticket.state == "queued" and time.perf_counter() > deadline and ticket.drop():
                        self.rejected.inc("query", "timeout")
                        raise UnavailableError(
                            f"waited {time.perf_counter() - t_in:.1f} s for a worker "
                            f"(limit {self.settings.queue_timeout_s} s)"
                        ) from None
                    if self._stopping.is_set() and ticket.drop():
                        raise UnavailableError("server is shutting down") from None
                    if disconnected is not None and await disconnected():
                        ticket.drop()
                        raise ClientGoneError("client went away") from None
                    continue
                answered = last is not None and isinstance(item, last)
                yield item
        finally:
            if not answered:
                cancel.set()
            items.close()

    @contextmanager
    def _generator_errors(self):
        """The engine's refusals as the service's errors (429 busy, 413 too large, 400 not served)."""
        from ragkv.engine import EngineBusyError, RequestTooLargeError
        from ragkv.rag import OptionNotServedError

        try:
            yield
        except EngineBusyError as e:
            self.rejected.inc("query", "busy")
            raise BusyError(str(e)) from None
        except RequestTooLargeError as e:
            raise TooLargeError(str(e)) from None
        except OptionNotServedError as e:
            raise InvalidRequestError(str(e)) from None

    async def answer(
        self, spec: QuerySpec, disconnected: Disconnected | None = None, events: list | None = None
    ) -> tuple[str, Final]:
        """The whole answer (text, :class:`Final`); work is dropped if ``disconnected()`` turns true.
        ``events``: a list that collects the token events (their log-probabilities)."""
        parts = []
        final = None
        async for item in self.stream(spec, disconnected):
            if isinstance(item, Final):
                final = item
            else:
                parts.append(item.text)
                if events is not None and item.is_token:
                    events.append(item)
        assert final is not None
        return "".join(parts), final

    # ---- the work (worker threads) -------------------------------------------------------------
    def _answer_iter(self, spec: QuerySpec, queue_s: float) -> Iterator[TokenEvent | Final]:
        rag = self.rag
        params = spec.params or SamplingParams(max_new_tokens=self.settings.max_new_tokens)
        if spec.messages is not None:
            yield from self._finals(self._chat_items(spec, params), queue_s)
            return
        recs: list[ChunkRecord] | None = None
        if spec.chunk_ids is not None:
            try:
                recs = rag.chunks_by_id(list(spec.chunk_ids), spec.collection)
            except KeyError as e:  # unknown or of another collection: one message, nothing tells them apart
                raise NotFoundError(str(e.args[0]) if e.args else "unknown chunk id") from None
        elif not spec.retrieve:
            recs = []
        items = rag.answer_stream(
            spec.question,
            k=spec.top_k,
            params=params,
            chunks=recs,
            collection=spec.collection,
            conversation=spec.conversation,
            settings=spec.settings,
        )
        yield from self._finals(items, queue_s)

    def _chat_items(self, spec: QuerySpec, params: SamplingParams) -> Iterator:
        """An OpenAI chat completed as sent (:attr:`QuerySpec.messages`): rendered and tokenized here,
        in the worker, after admission (a long conversation queues like any other work)."""
        from ragkv.model.chat import ChatTemplateError, chat_prompt_ids

        try:
            ids = chat_prompt_ids(self.rag.model, spec.messages)
        except ChatTemplateError as e:
            raise InvalidRequestError(str(e)) from None
        # what the settings leave unset: the RAG's (the service's) defaults, decided in RAG.job
        return self.rag.stream_ids(ids, params=params, collection=spec.collection, settings=spec.settings)

    def _finals(self, items: Iterator, queue_s: float) -> Iterator[TokenEvent | Final]:
        """Token events, then the :class:`Final` of the :class:`RagAnswer` that ends ``items``."""
        n, reason = 0, None
        for item in items:
            if isinstance(item, RagAnswer):
                final = Final(item, n, reason, queue_s)
                self._observe(final)
                yield final
            else:
                n += item.is_token
                reason = item.finish_reason or reason
                yield item

    def _observe(self, f: Final) -> None:
        t = f.answer.timings
        self.ttft.observe(t["ttft_s"], f.answer.mode)
        self.latency.observe(t["total_s"], f.answer.mode)
        self.tokens.inc(n=f.completion_tokens)
        self.prompt_tokens.inc(n=f.prompt_tokens)
        self.answers.inc(f.answer.mode)

    def ingest(
        self, docs: list[dict], cancel: threading.Event | None = None, collection: str = DEFAULT_COLLECTION
    ) -> dict:
        """Ingest ``[{id?, text, metadata}]`` into ``collection`` (all or none); per document: added /
        unchanged / replaced and its chunk ids. Stops before committing when ``cancel`` is set or the
        server stops."""
        rag = self.rag
        documents = [Document(d["text"], d.get("id"), dict(d.get("metadata") or {})) for d in docs]
        seen: dict[str, str] = {}
        unique = []
        for d in documents:
            sha = text_sha(d.text)
            if d.id in seen:
                if seen[d.id] != sha:
                    raise InvalidRequestError(f"document id {d.id!r} appears twice with different texts")
                continue
            seen[d.id] = sha
            unique.append(d)
        before = {d.id: rag.index.document_sha(d.id, collection) for d in unique}
        stop = self._stopping

        def cancelled() -> bool:
            return stop.is_set() or (cancel is not None and cancel.is_set())

        rep = rag.ingest(
            unique, show_progress=False, cancel=cancelled, pause=self._yield_to_queries, collection=collection
        )
        out = []
        for d in unique:
            old = before[d.id]
            status = "added" if old is None else "unchanged" if old == seen[d.id] else "replaced"
            ids = [r.chunk_id for r in rag.index.chunks_of(d.id, collection)]
            out.append({"id": d.id, "status": status, "chunk_ids": ids})
        self.ingested.inc(n=rep.documents_added)
        return {
            "documents": out,
            "documents_added": rep.documents_added,
            "documents_unchanged": rep.documents_unchanged,
            "chunks_added": rep.chunks_added,
            "kv_computed": rep.kv_computed,
            "kv_not_stored": rep.kv_not_stored,
            "seconds": rep.seconds,
        }

    def _yield_to_queries(self) -> None:
        """Between ingest steps: wait while queries are in flight (at most ``ingest_yield_s``, so a
        constant stream of queries slows an ingest down but never stops it)."""
        if self.queries.pending and not self._stopping.is_set():
            if not self.queries.wait_idle(self.settings.ingest_yield_s):
                self.ingest_yields.inc("timeout")
            else:
                self.ingest_yields.inc("idle")

    def delete(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> None:
        """Delete a document of ``collection``: 404 when unknown there (the same for another's id)."""
        try:
            self.rag.delete_document(doc_id, collection)
        except KeyError:
            raise NotFoundError(f"unknown document id {doc_id!r}") from None

    # ---- metrics -------------------------------------------------------------------------------
    def _setup_metrics(self) -> None:
        r = self.registry
        self.http_requests = r.add(
            Counter(
                "ragkv_http_requests_total",
                "HTTP requests by route and status",
                ("method", "route", "status"),
            )
        )
        self.http_latency = r.add(
            Histogram(
                "ragkv_http_request_duration_seconds",
                "HTTP request duration (to the end of the body)",
                ("route",),
            )
        )
        self.ttft = r.add(Histogram("ragkv_ttft_seconds", "time to first token (after the queue)", ("mode",)))
        self.latency = r.add(
            Histogram("ragkv_answer_seconds", "time to the whole answer (after the queue)", ("mode",))
        )
        self.queue_wait = r.add(Histogram("ragkv_queue_wait_seconds", "time waiting for a worker", ("pool",)))
        self.answers = r.add(Counter("ragkv_answers_total", "answers generated by prefill mode", ("mode",)))
        self.tokens = r.add(Counter("ragkv_generated_tokens_total", "tokens generated"))
        self.prompt_tokens = r.add(Counter("ragkv_prompt_tokens_total", "prompt tokens prefilled or reused"))
        self.rejected = r.add(
            Counter(
                "ragkv_rejected_requests_total", "requests refused (busy / queue timeout)", ("pool", "reason")
            )
        )
        self.cancelled = r.add(Counter("ragkv_cancelled_streams_total", "streams whose client went away"))
        self.ingested = r.add(Counter("ragkv_documents_ingested_total", "documents added or replaced"))
        self.ingest_yields = r.add(
            Counter(
                "ragkv_ingest_yields_total",
                "ingest steps that waited for queries in flight (until idle, or ingest_yield_s)",
                ("outcome",),
            )
        )

        def counters() -> dict:
            return self.rag.counters if self.rag is not None else {}

        r.add(
            Gauge(
                "ragkv_kv_chunk_hits",
                "retrieved chunks whose KV came from the store (since start)",
                lambda: counters().get("kv_hits", 0),
            )
        )
        r.add(
            Gauge(
                "ragkv_kv_chunk_misses",
                "retrieved chunks whose KV had to be recomputed (since start)",
                lambda: counters().get("kv_misses", 0),
            )
        )
        r.add(
            Gauge(
                "ragkv_kv_hit_rate",
                "kv hits / (hits + misses) of retrieved chunks (1 when none yet)",
                lambda: _rate(counters().get("kv_hits", 0), counters().get("kv_misses", 0)),
            )
        )
        r.add(Gauge("ragkv_store_bytes", "bytes of chunk KV in the store", lambda: self.rag.store.nbytes()))
        r.add(
            Gauge(
                "ragkv_kv_tree",
                "the exact KV tree (ragkv.blend.kvtree): requests and hits, tokens requested, matched and read "
                "from the store tier, pages written/read/rejected, pages the store found corrupt (digest: "
                "recomputed, never used), evictions, RAM bytes and nodes, token hit rate",
                lambda: _tree_figures(self.rag.kv_tree),
                ("figure",),
            )
        )
        r.add(
            Gauge(
                "ragkv_kv_tree_bytes",
                "bytes of the exact KV tree per tier (ram; store: its pages in the store's tree namespace)",
                lambda: _tree_bytes(self.rag.kv_tree),
                ("tier",),
            )
        )
        r.add(
            Gauge(
                "ragkv_store_ops",
                "chunk store counters (hits, misses, puts, bytes read/written ...)",
                lambda: {(k,): v for k, v in self.rag.store.stats().items() if isinstance(v, (int, float))},
                ("op",),
            )
        )
        r.add(
            Gauge(
                "ragkv_kv_buffers",
                "the process's pool of KV buffers (exact passes, decode caches): bytes held, and buffers "
                "handed out again (reused) or newly allocated (each new one page-faults on first use)",
                lambda: {
                    ("bytes",): KV_BUFFERS.nbytes(),
                    ("reused",): KV_BUFFERS.reused,
                    ("allocated",): KV_BUFFERS.allocated,
                },
                ("figure",),
            )
        )
        r.add(
            Gauge(
                "ragkv_blend_gate",
                "the blending self-check's state (1 for the current one; failed: reuse and blend run full)",
                lambda: {
                    (st,): int(gate_state(self.rag.model) == st) for st in ("passed", "failed", "pending")
                },
                ("state",),
            )
        )

        def fidelity() -> dict:
            op = self.rag.llm.operating_point(self.rag.planner.settings.fidelity)
            labels = (op.target, op.point, op.mode)
            return {(*labels, "same_as_full"): op.same or 0.0, (*labels, "speedup"): op.speedup or 1.0}

        r.add(
            Gauge(
                "ragkv_fidelity",
                "the operating point blend runs at (fidelity gate): its same-answer rate vs full prefill on the "
                "calibration set and its TTFT speed-up",
                fidelity,
                ("target", "point", "mode", "figure"),
            )
        )
        r.add(
            Gauge(
                "ragkv_quota_refusals",
                "ingests refused by a quota since start (ragkv.rag.quotas), by limit",
                lambda: {(k,): getattr(self.rag, "quota_refusals", {}).get(k, 0) for k in QUOTA_LIMITS},
                ("limit",),
            )
        )
        r.add(
            Gauge(
                "ragkv_collections", "collections holding chunks", lambda: len(self.rag.index.collections())
            )
        )
        r.add(Gauge("ragkv_documents", "documents in the index", lambda: self.rag.index.num_documents))
        r.add(Gauge("ragkv_chunks", "chunks in the index", lambda: len(self.rag.index)))
        r.add(
            Gauge(
                "ragkv_requests_running",
                "requests being served by a worker",
                lambda: {("query",): self.queries.running, ("ingest",): self.ingests.running},
                ("pool",),
            )
        )
        r.add(
            Gauge(
                "ragkv_requests_queued",
                "requests waiting for a worker",
                lambda: {("query",): self.queries.queued, ("ingest",): self.ingests.queued},
                ("pool",),
            )
        )


def _lower_priority(nice: int) -> None:
    """Run the calling thread ``nice`` steps below the process's CPU priority (Linux sets it per
    thread), so on a busy machine the scheduler prefers queries and the event loop to ingest work."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (AttributeError, OSError) as e:  # not Linux, or not permitted: priorities stay equal
        log.info("could not lower the ingest thread's priority: %s", e)


def _tree_figures(tree) -> dict:
    """The KV tree's counters, and the pages its store tier found corrupt (their digest failed: read
    as a miss and recomputed; the tree's own counters see only a miss)."""
    out = {(k,): v for k, v in tree.stats().items() if isinstance(v, (int, float))}
    if tree.store is not None:
        out[("store_pages_corrupt",)] = tree.store.stats().get("corrupt", 0)
    return out


def _tree_bytes(tree) -> dict:
    """The KV tree's bytes per tier (the store tier: its namespace of the store)."""
    return {("ram",): tree.nbytes, ("store",): tree.store.nbytes() if tree.store is not None else 0}


def _rate(hits: float, misses: float) -> float:
    return hits / (hits + misses) if hits + misses else 1.0


def build_generator(s: Settings, rag: RAG):
    """Where ``rag`` generates (``s.generation``): worker threads, one batching engine over the RAG's
    chunk resolver, or the vLLM server at ``vllm_url`` (:mod:`ragkv.rag.generation`)."""
    from ragkv.rag import EngineGenerator, ThreadGenerator

    if s.generation == "threads":
        return ThreadGenerator()
    if s.generation == "engine":
        from ragkv.engine import Engine, EngineConfig, SchedulerConfig

        cfg = EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=s.engine_max_seqs, max_queue=max(1, s.max_queue)),
        )
        # the RAG's LLM: its model, settings, KV adapter, chunk resolver (the corpus's) and KV tree
        return EngineGenerator(Engine(rag.llm, cfg))
    from ragkv.remote.client import VllmClient, VllmGenerator

    if rag.resolver.model is not rag.model:  # a chunk-KV writer: the connector writes chunk KV itself
        raise ValueError("a chunk-KV writer adapter cannot be served with generation 'vllm'")
    client = VllmClient(
        s.vllm_url,
        s.vllm_model,
        api_key=s.vllm_api_key.get_secret_value() if s.vllm_api_key else None,
        timeout=s.vllm_timeout_s,
        connect_timeout=s.vllm_connect_timeout_s,
    )
    return VllmGenerator(client)


def build_rag(s: Settings, writer: bool = False, collect_garbage: bool | None = None) -> RAG:
    """The RAG of these settings (model, data dir, store URL, embedder, chunking, defaults).

    Files it creates are private (umask 077: data 0600, folders 0700). The store authenticates blobs
    with ``store_hmac_key`` when set and refuses KV whose geometry is not the model's. ``writer``
    (``serve``, ``ingest``): register as a writer of the data folder first (:func:`lock_data_dir`).
    ``collect_garbage``: delete unreferenced stored KV on open (default: a writer of the default store
    under ``data_dir``, which is this index's alone)."""
    from ragkv.llm import LLM
    from ragkv.rag import Embedder, prompt_options, prompt_parts
    from ragkv.store import default_store, default_store_url

    os.umask(0o077)
    data_dir = Path(s.data_dir)
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = lock_data_dir(data_dir) if writer else None
    llm = LLM(
        s.model,
        dtype=s.dtype,
        device=s.device,
        decode_weights=s.decode_weights,
        settings=s.request_settings(),  # parsed once: every request's defaults (the RAG reads them too)
    )
    prompt = prompt_options(s.prompt_file)  # the same prompt settings `ragkv demo` reads from its corpus
    prefix, suffix = prompt_parts(llm.model, "?", **prompt)
    key = s.store_hmac_key.get_secret_value() if s.store_hmac_key else None
    url = s.store or default_store_url(data_dir)
    # chunk KV is the KV writer's (the model's, or a chunk-KV writer's): its codec steps and geometry
    store = default_store(url, model=llm.kv_model, codec=s.store_codec, hmac_key=key)
    expect_model(store, llm.kv_model)
    rag = RAG(
        llm,
        s.data_dir,
        store=store,
        embedder=Embedder(s.embedder),
        chunk_tokens=s.chunk_tokens_for(llm.model.config.max_position, len(prefix) + len(suffix)),
        overlap=s.overlap,
        top_k=s.top_k,
        order=s.chunk_order,
        ingest_batch=s.ingest_batch_chunks,
        quotas=s.quotas(),
        **prompt,
        # the default store under data_dir is this index's alone, and the writer holds the folder's lock
        collect_garbage_on_open=(writer and s.store is None) if collect_garbage is None else collect_garbage,
    )
    rag.writer_lock = lock  # held (open) until rag.close() or the process ends
    return rag


class DataDirLocked(ConfigError):
    """Another process holds this data folder alone (``ragkv-server gc``) (a ``ValueError``, so the
    command line prints its message)."""


def lock_data_dir(data_dir: Path):
    """Register this process as a writer of the data folder (:class:`ragkv.rag.writers.WriterLock`,
    shared: several services and ingests may write one folder, by that module's protocol); returns the
    lock (held until closed). :class:`DataDirLocked` while another process holds the folder alone (gc)."""
    from ragkv.rag.writers import DataDirBusy, WriterLock

    try:
        return WriterLock(data_dir)
    except DataDirBusy as e:
        raise DataDirLocked(str(e)) from None
