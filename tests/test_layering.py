"""The layout keeps its rooms apart (DESIGN.md, "Layout"): the node side (agent/) talks to the
manager only through `protocol`, and `protocol` imports nothing of either side; every package
imports only the layers below its own (LAYERS, the order written once; issue 34.3); no module is
part of an import cycle. Read from the source (every import statement, at any depth, of every
module), so a lazy import inside a function counts too. `make lint` checks the same layers with
import-linter (pyproject.toml's contracts); these tests are the rules' own, in the suite."""
from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

from benchmarks.import_cycles import import_cycles, project_graph

ROOT = Path(__file__).resolve().parent.parent

# What the manager side is: its apps' services, selectors, scheduler, tasks and models.
MANAGER = ("sessions", "accounts", "accelerators.models", "accelerators.services", "accelerators.selectors",
           "accelerators.mig_services", "accelerators.api", "accelerators.admin", "django.db", "rest_framework")


def imports_of(package: str) -> dict[str, set[str]]:
    """{module path: the modules it imports (absolute names)}, for every .py file under `package`."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        if "migrations" in path.parts:
            continue
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        out[str(path.relative_to(ROOT))] = names
    return out


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_agent_imports_nothing_of_the_manager():
    found = {module: sorted(n for n in names if under(n, MANAGER)) for module, names in imports_of("agent").items()}

    assert {m: n for m, n in found.items() if n} == {}
    assert "agent/core.py" in found and "agent/tasks.py" in found  # the walk saw the package


# What the agent may import of the project: the protocol, the pure allocator, the compute plugins
# and the pure configuration parse the mock plugin reads (and itself). Anything else of ours, and
# Django, is the manager's or the console's.
AGENT_MAY_IMPORT = ("agent", "protocol", "accelerators.allocation", "accelerators.plugins", "accelerators.config_parse")
OURS = ("accelerators", "accounts", "agent", "common", "console", "fgpu_cli", "protocol", "sessions", "usage", "django",
        "rest_framework")


def test_the_agent_imports_only_the_protocol_the_allocator_and_the_plugins():
    found = {module: sorted(n for n in names if under(n, OURS) and not under(n, AGENT_MAY_IMPORT))
             for module, names in imports_of("agent").items()}

    assert {m: n for m, n in found.items() if n} == {}
    assert "agent/boot.py" in found and "agent/mig.py" in found


@pytest.mark.parametrize("package", ["accelerators/allocation", "accelerators/plugins"])
def test_the_allocator_and_the_plugins_import_no_django_and_nothing_of_the_apps(package):
    found = {module: sorted(n for n in names if under(n, ("django", "rest_framework", "console", "sessions", "accounts",
                                                          "usage", "agent", "accelerators.models",
                                                          "accelerators.services", "accelerators.selectors")))
             for module, names in imports_of(package).items()}

    assert {m: n for m, n in found.items() if n} == {}


def test_accelerators_import_nothing_of_sessions():
    found = {module: sorted(n for n in names if under(n, ("sessions",))) for module, names in imports_of("accelerators").items()}

    assert {m: n for m, n in found.items() if n} == {}
    assert "accelerators/mig_services.py" in found


# The layers of the code, from the bottom up (README, "The code"; pyproject.toml's layers contract says the
# same): a package imports only packages of the layers below its own; the packages of one layer import
# none of each other. accelerators.allocation is a layer of its own below the rest of accelerators.
LAYERS = (
    ("protocol",),  # what the manager, the agents and the CLI share: names, typed messages, units, environment
    ("accelerators.allocation",),  # the pure allocator
    ("common",),  # the console's shared library: errors, API support, channel layers, the Celery app
    ("accelerators",),  # slot formats, nodes, devices, MIG; the compute plugins
    ("sessions", "agent", "fgpu_cli"),  # compute sessions on the manager side; the node side; the command line
    ("accounts",),  # users, tokens, the profile (which shows quotas and sessions)
    ("usage",),  # samples, accounting, metrics, idle reclamation (reads sessions' models)
    ("console",),  # the wiring: settings, urls, asgi, the Celery app's tasks, manage.py commands
)


def layer_of(module: str) -> tuple[int, str] | None:
    """(layer index, package) of a module name, or None when it is none of ours."""
    best = None
    for index, packages in enumerate(LAYERS):
        for package in packages:
            if under(module, (package,)) and (best is None or len(package) > len(best[1])):
                best = (index, package)
    return best


def upward_imports() -> dict[str, list[str]]:
    """{module path: the imports it makes of a package of its own layer (another package) or of a
    layer above}, every import statement at any depth counted."""
    found = {}
    for packages in LAYERS:
        for package in packages:
            for path, names in imports_of(package.replace(".", "/")).items():
                own = layer_of(path[:-3].replace("/", "."))
                if own is None or own[1] != package:  # a deeper layer's module (accelerators/allocation under accelerators)
                    continue
                bad = sorted(n for n in names if (other := layer_of(n)) and other[1] != package and other[0] >= own[0])
                if bad:
                    found[path] = bad
    return found


def test_no_package_imports_a_package_of_its_layer_or_above():
    assert upward_imports() == {}


def test_the_layers_name_every_package_of_the_code():
    ours = {path.parent.name for path in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks", "demo", "deploy", "var"}

    assert ours == {package.split(".")[0] for packages in LAYERS for package in packages}


def test_the_layer_check_sees_an_import_upwards_and_sideways():
    assert layer_of("sessions.models") == (4, "sessions") and layer_of("accelerators.allocation.core")[1] == "accelerators.allocation"
    assert layer_of("usage.models")[0] > layer_of("sessions.models")[0]  # sessions importing it would be upwards
    assert layer_of("agent.core")[0] == layer_of("sessions.models")[0]  # sessions importing the agent: sideways
    assert layer_of("django.db") is None


def test_no_module_is_part_of_an_import_cycle():
    assert import_cycles(project_graph()) == []


def test_the_cycle_check_finds_a_cycle_through_three_modules_and_ignores_a_chain():
    graph = grimp.ImportGraph()
    for importer, imported in (("a.x", "a.y"), ("a.y", "a.z"), ("a.z", "a.x"), ("a.z", "a.w"), ("b.p", "b.q")):
        graph.add_import(importer=importer, imported=imported)

    assert import_cycles(graph) == [["a.x", "a.y", "a.z"]]


def test_protocol_imports_neither_side():
    found = {module: sorted(n for n in names if under(n, MANAGER + ("agent", "console", "accelerators")))
             for module, names in imports_of("protocol").items()}

    assert {m: n for m, n in found.items() if n} == {}
    assert "protocol/__init__.py" in found


@pytest.mark.parametrize("package", ["sessions", "accelerators", "accounts"])
def test_the_manager_sends_to_agents_by_task_name_only(package):
    """The manager imports nothing of the node side: what both read (the environment contract,
    units) is protocol's, and it sends to agents by task name."""
    found = {module: sorted(n for n in names if under(n, ("agent",)))
             for module, names in imports_of(package).items()}

    assert {m: n for m, n in found.items() if n} == {}


def test_the_layering_check_sees_a_forbidden_import(tmp_path):
    """The check above can fail: an import of a manager module is found, also inside a function."""
    module = ast.parse("def f():\n    from sessions.models import ComputeSession\n")
    names = {n.module for n in ast.walk(module) if isinstance(n, ast.ImportFrom)}

    assert any(under(n, MANAGER) for n in names)


def test_no_script_directory_module_shadows_the_standard_library():
    """`python benchmarks/x.py` (or demo/, deploy/) puts the script's directory first on sys.path:
    a module there named like a standard one (benchmarks/queue.py once) breaks every import of
    it, Django's own included."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    shadowing = [
        str(path.relative_to(root))
        for folder in ("benchmarks", "demo", "deploy", "tests")
        for path in (root / folder).glob("*.py")
        if path.stem in sys.stdlib_module_names
    ]
    assert shadowing == []


def test_the_readme_draws_the_layers_in_this_order():
    """README's "The code" draws LAYERS top first, side-by-side packages on one line."""
    text = (ROOT / "README.md").read_text()
    drawing = text[text.index("## The code\n"):].split("```")[1]
    drawn = []
    for line in drawing.splitlines():
        names = [part.split()[0] for part in line.split("│") if part.strip().split()[:1] and part.split()[0].endswith("/")]
        if names:
            drawn.append(tuple(name.rstrip("/").replace("/", ".") for name in names))

    assert drawn == list(reversed(LAYERS))
