"""Pure functions: settings validation, key parsing, the schema, the UTF-8 cutter, events."""
from __future__ import annotations

import base64
import contextlib
import ctypes
import dataclasses
import json
import os
import resource
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from billiard import util as billiard_util

from runwarden import devstack
from shared.errors import InvalidIdempotencyKey, MissingIdempotencyKey, SchemaInvalid
from shared.idempotency import parse_key
from shared.schema import parse_tool_call
from shared.settings import Settings, SettingsError
from workers import sandbox, workspace
from workers.cgroups import Cgroups
from workers.relay import Utf8Cutter, incomplete_tail, output_event
from workers.shell import signal_name
from tests.waiting import wait_until

BASE_ENV = {"RUNWARDEN_REDIS_URL": "redis://127.0.0.1:1/0", "RUNWARDEN_JWT_SECRET": "s" * 32}


def test_short_jwt_secret_stops_start_up() -> None:
    with pytest.raises(SettingsError, match="at least 32 bytes"):
        Settings.from_env({**BASE_ENV, "RUNWARDEN_JWT_SECRET": "s" * 31})


@pytest.mark.parametrize("name,value", [("RUNWARDEN_SANDBOX", "docker"), ("RUNWARDEN_LEASE", "soon"),
                                        ("RUNWARDEN_STREAM_RETENTION", "60"), ("RUNWARDEN_REDIS_URL", ""),
                                        ("RUNWARDEN_TASK_EVENTS", "yes")])
def test_bad_settings_are_refused(name: str, value: str) -> None:
    with pytest.raises(SettingsError):
        Settings.from_env({**BASE_ENV, name: value})


def test_task_events_are_sent_once_a_monitor_asks_unless_set_on() -> None:
    from shared.celery_app import create_celery
    assert create_celery(Settings.from_env(BASE_ENV)).conf.worker_send_task_events is False
    on = Settings.from_env({**BASE_ENV, "RUNWARDEN_TASK_EVENTS": "on"})
    assert create_celery(on).conf.worker_send_task_events is True


def test_public_key_pins_its_algorithm(tmp_path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "key.pem").write_bytes(pem)
    settings = Settings.from_env({**BASE_ENV, "RUNWARDEN_JWT_PUBLIC_KEY": str(tmp_path / "key.pem")})
    assert settings.jwt_algorithms == ("ES256",) and settings.jwt_secret is None


def test_workers_need_no_jwt_key() -> None:
    settings = Settings.from_env({"RUNWARDEN_REDIS_URL": "redis://x"}, require_jwt=False)
    assert settings.jwt_algorithms == ()


@pytest.mark.parametrize("values,key", [(["abc"], "abc"), (['"01J9ZQ-x:y.z_1"'], "01J9ZQ-x:y.z_1"),
                                        (["a" * 255], "a" * 255)])
def test_keys_accepted(values: list[str], key: str) -> None:
    assert parse_key(values) == key


@pytest.mark.parametrize("values", [[""], ['""'], ["a" * 256], ["a b"], ["a,b"], ["é"], ["a", "a"], ['"a']])
def test_keys_refused(values: list[str]) -> None:
    with pytest.raises(InvalidIdempotencyKey):
        parse_key(values)


def test_missing_key() -> None:
    with pytest.raises(MissingIdempotencyKey):
        parse_key([])


def _pointers(body: object) -> list[str]:
    with pytest.raises(SchemaInvalid) as caught:
        parse_tool_call(body)
    return [error["pointer"] for error in caught.value.extra["errors"]]


def test_tool_name_binds_its_parameter_schema() -> None:
    body = {"tool_name": "apply_file_patch", "call_id": str(uuid.uuid4()), "parameters": {"command": "ls"}}
    assert "/parameters" in _pointers(body)


def test_call_id_format_is_asserted() -> None:
    body = {"tool_name": "read_file", "call_id": "not-a-uuid", "parameters": {"path": "a"}}
    assert set(_pointers(body)) == {"/call_id"}


def test_unknown_properties_are_refused() -> None:
    body = {"tool_name": "read_file", "call_id": str(uuid.uuid4()), "parameters": {"path": "a", "x": 1}, "y": 2}
    assert _pointers(body) == ["", "/parameters"]


def test_timeout_default() -> None:
    call = parse_tool_call({"tool_name": "execute_shell_command", "call_id": str(uuid.uuid4()),
                            "parameters": {"command": "true"}})
    assert call.parameters["timeout_ms"] == 30000


@pytest.mark.parametrize("data,held", [(b"abc", 0), (b"a\xc3", 1), (b"\xe2\x82", 2), (b"\xf0\x9f\x98", 3),
                                       (b"\xf0\x9f\x98\x80", 0), (b"\xff", 0), (b"\x80\x80\x80\x80", 0)])
def test_incomplete_tail(data: bytes, held: int) -> None:
    assert incomplete_tail(data) == held


def test_cutter_never_splits_a_character_and_keeps_every_byte() -> None:
    text = "aé😀你\r\n\t".encode() + b"\xff\xfe" + "ß".encode()
    for size in range(1, 6):
        cutter, pieces = Utf8Cutter(), []
        for start in range(0, len(text), size):
            pieces.append(cutter.feed(text[start:start + size]))
        pieces.append(cutter.flush())
        assert b"".join(pieces) == text
        for piece in pieces:
            if piece and b"\xff" not in piece and b"\xfe" not in piece:
                piece.decode("utf-8")  # whole characters only


def test_output_event_text_or_base64() -> None:
    assert json.loads(output_event(1, "stdout", "é\r\n".encode())) == {
        "type": "output", "seq": 1, "stream": "stdout", "data": "é\r\n"}
    event = json.loads(output_event(2, "stderr", b"\xff\x00"))
    assert base64.b64decode(event["data_b64"]) == b"\xff\x00" and "data" not in event


@pytest.mark.parametrize("text", ["plain", "tab\tcr\rlf\n", "quote \" backslash \\ slash /", "\x00\x01\x1f\x7f",
                                  "\u2028\u2029", "é€😀", "x" * 70_000])
def test_output_event_is_the_json_json_dumps_writes(text: str) -> None:
    """orjson writes the events; their bytes are what json.dumps(ensure_ascii=False) would write."""
    expected = json.dumps({"type": "output", "seq": 7, "stream": "stdout", "data": text},
                          ensure_ascii=False, separators=(",", ":")).encode()
    assert output_event(7, "stdout", text.encode()) == expected


@pytest.mark.parametrize("code,name", [(0, None), (1, None), (130, "SIGINT"), (137, "SIGKILL"), (143, "SIGTERM"),
                                       (255, None)])
def test_signal_name(code: int, name: str | None) -> None:
    assert signal_name(code) == name


def test_sandbox_etc_is_built_once_without_host_keys(tmp_path: Path) -> None:
    first = sandbox.build_etc(tmp_path / "etc")
    assert sandbox.build_etc(tmp_path / "etc") == first  # same content, same directory, not rebuilt
    assert sorted(p.name for p in (tmp_path / "etc").iterdir()) == [first.name]  # no staging left
    assert (first / "passwd").read_text().startswith("sandbox:x:1000:1000:")
    assert (first / "resolv.conf").read_text() == ""  # a placeholder shell:network binds over
    assert not (first / "ssl" / "private").exists()
    assert not (first / "shadow").exists()


def test_limits_prelude_sets_hard_limits_no_higher_than_ours() -> None:
    hard_files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    prelude = sandbox.limits_prelude(sandbox.Limits(2 << 30, 64, 1 << 20, 10**9), processes=64)
    expected_files = 10**9 if hard_files == resource.RLIM_INFINITY else min(10**9, hard_files)
    assert prelude.startswith(f"ulimit -H -S -v {2 << 20} -u 64 -f 1024 -n {expected_files} -c 0 || exit 126; ")
    assert prelude.endswith('exec /bin/bash -c "$1"')
    out = subprocess.run(["/bin/bash", "-c", sandbox.limits_prelude(sandbox.Limits(2 << 30, 64, 1 << 20, 512), 64),
                          "/bin/bash", 'ulimit -Hn; ulimit -Sv; echo "$0"'], capture_output=True, text=True, check=True)
    assert out.stdout == f"512\n{2 << 20}\n/bin/bash\n"


def test_a_verified_token_still_expires_and_stays_bound_to_its_key() -> None:
    from shared import tokens
    from shared.errors import TokenExpired, Unauthorized
    settings = Settings.from_env({"RUNWARDEN_JWT_SECRET": "s" * 48, "RUNWARDEN_REDIS_URL": "redis://localhost:1/0"})
    token = tokens.mint(b"s" * 48, tenant="t", run_id="r", sub="a", scopes=["files:read"], paths=["**"], ttl_s=2)
    assert tokens.verify(token, settings).tenant == "t"
    assert tokens.verify(token, settings).tenant == "t"  # the second time from the cache
    rotated = Settings.from_env({"RUNWARDEN_JWT_SECRET": "k" * 48, "RUNWARDEN_REDIS_URL": "redis://localhost:1/0"})
    with pytest.raises(Unauthorized):
        tokens.verify(token, rotated)  # another key: decoded again, and refused
    time.sleep(max(0.0, tokens.verify(token, settings).exp - time.time()) + 0.05)
    with pytest.raises(TokenExpired):
        tokens.verify(token, settings)


def _ids(pid: int | str) -> dict[str, str]:
    """The uid, gid, groups and capability lines of /proc/<pid>/status."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)
            if k in ("Uid", "Gid", "Groups", "CapPrm", "CapEff", "CapInh", "CapAmb")}


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop only happens when the worker is root")
@pytest.mark.parametrize("drop", ["thread", "setpriv", "fork"])
def test_bwrap_drops_to_the_sandbox_uid_by_thread_setpriv_or_fork(drop: str) -> None:
    """The spawning thread's own drop is the fast path, setpriv's exec the next, subprocess's fork
    the last: each leaves bwrap with every id the sandbox uid's and no capability, and the
    spawning thread as it was (root, its groups, its parent-death signal, the process dumpable)."""
    root = devstack.reachable_dir("rw-uid-")
    try:
        workspace = root / "ws"
        workspace.mkdir()
        os.chown(workspace, 65534, 65534)
        thread_uid = sandbox.ThreadUid.for_this_machine(65534) if drop == "thread" else None
        setpriv = shutil.which("setpriv") if drop == "setpriv" else None
        if (drop, thread_uid, setpriv) in (("thread", None, None), ("setpriv", None, None)):
            pytest.skip(f"no {drop} drop on this machine")
        runner = _runner(root, 65534, setpriv=setpriv, thread_uid=thread_uid)
        before = _ids("thread-self"), os.getgroups(), billiard_util.get_pdeathsig()
        billiard_util.set_pdeathsig(signal.SIGUSR2)  # as a pool process has one: it must survive the drop
        try:
            process = runner.spawn("ulimit -n; touch made; exec sleep 30", workspace, "", False)
            assert isinstance(process, sandbox.PopenProcess)
            outside = _ids(process.popen.pid)  # bwrap's own process, on the host
            assert (_ids("thread-self"), os.getgroups()) == before[:2]
            assert billiard_util.get_pdeathsig() == signal.SIGUSR2
            assert _dumpable()
        finally:
            billiard_util.set_pdeathsig(before[2])
        wait_until(lambda: (workspace / "made").exists(), 30, "the command to have written its output")
        process.kill()  # once its output is written
        code, out, err = sandbox.communicate(process, timeout_s=20)
        assert outside["Uid"].split() == ["65534"] * 4 and outside["Gid"].split() == ["65534"] * 4, outside
        assert outside["Groups"] == "" and {outside[c] for c in ("CapPrm", "CapEff", "CapAmb")} == {"0" * 16}
        assert out.startswith(b"256\n"), (code, out, err)
        assert (workspace / "made").stat().st_uid == 65534
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_uid_drop_is_the_spawning_threads_alone_and_undone_after_a_failed_spawn(tmp_path: Path) -> None:
    thread_uid = sandbox.ThreadUid.for_this_machine(65534)
    if thread_uid is None:
        pytest.skip("no per-thread uid drop on this machine (not root, or an unknown machine)")
    before = _ids("thread-self"), os.getgroups()
    other_started, other_done = threading.Event(), threading.Event()
    other = threading.Thread(target=lambda: (other_started.set(), other_done.wait(30)))
    other.start()
    try:
        other_started.wait(30)
        with pytest.raises(PermissionError):  # pytest's temporary directories are 0700: the uid cannot look
            with thread_uid.become():
                assert os.getresuid() == (65534, 65534, 0) and os.getgroups() == []
                assert _ids(f"self/task/{other.native_id}")["Uid"].split() == ["0"] * 4  # the process's other threads
                subprocess.Popen([str(tmp_path / "missing")])
    finally:
        other_done.set()
        other.join(30)
    assert (_ids("thread-self"), os.getgroups()) == before and _dumpable()


def test_a_thread_left_dropped_is_whole_again_at_its_next_spawn(tmp_path: Path) -> None:
    """A signal's exception raised between a spawn and its take-back (Python runs handlers between
    bytecodes) would leave the thread the sandbox uid: it then fails what needs root, and the next
    spawn takes it back first."""
    thread_uid = sandbox.ThreadUid.for_this_machine(65534)
    if thread_uid is None:
        pytest.skip("no per-thread uid drop on this machine (not root, or an unknown machine)")
    before = _ids("thread-self"), os.getgroups()
    (tmp_path / "root-owned").write_text("")
    with thread_uid.become():
        pass
    thread_uid._call(thread_uid._setresuid, 65534, 65534, -1)  # as if the take-back never ran
    try:
        with pytest.raises(PermissionError):
            os.chown(tmp_path / "root-owned", 0, 0)  # root's work fails: closed, not open
        with thread_uid.become():
            assert os.getresuid() == (65534, 65534, 0)
    finally:
        if os.getresuid() != (0, 0, 0):
            os.setresuid(0, 0, 0)
    assert (_ids("thread-self"), os.getgroups()) == before and _dumpable()


def _dumpable() -> bool:
    return ctypes.CDLL(None).prctl(3, 0, 0, 0, 0) == 1  # PR_GET_DUMPABLE


def _gone(pid: int, timeout_s: float = 30) -> bool:
    """Whether the process ended (a zombie counts: it runs nothing) within the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.02)
    return False


def test_a_sandbox_killed_while_bwrap_sets_it_up_leaves_nothing_running() -> None:
    """A kill right after spawn (a cancel, or a failure just after it) lands while bwrap is still
    setting the sandbox up, before its init has a process group of its own."""
    root = devstack.reachable_dir("rw-kill-")
    host_uid = 65534 if os.geteuid() == 0 else None
    try:
        workspace = root / "ws"
        workspace.mkdir()
        if host_uid is not None:
            os.chown(workspace, host_uid, host_uid)
        runner = _runner(root, host_uid, setpriv=shutil.which("setpriv"))
        for _ in range(3):
            process = runner.spawn("sleep 30", workspace, "", False)
            process.kill()
            process.wait()
            process.close()
            assert _gone(process.group_leader), f"the sandbox's init {process.group_leader} outlived its kill"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _runner(root: Path, host_uid: int | None, cgroups: Cgroups | None = None, setpriv: str | None = None,
            thread_uid: sandbox.ThreadUid | None = None) -> sandbox.BwrapRunner:
    bwrap = sandbox.find_bwrap()
    assert bwrap is not None
    return sandbox.BwrapRunner(bwrap, sandbox.Limits(1 << 30, 64, 1 << 20, 256), host_uid,
                               sandbox.build_etc(root / "etc"), cgroups, sandbox.bwrap_features(bwrap), setpriv,
                               thread_uid)


def test_sandbox_is_born_in_its_cgroup_and_the_spawning_thread_goes_home() -> None:
    """cgroup v1: the spawning thread joins the call's groups only while it starts bwrap."""
    cgroups = Cgroups.detect(1 << 30, 64)
    if cgroups is None:
        pytest.skip("no writable pids/memory cgroups here")
    group = cgroups.for_this_process()
    own_groups = Path(f"/proc/self/task/{threading.get_native_id()}/cgroup")
    home = own_groups.read_text()
    root = devstack.reachable_dir("rw-cg-")
    host_uid = 65534 if os.geteuid() == 0 else None
    process = None
    try:
        workspace = root / "ws"
        workspace.mkdir()
        if host_uid is not None:
            os.chown(workspace, host_uid, host_uid)
        thread_uid = sandbox.ThreadUid.for_this_machine(host_uid) if host_uid is not None else None
        process = _runner(root, host_uid, cgroups, thread_uid=thread_uid).spawn("sleep 30", workspace, "", False)
        assert own_groups.read_text() == home
        for directory in group.dirs:  # bwrap's sandbox child, and so everything it starts
            assert str(process.group_leader) in (directory / "cgroup.procs").read_text().split()
        if not group.spawns_inside:
            pytest.skip("this host moves the sandbox in after it starts (cgroup v2, or groups not writable)")
    finally:
        if process is not None:
            process.kill()
            process.wait()
            process.close()
        shutil.rmtree(root, ignore_errors=True)
        for directory in group.dirs:
            with contextlib.suppress(OSError):
                directory.rmdir()  # else still emptying: workers remove stale groups at start


def test_a_spawn_whose_thread_cannot_leave_the_cgroup_fails_and_leaves_nothing_running(tmp_path: Path) -> None:
    cgroups = Cgroups.detect(1 << 30, 64)
    group = cgroups.for_this_process() if cgroups else None
    if cgroups is None or group is None or not group.spawns_inside:
        pytest.skip("no cgroup v1 groups that this thread can join here")
    cgroups._own = (os.getpid(), dataclasses.replace(group, homes=(tmp_path,)))  # no way back
    root = devstack.reachable_dir("rw-noway-")
    try:
        workspace = root / "ws"
        workspace.mkdir()
        with pytest.raises(FileNotFoundError):
            _runner(root, None, cgroups, None).spawn("sleep 30", workspace, "", False)
        deadline = time.monotonic() + 30
        while (others := set((group.dirs[0] / "cgroup.procs").read_text().split()) - {str(os.getpid())}) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not others, f"left running in the call's group: {others}"
    finally:
        for home in group.homes:
            (home / "tasks").write_text("0")  # this thread goes home by hand
        shutil.rmtree(root, ignore_errors=True)
        for directory in group.dirs:
            with contextlib.suppress(OSError):
                directory.rmdir()


def test_an_idle_pool_group_outlives_another_workers_sweep_and_is_remade_if_removed() -> None:
    """A pool process's group is made once; a worker starting later on the same host sweeps old
    groups, which must not take a live process's (its next call could not start), and a group
    removed anyway is made again."""
    cgroups = Cgroups.detect(1 << 30, 64)
    if cgroups is None:
        pytest.skip("no writable pids/memory cgroups here")
    group = cgroups.for_this_process()
    try:
        hour_ago = time.time() - 3600
        for directory in group.dirs:
            os.utime(directory, (hour_ago, hour_ago))
        assert Cgroups.detect(1 << 30, 64) is not None  # another worker starts, and sweeps
        assert all(directory.is_dir() for directory in group.dirs)
        for directory in group.dirs:
            directory.rmdir()  # removed anyway
        assert cgroups.for_this_process().dirs == group.dirs
        assert all(directory.is_dir() for directory in group.dirs)
    finally:
        for directory in group.dirs:
            with contextlib.suppress(OSError):
                directory.rmdir()


def test_a_pool_group_is_named_for_its_process_not_only_its_pid() -> None:
    """pids come round again: a group named by pid alone would be inherited by a new process."""
    from workers.cgroups import _owner_alive, group_name
    mine = group_name(os.getpid())
    assert mine.startswith(f"pool-{os.getpid()}-") and _owner_alive(mine)
    assert not _owner_alive(f"pool-{os.getpid()}-1")  # the same pid, started at another time
    assert not _owner_alive(f"pool-{os.getpid()}")  # the old name: no start time, never taken as live
    assert not _owner_alive("pool-0-0") and not _owner_alive("unrelated")


def test_stream_copy_counts_the_bytes_its_cutter_holds_back() -> None:
    """The output cap is measured in kept bytes: a character's start held back at the cap must count,
    or flushing it at the cut would keep up to 3 bytes more than the cap."""
    from workers.relay import StreamCopy
    copy = StreamCopy("stdout", 1024)
    copy.take(copy.cutter.feed(b"ab\xe2\x82"))  # "ab" and the first two bytes of "€"
    assert (copy.size, copy.kept) == (2, 4)


def test_spare_file_is_linked_in_never_over_a_name_and_only_once(tmp_path: Path) -> None:
    """A patch's temp file made ahead (O_TMPFILE): linked in under the temp name, never over an
    existing entry; nameless until then, so nothing is left behind in the root."""
    root, target = tmp_path / "root", tmp_path / "root" / "tenant" / "run"
    target.mkdir(parents=True)
    spare = workspace.SpareFile(root)
    dir_fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert spare.take(dir_fd, "x") is None  # none made yet
        spare.restock()
        assert spare.fd is not None and sorted(p.name for p in root.iterdir()) == ["tenant"]
        (target / "taken").write_bytes(b"someone else's")
        assert spare.take(dir_fd, "taken") is None  # never replaces an entry
        assert (target / "taken").read_bytes() == b"someone else's"
        before = os.fstat(spare.fd).st_ino
        fd = spare.take(dir_fd, ".f.rw-1.tmp")
        assert fd is not None and spare.fd is None
        os.write(fd, b"new bytes")
        os.close(fd)
        assert (target / ".f.rw-1.tmp").read_bytes() == b"new bytes"
        assert (target / ".f.rw-1.tmp").stat().st_ino == before
        assert spare.take(dir_fd, ".f.rw-2.tmp") is None  # used up until the next restock
    finally:
        os.close(dir_fd)


def test_replace_uses_a_spare_and_falls_back_without_one(tmp_path: Path) -> None:
    """Across filesystems the link fails (EXDEV) and the temp file is created in place; either way
    the file is replaced whole and no temp file is left."""
    target = tmp_path / "ws"
    target.mkdir()
    other_fs = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None
    roots = [tmp_path] + ([other_fs] if other_fs and os.stat(other_fs).st_dev != os.stat(tmp_path).st_dev else [])
    dir_fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for n, root in enumerate(roots):
            spare = workspace.SpareFile(root)
            spare.restock()
            made = spare.fd
            workspace.replace(dir_fd, "f.txt", b"version %d\n" % n, workspace.read(dir_fd, "f.txt"), spare=spare)
            assert (target / "f.txt").read_bytes() == b"version %d\n" % n
            assert sorted(p.name for p in target.iterdir()) == ["f.txt"]
            assert (spare.fd is None) == (root == tmp_path), root  # used on the same filesystem only
            if spare.fd is not None:
                assert spare.fd == made
                os.close(spare.fd)
    finally:
        os.close(dir_fd)
