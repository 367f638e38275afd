"""A node's sharing settings have one write (accelerators.services.node_settings_update) and one
rule for what follows a change (`node_settings_saved`: a scheduler pass once it commits), which
the API and the admin form share (issue 19.5): the admin's change of the split count used to
save without the pass the API asked for, so a session it made room for waited for beat's next
pass."""
from __future__ import annotations

from html.parser import HTMLParser

import pytest
from django.test import Client

from accelerators.models import Node
from accelerators.services import node_capacity_changed, node_settings_update
from sessions.models import ComputeSession, SessionStatus
from sessions.scheduling.scheduler import schedule_pending
from sessions.admission.launch import session_create
from tests.conftest import client_for

pytestmark = pytest.mark.django_db


class _FormFields(HTMLParser):
    """The values a browser would post for the form with id `form_id` (inputs, checked boxes,
    selected options, text areas), as a dict of lists."""

    def __init__(self, form_id: str) -> None:
        super().__init__()
        self.form_id, self.inside, self.fields = form_id, False, {}
        self._select: str | None = None
        self._textarea: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "form":
            self.inside = a.get("id") == self.form_id
        if not self.inside or "name" not in a and tag != "option":
            return
        if tag == "input" and a.get("type") not in ("submit", "button", "file") and (
                a.get("type") not in ("checkbox", "radio") or "checked" in a):
            self.fields.setdefault(a["name"], []).append(a.get("value") or "")
        elif tag == "select":
            self._select = a["name"]
        elif tag == "option" and self._select and "selected" in a:
            self.fields.setdefault(self._select, []).append(a.get("value") or "")
        elif tag == "textarea":
            self._textarea = a["name"]
            self.fields.setdefault(a["name"], []).append("")

    def handle_endtag(self, tag):
        if tag == "form":
            self.inside = False
        elif tag == "select":
            self._select = None
        elif tag == "textarea":
            self._textarea = None

    def handle_data(self, data):
        if self._textarea:
            self.fields[self._textarea][-1] += data


def admin_form(client: Client, url: str, form_id: str) -> dict:
    page = client.get(url)
    assert page.status_code == 200, page.status_code
    parser = _FormFields(form_id)
    parser.feed(page.content.decode())
    assert parser.fields, f"no form {form_id} on {url}"
    return parser.fields


@pytest.fixture
def one_slot_node(demo_cluster, alice):
    """demo-node shared by one session at most (split count 1): alice's first 0.25 fGPU session
    is placed, her second waits for the split count."""
    Node.objects.filter(name="demo-node").update(device_split_count=1)
    first = session_create(owner=alice, name="first", resources={"cuda.shares": "0.25", "mem": "64M"})
    second = session_create(owner=alice, name="second", resources={"cuda.shares": "0.25", "mem": "64M"})
    schedule_pending()
    statuses = dict(ComputeSession.objects.values_list("name", "status"))
    assert statuses == {"first": SessionStatus.SCHEDULED, "second": SessionStatus.PENDING}, statuses
    return first, second


def test_raising_the_split_count_in_the_admin_starts_the_session_it_made_room_for(
        one_slot_node, admin, django_capture_on_commit_callbacks):
    _, second = one_slot_node
    client = Client()
    client.force_login(admin)
    node = Node.objects.get(name="demo-node")
    url = f"/admin/accelerators/node/{node.pk}/change/"
    form = admin_form(client, url, "node_form")
    form["device_split_count"] = ["2"]

    with django_capture_on_commit_callbacks(execute=True):
        answer = client.post(url, form)

    assert answer.status_code == 302, answer.content.decode()[:2000]
    assert Node.objects.get(name="demo-node").device_split_count == 2
    second.refresh_from_db()
    assert second.status == SessionStatus.SCHEDULED, second.status_reason


def test_raising_the_split_count_through_the_api_starts_it_by_the_same_write(
        one_slot_node, admin, django_capture_on_commit_callbacks):
    _, second = one_slot_node

    with django_capture_on_commit_callbacks(execute=True):
        answer = client_for(admin).patch("/api/v1/nodes/demo-node/", {"device_split_count": 2}, format="json",
                                          HTTP_IF_MATCH="*")

    assert answer.status_code == 200, answer.content
    assert answer.json()["device_split_count"] == 2
    second.refresh_from_db()
    assert second.status == SessionStatus.SCHEDULED, second.status_reason


def test_an_admin_save_that_changes_no_sharing_setting_asks_for_no_pass(
        one_slot_node, admin, django_capture_on_commit_callbacks):
    sent = []
    node_capacity_changed.connect(lambda sender, node, **kw: sent.append(node.name), weak=False, dispatch_uid="probe")
    try:
        client = Client()
        client.force_login(admin)
        node = Node.objects.get(name="demo-node")
        url = f"/admin/accelerators/node/{node.pk}/change/"
        with django_capture_on_commit_callbacks(execute=True):
            assert client.post(url, admin_form(client, url, "node_form")).status_code == 302
        with django_capture_on_commit_callbacks(execute=True):
            node_settings_update(node=node, changes={"memory_scaling": node.memory_scaling})
    finally:
        node_capacity_changed.disconnect(dispatch_uid="probe")

    assert sent == ["demo-node"]  # the service's write only


def test_the_write_refuses_what_is_not_a_sharing_setting(demo_cluster):
    node = Node.objects.get(name="demo-node")

    with pytest.raises(ValueError, match="not a node sharing setting: name"):
        node_settings_update(node=node, changes={"name": "other"})
    assert Node.objects.get(pk=node.pk).name == "demo-node"
