"""Load (issue 12): 200 launches from 20 clients on a cluster that holds 64 of them. No device is
over capacity at any sample; 64 run and every other one is PENDING with an evaluated reason (none
"waiting for the scheduler"); deleting them all drains the cluster within DRAIN_S."""
from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import wait_until
from tests.faults.test_faults import FINAL, CapacitySampler, sessions_by_name
from tests.stack import ApiClient

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

LAUNCHES, CLIENTS, HOLDS = 200, 20, 64
SETTLE_S, DRAIN_S = 60, 30


def test_two_hundred_launches_on_room_for_64_run_64_queue_the_rest_with_reasons_and_drain(fault_stack, alice_token):
    from sessions.models import Allocation, ComputeSession

    stack = fault_stack(nodes=2, gpus=4)  # 2 × 4 GPUs × 2 fGPU = 64 sessions of 0.25 fGPU
    clients = [ApiClient(stack.base, alice_token) for _ in range(CLIENTS)]
    names = [f"load-{i}-{uuid.uuid4().hex[:6]}" for i in range(LAUNCHES)]
    body = {"resources": {"cuda.shares": "0.25", "cpu": 1, "mem": "64M"}}
    sampler = CapacitySampler()
    sampler.start()
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(lambda i: clients[i % CLIENTS].launch(names[i], body), range(LAUNCHES)))
        assert all(status == 201 for status, _ in answers), [a for a in answers if a[0] != 201][:3]

        def settled():
            by_name = sessions_by_name(set(names))
            sessions = [ss[0] for ss in by_name.values()]
            if sum(s.status == "RUNNING" for s in sessions) != HOLDS or any(
                    s.status_reason == "waiting for the scheduler" for s in sessions):
                return None
            return by_name

        by_name = wait_until(settled, timeout=SETTLE_S, what=f"{HOLDS} sessions RUNNING and the rest given reasons")
        settle_s = time.monotonic() - started
        pending = [ss[0] for ss in by_name.values() if ss[0].status == "PENDING"]
        assert len(pending) == LAUNCHES - HOLDS
        assert all(s.status_reason.startswith(("waiting for capacity", "queued behind")) for s in pending), \
            {s.status_reason for s in pending}
        ids = [str(ss[0].pk) for ss in by_name.values()]

        started = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(lambda i: clients[i % CLIENTS].delete(ids[i]), range(LAUNCHES)))
        assert all(status in (200, 202, 204) for status, _ in results)
        wait_until(lambda: not ComputeSession.objects.filter(pk__in=ids).exclude(status__in=FINAL).exists(),
                   timeout=DRAIN_S, what="every session to end")
        drain_s = time.monotonic() - started
    finally:
        sampler.stop.set()
        sampler.join(timeout=5)
    assert not sampler.violations, sampler.violations[:5]
    assert not Allocation.objects.filter(released_at__isnull=True).exists()
    print("load:", json.dumps({"launches": LAUNCHES, "clients": CLIENTS, "running": HOLDS,
                               "all_placed_or_queued_s": round(settle_s, 1), "drain_s": round(drain_s, 1),
                               "capacity_samples": sampler.samples}))
