"""What if, for administrators (issue 32.4): every number in the what-if has bounds, an unknown
key is a 400 naming it, and a drain answers which sessions would wait longer and which running
ones would move, where and when."""
from __future__ import annotations

import json

from accelerators.allocation import replay as pure
from sessions.scheduling import eta
from sessions.scheduling import fairshare
from sessions.models import ComputeSession, SessionStatus
from tests.conftest import assert_error_shape, client_for
from tests.seed import make_cluster, mock_gpu
from tests.test_eta import WHOLE, one_gpu, running, two_teams, waiting  # noqa: F401 (fixtures)

WHAT_IF = "/api/v1/scheduler/what-if/"


def post_raw(client, body: str):
    return client.post(WHAT_IF, body, content_type="application/json")


def test_a_weight_of_ten_to_the_four_hundredth_is_a_400_not_a_500(two_teams, staff):  # noqa: F811
    admin = client_for(staff)

    huge = post_raw(admin, '{"share_weights": {"vision": 1' + "0" * 400 + "}}")
    largest = admin.post(WHAT_IF, {"share_weights": {"vision": fairshare.MAX_SHARE_WEIGHT}}, format="json")
    over = admin.post(WHAT_IF, {"share_weights": {"vision": fairshare.MAX_SHARE_WEIGHT + 1}}, format="json")
    limit = admin.post(WHAT_IF, {"backfill_limit": 10**400}, format="json")

    assert "share_weights.vision" in assert_error_shape(huge, 400)["field_errors"]
    assert largest.status_code == 200, largest.content
    assert "share_weights.vision" in assert_error_shape(over, 400)["field_errors"]
    assert "backfill_limit" in assert_error_shape(limit, 400)["field_errors"]


def test_unknown_keys_are_a_400_naming_them(two_teams, staff):  # noqa: F811
    answer = client_for(staff).post(WHAT_IF, {"backfill_limit": 0, "weights": {"vision": 2}, "dran": ["n1"]}, format="json")

    body = assert_error_shape(answer, 400)
    assert {"weights", "dran"} <= set(body["field_errors"])
    assert "dran" in json.dumps(body) and "weights" in json.dumps(body)


def test_the_fair_share_factor_refuses_a_weight_out_of_bounds():
    for weight in (0, fairshare.MAX_SHARE_WEIGHT + 1, 10.0**300):
        try:
            fairshare.fair_share_factor(usage=1.0, usage_total=2.0, weight=weight, weight_total=weight)
        except ValueError as exc:
            assert "fair-share weight" in str(exc)
        else:
            raise AssertionError(weight)


def test_draining_a_node_moves_its_sessions_to_the_other_and_the_waiting_one_waits_longer(db, bob, staff):
    from usage.models import IdlePolicy

    make_cluster(nodes={"n1": [mock_gpu(0)], "n2": [mock_gpu(0, node=1)]})
    IdlePolicy.objects.create(resource_group=None, max_lifetime=7200)
    on_n1 = running(bob, name="on-n1", minutes_ago=30)
    on_n2 = running(bob, name="on-n2", minutes_ago=60)
    assert {on_n1.node.name, on_n2.node.name} == {"n1", "n2"}
    drained = on_n1.node.name
    later = waiting(bob, "later")  # one owner: the queue is in arrival order (no fair share between them)

    answer = client_for(staff).post(WHAT_IF, {"drain": [drained]}, format="json")

    assert answer.status_code == 200, answer.content
    body = answer.json()
    row = {r["name"]: r for r in body["sessions"]}["later"]
    assert row["change"] == "later"  # one node fewer: it waits for the moved session too
    (move,) = body["moves"]
    assert move["name"] == "on-n1" and move["from_node"] == drained
    assert move["what_if"]["outcome"] == "estimate"
    other = on_n2.node.name
    assert move["to_node_earliest"] == move["to_node_latest"] == other
    # requeued by arrival (on-n1 was launched before later): it starts at on-n2's end, later after it
    assert move["what_if"]["earliest"] == row["today"]["earliest"]
    assert row["what_if"]["earliest"] > move["what_if"]["earliest"]
    assert body["changes"] == {"drain": [drained]}
    assert ComputeSession.objects.get(pk=on_n1.pk).status == SessionStatus.RUNNING  # nothing changed
    assert ComputeSession.objects.get(pk=later.pk).status == SessionStatus.PENDING


def test_a_drain_of_an_unknown_node_is_a_400_naming_it(db, staff):
    make_cluster(nodes={"n1": [mock_gpu(0)]})

    answer = client_for(staff).post(WHAT_IF, {"drain": ["n1", "n9"]}, format="json")

    assert "no node 'n9'" in json.dumps(assert_error_shape(answer, 400))


def test_draining_every_node_a_waiting_session_could_use_leaves_it_no_start(db, alice, bob):
    make_cluster(nodes={"n1": [mock_gpu(0)]})
    running(bob, minutes_ago=5)
    waiting(alice, "stuck", resources=WHOLE)

    answer = eta.scheduler_what_if(drain=frozenset({"n1"}))

    (row,) = answer.rows
    assert row.what_if.outcome in (pure.NEVER, pure.WAITING) and row.what_if.earliest is None
    assert [m.session.name for m in answer.moves] == ["holder"]
