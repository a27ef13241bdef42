"""Property tests (hypothesis) on the pure rules: path normalisation, symlink-free resolution,
`allowed_paths` globs, and the byte-exact patch applier against git's and difflib's own diffs.

No stack: these call the functions the API and the workers call, on random inputs.
"""
from __future__ import annotations

import difflib
import fnmatch
import hashlib
import os
import posixpath
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from shared.errors import FileNotFound, PathForbidden, PatchDoesNotApply
from shared.paths import normalize, path_allowed
from workers import patching, workspace

pytestmark = pytest.mark.timeout(120)

# --- shared.paths.normalize ---------------------------------------------------------------------

SEGMENTS = st.sampled_from(["a", "b", "é", "文件", ".", "..", "", " ", "...", ".git", "a b", "*", "\x00", "x\x00y"])
RAW_PATHS = st.one_of(
    st.lists(SEGMENTS, min_size=1, max_size=6).map("/".join),
    st.text(alphabet=st.sampled_from(["a", "é", ".", "/", "\x00", " ", "\\"]), max_size=12),
)


@settings(max_examples=500, deadline=None)
@given(RAW_PATHS, st.booleans())
@example("a/../../etc/passwd", False)
@example("/etc/passwd", False)
@example("./", True)
def test_normalize_never_leaves_the_workspace(raw: str, allow_root: bool) -> None:
    segments = [s for s in raw.split("/") if s not in ("", ".")]
    should_refuse = ("\x00" in raw or raw.startswith("/") or ".." in segments
                     or (not segments and not allow_root))
    try:
        result = normalize(raw, allow_root=allow_root)
    except PathForbidden:
        assert should_refuse, raw
        return
    assert not should_refuse, raw
    assert result == "/".join(segments)
    assert not result.startswith("/") and "\x00" not in result
    assert all(part not in ("", ".", "..") for part in result.split("/")) or result == ""
    assert normalize(result, allow_root=True) == result  # idempotent
    assert posixpath.normpath(posixpath.join("/ws", result)).startswith("/ws")


# --- workspace.parent_dir + read/replace on random symlink layouts ---------------------------------

NAMES = ["a", "b", "é"]
LINK_TARGETS = ["OUTSIDE", "OUTSIDE/secret.txt", "../outside", "../outside/secret.txt", "../../..", "..",
                ".", "a", "b/a", "é", "nowhere", "/etc", "/etc/hostname", "a/../.."]
SECRET = b"SECRET-outside-the-workspace\n"


@st.composite
def layouts(draw):  # type: ignore[no-untyped-def]
    """A list of (relative path, kind, link target) to create inside the workspace, in order."""
    entries = []
    for _ in range(draw(st.integers(1, 12))):
        path = "/".join(draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3)))
        kind = draw(st.sampled_from(["dir", "dir", "file", "link"]))
        entries.append((path, kind, draw(st.sampled_from(LINK_TARGETS)) if kind == "link" else ""))
    return entries


QUERIES = st.lists(st.sampled_from(NAMES + [".", ""]), min_size=1, max_size=4).map("/".join)


def build(root: Path, layout) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    ws, outside = root / "ws", root / "outside"
    ws.mkdir()
    (outside / "a").mkdir(parents=True)
    (outside / "secret.txt").write_bytes(SECRET)
    (outside / "a" / "a").write_bytes(SECRET)
    (outside / "b").write_bytes(SECRET)
    for rel, kind, target in layout:
        path = ws / rel
        if os.path.lexists(path) or not (path.parent.is_dir() and not path.parent.is_symlink()):
            continue
        if any((ws / Path(rel).parents[i]).is_symlink() for i in range(len(Path(rel).parents) - 1)):
            continue
        if kind == "dir":
            path.mkdir()
        elif kind == "file":
            path.write_bytes(f"inside:{rel}\n".encode())
        else:
            path.symlink_to(target.replace("OUTSIDE", str(outside)))
    return ws, outside


def model(ws: Path, rel: str) -> tuple[str, bytes | None]:
    """What resolution must give, from lstat alone: any symlink component is forbidden."""
    *dirs, name = rel.split("/")
    current = ws
    for part in dirs:
        current = current / part
        if not os.path.lexists(current):
            return "not_found", None
        if current.is_symlink() or not current.is_dir():
            return "forbidden", None
    final = current / name
    if not os.path.lexists(final):
        return "data", None
    if final.is_symlink() or final.is_dir():
        return "forbidden", None
    return "data", final.read_bytes()


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames + dirnames):
            path = Path(dirpath) / name
            digest.update(str(path).encode())
            if path.is_file() and not path.is_symlink():
                digest.update(path.read_bytes())
    return digest.hexdigest()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), QUERIES)
def test_read_never_goes_through_a_symlink(layout, query: str) -> None:  # type: ignore[no-untyped-def]
    try:
        rel = normalize(query)
    except PathForbidden:
        return
    with tempfile.TemporaryDirectory() as tmp:
        ws, _ = build(Path(tmp), layout)
        try:
            with workspace.parent_dir(ws, rel) as (dir_fd, name):
                outcome: tuple[str, bytes | None] = ("data", workspace.read(dir_fd, name).data)
        except PathForbidden:
            outcome = ("forbidden", None)
        except FileNotFound:
            outcome = ("not_found", None)
        assert outcome == model(ws, rel), (layout, rel)
        assert outcome[1] is None or outcome[1].startswith(b"inside:")
        assert outcome[1] != SECRET


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), QUERIES)
def test_write_never_goes_through_a_symlink(layout, query: str) -> None:  # type: ignore[no-untyped-def]
    try:
        rel = normalize(query)
    except PathForbidden:
        return
    with tempfile.TemporaryDirectory() as tmp:
        ws, outside = build(Path(tmp), layout)
        expected = model(ws, rel)
        outside_before = tree_digest(outside)
        try:
            with workspace.parent_dir(ws, rel, create=True) as (dir_fd, name):
                workspace.replace(dir_fd, name, b"written", workspace.read(dir_fd, name))
            wrote = True
        except PathForbidden:
            wrote = False
        assert tree_digest(outside) == outside_before  # nothing outside the workspace changed
        if expected[0] == "forbidden":
            assert not wrote, (layout, rel)
        else:  # a missing directory on the way is created as a real directory
            assert wrote, (layout, rel)
            target = ws / rel
            assert not any(p.is_symlink() for p in [target, *target.parents] if str(p).startswith(str(ws)))
            assert target.read_bytes() == b"written"
            assert os.path.realpath(target).startswith(str(ws) + os.sep)


# --- shared.paths.path_allowed globs -------------------------------------------------------------------

PATH_SEGMENTS = st.sampled_from(["a", "b", "ab", "é", ".a", "a.b", "x y"])
PATHS = st.lists(PATH_SEGMENTS, min_size=1, max_size=4).map("/".join)
GLOB_SEGMENTS = st.one_of(
    st.just("**"),
    st.text(alphabet=st.sampled_from(["a", "b", "é", ".", "*", "?"]), min_size=1, max_size=3)
    .filter(lambda s: "**" not in s and s not in (".", "..")),
)
# A pattern ending in "/**/**" is left out here: see test_repeated_double_star_grants_the_directory.
GLOBS = st.lists(GLOB_SEGMENTS, min_size=1, max_size=4).map("/".join).filter(lambda g: not g.endswith("**/**"))


def reference_match(pattern: list[str], path: list[str]) -> bool:
    """Segment by segment: `**` is any number of whole segments, `*`/`?` stay inside one."""
    if not pattern:
        return not path
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(reference_match(rest, path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], head) and reference_match(rest, path[1:])


def reference_allowed(glob: str, path: str) -> bool:
    """A pattern that matches a directory grants everything under it."""
    segments = path.split("/")
    return any(reference_match(glob.split("/"), segments[:n]) for n in range(1, len(segments) + 1))


@settings(max_examples=1000, deadline=None)
@given(GLOBS, PATHS)
@example("a/**/b", "a/b")
@example("a/**", "ab")
@example("**/b", "x y/a/b/c")
@example("a*b", "a/b")
def test_globs_match_the_segment_reference(glob: str, path: str) -> None:
    assert path_allowed([glob], path) == reference_allowed(glob, path), (glob, path)


def test_repeated_double_star_grants_the_directory() -> None:
    assert path_allowed(["a/**"], "a")
    assert path_allowed(["a/**/**"], "a")  # "**" is zero or more segments, twice is still zero or more


@settings(max_examples=300, deadline=None)
@given(PATH_SEGMENTS, PATH_SEGMENTS, st.sampled_from(["*", "?", "*?", "?*"]))
def test_star_and_question_never_match_a_slash(left: str, right: str, wildcard: str) -> None:
    # left/right stand where the wildcard would have to match "/" to reach the path.
    assert not path_allowed([f"{left}{wildcard}{right}"], f"{left}/{right}")
    assert path_allowed([f"{left}{wildcard}{right}"], f"{left}{'x' * len(wildcard)}{right}")


@settings(max_examples=300, deadline=None)
@given(PATHS, PATH_SEGMENTS)
def test_double_star_matches_everything(path: str, segment: str) -> None:
    assert path_allowed(["**"], path) and path_allowed(["**"], "")
    assert path_allowed([f"{segment}/**"], f"{segment}/{path}")
    assert path_allowed([f"{segment}/**"], segment)
    assert path_allowed(["**/" + path.split("/")[-1]], path)
    assert not path_allowed([f"{segment}/**"], f"{segment}x/{path}")


# --- workers.patching: apply(a, parse(diff(a, b))) == b --------------------------------------------

LINE_PIECES = st.sampled_from([b"a", b"b", b"x", b" ", b"\t", b"\r", b"\r\r", "é".encode(), "你好".encode(),
                               "😀".encode(), b"\\", b"-", b"+", b"@@ -1 +1 @@", b"--- a/f", b"+++ b/f",
                               b"\xff\xfe", b"\\ No newline at end of file", b"  trailing  "])
LINES = st.lists(LINE_PIECES, max_size=4).map(b"".join)


@st.composite
def file_pairs(draw, *, allow_missing_newline: bool = True):  # type: ignore[no-untyped-def]
    """A file and a random edit of it, as lists of lines without their LF, plus final-newline flags."""
    a = draw(st.lists(LINES, max_size=25))
    b = list(a)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["insert", "delete", "replace", "duplicate"]))
        pos = draw(st.integers(0, len(b)))
        if op == "insert" or not b:
            b[pos:pos] = draw(st.lists(LINES, min_size=1, max_size=3))
        elif op == "delete":
            del b[min(pos, len(b) - 1):min(pos, len(b) - 1) + draw(st.integers(1, 3))]
        elif op == "replace":
            b[min(pos, len(b) - 1)] = draw(LINES)
        else:
            b.insert(pos, b[min(pos, len(b) - 1)])
    if allow_missing_newline:
        return a, b, draw(st.booleans()), draw(st.booleans())
    return a, b, True, True


def join(lines: list[bytes], final_newline: bool) -> bytes:
    data = b"\n".join(lines)
    return data + b"\n" if lines and final_newline else data


GIT_ENV = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "LC_ALL": "C"}


def git_diff(old: bytes | None, new: bytes | None, context: int) -> bytes:
    """`git diff --no-index` between two files (or /dev/null for creation and deletion)."""
    with tempfile.TemporaryDirectory() as tmp:
        names = []
        for side, data in (("a", old), ("b", new)):
            if data is None:
                names.append(os.devnull)
            else:
                (Path(tmp) / f"{side}.txt").write_bytes(data)
                names.append(f"{side}.txt")
        done = subprocess.run(["git", "diff", "--no-index", "--no-color", "--no-ext-diff", "-a", f"-U{context}",
                               *names], cwd=tmp, env=GIT_ENV, capture_output=True, check=False)
        assert done.returncode in (0, 1), done.stderr
        return done.stdout


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(file_pairs(), st.integers(0, 4))
def test_apply_git_diff_gives_exactly_b(pair, context: int) -> None:  # type: ignore[no-untyped-def]
    a_lines, b_lines, a_newline, b_newline = pair
    a, b = join(a_lines, a_newline), join(b_lines, b_newline)
    assume(a != b)
    diff = git_diff(a, b, context)
    assert patching.apply(a, patching.parse(diff)) == b, diff


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LINES, min_size=1, max_size=10), st.booleans(), st.booleans())
def test_git_creation_and_deletion_diffs(lines: list[bytes], newline: bool, create: bool) -> None:
    data = join(lines, newline)
    assume(data)  # git writes no ---/+++ header at all for an empty file
    if create:
        patch = patching.parse(git_diff(None, data, 3))
        assert patch.creates and not patch.deletes
        assert patching.apply(b"", patch) == data
    else:
        patch = patching.parse(git_diff(data, None, 3))
        assert patch.deletes and not patch.creates
        assert patching.apply(data, patch) == b""


@settings(max_examples=300, deadline=None)
@given(file_pairs(allow_missing_newline=False), st.integers(0, 4))
def test_apply_difflib_diff_gives_exactly_b(pair, context: int) -> None:  # type: ignore[no-untyped-def]
    # difflib writes no "\ No newline at end of file" marker, so both files end with a newline here.
    a_lines, b_lines, _, _ = pair
    a, b = join(a_lines, True), join(b_lines, True)
    assume(a != b)
    diff = b"".join(difflib.diff_bytes(difflib.unified_diff, [line + b"\n" for line in a_lines],
                                       [line + b"\n" for line in b_lines], b"a/f.txt", b"b/f.txt", n=context))
    assert patching.apply(a, patching.parse(diff)) == b, diff


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(file_pairs(), st.integers(0, 3), st.data())
def test_a_diff_never_applies_to_a_different_file(pair, context: int, data) -> None:  # type: ignore[no-untyped-def]
    """No fuzz: flip one byte of a line the diff removes or keeps as context, and it is refused."""
    a_lines, b_lines, a_newline, b_newline = pair
    a, b = join(a_lines, a_newline), join(b_lines, b_newline)
    assume(a != b)
    patch = patching.parse(git_diff(a, b, context))
    old = a.split(b"\n")
    offsets = [sum(len(line) + 1 for line in old[:i]) for i in range(len(old))]
    positions = [offsets[hunk.old_start - 1 + j] + k for hunk in patch.hunks if hunk.old_lines
                 for j in range(len(hunk.old_lines)) for k in range(len(old[hunk.old_start - 1 + j]))]
    assume(positions)
    at = data.draw(st.sampled_from(positions))
    changed = a[:at] + bytes([a[at] ^ 0x01]) + a[at + 1:]
    with pytest.raises(PatchDoesNotApply):
        patching.apply(changed, patch)
