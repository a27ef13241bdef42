"""A WebSocket client for tests: collects a call's events and checks the stream's invariants."""
from __future__ import annotations

import base64
import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import websocket


@dataclass
class Received:
    events: list[dict[str, Any]] = field(default_factory=list)
    close_code: int | None = None

    def bytes_of(self, stream: str) -> bytes:
        out = bytearray()
        for event in self.events:
            if event["type"] == "output" and event["stream"] == stream:
                out += event["data"].encode() if "data" in event else base64.b64decode(event["data_b64"])
        return bytes(out)

    @property
    def exit(self) -> dict[str, Any]:
        exits = [e for e in self.events if e["type"] == "exit"]
        assert len(exits) == 1, exits
        assert self.events[-1] is exits[0]
        return exits[0]

    def check_sequence(self, first: int = 1) -> None:
        assert [e["seq"] for e in self.events] == list(range(first, first + len(self.events)))


def connect(agent: Any, task_id: str, *, after_seq: int | None = None, token: str | None = None,
            subprotocol: bool = False, timeout: float = 60) -> websocket.WebSocket:
    url = f"{agent.stack.ws_base}/v1/tool-calls/{task_id}/stream"
    if after_seq is not None:
        url += f"?after_seq={after_seq}"
    token = token or agent.token
    if subprotocol:
        return websocket.create_connection(url, subprotocols=[f"bearer.{token}", "runwarden.v1"], timeout=timeout,
                                           skip_utf8_validation=True, suppress_origin=True)
    return websocket.create_connection(url, header=[f"Authorization: Bearer {token}"], timeout=timeout,
                                       skip_utf8_validation=True, suppress_origin=True)


def collect(ws: websocket.WebSocket, *, limit: int | None = None) -> Received:
    """Read until the server closes (or `limit` events), keeping the close code."""
    received = Received()
    while limit is None or len(received.events) < limit:
        opcode, data = ws.recv_data(control_frame=True)
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            received.close_code = int.from_bytes(data[:2], "big") if len(data) >= 2 else None
            break
        if opcode == websocket.ABNF.OPCODE_TEXT:
            received.events.append(json.loads(data.decode("utf-8")))
    return received


def watch(agent: Any, task_id: str, **kwargs: Any) -> Received:
    ws = connect(agent, task_id, **kwargs)
    try:
        return collect(ws)
    finally:
        ws.close()


def raw_upgrade(agent: Any, task_id: str, *, receive_buffer: int | None = None, timeout: float = 30) -> socket.socket:
    """A bare socket that completes the WebSocket handshake and has read nothing of the stream
    (the headers are read byte by byte), for tests that read frames themselves or never read."""
    host, port = agent.stack.base_url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(timeout)
    sock.connect((host, int(port)))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET /v1/tool-calls/{task_id}/stream HTTP/1.1\r\nHost: {host}:{port}\r\n"
                  f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                  f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {agent.token}\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock
