"""The admin speaks the field's language (issue 18.5): its name, sizes in GiB with the bytes on
hover, times without microseconds, the field's words for labels, one token section, the
scheduler's bookkeeping explained, no fGPU offered on a GPU serving MIG, and a configuration
file imported from the browser with its warnings and errors, all or nothing."""
from __future__ import annotations

import re
from decimal import Decimal

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from accelerators.models import FractionalSettings, MigMode, Node, SlotFormat
from accounts.services import api_token_create
from sessions.models import Quota
from sessions.admission.launch import session_create
from tests.conftest import ROOT, client_for
from tests.test_mig_scheduling import mig_node

pytestmark = pytest.mark.django_db

ISO_WITH_MICROSECONDS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+")


def admin_client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def page_text(client: Client, url: str) -> str:
    answer = client.get(url)
    assert answer.status_code == 200, (url, answer.status_code)
    return answer.content.decode()


def test_the_admin_is_called_fgpu_console_administration(admin):
    text = page_text(admin_client(admin), "/admin/")
    assert "fGPU Console administration" in text and "Django administration" not in text
    assert "<title>Accelerators, sessions and people | fGPU Console admin</title>" in text


def test_the_index_names_models_in_the_fields_words_and_has_one_token_section(admin):
    text = page_text(admin_client(admin), "/admin/")
    assert "GPU instances" in text and "Gpu instances" not in text
    assert "Auth Token" not in text and "/admin/authtoken/" not in text  # DRF's own section is gone
    assert "API tokens" in text and "Login tokens (fgpu login)" in text  # both kinds, in Accounts


def test_sizes_show_in_binary_units_with_the_exact_bytes_on_hover(admin, demo_cluster, alice):
    client = admin_client(admin)
    settings = FractionalSettings.objects.get(slot_name="cuda")
    text = page_text(client, "/admin/accelerators/fractionalsettings/")
    assert '<span class="size" title="4,294,967,296 bytes">4 GiB</span>' in text
    assert "4294967296" not in text

    form = page_text(client, f"/admin/accelerators/fractionalsettings/{settings.pk}/change/")
    assert 'value="4 GiB"' in form and "Memory in 1.0 fGPU" in form and "SMs in 1.0 fGPU" in form

    node = Node.objects.get(name="demo-node")
    text = page_text(client, f"/admin/accelerators/node/{node.pk}/change/")
    assert '<span class="size" title="8,589,934,592 bytes">8 GiB</span>' in text  # the GPU
    assert "CPU cores" in text and "NUMA node" in text and "Cpu count" not in text

    session = session_create(owner=alice, name="nb", resources={"cuda.shares": "0.5", "mem": "1G"})
    text = page_text(client, f"/admin/compute_sessions/computesession/{session.pk}/change/")
    assert '<span class="size" title="1,073,741,824 bytes">1 GiB</span>' in text  # host memory
    assert "1073741824" not in text


def test_a_fractional_settings_form_takes_memory_as_a_binary_size(admin, demo_cluster):
    settings = FractionalSettings.objects.get(slot_name="cuda")
    answer = admin_client(admin).post(f"/admin/accelerators/fractionalsettings/{settings.pk}/change/", {
        "slot_name": "cuda", "allocation_mode": "fractional", "unit_mem": "2.5G", "unit_proc": "40",
        "quantum_size": "0.25"})
    assert answer.status_code == 302, answer.content.decode()[:2000]
    settings.refresh_from_db()
    assert settings.unit_mem == 2560 << 20

    answer = admin_client(admin).post(f"/admin/accelerators/fractionalsettings/{settings.pk}/change/", {
        "slot_name": "cuda", "allocation_mode": "fractional", "unit_mem": "1.1", "unit_proc": "40",
        "quantum_size": "0.25"})
    assert answer.status_code == 200 and "unit suffix" in answer.content.decode()


def test_times_show_to_the_second_without_microseconds(admin, demo_cluster, alice):
    client = admin_client(admin)
    session = session_create(owner=alice, name="nb", resources={"cuda.shares": "0.5"})
    for url in (f"/admin/compute_sessions/computesession/{session.pk}/change/",
                "/admin/compute_sessions/computesession/",
                f"/admin/accelerators/node/{Node.objects.get().pk}/change/",
                "/admin/accelerators/node/", "/admin/accelerators/fractionalsettings/"):
        text = page_text(client, url)
        assert not ISO_WITH_MICROSECONDS.search(text), url
        assert re.search(r'<time datetime="[^"]+" title="[^"]+ ago">\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC</time>', text), url


def test_a_session_page_explains_the_schedulers_bookkeeping_instead_of_bare_fields(admin, demo_cluster, alice):
    session = session_create(owner=alice, name="nb", resources={"cuda.shares": "0.5"})
    text = page_text(admin_client(admin), f"/admin/compute_sessions/computesession/{session.pk}/change/")
    assert "Internals (the scheduler&#x27;s bookkeeping)" in text
    assert "later sessions that started past it while it waited (backfill)" in text
    assert ">Overtaken:<" not in text and "Request spec" not in text
    assert "0.50 fGPU" in text and "an interactive shell" in text


def test_quota_labels_say_fgpu(admin):
    text = page_text(admin_client(admin), "/admin/compute_sessions/quota/add/")
    assert "Max fGPU" in text and "Max fgpu" not in text


def test_login_tokens_are_listed_by_their_first_characters_and_revoked_from_the_users_list(admin, alice):
    from accounts.models import LoginToken
    from accounts.services import login_token_issue

    key = login_token_issue(user=alice)
    api_token_create(user=alice, name="laptop")
    client = admin_client(admin)
    text = page_text(client, "/admin/accounts/logintoken/")
    assert f"{key[:8]}…" in text and key not in text  # only its digest is stored; no links, no check boxes
    text = page_text(client, "/admin/accounts/apitoken/")
    assert "laptop" in text and "never" in text
    answer = client.post("/admin/auth/user/", {"action": "revoke_login_tokens", "_selected_action": [alice.pk]})
    assert answer.status_code == 302
    assert not LoginToken.objects.filter(user=alice).exists()
    assert client_for(None).get("/api/v1/me/", HTTP_AUTHORIZATION=f"Token {key}").status_code == 401


def test_a_gpu_serving_mig_offers_no_fgpu_in_the_admin_nor_the_api(admin):
    node = mig_node(mode=MigMode.FIXED)
    FractionalSettings.objects.update(allocation_mode="fractional")
    gpu = node.devices.get()
    text = page_text(admin_client(admin), f"/admin/accelerators/node/{node.pk}/change/")
    assert "none (MIG fixed layout)" in text
    assert "3.30" not in text
    device = client_for(admin).get(f"/api/v1/devices/?node={node.name}").json()["results"][0]
    assert (device["capacity_fgpu"], device["free_fgpu"]) == (None, None)

    node.mig_mode = MigMode.OFF
    node.save(update_fields=["mig_mode"])
    device = client_for(admin).get(f"/api/v1/devices/?node={node.name}").json()["results"][0]
    assert Decimal(device["free_fgpu"]) > 0, device
    text = page_text(admin_client(admin), f"/admin/accelerators/device/{gpu.pk}/change/")
    assert "none (MIG" not in text


# --- the configuration upload page -----------------------------------------------------------------

IMPORT_URL = "/admin/accelerators/slotformat/import/"
MOCK_TOML = (ROOT / "demo" / "mock-accelerator.toml").read_bytes()


def upload(client: Client, name: str, data: bytes, **fields) -> str:
    answer = client.post(IMPORT_URL, {"file": SimpleUploadedFile(name, data), **fields})
    assert answer.status_code == 200
    return answer.content.decode()


def test_the_slot_format_list_links_to_the_import_page(admin):
    text = page_text(admin_client(admin), "/admin/accelerators/slotformat/")
    assert f'href="{IMPORT_URL}"' in text
    text = page_text(admin_client(admin), "/admin/accelerators/fractionalsettings/")
    assert 'href="/admin/accelerators/fractionalsettings/import/"' in text


def test_an_uploaded_toml_with_a_node_imports_formats_and_devices(admin):
    text = upload(admin_client(admin), "mock.toml", MOCK_TOML, node="gpu-node-9")
    assert "Imported.</strong>" in text and "Imported mock.toml (mock-accelerator TOML; slot cuda)." in text
    assert "fgpu-import-" not in text  # the temporary folder is never shown
    assert SlotFormat.objects.filter(slot_name="cuda").count() == 2
    assert Node.objects.get(name="gpu-node-9").devices.count() == 1


def test_check_only_reports_what_an_import_would_do_and_writes_nothing(admin):
    text = upload(admin_client(admin), "mock.toml", MOCK_TOML, node="gpu-node-9", check_only="on")
    assert "Checked only — nothing was imported." in text and "Would import mock.toml" in text
    assert "node gpu-node-9: 1 devices" in text
    assert not SlotFormat.objects.exists() and not Node.objects.exists()


def test_an_uploaded_file_with_an_error_imports_nothing_and_names_the_field(admin):
    broken = MOCK_TOML.replace(b'memory_size = "8G"', b'memory_size = "1.1"')
    assert broken != MOCK_TOML
    text = upload(admin_client(admin), "broken.toml", broken, node="gpu-node-9")
    assert "Nothing was imported." in text
    assert "broken.toml: <code>devices[0].memory_size</code>: &#x27;1.1&#x27;: a fractional size needs a unit suffix" \
        in text
    assert not SlotFormat.objects.exists() and not Node.objects.exists()


def test_an_etcd_json_upload_shows_the_importers_warnings(admin):
    data = (b'{"config": {"plugins": {"accelerator": {"cuda": {"allocation_mode": "fractional", '
            b'"unit_mem": "2G", "unit_proc": 10, "reserved_memory": "1G"}}}}}')
    text = upload(admin_client(admin), "etcd.json", data)
    assert "Imported etcd.json (etcd JSON; slot cuda)." in text
    assert re.search(r'<ul id="import-warnings"><li>etcd\.json: [^<]*reserved_memory', text), text
    settings = FractionalSettings.objects.get(slot_name="cuda")
    assert (settings.allocation_mode, settings.unit_mem, settings.unit_proc) == ("fractional", 2 << 30, 10)


def test_the_import_page_is_for_administrators_who_may_change_the_settings(django_user_model):
    clerk = django_user_model.objects.create_user("clerk", is_staff=True)
    assert admin_client(clerk).get(IMPORT_URL).status_code == 403
    assert Client().get(IMPORT_URL).status_code == 302  # to the login page


def test_quota_rows_still_show_memory_as_a_binary_size(admin, alice):
    Quota.objects.create(user=alice, max_gpu_memory=40 << 30)
    text = page_text(admin_client(admin), "/admin/compute_sessions/quota/")
    assert "0 B / 40 GiB" in text


# --- the fixed MIG layout editor --------------------------------------------------------------------

def test_the_node_page_edits_the_fixed_layout_in_rows_with_each_gpus_catalog(admin):
    node = mig_node(mode=MigMode.FIXED)
    text = page_text(admin_client(admin), f"/admin/accelerators/node/{node.pk}/change/")
    assert 'class="mig-layout-editor"' in text and f'data-check-url="/admin/accelerators/node/{node.pk}/mig-check/"' in text
    catalog = re.search(r'<script id="id_mig_layout-gpus" type="application/json">(.*?)</script>', text).group(1)
    assert '"name": "3g.40gb", "starts": [0, 4]' in catalog
    assert '<textarea name="mig_layout"' in text  # the JSON the script writes, and the form reads
    assert "mig-cell mig-free" in text and "background:" not in text.split('class="mig-legend"')[0][-3000:]


def check_layout(client: Client, node: Node, layout) -> dict:
    answer = client.post(f"/admin/accelerators/node/{node.pk}/mig-check/", data={"mig_layout": layout},
                         content_type="application/json")
    assert answer.status_code == 200
    return answer.json()


def test_the_layout_check_answers_as_saving_would_and_writes_nothing(admin):
    node = mig_node(mode=MigMode.DYNAMIC)
    client = admin_client(admin)
    assert check_layout(client, node, {"0": [{"profile": "3g.40gb", "start": 4}, {"profile": "2g.20gb", "start": 0}]}) \
        == {"ok": True, "error": ""}
    answer = check_layout(client, node, {"0": [{"profile": "4g.40gb", "start": 0}, {"profile": "2g.20gb", "start": 2}]})
    assert answer["ok"] is False and "memory slice 2 is already held by 4g.40gb@0" in answer["error"]
    answer = check_layout(client, node, {"0": [{"profile": "2g.20gb", "start": 1}]})
    assert "2g.20gb cannot start at memory slice 1 (allowed: 0, 2, 4)" in answer["error"]
    assert check_layout(client, node, {"7": []})["error"] == "mig_layout: node mig-node has no GPU '7'"
    node.refresh_from_db()
    assert (node.mig_mode, node.mig_layout) == (MigMode.DYNAMIC, {})


def test_only_those_who_may_change_nodes_may_ask_the_layout_check(admin, django_user_model):
    node = mig_node()
    clerk = django_user_model.objects.create_user("clerk", is_staff=True)
    answer = admin_client(clerk).post(f"/admin/accelerators/node/{node.pk}/mig-check/", data={}, content_type="application/json")
    assert answer.status_code == 403
    assert admin_client(admin).get(f"/admin/accelerators/node/{node.pk}/mig-check/").status_code == 405


def test_the_capacity_per_gpu_model_says_when_every_such_gpu_serves_mig(admin):
    mig_node(mode=MigMode.FIXED)
    FractionalSettings.objects.update(allocation_mode="fractional")
    text = page_text(admin_client(admin), "/admin/accelerators/fractionalsettings/")
    assert re.search(r"1 physical GPU = [\d.]+ fGPU \(none now: every such GPU serves MIG\)", text), text
