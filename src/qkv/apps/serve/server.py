"""The HTTP server under the app: uvicorn's h11 protocol with a deadline for each request.

uvicorn times out idle keep-alive connections only: a client that opens a connection and
sends half its headers (or half its body) holds it for ever, and a few hundred such
clients exhaust the process. :class:`TimedH11Protocol` closes a connection whose request
(headers and body) has not arrived in full :data:`~qkv.apps.serve.limits.READ_TIMEOUT_S`
seconds after its first byte (or after the connection opened), answering 408 when it can.
The app's own work (a long computation) is not bounded by it.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from qkv.apps.serve import limits

__all__ = ["TimedH11Protocol"]

log = logging.getLogger("qkv.apps.serve")
# h11 states in which the client still owes us (part of) a request.
_RECEIVING = (h11.IDLE, h11.SEND_BODY)


def _timeout_response() -> bytes:
    body = json.dumps({"error": f"request not received in full within "
                                f"{limits.READ_TIMEOUT_S:g} s"}).encode()  # fmt: skip
    head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body))  # fmt: skip
    return head + body


class TimedH11Protocol(H11Protocol):
    """:class:`~uvicorn.protocols.http.h11_impl.H11Protocol` with a read deadline per request."""

    _deadline: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(limits.READ_TIMEOUT_S, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _watch(self) -> None:
        """Deadline on while the client owes a request, off once it has arrived."""
        if self.conn.their_state not in _RECEIVING or self.transport.is_closing():
            self._disarm()
        elif self._deadline is None:
            self._arm()

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self.conn.their_state not in _RECEIVING:
            return
        log.info("closing a connection from %s: request not received in %g s", self.client,
                 limits.READ_TIMEOUT_S)  # fmt: skip
        # Part of the headers came and no response has begun: say why. Mid-body the app may
        # be answering already, so the connection just closes.
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self.transport.write(_timeout_response())
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # an opened connection must send its request too

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            self._arm()  # a new request begins: the full time from its first byte
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()  # a pipelined request may be under way; idle is uvicorn's keep-alive

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
