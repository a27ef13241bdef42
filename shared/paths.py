"""Pure rules for workspace paths and the `allowed_paths` globs of a token."""
from __future__ import annotations

import re
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
