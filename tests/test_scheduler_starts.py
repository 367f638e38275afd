"""A scheduler pass's agent starts on the real broker, and what a manager worker loads as it
starts (issue 35.2): the starts go out through one producer to each node's queue agent.<node>
without declaring it first (Redis: the default exchange delivers by the queue's name), and a
manager worker, not an agent's, imports the allocator's LP solver before its first pass.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
from django.conf import settings
from kombu import Connection, Exchange, Queue

import protocol
from common.celery import app
from sessions.admission import launch as admission
from sessions.models import ComputeSession, SessionStatus
from sessions.scheduling.scheduler import schedule_pending
from tests.conftest import make_cluster, mock_gpu

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not settings.REDIS_URL, reason="needs REDIS_URL")
@pytest.mark.django_db
def test_a_passs_starts_reach_each_agents_queue_on_redis_without_the_queue_declared(
    django_user_model, monkeypatch, django_capture_on_commit_callbacks
):
    names = [f"starts-{uuid.uuid4().hex[:8]}-{n}" for n in range(2)]
    make_cluster(nodes={name: [mock_gpu(n, node=n)] for n, name in enumerate(names)})
    owner = django_user_model.objects.create_user("alice")
    sessions = [admission.session_create(owner=owner, name=f"s{i}", resources={"cuda.shares": "2"}) for i in range(2)]
    client = redis.Redis.from_url(settings.REDIS_URL)
    queues = [protocol.agent_queue(name) for name in names]
    client.delete(*queues)
    monkeypatch.setitem(app.conf, "task_always_eager", False)  # to the broker, as a manager worker sends them

    with django_capture_on_commit_callbacks(execute=True):  # the starts are sent once the pass commits
        scheduled = schedule_pending()

    assert sorted(scheduled) == sorted(str(s.pk) for s in sessions)  # one whole 2-fGPU device each

    node_of = {str(s.pk): s.node.name for s in ComputeSession.objects.filter(status=SessionStatus.SCHEDULED)}
    assert sorted(node_of.values()) == sorted(names)
    assert [client.llen(q) for q in queues] == [1, 1]
    assert not client.exists(*(f"_kombu.binding.{q}" for q in queues))  # not declared by the manager
    with Connection(settings.REDIS_URL) as connection:  # the agent's side: kombu's Redis consumer of its queue
        for name, queue in zip(names, queues):
            message = connection.SimpleQueue(Queue(queue, Exchange(queue), routing_key=queue)).get(timeout=10)
            args, kwargs, _ = message.decode()
            assert message.headers["task"] == protocol.SESSION_START and args == []
            assert kwargs["node"] == name and node_of[kwargs["spec"]["session_id"]] == name
            assert message.headers["kwargsrepr"] == repr({"node": name, "spec": "…"})
            message.ack()
    client.delete(*queues, *(f"_kombu.binding.{q}" for q in queues))


@pytest.mark.parametrize(("queue", "loads"), [(protocol.MANAGER_QUEUE, True), (protocol.agent_queue("node-a"), False)])
def test_a_manager_worker_imports_the_lp_solver_as_it_starts_and_an_agents_worker_does_not(queue, loads):
    # A Celery worker consuming `queue`, set up (worker_init is sent) but not started, in a process
    # of its own: scipy.optimize is imported there or not.
    script = (
        "import sys, django; django.setup()\n"
        "from console.celery import app\n"
        "assert 'scipy.optimize' not in sys.modules\n"
        f"app.WorkController(queues=[{queue!r}], pool_cls='solo', hostname='solver-test@here')\n"
        "print('scipy.optimize' in sys.modules)\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "console.settings", "FGPU_SECRET_KEY": "k" * 50}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1].lower()) is loads
