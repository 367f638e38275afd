"""The waiting and active sessions kept between reads, each read again only when its row changed
(issue 35.2: the ETA, the what-if and the fragmentation map read all 2,000 of them as model
instances, with their owners, images, nodes and allocations, at the first ask after any change:
most of that ask's time at 1,000 nodes).

How a change is seen: one statement gives each PENDING or active session's fingerprint, the md5
of everything the readers take from it — its whole row, its node's name, status and resource
group, its owner's name, its image's reference, its allocations' rows and the GPU instances it
holds —; only the sessions whose fingerprint is new are read whole (one query, prefetching their
live allocations and GPU instances). A session written between the two statements is read as
it then is and is read again at the next use (its fingerprint no longer matches): never kept
stale. Every column counts, not only `version` (a pass writes `overtaken` without raising it).

PostgreSQL only (md5 of a row's text); on SQLite (standalone: a handful of sessions) each use
reads them all, as before. The instances handed out are shared between readers: read, never
change them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import Prefetch, QuerySet

from accelerators.models import GpuInstance, Node
from sessions.models import ACTIVE_STATUSES, Allocation, ComputeSession, SessionImage, SessionStatus

STATUSES = (SessionStatus.PENDING, *ACTIVE_STATUSES)


def _loaded(sessions: QuerySet) -> QuerySet:
    """`sessions` as the readers take them: owner, image and node joined; live allocations
    (`live`, unreleased, by id) and GPU instances prefetched."""
    return sessions.select_related("owner", "image", "node").prefetch_related(
        Prefetch("allocations", queryset=Allocation.objects.filter(released_at__isnull=True).order_by("pk"), to_attr="live"),
        "gpu_instances",
    )


def _fingerprints_sql() -> str:
    s, n = ComputeSession._meta.db_table, Node._meta.db_table
    u, i = get_user_model()._meta.db_table, SessionImage._meta.db_table
    a, g = Allocation._meta.db_table, GpuInstance._meta.db_table
    return (
        f"SELECT s.id, md5(concat_ws('|', row(s.*)::text, n.name, n.status, n.resource_group_id, u.username, i.reference, "
        f"(SELECT string_agg(row(a.*)::text, ',' ORDER BY a.id) FROM {a} a WHERE a.session_id = s.id), "
        f"(SELECT string_agg(g.id::text, ',' ORDER BY g.id) FROM {g} g WHERE g.session_id = s.id))) "
        f"FROM {s} s LEFT JOIN {n} n ON n.id = s.node_id LEFT JOIN {u} u ON u.id = s.owner_id "
        f"LEFT JOIN {i} i ON i.id = s.image_id WHERE s.status = ANY(%s)"
    )


class KeptSessions:
    """This process's kept sessions (module docstring): `read()` gives every PENDING and active
    session as it is now; `reads` (sessions read whole, for tests and benchmarks)."""

    def __init__(self) -> None:
        self._kept: dict = {}  # pk → (fingerprint, ComputeSession)
        self._lock = threading.Lock()
        self.reads = 0

    def read(self) -> list[ComputeSession]:
        """Every PENDING and active session (with `live` allocations and prefetched GPU
        instances), unordered: one statement, and one read of those that changed since."""
        if connection.vendor != "postgresql":
            return list(_loaded(ComputeSession.objects.filter(status__in=STATUSES)))
        with connection.cursor() as cursor:
            cursor.execute(_fingerprints_sql(), [[str(status) for status in STATUSES]])
            prints = dict(cursor.fetchall())
        with self._lock:
            kept = {pk: found for pk, found in self._kept.items() if pk in prints}
        changed = [pk for pk, fingerprint in prints.items() if pk not in kept or kept[pk][0] != fingerprint]
        if changed:
            read = {s.pk: s for s in _loaded(ComputeSession.objects.filter(pk__in=changed, status__in=STATUSES))}
            for pk in changed:
                if pk in read:
                    kept[pk] = (prints[pk], read[pk])
                else:  # it left the queue between the two statements
                    kept.pop(pk, None)
            self.reads += len(read)
        with self._lock:
            self._kept = kept
        return [session for _, session in kept.values()]

    def forget(self) -> None:
        """Read every session whole at the next use (a test's fresh database)."""
        with self._lock:
            self._kept = {}


_KEPT = KeptSessions()


def kept_sessions() -> KeptSessions:
    """This process's kept sessions."""
    return _KEPT


def queue_read() -> tuple[list[ComputeSession], list[ComputeSession]]:
    """(PENDING sessions in the pass's stored order: priority first, then arrival, then id;
    active sessions by arrival, then id), from the kept sessions."""
    sessions = kept_sessions().read()
    pending = sorted((s for s in sessions if s.status == SessionStatus.PENDING), key=lambda s: (-s.priority, s.created_at, s.pk))
    active = sorted((s for s in sessions if s.status in ACTIVE_STATUSES), key=lambda s: (s.created_at, s.pk))
    return pending, active


def active_on(node_names: Iterable[str], active: list[ComputeSession] | None = None) -> list[ComputeSession]:
    """The kept active sessions on the nodes named `node_names`, by arrival then id; `active`:
    `queue_read()`'s active sessions, read already."""
    names = set(node_names)
    return [s for s in (queue_read()[1] if active is None else active) if s.node is not None and s.node.name in names]
