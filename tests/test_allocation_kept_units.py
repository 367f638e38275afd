"""The allocator's kept device conversions (accelerators/allocation/core.py `_units`): a device's
free and total figures in quanta are converted once per distinct (memory, SMs, use, split count)
and settings, and a change to any of them is converted afresh — the same figures as the
conversion itself, whatever was asked before.

No database: plain Python over frozen dataclasses.
"""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accelerators.allocation import core
from accelerators.allocation.core import (
    FractionalSettings,
    ResourceRequest,
    allocate_shares,
    device_units,
    node_row,
    shares_grant,
)
from tests.builders import gpu, node

GiB = 1 << 30
D = Decimal
DEMO = FractionalSettings(unit_mem=4 * GiB, unit_proc=40, quantum=D("0.25"))
FINE = FractionalSettings(unit_mem=4 * GiB, unit_proc=40, quantum=D("0.05"))


def taking(device, fgpu: str, settings: FractionalSettings = DEMO):
    """`device` with one more session holding `fgpu` fGPU of it."""
    grant = shares_grant(device.device_id, D(fgpu), settings)
    return replace(
        device,
        memory_used=device.memory_used + grant.memory,
        proc_used=device.proc_used + grant.procs,
        sessions=device.sessions + 1,
    )


def test_a_device_whose_use_changed_is_converted_afresh():
    idle = gpu("a")
    assert device_units(idle, DEMO) == (8, 8)
    half = taking(idle, "1")
    assert device_units(half, DEMO) == (4, 8)  # the same device id: its use is in the key
    assert device_units(idle, DEMO) == (8, 8)  # and the idle figures are still the idle device's
    split = replace(half, max_sessions=1)  # its split count reached: full
    assert device_units(split, DEMO) == (0, 8)
    held = replace(idle, proc_used=D(80))  # all its SMs held (a whole-device grant)
    assert device_units(held, DEMO) == (0, 8)


def test_other_settings_convert_the_same_device_afresh():
    device = taking(gpu("a"), "0.5")
    assert device_units(device, DEMO) == (6, 8)
    assert device_units(device, FINE) == (30, 40)
    assert device_units(device, None) == (750, 1000)  # discrete mode: thousandths of its memory


def test_the_allocator_sees_a_device_filled_since_it_was_last_converted():
    a, b = gpu("a"), gpu("b")
    assert [g.device_id for g in allocate_shares([a, b], D("1.5"), DEMO)] == ["a"]
    a = taking(a, "1.5")  # now 0.5 free on a: 1.5 goes to b, 0.5 back to a (the least free that holds it)
    assert [g.device_id for g in allocate_shares([a, b], D("1.5"), DEMO)] == ["b"]
    assert [g.device_id for g in allocate_shares([a, b], D("0.5"), DEMO)] == ["a"]


def test_a_full_table_starts_afresh_and_answers_alike(monkeypatch):
    monkeypatch.setattr(core, "UNITS_KEPT", 3)
    device = gpu("a")
    seen = []
    for _ in range(8):
        seen.append(device_units(device, DEMO))
        device = taking(device, "0.25")
        assert len(core._units_table(DEMO)) <= 4
    assert seen == [(8 - i, 8) for i in range(8)]


@settings(max_examples=200, deadline=None)
@given(
    memory=st.sampled_from([4 * GiB, 8 * GiB, 12 * GiB, 1 * GiB]),
    sms=st.sampled_from([40, 80, 108, 20]),
    taken=st.lists(st.sampled_from(["0.25", "0.5", "0.75", "1"]), max_size=6),
    max_sessions=st.integers(0, 4),
    quantum=st.sampled_from([D("0.25"), D("0.05"), D("0.5")]),
)
def test_kept_figures_equal_a_fresh_conversion(memory, sms, taken, max_sessions, quantum):
    settings_ = FractionalSettings(unit_mem=4 * GiB, unit_proc=40, quantum=quantum)
    device = gpu("a", memory=memory, sms=sms, max_sessions=max_sessions)
    for fgpu in taken:
        assert device_units(device, settings_) == core._device_units_of(device, settings_)
        expected_free = int(core.truncate(core.device_free_shares(device, settings_), quantum) / quantum)
        assert core._units(device, settings_, core._units_table(settings_))[0] == expected_free
        row = node_row(node("n", device), settings_)
        assert row["free"] == [core._device_units_of(device, settings_)[0]]
        device = taking(device, fgpu, settings_)


@pytest.mark.parametrize("amount", ["0.5", "1", "1.75"])
def test_placement_after_use_matches_a_cold_table(amount):
    nodes = [node("n0", gpu("a"), taking(gpu("b"), "1")), node("n1", taking(gpu("c"), "1.5"), gpu("d"))]
    request = ResourceRequest(kind="shares", amount=D(amount))
    warm = core.place(nodes, request, DEMO, policy="binpack")
    core._units_kept.clear()
    cold = core.place(nodes, request, DEMO, policy="binpack")
    assert warm == cold
