"""The session list's read model: each web process keeps the API shapes it rendered
(SessionSerializer's representation, a dict), each with the fingerprint of the rows it was
rendered from, and serves a page of sessions from them while the fingerprints still match.

Why: a page of 100 sessions costs six queries whatever its length (sessions_shown), but building
their model instances and serializing them costs about 30 ms on a 2-core machine, seven times a
`GET /api/v1/me/` (issue 14; benchmarks/api.py). Sessions change far less often than pages are
read (the console's list refreshes on every notice).

The fingerprint is the session row's `xmin` (the transaction that wrote its current version:
PostgreSQL gives every write a new one) and every slot format's. Triggers (migration
compute_sessions 0013) rewrite a session's row whenever another row its shape is made from
changes: its allocations and GPU instances, their devices' shown fields, its node's name,
attributes and MIG mode (not the heartbeat's columns), its image, its owner's username. So no
write anywhere (an ORM save, a queryset update, an administrator's SQL) leaves a stale shape in
the list: the next page sees another fingerprint and renders the session again. Settings and
code are the process's own, so a restart, which empties the memory, takes their changes. A
shape served is the dict kept here: nothing may change it (the renderer only reads it).

A rendered shape is kept with the fingerprint read in the same snapshot as its rows (one
REPEATABLE READ transaction), so a write between the two reads cannot pair an old fingerprint
with a new shape. Kept only on PostgreSQL and outside a transaction: inside one, the caller's own
writes share one `xmin` (another database, standalone's SQLite, renders every page).

Shapes kept: at most SHAPE_CACHE_SIZE per process (the least recently served go first), about
4 KiB each. A new field of the shape that reads another table needs a trigger in a migration like
0013's; tests/test_session_shapes.py checks each one against a fresh render.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from django.db import connection, transaction
from django.db.models.expressions import RawSQL

from accelerators.models import SlotFormat
from sessions.models import ComputeSession

SHAPE_CACHE_SIZE = 10_000  # shapes per web process (≈ 40 MiB at most: 4 KiB each, measured)


def _shape_key_sql() -> str:
    """The fingerprint of the session row aliased by its table name (module docstring), as SQL:
    its row version's `xmin`, then every slot format's (an InitPlan: once per page)."""
    return (
        f"concat_ws('|', {ComputeSession._meta.db_table}.xmin, "
        f"(SELECT string_agg(f.xmin::text, ',' ORDER BY f.id) FROM {SlotFormat._meta.db_table} f))"
    )


class ShapeCache:
    """Rendered shapes by session id, each with its fingerprint: `{id: (key, shape)}`, at most
    `size`, least recently served first out. Safe to share between a process's threads."""

    def __init__(self, size: int = SHAPE_CACHE_SIZE):
        self.size = size
        self._shapes: OrderedDict[object, tuple[str, dict]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, session_id, key: str) -> dict | None:
        with self._lock:
            kept = self._shapes.get(session_id)
            if kept is None or kept[0] != key:
                return None
            self._shapes.move_to_end(session_id)
            return kept[1]

    def put(self, session_id, key: str, shape: dict) -> None:
        with self._lock:
            self._shapes[session_id] = (key, shape)
            self._shapes.move_to_end(session_id)
            while len(self._shapes) > self.size:
                self._shapes.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._shapes.clear()


SHAPES = ShapeCache()


def shapes_kept() -> bool:
    """Whether this request's pages of sessions come from kept shapes: on PostgreSQL, outside a
    transaction (module docstring)."""
    return connection.vendor == "postgresql" and not connection.in_atomic_block


def with_shape_keys(sessions):
    """A ComputeSession queryset (filtered and ordered as the page wants) → its `(id, key)`
    pairs: one query, the fingerprints computed by the database (module docstring)."""
    return sessions.prefetch_related(None).annotate(shape_key=RawSQL(_shape_key_sql(), ())).values_list("pk", "shape_key")


def session_shapes(page: list[tuple], *, render, cache: ShapeCache = SHAPES) -> tuple[list[dict], str]:
    """The API shapes of a page of sessions, in its order, and the page's digest (hex: changes
    when any shape may have; for an ETag). `page`: `with_shape_keys`' pairs; `render(ids)`:
    {id: shape} of those sessions, read now (sessions_shown + SessionSerializer). A session
    whose kept shape has another fingerprint, or none, is rendered again with its fingerprint
    read in the same snapshot, and kept; one deleted meanwhile is left out."""
    shapes: dict = {}
    missing = []
    for session_id, key in page:
        shape = cache.get(session_id, key)
        if shape is None:
            missing.append(session_id)
        else:
            shapes[session_id] = shape
    keys = dict(page)
    if missing:
        with _one_snapshot():
            fresh_keys = dict(with_shape_keys(ComputeSession.objects.filter(pk__in=missing)))
            rendered = render(missing)
        for session_id, shape in rendered.items():
            if session_id in fresh_keys:
                keys[session_id] = fresh_keys[session_id]
                cache.put(session_id, fresh_keys[session_id], shape)
                shapes[session_id] = shape
    digest = hashlib.sha256(";".join(f"{i}:{keys[i]}" for i, _ in page if i in shapes).encode()).hexdigest()
    return [shapes[i] for i, _ in page if i in shapes], digest


def _one_snapshot() -> transaction.Atomic:
    """A transaction whose reads all see one snapshot (REPEATABLE READ); opened outside any
    other (shapes_kept)."""
    return _RepeatableRead(using=None, savepoint=False, durable=True)


class _RepeatableRead(transaction.Atomic):
    def __enter__(self) -> None:
        super().__enter__()
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
