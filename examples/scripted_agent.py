"""An agent loop with no model: a scripted transcript driven through `POST /v1/tool-use`.

Each turn is what a model would emit (Anthropic `tool_use` blocks, sometimes several at once), built
from what the earlier turns answered; each answer is checked the way a platform relies on it: every
`tool_use_id` comes back on its `tool_result`, in order, and the workspace's state carries from turn
to turn (the sha a read returns is the base_sha the next patch uses). The script writes a tiny
program with two bugs and its test, runs the test, reads the failure, patches, runs again, recovers
from a stale patch, and ends green.

    RUNWARDEN_URL=http://127.0.0.1:8080 RUNWARDEN_TOKEN=... python examples/scripted_agent.py

Only the standard library: this is what a platform's own glue looks like.
"""
from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ZERO_SHA = "0" * 40
CALC = "add() { echo $(( $1 - $2 )); }\nmul() { echo $(( $1 + $2 )); }\n\"$@\"\n"
TEST = ("#!/bin/bash\nfail=0\n"
        "check() { got=$(bash calc.sh \"$1\" \"$2\" \"$3\"); [ \"$got\" = \"$4\" ] || "
        "{ echo \"FAIL $1 $2 $3: expected $4, got $got\"; fail=1; }; }\n"
        "check add 2 3 5\ncheck mul 2 3 6\n[ $fail = 0 ] && echo \"all tests passed\"\nexit $fail\n")


def creation_diff(path: str, text: str) -> str:
    lines = text.splitlines(keepends=True)
    return f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{line}" for line in lines)


def line_diff(path: str, old: str, new: str, text: str) -> str:
    """A one-line change of `text`, as a model writes it: the diff names the line's number."""
    lines = text.splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if line == old)
    return f"--- a/{path}\n+++ b/{path}\n@@ -{index + 1} +{index + 1} @@\n-{old}+{new}"


@dataclass
class Transcript:
    url: str
    token: str
    turns: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = field(default_factory=list)
    shas: dict[str, str] = field(default_factory=dict)

    def turn(self, *blocks: dict[str, Any]) -> list[dict[str, Any]]:
        """Send one assistant turn; check every id comes back, in order."""
        body = json.dumps(list(blocks) if len(blocks) > 1 else blocks[0]).encode()
        request = urllib.request.Request(f"{self.url}/v1/tool-use", data=body, method="POST", headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        results = answer if isinstance(answer, list) else [answer]
        assert [r["tool_use_id"] for r in results] == [b["id"] for b in blocks], "ids must come back in order"
        assert all(r["type"] == "tool_result" for r in results)
        self.turns.append((list(blocks), results))
        return results


def block(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": name, "input": arguments}


def text(result: dict[str, Any], index: int = 0) -> str:
    return str(result["content"][index]["text"])


def sha_in(result: dict[str, Any]) -> str:
    """The sha a result names (read_file: 'sha X'; a patch: 'new sha X'; a stale patch: 'current sha is X')."""
    found = re.search(r"\b([0-9a-f]{40})\b", result["content"][-1]["text"])
    assert found, result
    return found.group(1)


def run(url: str, token: str, say: Callable[[str], None] = lambda line: None) -> Transcript:
    t = Transcript(url.rstrip("/"), token)
    # 1-2: write the program and its test.
    for path, content in (("calc.sh", CALC), ("test.sh", TEST)):
        [created] = t.turn(block("apply_file_patch", path=path, diff=creation_diff(path, content), base_sha=ZERO_SHA))
        assert not created["is_error"], created
        t.shas[path] = sha_in(created)
    # 3: run the tests: both fail.
    [failed] = t.turn(block("execute_shell_command", command="bash test.sh"))
    assert failed["is_error"] and "FAIL add 2 3: expected 5, got -1" in text(failed), failed
    say("turn 3: tests fail: " + text(failed).splitlines()[0])
    # 4: read the program (and the test) to see why, in one turn.
    read_calc, read_test = t.turn(block("read_file", path="calc.sh"), block("read_file", path="test.sh"))
    assert text(read_calc) == CALC and text(read_test) == TEST and sha_in(read_calc) == t.shas["calc.sh"]
    # 5: fix add, against the sha just read.
    old_sha = t.shas["calc.sh"]
    fix = line_diff("calc.sh", "add() { echo $(( $1 - $2 )); }\n", "add() { echo $(( $1 + $2 )); }\n", CALC)
    [patched] = t.turn(block("apply_file_patch", path="calc.sh", diff=fix, base_sha=old_sha))
    assert not patched["is_error"], patched
    t.shas["calc.sh"] = sha_in(patched)
    # 6: run again: mul still fails.
    [still] = t.turn(block("execute_shell_command", command="bash test.sh"))
    assert still["is_error"] and "FAIL mul 2 3: expected 6, got 5" in text(still) and "FAIL add" not in text(still)
    say("turn 6: " + text(still).splitlines()[0])
    # 7: a patch written against the old file is refused, naming the current sha.
    current = CALC.replace("$1 - $2", "$1 + $2", 1)
    fix_mul = line_diff("calc.sh", "mul() { echo $(( $1 + $2 )); }\n", "mul() { echo $(( $1 * $2 )); }\n", current)
    [stale] = t.turn(block("apply_file_patch", path="calc.sh", diff=fix_mul, base_sha=old_sha))
    assert stale["is_error"] and "read the file again" in text(stale).lower() and t.shas["calc.sh"] in text(stale)
    say("turn 7: stale patch refused, as it should be")
    # 8: read it again, as told.
    [reread] = t.turn(block("read_file", path="calc.sh"))
    assert text(reread) == current and sha_in(reread) == t.shas["calc.sh"]
    # 9: the same fix against the current sha.
    [patched] = t.turn(block("apply_file_patch", path="calc.sh", diff=fix_mul, base_sha=sha_in(reread)))
    assert not patched["is_error"], patched
    # 10: green.
    [green] = t.turn(block("execute_shell_command", command="bash test.sh"))
    assert not green["is_error"] and text(green) == "all tests passed\n", green
    say("turn 10: " + text(green).strip())
    # 11: two checks at once; the second one counts its runs.
    counted = block("execute_shell_command", command="echo run >> runs.log; bash calc.sh mul 6 7")
    shown, product = t.turn(block("execute_shell_command", command="cat -A calc.sh | head -1"), counted)
    assert text(shown) == "add() { echo $(( $1 + $2 )); }$\n" and text(product) == "42\n"
    # 12: the network dropped the answer, so the platform sends the same block again: not run twice.
    [again] = t.turn(counted)
    assert again == product
    [runs] = t.turn(block("execute_shell_command", command="wc -l < runs.log"))
    assert text(runs) == "1\n", runs
    say(f"{len(t.turns)} turns, green, and the retried block ran once")
    return t


def main() -> int:
    url, token = os.environ.get("RUNWARDEN_URL", "http://127.0.0.1:8080"), os.environ.get("RUNWARDEN_TOKEN", "")
    if not token:
        print("set RUNWARDEN_TOKEN (runwarden token mint ... --scope files:read --scope files:write "
              "--scope shell:exec)", file=sys.stderr)
        return 2
    run(url, token, say=print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
