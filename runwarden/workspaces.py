"""`runwarden workspace create|list|delete`: the workspace endpoints (contract section 11) from a
shell, over HTTP. The token is `--token` or RUNWARDEN_TOKEN (one with the scope workspaces:admin),
else one of five minutes minted here from RUNWARDEN_JWT_SECRET for `--tenant`. An archive is
streamed from its file, never read whole. Exit status 2 is a usage error, 1 a refusal or failure
(printed as `runwarden: code: detail`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, BinaryIO

import requests

from shared import tokens
from shared.workspaces import SCOPE

DEFAULT_URL = "http://127.0.0.1:8080"
USAGE, REFUSED = 2, 1
MINTED_TTL_S = 300  # a token is checked when the request starts, so a long upload outlives it fine
READ_TIMEOUT_S = 900  # above the API's RUNWARDEN_UPLOAD_TIMEOUT default (600 s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=None, help=f"API base URL (default: $RUNWARDEN_URL, else {DEFAULT_URL})")
    common.add_argument("--token", default=None, help="token with workspaces:admin (default: $RUNWARDEN_TOKEN)")
    common.add_argument("--tenant", default=None, help="mint a token for this tenant (needs RUNWARDEN_JWT_SECRET)")
    commands = parser.add_subparsers(dest="workspace_command", required=True)
    create = commands.add_parser("create", parents=[common], help="create a run's workspace: empty, a tar or a clone")
    create.add_argument("run")
    source = create.add_mutually_exclusive_group()
    source.add_argument("--tar", metavar="FILE", help="a tar or gzipped tar to extract into it")
    source.add_argument("--git", metavar="URL", help="an https://, http:// or git:// repository to clone")
    create.add_argument("--ref", default=None, help="branch or tag to clone (with --git)")
    create.add_argument("--replace", action="store_true", help="replace the workspace if it exists")
    commands.add_parser("list", parents=[common], help="the tenant's workspaces, one JSON object a line")
    commands.add_parser("delete", parents=[common], help="delete a run's workspace").add_argument("run")


def run(args: argparse.Namespace) -> int:
    if args.workspace_command == "create" and args.ref and not args.git:
        print("runwarden: --ref goes with --git", file=sys.stderr)
        return USAGE
    token = args.token or os.environ.get("RUNWARDEN_TOKEN") or _minted(args)
    if not token:
        print("runwarden: give --token (or RUNWARDEN_TOKEN), or --tenant with RUNWARDEN_JWT_SECRET", file=sys.stderr)
        return USAGE
    base = (args.url or os.environ.get("RUNWARDEN_URL") or DEFAULT_URL).rstrip("/")
    headers = {"Authorization": f"Bearer {token}"}
    try:
        if args.workspace_command == "create":
            return _create(base, headers, args)
        if args.workspace_command == "list":
            return _list(base, headers)
        return _answer(requests.delete(f"{base}/v1/workspaces/{args.run}", headers=headers, timeout=(10, 120)))
    except OSError as exc:  # a file that cannot be read, or requests' ConnectionError
        print(f"runwarden: {exc}", file=sys.stderr)
        return REFUSED


def _minted(args: argparse.Namespace) -> str | None:
    secret = os.environ.get("RUNWARDEN_JWT_SECRET", "").encode()
    if not args.tenant or len(secret) < 32:
        return None
    return tokens.mint(secret, tenant=args.tenant, run_id=getattr(args, "run", None) or "workspaces",
                       sub="runwarden-cli", scopes=[SCOPE], paths=["**"], ttl_s=MINTED_TTL_S,
                       audience=os.environ.get("RUNWARDEN_JWT_AUDIENCE", "runwarden"))


def _create(base: str, headers: dict[str, str], args: argparse.Namespace) -> int:
    url = f"{base}/v1/workspaces/{args.run}" + ("?replace=true" if args.replace else "")
    if args.git:
        git = {"url": args.git, **({"ref": args.ref} if args.ref else {})}
        return _answer(requests.put(url, json={"git": git}, headers=headers, timeout=(10, READ_TIMEOUT_S)))
    if not args.tar:
        return _answer(requests.put(url, data=b"", headers=headers, timeout=(10, READ_TIMEOUT_S)))
    with open(args.tar, "rb") as archive:
        kind = "application/gzip" if _starts_with(archive, b"\x1f\x8b") else "application/x-tar"
        # A file object: requests sends it with its Content-Length, read in blocks as it goes.
        return _answer(requests.put(url, data=archive, headers={**headers, "Content-Type": kind},
                                    timeout=(10, READ_TIMEOUT_S)))


def _starts_with(archive: BinaryIO, magic: bytes) -> bool:
    head = archive.read(len(magic))
    archive.seek(0)
    return head == magic


def _list(base: str, headers: dict[str, str]) -> int:
    response = requests.get(f"{base}/v1/workspaces", headers=headers, timeout=(10, 60))
    if response.status_code != 200:
        return _answer(response)
    for workspace in response.json()["workspaces"]:
        print(json.dumps(workspace))
    return 0


def _answer(response: requests.Response) -> int:
    if response.status_code == 204:
        return 0
    body: Any = _json(response)
    if response.status_code < 300:
        print(json.dumps(body))
        return 0
    code = body.get("code", "error") if isinstance(body, dict) else "error"
    detail = body.get("detail", response.reason) if isinstance(body, dict) else response.reason
    member = body.get("member") if isinstance(body, dict) else None
    print(f"runwarden: {code}: {detail}" + (f" (member {member!r})" if member else ""), file=sys.stderr)
    return REFUSED


def _json(response: requests.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return {"code": f"http_{response.status_code}", "detail": response.text[:200]}
