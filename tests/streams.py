"""A WebSocket client for tests: collects a call's events and checks the stream's invariants."""
from __future__ import annotations

import base64
import json
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
