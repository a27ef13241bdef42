"""A TCP proxy in front of the API that makes the network misbehave on purpose, for the client's tests.

One request per connection (it asks the API to close after answering), so every fault hits one
request. Faults, each used up as it strikes:
- `drop_answers`: once the request has been forwarded whole and the API's answer begins, close
  both sides without passing a byte of it (the call ran; the client never heard);
- `cut_streams`: pass a WebSocket's handshake and its first frame, then close both sides;
- `canned`: answer a request with these bytes instead of forwarding it;
- `tamper`: replace bytes (same length) in what the API sends on a WebSocket.
`heads` keeps every request head received; `log` what happened and when (monotonic seconds).
"""
from __future__ import annotations

import json
import re
import socket
import threading
import time


def problem_answer(status: int, code: str, retry_after: int) -> bytes:
    body = json.dumps({"type": "about:blank", "status": status, "code": code, "detail": "from the test proxy"})
    reason = {429: "Too Many Requests", 503: "Service Unavailable"}.get(status, "Error")
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/problem+json\r\nRetry-After: {retry_after}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}").encode()


def frame_end(buf: bytes | bytearray, start: int) -> int | None:
    """Where the (unmasked, server-sent) WebSocket frame beginning at `start` ends, once it is whole."""
    if len(buf) < start + 2:
        return None
    length, offset = buf[start + 1] & 0x7F, start + 2
    if length in (126, 127):
        size = 2 if length == 126 else 8
        if len(buf) < offset + size:
            return None
        length, offset = int.from_bytes(buf[offset:offset + size], "big"), offset + size
    return offset + length if len(buf) >= offset + length else None


def _read_request(sock: socket.socket) -> tuple[bytes, bytes] | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    found = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    length = int(found.group(1)) if found else 0
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        body += chunk
    return head + b"\r\n\r\n", body


def _closing(head: bytes) -> bytes:
    """The head with `Connection: close`, so the API answers one request on this connection."""
    lines = [line for line in head[:-4].split(b"\r\n") if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


def _shut(*socks: socket.socket) -> None:
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


class Proxy:
    def __init__(self, upstream_url: str) -> None:
        host, port = upstream_url.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.drop_answers = 0
        self.cut_streams = 0
        self.canned: list[bytes] = []
        self.tamper: tuple[bytes, bytes] | None = None
        self.heads: list[bytes] = []
        self.log: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        _shut(self.server)

    def note(self, what: str) -> None:
        with self.lock:
            self.log.append((time.monotonic(), what))

    def take(self, fault: str) -> bool:
        """Use up one of a counted fault, if any is left."""
        with self.lock:
            left = getattr(self, fault)
            if left > 0:
                setattr(self, fault, left - 1)
            return bool(left > 0)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        try:
            request = _read_request(client)
            if request is None:
                return
            head, body = request
            with self.lock:
                self.heads.append(head)
                canned = self.canned.pop(0) if self.canned else None
            self.note("request " + head.split(b"\r\n")[0].decode())
            if canned is not None:
                self.note("canned " + canned.split(b"\r\n")[0].decode())  # noted before the client can read it
                client.sendall(canned)
                return
            upstream = socket.create_connection(self.upstream)
            if b"upgrade: websocket" in head.lower():
                self._pipe_websocket(client, upstream, head + body)
            else:
                self._pipe_http(client, upstream, _closing(head) + body)
        except OSError:
            pass
        finally:
            _shut(client, *([upstream] if upstream else []))

    def _pipe_http(self, client: socket.socket, upstream: socket.socket, request: bytes) -> None:
        upstream.sendall(request)
        first = upstream.recv(65536)
        if not first:
            return
        status = first.split(b"\r\n")[0].decode(errors="replace")
        if self.take("drop_answers"):
            self.note("dropped " + status)
            return
        self.note("answer " + status)
        client.sendall(first)
        while chunk := upstream.recv(65536):
            client.sendall(chunk)

    def _pipe_websocket(self, client: socket.socket, upstream: socket.socket, request: bytes) -> None:
        upstream.sendall(request)
        threading.Thread(target=self._forward, args=(client, upstream), daemon=True).start()
        cut, buf = self.take("cut_streams"), bytearray()
        while chunk := upstream.recv(65536):
            if self.tamper and self.tamper[0] in chunk:
                chunk = chunk.replace(*self.tamper)
                self.note("tampered")
            if not cut:
                client.sendall(chunk)
                continue
            buf += chunk  # held back until the handshake and the first frame are whole
            end = frame_end(buf, buf.index(b"\r\n\r\n") + 4) if b"\r\n\r\n" in buf else None
            if end is not None:
                client.sendall(buf[:end])
                self.note("cut a stream after its first frame")
                return

    @staticmethod
    def _forward(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
