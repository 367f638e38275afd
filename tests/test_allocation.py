"""The pure allocator (accelerators/allocation): capacity, strategies, placement, units, requests.

No database: everything here is plain Python over frozen dataclasses.
"""
from __future__ import annotations

import copy
from decimal import Decimal

import pytest

from accelerators.allocation.core import (
    DeviceGrant,
    DeviceState,
    FractionalSettings,
    ResourceRequest,
    allocate_devices,
    allocate_shares,
    check_ever_fits,
    device_capacity,
    device_free_shares,
    max_devices,
    max_shares,
    place,
    shares_grant,
)
from accelerators.allocation.errors import (
    AllocationError,
    InsufficientResource,
    InvalidResourceRequest,
    NeverSchedulable,
    NotMultipleOfQuantum,
)
from accelerators.allocation.requests import parse_resources
from protocol.units import (
    SizeError,
    format_binary_size,
    format_number,
    parse_binary_size,
    parse_decimal,
)
from tests.builders import gpu, node

GiB = 1 << 30
D = Decimal

# The walkthrough's fractional settings: 1 fGPU = 4 GiB and 40 SMs, quantum 0.25.
DEMO = FractionalSettings(unit_mem=4 * GiB, unit_proc=40, quantum=D("0.25"))
# Backend.AI's defaults: 1 fGPU = 2 GiB and 8 SMs.
BACKENDAI = FractionalSettings(unit_mem=2 * GiB, unit_proc=8, quantum=D("0.01"))


def used(device_id: str, fgpu: str, *, settings: FractionalSettings = DEMO, **kw) -> DeviceState:
    """An 8 GiB / 80-SM device of which `fgpu` fGPU is held by one session."""
    grant = shares_grant(device_id, D(fgpu), settings)
    return gpu(device_id, memory_used=grant.memory, proc_used=str(grant.procs), sessions=1, **kw)


def shares(amount: str, **kw) -> ResourceRequest:
    return ResourceRequest(kind="shares", amount=D(amount), **kw)


def by_device(grants) -> dict[str, Decimal]:
    return {g.device_id: g.shares for g in grants}


# --- capacity and free shares ---------------------------------------------------------------

def test_an_8_gib_80_sm_device_holds_2_fgpu_at_4_gib_and_40_sms_per_fgpu():
    assert device_capacity(memory_size=8 * GiB, subproc_count=80, settings=DEMO) == D("2.00")


def test_a_40g_108_sm_device_holds_13_50_fgpu_with_backendai_defaults_because_sms_bind_first():
    assert device_capacity(memory_size=40 * GiB, subproc_count=108, settings=BACKENDAI) == D("13.50")


def test_capacity_is_truncated_to_two_decimals_never_rounded_up():
    # 1 GiB - 1 byte over 4 GiB is 0.2499999…: truncated to 0.24, not rounded to 0.25.
    assert device_capacity(memory_size=GiB - 1, subproc_count=80, settings=DEMO) == D("0.24")


def test_free_shares_subtract_what_sessions_hold():
    assert device_free_shares(used("a", "0.5"), DEMO) == D("1.50")


def test_free_shares_are_bound_by_whichever_of_memory_or_sms_is_scarcer():
    # 1 GiB of memory used (0.25 fGPU worth) but 60 SMs used (1.5 fGPU worth): SMs bind.
    device = gpu("a", memory_used=GiB, proc_used="60")
    assert device_free_shares(device, DEMO) == D("0.50")


def test_a_device_held_whole_has_no_free_shares():
    device = gpu("a", memory_used=8 * GiB, proc_used="80", sessions=1)
    assert device_free_shares(device, DEMO) == 0


# --- allocate_shares: strategies ------------------------------------------------------------

def test_evenly_puts_a_fitting_request_on_the_device_with_least_free_capacity_that_still_fits():
    devices = [gpu("empty"), used("half", "1.0"), used("almost-full", "1.75")]
    # 0.75 fGPU does not fit "almost-full" (0.25 free); "half" (1.0 free) is the tightest fit.
    grants = allocate_shares(devices, D("0.75"), DEMO, strategy="evenly")
    assert by_device(grants) == {"half": D("0.75")}


def test_evenly_splits_1_75_over_as_few_devices_as_possible_and_grants_exactly_1_75():
    # Three 1-fGPU devices: 1.75 needs two of them. Backend.AI's evenly would grant 2 × 0.75 = 1.5.
    devices = [gpu(name, memory=4 * GiB, sms=40) for name in ("a", "b", "c")]
    grants = allocate_shares(devices, D("1.75"), DEMO, strategy="evenly")
    assert sum(g.shares for g in grants) == D("1.75")
    assert len(grants) == 2
    assert sorted(g.shares for g in grants) == [D("0.75"), D("1.00")]


def test_evenly_is_the_default_strategy():
    devices = [gpu("empty"), used("half", "1.0")]
    assert by_device(allocate_shares(devices, D("0.5"), DEMO)) == {"half": D("0.5")}


def test_fill_takes_the_most_free_device_first():
    devices = [used("half", "1.0"), gpu("empty"), used("almost-full", "1.75")]
    grants = allocate_shares(devices, D("0.5"), DEMO, strategy="fill")
    assert by_device(grants) == {"empty": D("0.5")}


def test_fill_empties_the_most_free_device_before_touching_the_next():
    devices = [used("half", "1.0"), gpu("empty")]
    grants = allocate_shares(devices, D("2.5"), DEMO, strategy="fill")
    assert by_device(grants) == {"empty": D("2.00"), "half": D("0.50")}


def test_an_amount_off_the_quantum_grid_raises_not_multiple_of_quantum():
    with pytest.raises(NotMultipleOfQuantum, match="0.3 fGPU is not a multiple of the quantum 0.25"):
        allocate_shares([gpu("a")], D("0.3"), DEMO)


@pytest.mark.parametrize("amount", ["0", "-0.25"])
def test_a_zero_or_negative_amount_is_an_invalid_request(amount):
    with pytest.raises(InvalidResourceRequest):
        allocate_shares([gpu("a")], D(amount), DEMO)


def test_more_than_the_node_has_free_raises_insufficient_resource():
    with pytest.raises(InsufficientResource, match="2.25 fGPU requested, 2.00 fGPU free"):
        allocate_shares([gpu("a")], D("2.25"), DEMO)


def test_an_unknown_strategy_is_an_invalid_request():
    with pytest.raises(InvalidResourceRequest, match="strategy"):
        allocate_shares([gpu("a")], D("0.5"), DEMO, strategy="random")


def test_a_shares_grant_holds_unit_mem_times_shares_bytes_and_unit_proc_times_shares_sms():
    grant = shares_grant("a", D("0.5"), DEMO)
    assert grant == DeviceGrant(device_id="a", shares=D("0.5"), memory=2 * GiB, procs=D("20"))
    grant = shares_grant("b", D("1.75"), BACKENDAI)
    assert grant.memory == int(D("1.75") * 2 * GiB) == 3758096384
    assert grant.procs == D("14")


def test_a_grant_of_0_5_fgpu_on_the_demo_device_is_2_gib_and_20_sms():
    (grant,) = allocate_shares([gpu("a")], D("0.5"), DEMO)
    assert (grant.memory, grant.procs) == (2 * GiB, D("20"))


# --- allocate_devices: whole devices --------------------------------------------------------

def test_whole_devices_are_only_taken_from_idle_devices():
    devices = [used("busy", "0.25"), gpu("idle")]
    grants = allocate_devices(devices, 1)
    assert [g.device_id for g in grants] == ["idle"]
    with pytest.raises(InsufficientResource, match="2 whole GPU"):
        allocate_devices(devices, 2)


def test_a_device_with_a_session_but_no_usage_is_not_idle():
    assert not gpu("a", sessions=1).is_idle
    with pytest.raises(InsufficientResource):
        allocate_devices([gpu("a", sessions=1)], 1)


def test_a_whole_device_grant_holds_all_its_memory_and_sms():
    (grant,) = allocate_devices([gpu("a", memory=40 * GiB, sms=108)], 1)
    assert grant == DeviceGrant(device_id="a", shares=D(1), memory=40 * GiB, procs=D(108))


def test_whole_devices_prefer_devices_on_one_numa_node():
    devices = [gpu("a0", numa=0), gpu("b1", numa=1), gpu("c0", numa=0), gpu("d1", numa=1), gpu("e1", numa=1)]
    grants = allocate_devices(devices, 2)
    # NUMA 0 (2 idle devices) is the smallest group that holds both: NUMA 1 is kept for larger asks.
    assert {g.device_id for g in grants} == {"a0", "c0"}
    grants = allocate_devices(devices, 3)
    assert {g.device_id for g in grants} == {"b1", "d1", "e1"}


def test_whole_devices_span_numa_nodes_when_no_single_one_holds_them():
    devices = [gpu("a0", numa=0), gpu("b1", numa=1)]
    assert {g.device_id for g in allocate_devices(devices, 2)} == {"a0", "b1"}


def test_a_device_count_below_one_is_an_invalid_request():
    with pytest.raises(InvalidResourceRequest):
        allocate_devices([gpu("a")], 0)


# --- place: nodes, policies, errors ---------------------------------------------------------

def test_binpack_picks_the_fuller_node():
    nodes = [node("empty", gpu("e")), node("busy", used("b", "1.0"))]
    assert place(nodes, shares("0.5"), DEMO, policy="binpack").node_id == "busy"


def test_spread_picks_the_emptier_node():
    nodes = [node("busy", used("b", "1.0")), node("empty", gpu("e"))]
    assert place(nodes, shares("0.5"), DEMO, policy="spread").node_id == "empty"


def test_binpack_is_the_default_policy_and_ties_go_to_the_first_node():
    assert place([node("n1", gpu("a")), node("n2", gpu("b"))], shares("0.5"), DEMO).node_id == "n1"
    assert place([node("n1", gpu("a")), node("n2", gpu("b"))], shares("0.5"), DEMO, policy="spread").node_id == "n1"


def test_a_placement_carries_the_node_and_its_grants():
    placement = place([node("n1", gpu("a"))], shares("0.5"), DEMO)
    assert placement.node_id == "n1"
    assert placement.grants == (DeviceGrant("a", D("0.5"), 2 * GiB, D("20")),)


def test_a_node_without_free_cpu_cores_is_passed_over():
    nodes = [node("busy-cpu", gpu("a"), cpu=8, cpu_used=7), node("free-cpu", gpu("b"))]
    assert place(nodes, shares("0.5", cpu=2), DEMO).node_id == "free-cpu"


def test_a_node_without_free_memory_is_passed_over():
    nodes = [node("busy-mem", gpu("a"), mem=32 * GiB, mem_used=31 * GiB), node("free-mem", gpu("b"))]
    assert place(nodes, shares("0.5", mem=2 * GiB), DEMO).node_id == "free-mem"


def test_when_cpu_is_short_everywhere_placement_fails_with_the_cpu_reason():
    nodes = [node("n1", gpu("a"), cpu=8, cpu_used=7)]
    with pytest.raises(InsufficientResource, match="n1: 2 CPU cores requested, 1 free"):
        place(nodes, shares("0.5", cpu=2), DEMO)


def test_when_memory_is_short_everywhere_placement_fails_with_the_memory_reason():
    nodes = [node("n1", gpu("a"), mem=32 * GiB, mem_used=31 * GiB)]
    with pytest.raises(InsufficientResource, match="n1: 2 GiB memory requested, 1 GiB free"):
        place(nodes, shares("0.5", mem=2 * GiB), DEMO)


def test_a_cpu_only_request_gets_a_node_and_no_grants():
    placement = place([node("n1", gpu("a"))], ResourceRequest(kind="none", cpu=2, mem=GiB), DEMO)
    assert placement.node_id == "n1"
    assert placement.grants == ()


def test_a_request_too_large_for_any_node_is_never_schedulable_naming_the_slot_and_the_largest_amount():
    nodes = [node("n1", gpu("a")), node("n2", used("b", "1.0"))]
    with pytest.raises(NeverSchedulable) as caught:
        place(nodes, shares("3"), DEMO)
    assert str(caught.value) == "cuda.shares: 3 fGPU requested, but the largest any node can hold is 2.00 fGPU"


@pytest.mark.parametrize("quantum", ["0.25", "0.5", "1"])
def test_the_never_schedulable_message_shows_the_largest_amount_with_two_decimals_whatever_the_quantum(quantum):
    settings = FractionalSettings(unit_mem=4 * GiB, unit_proc=40, quantum=D(quantum))
    with pytest.raises(NeverSchedulable, match=r"the largest any node can hold is 2\.00 fGPU$"):
        place([node("n1", gpu("a"))], shares("3"), settings)


def test_the_never_schedulable_message_counts_every_device_of_the_largest_node():
    nodes = [node("n1", gpu("a"), gpu("b")), node("n2", gpu("c"))]
    with pytest.raises(NeverSchedulable, match="rocm.shares: 5 fGPU requested, but the largest any node can hold is 4.00 fGPU"):
        place(nodes, shares("5", slot="rocm"), DEMO)


def test_a_request_that_fits_the_cluster_but_not_now_is_insufficient_not_never_schedulable():
    nodes = [node("n1", used("a", "1.5")), node("n2", used("b", "1.75"))]
    with pytest.raises(InsufficientResource) as caught:
        place(nodes, shares("1"), DEMO)
    assert not isinstance(caught.value, NeverSchedulable)
    assert "n1:" in str(caught.value) and "n2:" in str(caught.value)


def test_too_many_whole_devices_for_any_node_is_never_schedulable():
    nodes = [node("n1", gpu("a"), gpu("b")), node("n2", gpu("c"))]
    with pytest.raises(NeverSchedulable, match="cuda.device: 3 GPU\\(s\\) requested, but the largest node has 2"):
        place(nodes, ResourceRequest(kind="device", amount=D(3)), DEMO)


def test_a_fractional_device_count_is_an_invalid_request():
    with pytest.raises(InvalidResourceRequest, match="whole"):
        place([node("n1", gpu("a"))], ResourceRequest(kind="device", amount=D("1.5")), DEMO)


def test_more_cpu_than_any_node_has_is_never_schedulable_and_says_cpu_is_the_reason():
    # The node's GPU could hold 1 fGPU; it is the 16 cores that no node has.
    with pytest.raises(NeverSchedulable) as caught:
        place([node("n1", gpu("a"), cpu=8)], shares("1", cpu=16), DEMO)
    assert str(caught.value) == "cpu: 16 CPU cores requested, but the largest node has 8"


def test_more_memory_than_any_node_has_is_never_schedulable_and_says_memory_is_the_reason():
    with pytest.raises(NeverSchedulable) as caught:
        place([node("n1", gpu("a"), mem=32 * GiB)], shares("1", mem=64 * GiB), DEMO)
    assert str(caught.value) == "mem: 64 GiB memory requested, but the largest node has 32 GiB"


def test_a_request_no_single_node_holds_whole_is_never_schedulable_though_each_part_fits_somewhere():
    # n1 has the cores but a 1-fGPU device; n2 has the 2-fGPU device but only 2 cores.
    nodes = [node("n1", gpu("a", memory=4 * GiB, sms=40), cpu=8), node("n2", gpu("b"), cpu=2)]
    with pytest.raises(NeverSchedulable, match="no single node has 4 CPU cores"):
        place(nodes, shares("2", cpu=4), DEMO)


def test_shares_without_fractional_settings_are_an_invalid_request():
    with pytest.raises(InvalidResourceRequest):
        place([node("n1", gpu("a"))], shares("0.5"), None)


def test_placing_on_no_nodes_is_never_schedulable_and_says_to_start_an_agent():
    with pytest.raises(NeverSchedulable, match="start an agent"):
        place([], shares("0.5"), DEMO)


def test_an_off_quantum_request_fails_as_such_not_as_insufficient_or_never_schedulable():
    with pytest.raises(NotMultipleOfQuantum):
        place([node("n1", gpu("a"))], shares("0.3"), DEMO)
    with pytest.raises(NotMultipleOfQuantum):
        check_ever_fits([node("n1", gpu("a"))], shares("0.3"), DEMO)


def test_check_ever_fits_ignores_current_usage():
    check_ever_fits([node("n1", used("a", "2.0"), cpu=1, cpu_used=1)], shares("2", cpu=1), DEMO)


# --- max_shares / max_devices ---------------------------------------------------------------

def test_max_shares_sums_one_nodes_devices_rounded_down_to_the_quantum():
    # 0.24 fGPU free (SMs) rounds down to 0 at quantum 0.25; the full device adds 2.00.
    odd = gpu("odd", memory_used=0, proc_used="70.4")  # 9.6 SMs free → 0.24 fGPU
    nodes = [node("n1", odd, gpu("b"), used("c", "0.5")), node("n2", gpu("d"), gpu("e"))]
    assert max_shares(nodes, DEMO) == D("4.00")
    assert max_shares([nodes[0]], DEMO) == D("3.50")


def test_max_shares_of_no_nodes_is_zero():
    assert max_shares([], DEMO) == 0


def test_max_devices_counts_idle_devices_of_the_best_node():
    nodes = [node("n1", gpu("a"), used("b", "0.25"), gpu("c")), node("n2", gpu("d"))]
    assert max_devices(nodes) == 2
    assert max_devices([]) == 0


# --- inputs are never mutated ---------------------------------------------------------------

def test_no_function_mutates_its_inputs():
    devices = [gpu("a"), used("b", "0.5"), gpu("c", numa=1)]
    nodes = [node("n1", *devices), node("n2", used("d", "1.0"))]
    devices_before, nodes_before = copy.deepcopy(devices), copy.deepcopy(nodes)

    allocate_shares(devices, D("2.5"), DEMO, strategy="evenly")
    allocate_shares(devices, D("2.5"), DEMO, strategy="fill")
    allocate_devices(devices, 2)
    place(nodes, shares("1.5"), DEMO, policy="spread")
    place(nodes, ResourceRequest(kind="device", amount=D(2)), DEMO)
    max_shares(nodes, DEMO)
    for attempt in (lambda: allocate_shares(devices, D("9"), DEMO), lambda: place(nodes, shares("99"), DEMO)):
        with pytest.raises(AllocationError):
            attempt()

    assert devices == devices_before
    assert nodes == nodes_before


# --- units ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["40G", "40g", "40GB", "40GiB", "40gib", " 40 G "])
def test_binary_size_suffixes_are_binary_whatever_their_spelling(text):
    assert parse_binary_size(text) == 42949672960


@pytest.mark.parametrize(("text", "size"), [("0", 0), ("512", 512), ("1k", 1024), ("1.5M", 1572864), ("2T", 2 << 40)])
def test_binary_sizes_parse_to_bytes(text, size):
    assert parse_binary_size(text) == size


def test_a_fractional_size_with_a_suffix_is_truncated_to_whole_bytes():
    assert parse_binary_size("1.1k") == 1126


def test_an_integer_size_is_taken_as_bytes():
    assert parse_binary_size(17179869184) == 16 * GiB


@pytest.mark.parametrize("value", ["1.1", "-1G", "-5", -1, "", "lots", "1X", "1.5.5G", True, 1.5, None])
def test_bad_sizes_are_refused(value):
    with pytest.raises(SizeError):
        parse_binary_size(value)


def test_format_binary_size_picks_the_largest_whole_unit():
    assert format_binary_size(2 * GiB) == "2 GiB"
    assert format_binary_size(1536 << 20) == "1.5 GiB"
    assert format_binary_size(512) == "512 B"


@pytest.mark.parametrize(
    ("amount", "binary", "round_length", "text"),
    [
        ("0.5", False, 2, "0.50"),
        ("2", False, 0, "2"),
        ("1536", True, 2, "1.50Ki"),
        ("1500", False, 2, "1.50k"),
        ("1023", True, 0, "1023"),
        ("1000", False, 0, "1k"),
        ("3221225472", True, 1, "3.0Gi"),
    ],
)
def test_format_number_uses_binary_or_decimal_suffixes_and_fixed_digits(amount, binary, round_length, text):
    assert format_number(D(amount), binary=binary, round_length=round_length) == text


@pytest.mark.parametrize(
    ("amount", "binary", "round_length", "text"),
    [
        ("0.999", False, 2, "0.99"),
        ("1.99", False, 0, "1"),
        ("1999", False, 0, "1k"),
        ("2047", True, 0, "1Ki"),
        ("13.579", False, 1, "13.5"),
    ],
)
def test_format_number_truncates_and_never_rounds_up(amount, binary, round_length, text):
    assert format_number(D(amount), binary=binary, round_length=round_length) == text


def test_parse_decimal_refuses_floats_negatives_and_non_numbers():
    assert parse_decimal("0.25", what="x") == D("0.25")
    assert parse_decimal(3, what="x") == D(3)
    for bad in (0.5, "-1", "abc", "NaN", "Infinity", True):
        with pytest.raises(ValueError, match="^x: "):
            parse_decimal(bad, what="x")


# --- parse_resources ------------------------------------------------------------------------

def test_parse_resources_normalises_an_fgpu_request():
    request = parse_resources({"cuda.shares": "0.5", "cpu": 2, "mem": "1G"})
    assert request == ResourceRequest(kind="shares", amount=D("0.5"), cpu=2, mem=GiB, slot="cuda", style="fgpu")


def test_parse_resources_normalises_a_whole_device_request():
    request = parse_resources({"cuda.device": 2})
    assert request == ResourceRequest(kind="device", amount=D(2), cpu=1, mem=GiB, slot="cuda", style="devices")


def test_parse_resources_without_an_accelerator_is_a_cpu_only_request_with_defaults():
    request = parse_resources({})
    assert (request.kind, request.cpu, request.mem) == ("none", 1, GiB)


def test_parse_resources_refuses_two_accelerator_keys():
    with pytest.raises(InvalidResourceRequest, match="one accelerator request per session.*cuda.device.*cuda.shares"):
        parse_resources({"cuda.shares": "0.5", "cuda.device": 1})


@pytest.mark.parametrize("key", ["gpus", "cuda.fraction", ".shares"])
def test_parse_resources_refuses_an_unknown_key_naming_it(key):
    with pytest.raises(InvalidResourceRequest, match=f"resources.{key}: unknown resource"):
        parse_resources({key: "1"})


def test_parse_resources_reports_a_misspelt_key_beside_a_valid_one_as_unknown():
    # A typo ("cpus" for "cpu") is not a second accelerator request; the message must say which key is wrong.
    with pytest.raises(InvalidResourceRequest, match="resources.cpus: unknown resource"):
        parse_resources({"cuda.shares": "0.5", "cpus": 2})


def test_parse_resources_refuses_a_float_amount():
    with pytest.raises(InvalidResourceRequest, match="resources.cuda.shares: 0.5 must be given as text"):
        parse_resources({"cuda.shares": 0.5})


@pytest.mark.parametrize("value", ["1.5", "0.5"])
def test_parse_resources_refuses_a_device_count_that_is_not_whole(value):
    with pytest.raises(InvalidResourceRequest, match="resources.cuda.device: a device count must be a whole number"):
        parse_resources({"cuda.device": value})


@pytest.mark.parametrize("cpu", [0, -1, "0", 1.5, "two", True])
def test_parse_resources_refuses_fewer_than_one_or_non_whole_cpu_cores(cpu):
    with pytest.raises(InvalidResourceRequest, match="resources.cpu"):
        parse_resources({"cpu": cpu})


@pytest.mark.parametrize("mem", ["lots", "1.5", "-1G", 1.5])
def test_parse_resources_refuses_a_bad_memory_size(mem):
    with pytest.raises(InvalidResourceRequest, match="resources.mem"):
        parse_resources({"mem": mem})


def test_parse_resources_refuses_a_negative_amount_and_a_non_object():
    with pytest.raises(InvalidResourceRequest, match="negative"):
        parse_resources({"cuda.shares": "-0.5"})
    with pytest.raises(InvalidResourceRequest, match="expected an object"):
        parse_resources(["cuda.shares", "0.5"])
