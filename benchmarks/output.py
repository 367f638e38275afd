"""How a benchmark ends: its figures printed and written to its --out file."""

from __future__ import annotations

import time
from pathlib import Path


def figures_write(lines: list[str], *, began: float, command: str, out: Path) -> str:
    """Add "(took N s: <command>)" after a blank line to `lines` (N: whole seconds since
    `began`, a `time.perf_counter()` reading; `command`: the run's command line, options and
    all, so the figures say how to get them again), print them and write them to `out`
    (replaced; its folder made if missing). Returns the text written."""
    text = "\n".join([*lines, f"\n(took {time.perf_counter() - began:.0f} s: {command})"]) + "\n"
    print(text, end="")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text
