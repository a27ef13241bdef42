"""How gunicorn serves the API: `gunicorn --worker-class api.server.Worker 'api.app:create_app()'`.

The worker is gunicorn's gthread worker (a thread per request) with these changes:

- **A bound on receiving a request** (`RUNWARDEN_REQUEST_TIMEOUT`). gthread reads a request's headers
  and body with blocking reads that never time out (`--timeout 0`, as streams are long-lived), so a
  client that stopped mid-request held a thread for ever. Here every read of a request is bounded by
  the time left to it, counted from its first read until the application returns. A stall in the
  headers is answered 408 by the server; a stall in the body reaches the application as
  `RequestTimedOut` (an HTTP 408), which answers it as problem+json. Idle kept-alive connections wait
  in gthread's poller and WebSockets read the socket directly, so neither is affected, nor is a
  request the application takes long to answer (`Prefer: wait=60`): it reads nothing meanwhile.
  A route that receives large bodies (a workspace upload) gives its request a longer bound
  (`allow_request_time`, RUNWARDEN_UPLOAD_TIMEOUT).
- **Refusals as problem+json.** gunicorn answers a request it cannot parse (400, 414, 431…) with an
  HTML page; contract section 7 wants problem+json with a `code` (shared/errors.py).
- **No trust in forwarding headers.** gunicorn believes `X-Forwarded-Proto` (and `SCRIPT_NAME`
  headers) from 127.0.0.1 by default; here only the application's ProxyFix does, and only for
  `RUNWARDEN_TRUSTED_PROXIES` hops.
- **Connections closed on their own thread.** gthread closes a connection it does not keep alive on
  its event loop, lingering up to 2 s for the client's FIN (RFC 9112 §9.6), and serves no other
  connection meanwhile: every client that does not close would freeze the server for 2 s. Here that
  linger runs on the request's thread, and a connection whose request timed out is closed at once.
- **Streams leave the thread pool.** A WebSocket handshake accepted by the application `detach`es
  its connection: gunicorn neither answers nor closes it, and the process's stream server
  (`api/streams.py`) serves it on its event loop. The thread is free once the handshake is checked.
- **SIGTERM drains.** The worker closes its listening sockets at once (a new connection is refused,
  not left in the backlog), finishes its requests as gthread does, and waits for the stream
  server's drain (RUNWARDEN_DRAIN_S, then 1001) before it exits. gunicorn's `--graceful-timeout`
  must exceed RUNWARDEN_DRAIN_S by a few seconds, or the arbiter kills the worker first.
"""
from __future__ import annotations

import errno
import json
import socket
import ssl
import threading
import time
from http import HTTPStatus
from typing import Any

from gunicorn import util
from gunicorn.http.errors import (
    ConfigurationProblem,
    ExpectationFailed,
    InvalidResponseHeader,
    InvalidResponseHeaderName,
    LimitRequestHeaders,
    LimitRequestLine,
    ParseException,
    UnsupportedTransferCoding,
)
from gunicorn.http.parser import RequestParser
from gunicorn.http.unreader import SocketUnreader
from flask import Flask, Response
from gunicorn.workers import gthread
from werkzeug.exceptions import RequestTimeout as HTTPRequestTimeout

from api.problems import problem_response
from shared import errors

DEFAULT_REQUEST_TIMEOUT_S = 15  # for an application that is not runwarden's (the benchmark's floor)


class RequestTimedOut(HTTPRequestTimeout):
    """A read of the request after its time was up. An HTTP exception, not an OSError: werkzeug's
    input stream turns any OSError into a 400 "client disconnected", which this is not."""


class RequestClock:
    """The time left to receive the request being read; no bound once the application returned."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.allowed_s = timeout_s  # this request's bound: timeout_s, unless the application allows more
        self.running = False
        self.expired = False
        self.deadline: float | None = None

    def restart(self) -> None:
        self.running, self.expired, self.deadline, self.allowed_s = True, False, None, self.timeout_s

    def allow(self, timeout_s: float) -> None:
        """Bound this request by `timeout_s` from its first read instead."""
        if self.deadline is not None:
            self.deadline += timeout_s - self.allowed_s
        self.allowed_s = timeout_s

    def stop(self) -> None:
        self.running = False

    def left(self) -> float | None:
        """Seconds left (started by the request's first read), None when unbounded."""
        if not self.running:
            return None
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.allowed_s
        return self.deadline - now

    def expire(self) -> RequestTimedOut:
        self.expired = True
        return RequestTimedOut()


class TimedUnreader(SocketUnreader):
    """gunicorn's socket reader, each read bounded by the time left to its request."""

    def __init__(self, sock: Any, clock: RequestClock) -> None:
        super().__init__(sock)
        self.clock = clock

    def chunk(self, size_hint: int | None = None) -> bytes:
        left = self.clock.left()
        if left is None:
            return super().chunk(size_hint)
        if left <= 0:
            raise self.clock.expire()
        prior = self.sock.gettimeout()  # gunicorn's body drain sets its own
        self.sock.settimeout(left if prior is None else min(left, prior))
        try:
            return super().chunk(size_hint)
        except TimeoutError:
            if (self.clock.left() or 0) > 0:
                raise  # the drain's own timeout, not ours
            raise self.clock.expire() from None
        finally:
            self.sock.settimeout(prior)


class Connection(gthread.TConn):
    """gthread's connection, reading through a TimedUnreader, closed only once, and never once it was
    detached (its socket is the stream server's)."""

    def __init__(self, cfg: Any, sock: Any, client: Any, server: Any, timeout_s: float) -> None:
        super().__init__(cfg, sock, client, server)
        self.clock = RequestClock(timeout_s)
        self.closed = False
        self.detached = False

    def init(self) -> None:
        fresh = self.parser is None
        super().init()
        unreader = getattr(self.parser, "unreader", None)
        # HTTP/1 only, and only while it holds nothing (an h2c preface read ahead stays as it is).
        if (fresh and unreader is not None and type(self.parser) is RequestParser and type(unreader) is SocketUnreader
                and not unreader.buf.getvalue()):
            self.parser.unreader = TimedUnreader(self.sock, self.clock)

    def close(self, graceful: bool = False) -> None:
        if not self.closed and not self.detached:  # closed by its thread already, then again by gthread's loop
            self.closed = True
            super().close(graceful)


_handling = threading.local()  # the clock of the request this thread is handling


def allow_request_time(timeout_s: float) -> None:
    """Let the request being handled take `timeout_s` (from its first read) to arrive whole; for a
    route whose bodies are large. Nothing happens under another server (tests, the benchmark's floor)."""
    clock = getattr(_handling, "clock", None)
    if clock is not None:
        clock.allow(timeout_s)


class HandedOver(Response):
    """What a view returns once it `detach`ed its connection: gunicorn writes nothing and forgets the
    connection (the worker catches what this raises)."""

    def __call__(self, environ: Any, start_response: Any) -> Any:
        raise _Detached()


class _Detached(Exception):
    pass


_serving = threading.local()  # the Connection whose request this thread is serving


def detach(environ: dict[str, Any]) -> tuple[socket.socket, bytes]:
    """Take the connection of the request being served away from gunicorn: its socket, and what the
    client sent behind the request that gunicorn already read. The view then returns HandedOver()."""
    conn: Connection | None = getattr(_serving, "conn", None)
    if conn is None or conn.sock is not environ.get("gunicorn.socket") or conn.is_http2:
        raise errors.Unavailable("This server cannot hand streams over (serve the API with api.server.Worker).")
    if isinstance(conn.sock, ssl.SSLSocket):  # its TLS state cannot move to the event loop
        raise errors.Unavailable("Streams need TLS terminated in front of gunicorn, not by it.")
    conn.detached = True
    sock = conn.sock
    assert isinstance(sock, socket.socket)
    return sock, conn.parser.unreader.take_buffered()


class Worker(gthread.ThreadWorker):
    """gthread with the changes the module docstring lists."""

    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    runtime: Any = None  # runwarden's Runtime, once the application is loaded

    def init_process(self) -> None:
        # This process's copy of the configuration. Trusting no peer would be enough, but a peer on
        # a Unix socket is always trusted, so the headers trust would grant are emptied too.
        for name, value in (("forwarded_allow_ips", ""), ("secure_scheme_headers", {}), ("forwarder_headers", "")):
            self.cfg.set(name, value)
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        self.runtime = getattr(self.wsgi, "extensions", {}).get("runwarden")
        if self.runtime is not None:
            self.request_timeout_s = self.runtime.settings.request_timeout_s

    def handle_exit(self, sig: Any, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if self.runtime is not None:
            self.runtime.streams.begin_drain()

    def set_accept_enabled(self, enabled: bool) -> None:
        super().set_accept_enabled(enabled)
        if not enabled and not self.alive:
            # Stopping: gthread would keep its copy of each listening socket open until it exits, so
            # connections would wait in the backlog, unanswered, for the whole drain. Closed, they
            # are refused at once (the arbiter closed its own copies already) and go to another pod.
            for listener in self.sockets:
                listener.close()

    def run(self) -> None:
        super().run()
        if self.runtime is not None:
            self.runtime.streams.begin_drain()  # the arbiter may also stop us without SIGTERM
            if not self.runtime.streams.wait_drained():
                self.log.warning("streams still open at the end of the drain")

    def accept(self, listener: Any) -> None:
        """gthread's own, making a `Connection`."""
        try:
            client_sock, client_addr = listener.accept()
            self.nr_conns += 1
            client_sock.setblocking(True)
            conn = Connection(self.cfg, client_sock, client_addr, listener.getsockname(), self.request_timeout_s)
            self.enqueue_req(conn)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise

    def handle(self, conn: Connection) -> Any:
        conn.clock.restart()
        result = super().handle(conn)
        if result is False:
            # Here rather than on the event loop; a client that stalled has nothing left to drain.
            conn.close(graceful=not conn.clock.expired)
        return result

    def handle_request(self, req: Any, conn: Connection) -> Any:
        _handling.clock = conn.clock
        _serving.conn = conn
        try:
            return super().handle_request(req, conn)
        except _Detached:
            return False  # the stream server has it: nothing to write, nothing to keep alive
        finally:
            _handling.clock = None
            _serving.conn = None
            conn.clock.stop()  # later reads are gthread's drain of an unread body, bounded by it

    def handle_error(self, req: Any, client: Any, addr: Any, exc: BaseException) -> None:
        problem = refusal(exc)
        if problem is None:
            self.log.exception("Error handling request")
            problem = errors.InternalError("An unexpected error occurred; it has been logged.")
        else:
            self.log.warning("Refused a request from %s: %s", (addr or ("",))[0], type(exc).__name__)
        try:
            util.write_nonblock(client, problem_bytes(problem))
        except Exception:
            self.log.debug("Failed to send error message.")


# What the server answers for a request it could not read; None: not the client's fault (a 500).
_REFUSALS: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], type[errors.RunwardenError] | None], ...] = (
    (RequestTimedOut, errors.RequestTimeout),
    (LimitRequestLine, errors.UriTooLong),
    (LimitRequestHeaders, errors.RequestHeaderTooLarge),
    (ExpectationFailed, errors.ExpectationFailed),
    (UnsupportedTransferCoding, errors.TransferCodingNotImplemented),
    ((InvalidResponseHeader, InvalidResponseHeaderName, ConfigurationProblem), None),
    ((ParseException, ssl.SSLError), errors.BadRequest),
)


def init_app(app: Flask) -> None:
    """A body gunicorn cannot parse (a malformed chunk) raises inside the application as it reads."""
    @app.errorhandler(ParseException)
    def malformed_body(error: ParseException) -> Response:
        return problem_response(refusal(error) or errors.InternalError("The server failed to read the request."))


def refusal(exc: BaseException) -> errors.RunwardenError | None:
    for kinds, problem in _REFUSALS:
        if isinstance(exc, kinds):
            return problem() if problem else None
    return None


def problem_bytes(problem: errors.RunwardenError) -> bytes:
    """A whole HTTP/1.1 response carrying `problem`, after which the connection closes."""
    body = json.dumps(problem.problem(), separators=(",", ":")).encode()
    head = (f"HTTP/1.1 {problem.status} {HTTPStatus(problem.status).phrase}\r\nConnection: close\r\n"
            f"Content-Type: application/problem+json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body
