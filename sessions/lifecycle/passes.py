"""Asking for scheduler passes: `schedule_pending_soon` (a launch, a release, an agent's report
ask for one), coalesced on the broker; in standalone mode, passes on a thread of their own.

The pass itself is the task `fgpu.manager.schedule_pending` (sessions.tasks), sent here by name,
so the services that ask for a pass import neither the tasks nor the scheduler.
"""

from __future__ import annotations

import functools
import logging
import threading

from django import db
from django.conf import settings

from common.celery import TRANSIENT_ERRORS, app

log = logging.getLogger(__name__)

SCHEDULE_PENDING_TASK = "fgpu.manager.schedule_pending"
SCHEDULE_QUEUED_KEY = "fgpu:schedule-pending:queued"


def _redis():
    """The process's client of REDIS_URL (thread-safe, with its own connection pool): a pass's
    flag costs one command, not a new connection (issue 14)."""
    return _client(settings.REDIS_URL)


@functools.lru_cache(maxsize=4)
def _client(url: str):
    import redis

    return redis.Redis.from_url(url)


def schedule_pending_soon() -> None:
    """Ask for a scheduler pass, coalescing requests: while one pass is queued and has not
    started, more launches and releases add none (each pass sees every session committed before
    it starts, because it clears the flag first). Without this, N launches queue N passes that
    run one after another and delay the agents' reports behind them. The flag expires after
    30 s in case its pass is lost; beat runs a pass every 10 s anyway.

    A broker that cannot be reached is logged, not raised: the caller's write is committed,
    and beat's next pass places it.
    """
    if getattr(settings, "STANDALONE", False):
        _STANDALONE_PASSES.request()
        return
    try:
        if settings.REDIS_URL and not app.conf.task_always_eager:
            if not _redis().set(SCHEDULE_QUEUED_KEY, 1, nx=True, ex=30):
                return
        app.signature(SCHEDULE_PENDING_TASK).delay()
    except TRANSIENT_ERRORS:
        log.warning("could not ask for a scheduler pass (the broker is unreachable); beat's next pass runs it")


class _BackgroundPasses:
    """Standalone mode (eager Celery, no manager worker): scheduler passes on one thread of
    their own instead of inside the request that asked for one, so a launch or a delete answers
    without waiting for the pass (and the agents' starts it sends). Requests coalesce as on the
    distributed stack: one made while a pass runs adds one more pass after it, not one each."""

    def __init__(self) -> None:
        self._wanted = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        self._wanted.set()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="scheduler-passes", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            db.close_old_connections()
            try:
                # The pass's task run here, by name (sessions registers it when Django starts): this
                # module then imports no scheduler, which reaches the services (preemption's stops),
                # which ask for passes here.
                app.signature(SCHEDULE_PENDING_TASK).apply(throw=True)
            except Exception:  # the next request (or the periodic pass) tries again
                log.exception("scheduler pass failed")


_STANDALONE_PASSES = _BackgroundPasses()
