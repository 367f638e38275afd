"""The first ask after a change follows what changed (issue 35.2): the queue's sessions kept and
read again only where their row changed (`kept_sessions`), the cluster index of the last read
followed by the nodes that changed (`eta._index_followed`), the holders of the fragmentation
map taken from the kept sessions and each node's part of the map kept per node state. After
each of a run of random changes — a session ends, is queued, starts in a pass, is overtaken
(written without raising its version), a node is drained — the answers made so equal the ones
made from scratch at the same moment, on PostgreSQL (the kept paths are its only)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from django.db import connection
from django.db.models import F
from django.utils import timezone

from accelerators.allocation import core
from accelerators.drain import node_drain
from sessions.admission.launch import session_create
from sessions.lifecycle.services import session_report_apply
from sessions.models import ACTIVE_STATUSES, ComputeSession, SessionStatus
from sessions.scheduling import compaction as kept_map
from sessions.scheduling import eta
from sessions.scheduling.kept_sessions import kept_sessions
from sessions.scheduling.preemption import session_holders
from sessions.scheduling.scheduler import schedule_pending
from tests.seed import gpu_cluster

pytestmark = pytest.mark.skipif(connection.vendor != "postgresql", reason="the kept paths are PostgreSQL's")

SIZES = ["0.5", "1", "1.5", "2", "3"]


@pytest.fixture
def cluster(db):
    """Four nodes of two 8 GiB GPUs (2 fGPU each) and a MIG node of one H100; a maximum lifetime of 2 h."""
    from usage.models import IdlePolicy

    gpu_cluster(nodes=4, gpus=2, mig_gpus=1)
    IdlePolicy.objects.create(resource_group=None, max_lifetime=7200)
    kept_sessions().forget()
    eta._scopes_kept.clear()


def _launch(rng: random.Random, owner, name: str) -> ComputeSession:
    return session_create(owner=owner, name=name, resources={"cuda.shares": rng.choice(SIZES), "mem": "64M"})


def _answers(now) -> dict:
    """What the ETAs and the what-if say at `now`: the queue's order, what each session holds
    and when it ends, every band, what would make each waiting session fit, and a drain's
    what-if."""
    queue = eta._Queue(now=now)
    bands = queue.bands()
    what_if = eta._what_if(queue, bands, weights=None, policies=None, backfill_limit=None, drain=frozenset({"gpu-node-0"}))
    for room in queue._rooms:  # each replay kept its indexes as a build of its nodes at its end would be
        for scope in room.view.scopes.values():
            for pure_settings, index in scope.indexes.items():
                _same_index(index, core.cluster_index(scope.nodes, pure_settings))
    return {
        "pending": [s.pk for s in queue.pending],
        "holdings": {k: (h.node_id, h.cpu, h.mem, h.grants) for k, h in queue.holdings.items()},
        "ends": queue.ends,
        "bands": bands,
        "fits": {key: eta._fits_after(queue, key) for key in queue.requests},
        "what_if": [(r.session.pk, r.position_today, r.position_what_if, r.today, r.what_if, r.change) for r in what_if.rows],
        "moves": [(m.session.pk, m.from_node, m.what_if, m.to_early, m.to_late) for m in what_if.moves],
    }


FIGURES = ("cpu_total", "mem_total", "cpu_free", "mem_free", "free", "cap", "memory_total", "memory_free", "device_memory")
DERIVED = ("gsum", "gmax", "idle", "distinct", "gpu_total", "unit", "model")


def _same_index(index, built) -> None:
    assert index.names == built.names
    for name in FIGURES + DERIVED:
        assert np.array_equal(getattr(index, name), getattr(built, name)), name
    # alike nodes are twins in both (the scorers' classes), whatever their ids
    assert len(set(zip(index.twin.tolist(), built.twin.tolist()))) == len(set(built.twin.tolist()))
    assert len(set(zip(index.state.tolist(), built.state.tolist()))) == len(set(built.state.tolist()))


def _indexes_are_built_ones() -> int:
    """Each kept scope's cluster index (followed or built) holds the figures one built now from
    its nodes does, and so does the one a drain of its first node takes from it
    (`eta._index_of_rows`); returns how many were compared."""
    compared = 0
    for scope in eta._scopes_kept.values():
        for pure_settings, index in scope.indexes.items():
            _same_index(index, core.cluster_index(scope.nodes, pure_settings))
            keep = list(range(1, len(scope.nodes)))
            left = [scope.nodes[i] for i in keep]
            _same_index(eta._index_of_rows(index, keep, left), core.cluster_index(left, pure_settings))
            compared += 1
    return compared


def _report(now, *, kept: bool):
    if not kept:
        kept_map._named_kept.clear()
        kept_map._map_kept.clear()
    return kept_map.fragmentation_report(group=None, now=now, stamp=eta.cluster_stamp() if kept else None)


def test_after_random_changes_the_incremental_answers_equal_ones_made_from_scratch(cluster, alice, bob):
    rng = random.Random(352)
    for i in range(6):
        session_create(owner=alice, name=f"run-{i}", resources={"cuda.shares": rng.choice(SIZES), "mem": "64M"})
    schedule_pending()
    for i in range(6):
        _launch(rng, rng.choice([alice, bob]), f"wait-{i}")
    now = timezone.now()
    _answers(now)  # the first read: everything read whole, the indexes built
    _report(now, kept=True)

    partial_reads, steps = 0, ["end", "queue", "pass", "overtaken", "end", "queue", "drain", "end", "pass", "queue", "end"]
    for step, change in enumerate(steps):
        active = list(ComputeSession.objects.filter(status__in=ACTIVE_STATUSES).order_by("created_at"))
        pending = list(ComputeSession.objects.filter(status=SessionStatus.PENDING).order_by("created_at"))
        if change == "end" and active:
            session_report_apply(session_id=str(rng.choice(active).pk), status=SessionStatus.TERMINATED, exit_code=0)
        elif change == "queue":
            _launch(rng, rng.choice([alice, bob]), f"more-{step}")
        elif change == "pass":
            schedule_pending()
        elif change == "overtaken" and pending:  # written as the pass writes it: no new version
            ComputeSession.objects.filter(pk=rng.choice(pending).pk).update(overtaken=F("overtaken") + 3)
        elif change == "drain":
            node_drain(node_name="gpu-node-1")
        now = timezone.now()
        total = ComputeSession.objects.filter(status__in=(SessionStatus.PENDING, *ACTIVE_STATUSES)).count()

        before = kept_sessions().reads
        incremental = _answers(now)
        read = kept_sessions().reads - before
        partial_reads += read < total
        assert _indexes_are_built_ones() >= (1 if incremental["fits"] else 0)  # (none where nothing waits)
        kept_report = _report(now, kept=True)

        kept_sessions().forget()
        eta._scopes_kept.clear()
        fresh = _answers(now)
        fresh_report = _report(now, kept=False)

        for part in fresh:
            assert incremental[part] == fresh[part], (step, change, part)
        assert kept_report.map == fresh_report.map, (step, change)
        assert (kept_report.target, kept_report.plan, kept_report.mig) == (
            fresh_report.target,
            fresh_report.plan,
            fresh_report.mig,
        )
    assert partial_reads >= len(steps) - 2  # (a pass changes most sessions: read whole again, rightly)


def test_a_session_written_without_a_new_version_is_read_again(cluster, alice):
    session = session_create(owner=alice, name="waits", resources={"cuda.shares": "1", "mem": "64M"})
    first = next(s for s in kept_sessions().read() if s.pk == session.pk)
    assert first.overtaken == 0
    before = kept_sessions().reads

    ComputeSession.objects.filter(pk=session.pk).update(overtaken=2)  # the pass's backfill count: version kept

    again = next(s for s in kept_sessions().read() if s.pk == session.pk)
    assert again.overtaken == 2 and kept_sessions().reads == before + 1
    assert next(s for s in kept_sessions().read() if s.pk == session.pk) is again and kept_sessions().reads == before + 1


def test_the_kept_holders_are_the_ones_read_from_the_database(cluster, alice, bob):
    for i, owner in enumerate([alice, bob, alice]):
        session_create(owner=owner, name=f"run-{i}", resources={"cuda.shares": "1.5", "mem": "64M"})
    schedule_pending()
    names = [f"gpu-node-{n}" for n in range(4)]
    from sessions.scheduling.kept_sessions import active_on

    assert session_holders(node_names=names, sessions=active_on(names)) == session_holders(node_names=names)
