"""Device links reach the database: the mock TOML's `links` table (parsed, validated, stored by
`import_accelerator_config --node`), the CUDA plugin's NVML reading (against the fake NVML),
and `node_links_apply`."""
from __future__ import annotations

from io import StringIO
from pathlib import Path

import pynvml
import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.urls import reverse

from accelerators.allocation import topology
from accelerators.config_import import ConfigError, parse_mock_accelerator_toml
from accelerators.models import DeviceLink, Node
from accelerators.plugins import cuda
from accelerators.plugins import mock as mock_plugin
from accelerators.services import node_inventory_apply, node_links_apply
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml, FakeNvSwitch

FORMATS = """
[formats.device]
display_unit = "GPU"
display_icon = "gpu1"
human_readable_name = "GPU"
description = "CUDA-capable GPU"
number_format = { binary = false, round_length = 0 }
"""

UUIDS = [f"c59395cd-0000-0000-0000-00000000000{i}" for i in range(4)]


def write_toml(tmp_path: Path, links: str, *, devices: list[str] | None = None, name: str = "mock.toml") -> Path:
    """Four whole 40 GiB GPUs (NUMA nodes 0, 0, 1, 1) and `links` as top-level TOML text."""
    if devices is None:
        devices = [
            f'mother_uuid = "{uuid}", model_name = "CUDA GPU", numa_node = {i // 2}, subproc_count = 108, '
            f'memory_size = "40G", is_mig_device = false'
            for i, uuid in enumerate(UUIDS)
        ]
    body = "\n".join(f"  {{ {device} }}," for device in devices)
    text = (
        f'slot_name = "cuda"\ndevice_plugin_name = "CUDADevice"\n{links}\n'
        f'devices = [\n{body}\n]\n\n[attributes]\nnvidia_driver = "535.0"\ncuda_runtime = "12.2"\n{FORMATS}'
    )
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def gpu_id(position: int) -> str:
    return f"GPU-{UUIDS[position]}"


def stored_links(node_name: str) -> list[tuple[int, int, str, int]]:
    return [
        (link.device_a.index, link.device_b.index, link.kind, link.count)
        for link in DeviceLink.objects.filter(node__name=node_name).select_related("device_a", "device_b")
    ]


LINKS = """links = [
  { a = 0, b = 1, kind = "NVLINK", count = 4 },
  { a = "c59395cd-0000-0000-0000-000000000003", b = 2, kind = "NV2" },
  { a = 1, b = "GPU-c59395cd-0000-0000-0000-000000000002", kind = "PIX" },
  { a = 0, b = 3, kind = "sys" },
]"""


# --------------------------------------------------------------------------- the mock TOML


def test_the_links_table_is_parsed_into_links_between_device_ids(tmp_path):
    config = parse_mock_accelerator_toml(write_toml(tmp_path, LINKS))

    assert config.links == [
        topology.Link(gpu_id(0), gpu_id(1), "NVLINK", 4),
        topology.Link(gpu_id(3), gpu_id(2), "NVLINK", 2),
        topology.Link(gpu_id(1), gpu_id(2), "PIX"),
        topology.Link(gpu_id(0), gpu_id(3), "SYS"),
    ]
    assert config.warnings == ['%s: formats: no [formats.shares] table: fractional mode has no display '
                               'format for cuda.shares' % (tmp_path / "mock.toml")]


def test_a_file_without_links_has_none_and_the_mock_plugin_reports_links_by_device_id(tmp_path):
    assert parse_mock_accelerator_toml(write_toml(tmp_path, "", name="plain.toml")).links == []

    inventory = mock_plugin.load(write_toml(tmp_path, LINKS))

    assert inventory.links[0] == {"a": gpu_id(0), "b": gpu_id(1), "kind": "NVLINK", "count": 4}
    assert [link["kind"] for link in inventory.links] == ["NVLINK", "NVLINK", "PIX", "SYS"]


def test_links_may_also_be_written_as_an_array_of_tables_after_the_other_tables(tmp_path):
    path = write_toml(tmp_path, "")
    path.write_text(path.read_text() + '\n[[links]]\na = 0\nb = 1\nkind = "NV12"\n', encoding="utf-8")

    assert parse_mock_accelerator_toml(path).links == [topology.Link(gpu_id(0), gpu_id(1), "NVLINK", 12)]


@pytest.mark.parametrize(
    ("links", "field", "problem"),
    [
        ('links = [ { a = 0, b = 1, kind = "PCIE" } ]', "links[0].kind", "unknown link kind 'PCIE'"),
        ('links = [ { a = 0, b = 1, kind = 4 } ]', "links[0].kind", "expected text"),
        ('links = [ { a = 0, b = 1, kind = "X" } ]', "links[0].kind", "marks a device with itself"),
        ('links = [ { a = 0, b = 1, kind = "PIX", count = 2 } ]', "links[0].count", "a PIX link has no lanes"),
        ('links = [ { a = 0, b = 1, kind = "NV4", count = 2 } ]', "links[0].count", "contradicts kind 'NV4'"),
        ('links = [ { a = 0, b = 1, kind = "NVLINK", count = 0 } ]', "links[0].count", "below the minimum 1"),
        ('links = [ { a = 0, b = 4, kind = "PIX" } ]', "links[0].b", "no devices[4] (the file declares 4 devices)"),
        ('links = [ { a = "nope", b = 1, kind = "PIX" } ]', "links[0].a", "is not the mother_uuid of a whole device"),
        ('links = [ { a = true, b = 1, kind = "PIX" } ]', "links[0].a", "expected a position in devices or a mother_uuid"),
        ('links = [ { a = 2, b = 2, kind = "PIX" } ]', "links[0].b", "the same device as links[0].a"),
        ('links = [ { a = 0, kind = "PIX" } ]', "links[0].b", "missing"),
        ('links = [ { a = 0, b = 1, kind = "PIX", lanes = 2 } ]', "links[0].lanes", "unknown key"),
        ('links = [ { a = 0, b = 1, kind = "PIX" }, { a = 1, b = 0, kind = "NV1" } ]', "links[1]",
         "already linked by links[0]"),
        ('links = "NV4"', "links", "expected an array of tables"),
    ],
)
def test_a_bad_links_table_is_refused_naming_the_field(tmp_path, links, field, problem):
    with pytest.raises(ConfigError) as caught:
        parse_mock_accelerator_toml(write_toml(tmp_path, links))

    assert caught.value.field == field
    assert problem in caught.value.problem


def test_links_join_whole_devices_not_mig_slices(tmp_path):
    devices = [
        'mother_uuid = "m0", model_name = "CUDA GPU", numa_node = 0, subproc_count = 108, memory_size = "40G", '
        "is_mig_device = false",
        'mother_uuid = "m0", model_name = "MIG-10g", numa_node = 0, subproc_count = 14, memory_size = "10G", '
        "is_mig_device = true",
        'mother_uuid = "m1", model_name = "CUDA GPU", numa_node = 0, subproc_count = 108, memory_size = "40G", '
        "is_mig_device = false",
    ]
    with pytest.raises(ConfigError) as caught:
        parse_mock_accelerator_toml(write_toml(tmp_path, 'links = [ { a = 1, b = 2, kind = "PIX" } ]', devices=devices))
    assert (caught.value.field, caught.value.problem) == ("links[0].a", "devices[1] is a MIG slice; links join whole devices")

    # A mother_uuid names the whole GPU, never its slices.
    config = parse_mock_accelerator_toml(write_toml(tmp_path, 'links = [ { a = "m0", b = "m1", kind = "NV2" } ]',
                                                    devices=devices, name="ok.toml"))
    assert config.links == [topology.Link("GPU-m0", "GPU-m1", "NVLINK", 2)]


@pytest.mark.django_db
def test_import_with_a_node_stores_the_links_once_per_pair_and_a_reimport_replaces_them(tmp_path):
    out = StringIO()
    call_command("import_accelerator_config", str(write_toml(tmp_path, LINKS)), "--node", "nv-node", stdout=out)

    assert stored_links("nv-node") == [(0, 1, "NVLINK", 4), (0, 3, "SYS", 1), (1, 2, "PIX", 1), (2, 3, "NVLINK", 2)]
    assert "links between its devices: 4" in out.getvalue()
    pair = DeviceLink.objects.get(node__name="nv-node", device_a__index=2)
    assert pair.as_link() == topology.Link(gpu_id(2), gpu_id(3), "NVLINK", 2)

    fewer = write_toml(tmp_path, 'links = [ { a = 3, b = 1, kind = "PHB" } ]', name="fewer.toml")
    call_command("import_accelerator_config", str(fewer), "--node", "nv-node", stdout=StringIO())
    assert stored_links("nv-node") == [(1, 3, "PHB", 1)]

    call_command("import_accelerator_config", str(write_toml(tmp_path, "", name="none.toml")), "--node", "nv-node",
                 stdout=StringIO())
    assert stored_links("nv-node") == []


@pytest.mark.django_db
def test_import_refuses_a_bad_link_kind_naming_the_field_and_imports_nothing(tmp_path):
    bad = write_toml(tmp_path, 'links = [ { a = 0, b = 1, kind = "NV4" }, { a = 1, b = 2, kind = "QPI" } ]')

    with pytest.raises(CommandError, match=r"links\[1\]\.kind: unknown link kind 'QPI'.*\(nothing imported\)"):
        call_command("import_accelerator_config", str(bad), "--node", "nv-node", stdout=StringIO())

    assert not Node.objects.exists()
    assert not DeviceLink.objects.exists()


@pytest.mark.django_db
def test_the_node_admin_page_lists_its_links(tmp_path, client):
    call_command("import_accelerator_config", str(write_toml(tmp_path, LINKS)), "--node", "nv-node", stdout=StringIO())
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.com", "a-long-test-password"))

    page = client.get(reverse("admin:accelerators_node_change", args=[Node.objects.get(name="nv-node").pk]))

    assert page.status_code == 200
    html = page.content.decode()
    assert "Device links" in html
    assert "same PCIe switch (PIX)" in html
    assert f"#3 {gpu_id(3)}" in html


# --------------------------------------------------------------------------- node_links_apply


def register(node_name: str = "n1"):
    config = parse_mock_accelerator_toml(Path(__file__).parent / "fixtures" / "backendai" / "mock-accelerator.toml")
    return node_inventory_apply(node_name=node_name, devices=config.devices, plugins=["mock"], attributes={}), config


@pytest.mark.django_db
def test_node_links_apply_refuses_unknown_device_ids_naming_them_and_writes_nothing():
    node, config = register()
    first, second = config.devices[0].device_id, config.devices[1].device_id
    node_links_apply(node=node, links=[{"a": first, "b": second, "kind": "PIX"}])

    with pytest.raises(ValueError, match="node n1 has no devices GPU-gone-1, GPU-gone-2; cannot link them"):
        node_links_apply(node=node, links=[
            {"a": first, "b": second, "kind": "NVLINK", "count": 2},
            {"a": "GPU-gone-2", "b": first, "kind": "PIX"},
            {"a": "GPU-gone-1", "b": second, "kind": "PIX"},
        ])

    assert [(link.kind, link.count) for link in DeviceLink.objects.all()] == [("PIX", 1)]


@pytest.mark.django_db
def test_node_links_apply_refuses_another_nodes_devices_malformed_links_and_pairs_given_twice():
    node, config = register("n1")
    register("n2")
    ids = [device.device_id for device in config.devices]
    other = Node.objects.get(name="n2")
    DeviceLink.objects.create(node=other, device_a=other.devices.get(index=0), device_b=other.devices.get(index=1),
                              kind="PIX")

    with pytest.raises(ValueError, match="a PIX link has no lanes"):
        node_links_apply(node=node, links=[{"a": ids[0], "b": ids[1], "kind": "PIX", "count": 3}])
    with pytest.raises(ValueError, match=r"links\[0\]: unknown link kind 'NV4'"):
        node_links_apply(node=node, links=[{"a": ids[0], "b": ids[1], "kind": "NV4"}])
    with pytest.raises(ValueError, match="linked twice"):
        node_links_apply(node=node, links=[{"a": ids[0], "b": ids[1], "kind": "PIX"},
                                           {"a": ids[1], "b": ids[0], "kind": "PXB"}])

    node_links_apply(node=node, links=[{"a": ids[3], "b": ids[0], "kind": "NVLINK", "count": 2}])
    assert stored_links("n1") == [(0, 3, "NVLINK", 2)]
    assert stored_links("n2") == [(0, 1, "PIX", 1)]  # another node's links are left alone


@pytest.mark.django_db
def test_a_device_that_leaves_the_inventory_takes_its_links_with_it():
    node, config = register()
    ids = [device.device_id for device in config.devices]
    node_links_apply(node=node, links=[{"a": ids[0], "b": ids[1], "kind": "PIX"},
                                       {"a": ids[2], "b": ids[3], "kind": "NVLINK", "count": 1}])

    node_inventory_apply(node_name="n1", devices=config.devices[:3], plugins=["mock"], attributes={})

    assert stored_links("n1") == [(0, 1, "PIX", 1)]


# --------------------------------------------------------------------------- the CUDA plugin

GPU = [f"GPU-00000000-0000-0000-0000-00000000000{i}" for i in range(4)]
BUS = ["00000000:07:00.0", "00000000:0F:00.0", "00000000:47:00.0", "00000000:4E:00.0"]


def links_by_pair(inventory) -> dict[tuple[str, str], tuple[str, int]]:
    return {(link["a"], link["b"]): (link["kind"], link["count"]) for link in inventory.links}


def test_the_cuda_plugin_reads_nvlink_lane_counts_and_pcie_ancestors():
    gpus = [
        # GPU0 and GPU1: 4 lanes (counted from both ends alike); GPU2 and GPU3: 2 lanes plus an
        # inactive link; no NVLink between the pairs.
        FakeGpu(GPU[0], numa_node=0, pci_bus_id=BUS[0], nvlinks=[GPU[1], GPU[1], GPU[1], GPU[1]]),
        FakeGpu(GPU[1], numa_node=0, pci_bus_id=BUS[1], nvlinks=[GPU[0], GPU[0], GPU[0], GPU[0]]),
        FakeGpu(GPU[2], numa_node=1, pci_bus_id=BUS[2], nvlinks=[GPU[3], None, GPU[3]]),
        FakeGpu(GPU[3], numa_node=1, pci_bus_id=BUS[3], nvlinks=[GPU[2], None, GPU[2]]),
    ]
    fake = FakeNvml(gpus, topology={
        (GPU[0], GPU[2]): pynvml.NVML_TOPOLOGY_SINGLE,
        (GPU[3], GPU[0]): pynvml.NVML_TOPOLOGY_MULTIPLE,
        (GPU[1], GPU[2]): pynvml.NVML_TOPOLOGY_HOSTBRIDGE,
        # GPU1-GPU3: not given: different NUMA nodes → NVML_TOPOLOGY_SYSTEM
    })

    inventory = cuda.load(nvml=fake)

    assert links_by_pair(inventory) == {
        (GPU[0], GPU[1]): ("NVLINK", 4),
        (GPU[0], GPU[2]): ("PIX", 1),
        (GPU[0], GPU[3]): ("PXB", 1),
        (GPU[1], GPU[2]): ("PHB", 1),
        (GPU[1], GPU[3]): ("SYS", 1),
        (GPU[2], GPU[3]): ("NVLINK", 2),
    }
    assert inventory.warnings == []
    assert fake.shutdown_count == 1


def test_pcie_cards_without_nvlink_get_their_pcie_path_only():
    gpus = [FakeGpu(GPU[0], numa_node=0, pci_bus_id=BUS[0]), FakeGpu(GPU[1], numa_node=0, pci_bus_id=BUS[1]),
            FakeGpu(GPU[2], numa_node=1, pci_bus_id=BUS[2])]
    fake = FakeNvml(gpus, topology={(GPU[0], GPU[1]): pynvml.NVML_TOPOLOGY_INTERNAL})

    assert links_by_pair(cuda.load(nvml=fake)) == {
        (GPU[0], GPU[1]): ("PIX", 1),  # one board (NVML_TOPOLOGY_INTERNAL)
        (GPU[0], GPU[2]): ("SYS", 1),
        (GPU[1], GPU[2]): ("SYS", 1),
    }


def test_gpus_on_an_nvswitch_baseboard_are_all_linked_with_their_switch_lanes():
    switch = FakeNvSwitch("00000000:C0:00.0")
    gpus = [FakeGpu(GPU[i], pci_bus_id=BUS[i], nvlinks=[switch] * 18) for i in range(3)]
    gpus[2].nvlinks = [switch] * 12 + [None] * 6  # six lanes down

    links = links_by_pair(cuda.load(nvml=FakeNvml(gpus)))

    assert links == {(GPU[0], GPU[1]): ("NVLINK", 18), (GPU[0], GPU[2]): ("NVLINK", 12), (GPU[1], GPU[2]): ("NVLINK", 12)}


def test_a_driver_without_topology_answers_gives_no_pcie_links_and_one_gpu_gives_no_links():
    gpus = [FakeGpu(GPU[0], pci_bus_id=BUS[0], nvlinks=[GPU[1]]), FakeGpu(GPU[1], pci_bus_id=BUS[1], nvlinks=[GPU[0]]),
            FakeGpu(GPU[2], pci_bus_id=BUS[2])]

    inventory = cuda.load(nvml=FakeNvml(gpus, topology_supported=False))

    assert links_by_pair(inventory) == {(GPU[0], GPU[1]): ("NVLINK", 1)}
    assert cuda.load(nvml=FakeNvml([FakeGpu(GPU[0])])).links == []


def test_an_nvml_failure_while_reading_nvlink_names_the_call():
    gpus = [FakeGpu(GPU[0], pci_bus_id=BUS[0], nvlinks=[GPU[1]]), FakeGpu(GPU[1], pci_bus_id=BUS[1], nvlinks=[GPU[0]])]
    fake = FakeNvml(gpus)
    fake.fail("nvmlDeviceGetNvLinkRemotePciInfo", pynvml.NVML_ERROR_GPU_IS_LOST)

    with pytest.raises(cuda.CudaPluginError, match="nvmlDeviceGetNvLinkRemotePciInfo for GPU 0 .* NVLink 0 failed"):
        cuda.load(nvml=fake)
    assert fake.shutdown_count == 1


@pytest.mark.django_db
def test_cuda_plugin_links_are_stored_by_node_links_apply():
    gpus = [FakeGpu(GPU[i], numa_node=0, pci_bus_id=BUS[i], nvlinks=[GPU[1 - i]] * 2 if i < 2 else None)
            for i in range(3)]
    inventory = cuda.load(nvml=FakeNvml(gpus))

    node = node_inventory_apply(node_name="cuda-node", devices=inventory.devices, plugins=[inventory.plugin],
                                attributes=inventory.attributes)
    node_links_apply(node=node, links=inventory.links)

    assert stored_links("cuda-node") == [(0, 1, "NVLINK", 2), (0, 2, "NODE", 1), (1, 2, "NODE", 1)]
