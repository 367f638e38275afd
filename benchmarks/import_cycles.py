"""The project's import cycles, found with grimp (import-linter's graph library): each strongly
connected component of the graph of its modules (every import counts, a lazy one inside a
function too). Issue 19 counted two before its item 7 (the knot of sessions' scheduler, tasks,
services, events and selectors with accelerators.mig_services, and plugins.cuda ↔ cuda_mig); the
layering test (tests/test_layering.py) keeps it at none.

    python benchmarks/import_cycles.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT_PACKAGES = ("accelerators", "accounts", "agent", "console", "fgpu_cli", "protocol", "sessions", "usage")


def import_cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module of a grimp ImportGraph, each
    sorted, in order of their first module (Tarjan's algorithm, iterative)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in modules:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            for position in range(child, len(edges[node])):
                nxt = edges[node][position]
                if nxt not in index:
                    work.append((node, position + 1))
                    work.append((nxt, 0))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return sorted(found)


ROOT = Path(__file__).resolve().parent.parent


def project_graph():
    """grimp's graph of the project's packages, read from this checkout (its root first on
    sys.path), without grimp's cache."""
    import grimp

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return grimp.build_graph(*ROOT_PACKAGES, cache_dir=None)


if __name__ == "__main__":
    cycles = import_cycles(project_graph())
    print(f"{len(cycles)} import cycle(s)")
    for component in cycles:
        print(f"  {len(component)} modules: {', '.join(component)}")
