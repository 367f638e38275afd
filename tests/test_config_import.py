"""Importing Backend.AI accelerator configuration: mock-accelerator TOML and etcd-style JSON.

The three Backend.AI example files live, unchanged, in tests/fixtures/backendai/ (see its
README); tests that need another file write it under tmp_path.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from decimal import Decimal
from io import StringIO
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.urls import reverse

from accelerators.config_import import (
    ConfigError,
    FractionalSpec,
    import_accelerator_config,
    parse_etcd_json,
    parse_mock_accelerator_toml,
)
from accelerators.models import Device, FractionalSettings, Node, SlotFormat
from accelerators.plugins import mock as mock_plugin

FIXTURES = Path(__file__).parent / "fixtures" / "backendai"
MOCK = FIXTURES / "mock-accelerator.toml"
MIG = FIXTURES / "cuda-mock-mig.toml"
ROCM = FIXTURES / "rocm-mock.toml"
REPO_ROOT = Path(__file__).resolve().parent.parent

GiB = 1 << 30
MiB = 1 << 20

FORMATS = """
[formats.device]
display_unit = "GPU"
display_icon = "gpu1"
human_readable_name = "GPU"
description = "CUDA-capable GPU"
number_format = { binary = false, round_length = 0 }

[formats.shares]
display_unit = "fGPU"
display_icon = "gpu1"
human_readable_name = "fGPU"
description = "CUDA-capable GPU (fractional)"
number_format = { binary = false, round_length = 2 }
"""


def write_toml(tmp_path: Path, devices: list[str], *, slot: str = "cuda", plugin: str = "CUDADevice",
               extra: str = "", formats: str = FORMATS, name: str = "mock.toml") -> Path:
    """A mock-accelerator TOML with the given device inline tables (one per line)."""
    body = "\n".join(f"  {{ {device} }}," for device in devices)
    text = (
        f'slot_name = "{slot}"\ndevice_plugin_name = "{plugin}"\n{extra}\n'
        f"devices = [\n{body}\n]\n\n[attributes]\nnvidia_driver = \"535.0\"\ncuda_runtime = \"12.2\"\n{formats}"
    )
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def gpu(uuid: str = "aaaa-0001", *, memory: str = '"40G"', sms: int = 108, numa: int = 0, mig: str = "false",
        model: str = "CUDA GPU") -> str:
    return (
        f'mother_uuid = "{uuid}", model_name = "{model}", numa_node = {numa}, subproc_count = {sms}, '
        f"memory_size = {memory}, is_mig_device = {mig}"
    )


def write_json(tmp_path: Path, accelerator: dict | str, name: str = "etcd.json") -> Path:
    path = tmp_path / name
    if isinstance(accelerator, str):
        path.write_text(accelerator, encoding="utf-8")
    else:
        path.write_text(json.dumps({"config": {"plugins": {"accelerator": accelerator}}}), encoding="utf-8")
    return path


def row_counts() -> dict[str, int]:
    return {
        "slot formats": SlotFormat.objects.count(),
        "fractional settings": FractionalSettings.objects.count(),
        "nodes": Node.objects.count(),
        "devices": Device.objects.count(),
    }


# --------------------------------------------------------------------------- the three Backend.AI files


def test_the_fixture_copies_are_the_backendai_files_unchanged():
    shared = Path("/work/shared/fixtures/backendai")
    if not shared.is_dir():
        pytest.skip("the shared originals are not on this machine")
    for name in ("mock-accelerator.toml", "cuda-mock-mig.toml", "rocm-mock.toml"):
        assert (FIXTURES / name).read_bytes() == (shared / name).read_bytes(), name


def test_mock_accelerator_toml_declares_four_whole_40g_gpus():
    config = parse_mock_accelerator_toml(MOCK)

    assert config.slot_name == "cuda"
    assert config.device_plugin_name == "CUDADevice"
    assert len(config.devices) == 4
    assert [d.index for d in config.devices] == [0, 1, 2, 3]
    assert {d.memory_size for d in config.devices} == {42949672960}
    assert {d.subproc_count for d in config.devices} == {108}
    assert [d.numa_node for d in config.devices] == [0, 1, 0, 1]
    assert not any(d.is_mig_device for d in config.devices)
    assert config.devices[0].device_id == "GPU-c59395cd-ac91-4cd3-a1b0-3d2568aa2d01"
    assert config.devices[0].mother_uuid == "c59395cd-ac91-4cd3-a1b0-3d2568aa2d01"
    assert config.attributes == {"nvidia_driver": "450.0.0", "cuda_runtime": "11.0"}
    assert set(config.formats) == {"device", "shares"}
    assert config.formats["shares"].display_unit == "fGPU"
    assert config.formats["shares"].number_round_length == 2
    assert config.warnings == []


def test_cuda_mock_mig_toml_reads_mig_profiles_from_the_model_name():
    config = parse_mock_accelerator_toml(MIG)

    assert len(config.devices) == 9
    whole = [d for d in config.devices if not d.is_mig_device]
    slices = [d for d in config.devices if d.is_mig_device]
    assert len(whole) == 2
    assert [d.mig_profile for d in slices] == ["20g", "10g", "10g", "5g", "5g", "5g", "5g"]
    assert [d.memory_size for d in slices[:3]] == [20 * GiB, 10 * GiB, 10 * GiB]
    assert [d.subproc_count for d in slices] == [56, 28, 28, 14, 14, 14, 14]
    assert [d.device_id for d in slices[:4]] == [
        "MIG-c59395cd-ac91-4cd3-a1b0-3d2568aa2d03/0",
        "MIG-c59395cd-ac91-4cd3-a1b0-3d2568aa2d03/1",
        "MIG-c59395cd-ac91-4cd3-a1b0-3d2568aa2d03/2",
        "MIG-c59395cd-ac91-4cd3-a1b0-3d2568aa2d04/0",
    ]
    assert [d.index for d in slices] == [2, 3, 4, 5, 6, 7, 8]


def test_cuda_mock_mig_toml_slices_without_a_declared_gpu_get_no_parent_and_a_warning():
    config = parse_mock_accelerator_toml(MIG)

    slices = [d for d in config.devices if d.is_mig_device]
    assert {d.parent_device_id for d in slices} == {""}
    parent_warnings = [w for w in config.warnings if "is not declared" in w]
    assert len(parent_warnings) == 2  # one per mother_uuid, not one per slice
    assert "GPU-c59395cd-ac91-4cd3-a1b0-3d2568aa2d03" in parent_warnings[0]
    assert "devices[2], devices[3], devices[4]" in parent_warnings[0]


def test_cuda_mock_mig_toml_devices_table_is_imported_as_device_with_a_warning():
    config = parse_mock_accelerator_toml(MIG)

    assert set(config.formats) == {"device", "*-mig"}
    assert config.formats["device"].description == "CUDA-capable GPU"
    assert config.formats["*-mig"].description == "CUDA-capable GPU (MIG slice)"
    [devices_warning] = [w for w in config.warnings if "formats.devices" in w]
    assert "never reads" in devices_warning
    assert "imported as [formats.device]" in devices_warning
    assert any("no [formats.shares] table" in w for w in config.warnings)


def test_rocm_mock_toml_needs_no_is_mig_device_and_warns_that_fractional_mode_has_no_format():
    config = parse_mock_accelerator_toml(ROCM)

    assert config.slot_name == "rocm"
    assert config.device_plugin_name == "ROCm"
    assert len(config.devices) == 4
    assert {d.slot_name for d in config.devices} == {"rocm"}
    assert {d.model_name for d in config.devices} == {"AMD MI250"}
    assert {d.memory_size for d in config.devices} == {40 * GiB}
    assert config.attributes == {}
    assert set(config.formats) == {"device"}
    [warning] = config.warnings
    assert "fractional mode has no display format for rocm.shares" in warning


@pytest.mark.django_db
def test_importing_mock_accelerator_toml_with_a_node_writes_formats_settings_and_devices():
    report = import_accelerator_config(MOCK, node_name="gpu-node-1")

    assert sorted(report.slot_formats_created) == ["cuda.device", "cuda.shares"]
    assert report.fractional_settings_created == ["cuda"]
    assert report.device_count == 4
    node = Node.objects.get(name="gpu-node-1")
    assert node.attributes == {"nvidia_driver": "450.0.0", "cuda_runtime": "11.0"}
    assert node.plugins == ["ai.backend.accelerator.mock"]
    devices = list(node.devices.order_by("index"))
    assert [d.memory_size for d in devices] == [42949672960] * 4
    assert devices[3].device_id == "GPU-c59395cd-ac91-4cd3-a1b0-3d2568aa2d04"
    shares = SlotFormat.objects.get(slot_name="cuda", subtype="shares")
    assert shares.format_amount(Decimal("0.5")) == "0.50 fGPU"
    settings = FractionalSettings.objects.get(slot_name="cuda")
    assert (settings.allocation_mode, settings.unit_mem, settings.unit_proc) == ("discrete", 2 * GiB, 8)
    assert settings.quantum_size == Decimal("0.1")
    assert "node gpu-node-1: 4 devices" in report.summary()


@pytest.mark.django_db
def test_importing_cuda_mock_mig_toml_stores_mig_profiles_and_the_device_format():
    report = import_accelerator_config(MIG, node_name="mig-node")

    assert report.device_count == 9
    assert report.mig_device_count == 7
    node = Node.objects.get(name="mig-node")
    profiles = list(node.devices.filter(is_mig_device=True).order_by("index").values_list("mig_profile", flat=True))
    assert profiles == ["20g", "10g", "10g", "5g", "5g", "5g", "5g"]
    assert not node.devices.filter(parent__isnull=False).exists()
    assert set(SlotFormat.objects.values_list("subtype", flat=True)) == {"device", "*-mig"}
    assert any("formats.devices" in w for w in report.warnings)


@pytest.mark.django_db
def test_importing_rocm_mock_toml_creates_rocm_settings_and_only_a_device_format():
    report = import_accelerator_config(ROCM, node_name="rocm-node")

    assert report.device_count == 4
    assert list(SlotFormat.objects.values_list("slot_name", "subtype")) == [("rocm", "device")]
    assert FractionalSettings.objects.filter(slot_name="rocm").exists()
    assert Device.objects.filter(slot_name="rocm", node__name="rocm-node").count() == 4


@pytest.mark.django_db
def test_importing_a_toml_without_a_node_writes_formats_but_no_devices():
    report = import_accelerator_config(MOCK)

    assert SlotFormat.objects.count() == 2
    assert Node.objects.count() == 0
    assert Device.objects.count() == 0
    assert "devices: not imported" in report.summary()


# --------------------------------------------------------------------------- MIG parents


@pytest.mark.django_db
def test_mig_slices_link_to_the_whole_gpu_with_the_same_mother_uuid(tmp_path):
    path = write_toml(
        tmp_path,
        [
            gpu("bbbb-0001", memory='"80G"', sms=132),
            gpu("bbbb-0001", memory='"40G"', sms=66, mig="true", model="MIG-3g.40gb"),
            gpu("bbbb-0001", memory='"20G"', sms=33, mig="true", model="MIG-2g.20gb"),
            gpu("bbbb-0002", memory='"80G"', sms=132),
        ],
        extra='',
        formats=FORMATS + '\n[formats."*-mig"]\ndisplay_unit = "GPU"\ndisplay_icon = "gpu1"\n'
        'human_readable_name = "GPU"\ndescription = "MIG"\nnumber_format = { binary = false, round_length = 0 }\n',
    )

    config = parse_mock_accelerator_toml(path)
    assert [d.parent_device_id for d in config.devices] == ["", "GPU-bbbb-0001", "GPU-bbbb-0001", ""]
    assert [d.mig_profile for d in config.devices] == ["", "3g.40gb", "2g.20gb", ""]
    assert config.warnings == []

    import_accelerator_config(path, node_name="h100")
    parent = Device.objects.get(device_id="GPU-bbbb-0001")
    assert sorted(parent.mig_devices.values_list("device_id", flat=True)) == ["MIG-bbbb-0001/0", "MIG-bbbb-0001/1"]


def test_a_mother_uuid_that_already_starts_with_gpu_is_kept_as_the_device_id(tmp_path):
    path = write_toml(tmp_path, [gpu("GPU-cccc-0001"), gpu("GPU-cccc-0001", memory='"10G"', mig="true", model="MIG-1g")])

    config = parse_mock_accelerator_toml(path)

    assert config.devices[0].device_id == "GPU-cccc-0001"
    assert config.devices[1].device_id == "MIG-GPU-cccc-0001/0"
    assert config.devices[1].parent_device_id == "GPU-cccc-0001"


def test_mig_slices_larger_than_their_gpu_get_a_warning(tmp_path):
    path = write_toml(
        tmp_path,
        [gpu("dddd", memory='"10G"'), gpu("dddd", memory='"8G"', mig="true", model="MIG-a"),
         gpu("dddd", memory='"8G"', mig="true", model="MIG-b")],
    )

    config = parse_mock_accelerator_toml(path)

    assert any("more than the GPU's 10 GiB" in w for w in config.warnings)


# --------------------------------------------------------------------------- sizes and refusals


def test_a_fractional_memory_size_with_a_suffix_is_binary_and_truncated(tmp_path):
    path = write_toml(tmp_path, [gpu(memory='"1.1k"')])

    assert parse_mock_accelerator_toml(path).devices[0].memory_size == 1126


@pytest.mark.parametrize("spelling", ['"40G"', '"40g"', '"40GB"', '"40GiB"', "42949672960"])
def test_every_spelling_of_40g_is_40_gibibytes(tmp_path, spelling):
    path = write_toml(tmp_path, [gpu(memory=spelling)])

    assert parse_mock_accelerator_toml(path).devices[0].memory_size == 42949672960


def test_a_bare_fractional_memory_size_is_refused_naming_the_file_and_the_field(tmp_path):
    path = write_toml(tmp_path, [gpu("a1"), gpu("a2"), gpu("a3"), gpu("a4", memory='"1.1"')])

    with pytest.raises(ConfigError) as caught:
        parse_mock_accelerator_toml(path)

    assert caught.value.field == "devices[3].memory_size"
    assert str(caught.value) == (
        f"{path}: devices[3].memory_size: '1.1': a fractional size needs a unit suffix (e.g. '1.5G')"
    )


@pytest.mark.parametrize(
    "devices, extra, field, problem",
    [
        ([gpu(numa=-1)], "", "devices[0].numa_node", "-1 is negative"),
        ([gpu(sms=0)], "", "devices[0].subproc_count", "below the minimum 1"),
        ([gpu(memory='"-4G"')], "", "devices[0].memory_size", "is not a size"),
        ([gpu(memory="40.0")], "", "devices[0].memory_size", "give a size as text"),
        ([gpu().replace("subproc_count = 108", 'subproc_count = "108"')], "", "devices[0].subproc_count",
         "expected a whole number, got text"),
        ([gpu().replace("is_mig_device = false", 'is_mig_device = "no"')], "", "devices[0].is_mig_device",
         "expected true or false"),
        ([gpu().replace(", is_mig_device = false", "")], "", "devices[0].is_mig_device", "required for slot 'cuda'"),
        ([gpu().replace("numa_node = 0, ", "")], "", "devices[0].numa_node", "missing"),
        ([gpu() + ", colour = 1"], "", "devices[0].colour", "unknown key"),
        ([gpu("same"), gpu("same")], "", "devices[1].mother_uuid", "repeats devices[0]"),
        ([gpu(mig="true", model="MIG")], "", "devices[0].model_name", "'<prefix>-<profile>'"),
        ([gpu()], "agent_id = 'x'", "agent_id", "unknown key"),
    ],
)
def test_a_bad_device_table_is_refused_naming_the_field(tmp_path, devices, extra, field, problem):
    path = write_toml(tmp_path, devices, extra=extra)

    with pytest.raises(ConfigError) as caught:
        parse_mock_accelerator_toml(path)

    assert caught.value.field == field
    assert problem in caught.value.problem
    assert str(caught.value).startswith(f"{path}: {field}: ")


def test_a_cuda_slot_needs_a_cuda_device_plugin_name(tmp_path):
    path = write_toml(tmp_path, [gpu()], plugin="ROCm")

    with pytest.raises(ConfigError, match="device_plugin_name: 'ROCm': for slot 'cuda' it must be one of"):
        parse_mock_accelerator_toml(path)


def test_other_slots_accept_any_device_plugin_name_and_no_is_mig_device(tmp_path):
    device = gpu().replace(", is_mig_device = false", "")
    path = write_toml(tmp_path, [device], slot="metax", plugin="MetaXDevice")

    config = parse_mock_accelerator_toml(path)

    assert config.device_plugin_name == "MetaXDevice"
    assert config.devices[0].slot_name == "metax"
    assert config.devices[0].is_mig_device is False


def test_the_docs_spelling_is_mig_devices_is_accepted_with_a_warning(tmp_path):
    device = gpu("eeee", memory='"10G"', model="MIG-1g.10gb").replace("is_mig_device = false", "is_mig_devices = true")
    path = write_toml(tmp_path, [gpu("eeee"), device])

    config = parse_mock_accelerator_toml(path)

    assert config.devices[1].is_mig_device is True
    assert config.devices[1].mig_profile == "1g.10gb"
    [warning] = [w for w in config.warnings if "is_mig_devices" in w]
    assert "devices[1].is_mig_devices: read as is_mig_device" in warning


def test_a_devices_format_table_beside_a_device_table_is_ignored_with_a_warning(tmp_path):
    extra_table = FORMATS.replace("[formats.device]", "[formats.devices]").split("[formats.shares]")[0]
    path = write_toml(tmp_path, [gpu()], formats=FORMATS + extra_table.replace("CUDA-capable GPU", "other"))

    config = parse_mock_accelerator_toml(path)

    assert config.formats["device"].description == "CUDA-capable GPU"
    assert any("formats.devices: ignored" in w for w in config.warnings)


def test_malformed_toml_is_refused_with_its_line_and_column(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('slot_name = "cuda"\ndevices = [\n  { mother_uuid = "x" \n', encoding="utf-8")

    with pytest.raises(ConfigError) as caught:
        parse_mock_accelerator_toml(path)

    assert str(caught.value).startswith(f"{path}: invalid TOML: ")
    assert "line 3" in str(caught.value)


@pytest.mark.django_db
def test_a_refused_file_writes_nothing_even_over_an_earlier_import(tmp_path):
    import_accelerator_config(MOCK, node_name="gpu-node-1")
    before = row_counts()
    broken = tmp_path / "broken.toml"
    broken.write_text(MOCK.read_text(encoding="utf-8").replace("[attributes]", "[attributes"), encoding="utf-8")
    late_error = write_toml(tmp_path, [gpu("zz1"), gpu("zz2", memory='"1.5"')], slot="cuda", name="late.toml")

    for path in (broken, late_error):
        with pytest.raises(ConfigError):
            import_accelerator_config(path, node_name="gpu-node-1")

    assert row_counts() == before == {"slot formats": 2, "fractional settings": 1, "nodes": 1, "devices": 4}
    assert not Device.objects.filter(device_id__startswith="GPU-zz").exists()


@pytest.mark.django_db
def test_a_toml_import_never_overwrites_existing_fractional_settings():
    FractionalSettings.objects.create(slot_name="cuda", allocation_mode="fractional", unit_mem=4 * GiB, unit_proc=40)

    report = import_accelerator_config(MOCK)

    settings = FractionalSettings.objects.get(slot_name="cuda")
    assert (settings.allocation_mode, settings.unit_mem, settings.unit_proc) == ("fractional", 4 * GiB, 40)
    assert report.fractional_settings_unchanged == ["cuda"]
    assert report.fractional_settings_created == []


@pytest.mark.django_db
def test_reimporting_updates_only_the_slot_formats_that_changed(tmp_path):
    import_accelerator_config(MOCK)
    changed = tmp_path / "changed.toml"
    changed.write_text(MOCK.read_text(encoding="utf-8").replace('display_unit = "fGPU"', 'display_unit = "fG"'),
                       encoding="utf-8")

    report = import_accelerator_config(changed)

    assert report.slot_formats_updated == ["cuda.shares"]
    assert report.slot_formats_unchanged == ["cuda.device"]
    assert SlotFormat.objects.get(slot_name="cuda", subtype="shares").display_unit == "fG"
    assert SlotFormat.objects.count() == 2


def test_the_mock_plugin_reports_the_files_devices_and_driver_attributes():
    inventory = mock_plugin.load(MIG)

    assert inventory.plugin == "ai.backend.accelerator.mock"
    assert inventory.slot_name == "cuda"
    assert len(inventory.devices) == 9
    assert inventory.attributes["nvidia_driver"] == "450.0.0"
    assert inventory.attributes["cuda_runtime"] == "11.0"
    assert any("formats.devices" in w for w in inventory.warnings)


def test_the_mock_plugin_fills_in_backendais_default_driver_attributes(tmp_path):
    path = write_toml(tmp_path, [gpu()])
    path.write_text(path.read_text(encoding="utf-8").replace('nvidia_driver = "535.0"\n', ""), encoding="utf-8")

    inventory = mock_plugin.load(path)

    assert inventory.attributes == {"nvidia_driver": "450.00.00", "cuda_runtime": "12.2"}
    assert any("attributes.nvidia_driver: missing" in w for w in inventory.warnings)


# --------------------------------------------------------------------------- etcd-style JSON


def test_etcd_json_reads_every_slot_with_decimal_quantum_never_float(tmp_path):
    path = tmp_path / "etcd.json"
    path.write_text(
        '{"config": {"plugins": {"accelerator": {'
        '"cuda": {"allocation_mode": "fractional", "unit_mem": 1073741824, "unit_proc": 10, "quantum_size": 0.25},'
        '"rocm": {"unit_mem": "4G", "unit_proc": "16", "quantum_size": "0.05"}}}}}',
        encoding="utf-8",
    )

    cuda, rocm = parse_etcd_json(path)

    assert cuda == FractionalSpec(slot_name="cuda", allocation_mode="fractional", unit_mem=GiB, unit_proc=10,
                                  quantum_size=Decimal("0.25"))
    assert isinstance(cuda.quantum_size, Decimal)
    assert rocm == FractionalSpec(slot_name="rocm", allocation_mode="discrete", unit_mem=4 * GiB, unit_proc=16,
                                  quantum_size=Decimal("0.05"))


def test_etcd_json_absent_keys_take_backendais_defaults(tmp_path):
    path = write_json(tmp_path, {"cuda": {}})

    [spec] = parse_etcd_json(path)

    assert (spec.allocation_mode, spec.unit_mem, spec.unit_proc, spec.quantum_size) == (
        "discrete", 2 * GiB, 8, Decimal("0.1"))


@pytest.mark.django_db
def test_importing_etcd_json_sets_unit_mem_unit_proc_and_quantum(tmp_path):
    FractionalSettings.objects.create(slot_name="cuda")
    path = write_json(tmp_path, {"cuda": {"allocation_mode": "fractional", "unit_mem": 1073741824,
                                          "unit_proc": 10, "quantum_size": "0.25"},
                                 "rocm": {"allocation_mode": "fractional"}})

    report = import_accelerator_config(path)

    cuda = FractionalSettings.objects.get(slot_name="cuda")
    assert (cuda.allocation_mode, cuda.unit_mem, cuda.unit_proc, cuda.quantum_size) == (
        "fractional", GiB, 10, Decimal("0.25"))
    assert FractionalSettings.objects.get(slot_name="rocm").is_fractional
    assert report.fractional_settings_updated == ["cuda"]
    assert report.fractional_settings_created == ["rocm"]
    assert SlotFormat.objects.count() == 0


@pytest.mark.parametrize(
    "settings, field, problem",
    [
        ({"unit_mem": 256 * MiB}, "unit_mem", "below the minimum 512 MiB"),
        ({"unit_mem": "256M"}, "unit_mem", "below the minimum 512 MiB"),
        ({"unit_proc": 1}, "unit_proc", "below the minimum 2"),
        ({"quantum_size": "0"}, "quantum_size", "greater than 0"),
        ({"quantum_size": "-0.5"}, "quantum_size", "greater than 0"),
        ({"quantum_size": "0.0001"}, "quantum_size", "at most 3 decimal places"),
        ({"allocation_mode": "shared"}, "allocation_mode", "expected 'discrete' or 'fractional'"),
        ({"unit_mem": 1.5}, "unit_mem", "give a size as text"),
        ({"colour": "red"}, "colour", "unknown key"),
    ],
)
def test_etcd_json_out_of_range_values_are_refused(tmp_path, settings, field, problem):
    path = write_json(tmp_path, {"cuda": settings})

    with pytest.raises(ConfigError) as caught:
        parse_etcd_json(path)

    assert caught.value.field == f"config.plugins.accelerator.cuda.{field}"
    assert problem in caught.value.problem


@pytest.mark.django_db
def test_a_unit_mem_below_the_minimum_imports_nothing(tmp_path):
    path = write_json(tmp_path, {"rocm": {"allocation_mode": "fractional"},
                                 "cuda": {"allocation_mode": "fractional", "unit_mem": "256M"}})

    with pytest.raises(ConfigError, match="unit_mem: '256M' \\(256 MiB\\) is below the minimum 512 MiB"):
        import_accelerator_config(path)

    assert FractionalSettings.objects.count() == 0


def test_invalid_json_is_refused_with_its_line_and_column(tmp_path):
    path = write_json(tmp_path, '{"config": {\n  "plugins": {"accelerator": {"cuda": {,}}}}}')

    with pytest.raises(ConfigError) as caught:
        parse_etcd_json(path)

    assert str(caught.value).startswith(f"{path}: invalid JSON at line 2, column ")


def test_a_json_file_without_the_accelerator_branch_is_refused(tmp_path):
    path = write_json(tmp_path, '{"config": {"plugins": {}}}')

    with pytest.raises(ConfigError) as caught:
        parse_etcd_json(path)

    assert caught.value.field == "config.plugins.accelerator"


@pytest.mark.django_db
def test_json_content_is_detected_without_a_json_extension(tmp_path):
    path = write_json(tmp_path, {"cuda": {"allocation_mode": "fractional"}}, name="accelerator.conf")

    report = import_accelerator_config(path)

    assert report.kind == "etcd JSON"
    assert FractionalSettings.objects.get(slot_name="cuda").is_fractional


@pytest.mark.django_db
def test_a_node_name_given_with_a_json_file_is_ignored_with_a_warning(tmp_path):
    path = write_json(tmp_path, {"cuda": {}})

    report = import_accelerator_config(path, node_name="gpu-node-1")

    assert any("--node gpu-node-1: ignored" in w for w in report.warnings)
    assert Node.objects.count() == 0


# --------------------------------------------------------------------------- management command


@pytest.mark.django_db
def test_the_command_prints_a_summary_and_each_warning_on_stderr():
    stdout, stderr = StringIO(), StringIO()

    call_command("import_accelerator_config", str(MIG), "--node", "mig-node", stdout=stdout, stderr=stderr)

    assert "Imported" in stdout.getvalue()
    assert "node mig-node: 9 devices (2 GPUs, 7 MIG slices)" in stdout.getvalue()
    warnings = stderr.getvalue().splitlines()
    assert len(warnings) == 4
    assert all(line.startswith("warning: ") for line in warnings)
    assert any("formats.devices" in line for line in warnings)
    assert Device.objects.filter(node__name="mig-node").count() == 9


@pytest.mark.django_db
def test_the_command_refuses_a_bad_file_with_its_field_and_imports_nothing(tmp_path):
    path = write_toml(tmp_path, [gpu(memory='"1.1"')])

    with pytest.raises(CommandError) as caught:
        call_command("import_accelerator_config", str(path), "--node", "n1", stdout=StringIO(), stderr=StringIO())

    assert "devices[0].memory_size: '1.1': a fractional size needs a unit suffix" in str(caught.value)
    assert "nothing imported" in str(caught.value)
    assert row_counts() == {"slot formats": 0, "fractional settings": 0, "nodes": 0, "devices": 0}


def test_the_command_exits_with_status_1_on_a_bad_file(tmp_path):
    path = write_toml(tmp_path, [gpu(memory='"1.1"')])
    env = {**os.environ, "FGPU_DATA_DIR": str(tmp_path / "data"), "DJANGO_SETTINGS_MODULE": "console.settings"}
    env.pop("DATABASE_URL", None)

    result = subprocess.run(
        [sys.executable, "manage.py", "import_accelerator_config", str(path)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )

    assert result.returncode == 1, result.stderr
    assert "devices[0].memory_size" in result.stderr
    assert result.stdout == ""


# --------------------------------------------------------------------------- admin


@pytest.mark.django_db
def test_the_admin_pages_render_and_show_fgpu_per_physical_gpu(client):
    import_accelerator_config(MOCK, node_name="gpu-node-1")
    import_accelerator_config(MIG, node_name="mig-node")
    FractionalSettings.objects.filter(slot_name="cuda").update(allocation_mode="fractional")
    user = get_user_model().objects.create_superuser("root", "root@example.com", "a-long-test-password")
    client.force_login(user)
    settings = FractionalSettings.objects.get(slot_name="cuda")
    node = Node.objects.get(name="gpu-node-1")

    pages = {
        name: client.get(url)
        for name, url in {
            "slot formats": reverse("admin:accelerators_slotformat_changelist"),
            "fractional settings": reverse("admin:accelerators_fractionalsettings_changelist"),
            "fractional settings change": reverse("admin:accelerators_fractionalsettings_change", args=[settings.pk]),
            "nodes": reverse("admin:accelerators_node_changelist"),
            "node change": reverse("admin:accelerators_node_change", args=[node.pk]),
            "devices": reverse("admin:accelerators_device_changelist"),
            "devices of one node": reverse("admin:accelerators_device_changelist") + f"?node__id__exact={node.pk}",
            "device change": reverse("admin:accelerators_device_change", args=[node.devices.first().pk]),
            "slot format change": reverse("admin:accelerators_slotformat_change",
                                          args=[SlotFormat.objects.get(subtype="shares").pk]),
        }.items()
    }

    assert {name: page.status_code for name, page in pages.items()} == {name: 200 for name in pages}
    # 40 GiB / 2 GiB = 20, 108 SMs / 8 = 13.5 → 13.50 fGPU (Backend.AI's defaults).
    assert "1 physical GPU = 13.50 fGPU" in pages["fractional settings change"].content.decode()
    assert "1 physical GPU = 13.50 fGPU" in pages["fractional settings"].content.decode()
    assert "0.5 → 0.50 fGPU" in pages["slot formats"].content.decode()
    node_page = pages["node change"].content.decode()
    assert "40 GiB" in node_page
    assert "c59395cd-ac91-4cd3-a1b0-3d2568aa2d04" in node_page
    assert "13.50" in node_page  # free fGPU of an idle 40 GiB / 108-SM GPU
    assert "20 GiB" in pages["devices"].content.decode()  # the MIG-20g slice


@pytest.mark.django_db
def test_the_admin_node_page_fetches_fgpu_figures_for_all_devices_at_once(client):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    import_accelerator_config(MOCK, node_name="four-gpus")
    import_accelerator_config(MIG, node_name="nine-devices")
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.com", "a-long-test-password"))

    counts = {}
    for name in ("four-gpus", "nine-devices"):
        url = reverse("admin:accelerators_node_change", args=[Node.objects.get(name=name).pk])
        with CaptureQueriesContext(connection) as queries:
            assert client.get(url).status_code == 200
        counts[name] = len(queries)

    assert counts["four-gpus"] == counts["nine-devices"]
