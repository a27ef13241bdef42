"""The `allowed_commands` policy: every program a command line would run must be listed.

A policy layer on top of the sandbox, not a substitute for it. The command is parsed with bashlex;
every simple command anywhere in it (pipelines, lists, subshells, `$(…)`, backticks, `<(…)`,
function bodies) names its program. A program word that is not a literal (`$X`, `$(…)`) or a
command line that cannot be parsed is refused, since what it would run cannot be known.

Bash evaluates the *contents* of variables as arithmetic in many places (`$((x))`, `${s:x}`,
`${!x}`, `${x@P}`, `[[ … -eq … ]]`, `printf -v`, `read`, array subscripts), and an array subscript
in such contents can hold a `$(…)` that no parser of the command text can see. So under a policy,
only plain `$NAME`/`${NAME}` expansions are allowed, and only builtins that evaluate nothing.
"""
from __future__ import annotations

import re

import bashlex
import bashlex.ast
import bashlex.errors

from shared.errors import CommandForbidden

# Builtins that cannot run a program, and never evaluate a variable's contents as code or arithmetic.
HARMLESS_BUILTINS = frozenset({"cd", "echo", "true", "false", "pwd", "exit", ":"})

# `${…}` other than `${NAME}`, arithmetic, `[[`, array subscripts in assignments, and `let`.
_EVALUATING = re.compile(
    r"\$\{(?![A-Za-z_][A-Za-z0-9_]*\})"   # ${!x} ${x:o} ${x@P} ${a[i]} ${#x} …
    r"|\$\(\(|\(\("                     # $(( … )) and (( … ))
    r"|\[\["                              # [[ … ]] evaluates -eq operands as arithmetic
    r"|(?:^|[\s;&|(])[A-Za-z_][A-Za-z0-9_]*\["  # a[…]=… subscript assignment
)


class _Programs(bashlex.ast.nodevisitor):  # type: ignore[misc]
    def __init__(self) -> None:
        self.programs: list[str] = []
        self.opaque = False
        self.substitutions = 0

    def visitcommandsubstitution(self, node: bashlex.ast.node, command: bashlex.ast.node) -> None:
        self.substitutions += 1

    def visitprocesssubstitution(self, node: bashlex.ast.node, command: bashlex.ast.node) -> None:
        self.substitutions += 1

    def visitcommand(self, node: bashlex.ast.node, parts: list[bashlex.ast.node]) -> None:
        words = [part for part in parts if part.kind == "word"]
        if not words:
            return  # only assignments or redirections
        program = words[0]
        if any(sub.kind in ("parameter", "commandsubstitution", "processsubstitution", "tilde")
               for sub in getattr(program, "parts", [])):
            self.opaque = True
        self.programs.append(program.word)


def programs(command: str) -> list[str]:
    """The literal program names in `command`; raises CommandForbidden when it cannot be known."""
    if _EVALUATING.search(command):
        raise CommandForbidden("The command uses an expansion that can evaluate code (${…} forms, arithmetic, "
                               "[[ ]] or array subscripts), which a policy cannot check.")
    try:
        trees = bashlex.parse(command)
    except (bashlex.errors.ParsingError, NotImplementedError, AttributeError, IndexError, TypeError,
            ValueError, AssertionError, RecursionError):
        raise CommandForbidden("The command cannot be parsed, so its programs cannot be checked.") from None
    visitor = _Programs()
    for tree in trees:
        visitor.visit(tree)
    # bashlex does not look inside `${x:-$(…)}` or here-documents: any substitution it did not
    # parse is code we cannot see.
    if visitor.opaque:
        raise CommandForbidden("A program name comes from an expansion, so it cannot be checked.")
    if _substitution_marks(command) > visitor.substitutions:
        raise CommandForbidden("The command has a substitution the parser cannot see into.")
    return visitor.programs


def _substitution_marks(command: str) -> int:
    opened = command.count("$(") + command.count("<(") + command.count(">(")
    return opened + command.count("`") // 2 + command.count("`") % 2


def check(command: str, allowed: tuple[str, ...]) -> None:
    """Refuse (403 command_forbidden) unless every program is allowed."""
    permitted = set(allowed)
    for program in programs(command):
        if program in permitted or ("/" not in program and program in HARMLESS_BUILTINS):
            continue
        raise CommandForbidden(f"The program {program[:100]!r} is not in allowed_commands.", program=program[:100])
