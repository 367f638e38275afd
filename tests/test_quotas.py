"""Quotas per user and per project against the real database: what counts as in use (live
allocations, PENDING sessions as what they asked), the refusal naming the quota and the
figures, the headroom for the launch dialog, the model's constraints and the admin pages.

Sessions are created and scheduled through the real services (on-commit scheduling, eager
Celery); the quotas are written after the sessions they limit, so these tests hold whether or
not `session_create` checks quotas itself.
"""
from __future__ import annotations

import html
from decimal import Decimal as D

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, transaction

from accelerators.allocation.requests import parse_resources
from common.errors import ApplicationError
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import ComputeSession, Project, Quota, SessionStatus
from sessions.policy.quotas import quota_check, quota_headroom, quota_usage
from tests.conftest import GiB, make_cluster, mock_gpu
from tests.races import race

UNIT_MEM = 4 * GiB  # make_cluster's default: 1.0 fGPU = 4 GiB and 40 SMs


@pytest.fixture
def cluster(db):
    """One node with two 8 GiB / 80-SM GPUs, 2.0 fGPU each, quantum 0.25."""
    return make_cluster(nodes={"quota-node": [mock_gpu(0), mock_gpu(1)]})


@pytest.fixture
def users(django_user_model):
    return {name: django_user_model.objects.create_user(name) for name in ("alice", "bob", "carol")}


@pytest.fixture
def alice(users):
    return users["alice"]


@pytest.fixture
def create(django_capture_on_commit_callbacks):
    """Create a session the way the API does and run its on-commit scheduling."""

    def create(owner, resources: dict) -> ComputeSession:
        with django_capture_on_commit_callbacks(execute=True):
            session = admission.session_create(owner=owner, name="", resources=resources)  # session-<n>: a free name
        session.refresh_from_db()
        return session

    return create


def check(user, resources: dict) -> None:
    """The launch's quota check (`sessions.policy.quotas.quota_check`) of this request: its claim comes
    from the one rule the launch, the preview and the dialog use."""
    quota_check(user=user, request=parse_resources(resources))


def refusal(user, resources: dict) -> ApplicationError:
    with pytest.raises(ApplicationError) as refused:
        check(user, resources)
    return refused.value


def project(name: str, *members) -> Project:
    created = Project.objects.create(name=name)
    created.members.set(members)
    return created


# --- fGPU ------------------------------------------------------------------------------------

def test_a_user_quota_on_fgpu_refuses_the_request_that_would_pass_it_naming_the_quota_and_the_figures(
        cluster, alice, create):
    assert create(alice, {"cuda.shares": "1"}).status == SessionStatus.SCHEDULED
    Quota.objects.create(user=alice, max_fgpu=D("1.5"))

    error = refusal(alice, {"cuda.shares": "0.75"})

    assert error.status == 400
    assert (error.type, error.title) == ("quota-exceeded", "Quota exceeded")
    assert error.field_errors == {"resources": ["your quota: 1.00 fGPU in use + 0.75 asked > 1.50 allowed"]}
    assert error.detail == "your quota: 1.00 fGPU in use + 0.75 asked > 1.50 allowed"


def test_a_request_that_exactly_fills_the_fgpu_quota_is_allowed(cluster, alice, create):
    create(alice, {"cuda.shares": "1"})
    Quota.objects.create(user=alice, max_fgpu=D("1.5"))

    check(alice, {"cuda.shares": "0.5"})


def test_a_project_quota_applies_to_every_member_and_counts_the_other_members_sessions(cluster, users, create):
    alice, bob, carol = users["alice"], users["bob"], users["carol"]
    vision = project("vision", alice, bob)
    create(alice, {"cuda.shares": "1.5"})
    Quota.objects.create(project=vision, max_fgpu=D(2))

    error = refusal(bob, {"cuda.shares": "1"})

    assert error.field_errors["resources"] == ['quota of project "vision": 1.50 fGPU in use + 1.00 asked > 2.00 allowed']
    check(bob, {"cuda.shares": "0.5"})
    check(carol, {"cuda.shares": "1"})  # not a member


def test_a_member_of_two_projects_is_held_to_both_and_every_quota_passed_is_named(cluster, users, create):
    alice, bob = users["alice"], users["bob"]
    vision, speech = project("vision", alice, bob), project("speech", alice)
    create(bob, {"cuda.shares": "1"})
    Quota.objects.create(project=vision, max_fgpu=D("1.5"))
    Quota.objects.create(project=speech, max_fgpu=D("0.5"))
    Quota.objects.create(user=alice, max_fgpu=D(4))

    error = refusal(alice, {"cuda.shares": "0.75"})

    assert error.field_errors["resources"] == [
        'quota of project "speech": 0.00 fGPU in use + 0.75 asked > 0.50 allowed',
        'quota of project "vision": 1.00 fGPU in use + 0.75 asked > 1.50 allowed',
    ]
    assert error.detail == "; ".join(error.field_errors["resources"])


def test_the_fgpu_equivalent_of_a_per_device_grant_counts_against_the_fgpu_quota(cluster, alice, create):
    session = create(alice, {"gpu": 1, "gpu_memory": "6G", "gpu_cores": 25})  # 6 GiB / 4 GiB → 1.5 fGPU
    assert session.status == SessionStatus.SCHEDULED
    Quota.objects.create(user=alice, max_fgpu=D(2))

    [usage] = quota_usage(user=alice)

    assert usage.fgpu == D("1.5")
    assert refusal(alice, {"cuda.shares": "1"}).field_errors["resources"] == [
        "your quota: 1.50 fGPU in use + 1.00 asked > 2.00 allowed"]


# --- sessions, devices, memory ----------------------------------------------------------------

def test_the_sessions_quota_counts_pending_sessions(db, alice, create):
    make_cluster(nodes={"small-node": [mock_gpu(0)]})  # 2.0 fGPU in all
    assert create(alice, {"cuda.shares": "2"}).status == SessionStatus.SCHEDULED
    assert create(alice, {"cuda.shares": "1"}).status == SessionStatus.PENDING
    Quota.objects.create(user=alice, max_sessions=2)

    error = refusal(alice, {"cpu": 1})

    assert error.field_errors["resources"] == ["your quota: 2 sessions running or waiting, at most 2"]
    [usage] = quota_usage(user=alice)
    assert (usage.sessions, usage.fgpu, usage.devices, usage.gpu_memory) == (2, D(3), 1, 12 * GiB)


def test_a_pending_per_device_session_counts_its_devices_and_its_bytes_but_no_memory_for_a_percentage(
        db, alice, create):
    make_cluster(nodes={"small-node": [mock_gpu(0)]})
    assert create(alice, {"gpu": 1, "gpu_memory": "6G"}).status == SessionStatus.SCHEDULED
    assert create(alice, {"gpu": 1, "gpu_memory": "4G"}).status == SessionStatus.PENDING  # 2 GiB free
    assert create(alice, {"gpu": 1, "gpu_memory_percentage": 50}).status == SessionStatus.PENDING
    Quota.objects.create(user=alice)  # limits nothing, but shows the usage

    [usage] = quota_usage(user=alice)

    assert (usage.sessions, usage.devices, usage.gpu_memory) == (3, 3, 10 * GiB)
    assert usage.fgpu == D("1.5")  # the placed one's equivalent; pending per-device ones count 0


def test_the_devices_quota_counts_distinct_devices_held(cluster, alice, create):
    first = create(alice, {"cuda.shares": "0.5"})
    second = create(alice, {"cuda.shares": "0.5"})
    devices = {a.device_id for s in (first, second) for a in s.allocations.all()}
    Quota.objects.create(user=alice, max_devices=len(devices))

    error = refusal(alice, {"gpu": 1, "gpu_memory": "1G"})

    count = len(devices)
    assert error.field_errors["resources"] == [
        f"your quota: {count} device{'s' if count > 1 else ''} in use + 1 asked > {count} allowed"]
    check(alice, {"cuda.shares": "0.5"})  # a shares request's devices are known only once placed


def test_the_gpu_memory_quota_names_sizes_in_binary_units(cluster, alice, create):
    create(alice, {"gpu": 1, "gpu_memory": "6G"})
    Quota.objects.create(user=alice, max_gpu_memory=8 * GiB)

    error = refusal(alice, {"gpu": 1, "gpu_memory": "4G"})

    assert error.field_errors["resources"] == ["your quota: 6 GiB GPU memory in use + 4 GiB asked > 8 GiB allowed"]
    check(alice, {"gpu": 1, "gpu_memory": "2G"})


def test_whole_devices_in_discrete_mode_count_as_devices_and_memory_not_as_fgpu(db, alice, create):
    make_cluster(nodes={"discrete-node": [mock_gpu(0), mock_gpu(1)]}, mode="discrete")
    assert create(alice, {"cuda.device": 1}).status == SessionStatus.SCHEDULED
    Quota.objects.create(user=alice, max_fgpu=D(1), max_devices=1)

    [usage] = quota_usage(user=alice)

    assert (usage.fgpu, usage.devices, usage.gpu_memory) == (D(0), 1, 8 * GiB)
    assert refusal(alice, {"cuda.device": 1}).field_errors["resources"] == [
        "your quota: 1 device in use + 1 asked > 1 allowed"]


def test_a_limit_the_request_asks_nothing_of_does_not_refuse_it(cluster, alice, create):
    create(alice, {"cuda.shares": "1"})
    Quota.objects.create(user=alice, max_fgpu=D("0.5"))  # lowered below what is in use

    check(alice, {"cpu": 2})  # CPU only: no fGPU asked


# --- release, headroom, no quota --------------------------------------------------------------

def test_a_terminated_session_no_longer_counts(cluster, alice, create, django_capture_on_commit_callbacks):
    session = create(alice, {"cuda.shares": "1.5"})
    Quota.objects.create(user=alice, max_fgpu=D("1.5"), max_sessions=1)
    assert len(refusal(alice, {"cuda.shares": "0.5"}).field_errors["resources"]) == 2

    with django_capture_on_commit_callbacks(execute=True):
        services.session_terminate(session=session)
        assert services.session_report_apply(session_id=str(session.pk), status=SessionStatus.TERMINATED)

    [usage] = quota_usage(user=alice)
    assert (usage.fgpu, usage.devices, usage.gpu_memory, usage.sessions) == (D(0), 0, 0, 0)
    check(alice, {"cuda.shares": "1.5"})


def test_a_cancelled_pending_session_no_longer_counts(db, alice, create):
    make_cluster(nodes={"small-node": [mock_gpu(0)]})
    create(alice, {"cuda.shares": "2"})
    waiting = create(alice, {"cuda.shares": "1"})
    Quota.objects.create(user=alice, max_sessions=2)

    services.session_terminate(session=waiting)

    assert waiting.status == SessionStatus.CANCELLED
    check(alice, {"cuda.shares": "0.25"})


def test_headroom_is_the_smallest_allowance_left_over_all_quotas(cluster, users, create):
    alice, bob = users["alice"], users["bob"]
    vision = project("vision", alice, bob)
    create(alice, {"cuda.shares": "0.5"})
    create(bob, {"cuda.shares": "0.5"})
    Quota.objects.create(user=alice, max_fgpu=D(3), max_sessions=5, max_gpu_memory=16 * GiB)
    Quota.objects.create(project=vision, max_fgpu=D(2), max_devices=4)

    assert quota_headroom(user=alice) == {"fgpu": D(1), "devices": 4 - _devices_held(vision), "gpu_memory": 14 * GiB,
                                          "sessions": 4}
    assert quota_headroom(user=users["carol"]) == {"fgpu": None, "devices": None, "gpu_memory": None, "sessions": None}


def _devices_held(of: Project) -> int:
    return len({a.device_id for s in ComputeSession.objects.filter(owner__projects=of) for a in s.allocations.all()})


def test_headroom_never_goes_below_zero(cluster, alice, create):
    create(alice, {"cuda.shares": "1"})
    Quota.objects.create(user=alice, max_fgpu=D("0.5"))

    assert quota_headroom(user=alice)["fgpu"] == D(0)


def test_a_user_without_any_quota_is_unlimited(cluster, alice, create):
    create(alice, {"cuda.shares": "2"})

    check(alice, {"cuda.shares": "2"})
    assert quota_usage(user=alice) == []


def test_usage_lists_the_user_s_own_quota_first_then_the_projects_by_name(cluster, alice):
    Quota.objects.create(project=project("zeta", alice))
    Quota.objects.create(project=project("alpha", alice))
    Quota.objects.create(user=alice)

    assert [u.quota.subject for u in quota_usage(user=alice)] == ['user "alice"', 'project "alpha"', 'project "zeta"']


# --- the model --------------------------------------------------------------------------------

def test_a_quota_is_for_exactly_one_user_or_one_project(db, alice):
    vision = project("vision", alice)
    for kwargs in ({}, {"user": alice, "project": vision}):
        with pytest.raises(ValidationError, match="exactly one"):
            Quota(**kwargs).full_clean()
        with pytest.raises(IntegrityError), transaction.atomic():
            Quota.objects.create(**kwargs)


def test_a_user_or_a_project_has_at_most_one_quota(db, alice):
    Quota.objects.create(user=alice)
    with pytest.raises(IntegrityError), transaction.atomic():
        Quota.objects.create(user=alice)
    with pytest.raises(ValidationError, match="already has a quota"):
        Quota(user=alice).full_clean()


def test_negative_limits_are_refused(db, alice):
    with pytest.raises(ValidationError, match="cannot be negative"):
        Quota(user=alice, max_fgpu=D("-1")).full_clean()
    with pytest.raises(IntegrityError), transaction.atomic():
        Quota.objects.create(user=alice, max_gpu_memory=-1)


# --- admin ------------------------------------------------------------------------------------

def test_the_quota_admin_list_shows_each_limit_next_to_what_is_in_use(cluster, users, create, admin_client):
    vision = project("vision", users["alice"], users["bob"])
    create(users["alice"], {"cuda.shares": "1.5"})
    Quota.objects.create(project=vision, max_fgpu=D(2), max_gpu_memory=8 * GiB)

    page = html.unescape(admin_client.get("/admin/compute_sessions/quota/").content.decode())

    assert 'project "vision"' in page
    assert "1.50 / 2.00" in page
    assert "6 GiB / 8 GiB" in page
    assert "1 / unlimited" in page  # sessions


def test_the_quota_admin_form_takes_gpu_memory_as_a_binary_size(db, alice, admin_client):
    response = admin_client.post("/admin/compute_sessions/quota/add/", {
        "user": alice.pk, "project": "", "max_fgpu": "1.5", "max_devices": "", "max_gpu_memory": "40G",
        "max_sessions": "3"})

    assert response.status_code == 302, response.content.decode()[:2000]
    quota = Quota.objects.get(user=alice)
    assert (quota.max_fgpu, quota.max_devices, quota.max_gpu_memory, quota.max_sessions) == (D("1.5"), None, 40 * GiB, 3)
    assert 'value="40 GiB"' in admin_client.get(f"/admin/compute_sessions/quota/{quota.pk}/change/").content.decode()


def test_the_project_admin_edits_members_with_a_filter_widget(db, users, admin_client):
    response = admin_client.post("/admin/compute_sessions/project/add/", {
        "name": "vision", "description": "", "members": [users["alice"].pk, users["bob"].pk], "share_weight": 1})

    assert response.status_code == 302
    assert set(Project.objects.get(name="vision").members.values_list("username", flat=True)) == {"alice", "bob"}
    assert "selectfilter" in admin_client.get("/admin/compute_sessions/project/add/").content.decode().lower()


def test_the_session_admin_lists_sessions_read_only(cluster, alice, create, admin_client):
    session = create(alice, {"cuda.shares": "0.5"})

    page = html.unescape(admin_client.get("/admin/compute_sessions/computesession/").content.decode())

    assert "0.50 fGPU · 1 core · 1 GiB" in page
    assert "quota-node" in page and "alice" in page and "SCHEDULED" in page
    assert admin_client.get("/admin/compute_sessions/computesession/add/").status_code == 403
    change = admin_client.post(f"/admin/compute_sessions/computesession/{session.pk}/change/", {"name": "renamed"})
    assert change.status_code == 403
    assert admin_client.post(f"/admin/compute_sessions/computesession/{session.pk}/delete/",
                             {"post": "yes"}).status_code == 403
    session.refresh_from_db()
    assert session.name == "session-1"


# --- concurrency ------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_simultaneous_launches_of_one_project_check_the_quota_one_after_the_other(django_user_model):
    assert connection.vendor == "postgresql"
    make_cluster(nodes={"quota-node": [mock_gpu(0), mock_gpu(1)]})
    members = [django_user_model.objects.create_user(f"member{i}") for i in range(8)]
    vision = project("vision", *members)
    Quota.objects.create(project=vision, max_sessions=1)

    def launch(user):
        with transaction.atomic():  # as session_create does: check and write in one transaction
            check(user, {"cuda.shares": "0.25"})
            admission.session_create(owner=user, name="s", resources={"cuda.shares": "0.25"})

    seen = race(launch, members, name="launch", join_s=60)
    threads, refused, errors = seen.threads, seen.refused, seen.errors

    assert not any(thread.is_alive() for thread in threads), "a launching thread is stuck (deadlock?)"
    assert errors == []
    assert ComputeSession.objects.count() == 1
    assert len(refused) == len(members) - 1
    assert {e.type for e in refused} == {"quota-exceeded"}


def test_session_create_refuses_a_launch_over_the_user_s_fgpu_quota_and_the_slider_respects_it(db, django_user_model):
    from decimal import Decimal

    from common.errors import ApplicationError
    from sessions.admission.launch import launch_options
    from sessions.models import ComputeSession, Quota
    from sessions.admission.launch import session_create
    from tests.conftest import make_cluster, mock_gpu

    make_cluster(nodes={"quota-node": [mock_gpu(0)]})
    user = django_user_model.objects.create_user("capped")
    Quota.objects.create(user=user, max_fgpu=Decimal("0.5"))
    [slot] = launch_options(user=user)["slots"]
    assert slot["max_now"] == "0.50"

    with pytest.raises(ApplicationError) as refused:
        session_create(owner=user, name="big", resources={"cuda.shares": "1.0"})
    assert refused.value.type == "quota-exceeded"
    assert "your quota" in refused.value.detail and "0.50 allowed" in refused.value.detail
    assert not ComputeSession.objects.exists()


def test_the_dialog_s_maximum_comes_from_the_launch_s_claim_rule_gpu_memory_and_sessions_included(cluster, alice):
    """The slider's maximum is what the launch would allow: 1.0 fGPU claims 4 GiB, so a 6 GiB
    GPU-memory quota caps it at 1.50 (and a launch of 1.75 is refused); no session left caps it at 0
    (before issue 19 the dialog read the fGPU headroom only and offered the whole node)."""
    from sessions.admission.launch import launch_options

    quota = Quota.objects.create(user=alice, max_gpu_memory=6 * GiB)
    [slot] = launch_options(user=alice)["slots"]
    assert (slot["max_now"], slot["quota_max"], slot["quota_limit"], slot["free_now"]) == ("1.50", "1.50",
                                                                                          "gpu_memory", "4.00")
    check(alice, {"cuda.shares": slot["max_now"]})
    assert refusal(alice, {"cuda.shares": "1.75"}).type == "quota-exceeded"

    quota.max_sessions = 0
    quota.save()
    [slot] = launch_options(user=alice)["slots"]
    assert (slot["max_now"], slot["quota_limit"]) == ("0.00", "sessions")
