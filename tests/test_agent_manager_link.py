"""agent.manager_link alone: the agent's reports to the manager, retried off the loop, and the
ends it remembers for the heartbeat, with no agent, session or channel layer around it.

The manager is outside the agent's process (Celery tasks), so a recording stand-in that refuses
its first calls is the boundary; every wait is on a condition with a deadline."""

from __future__ import annotations

import asyncio
import threading
import time

from agent import manager_link
from agent.manager_link import ManagerLink
from protocol.messages import SessionEnd, SessionId
from tests.stack import wait_until_async


class FlakyManager:
    """Refuses its first `refuse` calls (as a broker that is down), records the others; calls come
    from the link's threads."""

    def __init__(self, refuse: int = 0) -> None:
        self.refuse = refuse
        self.reports: list[tuple] = []
        self.registered: list[tuple] = []
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def _take(self) -> None:
        with self._lock:
            self.threads.add(threading.current_thread().name)
            if self.refuse > 0:
                self.refuse -= 1
                raise ConnectionError("the broker is down")

    def report(self, session_id, status, reason, exit_code):
        self._take()
        self.reports.append((session_id, status, reason, exit_code))

    def register(self, node, inventory, running, images=None, **keywords):
        self._take()
        self.registered.append((node, running, images, keywords))


def run(scenario, manager):
    async def main():
        tasks: set[asyncio.Task] = set()

        def background(coro):
            task = asyncio.create_task(coro)
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        link = ManagerLink(node="link-node", manager=manager, background=background, retry_s=(0.01,))
        link.start(asyncio.get_running_loop())
        try:
            return await scenario(link)
        finally:
            for task in tasks:
                task.cancel()
            link.close()

    return asyncio.run(main())


def test_a_report_the_broker_refused_is_sent_again_in_the_background_from_the_manager_pool():
    manager = FlakyManager(refuse=3)

    async def scenario(link):
        await link.report("s1", "RUNNING", "")  # refused: returns at once, retried behind it
        assert manager.reports == []
        await wait_until_async(lambda: manager.reports, timeout=5, interval=0.01, what="the retried report")

    run(scenario, manager)
    assert manager.reports == [("s1", "RUNNING", "", None)]  # once, as sent
    assert all(name.startswith("agent-link-node-manager") for name in manager.threads)  # never the loop


def test_a_report_without_retry_is_dropped_when_refused():
    manager = FlakyManager(refuse=1)

    async def scenario(link):
        await link.report("s1", "PREPARING", "preparing", retry=False)
        await link.report("s1", "RUNNING", "")  # taken: the PREPARING was never tried again before it

    run(scenario, manager)
    assert manager.reports == [("s1", "RUNNING", "", None)]


def test_an_end_is_remembered_for_the_heartbeat_and_reported_again_on_request():
    manager = FlakyManager()

    async def scenario(link):
        await link.end("gone", "TERMINATED", "the process exited with code 0", 0)
        await link.end("back", "ERROR", "no room", None)
        state = link.ended_state(besides={"back": "RUNNING"})  # "back" runs again under its id
        await link.report_end("gone")
        return state

    state = run(scenario, manager)
    assert state == (SessionEnd(SessionId("gone"), "TERMINATED", "the process exited with code 0", 0),)
    assert manager.reports == [
        ("gone", "TERMINATED", "the process exited with code 0", 0),
        ("back", "ERROR", "no room", None),
        ("gone", "TERMINATED", "the process exited with code 0", 0),
    ]


def test_ends_older_than_the_keep_time_or_past_the_cap_are_forgotten(monkeypatch):
    monkeypatch.setattr(manager_link, "ENDED_KEEP_MAX", 2)
    link = ManagerLink(node="link-node", manager=FlakyManager(), background=lambda coro: coro.close())
    now = time.monotonic()
    link.ended = {
        "old": (now - manager_link.ENDED_KEEP_S - 1, "TERMINATED", "", 0),
        "a": (now, "TERMINATED", "", 0),
        "b": (now, "TERMINATED", "", 0),
        "c": (now, "TERMINATED", "", 0),
    }
    link.forget_old_ends()
    link.close()
    assert list(link.ended) == ["b", "c"]  # the expired one, then the oldest past the cap


def test_registration_is_marked_only_once_the_broker_took_it_and_a_failed_heartbeat_does_not_raise():
    manager = FlakyManager(refuse=1)

    def failing_heartbeat():
        raise ConnectionError("the broker is down")

    async def scenario(link):
        await link.register({"devices": []}, [], None, {})
        first = link.registered
        await link.heartbeat(failing_heartbeat)  # logged; the loop goes on
        await link.register({"devices": []}, ["s1"], {"img": "sha256:1"}, {"image_service_ports": {"sha256:1": "x"}})
        return first, link.registered

    assert run(scenario, manager) == (False, True)
    assert manager.registered == [("link-node", ["s1"], {"img": "sha256:1"}, {"image_service_ports": {"sha256:1": "x"}})]
