"""What sessions reads of the usage app, through an interface usage provides (issue 34.3): usage
sits above sessions (it imports sessions' models), so sessions never imports usage; usage's
AppConfig.ready() sets `reads` to its own implementation (usage.selectors.SessionsUsageReads).
Without the usage app (`UsageReads` itself) no resource group bounds a session's lifetime, no
session is watched for idleness and no data folder has a figure.

What is read: a resource group's lifetime bounds (usage.IdlePolicy: the scheduler's backfill time
limits, the ETA's ends), a running session's idle watch (usage.SessionActivity: the ETA's
reclamation deadlines) and a user's data folders' storage use (usage.FolderUse: My resources).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID


@dataclass(frozen=True)
class LifetimeBounds:
    """A resource group's idle policy, in seconds: `idle_timeout` idle before the warning (None:
    never reclaimed as idle), `max_lifetime` the longest a session runs (None: no limit), `grace`
    between the warning and the end."""

    idle_timeout: int | None
    max_lifetime: int | None
    grace: int


@dataclass(frozen=True)
class IdleWatch:
    """What idle reclamation knows of one running session: `last_input` (epoch seconds of its
    last terminal input, None: none seen), `deadline` (when it ends unless used; None: not warned)
    and `reason` (why it was warned, "" when not)."""

    last_input: int | None
    deadline: datetime | None
    reason: str


class UsageReads:
    """The reads, as they are without the usage app: empty. usage.selectors.SessionsUsageReads
    gives the real ones."""

    def lifetime_bounds(self) -> dict[int | None, LifetimeBounds]:
        """Resource group id (None: the nodes in no group) → its bounds, for the groups with a policy."""
        return {}

    def max_lifetimes(self) -> dict[str, int]:
        """Resource group name ("" for the nodes in no group) → the most seconds a session there
        may run, for the groups with a limit (backfill's time limits, as Slurm's --time)."""
        return {}

    def idle_watches(self, *, session_ids: Iterable[UUID]) -> dict[UUID, IdleWatch]:
        """Session id (its UUID pk) → its idle watch, for those of `session_ids` that have one."""
        return {}

    def folder_use(self, *, user: Any) -> list[dict[str, Any]]:
        """`user`'s data folders as each node's agent last measured them: `[{"folder", "node",
        "used": bytes, "limit": bytes, "t": epoch seconds}]` (usage.selectors.folder_use_list)."""
        return []


reads: UsageReads = UsageReads()  # set by usage.apps.UsageConfig.ready()
