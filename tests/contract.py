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
    "apply_file_patches": ({"patches"}, {"dry_run"}),  # v1.1, section 13
}
# Sections 2 and 13: a patch set's entries, 1 to 64 of them, each what apply_file_patch takes.
PATCH_ENTRY = {"path", "diff", "base_sha"}
MAX_PATCHES = 64
# Section 13: what every shell result and exit event carries, besides section 2's and 5's fields.
TERMINATIONS = {"exited", "signaled", "timed_out", "cancelled", "oom_killed", "output_capped", "lost"}
USAGE_FIELDS = {"peak_memory_bytes", "cpu_time_ms"}

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
    assert_forty_hex(schemas["apply_file_patch"]["properties"]["base_sha"])
    patches = schemas["apply_file_patches"]["properties"]["patches"]
    assert (patches["type"], patches["minItems"], patches["maxItems"]) == ("array", 1, MAX_PATCHES), patches
    entry = patches["items"]
    assert entry["additionalProperties"] is False and set(entry["required"]) == set(entry["properties"]) == PATCH_ENTRY
    assert all(0 < spec["maxLength"] <= 1024 * 1024 for spec in entry["properties"].values()), entry
    assert_forty_hex(entry["properties"]["base_sha"])
    dry_run = schemas["apply_file_patches"]["properties"]["dry_run"]
    assert (dry_run["type"], dry_run["default"]) == ("boolean", False)


def assert_forty_hex(spec: dict[str, Any]) -> None:
    """base_sha: forty lower-case hex digits, nothing before or after (not even a newline)."""
    pattern = re.compile(spec["pattern"])
    assert spec["maxLength"] == 40 and pattern.search("0123456789abcdef" * 2 + "01234567")
    for wrong in ("0" * 39, "0" * 41, "0" * 40 + "\n", "A" * 40, " " + "0" * 39):
        assert not pattern.search(wrong), (spec, wrong)
