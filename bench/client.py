"""Thin clients: one keep-alive HTTP connection per thread (http.client, little client overhead),
and WebSocket streams via websocket-client, reading events the way a careful client does."""
from __future__ import annotations

import base64
import hashlib
import http.client
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import websocket

from shared import tokens

SCOPES = ["files:read", "files:write", "shell:exec"]


class BenchError(RuntimeError):
    """A measured operation did not give the expected answer."""


class Http:
    """One persistent connection; reconnects once if the server closed an idle keep-alive connection."""

    def __init__(self, base_url: str, timeout: float = 120) -> None:
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.timeout = timeout
        self.conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
        for attempt in (1, 2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self.conn.request(method, path, body=body, headers=headers or {})
                response = self.conn.getresponse()
                data = response.read()
                if response.will_close:
                    self.close()
                return response.status, response.headers, data
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


@dataclass
class Agent:
    """One tenant and run, its token, and the envelope of each call."""

    base_url: str
    secret: str
    tenant: str = field(default_factory=lambda: f"bench{uuid.uuid4().hex[:8]}")
    run_id: str = field(default_factory=lambda: f"run{uuid.uuid4().hex[:8]}")

    def __post_init__(self) -> None:
        self.token = tokens.mint(self.secret.encode(), tenant=self.tenant, run_id=self.run_id, sub="bench",
                                 scopes=SCOPES, paths=["**"], ttl_s=3600)
        parts = urlsplit(self.base_url)
        self.ws_base = f"ws://{parts.netloc}"

    def request(self, tool_name: str, parameters: dict[str, Any], *, key: str | None = None,
                prefer_wait: int | None = None) -> tuple[bytes, dict[str, str]]:
        body = json.dumps({"tool_name": tool_name, "call_id": str(uuid.uuid4()), "parameters": parameters},
                          separators=(",", ":")).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json",
                   "Idempotency-Key": key or uuid.uuid4().hex}
        if prefer_wait:
            headers["Prefer"] = f"wait={prefer_wait}"
        return body, headers

    def post(self, http: Http, tool_name: str, parameters: dict[str, Any], *, expect: int,
             prefer_wait: int | None = None) -> dict[str, Any]:
        body, headers = self.request(tool_name, parameters, prefer_wait=prefer_wait)
        return self.send(http, body, headers, expect=expect)

    def send(self, http: Http, body: bytes, headers: dict[str, str], *, expect: int) -> dict[str, Any]:
        status, _, data = http.request("POST", "/v1/tool-calls", body, headers)
        if status != expect:
            raise BenchError(f"POST {json.loads(body)['tool_name']}: {status} (expected {expect}): {data[:300]!r}")
        return json.loads(data)

    def stream(self, stream_url: str, timeout: float = 120) -> websocket.WebSocket:
        return websocket.create_connection(stream_url, header=[f"Authorization: Bearer {self.token}"],
                                           timeout=timeout, skip_utf8_validation=True, suppress_origin=True)

    def delete(self, http: Http, task_id: str) -> int:
        status, _, _ = http.request("DELETE", f"/v1/tool-calls/{task_id}",
                                    headers={"Authorization": f"Bearer {self.token}"})
        return status


@dataclass
class StreamRead:
    """What one stream delivered: stdout bytes verified against the exit event's size and sha256."""

    events: int = 0
    stdout_bytes: int = 0
    first_output_at: float | None = None
    first_output_bytes: int = 0
    last_output_at: float | None = None
    exit_at: float | None = None
    exit: dict[str, Any] | None = None
    close_code: int | None = None
    seq_ok: bool = True
    sha_ok: bool = False


def read_stream(ws: websocket.WebSocket, *, until_first_output: bool = False) -> StreamRead:
    """Read events until the server closes (or the first output event); check seq and sha256."""
    out, sha, expected_seq = StreamRead(), hashlib.sha256(), 1
    while True:
        opcode, data = ws.recv_data(control_frame=True)
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            out.close_code = int.from_bytes(data[:2], "big") if len(data) >= 2 else None
            break
        if opcode != websocket.ABNF.OPCODE_TEXT:
            continue
        now = time.perf_counter()
        event = json.loads(data)
        out.events += 1
        out.seq_ok &= event.get("seq") == expected_seq
        expected_seq += 1
        if event["type"] == "output":
            piece = event["data"].encode() if "data" in event else base64.b64decode(event["data_b64"])
            if out.first_output_at is None:
                out.first_output_at, out.first_output_bytes = now, len(piece)
            out.last_output_at = now
            if event["stream"] == "stdout":
                out.stdout_bytes += len(piece)
                sha.update(piece)
            if until_first_output:
                return out
        elif event["type"] == "exit":
            out.exit_at, out.exit = now, event
    if out.exit is not None:
        out.sha_ok = (out.exit.get("stdout_sha256") == sha.hexdigest()
                      and out.exit.get("stdout_bytes") == out.stdout_bytes)
    return out
