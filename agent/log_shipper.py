"""The log shipper: a session's output on its way to the manager (`fgpu.manager.session_log_append`,
queue `manager.logs`, never ahead of control messages), in batches.

A batch goes every LOG_IDLE_FLUSH_S seconds, or every LOG_FLUSH_S while LOG_BATCH_CHARS or more
characters wait, one at a time and at most one per LOG_FLUSH_S, so a flooding session sends the
manager at most LOG_CHUNK_CHARS / LOG_FLUSH_S characters a second, and a session typed in a write
every LOG_IDLE_FLUSH_S at most. Each batch carries a sequence number and its offset in the
session's output (characters), so a retried delivery is stored once; what waits unshipped past
LOG_BACKLOG_CHARS (the manager unreachable, or output faster than the log ships) is dropped oldest
first and the offset moves past it, so offsets stay positions in the output. The last batch
carries the final mark.

The shipper knows nothing of PTYs, terminals or Celery: the terminal pipe hands it decoded text
(`SessionLog.add`), and the agent gives it the send (`SessionLog.bind`): an async call that
delivers one batch (seq, offset, text, final) and raises when the manager could not be reached.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from agent.buffers import take_front

log = logging.getLogger(__name__)

LOG_FLUSH_S = 0.5  # seconds between log batches while LOG_BATCH_CHARS or more wait
# Seconds between log batches of a trickle (a shell typed in): each batch is a database write on
# the manager (in standalone mode in the process that relays the terminal, where one every 0.5 s
# put a 3 ms stall into keystroke echoes every 0.5 s: benchmarks/terminal.py, p99).
LOG_IDLE_FLUSH_S = 2.0
LOG_BATCH_CHARS = 64 * 1024  # ship at once when this many characters wait
LOG_CHUNK_CHARS = 256 * 1024  # the most one batch carries
# Unshipped output kept (while the manager is unreachable, or the output comes faster than the log
# ships, LOG_CHUNK_CHARS per LOG_FLUSH_S); older is dropped. As much as the manager keeps of a
# session's log (FGPU_SESSION_LOG_MAX_CHARS), so the log it keeps ends with an unbroken tail.
LOG_BACKLOG_CHARS = 4 * 1024 * 1024
CLOSE_TRIES = 5  # tries of the last batches when the session ends, LOG_FLUSH_S apart

Batch = tuple[int, int, str, bool]  # (seq, offset in characters, text, final)
Send = Callable[[int, int, str, bool], Awaitable[None]]


@dataclass(frozen=True)
class LogLimits:
    """The shipper's pace and bounds (seconds, characters); the defaults are this module's."""

    flush_s: float = LOG_FLUSH_S
    idle_flush_s: float = LOG_IDLE_FLUSH_S
    batch_chars: int = LOG_BATCH_CHARS
    chunk_chars: int = LOG_CHUNK_CHARS
    backlog_chars: int = LOG_BACKLOG_CHARS


async def _never(seq: int, offset: int, text: str, final: bool) -> None:
    raise RuntimeError("the session's log is not bound to a manager")


@dataclass(eq=False)
class SessionLog:
    """One session's output not yet shipped, and the task that ships it (`run`, until `close`).
    Lives on the agent's loop; `add` is called for each decoded part of output."""

    limits: LogLimits = field(default_factory=LogLimits)
    pending: list[str] = field(default_factory=list)  # decoded output not yet batched
    pending_chars: int = 0
    seq: int = 0  # sequence number of the next batch
    offset: int = 0  # characters batched so far: the next batch's offset
    unsent: Batch | None = None  # a batch the manager has not taken yet (a retry keeps its seq)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    closing: asyncio.Event = field(default_factory=asyncio.Event)  # set with closed: ends a pause
    task: asyncio.Task | None = None
    send: Send = _never
    node: str = ""  # for the shipper's log lines
    session_id: str = ""

    def bind(self, *, send: Send, node: str, session_id: str) -> None:
        """Give the log its way to the manager (`send`: one batch, raises when not delivered)."""
        self.send, self.node, self.session_id = send, node, session_id

    def add(self, text: str) -> None:
        """More output (decoded text). Wakes the shipper once LOG_BATCH_CHARS wait; drops the
        oldest past twice LOG_BACKLOG_CHARS (the manager unreachable for long)."""
        self.pending.append(text)
        self.pending_chars += len(text)
        if self.pending_chars >= self.limits.batch_chars:
            self.wake.set()
        if self.pending_chars > 2 * self.limits.backlog_chars:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        """Keep the last LOG_BACKLOG_CHARS characters of the unshipped output; the next batch's
        offset moves past what is dropped, so offsets stay positions in the session's output."""
        if self.pending_chars <= self.limits.backlog_chars:
            return
        text = "".join(self.pending)
        dropped = len(text) - self.limits.backlog_chars
        self.offset += dropped
        self.pending = [text[dropped:]]
        self.pending_chars = self.limits.backlog_chars

    def next_batch(self, *, final: bool) -> Batch | None:
        """Cut the next batch (at most LOG_CHUNK_CHARS) from the pending output; None when there
        is nothing to send (`final`: the last batch is sent even when empty, with the mark). When
        the backlog outgrew LOG_BACKLOG_CHARS, its oldest part is dropped first."""
        self._drop_oldest()
        batch = take_front(self.pending, self.limits.chunk_chars)
        self.pending_chars -= len(batch)
        last = final and not self.pending
        if not batch and not last:
            return None
        chunk = (self.seq, self.offset, batch, last)
        self.seq += 1
        self.offset += len(batch)
        return chunk

    async def ship(self, *, final: bool, most: int | None = None) -> bool:
        """Send the unsent batch (a retry keeps its sequence number) and then the pending output,
        in batches (`most` of them; None: all). Returns False if the manager could not be reached
        (the output stays pending for the next try)."""
        for _ in itertools.repeat(None) if most is None else range(most):
            if self.unsent is None:
                self.unsent = self.next_batch(final=final)
                if self.unsent is None:
                    return True
            try:
                await self.send(*self.unsent)
            except Exception:
                log.warning(
                    "agent %s: could not ship the output of session %s; will retry", self.node, self.session_id, exc_info=True
                )
                return False
            sent_final = self.unsent[3]
            self.unsent = None
            if sent_final or not (self.pending or final):
                return True
        return True

    async def run(self) -> None:
        """Ship every LOG_IDLE_FLUSH_S, or every LOG_FLUSH_S while LOG_BATCH_CHARS or more wait,
        one batch at a time, until `close`."""
        loop = asyncio.get_running_loop()
        last = -self.limits.flush_s
        while not self.closed:
            if self.pending_chars >= self.limits.batch_chars:  # a backlog: on at the LOG_FLUSH_S pace
                self.wake.set()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=self.limits.idle_flush_s)
            except TimeoutError:
                pass
            self.wake.clear()
            pause = last + self.limits.flush_s - loop.time()
            if pause > 0:  # closing the log ends the pause (the session's end waits for it)
                try:
                    await asyncio.wait_for(self.closing.wait(), timeout=pause)
                except TimeoutError:
                    pass
            if not self.closed:
                last = loop.time()
                await self.ship(final=False, most=1)

    def start(self) -> None:
        """Start `run` as a task on the running loop."""
        self.task = asyncio.create_task(self.run())

    async def close(self) -> None:
        """Stop the periodic shipping and send the rest of the output with the final mark (a few
        tries, LOG_FLUSH_S apart); gives up, logged, after CLOSE_TRIES."""
        self.closed = True
        self.closing.set()
        self.wake.set()
        if self.task is not None:
            await self.task
        for _ in range(CLOSE_TRIES):
            if await self.ship(final=True):
                return
            await asyncio.sleep(self.limits.flush_s)
        log.error("agent %s: gave up shipping the last output of session %s", self.node, self.session_id)
