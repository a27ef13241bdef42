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


# --- issue 18 item 1: a listed name is the system's program, whatever the command sets -------------

from shared.commands import NEVER_ALLOWED  # noqa: E402  (appended section)

# Planted by an earlier call of a token without a policy: a workspace `bin/ls` and `bin/wc` that
# leave a marker, a shared object whose constructor leaves it, and a file whose name, read as an
# array subscript by bash, runs `touch pwned`.
PLANT = r"""set -e
mkdir -p bin docs sub && echo doc > docs/readme && echo in-sub > sub/f && echo a > a
printf '#!/bin/sh\n: > "$HOME/pwned"\n' > bin/ls && chmod +x bin/ls && cp bin/ls bin/wc
printf '%s\n' '#include <stdio.h>' '#include <stdlib.h>' \
  '__attribute__((constructor)) static void hit(void) {' \
  '  char path[4096]; snprintf(path, sizeof path, "%s/pwned", getenv("HOME"));' \
  '  FILE *marker = fopen(path, "w"); if (marker) fclose(marker); }' > x.c
gcc -shared -fPIC -o x.so x.c
touch 'q[$(touch pwned)]'
"""
LISTED = ["ls", "wc", "cat", "test", "[", "printf", "read"]

# Each one runs the planted code when no policy applies (test_name_attack_works_without_a_policy).
NAME_ATTACKS = [
    "PATH=bin ls",
    "PATH=bin; ls",
    "PATH=bin\nls",
    "PATH=$PWD/bin ls",
    "(PATH=bin; ls)",
    "echo $(PATH=bin ls)",
    "ls | PATH=bin wc -l",
    "export PATH=bin; ls",
    "for PATH in bin; do ls; done",
    "LD_PRELOAD=/workspace/x.so ls",
    "LD_PRELOAD=/workspace/x.so; export LD_PRELOAD; ls",
    "ls() { ./bin/ls; }; ls",
    "hash -p bin/ls ls; ls",
    "printf -v PATH %s bin; ls",
    "read PATH <<< bin; ls",
    "test -v q*",
    "[ -v q* ]",
    "for f in q*; do echo $[f]; done",
]


@pytest.fixture(scope="module")
def planted(stack):  # type: ignore[no-untyped-def]
    """(unrestricted agent, agent limited to LISTED) on one workspace holding the planted files."""
    from tests.conftest import Agent
    tenant, run_id = f"t{uuid.uuid4().hex[:10]}", f"r{uuid.uuid4().hex[:8]}"
    planter = Agent(stack, tenant, run_id, ["shell:exec", "files:read"], ["**"])
    result = planter.shell(PLANT, wait=60).json()["result"]
    assert result["exit_code"] == 0, result
    return planter, Agent(stack, tenant, run_id, ["shell:exec", "files:read"], ["**"], commands=LISTED)


@pytest.mark.parametrize("command", NAME_ATTACKS)
def test_name_attack_works_without_a_policy(planted, command: str) -> None:
    """The attacks below are real: without allowed_commands each one runs the planted code."""
    planter, _ = planted
    marker = planter.workspace / "pwned"
    try:
        assert planter.shell(command, wait=60).status_code == 200
        assert marker.exists(), command
    finally:
        planter.shell("rm -f pwned", wait=60)


@pytest.mark.parametrize("command", NAME_ATTACKS)
def test_name_attack_is_command_forbidden(planted, command: str) -> None:
    planter, limited_agent = planted
    marker = limited_agent.workspace / "pwned"
    assert not marker.exists()
    try:
        response = limited_agent.shell(command, wait=60)
        assert response.status_code == 403, (command, response.text)
        assert response.json()["code"] == "command_forbidden"
        assert not marker.exists(), f"{command!r} ran the planted code"
    finally:
        planter.shell("rm -f pwned", wait=60)


@pytest.mark.parametrize("command, stdout", [
    ("ls -la docs | wc -l", "4\n"),
    ("ls docs | wc -l", "1\n"),
    ("cat a > b; cat b", "a\n"),
    ("for f in a docs/readme; do cat \"$f\"; done", "a\ndoc\n"),
    ("cd sub && ls", "f\n"),
    ("cd bin; ls", "ls\nwc\n"),  # PATH never holds the workspace, so this is the system's ls
    ("x=docs; ls $x", "readme\n"),
    ("read -r line < a; echo \"$line\"", "a\n"),
    ("[ -f a ] && printf '%s\\n' yes; test -d bin && echo dir", "yes\ndir\n"),
    ("ls PATH=bin 2>/dev/null; echo $?", "2\n"),  # an argument, not an assignment
    ("cat <<EOF\n$HOME\nEOF", "/workspace\n"),
])
def test_listed_programs_run_beside_planted_ones(planted, command: str, stdout: str) -> None:
    _, limited_agent = planted
    response = limited_agent.shell(command, wait=60)
    assert response.status_code == 200, (command, response.text)
    result = response.json()["result"]
    assert (result["exit_code"], result["stdout"]) == (0, stdout), (command, result)
    assert not (limited_agent.workspace / "pwned").exists()


def test_refusal_says_how_to_pass_values(planted) -> None:
    _, limited_agent = planted
    detail = limited_agent.shell("PATH=bin ls", wait=None).json()["detail"]
    assert "environment" in detail and "arguments" in detail, detail
    detail = limited_agent.shell("PATH=bin; ls", wait=None).json()["detail"]
    assert "lowercase" in detail and "'PATH'" in detail, detail


@pytest.mark.parametrize("command", [
    "PAGER=bin/x; git log", "GIT_PAGER=bin/x git log", "GIT_EXEC_PATH=bin git status", "EDITOR=bin/x git commit",
    "PYTHONPATH=. python3 -c 1", "NODE_OPTIONS=--require=./x node", "BASH_ENV=x bash", "ENV=x sh", "IFS=/; ls",
    "GCONV_PATH=. ls", "x=1 ls", "a=1 b=2 ls", "ls; (cd d; Path=bin; ls)", "echo \"$(LANG=x ls)\"", "echo `PATH=bin ls`",
    "PATH+=:bin; ls", "for GIT_PAGER in bin/x; do git log; done", "for X in 1; do ls; done",
    "function ls { cat; }; ls", "f() { ls; }", "export x", "declare x=1", "local x", "readonly x", "typeset x",
    "unset PATH", "set -a", "shopt -s expand_aliases", "enable -n test", "alias ls=cat", "wait -p PATH",
    "mapfile lines < f", "getopts a opt", "let x=1", "source f", ". f", "eval ls", "exec ls", "command ls",
    "builtin cd", "trap ls EXIT", "compgen -C ls x", "jobs -x ls",
    "printf -v x %s 1", "printf -vx %s 1", "printf '-v' x 1", "printf \\-v x 1", "printf $(echo -v) x 1",
    "printf \"$f\" x", "read PATH", "read -a PATH", "read \"$x\"", "read a\\[\\$\\(id\\)\\]", "read Line",
    "test -v x", "test '-v' x", "[ -v x ]", "test \"$a\" \"$b\"", "[ \"$a\" \"$b\" \"$c\" ]", "[ -f $f ]", "[ -f * ]",
    "[ -f x", "test $(echo -v) x", "[ ! \"$a\" \"$b\" ]", "[ \"$@\" x ]", "echo `test \\\\-v x`",
    "echo `printf \\\\-v PATH x; ls`", "echo $[x]", "for f in *; do echo $[f]; done",
    "for f in *; do [ \"$f\" \"$f\" ]; done",
])
def test_check_refuses_what_changes_resolution_or_loading(command: str) -> None:
    with pytest.raises(CommandForbidden):
        check(command, tuple(ALLOWED + ["git", "python3", "node", "bash", "sh", "test", "[", "printf", "read"]
                             + sorted(NEVER_ALLOWED)))


@pytest.mark.parametrize("command", [
    "x=1; echo $x", "x_2+=y; ls", "for f in *; do cat \"$f\"; done", "read -r line < f", "read -a parts -d , x",
    "printf '%s\\n' a", "printf \"%s: $x\\n\" a", "printf -- -v", "printf '\\n'", "[ -f \"$f\" ]", "[ \"$x\" = y ]",
    "[ ! -e \"$f\" ]", "test -n \"$(ls)\"", "[ -e a -a -e b ]", "[ \\( -f a \\) ]", "ls > out 2>&1", "cat < f | cat",
    "cd sub && ls", "echo PATH=bin", "ls PATH=bin", "cat <<EOF\n$HOME\nEOF",
])
def test_check_allows_ordinary_use_of_listed_programs(command: str) -> None:
    check(command, tuple(ALLOWED + ["test", "[", "printf", "read"]))


def test_never_allowed_builtins_are_not_harmless() -> None:
    assert not NEVER_ALLOWED & HARMLESS_BUILTINS
    for name in ("export", "declare", "typeset", "readonly", "local", "set", "shopt", "hash", "enable", "alias",
                 "source", ".", "eval", "exec", "command", "builtin", "unset", "mapfile", "getopts", "trap"):
        assert name in NEVER_ALLOWED, name


def test_sandbox_exports_no_lowercase_variable() -> None:
    """Lowercase variables may be set under a policy because bash exports none of them: the sandbox's
    environment must never hold one (a lowercase `x=…` would then reach every program)."""
    from workers.sandbox import environment
    assert all(any(c.isupper() for c in name) for name in environment()), environment()
