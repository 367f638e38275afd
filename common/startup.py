"""What a long-running process does once it has imported what it serves with.

`freeze_imported_objects`: Python's full (generation 2) garbage collection walks every object the
collector tracks, and a console process holds a few hundred thousand from its imports (Django, DRF,
Channels, Celery, the compute plugins). Measured with a `gc.callbacks` probe while
benchmarks/terminal.py ran: 70-146 ms a full collection in daphne and in the agent, a stall of every
terminal the process relays (issue 14: echo p99). `gc.freeze()` moves the objects alive then into
the permanent generation, which no collection walks; a full collection then walks only what the
process made since. The gc module's documentation describes it (Python 3.7+,
https://docs.python.org/3/library/gc.html#gc.freeze); Instagram's "Dismissing Python Garbage
Collection" is where the practice comes from.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_imported_objects(what: str) -> None:
    """Collect once, then freeze every object alive (see the module's docstring); once a process:
    a later call does nothing (the agent's in-process Celery worker, ready after the agent froze).
    `what`: the process, for the log line (how many objects were frozen and how long the
    collection took)."""
    if gc.get_freeze_count():
        return
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info(
        "%s: %d objects frozen out of garbage collection (%.0f ms)",
        what,
        gc.get_freeze_count(),
        1000 * (time.perf_counter() - started),
    )
