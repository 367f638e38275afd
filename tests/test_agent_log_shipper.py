"""agent.log_shipper alone: a session's output batched to the manager, with no agent, PTY or
broker around it. The send is a recording stand-in for the manager's task (outside the process)
that can refuse; every wait is on a condition with a deadline."""

from __future__ import annotations

import asyncio
import logging

from agent.log_shipper import LogLimits, SessionLog
from tests.stack import wait_until_async


class Manager:
    def __init__(self, refuse: int = 0) -> None:
        self.refuse = refuse
        self.batches: list[tuple[int, int, str, bool]] = []

    async def send(self, seq: int, offset: int, text: str, final: bool) -> None:
        if self.refuse:
            self.refuse -= 1
            raise ConnectionError("the broker is down")
        self.batches.append((seq, offset, text, final))


def shipper(manager: Manager, **limits) -> SessionLog:
    log = SessionLog(limits=LogLimits(**limits))
    log.bind(send=manager.send, node="log-node", session_id="s1")
    return log


def test_a_batch_the_manager_did_not_take_is_sent_again_with_its_sequence_number_and_offset():
    manager = Manager(refuse=1)

    async def scenario():
        log = shipper(manager, chunk_chars=4)
        log.add("abcdef")
        assert not await log.ship(final=False)  # refused: kept as the unsent batch
        log.add("gh")
        assert await log.ship(final=True)

    asyncio.run(scenario())
    assert manager.batches == [(0, 0, "abcd", False), (1, 4, "efgh", True)]


def test_the_last_batch_carries_the_final_mark_even_when_nothing_waits():
    manager = Manager()

    async def scenario():
        log = shipper(manager)
        log.add("hello\r\n")
        assert await log.ship(final=False)
        await log.close()

    asyncio.run(scenario())
    assert manager.batches == [(0, 0, "hello\r\n", False), (1, 7, "", True)]


def test_output_past_twice_the_backlog_drops_the_oldest_and_the_offset_moves_past_it():
    log = shipper(Manager(), backlog_chars=4, chunk_chars=100)
    for part in ("abc", "def", "ghi"):  # 9 > 2 * 4: trimmed to the last 4 as it comes
        log.add(part)
    assert (log.pending, log.pending_chars, log.offset) == (["fghi"], 4, 5)
    assert log.next_batch(final=True) == (0, 5, "fghi", True)


def test_the_shipper_wakes_at_once_when_a_batch_is_full_and_not_before_the_idle_time_for_a_trickle():
    manager = Manager()

    async def scenario():
        log = shipper(manager, batch_chars=10, idle_flush_s=60.0, flush_s=0.01)
        log.start()
        log.add("typed")  # a trickle: waits for the idle flush (60 s here)
        await asyncio.sleep(0.05)  # noqa: TID251 -- the time itself is what is tested: nothing may go meanwhile
        quiet = list(manager.batches)
        log.add("x" * 10)  # a batch's worth: shipped at once
        await wait_until_async(lambda: manager.batches, timeout=5, interval=0.01, what="the full batch")
        await log.close()
        return quiet

    assert asyncio.run(scenario()) == []
    assert manager.batches[0] == (0, 0, "typed" + "x" * 10, False)
    assert manager.batches[-1][3] is True


def test_closing_gives_up_after_its_tries_and_says_so(caplog):
    manager = Manager(refuse=100)

    async def scenario():
        log = shipper(manager, flush_s=0.001)
        log.add("lost")
        await log.close()
        return log

    with caplog.at_level(logging.ERROR, logger="agent.log_shipper"):
        log = asyncio.run(scenario())
    assert manager.batches == [] and log.unsent == (0, 0, "lost", True)
    assert "gave up shipping the last output of session s1" in caplog.text
