"""The one thread-to-async bridge: a blocking iterator runs in one worker thread, its items arrive on the loop.

Generation is CPU-bound and blocking (the in-process generator, the engine's sink, a vLLM server's
stream); the async surfaces (the service, LangChain's ``astream``, LlamaIndex's ``astream_*``) take
its items on the event loop through :class:`ThreadItems`: an AnyIO memory object stream whose closing
ends the stream (no sentinel) and whose receiver going away stops the producer at its next item.

Why not Starlette's ``iterate_in_threadpool`` (one ``anyio.to_thread.run_sync(next, it)`` per item):
the iterator must stay in ONE thread and ONE context from its first item to its last. A generator
that holds a context-variable scope across its yields (``ragkv.blend.spans.cancel_scope``) fails with
``ValueError: <Token> was created in a different Context`` when each ``next`` runs in a fresh copy of
the context, and the service's admission pool counts a stream as one worker. Items cross with
``loop.call_soon_threadsafe`` (fire and forget) rather than ``anyio.from_thread.run_sync``, which waits
for the loop on every item. Measured per item on the 2-core CPU machine (docs/DECISIONS.md,
"Thread-to-async bridge"): queue 8 us, AnyIO round trip 91 us, ``iterate_in_threadpool`` 178 us.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

import anyio

T = TypeVar("T")


class ThreadItems(Generic[T]):
    """Items a worker thread hands to the event loop (made on the loop; ``put``/``finish`` from the thread)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._send, self._recv = anyio.create_memory_object_stream[Any](math.inf)
        self._error: BaseException | None = None
        #: set once the receiver stopped listening (closed, or the loop is gone): the producer stops
        self.gone = threading.Event()

    # ---- the worker thread's side ----------------------------------------------------------------
    def _call(self, fn: Callable[..., None], *args: Any) -> bool:
        """Run ``fn(*args)`` on the loop soon; False if nobody listens any more."""
        if self.gone.is_set():
            return False
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            self.gone.set()
            return False
        return True

    def _deliver(self, item: T) -> None:
        try:
            self._send.send_nowait(item)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.gone.set()

    def put(self, item: T) -> bool:
        """Hand ``item`` to the loop (never blocks); False once the receiver is gone."""
        return self._call(self._deliver, item)

    def finish(self, error: BaseException | None = None) -> None:
        """End the stream; the receiver raises ``error`` after the items already handed over."""
        self._error = error
        self._call(self._send.close)

    def drain(self, it: Iterator[T], stop: Callable[[], bool] | None = None) -> bool:
        """Hand over ``it``'s items; True when it ended, False when the receiver went or ``stop()``
        said so first (``it`` is then closed). The caller calls :meth:`finish`."""
        for item in it:
            if self.gone.is_set() or (stop is not None and stop()):
                close = getattr(it, "close", None)
                if close is not None:
                    close()
                return False
            self.put(item)
        return True

    # ---- the loop's side -------------------------------------------------------------------------
    async def get(self, timeout: float | None = None) -> T:
        """The next item; TimeoutError after ``timeout`` s without one; StopAsyncIteration at the end
        (the producer's error instead, if it gave one)."""
        try:
            if timeout is None:
                return await self._recv.receive()
            with anyio.fail_after(timeout):
                return await self._recv.receive()
        except anyio.EndOfStream:
            if self._error is not None:
                raise self._error from None
            raise StopAsyncIteration from None

    def __aiter__(self) -> ThreadItems[T]:
        return self

    async def __anext__(self) -> T:
        return await self.get()

    def close(self) -> None:
        """Stop listening: the producer stops at its next item."""
        self.gone.set()
        self._recv.close()


async def iterate_in_thread(
    make_iter: Callable[[], Iterator[T]], executor: Executor | None = None
) -> AsyncIterator[T]:
    """``make_iter()``'s items, computed in one worker thread (``executor``; None: the loop's default).

    When the consumer stops early the producer stops at its next item and its iterator is closed.
    """
    items: ThreadItems[T] = ThreadItems()

    def work() -> None:
        try:
            items.drain(make_iter())
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            items.finish(e)
            return
        items.finish()

    asyncio.get_running_loop().run_in_executor(executor, work)
    try:
        async for item in items:
            yield item
    finally:
        items.close()
