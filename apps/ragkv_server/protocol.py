"""Connection-level limits uvicorn lacks: a deadline for a request's headers, and a cap on
connections waiting to send one.

uvicorn's h11 protocol times out idle keep-alive connections, but a connection that never finishes
sending its request head (slowloris, or hundreds of half-open sockets) is held forever. This protocol
closes a connection whose request head has not arrived ``header_timeout`` seconds after it opened (or
after its previous response), and keeps at most ``max_pending`` connections in that state: one more
closes the oldest of them. So half-open sockets never fill uvicorn's connection cap
(``limit_concurrency``, which answers 503 beyond it) and a client that sends its request at once
(``/healthz``, any real client) is served. Body reads are timed by ``ragkv_server.middleware.BodyLimitMiddleware``.
"""

from __future__ import annotations

import asyncio
import logging

from cachetools import LRUCache
from uvicorn.protocols.http.h11_impl import H11Protocol

from ragkv.rag import WarnThrottle

log = logging.getLogger("ragkv.server")


class PendingHeads(LRUCache):
    """Connections waiting for a request head, the least recently armed first; past ``maxsize`` the
    oldest is closed (cachetools evicts through :meth:`popitem`)."""

    def popitem(self):
        key, oldest = super().popitem()
        oldest._disarm()
        if not oldest.transport.is_closing():
            oldest.warn.warning(
                "pending", "over %d connections without a request head: closing the oldest", self.maxsize
            )
            oldest.transport.close()
        return key, oldest


class HeaderTimeoutH11Protocol(H11Protocol):
    """H11Protocol that closes connections whose request head is late (see the module docstring)."""

    header_timeout: float = 10.0
    max_pending: int = 64
    #: connections waiting for a request head, oldest first (per server: see header_timeout_protocol)
    pending: PendingHeads = PendingHeads(max_pending)
    warn: WarnThrottle = WarnThrottle(log)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the head deadline as the connection opens."""
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)
        self.pending[id(self)] = self  # past max_pending the oldest is closed (PendingHeads.popitem)

    def _disarm(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None
        self.pending.pop(id(self), None)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self.pending.pop(id(self), None)
        if not self.transport.is_closing():
            log.info("closing a connection whose request head took over %.1f s", self.header_timeout)
            self.transport.close()

    def handle_events(self) -> None:
        """Disarm once a request's head has been parsed (uvicorn then starts a request cycle)."""
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:
            self._disarm()

    def on_response_complete(self) -> None:
        """The next request's head gets the same deadline (keep-alive idleness is uvicorn's own)."""
        self._arm()  # first: a pipelined request parsed inside super() disarms it again
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def header_timeout_protocol(timeout_s: float, max_pending: int = 64) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class with this head deadline and cap (uvicorn instantiates it per connection)."""
    attrs = {
        "header_timeout": timeout_s,
        "max_pending": max_pending,
        "pending": PendingHeads(max_pending),
        "warn": WarnThrottle(log),
    }
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), attrs)
