"""Server-sent events: a stream's first item taken before the headers, then each item rendered as events.

Errors before the first item surface as an ordinary HTTP error; an error after the headers becomes an
error event (and is logged). Closing the relay closes the stream, which stops a generation that is cut off.
"""

from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from fastapi.responses import StreamingResponse

from ragkv_server import openai_compat as oc
from ragkv_server.errors import report, strict_json

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict | str, event: str | None = None) -> str:
    """One SSE message: strict JSON (or a literal string such as ``[DONE]``), with its event name."""
    payload = data if isinstance(data, str) else strict_json(data)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


async def start_stream(it: AsyncIterator) -> tuple[object | None, bool]:
    """The first item of a stream (errors surface here, before any byte is sent) and whether there is one."""
    try:
        return await it.__anext__(), True
    except StopAsyncIteration:
        return None, False


async def relay(
    it: AsyncIterator,
    first: Any,
    more: bool,
    render: Callable[[Any], Iterator[str]],
    on_error: Callable[[Exception], str],
    head: Iterable[str] = (),
    tail: Iterable[str] = (),
) -> AsyncIterator[str]:
    """``head``, ``render(item)`` for each item from ``first`` on, then ``tail``; an error after the
    headers becomes ``on_error(exc)``. Closes ``it``."""
    item, has = first, more
    try:
        for line in head:
            yield line
        while has:
            for line in render(item):
                yield line
            try:
                item = await it.__anext__()
            except StopAsyncIteration:
                has = False
        for line in tail:
            yield line
    except Exception as e:  # noqa: BLE001 - after the headers, errors become an event
        yield on_error(e)
    finally:
        await it.aclose()


def openai_events(
    it: AsyncIterator,
    first: Any,
    more: bool,
    render: Callable[[Any], Iterator[str]],
    head: Iterable[str] = (),
    path: str = "/v1/chat/completions",
) -> AsyncIterator[str]:
    """An OpenAI SSE stream: ``head``, the rendered items, then ``data: [DONE]``; an error after the
    headers becomes OpenAI's error chunk."""

    def error_chunk(e: Exception) -> str:
        status, kind, message = report(e)
        return sse(oc.stream_error(status, message, kind, path))

    return relay(it, first, more, render, error_chunk, head, (sse("[DONE]"),))


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """The ``text/event-stream`` response of ``events`` (not cached, not buffered by proxies)."""
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
