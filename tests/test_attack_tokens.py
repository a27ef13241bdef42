"""Attacks on the bearer token: forged, tampered, expired, malformed and misplaced tokens are all 401.

Every refusal is `application/problem+json` with code `unauthorized` (or `token_expired`), carries
`WWW-Authenticate`, never echoes the signing secret, and records nothing: the same Idempotency-Key
then works with a good token.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import time
import uuid
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import jwt
import pytest
import requests

from shared import keys, tokens

PROBLEM_JSON = "application/problem+json"


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def claims(**changes: Any) -> dict[str, Any]:
    """A valid claim set for a fresh tenant; `changes` overrides, a value of `...` removes a claim."""
    now = int(time.time())
    base: dict[str, Any] = {
        "sub": "agent-1", "tenant": f"t{uuid.uuid4().hex[:10]}", "run_id": f"r{uuid.uuid4().hex[:8]}",
        "scopes": ["files:read", "files:write", "shell:exec"], "allowed_paths": ["**"],
        "iat": now, "exp": now + 600, "aud": "runwarden", "jti": uuid.uuid4().hex,
    }
    for name, value in changes.items():
        if value is ...:
            base.pop(name, None)
        else:
            base[name] = value
    return base


def raw_token(header: dict[str, Any], payload: dict[str, Any], key: bytes | None) -> str:
    """Sign by hand (pyjwt refuses some of the forgeries we need, such as HS256 keyed with a PEM)."""
    signing_input = f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(payload).encode())}"
    signature = b"" if key is None else hmac.new(key, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64url(signature)}"


def post_read(stack, authorization: str | None, key: str | None = None) -> requests.Response:
    headers = {"Content-Type": "application/json", "Idempotency-Key": key or uuid.uuid4().hex}
    if authorization is not None:
        headers["Authorization"] = authorization
    body = {"tool_name": "read_file", "call_id": str(uuid.uuid4()), "parameters": {"path": "f.txt"}}
    return requests.post(f"{stack.base_url}/v1/tool-calls", data=json.dumps(body), headers=headers, timeout=30)


def assert_unauthorized(response: requests.Response, secret: str, code: str = "unauthorized") -> None:
    assert response.status_code == 401, response.text
    assert response.headers["Content-Type"] == PROBLEM_JSON
    assert response.headers.get("WWW-Authenticate", "").lower().startswith("bearer")
    body = response.json()
    assert body["code"] == code and body["status"] == 401 and body["title"]
    assert secret not in response.text
    assert "Traceback" not in response.text


def _tampered(secret: bytes) -> str:
    good = jwt.encode(claims(scopes=["files:read"]), secret, algorithm="HS256")
    header, _, signature = good.split(".")
    more = claims(scopes=["files:read", "files:write", "shell:exec", "shell:network"])
    return f"{header}.{b64url(json.dumps(more).encode())}.{signature}"


def _hs(secret: bytes, **changes: Any) -> str:
    return jwt.encode(claims(**changes), secret, algorithm="HS256")


# name → (function of the secret giving the whole Authorization header value, expected code)
CASES: dict[str, tuple[Callable[[bytes], str], str]] = {
    "alg_none": (lambda s: "Bearer " + raw_token({"alg": "none", "typ": "JWT"}, claims(), None), "unauthorized"),
    "alg_none_uppercase": (lambda s: "Bearer " + raw_token({"alg": "NONE"}, claims(), None), "unauthorized"),
    "alg_none_with_real_signature": (
        lambda s: "Bearer " + raw_token({"alg": "none"}, claims(), s), "unauthorized"),
    "hs512_with_right_secret": (lambda s: "Bearer " + jwt.encode(claims(), s, algorithm="HS512"), "unauthorized"),
    "wrong_key": (lambda s: "Bearer " + jwt.encode(claims(), b"k" * 48, algorithm="HS256"), "unauthorized"),
    "wrong_audience": (lambda s: "Bearer " + _hs(s, aud="someone-else"), "unauthorized"),
    "audience_list_without_ours": (lambda s: "Bearer " + _hs(s, aud=["a", "b"]), "unauthorized"),
    "expired": (lambda s: "Bearer " + _hs(s, iat=int(time.time()) - 120, exp=int(time.time()) - 60),
                "token_expired"),
    "nbf_in_future": (lambda s: "Bearer " + _hs(s, nbf=int(time.time()) + 300), "unauthorized"),
    "iat_in_future": (lambda s: "Bearer " + _hs(s, iat=int(time.time()) + 300, exp=int(time.time()) + 600),
                      "unauthorized"),
    "lifetime_over_max": (lambda s: "Bearer " + _hs(s, exp=int(time.time()) + 3601), "unauthorized"),
    "exp_not_a_number": (lambda s: "Bearer " + _hs(s, exp="tomorrow"), "unauthorized"),
    "exp_numeric_string": (lambda s: "Bearer " + _hs(s, exp=str(int(time.time()) + 600)), "unauthorized"),
    "iat_numeric_string": (lambda s: "Bearer " + _hs(s, iat=str(int(time.time()))), "unauthorized"),
    "scopes_not_a_list": (lambda s: "Bearer " + _hs(s, scopes="files:read"), "unauthorized"),
    "scopes_list_of_numbers": (lambda s: "Bearer " + _hs(s, scopes=[1, 2]), "unauthorized"),
    "allowed_paths_not_a_list": (lambda s: "Bearer " + _hs(s, allowed_paths="**"), "unauthorized"),
    "allowed_commands_not_a_list": (lambda s: "Bearer " + _hs(s, allowed_commands="ls"), "unauthorized"),
    "sub_not_a_string": (lambda s: "Bearer " + _hs(s, sub=42), "unauthorized"),
    "sub_empty": (lambda s: "Bearer " + _hs(s, sub=""), "unauthorized"),
    "jti_not_a_string": (lambda s: "Bearer " + _hs(s, jti=12345), "unauthorized"),
    "tenant_dotdot": (lambda s: "Bearer " + _hs(s, tenant=".."), "unauthorized"),
    "tenant_traversal": (lambda s: "Bearer " + _hs(s, tenant="../x"), "unauthorized"),
    "tenant_not_a_string": (lambda s: "Bearer " + _hs(s, tenant=["a"]), "unauthorized"),
    "tenant_too_long": (lambda s: "Bearer " + _hs(s, tenant="t" * 65), "unauthorized"),
    "run_id_with_slash": (lambda s: "Bearer " + _hs(s, run_id="a/b"), "unauthorized"),
    "run_id_nul": (lambda s: "Bearer " + _hs(s, run_id="a\x00b"), "unauthorized"),
    "tampered_payload": (lambda s: "Bearer " + _tampered(s), "unauthorized"),
    "signature_stripped": (lambda s: "Bearer " + _hs(s).rsplit(".", 1)[0] + ".", "unauthorized"),
    "garbage": (lambda s: "Bearer not-a-token", "unauthorized"),
    "garbage_three_parts": (lambda s: "Bearer a.b.c", "unauthorized"),
    "long_garbage_token": (lambda s: "Bearer " + "A" * 8000, "unauthorized"),  # gunicorn caps a header at 8190
    "bearer_empty": (lambda s: "Bearer ", "unauthorized"),
    "bearer_only": (lambda s: "Bearer", "unauthorized"),
    "basic_scheme": (lambda s: "Basic " + base64.b64encode(b"agent:" + s).decode(), "unauthorized"),
    "token_without_scheme": (lambda s: _hs(s), "unauthorized"),
}
for _claim in tokens.REQUIRED_CLAIMS:
    CASES[f"missing_{_claim}"] = (lambda s, c=_claim: "Bearer " + _hs(s, **{c: ...}), "unauthorized")


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_token_is_401(stack, case: str) -> None:
    make, code = CASES[case]
    response = post_read(stack, make(stack.secret.encode()))
    assert_unauthorized(response, stack.secret, code)


def test_no_authorization_header_is_401(stack) -> None:
    assert_unauthorized(post_read(stack, None), stack.secret)


def test_the_control_token_is_accepted(stack) -> None:
    """The same construction as the table, unforged, passes: the table's 401s are the forgery's doing."""
    response = post_read(stack, "Bearer " + _hs(stack.secret.encode()))
    assert response.status_code == 404 and response.json()["code"] == "file_not_found", response.text
    lifetime_at_max = _hs(stack.secret.encode(), exp=int(time.time()) + 3600)
    assert post_read(stack, "Bearer " + lifetime_at_max).status_code == 404
    lowercase_scheme = post_read(stack, "bearer " + _hs(stack.secret.encode()))
    assert lowercase_scheme.status_code == 404


def test_authorization_header_sent_twice_is_401(stack) -> None:
    token = _hs(stack.secret.encode())
    url = urlsplit(stack.base_url)
    body = json.dumps({"tool_name": "read_file", "call_id": str(uuid.uuid4()), "parameters": {"path": "f.txt"}})
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        connection.putrequest("POST", "/v1/tool-calls")
        connection.putheader("Authorization", f"Bearer {token}")
        connection.putheader("Authorization", f"Bearer {token}")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Idempotency-Key", uuid.uuid4().hex)
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body.encode())
        response = connection.getresponse()
        text = response.read().decode()
        assert response.status == 401, text
        assert response.getheader("Content-Type") == PROBLEM_JSON
        assert response.getheader("WWW-Authenticate")
        assert json.loads(text)["code"] == "unauthorized"
        assert stack.secret not in text
    finally:
        connection.close()


@pytest.mark.parametrize("refused", ["forged", "expired", "garbage"])
def test_refused_token_records_nothing_so_the_key_works_afterwards(agent, refused: str) -> None:
    key = uuid.uuid4().hex
    run = {"tenant": agent.tenant, "run_id": agent.run_id}
    token = {"forged": lambda: jwt.encode(claims(**run), b"x" * 48, algorithm="HS256"),
             "expired": lambda: _hs(agent.stack.secret.encode(), **run, iat=int(time.time()) - 120,
                                    exp=int(time.time()) - 60),
             "garbage": lambda: "nope"}[refused]()
    assert post_read(agent.stack, f"Bearer {token}", key).status_code == 401
    assert not agent.stack.redis.exists(keys.idempotency(agent.tenant, key))
    response = post_read(agent.stack, f"Bearer {agent.token}", key)
    assert response.status_code == 404 and response.json()["code"] == "file_not_found"
    assert "Idempotent-Replayed" not in response.headers


def test_revoked_jti_is_401(agent) -> None:
    jti = jwt.decode(agent.token, options={"verify_signature": False})["jti"]
    assert post_read(agent.stack, f"Bearer {agent.token}").status_code == 404  # works before revocation
    agent.stack.redis.set(f"rw:revoked:{jti}", "1", ex=600)
    try:
        assert_unauthorized(post_read(agent.stack, f"Bearer {agent.token}"), agent.stack.secret)
        shown = agent.get(str(uuid.uuid4()))
        assert shown.status_code == 401  # every route, not only POST
        # POST checks revocation inside the idempotency claim; what fails before it still says 401
        key = uuid.uuid4().hex
        assert_unauthorized(post_read(agent.stack, f"Bearer {agent.token}", key), agent.stack.secret)
        bad_key = requests.post(f"{agent.stack.base_url}/v1/tool-calls", data=b"{}", timeout=30, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {agent.token}", "Idempotency-Key": "!"})
        assert_unauthorized(bad_key, agent.stack.secret)
        forbidden = agent.call("read_file", {"path": "../x"})
        assert forbidden.status_code == 401, forbidden.text
    finally:
        agent.stack.redis.delete(f"rw:revoked:{jti}")
    # the refused request claimed nothing: the same key runs once the token is valid again
    assert post_read(agent.stack, f"Bearer {agent.token}", key).status_code == 404


@pytest.mark.parametrize("scopes, tool, parameters, needed", [
    (["shell:exec"], "read_file", {"path": "a.txt"}, "files:read"),
    (["shell:exec"], "apply_file_patch", {"path": "a.txt", "diff": "--- /dev/null\n+++ b/a.txt\n@@ -0,0 +1 @@\n+x\n",
                                          "base_sha": "0" * 40}, "files:write"),
    (["files:read"], "apply_file_patch", {"path": "a.txt", "diff": "--- /dev/null\n+++ b/a.txt\n@@ -0,0 +1 @@\n+x\n",
                                          "base_sha": "0" * 40}, "files:write"),
    (["files:read", "files:write"], "execute_shell_command", {"command": "touch pwned"}, "shell:exec"),
    (["shell:network"], "execute_shell_command", {"command": "touch pwned"}, "shell:exec"),
    ([], "read_file", {"path": "a.txt"}, "files:read"),
])
def test_missing_scope_is_403(make_agent, scopes, tool, parameters, needed) -> None:
    caller = make_agent(scopes=scopes)
    key = uuid.uuid4().hex
    response = caller.call(tool, parameters, key=key)
    assert response.status_code == 403, response.text
    assert response.headers["Content-Type"] == PROBLEM_JSON
    assert response.json()["code"] == "forbidden_scope"
    assert needed in response.json()["detail"]
    # Refused before acceptance: no record, no claim, so no message was ever queued for it.
    assert not caller.stack.redis.exists(keys.task(keys.task_id_for(caller.tenant, key)))
    assert not caller.stack.redis.exists(keys.idempotency(caller.tenant, key))
    assert not (caller.workspace / "a.txt").exists() and not (caller.workspace / "pwned").exists()


# --- algorithm confusion on an RS256-configured API ----------------------------------------------

@pytest.fixture(scope="module")
def rs_stack(stack, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A second API configured with an RSA public key, sharing the session's Redis and workers."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from tests.conftest import start_stack

    tmp = tmp_path_factory.mktemp("rs-stack")
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public_pem = private.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo)
    key_path = Path(tmp / "jwt.pub")
    key_path.write_bytes(public_pem)
    info = start_stack(tmp, workers=0, redis_url=stack.redis_url, RUNWARDEN_JWT_PUBLIC_KEY=str(key_path),
                       RUNWARDEN_WORKSPACES=str(stack.workspaces))
    try:
        yield info, private, public_pem
    finally:
        info.stack.stop()


def test_rs256_stack_accepts_its_own_tokens(rs_stack) -> None:
    info, private, _ = rs_stack
    token = jwt.encode(claims(), private, algorithm="RS256")
    response = post_read(info, f"Bearer {token}")
    assert response.status_code == 404 and response.json()["code"] == "file_not_found", response.text


@pytest.mark.parametrize("attack", ["hs256_keyed_with_public_pem", "hs256_with_hs_secret", "alg_none",
                                    "rs512_same_key", "ps256_same_key"])
def test_rs256_stack_refuses_algorithm_confusion(rs_stack, stack, attack: str) -> None:
    info, private, public_pem = rs_stack
    if attack == "hs256_keyed_with_public_pem":
        token = raw_token({"alg": "HS256", "typ": "JWT"}, claims(), public_pem)
    elif attack == "hs256_with_hs_secret":
        token = jwt.encode(claims(), info.secret.encode(), algorithm="HS256")
    elif attack == "alg_none":
        token = raw_token({"alg": "none"}, claims(), None)
    elif attack == "rs512_same_key":
        token = jwt.encode(claims(), private, algorithm="RS512")
    else:
        token = jwt.encode(claims(), private, algorithm="PS256")
    response = post_read(info, f"Bearer {token}")
    assert_unauthorized(response, info.secret)
    assert public_pem.decode() not in response.text


# --- issue 18 item 2: `$` in Python's re.match also matches before a final newline ------------------

@pytest.mark.parametrize("claim, value", [("tenant", "A\n"), ("run_id", "r1\n"), ("tenant", "\nA"),
                                          ("run_id", "r1\n\n")])
def test_name_claim_with_a_newline_is_401(stack, claim: str, value: str) -> None:
    response = post_read(stack, "Bearer " + _hs(stack.secret.encode(), **{claim: value}))
    assert_unauthorized(response, stack.secret)
    assert not any("\n" in path.name for path in stack.workspaces.rglob("*")), "a workspace was named with \\n"
