"""Fair share over time (issue 17.1): who has had less of the cluster lately than their share
starts first among sessions of the same priority.

Accounts: every project (its members' usage, its `share_weight`) and every user in no project
(weight 1). A user in two projects counts in both, as in the usage report. An account's usage is
the fGPU its members' sessions were granted, in fGPU-seconds, each second weighted by
2^(-age / half-life) (FGPU_FAIRSHARE_HALF_LIFE_DAYS, default 7 days): an allocation one
half-life old counts half.

Factor: F = 2^(-(U / ΣU) / (W / ΣW)) over the active accounts (those with usage or with a
pending session): 1 for an account that used nothing, 0.5 for one whose usage share equals its
weight share, towards 0 for one far over its share; 1 for everyone while nobody used anything.
A session's factor is the best of its owner's accounts'. The queue orders by priority, then
factor (higher first), then arrival (sessions.scheduling.scheduler).

Sources: Slurm's classic fair-share factor F = 2^(-U/S) with usage decayed by PriorityDecayHalfLife
(priority/multifactor); Backend.AI's BEP-1026 draft for the 7-day half-life and GPU usage in
cuda.shares-seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db.models import FloatField, Func, Q, Sum, Value
from django.db.models.functions import Cast, Coalesce, Exp, Least
from django.utils import timezone

from sessions.models import Allocation, ComputeSession, Project, SessionStatus

MAX_SHARE_WEIGHT = 2_147_483_647  # the largest weight Project.share_weight holds (PostgreSQL integer); floats hold it exactly
HORIZON_HALF_LIVES = 20  # allocations released longer ago than this count under one millionth: left out


def decayed_seconds(*, start, end, now, half_life: float, exp=math.exp):
    """∫ from `start` to `end` of 2^(-(now - t) / half_life) dt: the seconds of [start, end]
    (epoch seconds, end ≥ start, both ≤ now) weighted by their age. `half_life` in seconds, > 0.
    The one formula for Python floats (`exp` math.exp) and for the database, which sums it over
    the allocations (`account_shares`: `start`, `end`, `now` expressions, `exp` Django's Exp)."""
    rate = math.log(2) / half_life
    return (exp(-rate * (now - end)) - exp(-rate * (now - start))) / rate


class _EpochSeconds(Func):
    """A datetime column in seconds since 1970 (UTC, float): PostgreSQL's EXTRACT(EPOCH …); on
    SQLite (standalone), where Django keeps datetimes as UTC text, by julianday()."""

    output_field = FloatField()

    def as_postgresql(self, compiler, connection, **extra):
        return self.as_sql(compiler, connection, template="EXTRACT(EPOCH FROM %(expressions)s)::double precision", **extra)

    def as_sqlite(self, compiler, connection, **extra):
        return self.as_sql(compiler, connection, template="((julianday(%(expressions)s) - 2440587.5) * 86400.0)", **extra)


def fair_share_factor(*, usage: float, usage_total: float, weight: float, weight_total: float) -> float:
    """2^(-(usage / usage_total) / (weight / weight_total)), in (0, 1]; 1.0 when nobody used
    anything (`usage_total` 0). Weights 1 … MAX_SHARE_WEIGHT each; raises ValueError outside."""
    if not 1 <= weight <= MAX_SHARE_WEIGHT:
        raise ValueError(f"a fair-share weight is 1 … {MAX_SHARE_WEIGHT}, not {weight}")
    if usage_total <= 0:
        return 1.0
    return 2.0 ** (-(usage / usage_total) / (weight / weight_total))


@dataclass(frozen=True)
class AccountShare:
    """One account's standing: `kind` "project" or "user", its `name`, `weight`, decayed `usage`
    (fGPU-seconds), `usage_share` and `weight_share` among the active accounts (0–1), `factor`
    (0–1], `pending` sessions of its members, and its members' user ids."""

    kind: str
    name: str
    weight: int
    usage: float
    usage_share: float
    weight_share: float
    factor: float
    pending: int
    members: frozenset


def half_life_seconds() -> float:
    """FGPU_FAIRSHARE_HALF_LIFE_DAYS in seconds; 0: fair share is off (the queue is first in,
    first out within a priority)."""
    return float(settings.FGPU_FAIRSHARE_HALF_LIFE_DAYS) * 86400


def account_shares(*, now: datetime | None = None, weights: dict[str, int] | None = None) -> list[AccountShare]:
    """Every active account's standing now (see the module docstring), lowest factor first.
    Three queries: each owner's decayed usage (summed by the database over the allocations within
    HORIZON_HALF_LIVES half-lives), the projects with their members, the pending sessions'
    owners. Empty when fair share is off. `weights` (project name → share weight, 1 …
    MAX_SHARE_WEIGHT; ValueError outside) replaces the stored weights of the projects it names:
    what the standing would be (the scheduler's what-if, `sessions.scheduling.eta`)."""
    bad = sorted(name for name, w in (weights or {}).items() if not 1 <= w <= MAX_SHARE_WEIGHT)
    if bad:
        raise ValueError(f"fair-share weights are 1 … {MAX_SHARE_WEIGHT}: {', '.join(bad)}")
    half_life = half_life_seconds()
    if half_life <= 0:
        return []
    now = now or timezone.now()
    now_s = now.timestamp()
    horizon = now - timedelta(seconds=half_life * HORIZON_HALF_LIVES)
    # Summed by the database, one row per owner: a pass reads as many rows as there are owners,
    # not the allocations of HORIZON_HALF_LIVES half-lives.
    now_v = Value(now_s, output_field=FloatField())
    end = Least(Coalesce(_EpochSeconds("released_at"), now_v), now_v)
    start = Least(_EpochSeconds("created_at"), end)
    used = Cast("shares", FloatField()) * decayed_seconds(start=start, end=end, now=now_v, half_life=half_life, exp=Exp)
    usage_by_user: dict[int, float] = dict(
        Allocation.objects.filter(Q(released_at__isnull=True) | Q(released_at__gt=horizon))
        .order_by()
        .values("session__owner_id")
        .annotate(usage=Sum(used, output_field=FloatField()))
        .values_list("session__owner_id", "usage")
    )
    pending_by_user: dict[int, int] = {}
    for owner_id in ComputeSession.objects.filter(status=SessionStatus.PENDING).values_list("owner_id", flat=True):
        pending_by_user[owner_id] = pending_by_user.get(owner_id, 0) + 1

    accounts: list[tuple[str, str, int, frozenset]] = []
    in_a_project: set[int] = set()
    for project in Project.objects.prefetch_related("members"):
        members = frozenset(user.pk for user in project.members.all())
        in_a_project |= members
        weight = (weights or {}).get(project.name, project.share_weight)
        accounts.append(("project", project.name, weight, members))
    alone = (set(usage_by_user) | set(pending_by_user)) - in_a_project
    for user_id, username in get_user_model().objects.filter(pk__in=alone).values_list("pk", "username"):
        accounts.append(("user", username, 1, frozenset([user_id])))

    standing = [
        (
            kind,
            name,
            weight,
            members,
            sum(usage_by_user.get(u, 0.0) for u in members),
            sum(pending_by_user.get(u, 0) for u in members),
        )
        for kind, name, weight, members in accounts
    ]
    active = [a for a in standing if a[4] > 0 or a[5] > 0]
    usage_total = sum(a[4] for a in active)
    weight_total = sum(a[2] for a in active)
    shares = [
        AccountShare(
            kind=kind,
            name=name,
            weight=weight,
            usage=usage,
            usage_share=usage / usage_total if usage_total else 0.0,
            weight_share=weight / weight_total,
            factor=fair_share_factor(usage=usage, usage_total=usage_total, weight=weight, weight_total=weight_total),
            pending=pending,
            members=members,
        )
        for kind, name, weight, members, usage, pending in active
    ]
    return sorted(shares, key=lambda a: (a.factor, a.kind, a.name))


def owner_factors(owner_ids, *, now: datetime | None = None, weights: dict[str, int] | None = None) -> dict[int, float]:
    """The fair-share factor of each of `owner_ids` (user ids): the best of their accounts'; 1.0
    for an owner with no active account. Empty when fair share is off. `weights`: as
    `account_shares`'."""
    shares = account_shares(now=now, weights=weights)
    if not shares:
        return {}
    factors: dict[int, float] = {}
    for account in shares:
        for user_id in account.members:
            factors[user_id] = max(factors.get(user_id, 0.0), account.factor)
    return {owner_id: factors.get(owner_id, 1.0) for owner_id in owner_ids}


def queue_key(session: ComputeSession, factors: dict[int, float]) -> tuple:
    """Where `session` stands in the queue: priority (higher first), then its owner's fair-share
    factor (higher first), then arrival. The one order the scheduler's pass and
    `sessions.scheduling.scheduler.pending_position` use."""
    return -session.priority, -factors.get(session.owner_id, 1.0), session.created_at, str(session.pk)
