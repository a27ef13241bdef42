"""A shell call's events over the WebSocket (contract section 5), resumed where a drop left off.

The stream is a log on the server: a connection that drops is opened again with
`after_seq=<last seq received>`, and the server sends every later event, so nothing is lost; an
event whose seq was already seen is skipped, so nothing is doubled. At the exit event the bytes
received are checked against the server's sha256 of each stream.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import websocket

from runwarden_client.errors import (ConnectionFailed, IntegrityError, RunwardenError, StreamError, TokenExpired,
                                     Unauthorized)
from runwarden_client.results import Event, Exit, Output, parse_event
from runwarden_client.retry import Budget, retry_after, retryable

if TYPE_CHECKING:
    from runwarden_client.client import Client

SIGNALS = ("SIGINT", "SIGTERM", "SIGKILL", "SIGHUP")  # what the server forwards (section 5)
RESUMABLE_CLOSES = {1001, 1011, 1012, 1013, 1014}  # going away, server error, restart, try again later
REVOKED_CLOSE = 4401
_NETWORK_ERRORS = (websocket.WebSocketException, OSError)


def stream_url(http_url: str, task_id: str, after_seq: int) -> str:
    base = "wss://" + http_url.removeprefix("https://") if http_url.startswith("https://") \
        else "ws://" + http_url.removeprefix("http://")
    query = f"?after_seq={after_seq}" if after_seq else ""
    return f"{base}/v1/tool-calls/{quote(task_id, safe='')}/stream{query}"


def connect(client: Client, task_id: str, after_seq: int, budget: Budget) -> websocket.WebSocket:
    """Open the stream, retrying a handshake that got no answer, a 5xx or a 429."""
    url = stream_url(client.url, task_id, after_seq)
    while True:
        try:
            # No Origin header: the server refuses any Origin it was not told to allow.
            return websocket.create_connection(url, timeout=client.timeout, header=[client.authorization],
                                               skip_utf8_validation=True, suppress_origin=True,
                                               enable_multithread=True)
        except websocket.WebSocketBadStatusException as exc:
            error = _handshake_error(exc)
            if not retryable(error.status, error.code):
                raise error from None
            budget.wait(error, retry_after((exc.resp_headers or {}).get("retry-after")))
        except _NETWORK_ERRORS as exc:
            budget.wait(ConnectionFailed(0, "connection_failed", f"stream: {type(exc).__name__}: {exc}"), None)


def _handshake_error(exc: websocket.WebSocketBadStatusException) -> RunwardenError:
    try:
        problem = json.loads(exc.resp_body or b"")
    except ValueError:
        problem = None
    if not isinstance(problem, dict):
        problem = {"code": f"http_{exc.status_code}", "detail": exc.status_message or ""}
    return RunwardenError.from_problem(exc.status_code, problem)


class Stream(Iterator[Event]):
    """Iterate for the events, in order, ending with the `Exit`; `stdout`/`stderr` collect the bytes.

    `signal(name)` may be called from another thread (a signal handler's, say) while this one reads.
    """

    def __init__(self, client: Client, task_id: str, *, call_id: str = "", after_seq: int = 0,
                 replayed: bool = False) -> None:
        self.client, self.task_id, self.call_id, self.replayed = client, task_id, call_id, replayed
        self.last_seq = after_seq
        self.exit: Exit | None = None
        self._verifiable = after_seq == 0  # bytes before after_seq were never seen here
        self._received = {"stdout": bytearray(), "stderr": bytearray()}
        self._ws: websocket.WebSocket | None = None
        self._outage: Budget | None = None  # the retries left while the connection is down

    @property
    def stdout(self) -> bytes:
        return bytes(self._received["stdout"])

    @property
    def stderr(self) -> bytes:
        return bytes(self._received["stderr"])

    def __next__(self) -> Event:
        if self.exit is not None:
            self.close()
            raise StopIteration
        while True:
            event = self._receive()
            if event is None or event.seq <= self.last_seq:
                continue
            self.last_seq = event.seq
            if isinstance(event, Output):
                self._received.setdefault(event.stream, bytearray()).extend(event.data)
            else:
                self.exit = event
                self.close()
                self._verify(event)
            return event

    def _receive(self) -> Event | None:
        ws = self._ws
        if ws is None:
            self._outage = self._outage or Budget(self.client.policy)
            ws = self._ws = connect(self.client, self.task_id, self.last_seq, self._outage)
        try:
            opcode, data = ws.recv_data(control_frame=True)
        except (websocket.WebSocketTimeoutException, TimeoutError):
            self.close()  # silent for `timeout` s, perhaps a dead connection: ask again from the last seq
            return None
        except _NETWORK_ERRORS as exc:  # dropped or silent too long: resume after the last seq
            self._dropped(ConnectionFailed(0, "connection_failed", f"stream: {type(exc).__name__}: {exc}"))
            return None
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            self._closed(data)
            return None
        if opcode != websocket.ABNF.OPCODE_TEXT:
            return None
        self._outage = None
        message = json.loads(data.decode("utf-8"))
        return parse_event(message) if isinstance(message, dict) else None

    def _dropped(self, error: RunwardenError) -> None:
        self.close()
        self._outage = self._outage or Budget(self.client.policy)
        self._outage.wait(error, None)

    def _closed(self, frame: bytes) -> None:
        code = int.from_bytes(frame[:2], "big") if len(frame) >= 2 else 1005
        reason = frame[2:].decode("utf-8", "replace")
        error = StreamError(0, "stream_error", f"the stream closed ({code} {reason}) before its exit event")
        if code in RESUMABLE_CLOSES:
            self._dropped(error)
            return
        self.close()
        if code == REVOKED_CLOSE:
            raise Unauthorized(401, "unauthorized", "the token was revoked")
        if reason == "token expired":
            raise TokenExpired(401, "token_expired", "the token expired while streaming")
        raise error

    def _verify(self, exit: Exit) -> None:
        if not self._verifiable:
            return
        for name, expected in (("stdout", exit.stdout_sha256), ("stderr", exit.stderr_sha256)):
            if expected is not None and hashlib.sha256(self._received[name]).hexdigest() != expected:
                raise IntegrityError(0, "integrity_error",
                                     f"{name} of {self.task_id} does not match the server's sha256")

    def signal(self, name: str) -> None:
        """Send a signal to the command's process group, on this stream (or a fresh connection)."""
        if name not in SIGNALS:
            raise ValueError(f"signal must be one of {', '.join(SIGNALS)}")
        ws = self._ws
        if ws is not None:
            try:
                ws.send(signal_message(name))
                return
            except _NETWORK_ERRORS:
                pass  # reconnecting: say it on a connection of its own
        send_signal(self.client, self.task_id, name)

    def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.close(timeout=1)
            except _NETWORK_ERRORS:
                pass

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def signal_message(name: str) -> str:
    return json.dumps({"type": "signal", "signal": name})


# A seq no stream reaches: the server replays nothing and only listens (after_seq allows 12 digits).
_NO_REPLAY = 10**12 - 1


def send_signal(client: Client, task_id: str, name: str) -> None:
    """One signal on a short connection of its own; the server reads it before our close."""
    if name not in SIGNALS:
        raise ValueError(f"signal must be one of {', '.join(SIGNALS)}")
    ws = connect(client, task_id, _NO_REPLAY, Budget(client.policy))
    try:
        ws.send(signal_message(name))
    finally:
        try:
            ws.close(timeout=1)
        except _NETWORK_ERRORS:
            pass


def drain(stream: Stream) -> Exit:
    """Read a stream to its end; its exit event."""
    for _ in stream:
        pass
    assert stream.exit is not None
    return stream.exit

