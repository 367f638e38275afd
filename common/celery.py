"""The Celery app the manager's tasks are defined on and sent with. Routes are declared here, in
one place: manager tasks (`fgpu.manager.*`) go to queue `manager`, except the agents' heartbeats
(`manager.heartbeats`: a node never looks lost behind a burst of launches and reports) and log
batches (`manager.logs`: a flooding session never queues ahead of either) and usage samples
(`manager.usage`); agent tasks (`fgpu.agent.*`) to queue `agent.<node>`, taken from the task's
`node` keyword argument. console.celery wires it to the apps (their tasks) and to a worker's
start (`consume_manager_queues`: a worker started with `-Q manager` consumes all four)."""

from __future__ import annotations

import kombu.exceptions
import redis.exceptions
from celery import Celery, shared_task
from django import db

from common.broker import patch_redis_transport
from protocol import (  # noqa: F401 (re-exported)
    HEARTBEAT_QUEUE,
    LOG_QUEUE,
    MANAGER_QUEUE,
    MANAGER_QUEUES,
    NOISY_TASKS,
    agent_queue,
    manager_queue,
)

app = Celery("console")
app.config_from_object("django.conf:settings", namespace="CELERY")
patch_redis_transport()  # a worker survives a broker restart (common/broker.py)


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
app.conf.task_default_queue = MANAGER_QUEUE


# Errors a manager task is retried after (with backoff, 1 s doubling up to 30 s, 20 times): the
# database or the broker went away for a moment (a restart, a terminated backend, a failover).
TRANSIENT_ERRORS = (
    db.OperationalError,
    db.InterfaceError,
    kombu.exceptions.OperationalError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)


def manager_task(name: str):
    """A manager task named `name` (fgpu.manager.*: queue `manager`, or the one route_task gives
    it), the apps' (sessions.tasks, usage.tasks): acknowledged after it ran (every manager task is
    idempotent), retried on TRANSIENT_ERRORS."""
    return shared_task(
        name=name,
        acks_late=True,
        autoretry_for=TRANSIENT_ERRORS,
        retry_backoff=1,
        retry_backoff_max=30,
        retry_jitter=True,
        max_retries=20,
    )


def agent_send(task: str, *, producer=None, **kwargs) -> None:
    """Send the agent task `task` (protocol.SESSION_START, SESSION_STOP, SESSIONS_SYNC,
    MIG_RECONCILE) with `kwargs`, which name its `node`, to queue `agent.<node>`; `producer`: a
    kombu producer to send through (one connection for many sends). By name, so the manager
    imports nothing of the agent; where an agent's tasks are registered in this process and Celery
    is eager (standalone mode, in-process tests), the task runs at once. Raises kombu's
    OperationalError when the broker cannot be reached. The message's header names the
    arguments, not their values (Celery's saferepr of a start spec was a third of each send:
    issue 35.2). Through a `producer` of kombu's virtual transports (Redis) the queue is not
    declared first (`_undeclared`)."""
    brief = {name: value if isinstance(value, str | int | bool | None) else "…" for name, value in kwargs.items()}
    app.signature(task, kwargs=kwargs).apply_async(
        producer=producer, argsrepr="()", kwargsrepr=repr(brief), **_undeclared(producer)
    )


def _undeclared(producer) -> dict:
    """`{"declare": []}` (Celery's publish option: declare no queue before the message) when
    `producer` sends through one of kombu's virtual transports (Redis, memory), else {}. There
    an agent task goes through the default exchange, which puts the message on the list named
    by its routing key, agent.<node>, whether that queue was declared or not (the agent's worker
    declares it when it consumes), so declaring it first changes nothing the agent reads, but
    costs two round trips outside kombu's publish batch for each queue new to the connection:
    a pass's starts to 1,000 nodes from a fresh connection 0.87 → 0.19 s of CPU, 1.6-4.7 →
    0.4-1.2 s (issue 35.2). A broker that drops a message to an undeclared queue (AMQP) keeps
    the declare."""
    if producer is None:
        return {}
    from kombu.transport import virtual

    return {"declare": []} if isinstance(producer.connection.transport, virtual.Transport) else {}
