"""Storage use shown (issue 31, item 6): the `storage` figure and the limit that an agent's usage
samples carry (agent.storage measures, agent.usage sends) are stored with the sample and answered
by the session's usage API whatever the range; the data folders' figures (`~/data`, each project's
`~/projects/<name>`) are kept per node, newest first, and shown in "My resources"; what does not
belong to a sample's session (another user's project) is not kept, and a malformed figure is
refused by name, never raised. `fgpu describe` prints the session's storage against its limit.
The database is real; the agent side is in tests/test_usage_agent.py, end to end in
tests/test_usage_e2e.py."""
from __future__ import annotations

import json
import re
import time

import pytest

from sessions.models import Project
from tests.conftest import GiB, client_for
from tests.test_cli import SID, cli, session as api_session
from tests.test_cli import api  # noqa: F401 (fixture: the tiny API server)
from tests.test_reconcile import agent  # noqa: F401 (fixture: the node's agent, a recording stand-in)
from tests.test_usage import NODE, batch, running, sample  # noqa: F401 (fixture)
from usage.models import FolderUse, SessionSample
from usage.services import usage_ingest

pytestmark = pytest.mark.django_db(transaction=True)
MiB = 1 << 20


def stored(session, t: int, *, storage, limit=10 * GiB, folders=None) -> dict:
    row = {**sample(session, t), "storage": storage, "storage_limit": limit}
    if folders is not None:
        row["folders"] = folders
    return row


def test_a_samples_storage_and_its_limit_are_stored_and_the_usage_api_answers_the_newest_whatever_the_range(running):
    session = running()
    now = int(time.time())
    result = usage_ingest(node_name=NODE, batch=batch(
        sample(session, now - 30),  # before the agent's first measure: no figure
        stored(session, now - 20, storage=1288 * MiB),
        stored(session, now - 10, storage=1300 * MiB),
        sample(session, now - 5),  # a sample from an agent that sends no storage
    ))

    assert result.stored == 4 and not result.refused
    assert list(SessionSample.objects.filter(session=session).order_by("t").values_list("storage", "storage_limit")) == [
        (None, None), (1288 * MiB, 10 * GiB), (1300 * MiB, 10 * GiB), (None, None)]
    answer = client_for(session.owner).get(f"/api/v1/sessions/{session.pk}/usage/").json()
    assert (answer["storage"], answer["storage_limit"], answer["storage_t"]) == (1300 * MiB, 10 * GiB, now - 10)
    # A range that holds none of those samples still says what the session stores now.
    early = client_for(session.owner).get(f"/api/v1/sessions/{session.pk}/usage/",
                                          {"since": now - 7200, "until": now - 3600}).json()
    assert early["t"] == [] and early["storage"] == 1300 * MiB


def test_a_session_never_measured_answers_null_storage(running):
    session = running()
    usage_ingest(node_name=NODE, batch=batch(sample(session, int(time.time()) - 5)))

    answer = client_for(session.owner).get(f"/api/v1/sessions/{session.pk}/usage/").json()

    assert (answer["storage"], answer["storage_limit"], answer["storage_t"]) == (None, None, None)


@pytest.mark.parametrize("bad", [
    {"storage": -1}, {"storage": "1G"}, {"storage_limit": True}, {"folders": "~/data"},
    {"folders": [{"folder": "/etc", "used": 1, "limit": 2}]}, {"folders": [{"folder": "~/data", "used": -1, "limit": 2}]},
    {"folders": [{"folder": "~/data", "used": 1}]}, {"folders": [["~/data", 1, 2]]},
    {"folders": [{"folder": "~/data", "used": 1, "limit": 2}] * 65},
])
def test_a_malformed_storage_figure_refuses_its_sample_by_name_and_the_rest_is_stored(running, bad):
    session = running()
    now = int(time.time())

    result = usage_ingest(node_name=NODE, batch=batch({**sample(session, now - 10), **bad}, stored(session, now - 5, storage=MiB)))

    assert result.refused == {"malformed": 1} and result.stored == 1
    assert not FolderUse.objects.exists()


def test_data_folders_keep_their_newest_figures_per_node_and_show_in_my_resources(running, alice, bob):
    vision = Project.objects.create(name="vision")
    vision.members.add(alice, bob)
    Project.objects.create(name="audio")  # alice is no member: a node naming it for her is not believed
    session, bobs = running(), running(owner=bob)
    now = int(time.time())
    data = {"folder": "~/data", "used": 3 * MiB, "limit": 10 * GiB}
    usage_ingest(node_name=NODE, batch=batch(
        stored(session, now - 10, storage=MiB, folders=[
            data, {"folder": "~/projects/vision", "used": 5 * MiB, "limit": 20 * GiB},
            {"folder": "~/projects/audio", "used": 7 * MiB, "limit": 20 * GiB}]),
        stored(session, now - 20, storage=MiB, folders=[{**data, "used": 2 * MiB}]),  # older, in the same batch
    ))
    usage_ingest(node_name=NODE, batch=batch(  # older still, in a later batch: never over a newer figure
        stored(session, now - 30, storage=MiB, folders=[{**data, "used": MiB}])))
    usage_ingest(node_name=NODE, batch=batch(  # bob's session writes the shared project folder later
        stored(bobs, now - 5, storage=MiB, folders=[{"folder": "~/projects/vision", "used": 6 * MiB, "limit": 20 * GiB}])))

    assert FolderUse.objects.count() == 2  # alice's ~/data and vision's folder; no row for audio
    mine = client_for(alice).get("/api/v1/my-resources/").json()["storage"]
    assert mine == [
        {"folder": "~/data", "node": NODE, "used": 3 * MiB, "limit": 10 * GiB, "t": now - 10},
        {"folder": "~/projects/vision", "node": NODE, "used": 6 * MiB, "limit": 20 * GiB, "t": now - 5},
    ]
    assert client_for(bob).get("/api/v1/my-resources/").json()["storage"] == [mine[1]]  # not alice's ~/data


def test_fgpu_describe_prints_the_sessions_storage_against_its_limit(api, capsys):
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, api_session(started_at="2026-01-01T00:01:00Z"))
    api.routes[("GET", f"/api/v1/sessions/{SID}/usage/")] = (200, {
        "t": [], "gpu_memory": [], "gpu_util": [], "cpu": [], "mem": [], "resolution": "raw", "gpu_memory_limit": 0,
        "deadline": None, "deadline_reason": "", "storage": 1288490188, "storage_limit": 10 * GiB, "storage_t": 1})

    assert cli.main(["describe", SID]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^Storage: +1.19 GiB of 10 GiB \(11 %\)$", out, re.M), out
    assert cli.main(["describe", SID, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["storage"] == {"storage": 1288490188, "storage_limit": 10 * GiB, "storage_t": 1}

    api.routes[("GET", f"/api/v1/sessions/{SID}/usage/")] = (200, {"t": [], "storage": None, "storage_limit": None})
    assert cli.main(["describe", SID]) == 0
    assert re.search(r"^Storage: +not measured yet$", capsys.readouterr().out, re.M)
    # A session that never ran asks nothing of usage; a server without storage figures prints none.
    api.requests.clear()
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, api_session())
    assert cli.main(["describe", SID]) == 0
    assert "Storage" not in capsys.readouterr().out
    assert not [r for r in api.requests if r["path"].endswith("/usage/")]
