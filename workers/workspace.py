"""File access inside one run's workspace that never follows a symlink.

Every path is walked component by component from the workspace's directory fd with
O_NOFOLLOW|O_DIRECTORY (a realpath-then-prefix check races a shell that swaps a directory for a
symlink). Writes go to a temp file in the same directory, fsync, then rename over the target, so
readers and crashes see the old file or the new one, never half of one.
"""
from __future__ import annotations

import errno
import functools
import os
import secrets
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from shared.errors import FileNotFound, PathForbidden, PayloadTooLarge

MAX_READ_BYTES = 32 * 1024 * 1024
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOCTTY: nor a terminal become the worker's.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


@dataclass(frozen=True)
class FileState:
    """A file's bytes and the metadata a replacement keeps; `data` is None when it does not exist."""

    data: bytes | None
    mode: int = 0o644
    uid: int = -1
    gid: int = -1


def workspace_dir(root: Path, tenant: str, run_id: str, owner_uid: int | None) -> Path:
    """Create `<root>/<tenant>/<run_id>` if needed; hand it to the sandbox's user when we are root."""
    path = run_path(root, tenant, run_id)
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True, mode=0o711)
        if owner_uid is not None:
            os.chown(path, owner_uid, owner_uid)
    return path


@functools.lru_cache(maxsize=1024)
def run_path(root: Path, tenant: str, run_id: str) -> Path:
    """The same Path for a run's calls: pathlib interns every component, and a fresh Path per call
    churned CPython's table of interned strings, whose resizes left pool processes ~1 MiB bigger."""
    return root / tenant / run_id


@contextmanager
def _open_dir(path: Path) -> Iterator[int]:
    fd = os.open(path, _DIR_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)


@contextmanager
def parent_dir(workspace: Path, relpath: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
    """A directory fd for the parent of `relpath` and the final name, reached without symlinks."""
    *dirs, name = relpath.split("/")
    fds = [os.open(workspace, _DIR_FLAGS)]
    try:
        for part in dirs:
            fds.append(_step(fds[-1], part, create))
        yield fds[-1], name
    finally:
        for fd in fds:
            os.close(fd)


def _step(dir_fd: int, name: str, create: bool) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise FileNotFound("A directory on the path does not exist.") from None
        st_parent = os.fstat(dir_fd)
        os.mkdir(name, 0o755, dir_fd=dir_fd)
        os.chown(name, st_parent.st_uid, st_parent.st_gid, dir_fd=dir_fd, follow_symlinks=False)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _refusal(exc) from None


def _refusal(exc: OSError) -> Exception:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return PathForbidden("The path goes through a symlink or a non-directory.")
    if exc.errno == errno.ENAMETOOLONG:
        return PathForbidden("A path segment is too long.")
    return exc


def read(dir_fd: int, name: str, *, keep_open: list[int] | None = None) -> FileState:
    """The file's bytes; a missing file gives data=None. Anything but a regular file (directory,
    symlink, FIFO, socket, device) is refused with PathForbidden.
    With `keep_open`, the file read is left open and its fd added there, for the caller to close."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return FileState(None)
    except OSError as exc:
        # open(2) fails on a socket, or a device without a driver, with ENXIO (on a nodev mount with
        # EACCES): name the special file as such, rather than pass on a file-system error (a 503).
        if _is_special(dir_fd, name):
            raise PathForbidden("The path names a special file.") from None
        raise _refusal(exc) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise PathForbidden("The path names a directory.")
        if not stat.S_ISREG(st.st_mode):
            raise PathForbidden("The path names a special file.")
        if st.st_size > MAX_READ_BYTES:
            raise PayloadTooLarge(f"The file is larger than {MAX_READ_BYTES} bytes.")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    except BaseException:
        os.close(fd)
        raise
    if keep_open is None:
        os.close(fd)
    else:
        keep_open.append(fd)
    return FileState(b"".join(chunks), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)


class SpareFile:
    """A nameless empty file (O_TMPFILE) made ahead of time, off the call's path, on the workspaces'
    filesystem. A patch links it in as its temp file instead of creating one: allocating the inode
    took 0.5–1 ms in a workspace on this machine's ext4 disk, the link 0.02 ms. Being nameless, a
    spare never outlives its process, whatever kills it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fd: int | None = None
        self.usable = True

    def restock(self) -> None:
        """Make the next spare if none is ready. Best effort: without one, a patch creates its file."""
        if self.fd is not None or not self.usable:
            return
        try:
            self.fd = os.open(self.root, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                self.usable = False  # this filesystem (or kernel) has no O_TMPFILE

    def take_nameless(self, dir_fd: int) -> int | None:
        """The spare itself, still nameless, if it is on the filesystem of `dir_fd` (else it stays)."""
        if self.fd is None or os.fstat(self.fd).st_dev != os.fstat(dir_fd).st_dev:
            return None
        fd, self.fd = self.fd, None
        return fd

    def take(self, dir_fd: int, name: str) -> int | None:
        """Link the spare in as `name`, never over an existing entry; its fd, or None if there is no
        spare or the workspace is on another filesystem."""
        if self.fd is None:
            return None
        try:
            os.link(f"/proc/self/fd/{self.fd}", name, dst_dir_fd=dir_fd)  # the way open(2) documents
        except OSError:
            return None
        fd, self.fd = self.fd, None
        return fd


def _is_special(dir_fd: int, name: str) -> bool:
    """Whether `name` is there as something other than a regular file, directory or symlink."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))


def identity(dir_fd: int, name: str) -> tuple[int, int] | None:
    """(device, inode) of what `name` holds now, None if nothing. Opened, not stat'ed, so that a
    network filesystem looks the name up again (close-to-open), as reading it did."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError:
        return (-1, -1)  # a symlink, or nothing readable: not the file that was read
    try:
        return identity_of(fd)
    finally:
        os.close(fd)


def identity_of(fd: int) -> tuple[int, int]:
    """(device, inode) of an open file."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def new_file_metadata(dir_fd: int, like: FileState) -> tuple[int, int, int]:
    """Mode, uid and gid for the file replacing `like`: its own, or for a new file the directory's owner."""
    if like.data is not None:
        return like.mode, like.uid, like.gid
    st_dir = os.fstat(dir_fd)
    return 0o644, st_dir.st_uid, st_dir.st_gid


def fill(fd: int, data: bytes, like: tuple[int, int, int], midway: Callable[[], None] | None = None) -> None:
    """Write `data` to the empty file `fd`, give it `like`'s mode and owner, and flush it to disk.
    `midway` (test mode, workers/holds.py) runs once half the bytes are written."""
    mode, uid, gid = like
    view = memoryview(data)
    if midway is not None:
        _write_all(fd, view[:len(view) // 2])
        midway()
        view = view[len(view) // 2:]
    _write_all(fd, view)
    if os.geteuid() == 0:
        os.fchown(fd, uid, gid)
    os.fchmod(fd, mode)
    os.fsync(fd)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def _temp_name(name: str) -> str:
    return f".{name[:200]}.rw-{secrets.token_hex(6)}.tmp"


def replace(dir_fd: int, name: str, data: bytes, like: FileState,
            before_rename: Callable[[], None] = lambda: None, spare: SpareFile | None = None,
            midway: Callable[[], None] | None = None) -> None:
    """Atomically put `data` at `name`, keeping the old file's mode and owner (or the directory's).
    `before_rename` runs once the bytes are on disk, just before they replace the file; the temp
    file is `spare`, when one is ready; `midway` is `fill`'s."""
    tmp = _temp_name(name)
    fd = spare.take(dir_fd, tmp) if spare else None
    if fd is None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            fill(fd, data, new_file_metadata(dir_fd, like), midway)
        finally:
            os.close(fd)
        before_rename()
    except BaseException:
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    _rename_in(tmp, dir_fd, name)


def link_in(fd: int, dir_fd: int, name: str) -> None:
    """Atomically put the nameless file `fd`, already filled (see `fill`), at `name`."""
    tmp = _temp_name(name)
    os.link(f"/proc/self/fd/{fd}", tmp, dst_dir_fd=dir_fd)  # the way open(2) documents for O_TMPFILE
    _rename_in(tmp, dir_fd, name)


def _rename_in(tmp: str, dir_fd: int, name: str) -> None:
    # The data is on disk before the rename, so no crash exposes an empty or partial file; the
    # rename itself is atomic for every reader. (No directory fsync: it buys durability of the
    # rename across power loss, not atomicity, at the cost of a second disk flush per patch.)
    try:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.unlink(tmp, dir_fd=dir_fd)
        raise


def delete(dir_fd: int, name: str) -> None:
    os.unlink(name, dir_fd=dir_fd)


def make_dirs(workspace: Path, relpath: str) -> None:
    """Make `relpath` and its parents as directories where missing, never through a symlink."""
    with parent_dir(workspace, relpath + "/.", create=True):
        pass


def open_beneath(workspace: Path, relpath: str) -> int | None:
    """An O_PATH fd of the file or directory at `relpath`, every component reached without a
    symlink (for a sandbox to bind: what it names can no longer change under it); None when nothing
    is there. A symlink or a special file is refused."""
    try:
        with parent_dir(workspace, relpath) as (dir_fd, name):
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except (FileNotFound, FileNotFoundError):
        return None
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind not in (stat.S_IFDIR, stat.S_IFREG):
        os.close(fd)
        raise PathForbidden("The path is a symlink or a special file.")
    return fd
