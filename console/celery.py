"""The Celery app. Routes are declared here, in one place: manager tasks (`fgpu.manager.*`)
go to queue `manager`, except the agents' heartbeats (`manager.heartbeats`: a node never looks
lost behind a burst of launches and reports) and log batches (`manager.logs`: a flooding session
never queues ahead of either) and usage samples (`manager.usage`); a worker started with `-Q manager`
consumes all four
(`consume_manager_queues`); agent tasks (`fgpu.agent.*`) to queue
`agent.<node>`, taken from the task's `node` keyword argument."""

from __future__ import annotations

import os

import kombu.exceptions
import redis.exceptions
from celery import Celery
from celery.signals import beat_init, celeryd_after_setup, worker_init, worker_ready
from django import db

from console.broker import patch_redis_transport
from protocol import (  # noqa: F401 (re-exported)
    HEARTBEAT_QUEUE,
    LOG_QUEUE,
    MANAGER_QUEUE,
    MANAGER_QUEUES,
    NOISY_TASKS,
    agent_queue,
    manager_queue,
)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

app = Celery("console")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["sessions", "usage", "agent"])
patch_redis_transport()  # a worker survives a broker restart (console/broker.py)


def route_task(name, args, kwargs, options, task=None, **kw):
    """Celery router: every project task has a queue; an agent task without `node` is a bug."""
    if name.startswith("fgpu.manager."):
        return {"queue": manager_queue(name)}
    if name.startswith("fgpu.agent."):
        node = (kwargs or {}).get("node")
        if not node:
            raise ValueError(f"task {name} needs the keyword argument node= to be routed to its agent")
        return {"queue": agent_queue(node)}
    return None


app.conf.task_routes = (route_task,)


@worker_init.connect
def worker_needs_secret_key(**kwargs):
    """A worker (the manager) refuses to start without a SECRET_KEY of its own (console.secret_key)."""
    from console.secret_key import require_secret_key

    require_secret_key("manager")


@beat_init.connect
def beat_needs_secret_key(**kwargs):
    """Beat refuses to start without a SECRET_KEY of its own (console.secret_key)."""
    from console.secret_key import require_secret_key

    require_secret_key("beat")


app.conf.task_default_queue = MANAGER_QUEUE


@celeryd_after_setup.connect
def consume_manager_queues(sender, instance, **kwargs):
    """A worker that consumes queue `manager` consumes `manager.heartbeats` and `manager.logs`
    too (the documented manager command, `celery -A console worker -Q manager`, stays as it is).
    Kombu's Redis transport takes from its queues in turn, so neither heartbeats nor log batches
    wait behind a burst on another queue."""
    queues = instance.app.amqp.queues
    if MANAGER_QUEUE in queues.consume_from:
        for queue in MANAGER_QUEUES:
            if queue not in queues.consume_from:
                queues.select_add(queue)


@worker_ready.connect
def freeze_worker_imports(sender, **kwargs):
    """A worker's tasks and what they import are loaded once it is ready: out of garbage
    collection from then on (console.startup)."""
    from console.startup import freeze_imported_objects

    freeze_imported_objects("worker")


# Errors a manager task is retried after (with backoff, 1 s doubling up to 30 s, 20 times): the
# database or the broker went away for a moment (a restart, a terminated backend, a failover).
TRANSIENT_ERRORS = (
    db.OperationalError,
    db.InterfaceError,
    kombu.exceptions.OperationalError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)


def agent_send(task: str, *, producer=None, **kwargs) -> None:
    """Send the agent task `task` (protocol.SESSION_START, SESSION_STOP, SESSIONS_SYNC,
    MIG_RECONCILE) with `kwargs`, which name its `node`, to queue `agent.<node>`; `producer`: a
    kombu producer to send through (one connection for many sends). By name, so the manager
    imports nothing of the agent; where an agent's tasks are registered in this process and Celery
    is eager (standalone mode, in-process tests), the task runs at once. Raises kombu's
    OperationalError when the broker cannot be reached."""
    app.signature(task, kwargs=kwargs).apply_async(producer=producer)
