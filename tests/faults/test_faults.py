"""Fault injection on the real distributed stack (issue 12): each fault is injected three times,
at a seeded random point of each phase (launch, run, delete) of 50 sessions (REST, with
Idempotency-Key and retries as `fgpu launch` does), and healed; then the invariants are checked:

- no device over capacity at any time (sampled every 0.25 s throughout);
- within CONVERGE_S of the fault healing, every session RUNNING, final, or PENDING with an
  evaluated reason; none stuck SCHEDULED, PREPARING or TERMINATING;
- after every session is deleted: every allocation released (exactly once: one row each,
  released_at set), and no process of an ended session alive (none carries its
  FGPU_SESSION_ID);
- one session per Idempotency-Key, however often a request was retried across the fault.

Seeds come from FGPU_FAULT_SEED (default 12); each test prints its figures (faults, sessions,
time to converge after each heal, p50 and max) in a line starting "faults:".
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import pytest

from tests.conftest import wait_until
from tests.stack import ApiClient, Stack, session_processes

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

SEED = int(os.environ.get("FGPU_FAULT_SEED", "12"))
SESSIONS = 50  # 2 nodes × 4 GPUs × 2 fGPU hold 64 of 0.25 fGPU: all fit, most are alive at once
CONVERGE_S = 90  # the stated bound (README "How the cluster heals": 20 s after heartbeats flow again) with room
ACTIVE_STUCK = ("SCHEDULED", "PREPARING", "TERMINATING")
FINAL = ("TERMINATED", "ERROR", "CANCELLED")


def requests_for(rng: random.Random) -> list[dict]:
    out = []
    for i in range(SESSIONS):
        body = {"resources": {"cuda.shares": "0.25", "cpu": 1, "mem": "64M"}}
        if rng.random() < 0.3:  # batch sessions that end by themselves, some leaving a daemon behind
            body["command"] = (f"sleep {rng.randint(2, 6)}; echo done" if rng.random() < 0.5 else
                               f"setsid sleep 600 & sleep {rng.randint(2, 6)}")
        out.append(body)
    return out


class CapacitySampler(threading.Thread):
    """Samples the unreleased allocations per device every 0.1 s; records any over capacity."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.violations: list[str] = []
        self.samples = 0

    def run(self):
        from django.db import connection
        from django.db.models import Sum

        from accelerators.models import Device
        from sessions.models import Allocation

        try:
            capacity = {d.pk: (d.memory_size, d.subproc_count) for d in Device.objects.all()}
            while not self.stop.wait(0.1):
                try:
                    rows = (Allocation.objects.filter(released_at__isnull=True).values("device_id")
                            .annotate(memory=Sum("memory"), procs=Sum("procs")))
                    for row in rows:
                        memory, procs = capacity[row["device_id"]]
                        if row["memory"] > memory or row["procs"] > Decimal(procs):
                            self.violations.append(f"device {row['device_id']}: {row} over ({memory}, {procs})")
                    self.samples += 1
                except Exception:  # a terminated backend: sample again with a new connection
                    connection.close()
        finally:
            connection.close()


def sessions_by_name(names: set[str]) -> dict:
    from sessions.models import ComputeSession

    out: dict[str, list] = {}
    for session in ComputeSession.objects.filter(name__in=names):
        out.setdefault(session.name, []).append(session)
    return out


def converged(names: set[str]):
    """None while some session is stuck; else the sessions by name."""
    from django.db import connection

    connection.close()  # a backend terminated by the fault: start afresh
    by_name = sessions_by_name(names)
    for sessions in by_name.values():
        for s in sessions:
            if s.status in ACTIVE_STUCK or (s.status == "PENDING" and s.status_reason == "waiting for the scheduler"):
                return None
    return by_name


class Fault:
    """A fault injected at once and healed `duration_s` later on a thread of its own, while the
    clients go on (they retry)."""

    def __init__(self, stack, inject, heal, duration_s: float):
        self.stack, self._inject, self._heal, self.duration_s = stack, inject, heal, duration_s
        self.thread: threading.Thread | None = None
        self.healed_at = 0.0

    def start(self) -> None:
        self._inject(self.stack)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        time.sleep(self.duration_s)  # noqa: TID251 (the fault's duration is the fault: Redis down for 10 s)
        self._heal(self.stack)
        self.healed_at = time.monotonic()

    def wait_healed(self) -> float:
        self.thread.join(timeout=120)
        return self.healed_at


def run_scenario(stack, inject, heal, *, name: str, alice_token: str, duration_s: float = 2.0) -> dict:
    """Launch SESSIONS sessions from 8 clients; inject the fault (`inject(stack)`) at a seeded
    random moment of the launches and heal it (`heal(stack)`) `duration_s` later; wait for
    convergence; inject it again while they run and wait for convergence; delete them all with
    the fault once more in the middle; check the invariants. Returns the figures."""
    rng = random.Random(f"{SEED}-{name}")
    client = ApiClient(stack.base, alice_token)
    bodies = requests_for(rng)
    names = [f"f{SEED}-{name}-{i}-{uuid.uuid4().hex[:6]}" for i in range(SESSIONS)]
    sampler = CapacitySampler()
    sampler.start()
    faults = 0
    try:
        fault_at = rng.randint(3, SESSIONS - 8)
        answers = {}
        with ThreadPoolExecutor(8) as pool:
            futures = {}
            fault = Fault(stack, inject, heal, duration_s)
            for i, (n, body) in enumerate(zip(names, bodies)):
                futures[n] = pool.submit(client.launch, n, body)
                if i == fault_at:
                    fault.start()
                    faults += 1
            for n, future in futures.items():
                answers[n] = future.result()
        healed = fault.wait_healed()
        bad = {n: a for n, a in answers.items() if a[0] != 201}
        assert not bad, f"launches that never got a 201: {bad}"
        by_name = wait_until(lambda: converged(set(names)), timeout=CONVERGE_S,
                             what="every session RUNNING, final or PENDING with a reason")
        converge = [time.monotonic() - healed]

        # While they run (batch ones end by themselves, waiting ones take their place).
        time.sleep(rng.uniform(0.5, 4.0))  # noqa: TID251 (the fault strikes at a seeded random moment of the run phase)
        fault = Fault(stack, inject, heal, duration_s)
        fault.start()
        faults += 1
        healed = fault.wait_healed()
        by_name = wait_until(lambda: converged(set(names)), timeout=CONVERGE_S,
                             what="every session RUNNING, final or PENDING with a reason after the run fault")
        converge.append(time.monotonic() - healed)
        duplicates = {n: [str(s.pk) for s in ss] for n, ss in by_name.items() if len(ss) > 1}
        assert not duplicates, f"one Idempotency-Key made several sessions: {duplicates}"
        assert set(by_name) == set(names)
        ids = {n: str(ss[0].pk) for n, ss in by_name.items()}

        # Delete them all, with the same fault once more in the middle.
        delete_fault_at = rng.randint(2, SESSIONS - 4)
        with ThreadPoolExecutor(8) as pool:
            futures = []
            fault = Fault(stack, inject, heal, duration_s)
            for i, session_id in enumerate(ids.values()):
                futures.append(pool.submit(client.delete, session_id))
                if i == delete_fault_at:
                    fault.start()
                    faults += 1
            results = [f.result() for f in futures]
        healed = fault.wait_healed()
        refused = [r for r in results if r[0] not in (200, 202, 204)]
        assert not refused, f"deletes that failed: {refused[:3]}"
        started = time.monotonic()

        def not_final() -> list:
            from django.db import connection

            connection.close()
            from sessions.models import ComputeSession

            return list(ComputeSession.objects.filter(pk__in=ids.values()).exclude(status__in=FINAL)
                        .values_list("name", "status", "status_reason", "node__name"))

        left = not_final()

        def ended() -> bool:
            left[:] = not_final()
            return not left

        if left:
            with contextlib.suppress(AssertionError):  # the assert below names the sessions left
                wait_until(ended, timeout=CONVERGE_S, interval=0.2, what="the deleted sessions to end")
        assert not left, f"deleted sessions not ended {CONVERGE_S}s after the fault healed: {left[:8]}"
        drain_s = time.monotonic() - started
        converge.append(time.monotonic() - healed)
    finally:
        sampler.stop.set()
        sampler.join(timeout=5)
    from sessions.models import Allocation

    assert not sampler.violations, sampler.violations[:5]
    assert sampler.samples > 10
    assert not Allocation.objects.filter(session_id__in=ids.values(), released_at__isnull=True).exists()
    per_device = {}
    for a in Allocation.objects.filter(session_id__in=ids.values()):
        per_device.setdefault((a.session_id, a.device_id), 0)
        per_device[(a.session_id, a.device_id)] += 1
    assert max(per_device.values(), default=1) == 1, "a session was allocated twice on one device"
    wait_until(lambda: not any(session_processes(ids.values()).values()), timeout=30,
               what="no process of an ended session alive")
    figures = {"fault": name, "seed": SEED, "faults": faults, "sessions": SESSIONS,
               "converge_p50_s": round(sorted(converge)[len(converge) // 2], 1),
               "converge_max_s": round(max(converge), 1),
               "converge_s": [round(c, 1) for c in converge], "drain_s": round(drain_s, 1),
               "capacity_samples": sampler.samples}
    print("faults:", json.dumps(figures))
    return figures


def kill(process: str):
    return (lambda stack: stack.kill(process)), (lambda stack: stack.restart(process))


def test_an_agent_killed_in_the_middle_of_launches_and_deletes(fault_stack, alice_token):
    stack = fault_stack(nodes=2, gpus=4)
    run_scenario(stack, *kill(Stack.agent_name("fault-node-0")), name="agent", alice_token=alice_token)


def test_the_manager_killed_in_the_middle_of_launches_and_deletes(fault_stack, alice_token):
    stack = fault_stack(nodes=2, gpus=4)
    run_scenario(stack, *kill("manager"), name="manager", alice_token=alice_token)


def test_the_web_process_killed_in_the_middle_of_launches_and_deletes(fault_stack, alice_token):
    stack = fault_stack(nodes=2, gpus=4)
    run_scenario(stack, *kill("web"), name="web", alice_token=alice_token)


# Redis is down for twice the heartbeat timeout at each fault, as 20 s was twice the fault stack's 10 s: every node is
# silent past the window in which it counts as alive (checked at each heal), so the nodes are LOST or about to be when
# the broker comes back empty. 10 s where 20 s took 3 × 10 s more (issue 34.5).
REDIS_HEARTBEAT_TIMEOUT_S = 5
REDIS_OUTAGE_S = 2 * REDIS_HEARTBEAT_TIMEOUT_S


def nodes_silent_s(stack) -> list[float]:
    """Seconds since each of the stack's nodes' last heartbeat the manager applied (from a thread of its own)."""
    from django.db import connection
    from django.utils import timezone

    from accelerators.models import Node

    try:
        beats = Node.objects.filter(name__in=[n.name for n in stack.nodes]).values_list("last_heartbeat", flat=True)
        return [(timezone.now() - beat).total_seconds() for beat in beats]
    finally:
        connection.close()


def test_redis_stopped_for_twice_the_heartbeat_timeout_in_the_middle_of_launches_and_deletes(fault_stack, alice_token):
    stack = fault_stack(nodes=2, gpus=4, env={"FGPU_HEARTBEAT_TIMEOUT": str(REDIS_HEARTBEAT_TIMEOUT_S)})
    silences: list[list[float]] = []

    def heal(stack):
        silences.append(nodes_silent_s(stack))
        stack.redis_start()

    run_scenario(stack, lambda s: s.redis_stop(), heal, name="redis", alice_token=alice_token, duration_s=REDIS_OUTAGE_S)
    assert len(silences) == 3 and all(len(s) == 2 and min(s) > REDIS_HEARTBEAT_TIMEOUT_S for s in silences), \
        f"an outage was not longer than the heartbeat timeout for every node: {silences}"


def test_postgresql_backends_terminated_in_the_middle_of_launches_and_deletes(fault_stack, alice_token):
    stack = fault_stack(nodes=2, gpus=4)

    def inject(stack):  # every backend of the test database, three times 0.3 s apart
        for _ in range(3):
            stack.terminate_backends()
            time.sleep(0.3)  # noqa: TID251 (the fault: three rounds of killed backends, 0.3 s apart)

    run_scenario(stack, inject, lambda s: None, name="postgres", alice_token=alice_token, duration_s=0)
