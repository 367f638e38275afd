"""When will a pending session start? (issue 17.3) and the scheduler's what-if (17.5): the pure
replay (accelerators.allocation.replay), the console's replay over the real placement
(sessions.scheduling.eta), GET /api/v1/sessions/<id>/eta/ and POST /api/v1/scheduler/what-if/."""
from __future__ import annotations

from django.db import connection
from django.test.utils import CaptureQueriesContext

import json
from datetime import timedelta

import pytest
from django.utils import timezone
from hypothesis import given, settings
from hypothesis import strategies as st

from accelerators.allocation import replay as pure
from sessions.scheduling import eta
from sessions.models import ComputeSession, Project, SessionStatus
from sessions.scheduling.scheduler import schedule_pending
from sessions.lifecycle.services import session_report_apply
from sessions.admission.launch import session_create
from tests.conftest import assert_error_shape, client_for
from tests.seed import make_cluster, mock_gpu

NOW = 1_000_000.0
MIN = 60.0


# --- the pure replay ------------------------------------------------------------------------------------

class Gpus:
    """A room of `total` whole GPUs: each key asks `sizes[key]` of them."""

    def __init__(self, total: int, sizes: dict[str, int], held: dict[str, int]):
        self.total, self.sizes, self.held = total, sizes, dict(held)

    def free(self) -> int:
        return self.total - sum(self.held.values())

    def place(self, key):
        want = self.sizes[key]
        if want > self.total:
            return pure.NEVER, f"{want} GPUs asked, {self.total} in all"
        if want > self.free():
            return pure.WAITING, f"{want} GPUs asked, {self.free()} free"
        self.held[key] = want
        return pure.PLACED, ""

    def release(self, key):
        self.held.pop(key, None)


def run(queue, *, total, held, ends, backfill=0):
    sizes = {q.key: q.size for q in queue} | {k: v for k, v in held.items()}
    room = Gpus(total, sizes, held)
    items = [pure.Queued(q.key, str(q.size), runtime=q.runtime) for q in queue]
    return pure.replay(items, ends=ends, room=room, now=NOW, backfill_limit=backfill).starts


class Q:
    def __init__(self, key, size, runtime):
        self.key, self.size, self.runtime = key, size, runtime


def test_a_session_that_fits_now_starts_now_and_one_too_large_never():
    starts = run([Q("small", 1, 60), Q("huge", 9, 60)], total=4, held={"r": 2}, ends={"r": NOW + 600})

    assert starts["small"] == pure.Start(NOW, pure.PLACED)
    assert starts["huge"].outcome == pure.NEVER and starts["huge"].at is None
    assert "9 GPUs asked, 4 in all" in starts["huge"].reason


def test_a_waiting_session_starts_when_the_holder_ends_and_the_next_when_it_ends_in_turn():
    starts = run([Q("a", 2, 30 * MIN), Q("b", 2, 30 * MIN)], total=2, held={"r": 2}, ends={"r": NOW + 10 * MIN})

    assert starts["a"].at == NOW + 10 * MIN
    assert starts["b"].at == NOW + 40 * MIN  # after a's own runtime


def test_no_known_end_leaves_it_waiting_with_the_reason():
    starts = run([Q("a", 2, 60)], total=2, held={"r": 2}, ends={"r": None})

    assert starts["a"] == pure.Start(None, pure.WAITING, "2 GPUs asked, 0 free")


def test_backfill_lets_a_small_one_pass_until_the_limit():
    queue = [Q("big", 2, 60), Q("s1", 1, 600), Q("s2", 1, 600)]
    free_one = {"r": 1}

    passing = run(queue, total=2, held=free_one, ends={"r": NOW + 60}, backfill=8)
    strict = run(queue, total=2, held=free_one, ends={"r": NOW + 60}, backfill=0)

    assert passing["s1"].at == NOW and passing["big"].at > NOW  # s1 backfilled past big
    assert strict["s1"].at >= strict["big"].at  # first in, first out


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=12),
       runtimes=st.lists(st.integers(1, 500), min_size=12, max_size=12),
       held=st.lists(st.tuples(st.integers(1, 2), st.one_of(st.none(), st.integers(0, 900))), max_size=3))
def test_in_first_in_first_out_order_the_start_never_comes_earlier_further_back_in_the_queue(sizes, runtimes, held):
    queue = [Q(f"q{i}", size, runtimes[i] * MIN) for i, size in enumerate(sizes)]
    holding = {f"r{i}": n for i, (n, _) in enumerate(held)}
    ends = {f"r{i}": None if end is None else NOW + end * MIN for i, (_, end) in enumerate(held)}

    starts = run(queue, total=6, held=holding, ends=ends, backfill=0)

    known = [starts[q.key].at for q in queue]
    reached = [t for t in known if t is not None]
    assert reached == sorted(reached)  # monotone in the queue position
    assert known[:len(reached)] == reached  # and once one cannot start, nothing behind it does
    assert all(t >= NOW for t in reached)


def test_a_band_runs_from_the_optimistic_start_to_the_pessimistic_one():
    assert pure.eta_band(pure.Start(NOW, pure.PLACED), pure.Start(NOW + 60, pure.PLACED)) == \
        pure.Band(NOW, NOW + 60, pure.PLACED)
    half = pure.eta_band(pure.Start(NOW, pure.PLACED), pure.Start(None, pure.WAITING, "no room"))
    assert (half.earliest, half.latest, half.outcome) == (NOW, None, pure.PLACED)
    assert pure.eta_band(pure.Start(None, pure.NEVER, "too big"), pure.Start(None, pure.NEVER, "too big")).outcome \
        == pure.NEVER


def test_the_remaining_runtime_comes_from_the_runs_that_lasted_as_long():
    history = [10 * MIN, 12 * MIN, 14 * MIN, 60 * MIN]

    fresh = pure.remaining_band(history, 0, low=0.0, high=1.0, minimum=3)
    later = pure.remaining_band(history, 13 * MIN, low=0.0, high=1.0, minimum=3)
    too_long = pure.remaining_band(history, 20 * MIN, low=0.0, high=1.0, minimum=3)

    assert fresh == (10 * MIN, 60 * MIN)
    assert later is None  # only two runs lasted 13 min: fewer than the minimum
    assert too_long is None
    assert pure.remaining_band(history, 11 * MIN, low=0.0, high=1.0, minimum=3) == (1 * MIN, 49 * MIN)


# --- the console's replay ---------------------------------------------------------------------------------

@pytest.fixture
def one_gpu(db):
    """Node n1 with one 8 GiB GPU (2 fGPU); nodes in no group: a maximum lifetime of 2 h."""
    from usage.models import IdlePolicy

    make_cluster(nodes={"n1": [mock_gpu(0)]})
    IdlePolicy.objects.create(resource_group=None, max_lifetime=7200)


WHOLE = {"cuda.shares": "2", "mem": "64M"}


def running(owner, *, name="holder", minutes_ago: float, command: str = "", resources=WHOLE) -> ComputeSession:
    """A session of `owner` placed and RUNNING (as its agent reports), started `minutes_ago`."""
    session = session_create(owner=owner, name=name, resources=resources, command=command)
    assert str(session.pk) in schedule_pending()
    session_report_apply(session_id=str(session.pk), status=SessionStatus.RUNNING)
    ComputeSession.objects.filter(pk=session.pk).update(started_at=timezone.now() - timedelta(minutes=minutes_ago))
    return ComputeSession.objects.get(pk=session.pk)


def waiting(owner, name, resources=WHOLE, command: str = "") -> ComputeSession:
    session = session_create(owner=owner, name=name, resources=resources, command=command)
    schedule_pending()
    session.refresh_from_db()
    assert session.status == SessionStatus.PENDING
    return session


def close(a, b, seconds: float = 5.0) -> bool:
    return abs((a - b).total_seconds()) <= seconds


def test_a_pending_session_that_fits_now_gets_now(one_gpu, alice):
    session = session_create(owner=alice, name="fits", resources={"cuda.shares": "1", "mem": "64M"})

    answer = eta.session_eta(session=session)

    assert answer.outcome == "now" and answer.fits_now
    assert answer.earliest == answer.latest == answer.computed_at
    assert answer.position == 1 and answer.fits_after == ()


def test_behind_a_running_session_the_eta_is_its_lifetime_end_and_the_next_one_waits_a_lifetime_more(
        one_gpu, alice, bob, django_user_model):
    holder = running(bob, minutes_ago=30)
    first = waiting(alice, "first")
    second = waiting(django_user_model.objects.create_user("carol"), "second")

    a, b = eta.session_eta(session=first), eta.session_eta(session=second)

    end = holder.started_at + timedelta(hours=2)
    assert a.outcome == "estimate" and close(a.earliest, end) and close(a.latest, end)
    assert b.outcome == "estimate" and close(b.earliest, end + timedelta(hours=2))  # after first's own lifetime
    assert (a.position, b.position) == (1, 2)
    assert "waiting for capacity" in a.waiting_reason
    assert [(f.session.pk, f.node, f.end.basis) for f in a.fits_after] == [(holder.pk, "n1", "maximum lifetime of 2 h")]
    assert not a.fits_now


def test_a_session_no_node_could_ever_hold_gets_never_with_the_reason(one_gpu, alice):
    from accelerators.allocation.requests import parse_resources, request_to_spec

    # Launched when the node had two GPUs (the launch refuses it now): 4 fGPU on one node of 2.
    spec = request_to_spec(parse_resources({"cuda.shares": "4", "mem": "64M"}))
    session = ComputeSession.objects.create(owner=alice, name="huge", resources={"cuda.shares": "4"},
                                            request_spec=spec, slot_name="cuda", slot_subtype="shares", amount=4)

    answer = eta.session_eta(session=session)

    assert answer.outcome == "never"
    assert "4 fGPU requested, but the largest any node can hold is 2.00 fGPU" in answer.reason
    assert answer.earliest is None and answer.latest is None


def test_a_batch_session_is_expected_to_end_as_its_owners_earlier_batch_sessions_did(db, alice, bob):
    make_cluster(nodes={"n1": [mock_gpu(0)]})  # no idle policy: no lifetime
    now = timezone.now()
    for minutes in (10, 12, 14):  # alice's earlier runs of the same job
        ComputeSession.objects.create(owner=alice, name="past", command="python train.py", resources={},
                                      status=SessionStatus.TERMINATED, exit_code=0,
                                      started_at=now - timedelta(days=1, minutes=minutes),
                                      terminated_at=now - timedelta(days=1))
    holder = running(alice, minutes_ago=2, command="python train.py")
    mine = waiting(bob, "next")

    answer = eta.session_eta(session=mine)

    assert answer.outcome == "estimate"
    # 5th and 95th percentile of 10, 12, 14 min (10.2, 13.8) from its start, 2 min ago.
    assert pure.HISTORY_BAND == (0.05, 0.95)
    assert close(answer.earliest, holder.started_at + timedelta(minutes=10.2), 10)
    assert close(answer.latest, holder.started_at + timedelta(minutes=13.8), 10)
    assert answer.fits_after[0].end.basis.startswith("batch history")


def test_behind_a_session_with_no_declared_end_the_eta_is_unknown_and_says_why(db, alice, bob):
    make_cluster(nodes={"n1": [mock_gpu(0)]})
    running(bob, minutes_ago=5)  # interactive, no idle policy: no known end
    mine = waiting(alice, "mine")

    answer = eta.session_eta(session=mine)

    assert answer.outcome == "unknown"
    assert "no declared end" in answer.reason
    assert [f.end.basis.startswith("no declared end") for f in answer.fits_after] == [True]


def test_the_eta_grows_with_the_queue_position(one_gpu, alice, bob):
    running(bob, minutes_ago=0)
    queued = [waiting(alice, f"q{i}", resources={"cuda.shares": "1", "mem": "64M"}) for i in range(5)]

    answers = [eta.session_eta(session=s) for s in queued]

    assert [a.position for a in answers] == [1, 2, 3, 4, 5]
    earliest = [a.earliest for a in answers]
    assert earliest == sorted(earliest) and earliest[0] < earliest[-1]


# --- the API ------------------------------------------------------------------------------------------

def test_the_eta_api_answers_its_shape_and_hides_another_users_session(one_gpu, alice, bob):
    running(bob, minutes_ago=30)
    mine = waiting(alice, "mine")

    answer = client_for(alice).get(f"/api/v1/sessions/{mine.pk}/eta/")

    assert answer.status_code == 200
    body = answer.json()
    assert set(body) == {"session", "outcome", "earliest", "latest", "reason", "position", "waiting_reason",
                         "fits_now", "fits_after", "computed_at", "mig_now"}
    assert body["outcome"] == "estimate" and body["position"] == 1
    assert body["fits_after"] == [{"session": None, "name": None, "owner": None, "node": "n1",
                                   "ends_earliest": body["earliest"], "ends_latest": body["latest"],
                                   "basis": "maximum lifetime of 2 h"}]


def test_the_eta_api_shows_administrators_who_holds_the_room(one_gpu, alice, bob, staff):
    holder = running(bob, minutes_ago=30)
    mine = waiting(alice, "mine")

    body = client_for(staff).get(f"/api/v1/sessions/{mine.pk}/eta/").json()

    assert [(r["session"], r["name"], r["owner"]) for r in body["fits_after"]] == [(str(holder.pk), "holder", "bob")]


def test_the_eta_of_another_users_session_is_a_404_and_of_a_running_one_a_409(one_gpu, alice, bob):
    holder = running(bob, minutes_ago=30)
    mine = waiting(alice, "mine")

    other = client_for(bob).get(f"/api/v1/sessions/{mine.pk}/eta/")
    started = client_for(bob).get(f"/api/v1/sessions/{holder.pk}/eta/")

    assert other.status_code == 404
    assert assert_error_shape(started, 409)["type"] == "not-pending"


# --- what-if ------------------------------------------------------------------------------------------

@pytest.fixture
def two_teams(one_gpu, alice, bob, django_user_model):
    """vision (alice) used 2 fGPU for two days, nlp (bob) for one; carol holds the GPU for another
    hour; alice's session waits, then bob's."""
    from tests.test_fairshare import used

    Project.objects.create(name="vision").members.add(alice)
    Project.objects.create(name="nlp").members.add(bob)
    used(alice, fgpu="2", hours=48, ended_days_ago=1)
    used(bob, fgpu="2", hours=24, ended_days_ago=1)
    running(django_user_model.objects.create_user("carol"), minutes_ago=60)
    return waiting(alice, "alices"), waiting(bob, "bobs")


def test_what_if_a_projects_weight_grows_its_session_starts_sooner_and_the_others_later(two_teams, staff):
    alices, bobs = two_teams

    answer = client_for(staff).post("/api/v1/scheduler/what-if/", {"share_weights": {"vision": 4}}, format="json")

    assert answer.status_code == 200, answer.content
    rows = {r["name"]: r for r in answer.json()["sessions"]}
    # today nlp used less: bob's goes first, at carol's end; vision at weight 4 is under its share
    assert (rows["bobs"]["position_today"], rows["alices"]["position_today"]) == (1, 2)
    assert (rows["alices"]["position_what_if"], rows["bobs"]["position_what_if"]) == (1, 2)
    assert rows["alices"]["change"] == "sooner" and rows["bobs"]["change"] == "later"
    assert rows["alices"]["what_if"]["earliest"] == rows["bobs"]["today"]["earliest"]
    assert rows["alices"]["today"]["earliest"] > rows["alices"]["what_if"]["earliest"]
    assert answer.json()["changes"] == {"share_weights": {"vision": 4}}
    assert Project.objects.get(name="vision").share_weight == 1  # nothing saved


def test_what_if_refuses_bad_bodies_with_the_problem_shape(two_teams, staff, alice):
    admin_client = client_for(staff)
    cases = [({}, "say what to change"), ({"share_weights": {"nope": 2}}, "no project 'nope'"),
             ({"share_weights": {"vision": 0}}, ""), ({"policies": {"": "fastest"}}, "not a valid choice"),
             ({"policies": {"gpu-a": "spread"}}, "no resource group 'gpu-a'"), ({"backfill_limit": -1}, "")]
    for body, words in cases:
        answer = admin_client.post("/api/v1/scheduler/what-if/", body, format="json")
        assert words in json.dumps(assert_error_shape(answer, 400)), body
    assert client_for(alice).post("/api/v1/scheduler/what-if/", {"backfill_limit": 0}, format="json").status_code == 403


def test_what_if_the_backfill_limit_were_zero_the_small_session_waits_for_the_big_one(one_gpu, alice, bob, staff):
    running(bob, minutes_ago=60, resources={"cuda.shares": "1", "mem": "64M"})  # half the GPU, an hour left
    big = waiting(alice, "big")  # the whole GPU
    small = session_create(owner=alice, name="small", resources={"cuda.shares": "1", "mem": "64M"})

    rows = {r.session.name: r for r in eta.scheduler_what_if(backfill_limit=0).rows}

    assert rows["small"].today.earliest < rows["big"].today.earliest  # backfilled past big, now
    # strict order: small waits for big, which no longer waits for small's room
    assert rows["small"].change == "later" and rows["big"].change == "sooner"
    assert rows["small"].what_if.earliest >= rows["big"].what_if.earliest
    assert ComputeSession.objects.get(pk=small.pk).status == SessionStatus.PENDING and big.status == "PENDING"


def test_a_session_arriving_later_joins_the_queue_in_its_place():
    items = [pure.Queued("first", "2", runtime=10 * MIN), pure.Queued("late", "1", runtime=MIN, arrives=NOW + 5 * MIN),
             pure.Queued("second", "2", runtime=MIN)]
    room = Gpus(2, {"first": 2, "late": 1, "second": 2}, {})

    starts = pure.replay(items, ends={}, room=room, now=NOW, backfill_limit=0).starts

    assert starts["first"].at == NOW
    # at first's end the late one (arrived meanwhile, ahead of second in the queue's order) goes first
    assert starts["late"].at == NOW + 10 * MIN and starts["second"].at == NOW + 11 * MIN


def test_the_calibration_benchmark_runs_on_a_slice_of_the_trace(capsys):
    from benchmarks import eta as bench
    from benchmarks import openb

    if not (openb.TRACE_DIR / "openb_pod_list_default.csv").exists():
        pytest.skip("the openb trace is not here (FGPU_OPENB_DIR)")
    assert bench.main(["--days", "1", "--warmup-days", "0.25", "--predictions", "5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)

    assert result["gpus"] == 8 and result["pods"] > 100
    assert result["waited"] > 0 and result["estimates"] == min(5, result["waited"])
    assert sum(result["counts"].values()) == result["estimates"]
    assert result["history_band"] == list(pure.HISTORY_BAND)


def test_what_if_the_nodes_spread_sessions_a_whole_gpu_request_waits_where_packing_fits_it_now(db, alice, staff):
    from usage.models import IdlePolicy

    make_cluster(nodes={"n1": [mock_gpu(0)], "n2": [mock_gpu(0, node=1)]})
    IdlePolicy.objects.create(resource_group=None, max_lifetime=7200)
    half = {"cuda.shares": "1", "mem": "64M"}
    for name in ("a", "b"):
        session_create(owner=alice, name=name, resources=half)
    whole = session_create(owner=alice, name="whole", resources=WHOLE)

    answer = client_for(staff).post("/api/v1/scheduler/what-if/", {"policies": {"": "spread"}}, format="json")

    rows = {r["name"]: r for r in answer.json()["sessions"]}
    assert rows["whole"]["today"]["outcome"] == "now"  # a and b share one GPU: the other is whole
    assert rows["whole"]["what_if"]["outcome"] == "estimate" and rows["whole"]["change"] == "later"
    assert rows["a"]["change"] == rows["b"]["change"] == "same"
    assert ComputeSession.objects.get(pk=whole.pk).status == SessionStatus.PENDING


def test_what_would_make_room_is_the_session_ending_first_not_every_one_on_the_node(one_gpu, alice, bob):
    half = {"cuda.shares": "1", "mem": "64M"}
    soon = running(bob, name="soon", minutes_ago=90, resources=half)  # its 2 h lifetime ends in 30 min
    running(bob, name="later", minutes_ago=10, resources=half)
    mine = waiting(alice, "mine", resources=half)

    answer = eta.session_eta(session=mine)

    assert [f.session.pk for f in answer.fits_after] == [soon.pk]
    assert close(answer.earliest, soon.started_at + timedelta(hours=2))


def test_etas_share_one_read_of_the_queue_until_a_session_changes(one_gpu, alice, bob, django_assert_max_num_queries):
    running(bob, minutes_ago=30)
    first, second = waiting(alice, "first"), waiting(alice, "second")
    eta.session_eta(session=first)

    with CaptureQueriesContext(connection) as queries:
        again = eta.session_eta(session=second)
    assert again.position == 2
    sessions_read = [q["sql"] for q in queries.captured_queries if "compute_sessions_" in q["sql"]]
    assert len(sessions_read) == 1 and "COUNT(" in sessions_read[0]  # the stamp; no read of the queue again

    third = waiting(bob, "third")  # a change: the next ETA reads the queue again and sees it
    assert eta.session_eta(session=third).position == 3
