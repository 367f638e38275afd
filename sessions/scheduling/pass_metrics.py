"""A scheduler pass's figures for Prometheus (issue 34.6): how long each pass took, how many
sessions it placed, left waiting and preempted, as Kueue exports its scheduler's
(`kueue_admission_attempt_duration_seconds`, a histogram of its `schedule()` cycles;
`kueue_admission_attempts_total`; `kueue_pending_workloads`; `kueue_preempted_workloads_total`).
`usage.metrics` exports them at `GET /metrics` (its table names them).

The passes run in the manager worker and /metrics is answered by the web, so the figures are
kept where both read them: in Redis (REDIS_URL), one hash (`KEY`) changed in one MULTI a pass;
without Redis (standalone: the pass and the web are one process), in this process's memory.
A Redis that cannot be reached loses that pass's figures (logged), never the pass.
"""

from __future__ import annotations

import logging
import threading
import time

from django.conf import settings

log = logging.getLogger(__name__)

KEY = "fgpu:scheduler:passes"
# Seconds: prometheus_client's default buckets (Histogram.DEFAULT_BUCKETS), written out so that the
# manager worker does not import the client.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
FIELDS = ("count", "sum", "placed", "noticed", "stopped", "waiting", "at") + tuple(f"le_{b}" for b in BUCKETS)

_memory: dict[str, float] = {}
_memory_lock = threading.Lock()


def pass_record(*, seconds: float, placed: int, waiting: int, noticed: int, stopped: int) -> None:
    """Count one pass of `seconds` (wall time, commit included) that placed `placed` sessions,
    left `waiting` waiting, put `noticed` under a preemption notice and stopped `stopped` whose
    notice ran out. One Redis round trip (none without Redis); raises nothing."""
    adds = {"count": 1, "sum": seconds, "placed": placed, "noticed": noticed, "stopped": stopped}
    adds.update({f"le_{b}": 1 for b in BUCKETS if seconds <= b})
    last = {"waiting": waiting, "at": time.time()}
    if not settings.REDIS_URL:
        with _memory_lock:
            for name, value in adds.items():
                _memory[name] = _memory.get(name, 0) + value
            _memory.update(last)
        return
    import redis

    from sessions.lifecycle.passes import _redis

    try:
        pipe = _redis().pipeline(transaction=True)
        for name, value in adds.items():
            pipe.hincrbyfloat(KEY, name, value)
        pipe.hset(KEY, mapping=last)
        pipe.execute()
    except redis.RedisError:
        log.warning("could not record the scheduler pass's figures in Redis; /metrics misses this pass", exc_info=True)


def pass_figures() -> dict[str, float]:
    """The figures summed over every pass recorded (`FIELDS`, 0 for none yet): "count" passes,
    "sum" seconds, "le_<bucket>" passes that took at most that many seconds, "placed",
    "noticed", "stopped" sessions; and the last pass's "waiting" sessions and "at" (Unix
    seconds). Raises redis.RedisError when Redis cannot be reached."""
    if not settings.REDIS_URL:
        with _memory_lock:
            stored = dict(_memory)
    else:
        from sessions.lifecycle.passes import _redis

        stored = {k.decode(): float(v) for k, v in _redis().hgetall(KEY).items()}
    return {name: float(stored.get(name, 0)) for name in FIELDS}
