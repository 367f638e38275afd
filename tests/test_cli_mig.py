"""`fgpu mig profiles` and `fgpu mig layout`: human tables and `--output json` over what the real
API answers (the MIG endpoints' JSON, taken from Django with a MIG node in the database and served
by the small HTTP server of test_cli.py), the query each command sends, and one-line errors."""
from __future__ import annotations

import json

import pytest
from django.utils import timezone

from accelerators.models import GpuInstance
from fgpu_cli import main as cli
from fgpu_cli.mig import profiles_text
from sessions.admission.launch import session_create
from tests.conftest import client_for
from tests.test_cli import api, one_line_error  # noqa: F401 (fixture)
from tests.test_mig_scheduling import end, mig_node, schedule

pytestmark = pytest.mark.django_db


def serve(fake, user, path: str, query: dict | None = None, *, as_path: str | None = None) -> dict:
    """Answer `as_path` (default `path`) on the fake server with what the real API answers `user`."""
    response = client_for(user).get(path, query or {})
    fake.routes[("GET", as_path or path)] = (response.status_code, response.json())
    return response.json()


@pytest.fixture
def mig_cluster(alice, django_capture_on_commit_callbacks):
    """mig-node's H100-80GB: alice's notebook on a 3g.40gb, an idle 1g.10gb, an unknown 1g.10gb at 6."""
    node = mig_node()
    GpuInstance.objects.create(node=node, parent=node.devices.get(), profile="1g.10gb", placement_start=6,
                               placement_size=1, uuid="MIG-stranger", unknown_since=timezone.now())
    small = session_create(owner=alice, name="small", resources={"mig_profile": "1g.10gb"})
    schedule(django_capture_on_commit_callbacks)
    end(small)
    session_create(owner=alice, name="notebook", resources={"mig_profile": "3g.40gb"})
    schedule(django_capture_on_commit_callbacks)
    return node


def test_mig_profiles_prints_a_row_per_profile_and_sends_the_model(api, alice, capsys):  # noqa: F811
    serve(api, alice, "/api/v1/mig/profiles/", {"model": "H100"})

    assert cli.main(["mig", "profiles", "--model", "H100"]) == 0

    assert api.requests[-1]["query"]["model"] == "H100"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["MODEL", "SOURCE", "PROFILE", "ID", "COMPUTE", "MEMORY", "SLICES", "MEMORY", "SMs",
                                "MAX", "STARTS"]
    row = next(line for line in lines if " 1g.20gb " in line).split()
    assert row[:2] == ["H100-80GB", "built-in"] and row[3:7] == ["15", "1/7", "2/8", "19.62"]
    assert row[-3:] == ["26", "4", "0,2,4,6"]
    assert next(line for line in lines if " 1g.10gb " in line).split()[-1] == "0-6"


def test_mig_profiles_json_is_the_apis_catalogs(api, alice, capsys):  # noqa: F811
    answer = serve(api, alice, "/api/v1/mig/profiles/")

    assert cli.main(["mig", "profiles", "-o", "json"]) == 0

    assert json.loads(capsys.readouterr().out) == answer["results"]


def test_an_unknown_model_is_one_line_from_the_server_and_exit_1(api, alice, capsys):  # noqa: F811
    serve(api, alice, "/api/v1/mig/profiles/", {"model": "RTX 4090"})

    assert cli.main(["mig", "profiles", "--model", "RTX 4090"]) == 1

    assert "'RTX 4090' is not a MIG-capable GPU model" in one_line_error(capsys.readouterr().err)


def test_mig_layout_draws_each_gpus_slices_and_lists_its_instances(api, alice, mig_cluster, capsys):  # noqa: F811
    serve(api, alice, "/api/v1/mig/layouts/")

    assert cli.main(["mig", "layout"]) == 0

    out = capsys.readouterr().out
    assert "mig-node GPU 0 · H100-80GB · MIG dynamic · catalog built-in" in out
    slice_map = out.splitlines()[2].split()
    assert slice_map.count("U") == 4 and slice_map.count("I") == 1 and slice_map[6] == "?"
    notebook = next(line for line in out.splitlines() if line.startswith("3g.40gb"))
    assert "in use" in notebook and "notebook (alice)" in notebook
    assert "unknown" in next(line for line in out.splitlines() if "MIG-stranger" in line)
    assert "free compute slices: 2 of 7" in out and "U in use" in out


def test_another_user_sees_the_instance_in_use_but_not_whose(api, bob, mig_cluster, capsys):  # noqa: F811
    serve(api, bob, "/api/v1/mig/layouts/")

    assert cli.main(["mig", "layout"]) == 0

    out = capsys.readouterr().out
    assert "in use" in next(line for line in out.splitlines() if line.startswith("3g.40gb"))
    assert "notebook" not in out and "alice" not in out


def test_mig_layout_of_one_node_shows_its_mode_and_fixed_layout(api, staff, mig_cluster, capsys):  # noqa: F811
    mig_cluster.mig_mode, mig_cluster.mig_layout = "fixed", {"0": [{"profile": "1g.10gb", "start": 5}]}
    mig_cluster.save()
    serve(api, staff, "/api/v1/nodes/mig-node/mig/")

    assert cli.main(["mig", "layout", "mig-node"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Node mig-node: MIG fixed\nfixed layout of GPU 0: 1g.10gb@5\n")

    assert cli.main(["mig", "layout", "mig-node", "--output", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus"][0]["node"] == "mig-node"


def test_a_node_that_does_not_exist_is_one_line_and_exit_1(api, alice, capsys):  # noqa: F811
    serve(api, alice, "/api/v1/nodes/nowhere/mig/")

    assert cli.main(["mig", "layout", "nowhere"]) == 1

    assert one_line_error(capsys.readouterr().err) == "no node 'nowhere'"


def test_no_mig_gpu_says_so(api, alice, capsys):  # noqa: F811
    serve(api, alice, "/api/v1/mig/layouts/")

    assert cli.main(["mig", "layout"]) == 0
    assert capsys.readouterr().out.strip() == "No MIG-capable GPU."


def test_mig_without_a_subcommand_is_a_usage_error(api, capsys):  # noqa: F811
    with pytest.raises(SystemExit) as exited:
        cli.main(["mig"])
    assert exited.value.code == 2 and "MIG_COMMAND" in capsys.readouterr().err


def test_an_assumed_memory_figure_is_marked():
    text = profiles_text([{"model": "B200-180GB", "source": "built-in", "profiles": [
        {"name": "1g.23gb", "profile_id": 19, "compute_slices": 1, "memory_slices": 1, "memory": 22 << 30,
         "memory_assumed": True, "sm_count": 0, "max_instances": 7, "placements": [{"start": 0, "size": 1}]}]}])
    assert "22 GiB *" in text and text.endswith("* memory derived, not captured from a GPU")
    assert text.splitlines()[1].split()[-3] == "?"  # SMs unknown


def test_a_profile_whose_placements_lack_starts_still_gets_its_row():
    # mypy found it: three or more placements without a "start" made the STARTS column raise (range(None)).
    placements = [{"size": 1}, {"size": 1}, {"size": 1}]
    text = profiles_text([{"model": "A100-40GB", "source": "nvml", "profiles": [
        {"name": "1g.5gb", "profile_id": 19, "compute_slices": 1, "memory_slices": 1, "memory": 5 << 30,
         "sm_count": 14, "max_instances": 7, "placements": placements}]}])
    assert text.splitlines()[1].split()[:3] == ["A100-40GB", "nvml", "1g.5gb"]
