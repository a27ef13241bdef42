"""Strict, byte-exact application of a one-file unified diff.

Hand-written rather than taken from a diff library: the ones on PyPI (unidiff, whatthepatch,
patch-ng) decode to text, fold line endings or apply with fuzz, and runwarden must keep every byte
(CRLF, lone CR, tabs, trailing spaces, invalid UTF-8) and apply only at the stated line numbers.
Lines are split on LF only, so a CR stays part of its line's content.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from shared.errors import PatchDoesNotApply

ZERO_SHA = "0" * 40
_HUNK_RE = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_NO_NEWLINE = b"\\"


def git_blob_sha(data: bytes) -> str:
    """What `git hash-object` prints for these bytes."""
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


@dataclass
class Hunk:
    old_start: int
    new_start: int
    old_lines: list[bytes] = field(default_factory=list)
    new_lines: list[bytes] = field(default_factory=list)


@dataclass
class FilePatch:
    hunks: list[Hunk]
    deletes: bool  # `+++ /dev/null`
    creates: bool  # `--- /dev/null`


def _split_on_lf(data: bytes) -> list[bytes]:
    parts = data.split(b"\n")
    lines = [part + b"\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def parse(diff: bytes) -> FilePatch:
    """Parse the headers and hunks of a diff that touches exactly one file."""
    lines = _split_on_lf(diff)
    hunks: list[Hunk] = []
    headers = {"---": 0, "+++": 0, "diff --git": 0}
    deletes = creates = False
    i = 0
    while i < len(lines):
        line = lines[i]
        match = _HUNK_RE.match(line)
        if match:
            hunk, i = _read_hunk(lines, i + 1, match)
            hunks.append(hunk)
            continue
        if line.startswith(b"diff --git "):
            headers["diff --git"] += 1
        elif line.startswith(b"--- "):
            headers["---"] += 1
            creates = line.rstrip(b"\r\n").split(b"\t")[0] == b"--- /dev/null"
        elif line.startswith(b"+++ "):
            headers["+++"] += 1
            deletes = line.rstrip(b"\r\n").split(b"\t")[0] == b"+++ /dev/null"
        elif hunks and line.strip():
            raise PatchDoesNotApply("Unexpected line after the last hunk.", line=i + 1)
        i += 1
    if max(headers.values()) > 1:
        raise PatchDoesNotApply("The diff touches several files; send one diff per file.")
    if headers["+++"] == 0 or headers["---"] == 0:
        raise PatchDoesNotApply("The diff has no '---'/'+++' file header.")
    if not hunks and not (creates or deletes):
        raise PatchDoesNotApply("The diff has no hunk.")
    return FilePatch(hunks, deletes, creates)


def _read_hunk(lines: list[bytes], i: int, match: re.Match[bytes]) -> tuple[Hunk, int]:
    old_count = int(match.group(2)) if match.group(2) is not None else 1
    new_count = int(match.group(4)) if match.group(4) is not None else 1
    hunk = Hunk(old_start=int(match.group(1)), new_start=int(match.group(3)))
    last_sides = ""
    while len(hunk.old_lines) < old_count or len(hunk.new_lines) < new_count or _is_marker(lines, i):
        if i >= len(lines):
            raise PatchDoesNotApply("The diff ends inside a hunk.")
        line = lines[i]
        tag, content = line[:1], line[1:]
        if tag == _NO_NEWLINE:
            _strip_newline(hunk, last_sides)
            last_sides = ""
        elif tag == b" " or line in (b"\n", b"\r\n"):
            content = content if tag == b" " else line  # an empty context line whose space was trimmed
            hunk.old_lines.append(content)
            hunk.new_lines.append(content)
            last_sides = "on"
        elif tag == b"-":
            hunk.old_lines.append(content)
            last_sides = "o"
        elif tag == b"+":
            hunk.new_lines.append(content)
            last_sides = "n"
        else:
            raise PatchDoesNotApply("The hunk's line counts do not match its lines.", line=i + 1)
        i += 1
    if len(hunk.old_lines) != old_count or len(hunk.new_lines) != new_count:
        raise PatchDoesNotApply("The hunk's line counts do not match its lines.", line=i)
    return hunk, i


def _is_marker(lines: list[bytes], i: int) -> bool:
    return i < len(lines) and lines[i].startswith(_NO_NEWLINE)


def _strip_newline(hunk: Hunk, sides: str) -> None:
    """`\\ No newline at end of file` applies to the line just before it, on the sides it was on."""
    if not sides:
        raise PatchDoesNotApply("'\\ No newline at end of file' does not follow a line.")
    for side, target in (("o", hunk.old_lines), ("n", hunk.new_lines)):
        if side in sides:
            if not target[-1].endswith(b"\n"):
                raise PatchDoesNotApply("Two 'No newline' markers for one line.")
            target[-1] = target[-1][:-1]


def apply(original: bytes, patch: FilePatch) -> bytes:
    """The new bytes; every context and removed line must match exactly where the hunk says."""
    old = _split_on_lf(original)
    out: list[bytes] = []
    cursor = 0
    for number, hunk in enumerate(patch.hunks, 1):
        # A hunk that removes nothing names the line *after which* it inserts.
        start = hunk.old_start - 1 if hunk.old_lines else hunk.old_start
        if start < cursor or start + len(hunk.old_lines) > len(old):
            raise PatchDoesNotApply(f"Hunk {number} is out of range or out of order.", hunk=number)
        if old[start:start + len(hunk.old_lines)] != hunk.old_lines:
            raise PatchDoesNotApply(f"Hunk {number} does not match the file at line {hunk.old_start}.", hunk=number)
        out.extend(old[cursor:start])
        out.extend(hunk.new_lines)
        cursor = start + len(hunk.old_lines)
    out.extend(old[cursor:])
    result = b"".join(out)
    if patch.deletes and result:
        raise PatchDoesNotApply("'+++ /dev/null' deletes the file, but the hunks leave content in it.")
    return result
