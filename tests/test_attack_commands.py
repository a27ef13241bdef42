"""allowed_commands: every program a shell command would run must be listed, else 403 command_forbidden.

First through the API with a token limited to ls, cat and echo (each bypass attempt is refused before
anything is queued, and the file it would delete survives), then shared/commands.py on its own.
"""
from __future__ import annotations

import uuid

import pytest

from shared.commands import HARMLESS_BUILTINS, check, programs
from shared.errors import CommandForbidden

ALLOWED = ["ls", "cat", "echo"]

BYPASSES = [
    "rm -rf x",
    "ls; rm x",
    "ls && rm x",
    "ls || rm x",
    "ls & rm x",
    "ls\nrm x",
    "ls | sh",
    "echo $(rm x)",
    "echo \"$(rm x)\"",
    "echo `rm x`",
    "(rm x)",
    "{ rm x; }",
    "! rm x",
    "ls > >(rm x)",
    "cat <(rm x)",
    "ls 2>$(rm x)",
    "ls <<< $(rm x)",
    "x=${a:-$(rm x)}; ls",
    "echo ${x/$(rm x)/}",
    "$CMD",
    "${CMD} x",
    "$(echo rm) x",
    "~/rm x",
    "/bin/rm x",
    "./rm x",
    "eval rm x",
    "exec rm x",
    "command rm x",
    "builtin eval rm x",
    "env rm x",
    "xargs rm < x",
    "source x",
    ". x",
    "trap 'rm x' EXIT",
    "f() { rm x; }; f",
    "echo() { rm x; }; echo",
    "if true; then rm x; fi",
    "for i in 1; do rm x; done",
    "while false; do rm x; done",
    "case a in a) rm x;; esac",
    "time rm x",
    "coproc rm x",
    "a=1 rm x",
    "cat <<EOF\n$(rm x)\nEOF",
    "cat <<EOF\n`rm x`\nEOF",
    "echo '$(rm x)'; test -v 'a[$(rm x)]'",
    "[[ $(rm x) ]]",
    "bash -c 'rm x'",
    "sh -c id",
    "alias ls=rm; ls x",
    "enable -f x y",
    "ls (",
    "ls;;",
    "echo 'unterminated",
]


def seed(agent) -> None:  # type: ignore[no-untyped-def]
    agent.workspace.mkdir(parents=True, exist_ok=True)
    (agent.workspace / "x").write_text("keep me\n")


@pytest.fixture(scope="module")
def limited(stack):  # type: ignore[no-untyped-def]
    from tests.conftest import Agent
    agent = Agent(stack, f"t{uuid.uuid4().hex[:10]}", f"r{uuid.uuid4().hex[:8]}", ["shell:exec", "files:read"],
                  ["**"], commands=ALLOWED)
    seed(agent)
    return agent


def test_allowed_program_runs(limited) -> None:
    response = limited.shell("ls -la", wait=30)
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    assert result["exit_code"] == 0 and " x\n" in result["stdout"]
    piped = limited.shell("cat x | cat; echo done; ls", wait=30).json()["result"]
    assert piped["stdout"] == "keep me\ndone\nx\n", piped


@pytest.mark.parametrize("command", BYPASSES)
def test_bypass_attempt_is_command_forbidden(limited, command: str) -> None:
    response = limited.shell(command, wait=None)
    assert response.status_code == 403, (command, response.text)
    assert response.headers["Content-Type"] == "application/problem+json"
    assert response.json()["code"] == "command_forbidden"
    assert (limited.workspace / "x").read_text() == "keep me\n"


def test_refusal_records_nothing(limited) -> None:
    key = uuid.uuid4().hex
    refused = limited.call("execute_shell_command", {"command": "rm x"}, key=key)
    assert refused.status_code == 403
    again = limited.call("execute_shell_command", {"command": "rm x"}, key=key)
    assert again.status_code == 403 and "Idempotent-Replayed" not in again.headers


def test_empty_allow_list_allows_only_harmless_builtins(make_agent) -> None:
    caller = make_agent(scopes=["shell:exec"], commands=[])
    assert caller.shell("echo hi; cd .; pwd", wait=30).json()["result"]["stdout"] == "hi\n/workspace\n"
    refused = caller.shell("ls", wait=None)
    assert refused.status_code == 403 and refused.json()["code"] == "command_forbidden"


def test_nul_byte_in_command_is_schema_invalid(agent) -> None:
    """bash -c cannot take a NUL: refused by the schema, never run cut short at the NUL."""
    response = agent.shell("echo a\x00b", wait=15)
    assert response.status_code == 400 and response.headers["Content-Type"] == "application/problem+json"
    assert response.json()["code"] == "schema_invalid", response.text
    assert [e["pointer"] for e in response.json()["errors"]] == ["/parameters/command"], response.text


def test_without_allowed_commands_any_program_runs(agent) -> None:
    assert agent.shell("id -u && true", wait=30).json()["result"]["stdout"] == "1000\n"


# Strings that evaluate a constructed `$(…)` at run time: the text holds no substitution, so the parser
# sees only `echo`, `test`, `printf` or `read`, all of which pass as allowed or harmless builtins.
RUNTIME_SUBSTITUTIONS = {
    "indirect_expansion": 'p=$; x="a[${p}(touch pwned)]"; echo ${!x}',
    "prompt_expansion": 'p=$; y="(touch pwned)"; z="$p$y"; echo "${z@P}"',
    "substring_offset": 'p=$; x="a[${p}(touch pwned)]"; echo ${p:x}',
    "test_v_subscript": 'p=$; x="a[${p}(touch pwned)]"; test -v "$x"; echo',
    "printf_v_subscript": 'p=$; x="a[${p}(touch pwned)]"; printf -v "$x" %s 1; echo',
    "read_subscript": 'p=$; x="a[${p}(touch pwned)]"; read "$x" <<< 1; echo',
}


@pytest.mark.parametrize("name", sorted(RUNTIME_SUBSTITUTIONS))
def test_runtime_built_substitution_is_command_forbidden(make_agent, name: str) -> None:
    caller = make_agent(scopes=["shell:exec"], commands=ALLOWED)
    response = caller.shell(RUNTIME_SUBSTITUTIONS[name], wait=30)
    try:
        assert response.status_code == 403, response.text
        assert response.json()["code"] == "command_forbidden"
    finally:
        assert not (caller.workspace / "pwned").exists(), "touch ran, though it is not an allowed command"


# --- shared/commands.py on its own -----------------------------------------------------------------

@pytest.mark.parametrize("command, expected", [
    ("ls -la", ["ls"]),
    ("ls | grep x | wc -l", ["ls", "grep", "wc"]),
    ("a && b || c; d & e", ["a", "b", "c", "d", "e"]),
    ("echo $(date) `whoami`", ["echo", "date", "whoami"]),
    ("echo $(cat $(find .))", ["echo", "cat", "find"]),
    ("diff <(sort a) >(tee b)", ["diff", "sort", "tee"]),
    ("(cd src && make)", ["cd", "make"]),
    ("{ git status; }", ["git"]),
    ("f() { rm x; }; f", ["rm", "f"]),
    ("X=1 Y=2 env", ["env"]),
    ("X=1", []),
    ("> out", []),
    ('"rm" x', ["rm"]),
    ("r\\m x", ["rm"]),
    ("if test -f x; then cat x; else touch x; fi", ["test", "cat", "touch"]),
])
def test_programs_finds_every_program(command: str, expected: list[str]) -> None:
    assert programs(command) == expected


@pytest.mark.parametrize("command", [
    "$CMD", "${CMD}", "$(which rm) x", "`which rm` x", "~/bin/tool",
    "x=${a:-$(rm x)}", "cat <<EOF\n$(rm x)\nEOF", "echo '$(rm x)'", "echo '`rm x`'",
    "ls (", "ls;;", "if", "echo 'unterminated", "case a in a) rm;; esac", "((",
])
def test_programs_refuses_what_it_cannot_see(command: str) -> None:
    with pytest.raises(CommandForbidden) as info:
        programs(command)
    assert info.value.code == "command_forbidden" and info.value.status == 403


@pytest.mark.parametrize("command", ["ls -la", "cat a b | cat", "echo hi > f", "cd src && ls", "pwd; true",
                                     "x=1; echo $x ${x}"])
def test_check_allows_listed_programs_and_harmless_builtins(command: str) -> None:
    check(command, tuple(ALLOWED))


@pytest.mark.parametrize("command", ["test -f x && cat x", "[ -d src ] || echo no", "printf '%s\\n' a",
                                     "read -r line < f; echo \"$line\""])
def test_builtins_that_evaluate_variables_need_listing(command: str) -> None:
    """test/[/printf/read can evaluate array subscripts held in variables: not harmless by default."""
    with pytest.raises(CommandForbidden):
        check(command, tuple(ALLOWED))
    check(command, tuple(ALLOWED) + ("test", "[", "printf", "read"))


@pytest.mark.parametrize("command", ["rm x", "/bin/ls", "ls; /usr/bin/cat x", "eval ls", "exec ls",
                                     "command ls", "builtin echo", "source f", "trap ls EXIT", "xargs ls"])
def test_check_refuses_other_programs(command: str) -> None:
    with pytest.raises(CommandForbidden):
        check(command, tuple(ALLOWED))


def test_harmless_builtins_cannot_run_code() -> None:
    for dangerous in ("eval", "exec", "command", "builtin", "source", ".", "trap", "enable", "alias",
                      "declare", "typeset", "mapfile", "readarray", "let", "fc", "hash", "bind", "coproc"):
        assert dangerous not in HARMLESS_BUILTINS, dangerous


@pytest.mark.parametrize("command, expected", [
    ("(" * 2000 + ")" * 2000, None),  # "((" opens arithmetic, which a policy cannot check
    ("$(" * 1000 + ")" * 1000, None),
    ("'" * 10001, None),  # an odd number of quotes: unterminated
    ("a|" * 2000 + "a", ["a"] * 2001),
    ("echo " + "x" * 65536, ["echo"]),
    ("\\" * 1000, ["\\" * 500]),  # each pair is one escaped backslash: one word, one program name
], ids=["parentheses", "substitutions", "quotes", "pipeline", "long_word", "backslashes"])
def test_programs_survives_pathological_input(command: str, expected: list[str] | None) -> None:
    """A definite answer for each: the programs, or a refusal (CommandForbidden, a 403); never a crash."""
    if expected is None:
        with pytest.raises(CommandForbidden):
            programs(command)
    else:
        assert programs(command) == expected
