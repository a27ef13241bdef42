"""Archives built in the tests (with tarfile, in memory or streamed), and an operator's client of
the workspace endpoints (contract section 11)."""
from __future__ import annotations

import gzip
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

from shared import tokens

Member = tuple[tarfile.TarInfo, bytes | None]


def file(name: str, data: bytes = b"", mode: int = 0o644) -> Member:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 1_700_000_000
    return info, data


def directory(name: str, mode: int = 0o755) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, mode
    return info, None


def link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def special(name: str, kind: bytes) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor = kind, 1, 3  # as /dev/null
    return info, None


def tar(*members: Member, gz: bool = False, fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """The archive of `members`, exactly as given (tarfile's addfile changes no name)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    raw = buffer.getvalue()
    return gzip.compress(raw, compresslevel=1) if gz else raw


def header_only(info: tarfile.TarInfo) -> bytes:
    """A member's header and nothing else: a member that declares data the archive does not hold."""
    return info.tobuf(tarfile.GNU_FORMAT)


class Zeros(io.RawIOBase):
    """`size` zero bytes, read in pieces (never held whole)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self.left)
        buffer[:count] = bytes(count)
        self.left -= count
        return count


def gzip_of_zeros_member(name: str, size: int) -> bytes:
    """A gzipped tar of one member of `size` zeros, compressed as it is made."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", compresslevel=1) as compressed:
        with tarfile.open(fileobj=compressed, mode="w|") as archive:
            info = tarfile.TarInfo(name)
            info.size = size
            archive.addfile(info, Zeros(size))
    return buffer.getvalue()


def streamed_zeros_tar(name: str, size: int, piece: int = 1 << 20) -> Iterator[bytes]:
    """An uncompressed tar of one member of `size` zeros, generated piece by piece."""
    info = tarfile.TarInfo(name)
    info.size = size
    yield info.tobuf(tarfile.GNU_FORMAT)
    zeros = bytes(piece)
    left = size
    while left:
        yield zeros[:min(left, piece)]
        left -= min(left, piece)
    yield bytes(-size % 512 + 1024)  # padding, then the two zero blocks that end an archive


class Operator:
    """An agent platform's operator: a token with workspaces:admin for one tenant."""

    def __init__(self, stack: Any, tenant: str, scopes: list[str] | None = None) -> None:
        self.stack, self.tenant = stack, tenant
        self.token = tokens.mint(stack.secret.encode(), tenant=tenant, run_id="operator", sub="platform",
                                 scopes=scopes or ["workspaces:admin"], paths=["**"], ttl_s=900)
        self.http = requests.Session()

    def url(self, run_id: str = "") -> str:
        return f"{self.stack.base_url}/v1/workspaces" + (f"/{run_id}" if run_id else "")

    def path(self, run_id: str) -> Path:
        return Path(self.stack.workspaces) / self.tenant / run_id

    def put(self, run_id: str, body: Any = b"", content_type: str | None = "application/x-tar",
            replace: bool = False, timeout: float = 300) -> requests.Response:
        headers = {"Authorization": f"Bearer {self.token}"}
        if content_type and body != b"":
            headers["Content-Type"] = content_type
        return self.http.put(self.url(run_id) + ("?replace=true" if replace else ""), data=body, headers=headers,
                             timeout=timeout)

    def clone(self, run_id: str, url: str, ref: str | None = None, replace: bool = False) -> requests.Response:
        git = {"url": url, **({"ref": ref} if ref else {})}
        return self.put(run_id, json.dumps({"git": git}).encode(), "application/json", replace)

    def listing(self) -> dict[str, dict[str, Any]]:
        response = self.http.get(self.url(), headers={"Authorization": f"Bearer {self.token}"}, timeout=60)
        assert response.status_code == 200, response.text
        return {entry["run_id"]: entry for entry in response.json()["workspaces"]}

    def delete(self, run_id: str) -> requests.Response:
        return self.http.delete(self.url(run_id), headers={"Authorization": f"Bearer {self.token}"}, timeout=120)
