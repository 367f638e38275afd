"""How long a batch job runs, from the runs like it that ended on their own (issue 32.3). Pure
Python, no Django: the console's ETA (`sessions.eta`) and `benchmarks/queue.py` use the same
keys, the same filter and the same fall-back.

What predicts a batch job's runtime is the job itself, not who launched it: its command, its
image, what it asked for (its normalised request) and its project. A history is kept per key
from the finest (all four) to the coarsest (the command alone); an estimate takes the finest
key with at least `minimum` runs that lasted as long as the job has run so far
(`replay.remaining_band`), so a new request shape of a known command falls back to that
command's runs, never to another command's. Only runs that completed count: a cancelled,
preempted, reclaimed or failed run says when someone stopped it, not how long the job takes.

Sources: keying by job identity rather than user is what Slurm's and Tsafrir et al.'s runtime
predictors do ("Backfilling using system-generated predictions rather than user runtime
estimates", IEEE TPDS 2007: the user's last two runs of the same job); Slurm's backfill uses the
job's time limit, a known end, before any prediction — as `sessions.eta` uses a preemption time
or a lifetime limit before this history.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from accelerators.allocation import replay as pure

COMPLETED = "completed"
CANCELLED = "cancelled"
PREEMPTED = "preempted"
FAILED = "failed"
OUTCOMES = (COMPLETED, CANCELLED, PREEMPTED, FAILED)

# (fields of `Job` that make the key, the words a basis uses), finest first
LEVELS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("command", "image", "resources", "project"), "this command, image, request and project"),
    (("command", "image", "resources"), "this command, image and request"),
    (("command", "image"), "this command and image"),
    (("command",), "this command"),
)


@dataclass(frozen=True)
class Job:
    """What identifies a batch job for its runtime: `command` (as launched; blank spaces at the
    ends do not count), `image` (reference, "" for none), `resources` (the normalised request as
    text, e.g. its JSON with sorted keys) and `project` (the owner's projects as text, or the
    owner for one in none)."""

    command: str
    image: str = ""
    resources: str = ""
    project: str = ""

    def key(self, fields: tuple[str, ...]) -> tuple:
        return (fields, *(getattr(self, f).strip() if f == "command" else getattr(self, f) for f in fields))


@dataclass
class History:
    """Runtimes (seconds) of completed runs by every key of `LEVELS`. `add` ignores runs that
    did not complete (`outcome` other than COMPLETED) and interactive ones (no command)."""

    runs: dict[tuple, list[float]] = field(default_factory=dict)

    def add(self, job: Job, seconds: float, outcome: str = COMPLETED) -> None:
        if outcome != COMPLETED or not job.command.strip() or seconds < 0:
            return
        for fields, _ in LEVELS:
            self.runs.setdefault(job.key(fields), []).append(seconds)

    def of(self, job: Job, elapsed: float = 0.0, *, minimum: int = pure.HISTORY_MIN) -> tuple[list[float], str]:
        """The runtimes of the finest key with at least `minimum` runs of `elapsed` seconds or
        longer, and its basis ("batch history of this command and image (12 runs)"); ([], words
        saying there is none) when no key has enough."""
        for fields, words in LEVELS:
            runs = self.runs.get(job.key(fields), [])
            if sum(1 for r in runs if r >= elapsed) >= minimum:
                return runs, f"batch history of {words} ({len(runs)} runs)"
        return [], f"no batch history of this command (fewer than {minimum} completed runs)"

    def band(
        self, job: Job, elapsed: float = 0.0, *, low: float = pure.HISTORY_BAND[0], high: float = pure.HISTORY_BAND[1]
    ) -> tuple[tuple[float, float] | None, str]:
        """How much longer `job`, having run `elapsed` seconds, runs: (earliest, latest) seconds
        from now (`replay.remaining_band` of `of`'s runtimes, quantiles `low`/`high`), or None,
        with the basis."""
        runs, basis = self.of(job, elapsed)
        band = pure.remaining_band(runs, elapsed, low=low, high=high, minimum=pure.HISTORY_MIN) if runs else None
        return band, basis


def history_of(rows: Iterable[tuple[Job, float, str]]) -> History:
    """A `History` of (job, seconds, outcome) rows."""
    history = History()
    for job, seconds, outcome in rows:
        history.add(job, seconds, outcome)
    return history
