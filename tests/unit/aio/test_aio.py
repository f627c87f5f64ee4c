"""The one thread-to-async bridge (ragkv.aio): order, errors, early stop, one thread and one context."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from ragkv.aio import ThreadItems, iterate_in_thread

SCOPE: contextvars.ContextVar[str | None] = contextvars.ContextVar("scope", default=None)


def _collect(make, executor=None) -> list:
    async def run():
        return [x async for x in iterate_in_thread(make, executor)]

    return asyncio.run(run())


def test_items_arrive_in_order_and_an_error_after_them():
    def gen():
        yield from range(5)
        raise KeyError("boom")

    got = []

    async def run():
        async for x in iterate_in_thread(gen):
            got.append(x)

    with pytest.raises(KeyError, match="boom"):
        asyncio.run(run())
    assert got == [0, 1, 2, 3, 4]


def test_the_iterator_stays_in_one_thread_and_one_context():
    """A generator holding a context-variable scope across its yields (ragkv.blend.spans.cancel_scope)
    works: per-item thread hops (Starlette's iterate_in_threadpool) fail with 'created in a different
    Context'. The caller's executor runs it (the service's admission pool)."""

    def gen():
        token = SCOPE.set("inside")
        try:
            for i in range(50):
                yield (i, threading.current_thread().name, SCOPE.get())
        finally:
            SCOPE.reset(token)

    with ThreadPoolExecutor(1, thread_name_prefix="bridge-test") as pool:
        got = _collect(gen, pool)
    assert [i for i, _, _ in got] == list(range(50))
    assert {(name.startswith("bridge-test"), scope) for _, name, scope in got} == {(True, "inside")}


def test_a_consumer_that_stops_early_stops_and_closes_the_producer():
    closed = threading.Event()
    produced = []

    def gen():
        try:
            i = 0
            while True:
                produced.append(i)
                yield i
                i += 1
        finally:
            closed.set()

    async def run():
        agen = iterate_in_thread(gen)
        first = [await agen.__anext__() for _ in range(3)]
        await agen.aclose()
        return first, await asyncio.to_thread(closed.wait, 60)

    first, was_closed = asyncio.run(run())
    assert first == [0, 1, 2] and was_closed


def test_get_with_a_timeout_and_the_end_of_the_stream():
    async def run():
        items: ThreadItems[int] = ThreadItems()
        with pytest.raises(TimeoutError):
            await items.get(0.01)  # nothing handed over yet
        threading.Thread(target=lambda: (items.put(7), items.finish())).start()
        first = await items.get(60)
        with pytest.raises(StopAsyncIteration):
            await items.get(60)
        return first

    assert asyncio.run(run()) == 7


def test_put_after_the_receiver_closed_says_nobody_listens():
    async def run():
        items: ThreadItems[int] = ThreadItems()
        items.close()
        return items.put(1)

    assert asyncio.run(run()) is False
