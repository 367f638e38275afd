"""A repair of the Redis broker transport (kombu 5.7) that keeps a worker alive across a broker
restart.

When Redis goes away, Celery's consumer (`on_connection_error_after_connected`) first calls
`connection.collect()`, which closes the default channel (restoring its unacknowledged messages
fails: the broker is down) and then detaches the transport from its connection
(`transport.client = None`); it then calls `connection.close()`, which closes the same channel
once more. That second close tries the restore again, needs a new Redis connection pool, reads
the host from `transport.client` — None — and raises AttributeError, which is not a connection
error: "Unrecoverable error: AttributeError('NoneType' object has no attribute 'hostname')"
and the worker process exits (seen in 1 of 6 Redis outages of the manager; tests/faults).

The same detached channel fails a second way: a task that finishes after the connection was
lost (acks_late) acknowledges its message on the old channel once the worker has reconnected;
the ack needs a Redis client of that channel, reads `channel.connection.client` — the
connection is None by then — and the AttributeError ends the worker the same way
("'NoneType' object has no attribute 'client'", seen in tests/faults on CI).

The repair: a channel whose transport is already detached neither restores its unacknowledged
messages on close nor acknowledges or rejects one. Nothing is lost: they stay in the broker's
unacked hash and any live consumer puts them back on their queue once they are older than the
visibility timeout (`CELERY_BROKER_TRANSPORT_OPTIONS["visibility_timeout"]`, kombu's
`restore_visible`), which is what happens to a killed worker's messages too; the task runs
again, and every manager and agent task is idempotent.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def _detached(qos) -> bool:
    """Whether the QoS's channel lost its transport (connection or its client gone)."""
    return getattr(qos.channel.connection, "client", None) is None


def patch_redis_transport() -> None:
    """Make `kombu.transport.redis.QoS.restore_unacked`, `ack` and `reject` no-ops (with a
    warning) on a channel whose transport was detached; idempotent."""
    from kombu.transport import redis as kombu_redis

    qos = kombu_redis.QoS
    if getattr(qos.restore_unacked, "fgpu_patched", False):
        return
    original_restore, original_ack, original_reject = qos.restore_unacked, qos.ack, qos.reject

    def restore_unacked(self, client=None):
        if client is None and _detached(self):
            if self._delivered:
                log.warning(
                    "broker connection gone: %d unacknowledged message(s) go back to their queue after the visibility timeout",
                    len(self._delivered),
                )
            return None
        return original_restore(self, client)

    def ack(self, delivery_tag):
        if _detached(self):
            log.warning(
                "broker connection gone: message %s is acknowledged by no one; it runs again after the visibility timeout",
                delivery_tag,
            )
            return None
        return original_ack(self, delivery_tag)

    def reject(self, delivery_tag, requeue=False):
        if _detached(self):
            log.warning("broker connection gone: message %s goes back to its queue after the visibility timeout", delivery_tag)
            return None
        return original_reject(self, delivery_tag, requeue=requeue)

    patched: dict[str, Any] = {"restore_unacked": restore_unacked, "ack": ack, "reject": reject}
    for name, fn in patched.items():
        fn.fgpu_patched = True
        setattr(qos, name, fn)
