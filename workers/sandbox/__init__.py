"""Runners that start one shell command, by runner: bubblewrap (the default, `bwrap`), a sandbox
prepared ahead of time and handed over by the keeper (`prepared`, `keeper`), or, explicitly, none
(`unsafe`). What they share, the started process as an interface included, is in `base`; what the
host prepares for them in `host`; the runner a worker uses is built by `build`."""
from workers.sandbox.base import (SANDBOX_HOME, Ahead, Go, Key, NotStarted, SANDBOX_UID, Limits, PopenProcess, Process, Runner, backstop_prelude,
                                  environment, frame, let_commands_start_with_default_signals, limits_prelude,
                                  write_frame)
from workers.sandbox.build import build_runner, self_test, communicate
from workers.sandbox.bwrap import BwrapRunner, _close, _open_view
from workers.sandbox.host import RUNTIME_DIR, build_etc, bwrap_features, find_bwrap, runtime_dir, stage_bwrap
from workers.sandbox.thread_uid import ThreadUid
from workers.sandbox.unsafe import UnsafeRunner

__all__ = [
    "Ahead", "Go", "Key", "NotStarted",
    "SANDBOX_HOME", "SANDBOX_UID", "RUNTIME_DIR", "Limits", "PopenProcess", "Process", "Runner", "BwrapRunner",
    "ThreadUid", "UnsafeRunner", "backstop_prelude", "build_etc", "build_runner", "bwrap_features", "environment",
    "find_bwrap",
    "let_commands_start_with_default_signals", "limits_prelude", "runtime_dir", "self_test", "stage_bwrap",
    "communicate", "frame", "write_frame", "_close", "_open_view",
]
