"""Placement on the kept cluster view never over-commits a device while writers race (issue
35.1): four OS processes, each with its own kept view (accelerators.cluster_view), launch,
schedule, report RUNNING, terminate and end sessions at once on one small PostgreSQL cluster
(3 nodes × 2 GPUs of 2 fGPU, split count 3), six rounds each; the test samples the devices'
live allocations while they run and after. Each writer's view was kept (few full reads, nodes
reloaded from the change log), and the test's own view, brought up to date from the writers' log
rows alone, equals a read of the database at the end.

No web, worker or agent processes: the writers call the services they would call (the same
transactions, locks and triggers), so the test stays in seconds (issue 34.5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from django.db import connection

from accelerators.selectors import node_states
from tests.seed import gpu_cluster
from tests.stack import ROOT, database_url_default, wait_until
from tests.test_concurrency_processes import over_commits

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the change log is PostgreSQL's"),
]

WORKERS = 4
ROUNDS = 6

# One writer: its own Django, its own kept view. ROUNDS rounds of: launch, pass, and on one of
# its sessions a RUNNING report, a terminate or a TERMINATED report (which releases). Prints what
# it did and its view's figures, as JSON.
WORKER = r"""
import json, random, sys
import django
django.setup()
from django.contrib.auth import get_user_model
from accelerators import cluster_view
from sessions.admission.launch import session_create
from sessions.lifecycle.services import session_report_apply, session_terminate
from sessions.models import ComputeSession
from sessions.scheduling.scheduler import schedule_pending

me, rounds, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rng = random.Random(me)
user = get_user_model().objects.get(username=f"racer{me}")
open(ready, "w").close()
sys.stdin.read(1)  # the go: one byte from the test, to every writer at once
done = {"launched": 0, "passes": 0, "running": 0, "ended": 0}
for n in range(rounds):
    shares = rng.choice(["0.25", "0.5", "0.75", "1"])
    try:
        session_create(owner=user, name=f"r{me}-{n}", resources={"cuda.shares": shares, "mem": "64M"})
        done["launched"] += 1
    except Exception as exc:  # a refusal (ApplicationError) is an answer; anything else fails the writer
        if type(exc).__name__ != "ApplicationError":
            raise
    schedule_pending()
    done["passes"] += 1
    mine = list(ComputeSession.objects.filter(owner=user, status__in=["SCHEDULED", "RUNNING"]).values_list("pk", "status"))
    if mine:
        pk, status = rng.choice(mine)
        what = rng.random()
        if status == "SCHEDULED" and what < 0.5:
            session_report_apply(session_id=str(pk), status="RUNNING", reason="", exit_code=None)
            done["running"] += 1
        elif what < 0.75:
            session_report_apply(session_id=str(pk), status="TERMINATED", reason="done", exit_code=0)
            done["ended"] += 1
        else:
            session_terminate(session=ComputeSession.objects.get(pk=pk))
            session_report_apply(session_id=str(pk), status="TERMINATED", reason="stopped", exit_code=0)
            done["ended"] += 1
view = cluster_view.cluster_view()
print(json.dumps({**done, "reads": view.reads, "reloaded": view.reloaded}))
"""


@pytest.fixture
def racers(django_user_model):
    from accelerators.models import Node

    gpu_cluster(nodes=3, gpus=2)
    Node.objects.update(device_split_count=3, cpu_count=64)
    node_states(slot_name="cuda")  # this process's view, read before the race
    return [django_user_model.objects.create_user(f"racer{i}") for i in range(WORKERS)]


def test_writers_racing_in_four_processes_on_the_kept_view_never_over_commit_a_device(racers, tmp_path):
    assert connection.vendor == "postgresql"
    env = {**os.environ, "DATABASE_URL": database_url_default(), "FGPU_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
    env["REDIS_URL"] = os.environ.get("REDIS_URL", "")  # a pass request goes to the broker; the writers pass themselves
    workers = []
    for i in range(WORKERS):
        ready = tmp_path / f"ready-{i}"
        argv = [sys.executable, "-c", WORKER, str(i), str(ROUNDS), str(ready)]
        workers.append(
            subprocess.Popen(
                argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    wait_until(lambda: all((tmp_path / f"ready-{i}").exists() for i in range(WORKERS)), timeout=120, what="the writers")
    for w in workers:
        assert w.stdin is not None
        w.stdin.write("g")
        w.stdin.flush()
    seen: list[str] = []

    def all_ended() -> bool:
        seen.extend(over_commits())  # sampled while they race, not only at the end
        return all(w.poll() is not None for w in workers)

    wait_until(all_ended, timeout=300, what="the writers to end")
    results = []
    for w in workers:
        out, err = w.communicate()
        assert w.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert seen == [] and over_commits() == []
    # This process's view, last read before the race, brought up to date from the others' log rows alone.
    assert node_states(slot_name="cuda") == node_states(slot_name="cuda", kept=False)
    assert sum(r["launched"] for r in results) >= WORKERS and sum(r["ended"] for r in results) >= 1, results
    # Each view was kept: read whole once (its first use), then only the nodes the log named.
    assert all(r["reads"] <= 2 and r["reloaded"] >= 1 for r in results), results
