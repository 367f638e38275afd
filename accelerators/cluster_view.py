"""The kept cluster view (issue 35.1): one in-memory view per process of the nodes, their
devices and device links and what live allocations and active sessions hold of them, as the
allocator sees them (`core.NodeState`), brought up to date from what changed instead of rebuilt
for each launch, preview, scheduler pass, ETA, what-if and fragmentation map.

How it learns what changed: the change log `accelerators_clusterchange` (migration 0013), a row
per node a write touched, inserted by triggers in the writer's own transaction. At each use the
view reads, in one statement, the log rows it has not applied and the statement's snapshot
`xmin` (every transaction older than it has ended), and reloads only the nodes those rows name:
a few rows and a few nodes where a full read is 1,000 nodes and 8,000 devices. The log is read
by transaction id, not by row id: ids are handed out before commit, so a row with a smaller id
may become visible after a larger one; a row whose transaction was still running at the last
read (txid ≥ that read's `xmin`) is read again until its transaction has ended (Debezium's and
Kueue's lesson alike: apply what committed, in any order, idempotently).

Why a log read in the caller's transaction rather than PostgreSQL LISTEN/NOTIFY: a notice comes
on another connection at some later time, so a reader never knows whether a committed change's
notice is still on its way; the log is read in the same snapshot as the rows the caller locked,
so after the caller's `select_for_update` (the scheduler's pass) the view is exactly the
database's committed state for those rows: nothing is placed on stale data. It needs no
listener thread in the web process, and a restarted process simply reads everything once.

Own writes: a transaction that has written the placement's inputs itself sees its uncommitted
rows; those nodes are read for that caller only (an overlay) and read again by the next
caller, never kept, so a rollback leaves nothing behind.

On SQLite (standalone: a handful of nodes, one process) nothing is kept: each use reads the
database as before. Log rows older than `KEEP_SECONDS` are deleted (at most once a minute per
process); a view that has not read the log for `STALE_SECONDS` reads everything again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from decimal import Decimal

from django.db import connection

import protocol
from accelerators.allocation import cluster, core, topology
from accelerators.live_usage import device_state, devices_with_usage, nodes_with_usage
from accelerators.mig_selectors import mig_exclusion
from accelerators.models import Device, DeviceLink, Node, NodeStatus, ResourceGroup

KEEP_SECONDS = 600
STALE_SECONDS = 300
_CLEAN_EVERY = 60.0


@dataclass(frozen=True)
class NodeEntry:
    """One node as the view keeps it: its row's placement fields, and per slot its non-MIG
    devices (`core.DeviceState`, with live usage) and device links. `images`: the session image
    keys its agent reports holding; `pulls_images`: its agent pulls images it lacks."""

    pk: str
    name: str
    status: str
    draining: bool
    shared_storage: bool  # its data-root is the cluster's shared mount (core.storage_scope)
    group_id: int | None
    images: frozenset[str]
    pulls_images: bool
    cpu_total: int
    mem_total: int
    cpu_used: int
    mem_used: int
    weights: tuple[Decimal, Decimal, Decimal]
    devices: dict[str, tuple[core.DeviceState, ...]]
    links: dict[str, tuple[topology.Link, ...]]
    # (slot, "empty" | "kind") → its emptied NodeState and its `shape_key`, built at first use:
    # the entry never changes, so neither do they (a changed node is a new entry)
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    def state(self, slot_name: str, *, usage: bool = True) -> core.NodeState:
        """The allocator's NodeState for `slot_name` (node_id = the node's name); without
        `usage`, nothing read as used. Built once per entry, slot and `usage`, then shared (a
        NodeState is never changed in place: a plan makes a new one, `core.apply_placement`)."""
        key = (slot_name, "used" if usage else "empty")
        found = self._derived.get(key)
        if found is None:
            found = self._derived[key] = self._state(slot_name, usage=usage)
        return found

    def kind(self, slot_name: str) -> tuple:
        """`shape_key` of this node emptied, for `slot_name` (built once per entry and slot)."""
        key = (slot_name, "kind")
        found = self._derived.get(key)
        if found is None:
            found = self._derived[key] = shape_key(self.state(slot_name, usage=False))
        return found

    def _state(self, slot_name: str, *, usage: bool) -> core.NodeState:
        devices = self.devices.get(slot_name, ())
        if not usage:
            devices = tuple(replace(d, memory_used=0, proc_used=Decimal(0), sessions=0) for d in devices)
        return core.NodeState(
            node_id=self.name,
            cpu_total=self.cpu_total,
            mem_total=self.mem_total,
            cpu_used=self.cpu_used if usage else 0,
            mem_used=self.mem_used if usage else 0,
            devices=devices,
            links=self.links.get(slot_name, ()),
            weights=self.weights,
            shared_storage=self.shared_storage,
        )

    def runs_image(self, reference: str) -> bool:
        """As `accelerators.selectors.node_runs_image`, in memory."""
        if reference in self.images or protocol.image_key(reference) in self.images:
            return True
        return reference != protocol.HOST_IMAGE and self.pulls_images


@dataclass
class Snapshot:
    """What one caller reads: the kept entries (shared, never changed in place) with the caller's
    own overlay, the view's version then (it grows with every change applied), and the version
    at which a node last left the kept entries (deleted, or kept out as a writer's own; 0: none
    yet), so that what is kept per node elsewhere (accelerators.api's node list) is pruned only
    when a node has gone."""

    entries: dict[str, NodeEntry]
    version: int
    overlay: bool = False
    removed: int = 0

    def nodes(self, *, alive_only: bool = True, group_id: int | None = None, image: str = "") -> list[NodeEntry]:
        """The entries `node_states` would read, by name."""
        found = (
            e
            for e in self.entries.values()
            if (not alive_only or (e.status == NodeStatus.ALIVE and not e.draining))
            and (group_id is None or e.group_id == group_id)
            and (not image or e.runs_image(image))
        )
        return sorted(found, key=lambda e: e.name)


@dataclass
class ClusterView:
    """The process's kept view (module docstring). Thread-safe: one refresh at a time."""

    entries: dict[str, NodeEntry] = field(default_factory=dict)
    version: int = 0
    horizon: int | None = None  # xmin of the last log read; None: read everything next
    last: tuple[str, int | None] | None = None  # the last log read's snapshot (text) and its reader's own txid
    seen: dict[int, int] = field(default_factory=dict)  # log row id → txid, rows at or above the horizon
    suspect: set[str] = field(default_factory=set)  # node pks to read again (a writer's own rows)
    read_at: float = 0.0
    cleaned_at: float = 0.0
    reads: int = 0  # full reads, for tests and benchmarks
    reloaded: int = 0  # nodes read again from the log, for tests and benchmarks
    removed: int = 0  # the version at which a node last left `entries` (0: none yet)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> Snapshot:
        """The view brought up to date in the caller's transaction (call after taking the
        caller's locks: the rows it locked are then current in it). On SQLite: read anew."""
        if connection.vendor != "postgresql":
            return Snapshot(entries=_read_nodes(None), version=-1)
        with self._lock:
            now = time.monotonic()
            if self.horizon is None or now - self.read_at > STALE_SECONDS:
                return self._read_all(now)
            kept_own: _Own = getattr(_OWN, "own", None) or _Own()
            xmin, own, changes, own_seen, taken = _changes_since(self.horizon, own_after=kept_own.last_id, last=self.last)
            if own is not None and kept_own.txid == own and own_seen != (kept_own.rows, kept_own.id_sum):
                # A savepoint of this transaction rolled back some of its own rows (a nested atomic
                # block that failed): what it kept of its own nodes may show writes that are gone.
                kept_own = _Own()
                xmin, own, changes, own_seen, taken = _changes_since(self.horizon, own_after=0, last=self.last)
            fresh = [(i, node, txid) for i, node, txid in changes if i not in self.seen]
            if any(node is None for _, node, _ in fresh):  # a resource group changed: weights of many nodes
                return self._read_all(now)
            mine = {node for _, node, txid in fresh if node is not None and own is not None and txid == own}
            theirs = {node for _, node, txid in fresh if node is not None and (own is None or txid != own)}
            for i, _, txid in fresh:
                if own is None or txid != own:
                    self.seen[i] = txid
            self.seen = {i: t for i, t in self.seen.items() if t >= xmin}
            self.horizon, self.read_at, self.last = xmin, now, (taken, own)
            if own is None or kept_own.txid != own:
                kept_own = _Own(txid=own, last_id=kept_own.last_id)
            own_ids = [i for i, _, txid in fresh if own is not None and txid == own]
            kept_own.last_id = max([kept_own.last_id, *own_ids])
            kept_own.rows += len(own_ids)
            kept_own.id_sum += sum(own_ids)
            # Never into the kept view: the nodes this transaction wrote, now or earlier in it.
            shared = (theirs | self.suspect) - mine - kept_own.entries.keys()
            if shared:
                self._apply(_read_nodes(shared), shared)
                self.suspect -= shared
            self.suspect |= mine
            self._clean(now)
            again = mine | (theirs & kept_own.entries.keys())  # its own nodes: new writes of its own, or others'
            if again:
                read = _read_nodes(again)
                kept_own.entries.update(read)
                for pk in again - read.keys():
                    kept_own.entries[pk] = None  # deleted in this transaction
            _OWN.own = kept_own
            if not kept_own.entries:
                return Snapshot(entries=self.entries, version=self.version, removed=self.removed)
            overlay = dict(self.entries)
            for pk, entry in kept_own.entries.items():
                overlay.pop(pk, None)
                if entry is not None:
                    overlay[pk] = entry
            return Snapshot(entries=overlay, version=-1, overlay=True)

    def _read_all(self, now: float) -> Snapshot:
        xmin, own, changes, _, taken = _changes_since(None)
        mine = {node for _, node, txid in changes if own is not None and txid == own}
        if None in mine:  # a resource group changed in this very transaction: read for this caller only
            return Snapshot(entries=_read_nodes(None), version=-1, overlay=True)
        read = _read_nodes(None)
        entries = {pk: e for pk, e in read.items() if pk not in mine}
        gone = not self.entries.keys() <= entries.keys()
        self.entries = entries
        mine_nodes = {pk for pk in mine if pk is not None}
        self.version += 1
        if gone:
            self.removed = self.version
        self.reads += 1
        self.seen = {i: txid for i, _, txid in changes if (own is None or txid != own) and txid >= xmin}
        self.horizon, self.read_at, self.suspect, self.last = xmin, now, mine_nodes, (taken, own)
        own_ids = [i for i, _, txid in changes if txid == own]
        _OWN.own = _Own(
            txid=own,
            last_id=max(own_ids, default=0),
            rows=len(own_ids),
            id_sum=sum(own_ids),
            entries={pk: read.get(pk) for pk in mine_nodes},
        )
        if not mine:
            return Snapshot(entries=self.entries, version=self.version, removed=self.removed)
        return Snapshot(entries=read, version=-1, overlay=True)

    def _apply(self, read: dict[str, NodeEntry], asked: set[str]) -> None:
        entries = dict(self.entries)  # a new dict: snapshots handed out before keep theirs
        for pk in asked:
            entries.pop(pk, None)
        entries.update(read)
        gone = any(pk in self.entries for pk in asked - read.keys())
        self.entries = entries
        self.version += 1
        if gone:
            self.removed = self.version
        self.reloaded += len(asked)

    def _clean(self, now: float) -> None:
        """Delete log rows older than KEEP_SECONDS whose transactions have ended, at most once
        a minute; rows another process is deleting are skipped, never waited for."""
        if now - self.cleaned_at < _CLEAN_EVERY:
            return
        self.cleaned_at = now
        with connection.cursor() as cursor:
            cursor.execute(
                "DELETE FROM accelerators_clusterchange WHERE id IN (SELECT id FROM accelerators_clusterchange "
                "WHERE at < now() - make_interval(secs => %s) AND txid < pg_snapshot_xmin(pg_current_snapshot()) "
                "FOR UPDATE SKIP LOCKED)",
                [KEEP_SECONDS],
            )

    def forget(self) -> None:
        """Read everything at the next use (a test's fresh database, a restore)."""
        with self._lock:
            self.horizon = None


@dataclass
class _Own:
    """What one thread's current transaction wrote itself, as it sees it: its transaction id,
    the last of its own log rows read (its rows come in id order: later rows of its own, and
    any row of a later transaction of this thread, have larger ids), how many of its rows up to
    it were read and their ids' sum (a savepoint's rollback that took some away is seen as a
    change of either: log ids are never reused), and its nodes so read (None: deleted). Never
    part of the kept view."""

    txid: int | None = None
    last_id: int = 0
    rows: int = 0
    id_sum: int = 0
    entries: dict[str, NodeEntry | None] = field(default_factory=dict)


_OWN = threading.local()


def _changes_since(
    horizon: int | None, own_after: int = 0, last: tuple[str, int | None] | None = None
) -> tuple[int, int | None, list[tuple[int, str | None, int]], tuple[int, int], str]:
    """(xmin, own txid or None, [(row id, node pk or None, txid)], (count, id sum), snapshot) of
    the log rows with txid ≥ `horizon` (None: ≥ the snapshot's xmin, those a full read needs to
    know), but not the rows of the caller's own transaction up to id `own_after` (read already),
    whose count and ids' sum come fourth; in one statement: one snapshot, given last as text.

    `last`: the previous read's snapshot and its reader's own txid. Rows whose transaction had
    committed in it were read then (or by a read before it), so only the others come: those of
    transactions it saw running or that began after it, and the previous reader's own (its own
    transaction looks committed in its own snapshot), besides the caller's own. Without it every
    row from `horizon` on would come again at each read, and `horizon` (the oldest transaction
    still open, in any database of the server) may lag far behind: a thousand nodes' rows read
    again at every launch (issue 35.2)."""
    snapshot, last_own = last if last is not None and horizon is not None else (None, None)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT s.xmin, s.own, s.own_rows, s.own_sum, s.snap, l.id, l.node_id, l.txid::text::bigint FROM (SELECT "
            "pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS xmin, pg_current_snapshot()::text AS snap, "
            "pg_current_xact_id_if_assigned()::text::bigint AS own, o.own_rows, o.own_sum FROM (SELECT "
            "count(*) AS own_rows, COALESCE(sum(id), 0)::bigint AS own_sum FROM accelerators_clusterchange "
            "WHERE txid = pg_current_xact_id_if_assigned() AND id <= %s) o) s "
            "LEFT JOIN accelerators_clusterchange l "
            "ON l.txid >= COALESCE(%s::text::xid8, pg_snapshot_xmin(pg_current_snapshot())) "
            "AND (%s::text IS NULL OR NOT pg_visible_in_snapshot(l.txid, %s::text::pg_snapshot) "
            "OR l.txid = %s::text::xid8 OR l.txid = pg_current_xact_id_if_assigned()) "
            "AND NOT (l.txid IS NOT DISTINCT FROM pg_current_xact_id_if_assigned() AND l.id <= %s)",
            [
                own_after,
                None if horizon is None else str(horizon),
                snapshot,
                snapshot,
                None if last_own is None else str(last_own),
                own_after,
            ],
        )
        rows = cursor.fetchall()
    xmin, own, own_rows, own_sum, taken = rows[0][0], rows[0][1], rows[0][2], rows[0][3], rows[0][4]
    changes = [(i, None if node is None else str(node), txid) for _, _, _, _, _, i, node, txid in rows if i is not None]
    return xmin, own, changes, (int(own_rows), int(own_sum)), taken


def _read_nodes(pks: Iterable[str] | None) -> dict[str, NodeEntry]:
    """{node pk: NodeEntry} for `pks` (None: every node) from the database: three queries."""
    nodes = Node.objects.all() if pks is None else Node.objects.filter(pk__in=list(pks))
    rows = list(nodes_with_usage(nodes).select_related("resource_group"))
    devices = Device.objects.filter(is_mig_device=False).exclude(mig_exclusion())
    if pks is not None:
        devices = devices.filter(node__in=[n.pk for n in rows])
    by_node: dict = {}
    for device in devices_with_usage(devices.select_related("node")).order_by("index"):
        by_node.setdefault(device.node_id, {}).setdefault(device.slot_name, []).append(device_state(device))
    links_rows = DeviceLink.objects.all() if pks is None else DeviceLink.objects.filter(node__in=[n.pk for n in rows])
    links: dict = {}
    for node_id, a, b, kind, count, slot in links_rows.values_list(
        "node_id", "device_a_id", "device_b_id", "kind", "count", "device_a__slot_name"
    ):
        links.setdefault(node_id, {}).setdefault(slot, []).append(topology.Link(a=str(a), b=str(b), kind=kind, count=count))
    entries = {}
    for n in rows:
        g: ResourceGroup | None = n.resource_group
        entries[str(n.pk)] = NodeEntry(
            pk=str(n.pk),
            name=n.name,
            status=n.status,
            draining=n.drain_since is not None,
            shared_storage=n.shared_storage,
            group_id=n.resource_group_id,
            images=frozenset(n.images or ()),
            pulls_images=bool((n.attributes or {}).get("pulls_images")),
            cpu_total=n.cpu_count,
            mem_total=n.memory_size,
            cpu_used=int(n.cpu_used or 0),  # nodes_with_usage's annotation
            mem_used=int(n.mem_used or 0),
            weights=(g.weight_memory, g.weight_cores, g.weight_sessions) if g else (Decimal(1),) * 3,
            devices={slot: tuple(states) for slot, states in by_node.get(n.pk, {}).items()},
            links={slot: tuple(found) for slot, found in links.get(n.pk, {}).items()},
        )
    return entries


_VIEW = ClusterView()


def cluster_view() -> ClusterView:
    """This process's kept view."""
    return _VIEW


def view_node_states(
    *,
    slot_name: str,
    alive_only: bool = True,
    group: ResourceGroup | None = None,
    image: str = "",
    usage: bool = True,
    snapshot: Snapshot | None = None,
) -> list[core.NodeState]:
    """`accelerators.selectors.node_states` from the kept view (same shapes and order: by
    name, devices by index); `snapshot`: one already taken (else taken now). Takes no lock:
    a caller that places lock first (`node_states(for_update=True)` does)."""
    snapshot = snapshot or cluster_view().snapshot()
    found = snapshot.nodes(alive_only=alive_only, group_id=group.pk if group else None, image=image)
    return [e.state(slot_name, usage=usage) for e in found]


_INDEXES: dict[tuple, tuple[list[NodeEntry], cluster.ClusterIndex]] = {}
_INDEXES_LOCK = threading.Lock()


def kept_index(key: tuple, entries: list[NodeEntry], slot_name: str, settings) -> cluster.ClusterIndex:
    """`core.cluster_index` of `entries`' states for `slot_name` (rows in `entries`' order) under
    the slot's `settings`, as a copy the caller may change (`ClusterIndex.set_row`, `commit`).

    Kept per `key` (the caller's name for the scope: resource group, slot, image) and settings
    between calls and brought up to date from what changed, instead of built anew (issue 35.2:
    building it from 10,000 nodes' 80,000 devices was 4.2 s of a 19.6 s pass): an entry of the
    view is replaced whenever its node changes, so a row whose entry is still the one kept is as
    it was, and only the others are set again (`core.node_row`). Where the scope's nodes are not
    the same ones in the same order, or a changed node's totals, devices or links changed (its
    `kind`: what `set_row` does not set), the index is built anew."""
    full = key + (settings,)
    with _INDEXES_LOCK:
        found = _INDEXES.get(full)
    index = None
    if found is not None and len(found[0]) == len(entries):
        kept, base = found
        changed = [row for row, (old, new) in enumerate(zip(kept, entries)) if old is not new]
        if all(kept[row].pk == entries[row].pk and kept[row].kind(slot_name) == entries[row].kind(slot_name) for row in changed):
            index = base.copy()
            for row in changed:
                index.set_row(row, **core.node_row(entries[row].state(slot_name), settings))
    if index is None:
        index = core.cluster_index([e.state(slot_name) for e in entries], settings)
    with _INDEXES_LOCK:
        if len(_INDEXES) > 64:
            _INDEXES.clear()
        _INDEXES[full] = (list(entries), index.copy())
    return index


def shape_key(node: core.NodeState) -> tuple:
    """What makes two emptied nodes alike for any request without pinned devices: their totals,
    devices (in order) and links (by device position), and weights; not their names or ids."""
    position = {d.device_id: i for i, d in enumerate(node.devices)}
    return (
        node.cpu_total,
        node.mem_total,
        node.weights,
        tuple(
            (d.memory_total, d.proc_total, d.max_sessions, d.numa_node, d.memory_physical, d.proc_physical) for d in node.devices
        ),
        tuple(sorted((position.get(k.a, -1), position.get(k.b, -1), k.kind, k.count) for k in node.links)),
    )


_KINDS: dict[tuple, list[core.NodeState]] = {}
_KINDS_LOCK = threading.Lock()


def ever_fits_nodes(request: core.ResourceRequest, *, group: ResourceGroup | None) -> list[core.NodeState]:
    """The registered nodes (alive or LOST, any image) of `group` (None: every node) that
    `core.check_ever_fits` needs to see for `request`, emptied: one of each kind (`shape_key`)
    — 1,000 alike nodes are one to check —, or all of them where the request pins devices.
    The kinds of a kept version are remembered (a launch on an unchanged view reads no node),
    and each entry's emptied state and kind are built once (`NodeEntry.kind`)."""
    slot = request.slot or "cuda"
    snapshot = cluster_view().snapshot()
    group_id = group.pk if group else None
    if request.pins:
        return view_node_states(slot_name=slot, alive_only=False, group=group, usage=False, snapshot=snapshot)
    key = (snapshot.version, slot, group_id)
    if snapshot.version >= 0:
        with _KINDS_LOCK:
            if key in _KINDS:
                return _KINDS[key]
    kinds: dict[tuple, core.NodeState] = {}
    for entry in snapshot.nodes(alive_only=False, group_id=group_id):
        kind = entry.kind(slot)
        if kind not in kinds:
            kinds[kind] = entry.state(slot, usage=False)
    found = list(kinds.values())
    if snapshot.version >= 0:
        with _KINDS_LOCK:
            if len(_KINDS) > 64:
                _KINDS.clear()
            _KINDS[key] = found
    return found
