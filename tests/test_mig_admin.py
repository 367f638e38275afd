"""The administrator's MIG view: each GPU's memory and compute slices, instances in use, idle
and stranded; fixed layouts checked against the catalog and applied."""
from __future__ import annotations

import pytest
from django.test import Client

from accelerators.allocation.errors import InvalidResourceRequest
from accelerators.mig_selectors import mig_gpu_pictures
from accelerators.mig_services import node_mig_layout_apply
from accelerators.models import GpuInstance, MigMode, Node
from sessions.scheduling.scheduler import schedule_pending
from sessions.lifecycle.services import session_report_apply
from sessions.admission.launch import session_create
from tests.test_mig_scheduling import mig_node

pytestmark = pytest.mark.django_db


def test_the_picture_shows_slices_in_use_by_whom_idle_free_and_stranded(alice, django_capture_on_commit_callbacks):
    node = mig_node()
    gpu = node.devices.get()
    GpuInstance.objects.create(node=node, parent=gpu, profile="1g.10gb", placement_start=6, placement_size=1)
    held = session_create(owner=alice, name="notebook", resources={"mig_profile": "4g.40gb"})
    with django_capture_on_commit_callbacks(execute=False):
        schedule_pending()
    [picture] = mig_gpu_pictures(node=node)
    states = [c.state for c in picture.memory]
    assert states == ["used"] * 4 + ["free", "free", "idle", "stranded"]
    assert picture.memory[0].session == "notebook (alice)" and picture.memory[6].instance == "1g.10gb@6"
    assert [c.state for c in picture.compute] == ["used"] * 4 + ["idle", "free", "free"]
    session_report_apply(session_id=str(held.pk), status="TERMINATED", reason="done", exit_code=0)
    [picture] = mig_gpu_pictures(node=node)
    assert [c.state for c in picture.memory][:4] == ["idle"] * 4


def test_the_node_admin_page_draws_the_mig_picture(admin):
    node = mig_node()
    GpuInstance.objects.create(node=node, parent=node.devices.get(), profile="3g.40gb", placement_start=4,
                               placement_size=4)
    client = Client()
    client.force_login(admin)
    page = client.get(f"/admin/accelerators/node/{node.pk}/change/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "GPU 0 · H100-80GB" in text and "slice 4: idle 3g.40gb@4" in text


def test_a_fixed_layout_is_checked_against_the_catalog_and_applied_as_idle_instances():
    node = mig_node(mode=MigMode.FIXED)
    node.mig_layout = {"0": [{"profile": "3g.40gb", "start": 4}, {"profile": "2g.20gb", "start": 0}]}
    node.save()
    node_mig_layout_apply(node=node)
    assert sorted(GpuInstance.objects.values_list("profile", "placement_start")) == [("2g.20gb", 0), ("3g.40gb", 4)]
    node.mig_layout = {"0": [{"profile": "2g.20gb", "start": 0}]}
    node_mig_layout_apply(node=node)
    assert list(GpuInstance.objects.values_list("profile", flat=True)) == ["2g.20gb"]
    node.mig_layout = {"0": [{"profile": "2g.20gb", "start": 1}]}
    with pytest.raises(InvalidResourceRequest, match="cannot start at memory slice 1"):
        node_mig_layout_apply(node=node)


def test_the_admin_form_refuses_an_overlapping_fixed_layout(admin):
    node = mig_node()
    client = Client()
    client.force_login(admin)
    url = f"/admin/accelerators/node/{node.pk}/change/"
    form = client.get(url).context["adminform"].form
    data = {k: v for k, v in form.initial.items() if v is not None and not isinstance(v, (list, dict))}
    data.update({"mig_mode": "fixed", "mig_layout": '{"0": [{"profile": "4g.40gb", "start": 0}, '
                                                   '{"profile": "2g.20gb", "start": 2}]}',
                 "resource_group": "", "plugins": "[]", "attributes": "{}"})
    for prefix in ("devices", "device_links"):
        data.update({f"{prefix}-TOTAL_FORMS": "0", f"{prefix}-INITIAL_FORMS": "0"})
    page = client.post(url, data)
    assert page.status_code == 200 and "already held" in page.content.decode()
    assert Node.objects.get(pk=node.pk).mig_mode == MigMode.DYNAMIC
