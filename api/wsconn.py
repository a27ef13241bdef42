"""One WebSocket connection on the streams' event loop: websockets' Sans-I/O protocol on an asyncio transport.

The opening handshake was checked and accepted on a gunicorn thread (`api/routes/stream.py`); this
side writes the 101 and the frames, answers pings and close frames (the protocol object does), and
tells its owner what happens through three callbacks. Time-based duties (pings, a client that stopped
reading, a close handshake that never completes) are the owner's sweeper's, which reads the
timestamps kept here: one timer for every connection of the process, not a task each.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from websockets.frames import Frame, Opcode
from websockets.protocol import OPEN
from websockets.server import ServerProtocol

# Transport buffer marks: above the high one, nothing more is handed to this connection until the
# kernel took it (`writable`); what a client that stops reading pins is one batch above that.
WRITE_HIGH = 64 * 1024
WRITE_LOW = 16 * 1024


class WsConnection(asyncio.Protocol):
    """A server-side WebSocket connection whose handshake is already accepted (`protocol` holds the 101)."""

    def __init__(self, protocol: ServerProtocol, buffered: bytes, *, on_text: Callable[[bytes], None],
                 on_writable: Callable[[], None], on_lost: Callable[[], None]) -> None:
        self.protocol = protocol
        self.buffered = buffered  # what the client sent behind its handshake request, read by gunicorn
        self.on_text, self.on_writable, self.on_lost = on_text, on_writable, on_lost
        self.transport: asyncio.Transport | None = None
        now = time.monotonic()
        self.heard_at = now  # the last bytes from the client (a pong, a signal, a close)
        self.pinged_at: float | None = None  # a ping waits for its answer since then
        self.paused_at: float | None = None  # the transport's buffer is above WRITE_HIGH since then
        self.closing_at: float | None = None  # our close frame went out then
        self.lost = False

    @property
    def open(self) -> bool:
        return not self.lost and self.protocol.state is OPEN

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH, low=WRITE_LOW)
        self._flush()  # the 101
        if self.buffered:
            self.data_received(self.buffered)
            self.buffered = b""

    def data_received(self, data: bytes) -> None:
        self.heard_at = time.monotonic()
        self.pinged_at = None
        self.protocol.receive_data(data)
        for event in self.protocol.events_received():
            # A signal is one small unfragmented text frame; pings, pongs and closes the protocol answers.
            if isinstance(event, Frame) and event.opcode is Opcode.TEXT and event.fin:
                self.on_text(bytes(event.data))
        self._flush()

    def eof_received(self) -> bool | None:
        self.protocol.receive_eof()
        self._flush()
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.on_lost()

    def pause_writing(self) -> None:
        self.paused_at = time.monotonic()

    def resume_writing(self) -> None:
        self.paused_at = None
        self.on_writable()

    # --- what the owner does -------------------------------------------------------------------

    def send_text(self, data: bytes) -> None:
        """One text frame of `data`, already valid UTF-8 (an event as the worker logged it)."""
        if self.open:
            self.protocol.send_text(data)
            self._flush()

    def ping(self) -> None:
        if self.open and self.pinged_at is None:
            self.pinged_at = time.monotonic()
            self.protocol.send_ping(b"")
            self._flush()

    def close(self, code: int, reason: str = "") -> None:
        """Start the closing handshake; the sweeper aborts it if the client never answers."""
        if self.open:
            self.protocol.send_close(code, reason)
            self._flush()

    def abort(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.abort()

    def _flush(self) -> None:
        assert self.transport is not None
        for data in self.protocol.data_to_send():
            if data:
                self.transport.write(data)
            elif self.transport.can_write_eof():  # websockets' SEND_EOF: half-close
                self.transport.write_eof()
        if self.closing_at is None and self.protocol.close_expected():
            self.closing_at = time.monotonic()
