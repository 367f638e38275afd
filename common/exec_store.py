"""The exec store this process's settings name (protocol.exec_store): the web's, and the
embedded agents' in standalone mode. Here, not in protocol, which imports no Django."""

from __future__ import annotations

from django.conf import settings

from protocol.exec_store import exec_store_for


def exec_store_default():
    """The store this process's settings name: Redis at REDIS_URL, or memory in standalone mode
    (which ignores REDIS_URL, as its channel layer does) and without REDIS_URL."""
    return exec_store_for("" if getattr(settings, "STANDALONE", False) else settings.REDIS_URL or "")
