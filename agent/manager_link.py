"""The agent's link to the manager: registration, heartbeats and session reports.

The agent never opens the database: it sends Celery tasks named in `protocol` (queue `manager`,
log batches on `manager.logs`, usage on `manager.usage`), signed with the node's key. Sends are
blocking calls (a broker publish; in standalone mode the manager's code itself, eagerly), so
`ManagerLink` makes them on pools of its own, never on the loop: reports and log batches on a
bounded manager pool, heartbeats on one thread of their own (a node never goes LOST because its
agent is busy).

Healing (DESIGN.md, "How the system heals"): a report the broker does not take is tried again in
the background (REPORT_RETRY_S apart, for REPORT_GIVE_UP_S at most); the ends the agent reported
are kept for ENDED_KEEP_S so that each heartbeat lists them (`ended_state`) for a manager that
missed the report. As the parts of Backend.AI's agent hand their events to one producer
(`ai.backend.agent` event producer), every part here reports through this one link.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Collection, Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import protocol
from protocol.messages import (
    AgentState,
    Heartbeat,
    Inventory,
    LogBatch,
    NodeName,
    Registration,
    SessionEnd,
    SessionId,
    SessionReport,
    UsageBatch,
)
from protocol.mig_messages import MigReport

log = logging.getLogger(__name__)
T = TypeVar("T")

MANAGER_THREADS = 4
REPORT_RETRY_S = (0.5, 1, 2, 4, 5)  # pauses between tries of a report the broker did not take; then every 5 s
REPORT_GIVE_UP_S = 600  # after this a report is left to the heartbeat's reconciliation
ENDED_KEEP_S = 600  # how long heartbeats keep listing a session's end (for a manager that missed the report)
ENDED_KEEP_MAX = 10_000
HEARTBEAT_EXPIRES_S = 30


class CeleryManager:
    """How an agent talks to the manager: Celery tasks named in `protocol` (blocking calls).
    `app`: the Celery app (in standalone mode eager, so a call runs the manager's code at once);
    `node`: this agent's node, named in its session reports and log batches; `key`: the node's
    agent key (agent.toml `[manager] node-key`), which signs every message (protocol.sign)."""

    def __init__(self, app: Any, *, node: str = "", key: str = "") -> None:
        self.app = app
        self.node = node
        self.key = key

    def _send(self, task: str, **options: Any) -> None:
        kwargs = options.pop("kwargs")
        if self.key:
            kwargs[protocol.SIGNATURE] = protocol.sign(self.key, task, kwargs)
        self.app.signature(task, kwargs=kwargs).apply_async(**options)

    def register(
        self,
        node: str,
        inventory: dict[str, Any],
        running: list[str],
        images: dict[str, str] | None = None,
        *,
        image_service_ports: dict[str, str] | None = None,
    ) -> None:
        """`images`: the session images the node holds ({reference: image id}; sent only when known);
        `image_service_ports`: {image id: its ai.backend.service-ports label} (sent only when not empty)."""
        registration = Registration(
            node=NodeName(node),
            inventory=Inventory.decode(inventory),
            running=tuple(SessionId(s) for s in running),
            images=images,
            image_service_ports=image_service_ports,
        )
        self._send(protocol.AGENT_REGISTER, kwargs=registration.encode())

    def heartbeat(
        self,
        node: str,
        running: list[str],
        mig_digest: str | None = None,
        state: AgentState | None = None,
        images: dict[str, str] | None = None,
        *,
        image_service_ports: dict[str, str] | None = None,
    ) -> None:
        """`state`: the agent's view of its sessions (`Agent.state`; None: not sent); `images` and
        `image_service_ports` as for `register`. A heartbeat the manager has not taken within
        HEARTBEAT_EXPIRES_S is dropped unread: a newer one is on its way."""
        beat = Heartbeat(
            node=NodeName(node),
            running=tuple(SessionId(s) for s in running),
            mig_digest=mig_digest,
            state=state,
            images=images,
            image_service_ports=image_service_ports,
        )
        self._send(protocol.AGENT_HEARTBEAT, kwargs=beat.encode(), expires=HEARTBEAT_EXPIRES_S)

    def report(self, session_id: str, status: str, reason: str, exit_code: int | None) -> None:
        report = SessionReport(SessionId(session_id), status, reason, exit_code, NodeName(self.node) if self.node else None)
        self._send(protocol.SESSION_REPORT, kwargs=report.encode())

    def log(self, session_id: str, seq: int, offset: int, text: str, final: bool) -> None:
        batch = LogBatch(SessionId(session_id), seq, offset, text, final, NodeName(self.node) if self.node else None)
        self._send(protocol.SESSION_LOG_APPEND, kwargs=batch.encode())

    def mig_report(self, node: str, report: MigReport) -> None:
        """What the agent's MIG manager found and did (protocol.mig_messages.MigReport)."""
        self._send(protocol.MIG_REPORT, kwargs={"node": node, "report": report.encode()})

    def usage(self, batch: UsageBatch) -> None:
        """A batch of usage samples (agent.usage), on queue manager.usage."""
        self._send(protocol.USAGE_REPORT, kwargs=batch.encode())


End = tuple[float, str, str, int | None]  # (monotonic time it was reported, status, reason, exit code)


class ManagerLink:
    """One node's reports to the manager, made off the loop and retried.

    `node`: the node's name; `manager`: an object with the methods of `CeleryManager` (`register`,
    `heartbeat`, `report`, `log`, `mig_report`; blocking); `background`: runs a coroutine as a
    task the agent keeps until it is done (its report retries). `loop` is set by `start` (the
    agent's loop) before any other call. Raises nothing: a failed send is logged and tried again
    (reports) or left to the next heartbeat (registration, heartbeats)."""

    loop: asyncio.AbstractEventLoop

    def __init__(
        self,
        *,
        node: str,
        manager: Any,
        background: Callable[[Coroutine[Any, Any, None]], None],
        retry_s: Iterable[float] = REPORT_RETRY_S,
    ) -> None:
        self.node = node
        self.manager = manager
        self.background = background
        self.retry_s = tuple(retry_s)
        self.registered = False
        self.ended: dict[str, End] = {}  # session id → its reported end, listed by heartbeats for ENDED_KEEP_S
        self.pool = ThreadPoolExecutor(MANAGER_THREADS, thread_name_prefix=f"agent-{node}-manager")
        self.heartbeat_pool = ThreadPoolExecutor(1, thread_name_prefix=f"agent-{node}-heartbeat")

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def close(self) -> None:
        """Drop what waits on the pools (the agent shuts down)."""
        for pool in (self.pool, self.heartbeat_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)`, a call to the manager, on the manager pool: never on the loop,
        never behind session work."""
        return await self.loop.run_in_executor(self.pool, partial(fn, *args, **kwargs))

    async def register(
        self, inventory: dict[str, Any], running: list[str], images: dict[str, str] | None, service_ports: dict[str, Any]
    ) -> None:
        """Register the node (its `inventory`, the session ids it `running`, its held `images`,
        `service_ports`: the keyword `service_ports_keyword` builds); `registered` says whether the
        broker took it (else the next heartbeat tries again)."""
        try:
            await self.call(self.manager.register, self.node, inventory, running, images, **service_ports)
            self.registered = True
        except Exception:
            log.exception("agent %s: could not register with the manager; will try again", self.node)

    async def heartbeat(self, send: Callable[[], None]) -> None:
        """Run blocking `send` (the agent's heartbeat, which reads NVML for its MIG digest) on
        the heartbeat thread; a failure is logged (the next heartbeat comes HEARTBEAT_S later)."""
        try:
            await self.loop.run_in_executor(self.heartbeat_pool, send)
        except Exception:
            log.exception("agent %s: heartbeat failed", self.node)

    # --- session reports ---------------------------------------------------------------

    async def report(
        self, session_id: str, status: str, reason: str, exit_code: int | None = None, *, retry: bool = True
    ) -> None:
        """Report a session's state to the manager. When the broker does not take it, try again
        in the background (`retry`; REPORT_RETRY_S apart, for REPORT_GIVE_UP_S at most, after
        which the heartbeat's state still tells the manager)."""
        try:
            await self.call(self.manager.report, session_id, status, reason, exit_code)
            return
        except Exception:
            log.warning(
                "agent %s: could not report %s for session %s%s",
                self.node,
                status,
                session_id,
                "; will try again" if retry else "",
                exc_info=True,
            )
        if retry:
            self.background(self._report_retry(session_id, status, reason, exit_code))

    async def _report_retry(self, session_id: str, status: str, reason: str, exit_code: int | None) -> None:
        give_up = self.loop.time() + REPORT_GIVE_UP_S
        for attempt in itertools.count():
            await asyncio.sleep(self.retry_s[min(attempt, len(self.retry_s) - 1)])
            try:
                await self.call(self.manager.report, session_id, status, reason, exit_code)
                log.info("agent %s: reported %s for session %s after %d retries", self.node, status, session_id, attempt + 1)
                return
            except Exception:
                if self.loop.time() > give_up:
                    log.error(
                        "agent %s: gave up reporting %s for session %s; the heartbeat carries it", self.node, status, session_id
                    )
                    return

    async def end(self, session_id: str, status: str, reason: str, exit_code: int | None) -> None:
        """Remember a session's end (heartbeats list it for ENDED_KEEP_S) and report it."""
        self.ended[session_id] = (time.monotonic(), status, reason, exit_code)
        await self.report(session_id, status, reason, exit_code=exit_code)

    async def report_end(self, session_id: str) -> None:
        """Report a remembered end again (a re-sent start or stop of an ended session). Raises
        KeyError if the session's end is not remembered."""
        _, status, reason, exit_code = self.ended[session_id]
        await self.report(session_id, status, reason, exit_code=exit_code)

    def ended_state(self, *, besides: Collection[str]) -> tuple[SessionEnd, ...]:
        """The remembered ends, for the heartbeat's state (protocol.messages.AgentState.ended), oldest
        first, without the sessions in `besides` (those that run again under the same id)."""
        return tuple(
            SessionEnd(SessionId(session_id), status, reason, code)
            for session_id, (_, status, reason, code) in self.ended.items()
            if session_id not in besides
        )

    def forget_old_ends(self) -> None:
        """Forget ends reported more than ENDED_KEEP_S ago, and the oldest past ENDED_KEEP_MAX."""
        horizon = time.monotonic() - ENDED_KEEP_S
        for session_id in [sid for sid, end in self.ended.items() if end[0] < horizon]:
            del self.ended[session_id]
        while len(self.ended) > ENDED_KEEP_MAX:
            del self.ended[next(iter(self.ended))]


def service_ports_keyword(labels: dict[str, str]) -> dict[str, dict[str, str]]:
    """The held images' ai.backend.service-ports labels as a keyword for register and heartbeat,
    none when there are none (a manager double that predates them keeps working)."""
    return {"image_service_ports": dict(labels)} if labels else {}
