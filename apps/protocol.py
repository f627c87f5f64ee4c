"""Connection-level limits uvicorn lacks: a deadline for a request's headers.

uvicorn's h11 protocol times out idle keep-alive connections, but a connection that never finishes
sending its request head (slowloris, or hundreds of half-open sockets) is held forever. This protocol
closes a connection whose request head has not arrived ``header_timeout`` seconds after it opened (or
after its previous response). Body reads are timed by ``apps.server.BodyLimitMiddleware``; the
connection cap is uvicorn's ``limit_concurrency``.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ragkv.server")


class HeaderTimeoutH11Protocol(H11Protocol):
    """H11Protocol that closes connections whose request head is late (see the module docstring)."""

    header_timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the head deadline as the connection opens."""
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
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


def header_timeout_protocol(timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class with this head deadline (uvicorn instantiates it per connection)."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": timeout_s})
