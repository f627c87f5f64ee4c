"""A request's prompt parts, sampling settings, state and output channel."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from ragkv.blend.plan import BlendPlan
from ragkv.generate import Detokenizer, SamplingParams, TokenEvent
from ragkv.metrics.serving import RequestMetrics

if TYPE_CHECKING:
    from ragkv.engine.paged_cache import PagedSequence

_ids = itertools.count()


class RequestStatus(str, Enum):
    WAITING = "waiting"  # queued; nothing fetched yet
    WAITING_FOR_KV = "waiting_for_kv"  # chunk KV being fetched in the background
    READY = "ready"  # everything local (fetched, or preempted); waiting for KV blocks / a running slot
    RUNNING = "running"  # prefilled, decoding
    FINISHED = "finished"


class RequestFailedError(RuntimeError):
    """The request could not be served (fetch failure, prompt too long, bad KV ...); see ``__cause__``."""


@dataclass
class RequestOutput:
    """The final state of a request."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    metrics: RequestMetrics
    error: str | None = None
    prefill_stats: dict = field(default_factory=dict)


class Request:
    """Prompt parts (token ids / chunk items), sampling, mode; mutated only by the engine thread."""

    def __init__(
        self,
        prefix: list[int],
        chunks: list,
        question: list[int],
        params: SamplingParams,
        plan: BlendPlan,
        request_id: str | None = None,
        sink: Callable[[object], None] | None = None,
    ):
        self.request_id = request_id or f"req-{next(_ids)}"
        self.prefix, self.chunks, self.question = prefix, chunks, question
        #: what the prefill runs (mode, ratio or schedule, the gate's point): ``Engine.make_request``
        self.params, self.plan = params, plan
        self.mode = plan.mode
        self.status = RequestStatus.WAITING
        self.metrics = RequestMetrics()
        self.resolved: list | None = None  # chunk items after fetching (ChunkKV or token ids)
        self.seq: PagedSequence | None = None
        self.detok: Detokenizer | None = None  # the generated tokens and text (set by the engine)
        self.next_token: int | None = None
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.prefill_stats: dict = {}
        #: the first prefill's hook for the finished answer (the KV tree's commit, :func:`exact_prefill`)
        self.on_finish: Callable[..., None] | None = None
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.sink = sink
        self.done = threading.Event()

    @property
    def output_ids(self) -> list[int]:
        return self.detok.ids if self.detok is not None else []

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

    @property
    def needs_kv(self) -> bool:
        return self.mode in ("reuse", "blend")

    def emit(self, event: object) -> None:
        if self.sink is not None:
            self.sink(event)

    def ends_stream(self, ev) -> bool:
        """Whether ``ev`` (a token event or this request's output) ends its stream; raises
        :class:`RequestFailedError` when the output says it failed."""
        if not isinstance(ev, RequestOutput):
            return False
        if ev.finish_reason == "error":
            raise RequestFailedError(f"request {ev.request_id} failed: {ev.error}") from self.error
        return True

    def output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.text,
            list(self.output_ids),
            self.finish_reason or "",
            self.metrics,
            None if self.error is None else f"{type(self.error).__name__}: {self.error}",
            self.prefill_stats,
        )


class RequestHandle:
    """What ``submit`` returns: stream tokens, wait for the result, or cancel.

    When the engine runs no background loop, reading the stream drives ``engine.step()`` itself.
    """

    def __init__(self, engine, request: Request):
        self._engine = engine
        self.request = request
        self._events: queue.Queue = queue.Queue()
        request.sink = self._events.put

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def _next(self, timeout: float | None, poll: Callable[[], None] | None = None):
        while True:
            try:
                return self._events.get_nowait()
            except queue.Empty:
                pass
            if poll is not None:
                poll()
            if self._engine.background_running:
                try:
                    return self._events.get(timeout=0.05 if timeout is None else timeout)
                except queue.Empty:
                    if timeout is not None:
                        raise TimeoutError(f"no event from {self.request_id} within {timeout}s") from None
                    continue
            if not self._engine.step():
                self._engine.wait_for_work(0.005)

    def stream(
        self, timeout: float | None = None, poll: Callable[[], None] | None = None
    ) -> Iterator[TokenEvent]:
        """Yield tokens as they are produced; raises :class:`RequestFailedError` if the request failed.
        ``poll()`` runs while waiting (every 50 ms at most): a cancellation check may raise from it."""
        while True:
            ev = self._next(timeout, poll)
            if self.request.ends_stream(ev):
                return
            yield ev

    __iter__ = stream

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the end of the request (draining its stream) and return its output."""
        for _ in self.stream(timeout):
            pass
        return self.request.output()

    def cancel(self) -> None:
        self._engine.cancel(self.request_id)
