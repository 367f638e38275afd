"""Fair share over time (issue 17.1): decayed usage per project (and per user in no project),
weights, the factor 2^(-U/S), the queue ordered by priority, then factor, then arrival, and
GET /api/v1/fairshare/."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from hypothesis import given, settings
from hypothesis import strategies as st

from accelerators.models import Device
from sessions.scheduling import fairshare
from sessions.models import Allocation, ComputeSession, Project, SessionStatus
from sessions.scheduling.scheduler import pending_position, schedule_pending
from sessions.admission.launch import session_create
from tests.conftest import client_for
from tests.seed import make_cluster, mock_gpu

DAY = 86400.0


# --- the pure rules ---------------------------------------------------------------------------------

def test_an_hour_one_half_life_old_counts_half_and_two_half_lives_a_quarter():
    now = 100 * DAY
    fresh = fairshare.decayed_seconds(start=now - 3600, end=now, now=now, half_life=7 * DAY)
    week_old = fairshare.decayed_seconds(start=now - 7 * DAY - 3600, end=now - 7 * DAY, now=now, half_life=7 * DAY)
    fortnight = fairshare.decayed_seconds(start=now - 14 * DAY - 3600, end=now - 14 * DAY, now=now, half_life=7 * DAY)

    assert fresh == pytest.approx(3600, rel=5e-3)  # the hour itself ages a little: 0.2 % on average
    assert week_old / fresh == pytest.approx(0.5, rel=1e-9)
    assert fortnight / fresh == pytest.approx(0.25, rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(start=st.floats(0, 50 * DAY), length=st.floats(0, 20 * DAY), split=st.floats(0, 1),
       half_life=st.floats(0.5 * DAY, 30 * DAY))
def test_decayed_seconds_add_up_over_a_split_interval_and_never_exceed_the_seconds(start, length, split, half_life):
    now, end, middle = 80 * DAY, start + length, start + length * split
    whole = fairshare.decayed_seconds(start=start, end=end, now=now, half_life=half_life)
    parts = (fairshare.decayed_seconds(start=start, end=middle, now=now, half_life=half_life)
             + fairshare.decayed_seconds(start=middle, end=end, now=now, half_life=half_life))

    assert whole == pytest.approx(parts, rel=1e-9, abs=1e-6)
    assert 0 <= whole <= length + 1e-6


def test_the_factor_is_one_without_usage_a_half_at_the_share_and_lower_past_it():
    assert fairshare.fair_share_factor(usage=0, usage_total=0, weight=1, weight_total=2) == 1.0
    assert fairshare.fair_share_factor(usage=5, usage_total=10, weight=1, weight_total=2) == pytest.approx(0.5)
    assert fairshare.fair_share_factor(usage=9, usage_total=10, weight=1, weight_total=2) == pytest.approx(2 ** -1.8)
    assert fairshare.fair_share_factor(usage=0, usage_total=10, weight=1, weight_total=2) == 1.0
    # the same usage weighs less against a larger weight
    heavy = fairshare.fair_share_factor(usage=5, usage_total=10, weight=2, weight_total=3)
    light = fairshare.fair_share_factor(usage=5, usage_total=10, weight=1, weight_total=3)
    assert heavy > light and heavy == pytest.approx(2 ** -(0.5 / (2 / 3)))


# --- with the database --------------------------------------------------------------------------------

pytestmark_db = pytest.mark.django_db


@pytest.fixture
def teams(django_user_model):
    """Projects vision (alice) and nlp (bob), and carol in no project, on a node with one 8 GiB GPU
    (2 fGPU at unit_mem 4 GiB)."""
    make_cluster(nodes={"n1": [mock_gpu(0)]})
    alice, bob, carol = (django_user_model.objects.create_user(name) for name in ("alice", "bob", "carol"))
    Project.objects.create(name="vision").members.add(alice)
    Project.objects.create(name="nlp").members.add(bob)
    return alice, bob, carol


def used(owner, *, fgpu: str, hours: float, ended_days_ago: float) -> None:
    """A session of `owner` that held `fgpu` for `hours`, released `ended_days_ago` days ago."""
    from accelerators.models import Device

    session = ComputeSession.objects.create(owner=owner, name="past", resources={}, request_spec={},
                                            status=SessionStatus.TERMINATED)
    end = timezone.now() - timedelta(days=ended_days_ago)
    allocation = Allocation.objects.create(session=session, device=Device.objects.first(), shares=fgpu,
                                           memory=1 << 30, procs=1, released_at=end)
    Allocation.objects.filter(pk=allocation.pk).update(created_at=end - timedelta(hours=hours))


@pytestmark_db
def test_accounts_carry_their_members_decayed_usage_and_weights(teams):
    alice, bob, carol = teams
    used(alice, fgpu="2", hours=10, ended_days_ago=7)  # 20 fGPU-hours a half-life ago: about 10 now
    used(bob, fgpu="1", hours=10, ended_days_ago=0)  # 10 fGPU-hours just now
    Project.objects.filter(name="nlp").update(share_weight=3)

    shares = {a.name: a for a in fairshare.account_shares()}

    assert set(shares) == {"vision", "nlp"}  # carol used nothing and waits for nothing: inactive
    assert shares["vision"].usage / 3600 == pytest.approx(10.0, rel=0.05)  # (the ten hours age too)
    assert shares["nlp"].usage / 3600 == pytest.approx(10.0, rel=0.05)
    assert (shares["vision"].weight_share, shares["nlp"].weight_share) == (0.25, 0.75)
    assert shares["vision"].factor == pytest.approx(2 ** -(0.5 / 0.25), rel=0.03)
    assert shares["nlp"].factor == pytest.approx(2 ** -(0.5 / 0.75), rel=0.03)


@pytestmark_db
def test_the_database_sums_each_owners_allocations_as_the_formula_does(teams):
    alice, bob, _ = teams
    used(alice, fgpu="2", hours=10, ended_days_ago=7)
    used(alice, fgpu="0.25", hours=3, ended_days_ago=2)
    used(bob, fgpu="1", hours=1, ended_days_ago=200)  # beyond HORIZON_HALF_LIVES half-lives: left out
    running = ComputeSession.objects.create(owner=bob, name="now", resources={}, request_spec={},
                                            status=SessionStatus.RUNNING)
    live = Allocation.objects.create(session=running, device=Device.objects.first(), shares="0.5", memory=1 << 30, procs=1)
    Allocation.objects.filter(pk=live.pk).update(created_at=timezone.now() - timedelta(hours=5))
    now = timezone.now()

    shares = {a.name: a for a in fairshare.account_shares(now=now)}

    def expected(owner) -> float:
        total = 0.0
        for a in Allocation.objects.filter(session__owner=owner):
            end = min((a.released_at or now).timestamp(), now.timestamp())
            if now.timestamp() - end > fairshare.half_life_seconds() * fairshare.HORIZON_HALF_LIVES:
                continue
            total += float(a.shares) * fairshare.decayed_seconds(start=min(a.created_at.timestamp(), end), end=end,
                                                                 now=now.timestamp(), half_life=7 * DAY)
        return total

    assert shares["vision"].usage == pytest.approx(expected(alice), rel=1e-9)
    assert shares["nlp"].usage == pytest.approx(expected(bob), rel=1e-9)
    assert expected(bob) == pytest.approx(0.5 * fairshare.decayed_seconds(start=now.timestamp() - 5 * 3600,
                                                                          end=now.timestamp(), now=now.timestamp(),
                                                                          half_life=7 * DAY), rel=1e-6)


@pytestmark_db
def test_the_team_that_used_less_starts_first_though_it_asked_later(teams, django_capture_on_commit_callbacks):
    alice, bob, _ = teams
    used(alice, fgpu="2", hours=48, ended_days_ago=1)  # vision used the GPU for two days; nlp never
    first = session_create(owner=alice, name="alices", resources={"cuda.shares": "2", "mem": "64M"})
    later = session_create(owner=bob, name="bobs", resources={"cuda.shares": "2", "mem": "64M"})
    assert (pending_position(later), pending_position(first)) == (1, 2)

    schedule_pending()

    first.refresh_from_db()
    later.refresh_from_db()
    assert later.status == SessionStatus.SCHEDULED
    assert first.status == SessionStatus.PENDING, first.status_reason


@pytestmark_db
def test_priority_comes_before_fair_share_and_arrival_decides_between_equals(teams):
    alice, bob, carol = teams
    used(alice, fgpu="2", hours=48, ended_days_ago=1)
    urgent = session_create(owner=alice, name="urgent", resources={"cuda.shares": "2", "mem": "64M"})
    ComputeSession.objects.filter(pk=urgent.pk).update(priority=5)  # as an administrator may
    urgent.refresh_from_db()
    bobs = session_create(owner=bob, name="bobs", resources={"cuda.shares": "2", "mem": "64M"})
    carols = session_create(owner=carol, name="carols", resources={"cuda.shares": "2", "mem": "64M"})

    assert [pending_position(s) for s in (urgent, bobs, carols)] == [1, 2, 3]  # bob and carol: factor 1, arrival


@pytestmark_db
def test_a_user_in_two_projects_gets_the_best_factor_of_the_two(teams):
    """Alice's usage counts in both her projects, vision (weight 1) and a large one, big (weight 4):
    her sessions take big's factor, the better one, and start before bob's, who used as much in
    nlp (weight 1) and asked first. The worse of the two (or vision's, the first she joined)
    would tie her with bob, and arrival would put bob first."""
    alice, bob, _ = teams
    Project.objects.create(name="big", share_weight=4).members.add(alice)
    used(alice, fgpu="1", hours=10, ended_days_ago=0)
    used(bob, fgpu="1", hours=10, ended_days_ago=0)
    bobs = session_create(owner=bob, name="bobs", resources={"cuda.shares": "2", "mem": "64M"})
    alices = session_create(owner=alice, name="alices", resources={"cuda.shares": "2", "mem": "64M"})

    now = timezone.now()
    shares = {a.name: a.factor for a in fairshare.account_shares(now=now)}
    factors = fairshare.owner_factors([alice.pk, bob.pk], now=now)

    # three accounts used a third each: vision and nlp against a 1/6 weight share, big against 4/6
    assert shares == pytest.approx({"vision": 2**-2, "nlp": 2**-2, "big": 2**-0.5}, rel=1e-3)
    assert factors == {alice.pk: shares["big"], bob.pk: shares["nlp"]}
    assert (pending_position(alices), pending_position(bobs)) == (1, 2)


@pytestmark_db
def test_with_fair_share_off_the_queue_is_first_in_first_out(teams, settings):
    settings.FGPU_FAIRSHARE_HALF_LIFE_DAYS = 0
    alice, bob, _ = teams
    used(alice, fgpu="2", hours=48, ended_days_ago=1)
    first = session_create(owner=alice, name="alices", resources={"cuda.shares": "2", "mem": "64M"})
    later = session_create(owner=bob, name="bobs", resources={"cuda.shares": "2", "mem": "64M"})

    schedule_pending()

    assert ComputeSession.objects.get(pk=first.pk).status == SessionStatus.SCHEDULED
    assert fairshare.account_shares() == []
    assert pending_position(ComputeSession.objects.get(pk=later.pk)) == 1


@pytestmark_db
def test_the_api_shows_administrators_every_account_and_users_their_own(teams, admin):
    alice, bob, _ = teams
    used(alice, fgpu="1", hours=4, ended_days_ago=0)
    session_create(owner=bob, name="bobs", resources={"cuda.shares": "0.25", "mem": "64M"})

    every = client_for(admin).get("/api/v1/fairshare/")
    own = client_for(bob).get("/api/v1/fairshare/")

    assert every.status_code == own.status_code == 200
    body = every.json()
    assert body["half_life_days"] == 7
    assert [(a["name"], a["pending"]) for a in body["accounts"]] == [("vision", 0), ("nlp", 1)]  # lowest factor first
    vision = body["accounts"][0]
    assert vision["usage_fgpu_hours"] == pytest.approx(4.0, rel=0.01) and vision["usage_share"] == 1.0
    assert vision["factor"] == pytest.approx(2 ** -2, rel=0.01) and body["accounts"][1]["factor"] == 1.0
    assert [a["name"] for a in own.json()["accounts"]] == ["nlp"]
    assert client_for(None).get("/api/v1/fairshare/").status_code == 401


@pytestmark_db
def test_the_project_list_of_the_admin_shows_each_projects_standing(teams, admin):
    alice, _, _ = teams
    used(alice, fgpu="1", hours=4, ended_days_ago=0)
    client = Client()
    client.force_login(admin)

    page = client.get("/admin/compute_sessions/project/").content.decode()

    assert "factor 0.500 · 100 % used of a 100 % share" in page  # vision, the only active account
    assert "inactive (no usage, nothing waiting)" in page  # nlp
