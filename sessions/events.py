"""Live notices through the channel layer: groups `session-<id>`, `user-<id>`, `staff`.

The channel layer delivers notices; Celery does the work. Notices are sent after commit,
so a page never sees a state the database does not hold.
"""
from __future__ import annotations

import json
import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction
from rest_framework.renderers import JSONRenderer

log = logging.getLogger(__name__)

STAFF_GROUP = "staff"


def session_group(session_id) -> str:
    return f"session-{session_id}"


def user_group(user_id) -> str:
    return f"user-{user_id}"


def terminal_group(session_id) -> str:
    """Where the agent sends a session's PTY output; terminal consumers join it."""
    return f"terminal-{session_id}"


def pty_group(session_id) -> str:
    """Where terminal consumers send input and resizes; the session's agent joins it."""
    return f"pty-{session_id}"


def session_notify(session) -> None:
    """After commit, push the session's current API shape to its owner, its page and staff."""
    session_id, owner_id = session.pk, session.owner_id

    def send() -> None:
        from sessions.models import ComputeSession
        from sessions.serializers import SessionSerializer

        fresh = ComputeSession.objects.select_related("owner", "node").prefetch_related("allocations__device").get(pk=session_id)
        # Through JSON, so the message holds only plain types (msgpack on the Redis layer).
        message = {"type": "session.update", "session": json.loads(JSONRenderer().render(SessionSerializer(fresh).data))}
        layer = get_channel_layer()
        try:
            for group in (session_group(session_id), user_group(owner_id), STAFF_GROUP):
                async_to_sync(layer.group_send)(group, message)
        except Exception:  # a notice is best-effort: the state is already committed
            log.exception("could not push the update of session %s", session_id)

    transaction.on_commit(send)
