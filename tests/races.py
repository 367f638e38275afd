"""Races between threads on the real database, for the tests that prove a lock or a constraint
holds (two launches of one name, one project's launches against its quota): each thread's work
starts at one barrier, an application error is a refusal, any other exception is kept for the
test to report (not lost in the thread), and each thread closes its own database connection."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from django.db import connection

from common.errors import ApplicationError

T = TypeVar("T")


@dataclass
class Race(Generic[T]):
    """What `race` saw: its threads (joined, or still alive when stuck), the ApplicationErrors
    its works raised, and any other exception."""

    threads: list[threading.Thread] = field(default_factory=list)
    refused: list[ApplicationError] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)


def race(work: Callable[[T], object], each: Sequence[T], *, name: str, join_s: float) -> Race[T]:
    """Run `work(item)` for each of `each` at once, one thread each (named `<name>-<i>`), all
    released together by a barrier (waited on for at most 30 s); each thread is joined for at
    most `join_s` seconds. The test asserts on what comes back."""
    barrier = threading.Barrier(len(each))
    seen: Race[T] = Race()

    def run(item: T) -> None:
        try:
            barrier.wait(timeout=30)
            work(item)
        except ApplicationError as exc:
            seen.refused.append(exc)
        except BaseException as exc:  # reported by the test, not lost in the thread
            seen.errors.append(exc)
        finally:
            connection.close()

    seen.threads = [threading.Thread(target=run, args=(item,), name=f"{name}-{i}") for i, item in enumerate(each)]
    for thread in seen.threads:
        thread.start()
    for thread in seen.threads:
        thread.join(timeout=join_s)
    return seen
