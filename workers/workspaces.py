"""Workspace operations on a worker (contract section 11): create (empty, from an upload, by a
clone), replace and delete; and the sweep (idle expiry, measuring, dead workers' leftovers).

A workspace appears whole or not at all: it is built in a staging directory beside it,
`<root>/<tenant>/.rw-staging.<run_id>.<op_id>`, checked as a whole, then renamed in. A replaced or
deleted one is first renamed aside (`.rw-trash.<run_id>.<op_id>`), then removed. (Names starting
with "." are never a tenant's nor a run's: shared/paths.py NAME_RE.) Each operation holds the
workspace's lock in Redis while it works, its op id as the value; a staging or trash directory
whose op no longer holds the lock belongs to a worker that died, and the sweep removes it.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import redis

from shared import connections, keys
from shared.errors import (BadRequest, NotFound, RequestTimeout, RunwardenError, SandboxUnavailable, Unavailable,
                           WorkspaceBusy, WorkspaceExists)
from shared.paths import NAME_RE
from shared.placement import Placement
from shared.settings import Settings
from shared.workspaces import DATA, END, GitSource, Operation, Registry
from workers import archive, clone
from workers.archive import ChunkReader, Limits
from workers.sandbox import Runner

log = logging.getLogger("runwarden.workspaces")

STAGING, TRASH = ".rw-staging", ".rw-trash"
LOCK_TTL_MS = 60_000
LOCK_REFRESH_S = 10.0
UPLOAD_IDLE_S = 60.0  # an upload from which nothing arrives for this long is abandoned
DEADLINE_MARGIN_S = 5.0  # a clone ends this long before the API stops waiting for it

# KEYS: the lock. ARGV: op id (and a ttl ms to refresh). Only the holder refreshes or releases it.
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
_REFRESH = ("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end "
            "return 0")


@dataclass(frozen=True)
class Place:
    """Where one operation on a run's workspace works."""

    root: Path
    tenant: str
    run_id: str
    op_id: str

    @property
    def target(self) -> Path:
        return self.root / self.tenant / self.run_id

    @property
    def staging(self) -> Path:
        return self.root / self.tenant / f"{STAGING}.{self.run_id}.{self.op_id}"

    @property
    def trash(self) -> Path:
        return self.root / self.tenant / f"{TRASH}.{self.run_id}.{self.op_id}"


class WorkspaceLock:
    def __init__(self, client: redis.Redis, place: Place) -> None:
        self.client = client
        self.key = keys.workspace_lock(place.tenant, place.run_id)
        self.op_id = place.op_id
        self.refreshed = 0.0

    def take(self) -> bool:
        self.refreshed = time.monotonic()
        return bool(self.client.set(self.key, self.op_id, nx=True, px=LOCK_TTL_MS))

    def refresh(self) -> None:
        """Keep the lock while working (cheap to call often: at most one round trip per 10 s)."""
        if time.monotonic() - self.refreshed >= LOCK_REFRESH_S:
            self.refreshed = time.monotonic()
            self.client.eval(_REFRESH, 1, self.key, self.op_id, LOCK_TTL_MS)

    def release(self) -> None:
        self.client.eval(_RELEASE, 1, self.key, self.op_id)


@dataclass(frozen=True)
class Outcome:
    """An operation's answer, and what to remove once it is given (an old tree renamed aside)."""

    status: int
    body: dict[str, Any] | None
    leftovers: tuple[Path, ...] = ()


def remove_tree(path: Path) -> None:
    """rmtree works from directory fds on Linux, so a symlink in the tree is removed, never followed."""
    if os.path.lexists(path):
        shutil.rmtree(path, ignore_errors=True)


class Operations:
    """Create and delete, as the tasks in workers/workspace_tasks.py run them."""

    def __init__(self, settings: Settings, client: redis.Redis, runner: Runner | None,
                 owner_uid: int | None, sandbox_error: str | None = None) -> None:
        self.settings = settings
        self.client = client
        self.runner = runner
        self.sandbox_error = sandbox_error
        self.owner_uid = owner_uid  # the sandbox's host uid, as workspace_dir gives it the directory
        self.registry = Registry(client)

    def perform(self, kind: str, message: dict[str, Any]) -> Outcome:
        """The operation's outcome, whatever happens: a refusal or a failure is an answer too."""
        try:
            return self.create(message) if kind == "create" else self.delete(message)
        except RunwardenError as exc:
            return Outcome(exc.status, exc.problem())
        except OSError as exc:
            log.exception("workspace %s of %s/%s failed", kind, message["tenant"], message["run_id"])
            error = Unavailable(f"The file system refused: {exc.strerror or type(exc).__name__}.")
            return Outcome(error.status, error.problem())

    def _place(self, message: dict[str, Any]) -> Place:
        return Place(self.settings.workspaces, message["tenant"], message["run_id"], message["op_id"])

    def _busy(self, place: Place) -> bool:
        return bool(self.client.scard(keys.run_active(place.tenant, place.run_id)))

    def _locked(self, place: Place) -> WorkspaceLock:
        lock = WorkspaceLock(self.client, place)
        if not lock.take():
            raise WorkspaceBusy("Another operation on this workspace is under way.")
        return lock

    def create(self, message: dict[str, Any]) -> Outcome:
        place = self._place(message)
        lock = self._locked(place)
        try:
            return self._create(place, message, lock)
        finally:
            remove_tree(place.staging)  # still there: it failed, and leaves nothing behind
            lock.release()

    def _create(self, place: Place, message: dict[str, Any], lock: WorkspaceLock) -> Outcome:
        replace = message["replace"]
        if not replace and os.path.lexists(place.target):
            raise WorkspaceExists("The run has a workspace; add ?replace=true to replace it.")
        if replace and self._busy(place):
            raise WorkspaceBusy("A call of this run is queued or running.")
        place.staging.parent.mkdir(parents=True, exist_ok=True)
        place.staging.mkdir(mode=0o711)
        if self.owner_uid is not None:
            os.chown(place.staging, self.owner_uid, self.owner_uid)
        limits = Limits(message["workspace_bytes"], self.settings.workspace_max_files)
        dir_modes = self._fill(place, message, limits, lock)
        usage = archive.check_tree(place.staging, limits, self.owner_uid)
        archive.apply_dir_modes(place.staging, dir_modes)
        if time.time() > message["deadline"]:  # the API has answered 503: create nothing
            raise Unavailable("The workspace was not ready in time; nothing was created.")
        leftovers = self._install(place, replace)
        self.registry.created(place.tenant, place.run_id, usage)
        return Outcome(201, {"run_id": place.run_id, "files": usage.files, "bytes": usage.total_bytes}, leftovers)

    def _fill(self, place: Place, message: dict[str, Any], limits: Limits, lock: WorkspaceLock) -> dict[str, int]:
        """Put the source into the staging directory; the archive's directory modes, to apply last."""
        if message["source"] == "git":
            if self.runner is None:
                raise SandboxUnavailable(self.sandbox_error or "No sandbox is configured on this worker.")
            git = GitSource(message["git"]["url"], message["git"].get("ref"))
            deadline = time.monotonic() + message["deadline"] - time.time() - DEADLINE_MARGIN_S
            clone.clone(self.runner, place.staging, git, deadline, limits, lock.refresh)
            return {}
        if message["source"] == "archive":
            upload = Operation(self.client, message["op_id"])
            source = archive.open_upload(ChunkReader(lambda: _next_chunk(upload, lock)))
            return archive.extract(source, place.staging, limits) if source is not None else {}
        return {}  # empty

    def _install(self, place: Place, replace: bool) -> tuple[Path, ...]:
        """Rename the staging directory in; a replaced workspace is renamed aside first."""
        if replace and os.path.lexists(place.target):
            os.rename(place.target, place.trash)
            self._forget(place)
            try:
                os.rename(place.staging, place.target)
            except OSError:  # a call made the directory anew in between: put the old one back
                os.rename(place.trash, place.target)
                raise WorkspaceBusy("A call of this run started meanwhile; nothing was replaced.") from None
            return (place.trash,)
        try:
            os.rename(place.staging, place.target)  # over an empty directory a first call made: fine
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise WorkspaceExists("The run's first call made its workspace meanwhile.") from None
            raise
        return ()

    def _forget(self, place: Place) -> None:
        """A sandbox prepared for the run binds the old directory: it must serve no call (the
        keepers of other hosts see the path's directory change; this one is told at once)."""
        if self.runner is not None:
            self.runner.forget(place.target)

    def delete(self, message: dict[str, Any]) -> Outcome:
        place = self._place(message)
        lock = self._locked(place)
        try:
            if self._busy(place):
                raise WorkspaceBusy("A call of this run is queued or running.")
            on_disk = os.path.lexists(place.target)
            if on_disk:
                os.rename(place.target, place.trash)  # gone at once; removed after the answer
                self._forget(place)
            recorded = self.registry.remove(place.tenant, place.run_id)
            if not (on_disk or recorded):
                raise NotFound("No such workspace.")
            return Outcome(204, None, (place.trash,) if on_disk else ())
        finally:
            lock.release()


class UploadAbandoned(BadRequest):
    """The API said the client went away, or stalled, before the upload's end."""


def _next_chunk(upload: Operation, lock: WorkspaceLock) -> bytes | memoryview:
    """The upload's next bytes (b"" at its end), keeping the lock meanwhile."""
    lock.refresh()
    item = upload.pop(UPLOAD_IDLE_S)
    if item is None:
        raise RequestTimeout(f"Nothing of the upload arrived for {UPLOAD_IDLE_S:.0f} s.")
    tag = item[:1]
    if tag == DATA:
        return memoryview(item)[1:]
    if tag == END:
        return b""
    raise UploadAbandoned("The upload was not completed.")


# ---- the sweep, run by every worker's main process ----

SWEEP_EVERY_S = 3.0
LEFTOVERS_EVERY = 20  # sweeps between looks for dead workers' staging directories
USE_THROTTLE_S = 1.0  # a pool process records a run's use at most this often (workspace_tasks.py)
MEASURE_LIMIT = 500  # workspaces measured in one sweep; the next sweep goes on from there
EXPIRE_LIMIT = 100
MEASURE_CAP = 1_000_000  # entries counted in one workspace


class Sweeper:
    """Each pass (one worker at a time, by a lock): measure the workspaces used since the last
    pass, delete those idle past RUNWARDEN_WORKSPACE_IDLE_TTL with no call queued or running, and
    now and then remove staging and trash directories of dead workers and record workspaces the
    registry lacks (made before it existed)."""

    def __init__(self, settings: Settings, client: redis.Redis, name: str) -> None:
        self.settings = settings
        self.client = client
        self.name = name
        self.registry = Registry(client)
        self.passes = 0
        # Node placement: each node sweeps the workspaces on its own disk, with its own lock.
        self.node = settings.node if settings.placement == "node" else None
        self.placement = Placement(client)
        self.scope = f":{self.node}" if self.node else ""

    def _mine(self, tenant: str, run_id: str) -> bool:
        return self.node is None or self.placement.node_of(tenant, run_id) == self.node

    def sweep(self) -> bool:
        """One pass, if no other worker's is under way; whether it ran."""
        if not self.client.set(keys.WORKSPACE_SWEEP_LOCK + self.scope, self.name, nx=True,
                               px=int(SWEEP_EVERY_S * 1000) - 200):
            return False
        started = time.time()
        since = float(self.client.hget(keys.WORKSPACE_SWEEPS, "measured_at" + self.scope) or 0)
        # A use is recorded at most every USE_THROTTLE_S, after calls that may have changed the
        # workspace since: looking that far back (and a margin for clocks) misses none of them.
        measured_to = self._measure(since - USE_THROTTLE_S - 2, started)
        self._expire(started - self.settings.workspace_idle_ttl_s)
        self.passes += 1
        if self.passes % LEFTOVERS_EVERY == 0:
            self.leftovers()
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(keys.WORKSPACE_SWEEPS, "measured_at" + self.scope, measured_to)
        pipe.hincrby(keys.WORKSPACE_SWEEPS, "passes", 1)
        pipe.execute()
        return True

    def _measure(self, low: float, started: float) -> float:
        """Measure the workspaces used in [low, started]; where the next pass should start."""
        used = self.client.zrangebyscore(keys.WORKSPACES_BY_USE, low, started, start=0, num=MEASURE_LIMIT,
                                         withscores=True)
        for name, _ in used:
            tenant, _, run_id = name.decode().partition("/")
            if not self._mine(tenant, run_id):
                continue
            try:
                usage = archive.measure(self.settings.workspaces / tenant / run_id, MEASURE_CAP)
            except OSError:
                continue  # deleted meanwhile
            self.registry.measured(tenant, run_id, usage)
        return used[-1][1] if len(used) == MEASURE_LIMIT else started

    def _expire(self, cutoff: float) -> None:
        for name in self.client.zrangebyscore(keys.WORKSPACES_BY_USE, "-inf", cutoff, start=0, num=EXPIRE_LIMIT):
            tenant, _, run_id = name.decode().partition("/")
            if not self._mine(tenant, run_id):
                continue
            place = Place(self.settings.workspaces, tenant, run_id, uuid.uuid4().hex)
            lock = WorkspaceLock(self.client, place)
            if not lock.take():
                continue  # an operation on it is under way
            try:
                if not self._still_idle(tenant, run_id, cutoff):
                    continue
                if os.path.lexists(place.target):
                    os.rename(place.target, place.trash)
                self.registry.remove(tenant, run_id)
                if self.node is not None:
                    self.placement.free(tenant, run_id)  # its next call may be placed anywhere
                log.info("deleted the workspace of %s/%s: unused for %d s", tenant, run_id,
                         self.settings.workspace_idle_ttl_s)
                remove_tree(place.trash)
            finally:
                lock.release()

    def _still_idle(self, tenant: str, run_id: str, cutoff: float) -> bool:
        """Checked under the workspace's lock: no call of the run is queued or running, and it was
        not used since it was found idle."""
        if self.client.scard(keys.run_active(tenant, run_id)):
            return False
        last_used = self.registry.last_used(tenant, run_id)
        return last_used is None or last_used <= cutoff

    def leftovers(self) -> None:
        """Remove the staging and trash directories no live operation holds, and record the
        workspaces on disk the registry lacks."""
        root = self.settings.workspaces
        for tenant in _names(root):
            recorded = {run_id.decode() for run_id in self.client.hkeys(keys.workspaces(tenant))}
            for entry in os.scandir(root / tenant):
                if entry.name.startswith((f"{STAGING}.", f"{TRASH}.")):
                    run_id, _, op_id = entry.name.split(".", 2)[2].rpartition(".")
                    if self.client.get(keys.workspace_lock(tenant, run_id)) != op_id.encode():
                        log.info("removing %s/%s, left by a worker that stopped", tenant, entry.name)
                        remove_tree(Path(entry.path))
                elif NAME_RE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False) \
                        and entry.name not in recorded:
                    self._adopt(tenant, entry.name, entry.stat(follow_symlinks=False).st_mtime)

    def _adopt(self, tenant: str, run_id: str, mtime: float) -> None:
        usage = archive.measure(self.settings.workspaces / tenant / run_id, MEASURE_CAP)
        self.registry.adopted(tenant, run_id, usage, mtime)
        if self.node is not None:  # found on this node's disk: its calls belong here
            self.client.set(keys.placement(tenant, run_id), self.node, nx=True)


def _names(directory: Path) -> list[str]:
    """The directories in `directory` named as a tenant or run may be (not symlinks)."""
    try:
        return [entry.name for entry in os.scandir(directory)
                if NAME_RE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def sweep_forever(settings: Settings, name: str, stop: Any) -> None:
    """The main process's sweeping thread: leftovers at start (a dead worker's), then a pass every
    SWEEP_EVERY_S."""
    sweeper = Sweeper(settings, connections.connect(settings, socket_timeout=30), name)
    work: Callable[[], object] = sweeper.leftovers
    while True:
        try:
            work()
        except redis.RedisError as exc:
            log.warning("workspace sweep cannot reach Redis: %s", exc)
        except OSError as exc:
            log.warning("workspace sweep failed: %s", exc)
        if stop.wait(SWEEP_EVERY_S):
            return
        work = sweeper.sweep
