"""Live notices through the channel layer: groups `session-<id>`, `user-<id>`, `staff`.

The channel layer delivers notices; Celery does the work. Notices are sent after commit,
so a page never sees a state the database does not hold.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import TypeVar

from channels.layers import get_channel_layer
from django.db import transaction
from rest_framework.renderers import JSONRenderer

from protocol import pty_group, terminal_group  # noqa: F401 (the agent's groups, re-exported for the web)
from protocol.channel import AgentLink
from sessions.lifecycle.agent_links import agent_link, agent_link_named, agent_link_of_session  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)
T = TypeVar("T")

STAFF_GROUP = "staff"


def session_group(session_id) -> str:
    return f"session-{session_id}"


def user_group(user_id) -> str:
    return f"user-{user_id}"


def session_notify(session, *, answered: bool = False) -> None:
    """After commit, push the session's current API shape to its owner, its page and staff (`sessions_notify`)."""
    sessions_notify([session], answered=answered)


def sessions_notify(sessions, *, answered: bool = False) -> None:
    """After commit, push each session's current API shape to its owner, its page and staff:
    `{"type": "session.update", "session": {…}}` to `session-<id>`, `user-<owner id>`, `staff`,
    in that order, once per entry of `sessions` (a list of ComputeSession, in order), of those
    a page listens for (`_send_updates`). `answered`: the caller answers with the session's
    shape (a DELETE: `shape_shown`), so a few are rendered without asking who listens.

    One after-commit callback for the whole list: one query (with its prefetches) reads them all,
    and every group send goes out from one event loop, so a scheduler pass placing 1,000
    sessions costs a few hundred milliseconds instead of one query and three thread hops each.
    A session deleted before the callback runs is skipped. Sends are best-effort (logged), and so
    is the read: the callback never raises, so nothing after the commit turns the write that
    notified into an error answer (issue 33)."""
    entries = [(s.pk, s.owner_id) for s in sessions]
    if entries:
        transaction.on_commit(lambda: _send_updates(entries, answered=answered), robust=True)


def session_notify_rendered(session) -> dict:
    """Inside the writer's transaction: read `session` as a notice reads it and render its API
    shape now (the state the commit will hold), and after commit push exactly that shape, as
    `session_notify` would, without reading the database again. Returns the shape, which
    `shape_shown` gives too. A write that answers with its session (a launch) so has nothing left
    to do after its commit that needs the database: the answer is the one the commit earned,
    whatever happens to the database's connections then (issue 33). Raises what the read raises
    (django.db.DatabaseError): before the commit, so the write is rolled back with it."""
    shapes = _render([session.pk])
    entries = [(session.pk, session.owner_id)]
    transaction.on_commit(lambda: _push(entries, shapes), robust=True)
    return shapes[str(session.pk)]


# The API's shapes of a list of sessions (sessions.api.serializers.session_shapes), set when the app
# is ready (sessions.apps): the notices carry the API's shapes, and this layer, below the API, does not
# import it.
shapes_renderer: Callable[[list], object] | None = None

_rendered = threading.local()  # .shapes: {session id: API shape} of this thread's last notice


def shape_shown(session) -> dict | None:
    """The API shape (SessionSerializer's, through JSON) that this thread's last notice rendered
    for `session`, if it shows the session's `version` (the state `session` holds); else None.
    A write that notified after its commit answers with it instead of reading and serialising
    the session a second time (a DELETE's or launch's answer)."""
    shape = getattr(_rendered, "shapes", {}).get(str(session.pk))
    return shape if shape is not None and shape.get("version") == session.version else None


def _render(session_ids: list) -> dict[str, dict]:
    """{session id (text): API shape} of the sessions `session_ids` that exist, read now; kept as
    this thread's last rendering (`shape_shown`). Raises DatabaseError when the read fails."""
    from sessions.selectors import sessions_shown_by_id

    assert shapes_renderer is not None, "sessions.apps sets the renderer when Django is set up"
    fresh = sessions_shown_by_id(list(dict.fromkeys(session_ids)))
    # Through JSON, so the messages hold only plain types (msgpack on the Redis layer).
    shapes = {shape["id"]: shape for shape in json.loads(JSONRenderer().render(shapes_renderer(fresh)))}
    _rendered.shapes = shapes
    return shapes


def _send_updates(entries: list[tuple], *, answered: bool = False) -> None:
    """After commit: read the sessions of `entries` ((id, owner id) pairs) that a page listens
    for (`_listened`) and push their notices; the others are neither read nor rendered (a
    scheduler pass placing 1,000 sessions nobody watches spent most of its commit rendering
    their API shapes: issue 35.2; an agent's PREPARING, RUNNING and TERMINATED reports of a
    session launched through the API or the CLI rendered it three times, each read and render
    beside the launch's own steps in the manager's process: issue 35.3). Fewer than _ASK_FROM
    of a write that is `answered` with its session are rendered without asking: that write
    reuses the shape (`shape_shown`: a DELETE's answer), which it would otherwise read and
    render itself. Never raises: a read that fails (the database's connection cut) loses these
    notices, logged; the pages re-read the list when their websocket reconnects, and the next
    change notifies."""
    heard = _listened(entries) if len(entries) >= _ASK_FROM or not answered else None
    if heard is not None:
        entries = [entry for entry in entries if entry[0] in heard]
    if not entries:
        return
    try:
        shapes = _render([session_id for session_id, _ in entries])
    except Exception:
        log.warning("could not read %d session(s) for their notices after commit; not sent", len(entries), exc_info=True)
        return
    _push(entries, shapes)


_ASK_FROM = 8  # notices of an answered write's commit from which `_listened` is asked first (others: always)
_MEMBERS_WAIT_S = 5.0


def _listened(entries: list[tuple]) -> set | None:
    """The ids of `entries` ((id, owner id) pairs) whose notice some page would receive now: the
    staff group, the owner's group or the session's group has a member (the channel layer's
    `groups_members`: common.layers). None: every one (staff listen, or the layer cannot say, or
    did not answer within _MEMBERS_WAIT_S). A notice left out is one sent to empty groups, which
    the layer drops: a page that joins its group after this look is as one that joined after the
    send (it reads the list when its websocket opens)."""
    try:
        return _SENDER.call(lambda: _members_of(entries), timeout=_MEMBERS_WAIT_S)
    except Exception:  # not knowing who listens: notify them all, as before
        log.warning("could not ask the channel layer which pages listen; notifying all", exc_info=True)
        return None


async def _members_of(entries: list[tuple]) -> set | None:
    """`_listened` on the sender's loop: the staff group first, then the owners' groups, then the
    sessions' groups of the owners nobody listens for, each list in one call of the layer's
    `groups_members` (common.layers' two layers: one Redis round trip; Channels' own has none)."""
    counted = getattr(get_channel_layer(), "groups_members", None)
    if counted is None or (await counted([STAFF_GROUP]))[0]:
        return None

    async def with_members(groups: list[str]) -> set[str]:
        counts = await counted(groups) if groups else []
        return {group for group, count in zip(groups, counts) if count}

    owners = await with_members(list(dict.fromkeys(user_group(owner_id) for _, owner_id in entries)))
    rest = [session_group(session_id) for session_id, owner_id in entries if user_group(owner_id) not in owners]
    pages = await with_members(rest)
    return {
        session_id for session_id, owner_id in entries if user_group(owner_id) in owners or session_group(session_id) in pages
    }


def _push(entries: list[tuple], shapes: dict[str, dict]) -> None:
    """Queue the notices of `entries` with their `shapes` (from `_render`) on the sender."""
    sends = []
    for session_id, owner_id in entries:
        shape = shapes.get(str(session_id))
        if shape is not None:
            message = {"type": "session.update", "session": shape}
            sends += [(group, message) for group in (session_group(session_id), user_group(owner_id), STAFF_GROUP)]
    if sends:
        _SENDER.send(sends)


def pty_send(link: AgentLink, session_id, message: dict) -> None:
    """Send `message` (a `pty.*` message, protocol) to the session's agent (`link`: its node)
    over the channel layer, sealed with the node's key, best-effort, without waiting (as the
    notices go: `_Sender`)."""
    _SENDER.send([(link.pty_group(session_id), link.command({**message, "session_id": str(session_id)}))])


async def _group_send_all(layer, sends: list[tuple[str, dict]]) -> None:
    """Send in order (a group sees its notices in the order they were made), logging failures."""
    for group, message in sends:
        try:
            await layer.group_send(group, message)
        except Exception:  # a notice is best-effort: the state is already committed
            log.exception("could not send %s to %s", message["type"], group)


class _Sender:
    """Sends the notices from one long-lived event loop, in the order they were made, without
    making the writer wait: a launch, a delete, a scheduler pass or an agent's report is not
    held up by the channel layer (async_to_sync from a worker thread would start an event loop,
    and a Redis connection, for every notice, and wait for the sends).

    The loop is a thread of its own (web and manager processes), or the server's loop where the
    channel layer must be used from it (`use_loop`: standalone mode's in-memory layer lives on
    the web server's loop). Notices are best-effort, as before: a process that dies loses those not yet
    sent; the pages re-read the list when their websocket reconnects."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None

    def use_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Send from `loop` (running, in another thread or this one) from now on."""
        with self._lock:
            self._start_on(loop)

    def send(self, sends: list[tuple[str, dict]]) -> None:
        loop, queue = self._running()
        loop.call_soon_threadsafe(queue.put_nowait, sends)

    def call(self, coroutine: Callable[[], Coroutine[object, object, T]], *, timeout: float) -> T:
        """Run `coroutine()` on the sender's loop and wait for its result, at most `timeout`
        seconds (then TimeoutError); RuntimeError from the loop's own thread (it would wait
        for itself)."""
        loop, _ = self._running()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError("the notices' loop cannot wait for itself")
        return asyncio.run_coroutine_threadsafe(coroutine(), loop).result(timeout)

    def _running(self) -> tuple[asyncio.AbstractEventLoop, asyncio.Queue]:
        with self._lock:
            loop, queue = self._loop, self._queue  # set together by _start_on
            if loop is None or queue is None or loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="session-notices", daemon=True).start()
                queue = self._start_on(loop)
        return loop, queue

    def _start_on(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._loop, self._queue = loop, queue
        asyncio.run_coroutine_threadsafe(self._drain(queue), loop)
        return queue

    @staticmethod
    async def _drain(queue: asyncio.Queue) -> None:
        while True:
            sends = await queue.get()
            try:
                await _group_send_all(get_channel_layer(), sends)
            except Exception:
                log.exception("could not push %d session notice(s)", len(sends))


_SENDER = _Sender()
use_loop = _SENDER.use_loop
