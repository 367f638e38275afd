"""Every list of the REST API (and the profile page's list of API tokens) answers in a number of
database queries that does not grow with its length, and so do the launch options and `/me/`
with the nodes and sessions behind them: each is pinned for 1 and for 100 rows with the same
bound, on the real database (issue 14). The rows are of every kind the list shows differently
(sessions in every request style, placed, ended and waiting; nodes with sessions, MIG slices and
a resource group; GPU instances in use; …), so one query per row of any kind passes the bound.

Each bound is the query count itself, so one query more anywhere fails it; what each query
reads is listed beside the bound.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from accelerators.allocation import mig
from accelerators.models import FractionalSettings, MigMode, Node, ResourceGroup, SlotFormat
from sessions.models import Project, Quota, SessionImage
from sessions.lifecycle.services import session_report_apply
from tests.conftest import client_for
from tests.seed import GiB, gpu_cluster, make_cluster, mock_gpu, sessions_in_every_style

pytestmark = pytest.mark.django_db

ROWS = [1, 100]
TOKEN = 1  # the API token with its user (accounts.authentication: one lookup)
PAGED = TOKEN + 1  # and the COUNT of a database-backed page
SIGNED_IN = 2  # a page's signed-in user: the Django session and the user


@pytest.fixture(params=ROWS, ids=lambda rows: f"{rows}-rows")
def rows(request) -> int:
    return request.param


def assert_page(api, path: str, *, rows: int, queries: int, assert_max_queries) -> dict:
    """GET `path` within `queries` queries; its page holds `rows` rows. Returns the body."""
    with assert_max_queries(queries):
        response = api.get(path)
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["count"], len(body["results"])) == (rows, rows)
    return body


def launch(owner, count: int, resources: dict) -> list:
    """`count` sessions asking `resources`, placed by one scheduler pass."""
    from sessions.scheduling.scheduler import schedule_pending
    from sessions.admission.launch import session_create

    sessions = [session_create(owner=owner, name="", resources={**resources, "mem": "64M"}) for i in range(count)]
    schedule_pending()
    return sessions


def gpus_with_mig_slices(count: int, *, node: int = 0) -> list:
    """`count` devices of a node's inventory: 8 GiB GPUs, except that of each ten, the last two
    are an H100 and a static 3g.40gb MIG slice of it (a device with a parent)."""
    devices = []
    for index in range(count):
        if index % 10 == 9:
            parent = devices[-1]
            devices.append(replace(parent, device_id=f"MIG-{parent.device_id}/0", model_name="MIG 3g.40gb",
                                   memory_size=40 * GiB, subproc_count=60, is_mig_device=True,
                                   mig_profile="3g.40gb", parent_device_id=parent.device_id))
        elif index % 10 == 8:
            devices.append(mock_gpu(index, node=node, memory=80 * GiB, sms=132, model="H100-80GB"))
        else:
            devices.append(mock_gpu(index, node=node))
    return devices


# --- sessions -------------------------------------------------------------------------------------

# The sessions with their owners, nodes and images; their allocations with devices; their GPU
# instances with GPUs; the slot formats (once, for every row that shows an fGPU amount).
# Since issue 37.3, one more whatever the page's length: the count of registered nodes, read once a page for
# the sessions on nodes without shared storage (sessions.policy.data_folders: their folders are local).
SESSIONS_QUERIES = 5


def test_the_session_list_costs_the_same_queries_for_1_or_100_sessions_of_every_style(
        rows, alice, django_assert_max_num_queries):
    gpu_cluster(nodes=2, mig_gpus=4)
    sessions_in_every_style(owner=alice, count=rows)

    body = assert_page(client_for(alice), "/api/v1/sessions/", rows=rows, queries=PAGED + SESSIONS_QUERIES,
                       assert_max_queries=django_assert_max_num_queries)

    if rows == 100:  # every kind of row is there: fGPU amounts, MIG grants, shared slices, ended, waiting
        shown = {(s["status"], bool(s["allocations"]), s["mig_profile"], s["fraction_enforcement"]) for s in body["results"]}
        assert {status for status, *_ in shown} == {"SCHEDULED", "TERMINATED", "PENDING"}
        assert any(profile == "1g.10gb" for _, _, profile, _ in shown)
        assert any(enforcement == "none" for *_, enforcement in shown)
        assert any(s["requested"].startswith("0.50 fGPU") for s in body["results"])


# The caller's quotas; the slots; for the one slot (cuda) the nodes in reach with their live
# usage, their devices and links, its fractional settings and slot format; the MIG nodes, their
# devices, the busy devices (2), the GPU instances, the CPU in use.
# Since issue 35.1 the nodes come from the kept cluster view: one statement more, its read of the change log
# (accelerators.cluster_view._changes_since), whatever the number of nodes.
LAUNCH_OPTIONS_QUERIES = 14


def test_launch_options_cost_the_same_queries_for_1_or_100_gpu_nodes_and_mig_nodes(
        rows, alice, django_assert_max_num_queries):
    gpu_cluster(nodes=rows, gpus=1)
    make_cluster(nodes={f"mig-node-{n}": [mock_gpu(0, node=rows + n, memory=80 * GiB, sms=132, model="H100-80GB")]
                        for n in range(rows)})
    Node.objects.filter(name__startswith="mig-node-").update(mig_mode=MigMode.DYNAMIC)
    launch(alice, 2, {"cuda.shares": "0.5"})
    launch(alice, 2, {"mig_profile": "3g.40gb"})
    api = client_for(alice)

    with django_assert_max_num_queries(TOKEN + LAUNCH_OPTIONS_QUERIES):
        body = api.get("/api/v1/launch-options/").json()

    assert body["slots"][0]["max_ever"] == "2.00"
    profile = next(p for p in body["mig"]["profiles"] if p["name"] == "3g.40gb")
    assert (profile["max_ever"], profile["max_now"]) == (2 * rows, 2 * rows - 2)


def test_me_costs_the_same_queries_for_1_or_100_live_sessions(rows, alice, django_assert_max_num_queries):
    gpu_cluster(nodes=2, mig_gpus=4)
    sessions = sessions_in_every_style(owner=alice, count=rows)
    api = client_for(alice)

    # The caller's projects, the COUNT of live sessions, the quotas that apply.
    with django_assert_max_num_queries(TOKEN + 3):
        body = api.get("/api/v1/me/").json()

    assert body["live_sessions"] == sum(1 for s in sessions if s.status != "TERMINATED")


# --- the inventory --------------------------------------------------------------------------------

# The nodes with their resource groups; their devices with usage and MIG parents; the
# fractional settings and the GPUs with MIG slices (no fGPU there), once for the page's devices.
NODES_QUERIES = 4


def test_the_node_list_costs_the_same_queries_for_1_or_100_nodes_with_sessions(
        rows, alice, django_assert_max_num_queries):
    make_cluster(nodes={f"gpu-node-{n}": gpus_with_mig_slices(10, node=n) for n in range(rows)}, cpu=64)
    Node.objects.update(resource_group=ResourceGroup.objects.create(name="training"))
    launch(alice, 20, {"cuda.shares": "0.5"})

    body = assert_page(client_for(alice), "/api/v1/nodes/", rows=rows, queries=PAGED + NODES_QUERIES,
                       assert_max_queries=django_assert_max_num_queries)

    devices = [d for node in body["results"] for d in node["devices"]]
    assert len(devices) == 10 * rows and any(d["parent"] for d in devices)
    assert sum(float(d["allocated_fgpu"]) for d in devices) == 10.0  # 20 × 0.5 fGPU, wherever they went


def test_the_device_list_costs_the_same_queries_for_1_or_100_devices(rows, alice, django_assert_max_num_queries):
    make_cluster(nodes={"gpu-node-0": gpus_with_mig_slices(rows)}, cpu=64)
    launch(alice, 4, {"cuda.shares": "0.5"})

    # The devices with usage, nodes and MIG parents; the fractional settings; the GPUs with MIG slices.
    body = assert_page(client_for(alice), "/api/v1/devices/", rows=rows, queries=PAGED + 3,
                       assert_max_queries=django_assert_max_num_queries)

    assert sum(d["session_count"] for d in body["results"]) == 4


def test_the_mig_layout_list_costs_the_same_queries_for_1_or_100_gpus(rows, alice, django_assert_max_num_queries):
    gpu_cluster(nodes=0, mig_gpus=rows)
    ended, *running = launch(alice, 1 + rows, {"mig_profile": "1g.10gb"})
    session_report_apply(session_id=str(ended.pk), status="TERMINATED", reason="done", exit_code=0)

    # The nodes, their GPU instances with sessions and owners, their whole GPUs (a list built in
    # memory: no COUNT).
    body = assert_page(client_for(alice), "/api/v1/mig/layouts/", rows=rows, queries=TOKEN + 3,
                       assert_max_queries=django_assert_max_num_queries)

    states = [(i["state"], bool(i["session"])) for gpu in body["results"] for i in gpu["instances"]]
    assert sorted(states) == [("idle", False)] + [("in_use", True)] * rows


def test_the_mig_profile_list_costs_the_same_queries_for_1_or_100_catalogs_read_from_nvml(
        rows, alice, django_assert_max_num_queries):
    built_in = mig.CATALOGS["H100-80GB"]
    for n in range(rows):
        catalog = mig.catalog_as_dict(replace(built_in, model=f"NVIDIA H100 80GB HBM3 rev {n}"))
        make_cluster(nodes={f"mig-{n}": [replace(mock_gpu(0, node=n, memory=80 * GiB, sms=132, model="H100-80GB"),
                                                 mig_catalog=catalog)]})

    # Every whole GPU with its node (the catalogs they are planned with; a list built in memory).
    assert_page(client_for(alice), "/api/v1/mig/profiles/?limit=1000", rows=len(mig.CATALOGS) + rows,
                queries=TOKEN + 1, assert_max_queries=django_assert_max_num_queries)


# --- configuration --------------------------------------------------------------------------------

def test_the_resource_group_list_costs_the_same_queries_for_1_or_100_groups(rows, alice,
                                                                            django_assert_max_num_queries):
    nodes = make_cluster(nodes={f"gpu-node-{n}": [mock_gpu(0, node=n)] for n in range(rows)})
    for n, node in enumerate(nodes.values()):
        node.resource_group = ResourceGroup.objects.create(name=f"pool-{n}")
        node.save(update_fields=["resource_group"])

    # The groups; their nodes.
    body = assert_page(client_for(alice), "/api/v1/resource-groups/", rows=rows, queries=PAGED + 2,
                       assert_max_queries=django_assert_max_num_queries)

    assert all(group["nodes"] for group in body["results"])


@pytest.mark.parametrize("path, model, fields", [
    ("/api/v1/slot-formats/", SlotFormat, {"subtype": "shares", "display_unit": "fGPU", "number_round_length": 2}),
    ("/api/v1/fractional-settings/", FractionalSettings, {"allocation_mode": "fractional"}),
], ids=["slot-formats", "fractional-settings"])
def test_the_accelerator_settings_lists_cost_the_same_queries_for_1_or_100_rows(
        rows, path, model, fields, alice, django_assert_max_num_queries):
    model.objects.bulk_create([model(slot_name=f"slot{n}", **fields) for n in range(rows)])

    # The rows.
    assert_page(client_for(alice), path, rows=rows, queries=PAGED + 1, assert_max_queries=django_assert_max_num_queries)


def test_the_image_list_costs_the_same_queries_for_1_or_100_images(rows, alice, django_assert_max_num_queries):
    from sessions.policy.images import image_save

    make_cluster(nodes={"gpu-node-0": [mock_gpu(0)]})
    for n in range(rows - 1):  # and the built-in "host"
        image_save(image=SessionImage(reference=f"registry.example/team/image-{n}:1", display_name=f"image {n}"))

    # The images; the alive nodes with the images they hold (once).
    body = assert_page(client_for(alice), "/api/v1/images/", rows=rows, queries=PAGED + 2,
                       assert_max_queries=django_assert_max_num_queries)

    assert [image["nodes"] for image in body["results"] if image["reference"] == "host"] == [["gpu-node-0"]]


# --- projects, quotas, tokens ---------------------------------------------------------------------

def test_the_project_list_costs_the_same_queries_for_1_or_100_projects(rows, staff, django_user_model,
                                                                       django_assert_max_num_queries):
    users = [django_user_model.objects.create_user(f"user{n}") for n in range(3)]
    for n in range(rows):
        Project.objects.create(name=f"project-{n}").members.set(users[:1 + n % 3])

    # The projects; their members; their resource groups.
    body = assert_page(client_for(staff), "/api/v1/projects/", rows=rows, queries=PAGED + 3,
                       assert_max_queries=django_assert_max_num_queries)

    assert all(project["members"] for project in body["results"])


def test_the_quota_list_costs_the_same_queries_for_1_or_100_quotas(rows, staff, django_user_model,
                                                                   django_assert_max_num_queries):
    for n in range(rows):
        if n % 2:
            Quota.objects.create(project=Project.objects.create(name=f"project-{n}"), max_sessions=n)
        else:
            Quota.objects.create(user=django_user_model.objects.create_user(f"user{n}"), max_fgpu=n)

    # The quotas with their users and projects.
    body = assert_page(client_for(staff), "/api/v1/quotas/", rows=rows, queries=PAGED + 1,
                       assert_max_queries=django_assert_max_num_queries)

    assert {quota["scope"] for quota in body["results"]} == ({"user", "project"} if rows > 1 else {"user"})


def test_the_token_list_of_the_profile_page_costs_the_same_queries_for_1_or_100_tokens(
        rows, client, alice, django_assert_max_num_queries):
    from accounts.services import api_token_create

    for n in range(rows):
        api_token_create(user=alice, name=f"script {n}")
    client.force_login(alice)

    # The live tokens, the login token.
    with django_assert_max_num_queries(SIGNED_IN + 2):
        response = client.get("/account/")

    assert response.status_code == 200
    assert response.content.count(b"script ") >= rows


# --- a write's answer -----------------------------------------------------------------------------

# The token; the session with its node (the permission check); the conditional UPDATE to
# TERMINATING (a RUNNING session is not tried as PENDING; one statement, no BEGIN … COMMIT: the stop
# goes out when it returns), which matches the version read, so the session is not read back (issue
# 35.3); the notice's read (the session with its owner, node and image; allocations with devices;
# slot formats; a session that is not MIG's reads no GPU instances). The answer is the notice's
# shape: nothing is read a second time.
TERMINATE_QUERIES = TOKEN + 1 + 1 + 3 + 1  # + the count of registered nodes in the notice's shape (issue 37.3)


@pytest.mark.django_db(transaction=True)  # the notice is rendered at the real commit, as in production
def test_terminating_answers_the_shape_its_notice_rendered_without_reading_the_session_again(
        alice, django_assert_max_num_queries):
    gpu_cluster(nodes=1)
    session = launch(alice, 1, {"cuda.shares": "0.5"})[0]
    for status in ("PREPARING", "RUNNING"):
        assert session_report_apply(session_id=str(session.pk), status=status)
    api = client_for(alice)

    with django_assert_max_num_queries(TERMINATE_QUERIES):
        answer = api.delete(f"/api/v1/sessions/{session.pk}/")

    assert answer.status_code == 202, answer.content
    assert answer.json()["status"] == "TERMINATING"
    assert answer.json() == api.get(f"/api/v1/sessions/{session.pk}/").json()  # the same state, shown the same


def test_a_notices_shape_is_not_answered_for_another_state_of_the_session(alice):
    """A write whose notice was not rendered (or rendered an older or newer state) reads the
    session afresh: the shape is the notice's only for the same version."""
    from sessions.lifecycle import events

    gpu_cluster(nodes=1)
    session = launch(alice, 1, {"cuda.shares": "0.5"})[0]
    events._rendered.shapes = {str(session.pk): {"id": str(session.pk), "version": session.version, "status": "X"}}

    assert events.shape_shown(session) == {"id": str(session.pk), "version": session.version, "status": "X"}
    session.version += 1
    assert events.shape_shown(session) is None
    events._rendered.shapes = {}
    assert events.shape_shown(session) is None


# --- an agent's messages on the manager -------------------------------------------------------------

# The session with its node, whose key checks the signature; BEGIN, the conditional UPDATE of the
# session, the release of its allocations, COMMIT; then, after the commit, the MIG layout retry's
# look at the node, and the scheduler pass the release asks for (eager in tests, a task of its own in
# production: BEGIN, the pending sessions, whether a preemption notice stands or a preempted session
# waits to be requeued (sessions.scheduling.preemption), COMMIT); and where a page listens (a staff
# page another test left in the shared channel layer's group), the notice's read: 3, as above, and the
# count of registered nodes in its shape (issue 37.3). With none listening it reads nothing (issue 35.3).
REPORT_QUERIES = 1 + 4 + 1 + 4 + 3 + 1


@pytest.mark.django_db(transaction=True)  # the notice is rendered at the real commit, as in production
def test_an_agents_terminated_report_reads_the_session_and_its_nodes_key_once(alice, django_assert_max_num_queries):
    from sessions.tasks import session_report

    gpu_cluster(nodes=1)
    session = launch(alice, 1, {"cuda.shares": "0.5"})[0]
    session_report_apply(session_id=str(session.pk), status="RUNNING")
    node = Node.objects.get().name

    with django_assert_max_num_queries(REPORT_QUERIES):
        session_report(session_id=str(session.pk), status="TERMINATED", reason="terminated", exit_code=0, node=node)

    session.refresh_from_db()
    assert session.status == "TERMINATED"
    assert not session.allocations.filter(released_at__isnull=True).exists()


# The session with its node (and key); BEGIN, the log's row locked, whether the batch is stored
# already, the batch, the log's length, COMMIT. Older batches are deleted only once the log passes
# its limit.
LOG_BATCH_QUERIES = 1 + 6


@pytest.mark.django_db(transaction=True)
def test_a_log_batch_costs_the_same_few_statements_on_the_manager(alice, django_assert_max_num_queries):
    from sessions.models import SessionLogChunk
    from sessions.tasks import session_log_append

    gpu_cluster(nodes=1)
    session = launch(alice, 1, {"cuda.shares": "0.5"})[0]
    node = Node.objects.get().name
    session_log_append(session_id=str(session.pk), seq=0, offset=0, text="a" * 10, node=node)  # creates the log

    with django_assert_max_num_queries(LOG_BATCH_QUERIES):
        session_log_append(session_id=str(session.pk), seq=1, offset=10, text="b" * 10, node=node)

    assert list(SessionLogChunk.objects.filter(session=session).order_by("seq").values_list("text", flat=True)) == [
        "a" * 10, "b" * 10]
