"""What /work/shared/CONTRACT.md says, written out here, so tests compare the code with the
contract instead of with the code's own values."""
from __future__ import annotations

import re
from typing import Any

# Section 2: each tool's (required, optional) parameters.
TOOL_PARAMETERS = {
    "read_file": ({"path"}, set()),
    "apply_file_patch": ({"path", "diff", "base_sha"}, set()),
    "execute_shell_command": ({"command"}, {"timeout_ms", "cwd"}),
}

# Sections 2 and 7: the routes and their methods (the WebSocket stream is described in the text).
ROUTES = {
    ("/v1/tool-calls", "post"), ("/v1/tool-calls/{task_id}", "get"), ("/v1/tool-calls/{task_id}", "delete"),
    ("/v1/tools", "get"), ("/healthz", "get"), ("/readyz", "get"), ("/metrics", "get"),
    ("/v1/audit", "get"),  # section 12
}
# Section 11: workspaces.
ROUTES |= {("/v1/workspaces", "get"), ("/v1/workspaces/{run_id}", "put"), ("/v1/workspaces/{run_id}", "delete")}


def assert_tool_parameters(schemas: dict[str, dict[str, Any]]) -> None:
    """Each tool's parameter schema is the contract's: strict, the listed properties, every string
    bounded, timeout_ms 1..60000 (default 30000), base_sha 40 hex."""
    assert set(schemas) == set(TOOL_PARAMETERS), sorted(schemas)
    for name, schema in schemas.items():
        required, optional = TOOL_PARAMETERS[name]
        assert schema["type"] == "object" and schema["additionalProperties"] is False, (name, schema)
        assert set(schema["required"]) == required and set(schema["properties"]) == required | optional, name
        for prop, spec in schema["properties"].items():
            assert spec["type"] != "string" or 0 < spec.get("maxLength", 0) <= 1024 * 1024, (name, prop, spec)
    timeout = schemas["execute_shell_command"]["properties"]["timeout_ms"]
    assert (timeout["type"], timeout["minimum"], timeout["maximum"], timeout["default"]) == ("integer", 1, 60000, 30000)
    base_sha = schemas["apply_file_patch"]["properties"]["base_sha"]
    assert base_sha["maxLength"] == 40
    # JSON Schema patterns are searched (ECMA-262): forty hex digits, the whole value, nothing else.
    pattern = re.compile(base_sha["pattern"])
    assert pattern.search("0123456789abcdef" * 2 + "01234567")
    for wrong in ("a" * 39, "a" * 41, "A" * 40, "a" * 40 + "\n", "\n" + "a" * 40, "g" * 40):
        assert not pattern.search(wrong), wrong
