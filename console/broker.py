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

The repair: a channel whose transport is already detached does not restore its unacknowledged
messages on close. Nothing is lost: they stay in the broker's unacked hash and any live
consumer puts them back on their queue once they are older than the visibility timeout
(`CELERY_BROKER_TRANSPORT_OPTIONS["visibility_timeout"]`, kombu's `restore_visible`), which is
what happens to a killed worker's messages too.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def patch_redis_transport() -> None:
    """Make `kombu.transport.redis.QoS.restore_unacked` a no-op (with a warning) on a channel
    whose transport was detached; idempotent."""
    from kombu.transport import redis as kombu_redis

    original = kombu_redis.QoS.restore_unacked
    if getattr(original, "fgpu_patched", False):
        return

    def restore_unacked(self, client=None):
        if client is None and getattr(self.channel.connection, "client", None) is None:
            if self._delivered:
                log.warning("broker connection gone: %d unacknowledged message(s) go back to their queue after "
                            "the visibility timeout", len(self._delivered))
            return None
        return original(self, client)

    restore_unacked.fgpu_patched = True
    kombu_redis.QoS.restore_unacked = restore_unacked
