"""The scheduler's cluster index kept between passes (accelerators.cluster_view.kept_index, issue
35.2): brought up to date from the view's changed entries, it equals one built anew from every
node, after a pass placed sessions, after they ended, and after a node's devices changed."""

from __future__ import annotations

import numpy as np
import pytest
from django.db import connection

from accelerators.allocation import core
from accelerators.cluster_view import cluster_view, kept_index
from accelerators.models import Device, Node
from accelerators.selectors import fractional_settings_get
from sessions.admission.launch import session_create
from sessions.lifecycle.services import session_report_apply
from sessions.models import ComputeSession, SessionStatus
from sessions.scheduling.scheduler import schedule_pending
from tests.seed import gpu_cluster

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the kept view is PostgreSQL's"),
]

FIGURES = ("cpu_free", "mem_free", "free", "memory_free", "gsum", "gmax", "idle", "distinct", "cap", "memory_total")


def _kept_and_fresh():
    settings = fractional_settings_get(slot_name="cuda").as_allocation_settings()
    entries = cluster_view().snapshot().nodes()
    kept = kept_index(("", "cuda", "test"), entries, "cuda", settings)
    fresh = core.cluster_index([e.state("cuda") for e in entries], settings)
    return kept, fresh


def _assert_same(kept, fresh) -> None:
    assert kept.names == fresh.names
    for name in FIGURES:
        assert np.array_equal(getattr(kept, name), getattr(fresh, name)), name


def test_the_kept_index_follows_placements_releases_and_a_changed_device(django_user_model):
    assert connection.vendor == "postgresql"
    gpu_cluster(nodes=4, gpus=2)
    _assert_same(*_kept_and_fresh())  # the first: built from every node, then kept
    owner = django_user_model.objects.create_user("kept")
    for i in range(3):
        session_create(owner=owner, name=f"s{i}", resources={"cuda.shares": "0.5", "mem": "64M"})
    schedule_pending()
    placed = list(ComputeSession.objects.filter(status=SessionStatus.SCHEDULED))
    assert placed
    kept, fresh = _kept_and_fresh()
    _assert_same(kept, fresh)
    assert int(kept.gsum.sum()) < int(kept.cap.sum())  # the placements show
    session_report_apply(session_id=str(placed[0].pk), status="TERMINATED", reason="done", exit_code=0)
    _assert_same(*_kept_and_fresh())
    Device.objects.filter(node=Node.objects.get(name="gpu-node-3"), index=1).update(memory_size=4 << 30)
    _assert_same(*_kept_and_fresh())
