"""The `allowed_commands` policy: every program a command line would run must be listed.

A policy layer on top of the sandbox, not a substitute for it. The command is parsed with bashlex;
every simple command anywhere in it (pipelines, lists, subshells, `$(…)`, backticks, `<(…)`,
function bodies) names its program. A program word that is not a literal (`$X`, `$(…)`) or a
command line that cannot be parsed is refused, since what it would run cannot be known.

A listed name means the system's program (PATH in the sandbox is fixed and never the workspace), so
a command may not change how names resolve or what a program loads. Capitalised names are where
the shell and programs take their settings (PATH, LD_PRELOAD, BASH_ENV, IFS, GIT_PAGER,
PYTHONPATH…), too many to list: under a policy a command may set only lowercase shell variables
(`x=1`, `for f in …`, `read line`), which bash does not export and nothing but the command reads.
`NAME=value program` (any name) puts NAME in the program's environment and is refused; so are
function definitions, which could stand in for a listed name, and the builtins that export, resolve
or evaluate (NEVER_ALLOWED), even when listed.

Bash evaluates the *contents* of variables as arithmetic in many places (`$((x))`, `$[x]`, `${s:x}`,
`${!x}`, `${x@P}`, `[[ … -eq … ]]`, `test -v`, `printf -v`, `read`, array subscripts), and an array
subscript in such contents can hold a `$(…)` that no parser of the command text can see. So under a
policy only plain `$NAME`/`${NAME}` expansions are allowed, `test`, `[`, `printf` and `read` only in
forms where no expanded word can reach such a place, and only builtins that evaluate nothing pass
unlisted.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Callable

import bashlex
import bashlex.ast
import bashlex.errors

from shared.errors import CommandForbidden

# Builtins that cannot run a program, and never evaluate a variable's contents as code or arithmetic.
HARMLESS_BUILTINS = frozenset({"cd", "echo", "true", "false", "pwd", "exit", ":"})

# Builtins refused under a policy even when listed: no system program has these names, and each one
# sets or exports variables, changes what a name resolves to, or runs text as code.
NEVER_ALLOWED = frozenset({
    "export", "declare", "typeset", "readonly", "local", "unset", "let", "mapfile", "readarray", "getopts",
    "wait",  # wait -p NAME
    "set", "shopt", "hash", "enable", "alias", "unalias", "command", "builtin",
    "source", ".", "eval", "exec", "trap", "jobs", "fc", "compgen", "complete", "compopt", "bind", "history",
})

# `${…}` other than `${NAME}`, arithmetic, `[[`, array subscripts in assignments, and `let`.
_EVALUATING = re.compile(
    r"\$\{(?![A-Za-z_][A-Za-z0-9_]*\})"   # ${!x} ${x:o} ${x@P} ${a[i]} ${#x} ${x=v} …
    r"|\$\(\(|\(\(|\$\["                # $(( … )), (( … )) and the old $[ … ]
    r"|\[\["                              # [[ … ]] evaluates -eq operands as arithmetic
    r"|(?:^|[\s;&|(])[A-Za-z_][A-Za-z0-9_]*\["  # a[…]=… subscript assignment
)
_SHELL_VARIABLE = re.compile(r"[a-z_][a-z0-9_]*")  # no capital: no setting of the shell or of a program
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:\[.*\])?\+?=", re.DOTALL)
_UNSEEN = re.compile(r"[$`*?\[{~\n]")  # an expansion, glob, brace, tilde or line continuation
_BINARY_TESTS = frozenset({"=", "==", "!=", "<", ">", "-nt", "-ot", "-ef", "-eq", "-ne", "-lt", "-le", "-gt",
                           "-ge"})
_VARIABLES_HELP = ("Under allowed_commands a command may set only lowercase shell variables (x=1, for f in …, "
                   "read line); pass other values to programs as arguments.")


@dataclass
class _Simple:
    """One simple command: its assignments, and its words as written (None inside backticks, whose
    extra level of backslash processing the text does not show)."""

    assignments: list[str]
    program: str
    args: list[str | None]


@dataclass
class _Scan(bashlex.ast.nodevisitor):  # type: ignore[misc]
    text: str
    simples: list[_Simple] = field(default_factory=list)
    loop_variables: list[str] = field(default_factory=list)
    functions: list[str] = field(default_factory=list)
    opaque: bool = False
    substitutions: int = 0
    backticks: int = 0

    def visitcommandsubstitution(self, node: bashlex.ast.node, command: bashlex.ast.node) -> None:
        self.substitutions += 1
        self.backticks += self.text.startswith("`", node.pos[0])

    def visitprocesssubstitution(self, node: bashlex.ast.node, command: bashlex.ast.node) -> None:
        self.substitutions += 1

    def visitnodeend(self, node: bashlex.ast.node) -> None:
        if node.kind == "commandsubstitution":
            self.backticks -= self.text.startswith("`", node.pos[0])

    def visitfor(self, node: bashlex.ast.node, parts: list[bashlex.ast.node]) -> None:
        self.loop_variables.append(next((part.word for part in parts if part.kind == "word"), ""))

    def visitfunction(self, node: bashlex.ast.node, name: bashlex.ast.node, body: bashlex.ast.node,
                      parts: list[bashlex.ast.node]) -> None:
        self.functions.append(name.word)

    def visitcommand(self, node: bashlex.ast.node, parts: list[bashlex.ast.node]) -> None:
        words = [part for part in parts if part.kind == "word"]
        assignments = [part.word for part in parts if part.kind == "assignment"]
        if not words:
            if assignments:
                self.simples.append(_Simple(assignments, "", []))
            return  # only assignments or redirections
        program = words[0]
        if any(sub.kind in ("parameter", "commandsubstitution", "processsubstitution", "tilde")
               for sub in getattr(program, "parts", [])):
            self.opaque = True
        args = [None if self.backticks else self.text[word.pos[0]:word.pos[1]] for word in words[1:]]
        self.simples.append(_Simple(assignments, program.word, args))


def _scan(command: str) -> _Scan:
    """Every simple command, loop variable and function of `command`; raises CommandForbidden when
    what it would run cannot be known."""
    if _EVALUATING.search(command):
        raise CommandForbidden("The command uses an expansion that can evaluate code (${…} forms, arithmetic, "
                               "[[ ]] or array subscripts), which a policy cannot check.")
    scan = _Scan(command)
    try:
        for tree in bashlex.parse(command):
            scan.visit(tree)
    except (bashlex.errors.ParsingError, NotImplementedError, AttributeError, IndexError, TypeError,
            ValueError, AssertionError, RecursionError):
        raise CommandForbidden("The command cannot be parsed, so its programs cannot be checked.") from None
    # bashlex does not look inside `${x:-$(…)}` or here-documents: any substitution it did not
    # parse is code we cannot see.
    if scan.opaque:
        raise CommandForbidden("A program name comes from an expansion, so it cannot be checked.")
    if _substitution_marks(command) > scan.substitutions:
        raise CommandForbidden("The command has a substitution the parser cannot see into.")
    return scan


def programs(command: str) -> list[str]:
    """The literal program names in `command`; raises CommandForbidden when it cannot be known."""
    return [simple.program for simple in _scan(command).simples if simple.program]


def _substitution_marks(command: str) -> int:
    opened = command.count("$(") + command.count("<(") + command.count(">(")
    return opened + command.count("`") // 2 + command.count("`") % 2


def check(command: str, allowed: tuple[str, ...]) -> None:
    """Refuse (403 command_forbidden) unless every program is allowed and nothing changes what runs."""
    scan = _scan(command)
    for simple in scan.simples:
        _check_assignments(simple)
    for variable in scan.loop_variables:
        _require_shell_variable(variable)
    if scan.functions:
        raise CommandForbidden(f"Defining a function ({scan.functions[0][:100]!r}) is not allowed under "
                               "allowed_commands: it could stand in for a listed program. Write the commands out.")
    permitted = set(allowed)
    for simple in scan.simples:
        if simple.program:
            _check_program(simple, permitted)


def _check_assignments(simple: _Simple) -> None:
    if simple.assignments and simple.program:
        name = simple.assignments[0].split("=", 1)[0]
        raise CommandForbidden(f"{name[:100]}=… before a program is not allowed under allowed_commands: it would "
                               f"change that program's environment. {_VARIABLES_HELP}")
    for assignment in simple.assignments:
        _require_shell_variable(assignment.split("=", 1)[0].removesuffix("+"))
    if simple.program and (looks_assigned := _ASSIGNMENT.match(simple.program)):  # a form bashlex missed
        _require_shell_variable(looks_assigned.group(1))


def _require_shell_variable(name: str) -> None:
    if not _SHELL_VARIABLE.fullmatch(name):
        raise CommandForbidden(f"Setting {name[:100]!r} is not allowed under allowed_commands: names with capitals "
                               f"(PATH, LD_PRELOAD, GIT_PAGER…) steer the shell and programs. {_VARIABLES_HELP}")


def _check_program(simple: _Simple, permitted: set[str]) -> None:
    program = simple.program
    if program in NEVER_ALLOWED:
        raise CommandForbidden(f"The builtin {program!r} sets variables, changes what names resolve to, or runs "
                               "text as code: it is not allowed under allowed_commands, even when listed.",
                               program=program)
    if not (program in permitted or ("/" not in program and program in HARMLESS_BUILTINS)):
        raise CommandForbidden(f"The program {program[:100]!r} is not in allowed_commands.", program=program[:100])
    rule = _ARGUMENT_RULES.get(program)
    if rule is not None and not rule[0](simple.args):
        raise CommandForbidden(rule[1], program=program)


# --- builtins that shadow a system program, or set variables, and what makes them safe -------------

def _literal(raw: str | None) -> str | None:
    """A word's value when its text holds no expansion, glob, brace or tilde, else None."""
    if raw is None or _UNSEEN.search(raw):
        return None
    try:
        values = shlex.split(raw)
    except ValueError:
        return None
    return values[0] if len(values) == 1 else None


def _one_word(raw: str | None) -> bool:
    """The word stays one word after expansion (no splitting, no globbing, not "$@")."""
    if raw is None:
        return False
    quoted = re.fullmatch(r"'[^']*'", raw) or (re.fullmatch(r'"[^"\\`]*"', raw) and "$@" not in raw)
    return bool(quoted) or _literal(raw) is not None


def _test_is_safe(args: list[str | None]) -> bool:
    """bash's own test reads an array subscript in the operand of -v as code (`test -v 'a[$(id)]'`):
    no -v, and every place bash's rules (test.c, up to four arguments) read an operator is a literal."""
    values = [_literal(raw) for raw in args]
    return "-v" not in values and all(_one_word(raw) for raw in args) and _operators_literal(values)


def _operators_literal(values: list[str | None]) -> bool:
    if len(values) <= 1:
        return True
    if len(values) == 2:
        return values[0] is not None  # "!" or a unary operator
    if len(values) == 3:
        return values[1] in _BINARY_TESTS or (values[0] == "!" and _operators_literal(values[1:])) \
            or (values[0] == "(" and values[2] == ")")
    if len(values) == 4:
        return (values[0] == "!" and _operators_literal(values[1:])) \
            or (values[0] == "(" and values[3] == ")" and _operators_literal(values[1:3]))
    return None not in values  # a full expression: any word may be an operator


def _bracket_is_safe(args: list[str | None]) -> bool:
    return bool(args) and _literal(args[-1]) == "]" and _test_is_safe(args[:-1])


def _printf_is_safe(args: list[str | None]) -> bool:
    """No -v: the options (leading words that start with '-') must be visible."""
    for raw in args:
        value = _literal(raw)
        if value is None:
            return _cannot_start_with_dash(raw)
        if value == "--" or not value.startswith("-"):
            return True
        if "v" in value:
            return False
    return True


def _cannot_start_with_dash(raw: str | None) -> bool:
    if not raw:
        return False
    quoted = raw[0] in "'\""
    first = raw[1:2] if quoted else raw[0]
    return bool(first) and first not in "-$`\"'*?[{~" + ("" if quoted else "\\")


def _read_is_safe(args: list[str | None]) -> bool:
    """Every word written out, and every name read sets a lowercase one."""
    values = [_literal(raw) for raw in args]
    return None not in values and not any(
        _IDENTIFIER.fullmatch(value) and not _SHELL_VARIABLE.fullmatch(value) for value in values if value)


_TEST_HELP = ("bash's test reads the operand of -v as code: under allowed_commands, test and [ may not use -v, and "
              "no operator may come from an expansion (write operators out; quote expansions: [ -f \"$f\" ]).")
_ARGUMENT_RULES: dict[str, tuple[Callable[[list[str | None]], bool], str]] = {
    "test": (_test_is_safe, _TEST_HELP),
    "[": (_bracket_is_safe, _TEST_HELP),
    "printf": (_printf_is_safe, "printf -v sets a variable, which is not allowed under allowed_commands "
                                "(write x=$(printf …)); its format must not start with an expansion."),
    "read": (_read_is_safe, "Under allowed_commands, read may only set lowercase variables, named literally."),
}
