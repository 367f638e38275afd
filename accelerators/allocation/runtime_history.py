"""How long a batch job runs, from the runs like it that ended on their own (issue 32.3). Pure
Python, no Django: the console's ETA (`sessions.scheduling.eta`) and `benchmarks/queue_bands.py` use the same
keys, the same filter and the same fall-back.

What predicts a batch job's runtime is the job itself, not who launched it: its command, its
image, what it asked for (its normalised request) and its project. A history is kept per key
from the finest (all four) to the coarsest (the command alone); an estimate takes the finest
key with at least `minimum` runs that lasted as long as the job has run so far
(`replay.remaining_band`), so a new request shape of a known command falls back to that
command's runs, never to another command's. Only runs that completed say how long the job takes:
a cancelled, preempted, reclaimed or failed run says when someone (or something) stopped it. The
band's late end and the key's choice come from completed runs only; the early end may come
sooner when runs of that same key were cut short often enough to reach the band's low quantile
(`early_ends`): a start in a queue of such jobs can come that early. benchmarks/queue_bands.py measures
both (results/queue_bands.txt): on its mixed trace (18 % of runs cut short) the band from completed runs
alone held 64 % of the starts (54 % with another seed), with the same key's cut-short runs on the
early side 82 % (85 %).

Sources: keying by job identity rather than user is what Slurm's and Tsafrir et al.'s runtime
predictors do ("Backfilling using system-generated predictions rather than user runtime
estimates", IEEE TPDS 2007: the user's last two runs of the same job); Slurm's backfill uses the
job's time limit, a known end, before any prediction — as `sessions.scheduling.eta` uses a preemption time
or a lifetime limit before this history.
"""

from __future__ import annotations

from typing import Any

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

    def key(self, fields: tuple[str, ...]) -> tuple[Any, ...]:
        return (fields, *(getattr(self, f).strip() if f == "command" else getattr(self, f) for f in fields))


@dataclass
class History:
    """Runtimes (seconds) by every key of `LEVELS`: `runs` of completed runs, `cut` of runs cut
    short (cancelled, preempted, failed). `add` ignores interactive runs (no command)."""

    runs: dict[tuple[Any, ...], list[float]] = field(default_factory=dict)
    cut: dict[tuple[Any, ...], list[float]] = field(default_factory=dict)

    def add(self, job: Job, seconds: float, outcome: str = COMPLETED) -> None:
        if not job.command.strip() or seconds < 0:
            return
        into = self.runs if outcome == COMPLETED else self.cut
        for fields, _ in LEVELS:
            into.setdefault(job.key(fields), []).append(seconds)

    def of(self, job: Job, elapsed: float = 0.0, *, minimum: int = pure.HISTORY_MIN) -> tuple[list[float], str]:
        """The completed runtimes of the finest key with at least `minimum` completed runs of
        `elapsed` seconds or longer, and its basis ("batch history of this command and image (12
        runs)"); ([], words saying there is none) when no key has enough."""
        runs, basis, _ = self._level(job, elapsed, minimum)
        return runs, basis

    def _level(self, job: Job, elapsed: float, minimum: int) -> tuple[list[float], str, tuple[Any, ...]]:
        for fields, words in LEVELS:
            runs = self.runs.get(job.key(fields), [])
            if sum(1 for r in runs if r >= elapsed) >= minimum:
                return runs, f"batch history of {words} ({len(runs)} runs)", job.key(fields)
        return [], f"no batch history of this command (fewer than {minimum} completed runs)", ()

    def band(
        self,
        job: Job,
        elapsed: float = 0.0,
        *,
        low: float = pure.HISTORY_BAND[0],
        high: float = pure.HISTORY_BAND[1],
        early_ends: bool = True,
    ) -> tuple[tuple[float, float] | None, str]:
        """How much longer `job`, having run `elapsed` seconds, runs: (earliest, latest) seconds
        from now — `replay.remaining_band` of `of`'s completed runtimes at quantiles `low` and
        `high`; with `early_ends`, the earliest is the `low` quantile of that key's completed and
        cut-short runs together when that is sooner (how early such a job has ended) — or None,
        with the basis."""
        runs, basis, key = self._level(job, elapsed, pure.HISTORY_MIN)
        band = pure.remaining_band(runs, elapsed, low=low, high=high, minimum=pure.HISTORY_MIN) if runs else None
        cut = [r for r in self.cut.get(key, []) if r >= elapsed] if key else []
        if band is None or not early_ends or not cut:
            return band, basis
        every = [r for r in runs if r >= elapsed] + cut
        early = max(0.0, pure.quantile(every, low) - elapsed)
        if early < band[0]:
            return (early, band[1]), f"{basis[:-1]}; {len(cut)} cut short)"
        return band, basis


def history_of(rows: Iterable[tuple[Job, float, str]]) -> History:
    """A `History` of (job, seconds, outcome) rows."""
    history = History()
    for job, seconds, outcome in rows:
        history.add(job, seconds, outcome)
    return history
