"""What the usage pictures read (issue 15, part 4): the list's gauges (`GET /api/v1/usage/latest/`,
own sessions only, a silent agent is unknown not zero, constant queries), a node's devices'
history for its admin page (`GET /api/v1/nodes/<name>/usage/`, gaps as nulls), and the pages
that carry the charts. The database is real; the agents' batches go through `usage_ingest`."""
from __future__ import annotations

import time

import pytest

from accelerators.models import Node
from tests.conftest import GiB, client_for, mock_gpu
from tests.test_reconcile import agent  # noqa: F401 (fixture used by test_usage's `running`)
from tests.test_usage import NODE, batch, running, sample  # noqa: F401 (fixture)
from usage.services import usage_ingest

pytestmark = pytest.mark.django_db(transaction=True)


def latest(user, *sessions):
    return client_for(user).get("/api/v1/usage/latest/", {"session": [str(s.pk) for s in sessions]})


def test_the_lists_gauge_reads_each_sessions_newest_sample_of_the_last_minute_and_its_granted_memory(running):
    busy, silent = running(), running(shares="0.25")
    now = int(time.time())
    usage_ingest(node_name=NODE, batch=batch(sample(busy, now - 10, gpu_memory=GiB // 2, gpu_util=30),
                                             sample(busy, now - 5, gpu_memory=GiB, gpu_util=60),
                                             sample(silent, now - 120, gpu_memory=GiB)))

    response = latest(busy.owner, busy, silent)

    assert response.status_code == 200, response.content
    rows = {row["id"]: row for row in response.json()["sessions"]}
    assert rows[str(busy.pk)] == {"id": str(busy.pk), "t": now - 5, "gpu_memory": GiB, "gpu_util": 60,
                                  "gpu_memory_limit": 2 * GiB}  # 0.5 fGPU of a 4 GiB unit
    # Its agent sent nothing for two minutes: unknown, never a stale or zero figure.
    assert rows[str(silent.pk)] == {"id": str(silent.pk), "t": None, "gpu_memory": None, "gpu_util": None,
                                    "gpu_memory_limit": GiB}


def test_the_lists_gauge_shows_a_user_only_their_own_sessions_and_refuses_bad_ids(running, bob, staff):
    session = running()
    usage_ingest(node_name=NODE, batch=batch(sample(session, int(time.time()) - 5)))

    assert latest(bob, session).json() == {"sessions": []}
    assert [r["gpu_memory"] for r in latest(staff, session).json()["sessions"]] == [GiB]
    api = client_for(session.owner)
    assert api.get("/api/v1/usage/latest/").status_code == 400
    bad = api.get("/api/v1/usage/latest/", {"session": "not-a-uuid"})
    assert bad.status_code == 400 and "session" in bad.json()["field_errors"]
    assert api.get("/api/v1/usage/latest/", {"session": [str(session.pk)] * 201}).status_code == 400


@pytest.mark.parametrize("count", [1, 8])
def test_the_lists_gauges_cost_the_same_queries_for_1_or_8_sessions(running, count, django_assert_max_num_queries):
    sessions = [running(shares="0.25") for _ in range(count)]
    now = int(time.time())
    usage_ingest(node_name=NODE, batch=batch(*[sample(s, now - 5) for s in sessions]))

    api = client_for(sessions[0].owner)
    # The token with its user; the sessions with their granted memory; their samples of the last minute.
    with django_assert_max_num_queries(3):
        response = api.get("/api/v1/usage/latest/", {"session": [str(s.pk) for s in sessions]})

    assert len(response.json()["sessions"]) == count


def test_a_nodes_usage_charts_each_gpu_with_a_gap_where_its_agent_was_silent(demo_cluster, alice):
    now = int(time.time())
    uuid = mock_gpu(0).device_id
    devices = [{"device": uuid, "t": t, "memory_used": used, "memory_total": 8 * GiB, "util": util}
               for t, used, util in ((now - 100, GiB, 10), (now - 95, 2 * GiB, 20), (now - 90, 2 * GiB, 25),
                                     (now - 10, 3 * GiB, 70))]
    usage_ingest(node_name=NODE, batch=batch(devices=devices))

    response = client_for(alice).get(f"/api/v1/nodes/{NODE}/usage/", {"since": now - 200})

    assert response.status_code == 200, response.content
    (gpu,) = response.json()["devices"]
    assert (gpu["index"], gpu["uuid"], gpu["memory_size"]) == (0, uuid, 8 * GiB)
    assert gpu["t"] == [now - 100, now - 95, now - 90, now - 89, now - 10]
    assert gpu["memory_used"] == [GiB, 2 * GiB, 2 * GiB, None, 3 * GiB]
    assert gpu["util"] == [10, 20, 25, None, 70]


def test_a_nodes_usage_of_an_unknown_node_or_a_bad_range_is_refused(demo_cluster, alice):
    api = client_for(alice)
    assert api.get("/api/v1/nodes/no-such-node/usage/").status_code == 404
    assert api.get(f"/api/v1/nodes/{NODE}/usage/", {"since": 100, "until": 50}).status_code == 400


def test_the_session_page_and_the_node_admin_page_carry_the_charts_and_their_scripts(running, admin, client):
    session = running()
    client.force_login(session.owner)
    page = client.get(f"/sessions/{session.pk}/terminal/").content.decode()
    assert 'id="usage-charts"' in page and f"/api/v1/sessions/{session.pk}/usage/" in page
    assert "vendor/uplot/uPlot.iife.min.js" in page and "js/usage.js" in page

    client.force_login(admin)
    node = Node.objects.get(name=NODE)
    page = client.get(f"/admin/accelerators/node/{node.pk}/change/").content.decode()
    assert "node-usage-charts" in page and f"/api/v1/nodes/{NODE}/usage/" in page
    assert "vendor/uplot/uPlot.iife.min.js" in page and "js/usage.js" in page
