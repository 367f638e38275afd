"""`fgpu mig profiles` and `fgpu mig layout`: the MIG API's answers as human text. Pure functions
over the JSON of `GET /api/v1/mig/profiles/`, `/api/v1/mig/layouts/` and `/api/v1/nodes/<name>/mig/`."""

from __future__ import annotations

from fgpu_cli.formatting import size, table

STATES = {"in_use": "in use", "idle": "idle", "unknown": "unknown"}
# One character per memory slice in a GPU's map: in use, idle, unknown, free, stranded.
MAP_MARKS = {"in_use": "U", "idle": "I", "unknown": "?", "free": ".", "stranded": "x"}
MAP_LEGEND = "U in use, I idle, ? unknown (not planned by the manager), . free, x stranded"


def _starts(placements: list[dict]) -> str:
    """[{"start": 0, "size": 1}, …] → "0-6" for a run of consecutive starts, else "0,2,4,6"."""
    starts = [p.get("start") for p in placements]
    first = starts[0] if starts else None
    if len(starts) > 2 and isinstance(first, int) and starts == list(range(first, first + len(starts))):
        return f"{starts[0]}-{starts[-1]}"
    return ",".join(str(s) for s in starts) or "-"


def profiles_text(catalogs: list[dict]) -> str:
    """One row per profile of each catalog: model, source (built-in / nvml), name, profile id,
    compute slices of 7, memory slices of 8, memory, SMs, max instances, allowed starts."""
    rows = []
    for catalog in catalogs:
        for p in catalog.get("profiles") or []:
            memory = size(p.get("memory")) + (" *" if p.get("memory_assumed") else "")
            rows.append(
                [
                    catalog.get("model"),
                    catalog.get("source"),
                    p.get("name"),
                    p.get("profile_id"),
                    f"{p.get('compute_slices')}/7",
                    f"{p.get('memory_slices')}/8",
                    memory,
                    p.get("sm_count") or "?",
                    p.get("max_instances"),
                    _starts(p.get("placements") or []),
                ]
            )
    text = table(["MODEL", "SOURCE", "PROFILE", "ID", "COMPUTE", "MEMORY SLICES", "MEMORY", "SMs", "MAX", "STARTS"], rows)
    if any(p.get("memory_assumed") for c in catalogs for p in c.get("profiles") or []):
        text += "\n* memory derived, not captured from a GPU"
    return text


def _slice_map(layout: dict) -> str:
    marks = ["." for _ in range(8)]
    for slot in layout.get("stranded_slices") or []:
        marks[slot] = MAP_MARKS["stranded"]
    for instance in layout.get("instances") or []:
        placement = instance.get("placement") or {}
        for slot in range(placement.get("start", 0), placement.get("start", 0) + placement.get("size", 0)):
            if 0 <= slot < 8:
                marks[slot] = MAP_MARKS.get(instance.get("state"), "?")
    return " ".join(marks)


def _session_text(session: dict | None) -> str:
    return f"{session.get('name')} ({session.get('owner')})" if session else ""


def layout_text(layouts: list[dict]) -> str:
    """Each MIG GPU as a block: a header (node, GPU, model, MIG mode), its 8 memory slices as a
    map, a table of its GPU instances, and its free and stranded slices."""
    if not layouts:
        return "No MIG-capable GPU."
    blocks = []
    for layout in layouts:
        gpu = layout.get("gpu") or {}
        header = (
            f"{layout.get('node')} GPU {gpu.get('index')} · {layout.get('model')} · MIG {layout.get('mig_mode')}"
            f" · catalog {layout.get('catalog_source')}"
        )
        lines = [header, "memory slices  0 1 2 3 4 5 6 7", f"               {_slice_map(layout)}"]
        rows = []
        for i in layout.get("instances") or []:
            placement = i.get("placement") or {}
            start, end = placement.get("start"), placement.get("start", 0) + placement.get("size", 1) - 1
            rows.append(
                [
                    i.get("profile"),
                    f"{start}-{end}" if end != start else str(start),
                    size(i.get("memory")),
                    i.get("sm_count"),
                    STATES.get(i.get("state"), i.get("state")),
                    _session_text(i.get("session")),
                    i.get("uuid"),
                ]
            )
        if rows:
            lines.append(table(["INSTANCE", "SLICES", "MEMORY", "SMs", "STATE", "SESSION", "MIG DEVICE"], rows))
        free = ", ".join(str(s) for s in layout.get("free_slices") or []) or "none"
        stranded = layout.get("stranded_slices") or []
        lines.append(
            f"free memory slices: {free}"
            + (f" (stranded: {', '.join(map(str, stranded))})" if stranded else "")
            + f"; free compute slices: {layout.get('free_compute_slices')} of 7"
        )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + f"\n\n{MAP_LEGEND}"


def node_text(node: dict) -> str:
    """A node's MIG: its mode, its fixed layout (mode "fixed"), then `layout_text` of its GPUs."""
    lines = [f"Node {node.get('name')}: MIG {node.get('mig_mode')}"]
    if node.get("mig_mode") == "fixed":
        for gpu, entries in sorted((node.get("mig_layout") or {}).items()):
            placed = ", ".join(f"{e.get('profile')}@{e.get('start')}" for e in entries or []) or "none"
            lines.append(f"fixed layout of GPU {gpu}: {placed}")
    return "\n".join(lines) + "\n\n" + layout_text(node.get("gpus") or [])
