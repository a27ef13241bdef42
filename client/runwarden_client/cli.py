"""`runwarden call read|patch|sh` (also `runwarden-call` where only the client is installed).

`sh` behaves like `ssh HOST COMMAND`: the words are joined with spaces and run by the sandbox's
bash; stdout and stderr arrive live and byte for byte on this process's own; Ctrl-C (and SIGTERM,
SIGHUP) reaches the command's process group; the exit status is the command's (128+N for signal N).
Exit status 2 is a usage error, 1 a refusal or failure of runwarden itself (printed as `code: detail`).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import BinaryIO

from runwarden_client.client import Client
from runwarden_client.errors import BaseShaMismatch, RunwardenError
from runwarden_client.results import ZERO_SHA, Output
from runwarden_client.stream import Stream

DEFAULT_URL = "http://127.0.0.1:8080"  # where `runwarden dev` listens
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
USAGE, REFUSED = 2, 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `read`, `patch` and `sh` subcommands, under `parser`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=None, help=f"API base URL (default: $RUNWARDEN_URL, else {DEFAULT_URL})")
    common.add_argument("--token", default=None, help="bearer token (default: $RUNWARDEN_TOKEN)")
    calls = parser.add_subparsers(dest="call_command", required=True)
    read = calls.add_parser("read", parents=[common], help="print a file's bytes, exactly")
    read.add_argument("path")
    read.add_argument("--sha", action="store_true", help="print the file's git blob sha instead")
    patch = calls.add_parser("patch", parents=[common], help="apply a unified diff to one file")
    patch.add_argument("path")
    patch.add_argument("--diff", required=True, help="file holding the diff ('-': standard input)")
    base = patch.add_mutually_exclusive_group(required=True)
    base.add_argument("--base-sha", help="the file's git blob sha the diff was made against (read --sha)")
    base.add_argument("--create", action="store_true", help="the file must not exist yet")
    sh = calls.add_parser("sh", parents=[common], help="run a command in the sandbox, like ssh")
    sh.add_argument("--timeout-ms", type=int, default=None)
    sh.add_argument("--cwd", default=None, help="relative directory of the workspace")
    sh.add_argument("words", nargs="+", metavar="COMMAND", help="the command and its words (after --)")


def run(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("RUNWARDEN_TOKEN")
    if not token:
        print("runwarden: give --token or set RUNWARDEN_TOKEN", file=sys.stderr)
        return USAGE
    client = Client(args.url or os.environ.get("RUNWARDEN_URL") or DEFAULT_URL, token)
    try:
        if args.call_command == "read":
            return _read(client, args)
        if args.call_command == "patch":
            return _patch(client, args)
        return _sh(client, args)
    except RunwardenError as exc:
        extra = f" (current_sha {exc.current_sha})" if isinstance(exc, BaseShaMismatch) else ""
        print(f"runwarden: {exc.code}: {exc.detail}{extra}", file=sys.stderr)
        return REFUSED
    except KeyboardInterrupt:  # before the command ran (or while asking): nothing to forward
        return 128 + signal.SIGINT


def _read(client: Client, args: argparse.Namespace) -> int:
    result = client.read_file(args.path)
    if args.sha:
        print(result.sha)
    else:
        _write(sys.stdout.buffer, result.content)
    return 0


def _patch(client: Client, args: argparse.Namespace) -> int:
    try:
        raw = sys.stdin.buffer.read() if args.diff == "-" else Path(args.diff).read_bytes()
        diff = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"runwarden: cannot use {args.diff} as a diff: {exc}", file=sys.stderr)
        return USAGE
    result = client.apply_patch(args.path, diff, base_sha=ZERO_SHA if args.create else args.base_sha)
    shown = {k: v for k, v in asdict(result).items() if k in ("path", "base_sha", "new_sha", "created", "deleted")}
    print(json.dumps(shown))
    return 0


def _sh(client: Client, args: argparse.Namespace) -> int:
    stream = client.stream(" ".join(args.words), timeout_ms=args.timeout_ms, cwd=args.cwd)
    sinks = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
    with stream, _forwarding_signals(stream):
        for event in stream:
            if isinstance(event, Output):
                _write(sinks.get(event.stream, sys.stderr.buffer), event.data)
    exit = stream.exit
    assert exit is not None
    if exit.exit_code is None:  # it never ran to an exit: failed (no sandbox) or lost (its worker died)
        print(f"runwarden: the call ended {exit.status} without an exit code", file=sys.stderr)
        return REFUSED
    return exit.exit_code


def _write(sink: BinaryIO, data: bytes) -> None:
    sink.write(data)
    sink.flush()


@contextmanager
def _forwarding_signals(stream: Stream) -> Iterator[None]:
    """While the command runs, a signal to this process is sent to it instead. The send runs on a
    thread of its own: the handler interrupts the reading thread, which may hold the socket's lock."""
    def send(name: str) -> None:
        try:
            stream.signal(name)
        except RunwardenError as exc:
            print(f"runwarden: could not forward {name}: {exc.code}: {exc.detail}", file=sys.stderr)

    def forward(signum: int, _frame: object) -> None:
        threading.Thread(target=send, args=(signal.Signals(signum).name,), daemon=True).start()

    previous = {number: signal.signal(number, forward) for number in FORWARDED}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runwarden-call", description="One runwarden tool call from a shell.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
