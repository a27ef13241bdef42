"""Pure rules for workspace paths and the `allowed_paths` globs of a token."""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from functools import lru_cache

from shared.errors import PathForbidden

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def normalize(path: str, *, allow_root: bool = False) -> str:
    """A relative POSIX path with `.` and empty segments dropped; refuse `/…`, `..` and NUL.

    Returns "" for the workspace root when `allow_root` (a shell `cwd` of "." is fine).
    """
    if "\x00" in path:
        raise PathForbidden("Path contains a NUL byte.")
    if path.startswith("/"):
        raise PathForbidden("Path must be relative to the workspace.")
    segments = [segment for segment in path.split("/") if segment not in ("", ".")]
    if ".." in segments:
        raise PathForbidden("Path must not contain a '..' segment.")
    if not segments and not allow_root:
        raise PathForbidden("Path names the workspace itself, not a file.")
    return "/".join(segments)


@lru_cache(maxsize=1024)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    """`*` and `?` stay in one segment, `**` spans segments; a match on a directory covers what is under it."""
    while "**/**" in pattern:
        pattern = pattern.replace("**/**", "**")
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]+/)*")
            i += 3
        elif pattern.startswith("/**", i) and i + 3 == len(pattern):
            out.append("(?:/.*)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + "(?:/.*)?")


def path_allowed(patterns: list[str] | tuple[str, ...], path: str) -> bool:
    """True when a normalized workspace path (or "" for the root) is granted by one of the globs."""
    for pattern in patterns:
        pattern = pattern.strip("/") if pattern not in ("/", "") else "**"
        if pattern in ("**", "."):
            return True
        if path and _glob_regex(pattern).fullmatch(path):
            return True
    return False


# What _glob_regex treats as wildcards; anything else in a pattern (`[` included) is a literal name.
_WILDCARDS = frozenset("*?")


@dataclass(frozen=True)
class ShellView:
    """What of a run's workspace a shell call sees at /workspace (contract section 6): the literal
    directory prefix of each `allowed_paths` pattern, or all of it."""

    whole: bool
    make: tuple[str, ...] = ()  # the outermost prefixes of wildcard patterns: made as directories if missing
    binds: tuple[str, ...] = ()  # the outermost granted paths, bound where they exist

    def covers(self, path: str) -> bool:
        """Whether a normalized workspace path ("" for the root) is inside what the shell sees."""
        return self.whole or not path or any(path == bound or path.startswith(bound + "/") for bound in self.binds)


WHOLE_WORKSPACE = ShellView(whole=True)


@lru_cache(maxsize=1024)
def shell_view(patterns: tuple[str, ...]) -> ShellView:
    """The view a token's `allowed_paths` give its shell.

    A pattern's prefix is its segments before the first one with a wildcard: `docs/**` → `docs`,
    `src/*.py` → `src`, `a/b/**/c` → `a/b`; a wildcard in the first segment (`**`, `*.md`) gives
    the whole workspace. Prefixes of wildcard patterns are made if missing, so the shell can write
    there. A pattern without a wildcard (`docs/readme.md`, `src`) names one path, a file or a
    directory: it is shown if it exists and not made otherwise (nothing says which of the two
    it should be). A pattern that can match no normalized path (a `..`, `.` or empty segment)
    shows nothing, as it grants nothing. Nested prefixes are shown once, by the outermost.
    """
    made, granted = [], []
    for pattern in patterns:
        prefix = _literal_prefix(pattern)
        if prefix is None:
            continue
        path, wildcard = prefix
        if not path:
            return WHOLE_WORKSPACE
        granted.append(path)
        if wildcard:
            made.append(path)
    return ShellView(False, _outermost(made), _outermost(granted))


def _literal_prefix(pattern: str) -> tuple[str, bool] | None:
    """(prefix, whether a wildcard followed it), "" meaning the whole workspace; None if the
    pattern grants nothing. Normalized as `path_allowed` does."""
    pattern = pattern.strip("/") if pattern not in ("/", "") else "**"
    if pattern in ("**", "."):
        return "", True
    segments = pattern.split("/")
    if any(segment in ("", ".", "..") for segment in segments):
        return None
    literal = list(itertools.takewhile(lambda segment: not _WILDCARDS & set(segment), segments))
    return "/".join(literal), len(literal) < len(segments)


def _outermost(paths: list[str]) -> tuple[str, ...]:
    kept: list[str] = []
    for path in sorted(set(paths), key=lambda p: p.split("/")):  # a directory sorts before what is under it
        if not any(path == outer or path.startswith(outer + "/") for outer in kept):
            kept.append(path)
    return tuple(kept)
