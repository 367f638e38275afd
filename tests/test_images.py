"""Session images (issue 13, item 2): administrators register them (`/api/v1/images/`, admin),
nodes report the ones they hold in their registration and heartbeats (signed like every agent
message), a launch names one (or gets the default) and the scheduler places it only on a node
that holds it; the start spec carries it to the agent, whose docker runtime runs it.

Real PostgreSQL; the manager's tasks run eagerly, as the agent sends them (CeleryManager)."""
from __future__ import annotations

import asyncio
import json
import uuid
import pytest
from channels.layers import InMemoryChannelLayer

import protocol
import sessions.tasks  # noqa: F401  (registers the manager's tasks: CeleryManager's messages then run eagerly)
from accelerators.models import Node, NodeStatus, ResourceGroup
from accelerators.services import node_inventory_apply
from common.celery import app
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.policy.images import image_default
from sessions.models import ComputeSession, SessionImage, SessionStatus
from agent.core import Agent
from agent.manager_link import CeleryManager
from agent.runtimes import HeldImages, ProcessRuntime
from sessions.scheduling.scheduler import schedule_pending
from tests.conftest import GiB, assert_error_shape, client_for, make_cluster, mock_gpu
from tests.test_agent_runtime import DEVICE, RecordingManager
from tests.test_docker_runtime import docker_client  # noqa: F401  (fixture: Docker Engine on this machine)

pytestmark = pytest.mark.django_db

TEST_IMAGE = "fgpu-session:test"
PYTORCH = "nvcr.io/nvidia/pytorch:24.05-py3"


@pytest.fixture
def host():
    """The built-in "host" image (migration 0007 creates it; made sure of here)."""
    image, _ = SessionImage.objects.get_or_create(reference=protocol.HOST_IMAGE)
    if not SessionImage.objects.filter(is_default=True).exists():
        SessionImage.objects.filter(pk=image.pk).update(is_default=True)
    return SessionImage.objects.get(pk=image.pk)


@pytest.fixture
def test_image():
    return SessionImage.objects.create(reference=TEST_IMAGE, display_name="Debian minimal", shell="/bin/sh")


def docker_node(name: str, *references: str, device_index: int = 1) -> Node:
    """A registered node whose agent (docker runtime) reports holding `references`."""
    return node_inventory_apply(node_name=name, devices=[mock_gpu(device_index)], plugins=["ai.backend.accelerator.mock"],
                                attributes={}, cpu_count=8, memory_size=32 * GiB,
                                images={ref: f"sha256:{uuid.uuid4().hex}" for ref in references})


def launch(owner, image=None, shares="0.5", **extra) -> ComputeSession:
    return admission.session_create(owner=owner, name="", resources={"cuda.shares": shares, **extra}, image=image)


def status_of(session: ComputeSession) -> tuple[str, str, str | None]:
    session.refresh_from_db()
    return session.status, session.status_reason, session.node.name if session.node_id else None


# --- the model and its migration ----------------------------------------------------------------------

def test_the_migration_registered_host_as_the_default_image():
    host = SessionImage.objects.get(reference="host")
    assert host.is_default and image_default() == host
    assert SessionImage.objects.filter(is_default=True).count() == 1


def test_the_migrations_host_image_is_not_the_default_where_another_one_is():
    from importlib import import_module

    from django.apps import apps

    create_host_image = import_module("sessions.migrations.0007_session_images").create_host_image
    SessionImage.objects.all().delete()
    SessionImage.objects.create(reference=PYTORCH, is_default=True)
    create_host_image(apps, None)
    assert not SessionImage.objects.get(reference="host").is_default
    assert image_default().reference == PYTORCH


def test_at_most_one_image_is_the_default_in_the_database(host):
    from django.db import IntegrityError, transaction

    with pytest.raises(IntegrityError), transaction.atomic():
        SessionImage.objects.create(reference=PYTORCH, is_default=True)


def test_without_a_marked_default_host_is_the_default_and_without_host_there_is_none(host, test_image):
    SessionImage.objects.update(is_default=False)
    assert image_default() == host
    host.delete()
    assert image_default() is None


# --- the API: everyone reads, administrators write -------------------------------------------------------

def test_every_user_lists_and_reads_images_with_the_nodes_that_hold_them(demo_cluster, alice, host, test_image):
    docker_node("docker-node", TEST_IMAGE)
    Node.objects.filter(name="demo-node").update(status=NodeStatus.LOST)  # holds host, but is not alive
    client = client_for(alice)
    listed = client.get("/api/v1/images/")
    assert listed.status_code == 200
    by_reference = {i["reference"]: i for i in listed.json()["results"]}
    assert [i["reference"] for i in listed.json()["results"]][0] == "host"  # the default first
    assert by_reference[TEST_IMAGE]["nodes"] == ["docker-node"]
    assert by_reference["host"]["nodes"] == []
    one = client.get(f"/api/v1/images/{test_image.pk}/")
    assert one.status_code == 200 and one.json()["shell"] == "/bin/sh" and one["ETag"]


def test_users_may_not_create_change_or_delete_images(alice, host):
    client = client_for(alice)
    assert_error_shape(client.post("/api/v1/images/", {"reference": PYTORCH}, format="json"), 403)
    assert_error_shape(client.patch(f"/api/v1/images/{host.pk}/", {"is_default": False}, format="json",
                                    HTTP_IF_MATCH="*"), 403)
    assert_error_shape(client.delete(f"/api/v1/images/{host.pk}/"), 403)
    assert SessionImage.objects.filter(reference="host", is_default=True).exists()
    assert not SessionImage.objects.filter(reference=PYTORCH).exists()


def test_an_administrator_marking_a_new_default_takes_the_mark_from_the_old_one(staff, host):
    client = client_for(staff)
    created = client.post("/api/v1/images/", {"reference": PYTORCH, "display_name": "PyTorch", "accelerators": ["cuda"],
                                              "labels": {"framework": "pytorch"}, "is_default": True}, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["is_default"] is True and created.json()["accelerators"] == ["cuda"]
    assert list(SessionImage.objects.filter(is_default=True).values_list("reference", flat=True)) == [PYTORCH]

    tag = client.get(f"/api/v1/images/{host.pk}/")["ETag"]
    back = client.patch(f"/api/v1/images/{host.pk}/", {"is_default": True}, format="json", HTTP_IF_MATCH=tag)
    assert back.status_code == 200, back.content
    assert list(SessionImage.objects.filter(is_default=True).values_list("reference", flat=True)) == ["host"]


@pytest.mark.parametrize("body, field", [
    ({"reference": "has space:1"}, "reference"),
    ({"reference": ""}, "reference"),
    ({"reference": "host"}, "reference"),  # taken
    ({"reference": "x:1", "accelerators": ["CUDA"]}, "accelerators"),
    ({"reference": "x:1", "accelerators": ["cuda", "cuda"]}, "accelerators"),
    ({"reference": "x:1", "accelerators": "cuda"}, "accelerators"),
    ({"reference": "x:1", "labels": {"gpu": 1}}, "labels"),
    ({"reference": "x:1", "shell": "bash"}, "shell"),
])
def test_a_bad_image_is_a_400_naming_its_field(staff, host, body, field):
    response = client_for(staff).post("/api/v1/images/", body, format="json")
    named = assert_error_shape(response, 400)["field_errors"]
    assert any(key.split(".")[0] == field for key in named), named  # "accelerators.0": the list's first item


def test_an_image_that_sessions_wait_or_run_in_cannot_be_deleted_until_they_ended(demo_cluster, staff, alice,
                                                                                   test_image):
    session = launch(alice, image=TEST_IMAGE)
    client = client_for(staff)
    refused = client.delete(f"/api/v1/images/{test_image.pk}/")
    assert assert_error_shape(refused, 409)["type"] == "image-in-use"
    services.session_terminate(session=session)  # PENDING → CANCELLED
    assert client.delete(f"/api/v1/images/{test_image.pk}/").status_code == 204
    session.refresh_from_db()
    assert session.image is None and session.status == SessionStatus.CANCELLED


def test_the_admin_lists_images_and_will_not_delete_one_in_use(demo_cluster, admin, alice, test_image, client):
    launch(alice, image=TEST_IMAGE)
    client.force_login(admin)
    page = client.get("/admin/compute_sessions/sessionimage/")
    assert page.status_code == 200
    html = page.content.decode()
    assert TEST_IMAGE in html and "Debian minimal" in html and "none (sessions in it wait)" in html
    delete = client.post(f"/admin/compute_sessions/sessionimage/{test_image.pk}/delete/", {"post": "yes"})
    assert delete.status_code == 403
    assert SessionImage.objects.filter(pk=test_image.pk).exists()
    added = client.post("/admin/compute_sessions/sessionimage/add/", {
        "reference": PYTORCH, "display_name": "", "description": "", "accelerators": '["cuda"]', "shell": "",
        "labels": "{}", "is_default": "on"})
    assert added.status_code == 302, added.content.decode()[:2000]
    assert list(SessionImage.objects.filter(is_default=True).values_list("reference", flat=True)) == [PYTORCH]


# --- launching with an image -----------------------------------------------------------------------------

def test_a_launch_without_an_image_gets_the_default_and_the_session_shows_it(demo_cluster, alice, host):
    response = client_for(alice).post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5"}}, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["image"] == "host"
    assert ComputeSession.objects.get(pk=response.json()["id"]).image == host


def test_a_launch_names_a_registered_image(demo_cluster, alice, host, test_image):
    response = client_for(alice).post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5"}, "image": TEST_IMAGE},
                                      format="json")
    assert response.status_code == 201, response.content
    assert response.json()["image"] == TEST_IMAGE
    assert client_for(alice).get(f"/api/v1/sessions/{response.json()['id']}/").json()["image"] == TEST_IMAGE


def test_an_unknown_image_is_a_400_naming_the_field_and_the_registered_ones(demo_cluster, alice, host, test_image):
    response = client_for(alice).post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5"},
                                                            "image": "ubuntu:24.04"}, format="json")
    body = assert_error_shape(response, 400)
    assert body["type"] == "unknown-image"
    [message] = body["field_errors"]["image"]
    assert "ubuntu:24.04" in message and "fgpu-session:test" in message and "host" in message
    assert not ComputeSession.objects.exists()


def test_an_image_for_other_accelerators_is_refused(demo_cluster, alice, host):
    SessionImage.objects.create(reference="rocm/pytorch:latest", accelerators=["rocm"])
    response = client_for(alice).post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5"},
                                                            "image": "rocm/pytorch:latest"}, format="json")
    assert "rocm" in assert_error_shape(response, 400)["field_errors"]["image"][0]
    cpu_only = client_for(alice).post("/api/v1/sessions/", {"resources": {"cpu": 1}, "image": "rocm/pytorch:latest"},
                                      format="json")
    assert cpu_only.status_code == 201, cpu_only.content  # a CPU-only session asks for no accelerator


def test_docker_hubs_implicit_names_find_the_registered_image(demo_cluster, alice, host):
    SessionImage.objects.create(reference="docker.io/library/ubuntu:24.04")
    session = launch(alice, image="ubuntu:24.04")
    assert session.image.reference == "docker.io/library/ubuntu:24.04"


@pytest.mark.parametrize("reference, key", [
    ("docker.io/library/ubuntu", "ubuntu:latest"), ("library/ubuntu:22.04", "ubuntu:22.04"),
    ("index.docker.io/nvidia/cuda:12.4.1-base", "nvidia/cuda:12.4.1-base"), (PYTORCH, PYTORCH),
    ("localhost:5000/team/img", "localhost:5000/team/img:latest"),
    ("nvcr.io/nvidia/pytorch:24.05-py3@sha256:abc", "nvcr.io/nvidia/pytorch@sha256:abc"),
])
def test_image_key_is_the_form_docker_lists_its_tags_in(reference, key):
    assert protocol.image_key(reference) == key


# --- placement only on nodes that hold the image ------------------------------------------------------------

def test_a_session_goes_only_to_a_node_that_holds_its_image(alice, host, test_image):
    make_cluster(nodes={"process-node": [mock_gpu(0)]})  # registers without images: holds host
    docker_node("docker-node", TEST_IMAGE)
    # Binpack takes the first of equal nodes (docker-node, by name), then the fuller one: without
    # the image filter the host session would go to docker-node and the other one after it.
    ResourceGroup.objects.create(name="default", policy="binpack")
    on_host = launch(alice, image="host")
    in_image = launch(alice, image=TEST_IMAGE)
    schedule_pending()
    assert status_of(in_image)[::2] == (SessionStatus.SCHEDULED, "docker-node")
    assert status_of(on_host)[::2] == (SessionStatus.SCHEDULED, "process-node")


def test_a_session_waits_in_words_while_no_alive_node_holds_its_image_and_starts_once_one_does(
        demo_cluster, alice, host, test_image):
    session = launch(alice, image=TEST_IMAGE)
    schedule_pending()
    assert status_of(session) == (SessionStatus.PENDING, f"waiting for a node with image {TEST_IMAGE}: no node has it",
                                  None)
    docker_node("docker-node", TEST_IMAGE)
    Node.objects.filter(name="docker-node").update(status=NodeStatus.LOST)
    schedule_pending()
    assert status_of(session)[:2] == (SessionStatus.PENDING, f"waiting for a node with image {TEST_IMAGE}: the nodes "
                                                              "that have it are not alive (LOST)")
    # The demo node's agent pulls the image: its next heartbeat says so, which asks for a pass
    # (run at once here, Celery being eager), and the pass places the session there.
    CeleryManager(app, node="demo-node").heartbeat("demo-node", [], None, None, {"host": "host", TEST_IMAGE: "sha256:1"})
    assert status_of(session)[::2] == (SessionStatus.SCHEDULED, "demo-node")


def test_a_node_that_pulls_images_takes_a_session_in_an_image_it_lacks_but_never_one_in_host(alice, host, test_image):
    make_cluster(nodes={"process-node": [mock_gpu(0)]})  # the process runtime: holds host, pulls nothing
    puller = docker_node("docker-node", "other:image")
    Node.objects.filter(pk=puller.pk).update(attributes={"pulls_images": True})
    in_image = launch(alice, image=TEST_IMAGE)
    on_host = launch(alice, image="host")
    schedule_pending()
    assert status_of(in_image)[::2] == (SessionStatus.SCHEDULED, "docker-node")  # it will pull the image
    assert status_of(on_host)[::2] == (SessionStatus.SCHEDULED, "process-node")
    Node.objects.filter(pk=puller.pk).update(attributes={"pulls_images": False})  # pull-images = false
    again = launch(alice, image=TEST_IMAGE)
    schedule_pending()
    assert status_of(again)[:2] == (SessionStatus.PENDING, f"waiting for a node with image {TEST_IMAGE}: no node has it")


def test_one_pass_tells_requests_of_the_same_shape_apart_by_image(demo_cluster, alice, host, test_image):
    # The same request in an image no node holds, then in host: the first waits, and its reason
    # must not be taken for the second's (the pass's "no room" cache keys on the image too).
    missing = launch(alice, image=TEST_IMAGE)
    held = launch(alice, image="host")
    schedule_pending()
    assert status_of(missing)[0] == SessionStatus.PENDING
    assert status_of(held)[::2] == (SessionStatus.SCHEDULED, "demo-node")


def test_nodes_holding_the_image_but_too_small_make_it_wait_not_fail(alice, host, test_image):
    make_cluster(nodes={"big-node": [mock_gpu(0, memory=16 * GiB, sms=160)]})  # 4 fGPU, holds host only
    docker_node("small-docker-node", TEST_IMAGE)  # 2 fGPU
    session = launch(alice, image=TEST_IMAGE, shares="3")
    schedule_pending()
    status, reason, _ = status_of(session)
    assert status == SessionStatus.PENDING
    assert reason == f"waiting for capacity: no alive node with image {TEST_IMAGE} could hold it"


def test_sessions_from_before_images_go_to_any_node(demo_cluster, alice):
    session = launch(alice)
    ComputeSession.objects.filter(pk=session.pk).update(image=None)  # as an old row
    Node.objects.filter(name="demo-node").update(images={})
    schedule_pending()
    assert status_of(session)[::2] == (SessionStatus.SCHEDULED, "demo-node")


def test_a_mig_session_goes_only_to_a_mig_node_that_holds_its_image(alice, host, test_image):
    from tests.test_mig_scheduling import mig_node

    mig_node()  # holds host only
    session = admission.session_create(owner=alice, name="m", resources={"mig_profile": "1g.10gb"}, image=TEST_IMAGE)
    docker_node("gpu-less-docker-node", TEST_IMAGE)  # holds the image, but has no MIG
    schedule_pending()
    assert status_of(session)[:2] == (SessionStatus.PENDING,
                                      f"waiting for capacity: no node with MIG enabled has image {TEST_IMAGE}")
    Node.objects.filter(name="mig-node").update(images={TEST_IMAGE: "sha256:1"})
    schedule_pending()
    assert status_of(session)[::2] == (SessionStatus.SCHEDULED, "mig-node")


def test_the_preview_places_the_request_in_its_image(demo_cluster, alice, host, test_image):
    client = client_for(alice)
    in_host = client.post("/api/v1/sessions/preview/", {"resources": {"cuda.shares": "0.5"}}, format="json").json()
    assert in_host["fits_now"] and in_host["node"] == "demo-node"
    waiting = client.post("/api/v1/sessions/preview/", {"resources": {"cuda.shares": "0.5"}, "image": TEST_IMAGE},
                          format="json").json()
    assert not waiting["fits_now"] and not waiting["never"]
    assert waiting["reason"] == f"waiting for a node with image {TEST_IMAGE}: no node has it"
    unknown = client.post("/api/v1/sessions/preview/", {"resources": {"cuda.shares": "0.5"}, "image": "nope:1"},
                          format="json")
    assert "image" in assert_error_shape(unknown, 400)["field_errors"]


def test_the_start_spec_carries_the_image_and_its_shell(demo_cluster, alice, host, test_image,
                                                        django_capture_on_commit_callbacks):
    from sessions.scheduling.scheduler import _send_starts

    Node.objects.filter(name="demo-node").update(images={"host": "host", TEST_IMAGE: "sha256:1"})
    launch(alice, image=TEST_IMAGE)
    launch(alice)  # the default, host: no shell of its own
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        schedule_pending()
    [starts] = [cb.args[0] for cb in callbacks if getattr(cb, "func", None) is _send_starts]
    assert [(spec["image"], spec["shell"]) for _, spec in starts] == [(TEST_IMAGE, "/bin/sh"), ("host", "")]


# --- what the agents report ----------------------------------------------------------------------------------

def test_registration_and_heartbeats_store_the_images_a_node_holds(alice, host):
    manager = CeleryManager(app, node="gpu-node")
    inventory = {"devices": [mock_gpu(0).as_dict()], "plugins": ["ai.backend.accelerator.mock"], "attributes": {},
                 "cpu_count": 8, "memory_size": 32 * GiB}
    manager.register("gpu-node", inventory, [], {TEST_IMAGE: "sha256:aaa"})
    assert Node.objects.get(name="gpu-node").images == {TEST_IMAGE: "sha256:aaa"}
    manager.heartbeat("gpu-node", [], None, None, {TEST_IMAGE: "sha256:bbb", PYTORCH: "sha256:ccc"})
    assert Node.objects.get(name="gpu-node").images == {TEST_IMAGE: "sha256:bbb", PYTORCH: "sha256:ccc"}
    manager.heartbeat("gpu-node", [], None, None)  # an agent from before images: what it had stays
    assert Node.objects.get(name="gpu-node").images == {TEST_IMAGE: "sha256:bbb", PYTORCH: "sha256:ccc"}
    manager.register("gpu-node", inventory, [])  # …and registering without images: the process runtime's host
    assert Node.objects.get(name="gpu-node").images == {"host": "host"}
    assert client_for(alice).get("/api/v1/nodes/gpu-node/").json()["images"] == {"host": "host"}


def test_a_report_of_images_keeps_only_text_references_and_at_most_the_limit(host):
    make_cluster(nodes={"gpu-node": [mock_gpu(0)]})
    many = {f"img{i:04d}:1": "sha256:x" for i in range(protocol.MAX_IMAGES + 5)}
    CeleryManager(app, node="gpu-node").heartbeat("gpu-node", [], None, None, {**many, "x" * 300: "id", "ok:1": 7})
    stored = Node.objects.get(name="gpu-node").images
    assert len(stored) == protocol.MAX_IMAGES and "x" * 300 not in stored and "ok:1" not in stored
    CeleryManager(app, node="gpu-node").heartbeat("gpu-node", [], None, None, ["not", "an", "object"])
    assert Node.objects.get(name="gpu-node").images == {}


def test_signed_images_verify_and_altered_ones_do_not(host, caplog):
    from accelerators.services import node_agent_key_rotate

    make_cluster(nodes={"gpu-node": [mock_gpu(0)]})
    key = node_agent_key_rotate(node_name="gpu-node")
    CeleryManager(app, node="gpu-node", key=key).heartbeat("gpu-node", [], None, None, {TEST_IMAGE: "sha256:1"})
    assert Node.objects.get(name="gpu-node").images == {TEST_IMAGE: "sha256:1"}

    # A message signed without images (an agent from before them) still verifies…
    kwargs = {"node": "gpu-node", "running": [], "mig_digest": None, "state": None}
    app.signature(protocol.AGENT_HEARTBEAT, kwargs={
        **kwargs, protocol.SIGNATURE: protocol.sign(key, protocol.AGENT_HEARTBEAT, kwargs)}).apply_async()
    assert Node.objects.get(name="gpu-node").images == {TEST_IMAGE: "sha256:1"}
    # …but images added to a signed message do not.
    forged = {**kwargs, protocol.SIGNATURE: protocol.sign(key, protocol.AGENT_HEARTBEAT, kwargs),
              "images": {PYTORCH: "sha256:2"}}
    app.signature(protocol.AGENT_HEARTBEAT, kwargs=forged).apply_async()
    assert Node.objects.get(name="gpu-node").images == {TEST_IMAGE: "sha256:1"}
    assert any("does not verify" in r.getMessage() for r in caplog.records)


def test_a_process_runtime_agent_registers_and_heartbeats_holding_host(tmp_path):
    async def main():
        manager = RecordingManager(asyncio.get_running_loop())
        inventory = {"devices": [DEVICE.as_dict()], "plugins": [], "attributes": {}, "cpu_count": 8,
                     "memory_size": 32 * GiB}
        agent = Agent(node=f"n-{uuid.uuid4().hex[:8]}", inventory=inventory, channel_layer=InMemoryChannelLayer(),
                      manager=manager, scratch_root=tmp_path / "scratch", mock=True, heartbeat_s=0.05)
        await agent.start()
        try:
            await manager.wait_for(lambda: manager.heartbeats, what="a heartbeat")
        finally:
            await agent.shutdown()
        return manager.images

    reported = asyncio.run(main())
    assert reported[0] == {"host": "host"} and reported[1] == {"host": "host"}  # registration, first heartbeat


class CountingRuntime:
    def __init__(self, answers):
        self.answers = list(answers)
        self.calls = 0

    def images(self):
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_held_images_are_listed_at_most_every_30_s_and_a_failed_listing_keeps_the_last():
    now = [100.0]
    runtime = CountingRuntime([{"a:1": "sha256:1"}, RuntimeError("Docker Engine is not reachable"), {"b:1": "sha256:2"}])
    held = HeldImages(runtime, clock=lambda: now[0])
    assert held.claim() and not held.claim()  # one listing at a time
    assert held.refresh() == {"a:1": "sha256:1"}
    now[0] += HeldImages.REFRESH_S - 1
    assert not held.claim()
    now[0] += 1
    assert held.claim() and held.refresh() == {"a:1": "sha256:1"}  # Docker down: the last list stays
    now[0] += HeldImages.REFRESH_S
    assert held.claim() and held.refresh() == {"b:1": "sha256:2"}
    assert runtime.calls == 3


def test_a_node_whose_first_listing_fails_holds_nothing():
    held = HeldImages(CountingRuntime([RuntimeError("down")]))
    assert held.refresh() == {}


def test_the_process_runtime_holds_host():
    assert ProcessRuntime().images() == {"host": "host"}


def test_standalone_with_docker_registers_the_agents_default_image_as_the_default(host):
    import dataclasses

    from console.management.commands.standalone import DEMO_AGENT, Command
    from agent.config import load_agent_config

    config = dataclasses.replace(load_agent_config(DEMO_AGENT), runtime="docker", default_image=TEST_IMAGE)
    Command()._register_images([dataclasses.replace(config, runtime="process")])
    assert not SessionImage.objects.filter(reference=TEST_IMAGE).exists()
    Command()._register_images([config])
    assert image_default().reference == TEST_IMAGE
    SessionImage.objects.filter(reference=TEST_IMAGE).update(is_default=False)
    SessionImage.objects.create(reference=PYTORCH, is_default=True)  # an administrator's choice
    Command()._register_images([config])
    assert image_default().reference == PYTORCH


# --- the docker runtime ------------------------------------------------------------------------------------------

@pytest.mark.docker
def test_the_docker_runtime_reports_every_tag_of_its_local_images(docker_client):
    from agent.docker_runtime import DockerRuntime

    image = docker_client.images.get(TEST_IMAGE)
    extra = f"fgpu-images-test:{uuid.uuid4().hex[:8]}"
    image.tag(extra)
    try:
        held = DockerRuntime(node="n", default_image=TEST_IMAGE, client=docker_client).images()
    finally:
        docker_client.images.remove(extra)  # only the tag: the image keeps fgpu-session:test
    assert held[TEST_IMAGE] == held[extra] == image.id
    assert not any(ref.startswith("<none>") for ref in held)


@pytest.mark.docker
def test_the_docker_runtime_runs_the_specs_image_and_its_default_image_without_one(docker_client, tmp_path):
    from agent.docker_runtime import DockerRuntime
    from protocol.messages import StartSpec
    from tests.test_agent_runtime import start_spec

    runtime = DockerRuntime(node="n", default_image=TEST_IMAGE, network="none", client=docker_client)
    spec = start_spec()

    def config(wire: dict) -> dict:  # the spec as the agent decodes it from the wire
        return runtime.container_config(spec=StartSpec.decode(wire), argv=["/bin/sh"], env={}, work_dir=tmp_path)

    named = config({**spec, "image": PYTORCH})
    bare = config({**spec, "image": ""})
    old = config({k: v for k, v in spec.items() if k != "image"})
    assert (named["image"], bare["image"], old["image"]) == (PYTORCH, TEST_IMAGE, TEST_IMAGE)


# --- the command line ---------------------------------------------------------------------------------------------

def test_fgpu_launch_image_sends_it_and_the_server_takes_that_body(demo_cluster, alice, host, test_image, monkeypatch,
                                                                   tmp_path, capsys):
    from fgpu_cli import main as cli
    from tests.test_cli import SID, FakeApi, session

    api = FakeApi()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("FGPU_URL", api.url)
    monkeypatch.setenv("FGPU_TOKEN", "t0ken")
    try:
        api.routes[("POST", "/api/v1/sessions/")] = (201, session(status="PENDING", image=TEST_IMAGE))
        assert cli.main(["launch", "--fgpu", "0.5", "--image", TEST_IMAGE]) == 0
        body = api.requests[-1]["body"]
        assert capsys.readouterr().out == SID + "\n"
    finally:
        api.close()
    assert body == {"resources": {"cuda.shares": "0.5"}, "image": TEST_IMAGE}
    created = client_for(alice).post("/api/v1/sessions/", body, format="json")
    assert created.status_code == 201 and created.json()["image"] == TEST_IMAGE


def test_fgpu_launch_refuses_an_empty_image_as_bad_usage(capsys):
    from fgpu_cli import main as cli

    assert cli.main(["launch", "--image", " "]) == 2
    assert "--image" in capsys.readouterr().err


def test_fgpu_images_lists_what_the_api_answers(demo_cluster, alice, host, test_image, monkeypatch, tmp_path, capsys):
    from fgpu_cli import main as cli
    from tests.test_cli import FakeApi

    docker_node("docker-node", TEST_IMAGE)
    answer = client_for(alice).get("/api/v1/images/").json()  # what the real server answers, served as is
    api = FakeApi()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("FGPU_URL", api.url)
    monkeypatch.setenv("FGPU_TOKEN", "t0ken")
    api.routes[("GET", "/api/v1/images/")] = (200, answer)
    try:
        assert cli.main(["images"]) == 0
        table = capsys.readouterr().out.splitlines()
        assert cli.main(["images", "-o", "json"]) == 0
        as_json = json.loads(capsys.readouterr().out)
    finally:
        api.close()
    assert table[0].split() == ["IMAGE", "DEFAULT", "NAME", "ACCELERATORS", "ON", "NODES"]
    assert table[1].split()[:2] == ["host", "yes"] and table[1].endswith("demo-node")
    assert table[2].startswith(TEST_IMAGE) and "Debian minimal" in table[2] and table[2].endswith("docker-node")
    assert [i["reference"] for i in as_json] == ["host", TEST_IMAGE]

