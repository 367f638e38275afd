"""Every environment variable the console's processes read is in `.env.example` (STYLE.md's
house rule), found in the code itself: the `common.env` readers' calls, `os.environ` and
`os.getenv` with a literal name, in the web, manager and agent packages."""
from __future__ import annotations

import ast
import re

from tests.conftest import ROOT

PACKAGES = ("accelerators", "accounts", "agent", "common", "console", "protocol", "sessions", "usage")
# Not the console's processes: the virtual nvidia-smi runs inside a session and reads the session's
# environment contract (README, "The session's environment"); the CLI (fgpu_cli) has its own.
INSIDE_A_SESSION = {"agent/nvidia_smi.py"}
READERS = {"env_str", "env_int", "env_bool", "env_list", "env_url", "env_decimal", "env_float", "getenv"}
OURS = re.compile(r"FGPU_[A-Z0-9_]+|DATABASE_URL|REDIS_URL|PORT")  # not PATH, HOME, … (the system's)


def names_read() -> dict[str, str]:
    """{variable: the first file reading it}."""
    found: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts or str(path.relative_to(ROOT)) in INSIDE_A_SESSION:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                name = None
                if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                    func = node.func
                    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                    environ_get = (isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault")
                                   and getattr(func.value, "attr", getattr(func.value, "id", "")) == "environ")
                    if called in READERS or environ_get:
                        name = node.args[0].value
                elif (isinstance(node, ast.Subscript) and getattr(node.value, "attr", "") == "environ"
                      and isinstance(node.slice, ast.Constant)):
                    name = node.slice.value
                if isinstance(name, str) and OURS.fullmatch(name):
                    found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_the_scan_finds_the_settings_variables():
    read = names_read()
    assert {"DATABASE_URL", "REDIS_URL", "FGPU_SECRET_KEY", "FGPU_BACKFILL_LIMIT"} <= set(read)


def test_every_variable_the_product_reads_is_in_env_example():
    documented = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", (ROOT / ".env.example").read_text(), re.MULTILINE))
    missing = {name: where for name, where in names_read().items() if name not in documented}
    assert missing == {}, f"read but not in .env.example: {missing}"
