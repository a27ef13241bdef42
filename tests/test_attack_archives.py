"""Hostile archives against the real stack (contract section 11): every one is 422
archive_rejected naming its member, leaves no workspace (or the replaced one unchanged) and no
staging directory, and writes nothing outside: a marker directory next to the workspaces root
holds a file the archives aim at, which must stay as it was.

A stack of its own, with small limits (50 entries, 64 MiB a workspace), so the limits can be hit
with small archives, and short request bounds: 2 s for a request, 15 s for an upload.
"""
from __future__ import annotations

import os
import shutil
import stat
import tarfile
import socket
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from runwarden import devstack
from shared import keys
from tests.archives import Operator, directory, file, gzip_of_zeros_member, header_only, link, special, tar
from tests.conftest import reachable_workspaces, start_stack
from tests.waiting import wait_until

MAX_FILES = 50
QUOTA = 64 * 1024 * 1024
REQUEST_TIMEOUT_S, UPLOAD_TIMEOUT_S = 2, 15
SECRET = b"the host's own file\n"


@pytest.fixture(scope="module")
def hostile_stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    workspaces = reachable_workspaces()
    marker = workspaces.with_name(workspaces.name + "-outside")
    marker.mkdir(mode=0o777)
    (marker / "secret").write_bytes(SECRET)
    info = start_stack(tmp_path_factory.mktemp("archives"), RUNWARDEN_WORKSPACES=str(workspaces),
                       RUNWARDEN_WORKSPACE_MAX_FILES=str(MAX_FILES), RUNWARDEN_TENANT_WORKSPACE_BYTES=str(QUOTA),
                       RUNWARDEN_REQUEST_TIMEOUT=str(REQUEST_TIMEOUT_S), RUNWARDEN_UPLOAD_TIMEOUT=str(UPLOAD_TIMEOUT_S))
    info.marker = marker  # type: ignore[attr-defined]
    yield info
    info.stack.stop()
    shutil.rmtree(workspaces, ignore_errors=True)
    shutil.rmtree(marker, ignore_errors=True)


@pytest.fixture
def operator(hostile_stack: Any) -> Operator:
    return Operator(hostile_stack, f"t{uuid.uuid4().hex[:10]}")


def outside(stack: Any) -> tuple[str, str]:
    """The marker directory as an absolute path, and as a path relative to a workspace
    (`<root>/<tenant>/<run>`, or a staging directory beside it)."""
    return str(stack.marker), f"../../../{stack.marker.name}"


def hostile(stack: Any) -> list[tuple[str, list[Any], str | None]]:
    """(what it tries, its members, the member the answer must name)."""
    absolute, relative = outside(stack)
    return [
        ("absolute name", [file(f"{absolute}/pwned", b"x")], f"{absolute}/pwned"),
        ("dot-dot name", [file(f"{relative}/pwned", b"x")], f"{relative}/pwned"),
        ("dot-dot inside a name", [directory("a"), file(f"a/../{relative}/pwned", b"x")], f"a/../{relative}/pwned"),
        ("symlink to an absolute path, then a file through it",
         [link("a", absolute), file("a/pwned", b"x")], "a"),
        ("symlink climbing out, then a file through it", [link("a", relative), file("a/pwned", b"x")], "a"),
        ("file written through an inside symlink (a -> . chain)", [link("a", "."), file("a/a/a/pwned", b"x")],
         "a/a/a/pwned"),
        ("directory made through a symlink", [link("a", "."), directory("a/b")], "a/b"),
        # Read lexically, d/s/d/../.. is d; through d/s -> .. (the root) it is the root's parent.
        ("symlink leading out only through another symlink",
         [directory("d"), link("d/s", ".."), link("t", "d/s/d/../..")], "t"),
        ("the same, made before the symlink it goes through",
         [directory("d"), link("t", "d/s/d/../.."), link("d/s", "..")], "t"),
        ("hard link to an absolute path", [link("h", f"{absolute}/secret", tarfile.LNKTYPE)], "h"),
        ("hard link climbing out", [link("h", f"{relative}/secret", tarfile.LNKTYPE)], "h"),
        ("hard link through an inside symlink",
         [file("sub/f", b"x"), link("s", "sub"), link("h", "s/f", tarfile.LNKTYPE)], "h"),
        ("hard link to a symlink", [file("f", b"x"), link("s", "f"), link("h", "s", tarfile.LNKTYPE)], "h"),
        ("character device", [special("null", tarfile.CHRTYPE)], "null"),
        ("block device", [special("disk", tarfile.BLKTYPE)], "disk"),
        ("FIFO", [special("pipe", tarfile.FIFOTYPE)], "pipe"),
        ("a type tar does not know", [special("odd", b"Z")], "odd"),
        ("sparse member", [special("holes", tarfile.GNUTYPE_SPARSE)], "holes"),
        ("a file over a directory", [directory("x"), file("x", b"x")], "x"),
        ("a file named as the root", [file(".", b"x")], "."),
        ("too many files", [file(f"f{i}", b"") for i in range(MAX_FILES + 1)], f"f{MAX_FILES}"),
        ("too many directories on the way", [file("/".join(["d"] * (MAX_FILES + 1)), b"")],
         "/".join(["d"] * (MAX_FILES + 1))),
    ]


def assert_nothing_written(operator: Operator, run_id: str, stack: Any) -> None:
    tenant_dir = operator.path(run_id).parent
    assert not os.path.lexists(operator.path(run_id))
    assert not tenant_dir.exists() or os.listdir(tenant_dir) == []  # no staging directory left either
    assert sorted(os.listdir(stack.marker)) == ["secret"]
    secret = stack.marker / "secret"
    assert secret.read_bytes() == SECRET and secret.stat().st_nlink == 1
    assert run_id not in operator.listing()


def assert_rejected(response: Any, member: str | None) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    assert response.headers["Content-Type"] == "application/problem+json"
    problem = response.json()
    assert problem["code"] == "archive_rejected" and problem["member"] == member, problem
    assert "/tmp/" not in problem["detail"] and "Traceback" not in problem["detail"]
    return problem


def test_every_hostile_archive_is_rejected_and_writes_nothing(hostile_stack: Any, operator: Operator) -> None:
    """Each case as a tar and as a gzipped tar; every case runs, and the failures are listed."""
    failures = []
    for what, members, offending in hostile(hostile_stack):
        for gz in (False, True):
            run_id = f"r{uuid.uuid4().hex[:8]}"
            response = operator.put(run_id, tar(*members, gz=gz), "application/gzip" if gz else "application/x-tar")
            try:
                assert_rejected(response, offending)
                assert_nothing_written(operator, run_id, hostile_stack)
            except AssertionError as exc:
                failures.append(f"{what} ({'gzip' if gz else 'tar'}): {exc}")
    assert not failures, "\n".join(failures)


def test_a_name_holding_nul_is_rejected(hostile_stack: Any, operator: Operator) -> None:
    info, data = file("placeholder", b"x")
    info.pax_headers = {"path": "a\x00b"}  # ustar names end at NUL; a pax path can hold one
    response = operator.put("r-nul", tar((info, data)))
    assert_rejected(response, "a\x00b")
    assert_nothing_written(operator, "r-nul", hostile_stack)


def test_a_rejected_replacement_leaves_the_workspace_as_it_was(hostile_stack: Any, operator: Operator) -> None:
    assert operator.put("r1", tar(file("keep.txt", b"kept\n"), directory("src"))).status_code == 201
    before = operator.listing()["r1"]
    _, relative = outside(hostile_stack)
    response = operator.put("r1", tar(file("new.txt", b"new"), link("a", relative), file("a/pwned", b"x")),
                            replace=True)
    assert_rejected(response, "a")
    assert sorted(os.listdir(operator.path("r1"))) == ["keep.txt", "src"]
    assert (operator.path("r1") / "keep.txt").read_bytes() == b"kept\n"
    assert os.listdir(operator.path("r1").parent) == ["r1"]  # no staging or trash directory beside it
    assert operator.listing()["r1"] == before
    assert sorted(os.listdir(hostile_stack.marker)) == ["secret"]


def test_a_member_declaring_more_than_the_quota_is_refused_before_its_data(hostile_stack: Any,
                                                                            operator: Operator) -> None:
    """The archive holds the header only: had the worker read on for the data, it would have found
    a truncated archive, not a quota."""
    huge = tarfile.TarInfo("huge.bin")
    huge.size = 1 << 40
    problem = assert_rejected(operator.put("r-huge", header_only(huge)), "huge.bin")
    assert "quota" in problem["detail"]
    assert_nothing_written(operator, "r-huge", hostile_stack)


def test_the_sum_of_sizes_is_bounded_by_the_quota(hostile_stack: Any, operator: Operator) -> None:
    half = QUOTA // 2 + 1
    archive = tar(file("a.bin", bytes(half)), file("b.bin", bytes(half)), gz=True)
    problem = assert_rejected(operator.put("r-sum", archive, "application/gzip"), "b.bin")
    assert "quota" in problem["detail"]
    assert_nothing_written(operator, "r-sum", hostile_stack)


def test_a_gzip_bomb_stops_at_the_bound(hostile_stack: Any, operator: Operator) -> None:
    """A valid little archive followed by 1 GiB of zeros (a megabyte gzipped): no member declares
    them, so decompression stops a few MiB in."""
    small = tar(file("ok.txt", b"ok"))
    bomb = gzip_of_trailing_zeros(small, 1 << 30)
    assert len(bomb) < 4 * 1024 * 1024
    problem = assert_rejected(operator.put("r-bomb", bomb, "application/gzip"), None)
    assert "more data than its members declare" in problem["detail"]
    assert_nothing_written(operator, "r-bomb", hostile_stack)


def test_a_huge_extended_header_is_refused_before_it_is_read(hostile_stack: Any, operator: Operator) -> None:
    """tarfile reads a pax header whole into memory: one declaring 1 GiB is refused first."""
    header = tarfile.TarInfo("././@PaxHeader")
    header.type, header.size = tarfile.XHDTYPE, 1 << 30
    bomb = gzip_of_trailing_zeros(header_only(header), 8 * 1024 * 1024)
    problem = assert_rejected(operator.put("r-pax", bomb, "application/gzip"), "././@PaxHeader")
    assert "extended header" in problem["detail"]
    assert_nothing_written(operator, "r-pax", hostile_stack)


def test_a_member_of_zeros_too_big_for_the_quota_is_refused(hostile_stack: Any, operator: Operator) -> None:
    bomb = gzip_of_zeros_member("zeros.bin", 2 * QUOTA)
    assert_rejected(operator.put("r-zeros", bomb, "application/gzip"), "zeros.bin")
    assert_nothing_written(operator, "r-zeros", hostile_stack)


def test_not_an_archive_is_rejected(hostile_stack: Any, operator: Operator) -> None:
    for body, content_type in ((b"definitely not a tar archive" * 40, "application/x-tar"),
                               (b"\x1f\x8b" + b"not gzip" * 10, "application/gzip")):
        response = operator.put("r-junk", body, content_type)
        assert_rejected(response, None)
        assert_nothing_written(operator, "r-junk", hostile_stack)


def test_setuid_and_setgid_bits_are_dropped(hostile_stack: Any, operator: Operator) -> None:
    archive = tar(directory("shared", 0o3777), file("shared/suid", b"#!/bin/sh\n", 0o4755),
                  file("sgid", b"x", 0o2755), file("plain", b"x", 0o640))
    response = operator.put("r-suid", archive)
    assert response.status_code == 201, response.text
    root = operator.path("r-suid")
    modes = {name: stat.S_IMODE(os.lstat(root / name).st_mode) for name in ("shared", "shared/suid", "sgid", "plain")}
    assert modes == {"shared": 0o777, "shared/suid": 0o755, "sgid": 0o755, "plain": 0o640}


def test_symlinks_that_stay_inside_are_kept(hostile_stack: Any, operator: Operator) -> None:
    archive = tar(directory("d"), file("d/f", b"x"), link("d/up", ".."), link("rel", "d/f"),
                  link("dangling", "not/there"), link("h", "d/f", tarfile.LNKTYPE))
    response = operator.put("r-links", archive)
    assert response.status_code == 201, response.text
    root = operator.path("r-links")
    assert os.readlink(root / "d/up") == ".." and os.readlink(root / "rel") == "d/f"
    assert os.lstat(root / "h").st_ino == os.lstat(root / "d/f").st_ino


def test_a_dead_workers_staging_directory_is_swept(hostile_stack: Any, operator: Operator) -> None:
    """A staging directory whose operation no longer holds the workspace's lock is a dead worker's,
    removed by a worker's sweep (at its start, here a new one's; and every minute); one whose
    operation still holds the lock is left alone."""
    tenant_dir = Path(hostile_stack.workspaces) / operator.tenant
    dead = tenant_dir / ".rw-staging.r-dead.0123456789abcdef0123456789abcdef"
    live = tenant_dir / ".rw-staging.r-live.fedcba9876543210fedcba9876543210"
    for staging in (dead, live):
        (staging / "half").mkdir(parents=True)
        (staging / "half" / "written").write_bytes(b"x")
    hostile_stack.redis.set(keys.workspace_lock(operator.tenant, "r-live"), live.name.rsplit(".", 1)[1], ex=300)
    log = hostile_stack.logs / "worker-sweeper.log"
    devstack.start_worker(hostile_stack.stack, hostile_stack.env, concurrency=1, name=f"ws-{uuid.uuid4().hex[:6]}",
                          log=log)
    wait_until(lambda: not dead.exists(), 90, "the new worker to sweep the dead worker's staging directory")
    assert (live / "half" / "written").read_bytes() == b"x"
    hostile_stack.redis.delete(keys.workspace_lock(operator.tenant, "r-live"))


def gzip_of_trailing_zeros(head: bytes, zeros: int) -> bytes:
    """`head` then `zeros` zero bytes, gzipped as one stream (compressed piece by piece)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    pieces = [compressor.compress(head)]
    block = bytes(1 << 20)
    for _ in range(zeros // len(block)):
        pieces.append(compressor.compress(block))
    pieces.append(compressor.flush())
    return b"".join(pieces)



def test_an_upload_may_take_longer_than_a_request_but_a_stalled_one_creates_nothing(hostile_stack: Any,
                                                                                      operator: Operator) -> None:
    """An upload is bounded by RUNWARDEN_UPLOAD_TIMEOUT, not RUNWARDEN_REQUEST_TIMEOUT: a body
    trickling in for twice the request bound (it sleeps, so it cannot be faster) goes through; a body
    that stops arriving is answered 408 once the upload bound is spent, and leaves nothing."""
    archive = tar(file("slow.txt", b"slow\n" * 1000))

    def trickle() -> Iterator[bytes]:
        pieces = [archive[i:i + len(archive) // 8 + 1] for i in range(0, len(archive), len(archive) // 8 + 1)]
        for piece in pieces:
            time.sleep(2 * REQUEST_TIMEOUT_S / len(pieces))
            yield piece

    slow = operator.put("r-slow", trickle())
    assert slow.status_code == 201 and slow.json()["bytes"] == 5000, slow.text

    api = urlsplit(hostile_stack.base_url)
    with socket.create_connection((api.hostname, api.port), timeout=UPLOAD_TIMEOUT_S + 60) as conn:
        conn.sendall(f"PUT /v1/workspaces/r-stalled HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {operator.token}\r\n"
                     f"Content-Type: application/x-tar\r\nContent-Length: {len(archive) + 4096}\r\n\r\n".encode()
                     + archive[:2048])
        answer = b""
        while b"\r\n\r\n" not in answer and (data := conn.recv(65536)):
            answer += data
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"application/problem+json" in answer
    tenant_dir = operator.path("r-stalled").parent
    wait_until(lambda: os.listdir(tenant_dir) == ["r-slow"], 60, "the stalled upload's staging directory to go")
    assert "r-stalled" not in operator.listing()
