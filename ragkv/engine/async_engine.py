"""asyncio front end: the engine steps in its background thread; tokens reach the loop through the
core's one thread-to-async bridge (:class:`ragkv.aio.ThreadItems`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ragkv.aio import ThreadItems
from ragkv.engine.engine import Engine, EngineConfig
from ragkv.engine.request import Request, RequestOutput
from ragkv.generate import TokenEvent


class AsyncRequestHandle:
    """``async for token in handle`` streams; ``await handle.result()`` waits; ``await handle.cancel()``."""

    def __init__(self, engine: Engine, request: Request):
        """Made on the event loop (the bridge binds to the running loop)."""
        self._engine = engine
        self.request = request
        self._items: ThreadItems = ThreadItems()
        request.sink = self._items.put

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def stream(self) -> AsyncIterator[TokenEvent]:
        async for ev in self._items:
            if self.request.ends_stream(ev):
                return
            yield ev

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self.stream()

    async def result(self) -> RequestOutput:
        async for _ in self.stream():
            pass
        return self.request.output()

    async def cancel(self) -> bool:
        return await asyncio.to_thread(self._engine.cancel, self.request_id)


class AsyncEngine:
    """Wraps :class:`Engine` for asyncio servers; ``submit`` never blocks on a running step."""

    def __init__(self, model_or_engine, config: EngineConfig | None = None, store=None, resolver=None):
        self.engine = (
            model_or_engine
            if isinstance(model_or_engine, Engine)
            else Engine(model_or_engine, config, store, resolver=resolver)
        )

    async def submit(self, prefix=(), chunks=(), question=(), params=None, **kw) -> AsyncRequestHandle:
        """Queue a request (see :meth:`Engine.submit`); raises ``EngineBusyError`` past the queue limit."""
        self.engine.start()
        req = self.engine.make_request(prefix, chunks, question, params, **kw)
        handle = AsyncRequestHandle(self.engine, req)
        self.engine.enqueue(req)
        return handle

    async def generate(self, prefix=(), chunks=(), question=(), params=None, **kw) -> RequestOutput:
        handle = await self.submit(prefix, chunks, question, params, **kw)
        return await handle.result()

    async def stream(self, prefix=(), chunks=(), question=(), params=None, **kw) -> AsyncIterator[TokenEvent]:
        handle = await self.submit(prefix, chunks, question, params, **kw)
        try:
            async for ev in handle:
                yield ev
        finally:
            if handle.request.finish_reason is None:  # the consumer stopped early: free its KV
                await handle.cancel()

    async def cancel(self, request_id: str) -> bool:
        return await asyncio.to_thread(self.engine.cancel, request_id)

    def metrics(self):
        return self.engine.metrics()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
