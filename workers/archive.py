"""An upload (a tar, or a gzipped tar) or a clone turned into a directory that may become a
workspace, all or nothing.

Everything is written into a staging directory of its own, beside the workspace, which
workers/workspaces.py renames in only once the whole archive passed. Members are written with the
helpers of workers/workspace.py, which walk each path from a directory fd with O_NOFOLLOW, so
nothing is ever written through a symlink, whatever the archive holds (`a -> /etc`, then
`a/passwd`). tarfile is only the parser: Python 3.11's extraction filters predate the 2025 fixes
(CVE-2025-4517 and its siblings), and nothing here relies on them. It is fed through a bound: a
header tarfile would hold whole in memory is refused when large, a member is refused by its
declared size before its data is read, and the bytes decompressed may not exceed what the
accepted members declare plus a small allowance for headers, so a gzip bomb stops at the bound.
Then the finished tree is checked once more as a whole (`check_tree`), the only check a clone
gets: the entries and bytes, no special file, no symlink leading out (resolved through the
tree's other symlinks), no setuid/setgid bit, everything owned by the sandbox's user.
"""
from __future__ import annotations

import errno
import gzip
import os
import stat
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from shared import paths
from shared.errors import ArchiveRejected, FileNotFound, PathForbidden
from shared.workspaces import Usage
from workers import workspace

MAX_HEADER_BYTES = 64 * 1024  # a pax or GNU long-name header (a 4096-byte path needs 4.2 KiB)
ALLOWANCE_BYTES = 4 * 1024 * 1024  # decompressed bytes beyond the members' own: headers, padding, the end
ALLOWANCE_PER_MEMBER = 8 * 1024
COPY_BYTES = 1024 * 1024
MAX_DEPTH = 256  # directories below the root; deeper would take more fds to walk than a worker has
MAX_SYMLINK_HOPS = 40  # as the kernel's own limit on following symlinks (ELOOP)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_HEADER_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
                 tarfile.SOLARIS_XHDTYPE)
# Errors of the file system that a member's name or kind causes: the archive's fault, not ours.
_NAME_ERRNOS = (errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENOENT,
                errno.EMLINK, errno.EINVAL)
_MALFORMED = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, RecursionError, UnicodeError)


@dataclass(frozen=True)
class Limits:
    max_bytes: int  # of regular files; 0: unlimited
    max_files: int  # entries of every kind


def shown(name: str) -> str:
    """A member's name as an answer can carry it: UTF-8 (tarfile keeps undecodable bytes as
    surrogates), bounded."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")[:1024]


class ChunkReader:
    """A reader over the chunks `next_chunk` returns (b"" at the end), holding one at a time."""

    def __init__(self, next_chunk: Callable[[], bytes | memoryview]) -> None:
        self.next_chunk = next_chunk
        self.chunk = memoryview(b"")
        self.ended = False

    def _fill(self) -> bool:
        while not self.chunk and not self.ended:
            self.chunk = memoryview(self.next_chunk())
            self.ended = not self.chunk
        return bool(self.chunk)

    def read(self, size: int = -1) -> bytes:
        if not self._fill():
            return b""
        count = len(self.chunk) if size < 0 else min(size, len(self.chunk))
        data, self.chunk = bytes(self.chunk[:count]), self.chunk[count:]
        return data

    def peek(self, size: int) -> bytes:
        self._fill()
        return bytes(self.chunk[:size])


class Bounded:
    """What tarfile reads: the upload's bytes, gunzipped if they are gzip, and no more of them
    than the members accepted so far declare, plus the allowance."""

    def __init__(self, inner: BinaryIO | ChunkReader) -> None:
        self.inner = inner
        self.consumed = 0
        self.allowed = ALLOWANCE_BYTES

    def allow(self, member: tarfile.TarInfo) -> None:
        self.allowed += ALLOWANCE_PER_MEMBER + (member.size if member.isreg() else 0)

    def read(self, size: int = -1) -> bytes:
        data = self.inner.read(COPY_BYTES if size < 0 else size)
        self.consumed += len(data)
        if self.consumed > self.allowed:
            raise ArchiveRejected("The archive holds more data than its members declare (a decompression bomb?).",
                                  member=None)
        return data


def open_upload(reader: ChunkReader) -> Bounded | None:
    """The upload as tarfile should read it; None for an empty upload (an empty workspace)."""
    head = reader.peek(2)
    if not head:
        return None
    if head == b"\x1f\x8b":  # gzip's magic, whatever the Content-Type said
        return Bounded(gzip.GzipFile(fileobj=reader, mode="rb"))  # type: ignore[call-overload]
    return Bounded(reader)


class _Header(tarfile.TarInfo):
    """tarfile's own parsing of a member, but a header it would read whole into memory is refused
    first when it is large, and sparse members (whose data is not what they declare) at once."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise ArchiveRejected("Sparse members are not accepted.", member=shown(self.name))
        if self.type in _HEADER_TYPES and not 0 <= self.size <= MAX_HEADER_BYTES:
            raise ArchiveRejected(f"An extended header is larger than {MAX_HEADER_BYTES} bytes.",
                                  member=shown(self.name))
        return super()._proc_member(tarfile_)  # type: ignore[misc]


def extract(source: Bounded, staging: Path, limits: Limits) -> dict[str, int]:
    """Write the archive's members into the empty directory `staging`; ArchiveRejected at the
    first that may not be written (the caller removes `staging`). Returns the directories' modes,
    for `apply_dir_modes` once the tree is checked."""
    writer = _Writer(staging, limits)
    try:
        with tarfile.open(fileobj=source, mode="r|", tarinfo=_Header) as tar:  # type: ignore[call-overload]
            for member in tar:
                tar.members.clear()  # stream mode keeps every member read; nothing here needs them
                source.allow(member)
                writer.add(tar, member)
            while source.read(COPY_BYTES):  # what follows the archive's end: padding, within the bound
                pass
    except _MALFORMED as exc:
        raise ArchiveRejected(f"Not a valid tar or gzipped tar archive ({type(exc).__name__}).",
                              member=writer.last) from None
    return writer.dir_modes


class _Writer:
    """Writes members one by one, never through a symlink, counting entries and bytes."""

    def __init__(self, staging: Path, limits: Limits) -> None:
        self.staging = staging
        self.limits = limits
        self.known: set[str] = set()  # every path made, the directories made on the way included
        self.total_bytes = 0
        self.dir_modes: dict[str, int] = {}
        self.last: str | None = None

    def reject(self, detail: str) -> ArchiveRejected:
        return ArchiveRejected(detail, member=self.last)

    def add(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        self.last = shown(member.name)
        name = self._name(member)
        if name is None:
            return  # the archive's own root, "./"
        self._count(name)
        try:
            self._write(tar, member, name)
        except (PathForbidden, FileNotFound) as exc:
            raise self.reject(f"The member cannot be written there: {exc.detail}") from None
        except OSError as exc:
            if exc.errno in _NAME_ERRNOS:
                raise self.reject(f"The member cannot be written there: {os.strerror(exc.errno or 0)}.") from None
            raise

    def _count(self, name: str) -> None:
        """Count the entries the member makes: itself and the directories above it not made yet."""
        path = ""
        for part in name.split("/"):
            path = f"{path}/{part}" if path else part
            if path not in self.known:
                self.known.add(path)
                if len(self.known) > self.limits.max_files:
                    raise self.reject(f"The archive holds more than {self.limits.max_files} entries.")

    def _name(self, member: tarfile.TarInfo) -> str | None:
        try:
            name = paths.normalize(member.name, allow_root=True)
        except PathForbidden as exc:
            raise self.reject(f"The member's name leads out of the workspace: {exc.detail}") from None
        if not name and not member.isdir():
            raise self.reject("A member that is not a directory names the archive's root.")
        if name.count("/") >= MAX_DEPTH - 1:
            raise self.reject(f"The member is deeper than {MAX_DEPTH} directories.")
        return name or None

    def _write(self, tar: tarfile.TarFile, member: tarfile.TarInfo, name: str) -> None:
        if member.isdir():
            workspace.make_dirs(self.staging, name)
            self.dir_modes[name] = member.mode & 0o777  # setuid, setgid and sticky bits dropped
        elif member.isreg():
            self._file(tar, member, name)
        elif member.issym():
            self._symlink(member, name)
        elif member.islnk():
            self._hardlink(member, name)
        else:
            raise self.reject("Devices, FIFOs and other special files are not accepted.")

    def _file(self, tar: tarfile.TarFile, member: tarfile.TarInfo, name: str) -> None:
        if member.sparse is not None or member.size < 0:
            raise self.reject("Sparse members are not accepted.")
        self.total_bytes += member.size  # refused on its declared size, before any of its data is read
        if self.limits.max_bytes and self.total_bytes > self.limits.max_bytes:
            raise self.reject(f"The archive's files exceed the workspace quota of {self.limits.max_bytes} bytes.")
        data = tar.extractfile(member)
        assert data is not None  # a regular member always has a file object
        with workspace.parent_dir(self.staging, name, create=True) as (dir_fd, leaf):
            self._clear(dir_fd, leaf)
            fd = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
            try:
                while chunk := data.read(COPY_BYTES):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view):]
                os.fchmod(fd, member.mode & 0o777)  # setuid, setgid and sticky bits dropped
                if 0 <= member.mtime < 1 << 34:
                    os.utime(fd, (member.mtime, member.mtime))
            finally:
                os.close(fd)

    def _symlink(self, member: tarfile.TarInfo, name: str) -> None:
        target = member.linkname
        if not target or "\x00" in target:
            raise self.reject("A symlink without a target.")
        if target.startswith("/") or _climbs_out(name, target):
            raise self.reject("A symlink leads out of the workspace.")
        with workspace.parent_dir(self.staging, name, create=True) as (dir_fd, leaf):
            self._clear(dir_fd, leaf)
            os.symlink(target, leaf, dir_fd=dir_fd)

    def _hardlink(self, member: tarfile.TarInfo, name: str) -> None:
        try:
            source = paths.normalize(member.linkname)
        except PathForbidden:
            raise self.reject("A hard link leads out of the workspace.") from None
        try:
            with workspace.parent_dir(self.staging, source) as (source_dir, source_leaf):
                fd = os.open(source_leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             dir_fd=source_dir)
        except (FileNotFound, PathForbidden, OSError):
            raise self.reject("A hard link to a file no earlier member made.") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise self.reject("A hard link to something other than a regular file.")
            with workspace.parent_dir(self.staging, name, create=True) as (dir_fd, leaf):
                self._clear(dir_fd, leaf)
                os.link(f"/proc/self/fd/{fd}", leaf, dst_dir_fd=dir_fd)  # the file opened, not a name
        finally:
            os.close(fd)

    def _clear(self, dir_fd: int, leaf: str) -> None:
        """A later member of the same name replaces the earlier one, as tar does; never a directory."""
        try:
            mode = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISDIR(mode):
            raise self.reject("The member names a directory an earlier member made.")
        os.unlink(leaf, dir_fd=dir_fd)


def _climbs_out(name: str, target: str) -> bool:
    """Whether `target`, read lexically from the directory of the link `name`, climbs above the root."""
    depth = name.count("/")
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part not in ("", "."):
            depth += 1
    return False


def check_tree(root: Path, limits: Limits, owner_uid: int | None) -> Usage:
    """Check what is about to become a workspace, as a whole: nothing else writes it now (the
    archive's writer is done, a clone's sandbox has ended). Refuses a special file, a symlink
    leading out, a tree too deep, more entries or bytes than `limits`; drops setuid/setgid bits;
    gives every entry to `owner_uid` (the sandbox's user) when set."""
    entries = total_bytes = 0
    for relpath, dir_fd, name, st in walk(root):
        entries += 1
        kind = stat.S_IFMT(st.st_mode)
        if entries > limits.max_files:
            raise ArchiveRejected(f"The tree holds more than {limits.max_files} entries.", member=shown(relpath))
        if kind == stat.S_IFREG:
            total_bytes += st.st_size
            if limits.max_bytes and total_bytes > limits.max_bytes:
                raise ArchiveRejected(f"The files exceed the workspace quota of {limits.max_bytes} bytes.",
                                      member=shown(relpath))
        elif kind == stat.S_IFLNK:
            if _leads_out(root, relpath, os.readlink(name, dir_fd=dir_fd)):
                raise ArchiveRejected("A symlink leads out of the workspace.", member=shown(relpath))
        elif kind != stat.S_IFDIR:
            raise ArchiveRejected("Devices, FIFOs, sockets and other special files are not accepted.",
                                  member=shown(relpath))
        elif relpath.count("/") + 1 >= MAX_DEPTH:
            raise ArchiveRejected(f"The tree is deeper than {MAX_DEPTH} directories.", member=shown(relpath))
        _own(dir_fd, name, st, kind, owner_uid)
    return Usage(entries, total_bytes)


def _own(dir_fd: int, name: str, st: os.stat_result, kind: int, owner_uid: int | None) -> None:
    if kind != stat.S_IFLNK and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
        os.chmod(name, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID), dir_fd=dir_fd)
    if owner_uid is not None and (st.st_uid, st.st_gid) != (owner_uid, owner_uid):
        os.chown(name, owner_uid, owner_uid, dir_fd=dir_fd, follow_symlinks=False)


def _leads_out(root: Path, relpath: str, target: str) -> bool:
    """Whether the symlink at `relpath` resolves outside `root`, following the tree's own symlinks
    as the kernel would (a lexical check is not enough: `d/s -> ..` and `t -> d/s/..` each look
    inside). Only real directories are ever kept on the way, so each lstat names no symlink but
    its last component; past a name that does not exist, the rest is read lexically."""
    if target.startswith("/"):
        return True
    kept = relpath.split("/")[:-1]
    pending, hops = target.split("/"), 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not kept:
                return True
            kept.pop()
            continue
        kept.append(part)
        try:
            mode = os.lstat(root.joinpath(*kept)).st_mode
        except OSError:
            continue  # nothing there (yet): the rest is lexical
        if stat.S_ISLNK(mode):
            hops += 1
            inner = os.readlink(root.joinpath(*kept))
            if hops > MAX_SYMLINK_HOPS or inner.startswith("/"):
                return True
            kept.pop()
            pending = inner.split("/") + pending
    return False


def apply_dir_modes(root: Path, modes: dict[str, int]) -> None:
    """Give the archive's directories their modes, deepest first, once nothing is written in them."""
    for name in sorted(modes, key=lambda n: n.count("/"), reverse=True):
        with workspace.parent_dir(root, name) as (dir_fd, leaf):
            fd = os.open(leaf, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                os.fchmod(fd, modes[name])
            finally:
                os.close(fd)


def walk(root: Path) -> Iterator[tuple[str, int, str, os.stat_result]]:
    """Every entry below `root`, depth first, as (relative path, its directory's fd, name, lstat).
    Each directory is opened from its parent's fd with O_NOFOLLOW, so a tree that changes while it
    is walked (a workspace in use) can make the walk miss entries but never leave `root`. Only
    MAX_DEPTH levels are walked (two fds each)."""
    root_fd = os.open(root, _DIR_FLAGS)
    stack = [("", root_fd, os.scandir(root_fd))]
    try:
        while stack:
            rel_dir, dir_fd, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                entries.close()
                os.close(dir_fd)
                stack.pop()
                continue
            relpath = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            yield relpath, dir_fd, entry.name, st
            if stat.S_ISDIR(st.st_mode) and len(stack) < MAX_DEPTH:
                try:
                    child = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
                except OSError:
                    continue  # gone, or replaced by a symlink, since it was listed
                stack.append((relpath, child, os.scandir(child)))
    finally:
        for _, fd, entries in stack:
            entries.close()
            os.close(fd)


def measure(root: Path, max_entries: int) -> Usage:
    """A workspace's entries and bytes, stopping at `max_entries` (a lower bound then)."""
    entries = total_bytes = 0
    for _, _, _, st in walk(root):
        entries += 1
        if stat.S_ISREG(st.st_mode):
            total_bytes += st.st_size
        if entries >= max_entries:
            break
    return Usage(entries, total_bytes)
