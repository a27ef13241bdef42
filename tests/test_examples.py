"""The examples run against the real stack, as a platform would run them."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from tests.conftest import Agent

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_scripted_agent_loop_goes_green_in_twelve_turns(agent: Agent) -> None:
    transcript = load("scripted_agent").run(agent.stack.base_url, agent.token)
    assert len(transcript.turns) >= 12
    sent = [block["id"] for blocks, _ in transcript.turns for block in blocks]
    answered = [result["tool_use_id"] for _, results in transcript.turns for result in results]
    assert answered == sent
    assert (agent.workspace / "calc.sh").read_text().startswith("add() { echo $(( $1 + $2 )); }\n")
    assert (agent.workspace / "runs.log").read_bytes() == b"run\n"
