"""The Celery app's wiring (`celery -A console worker`, `celery -A console beat`): the app of
common.celery with the apps' tasks (sessions, usage, agent) and what a worker and beat do when
they start: refuse to without a SECRET_KEY of their own, consume every manager queue when asked
for `manager` (`consume_manager_queues`), keep their imports out of garbage collection. Routes,
`agent_send` and the transient errors are common.celery's."""

from __future__ import annotations

import os

# Before common.celery makes the app: Celery's Django fixup is chosen when the app is made, from this
# variable; set after, `celery -A console worker` without it failed every task (AppRegistryNotReady).
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

from celery.signals import beat_init, celeryd_after_setup, worker_init, worker_ready  # noqa: E402

from common.celery import app  # noqa: E402
from protocol import MANAGER_QUEUE, MANAGER_QUEUES  # noqa: E402

app.autodiscover_tasks(["sessions", "usage", "agent"])


@worker_init.connect
def worker_needs_secret_key(sender=None, **kwargs):
    """A manager worker refuses to start without a SECRET_KEY of its own (common.secret_key). An
    agent's embedded worker (`manage.py agent`: its queue agent.<node> only, no manager queue)
    signs nothing and starts without one, as README says (compose's agent holds no key)."""
    from common.secret_key import require_secret_key

    if _consumes_manager_queues(sender):
        require_secret_key("manager")


@worker_init.connect
def manager_loads_solver(sender=None, **kwargs):
    """A manager worker imports the allocator's LP solver as it starts, before its pool forks
    and its imports are frozen (`accelerators.allocation.packing.solver_load`): the first
    scheduler pass no longer pays the import (0.5-1.3 s of a 1,000-session pass, issue 35.2)."""
    if _consumes_manager_queues(sender):
        from accelerators.allocation.packing import solver_load

        solver_load()


def _consumes_manager_queues(sender) -> bool:
    """Whether the worker `sender` (None: not known) consumes a manager queue: every worker but
    an agent's embedded one (its queue agent.<node> only)."""
    consumed = set(sender.app.amqp.queues.consume_from or ()) if sender is not None else set()
    return not consumed or not consumed.isdisjoint(MANAGER_QUEUES)


@beat_init.connect
def beat_needs_secret_key(**kwargs):
    """Beat refuses to start without a SECRET_KEY of its own (common.secret_key)."""
    from common.secret_key import require_secret_key

    require_secret_key("beat")


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
    collection from then on (common.startup)."""
    from common.startup import freeze_imported_objects

    freeze_imported_objects("worker")
