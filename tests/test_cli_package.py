"""`fgpu` installs on its own (issue 19.9): fgpu_cli/ imports only the standard library, itself,
websockets and protocol (which its own package ships, and which imports only the standard
library), its own pyproject.toml asks for nothing else, `fgpu --help` loads neither asyncio
nor urllib.request, and the server, the agent and the CLI write amounts and sizes with the one
set of formatters (protocol.units). How fast it starts is benchmarked, not tested here
(benchmarks/cli_startup.py)."""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = ROOT / "fgpu_cli"


def imported_roots(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_cli_imports_the_standard_library_itself_websockets_and_protocol_only():
    found = {path.name: sorted(imported_roots(path) - set(sys.stdlib_module_names) - {"__future__", "fgpu_cli", "protocol"})
             for path in sorted(CLI.glob("*.py"))}

    assert {name: roots for name, roots in found.items() if roots and roots != ["websockets"]} == {}
    assert "main.py" in found and "formatting.py" in found


def test_what_it_loads_of_protocol_loads_the_standard_library_only():
    probe = ("import sys\nimport fgpu_cli.main, fgpu_cli.formatting, protocol.units\n"
             "print(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names) - {'fgpu_cli', 'protocol', '__main__'}))")
    done = subprocess.run([sys.executable, "-S", "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)

    assert done.stdout.strip() == "[]"


def test_its_own_package_asks_for_websockets_alone_at_the_consoles_version():
    own = tomllib.loads((CLI / "pyproject.toml").read_text())["project"]
    console = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    assert own["dependencies"] == [d for d in console["dependencies"] if d.startswith("websockets==")]
    assert tomllib.loads((CLI / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"] == ["fgpu_cli", "protocol"]
    assert own["scripts"] == console["scripts"] == {"fgpu": "fgpu_cli.main:main"}


def test_fgpu_help_loads_neither_asyncio_nor_the_http_client():
    probe = ("import sys, contextlib, io\nfrom fgpu_cli.main import main\n"
             "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
             "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
             "assert 'usage: fgpu' in out.getvalue(), out.getvalue()\n"
             "print(sorted(m for m in ('asyncio', 'urllib.request', 'http.client', 'ssl', 'websockets', 'django') "
             "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)

    assert done.stdout.strip() == "[]"


def test_server_agent_and_cli_write_amounts_and_sizes_with_the_same_functions():
    from accelerators import models
    from agent import storage
    from fgpu_cli import formatting
    from protocol import units
    from sessions.admission import launch
    from sessions.policy import quotas

    assert models.units is units and storage.format_binary_size is units.format_binary_size
    assert launch.shares_text is quotas.fgpu_text is formatting.fgpu_text is units.fgpu_text
    assert formatting.size(3 << 29) == units.format_binary_size(3 << 29) == "1.5 GiB"
    assert formatting.amount("1500", round_length=1) == units.format_number("1500", binary=False, round_length=1) + " fGPU"
    assert formatting.shares_text("0.125") == units.fgpu_text("0.125") == "0.125"
