"""No sandbox at all: `RUNWARDEN_SANDBOX=none`, for development where bubblewrap cannot run."""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from shared.paths import WHOLE_WORKSPACE, ShellView
from workers.cgroups import Cgroups
from workers.sandbox.base import (ColdRunner, Go, Limits, NotStarted, PopenProcess, backstop_prelude, check_cwd,
                                  environment, let_commands_start_with_default_signals)


class UnsafeRunner(ColdRunner):
    """No sandbox at all: only for development where bubblewrap cannot run, and chosen explicitly."""

    name = "none"

    def __init__(self, limits: Limits, cgroups: Cgroups | None = None) -> None:
        self.limits = limits
        self.cgroups = cgroups
        self._prelude = backstop_prelude(limits, cgroups is not None)

    def spawn(self, command: str, workspace: Path, cwd: str, network: bool,
              view: ShellView = WHOLE_WORKSPACE, go: Go | None = None, new_run: bool = False) -> PopenProcess:
        check_cwd(view, cwd)  # nothing else of the view: without a sandbox the command sees everything
        if go is not None and not go():  # nothing to overlap it with: this bash starts its command
            raise NotStarted()
        let_commands_start_with_default_signals()
        prelude = self._prelude
        if self.cgroups:  # nothing isolates this bash, so it can join its cgroup itself
            procs = (directory / "cgroup.procs" for directory in self.cgroups.for_this_process().dirs)
            prelude = "".join(f"echo $$ > {shlex.quote(str(path))} && " for path in procs) + prelude
        env = environment() | {"HOME": str(workspace)}
        meter = self.meter()
        try:
            popen = subprocess.Popen(
                ["/bin/bash", "-c", prelude, "/bin/bash", command], cwd=workspace / cwd if cwd else workspace,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                start_new_session=True,
            )
        except BaseException:
            meter.stop()
            raise
        return PopenProcess(popen, popen.pid, meter)
