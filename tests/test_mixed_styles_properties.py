"""Property tests over random inventories and random sequences of mixed-style requests
(fGPU shares, whole devices, HAMi memory + cores, Run:ai fractions) and releases: no device is
ever over its capacity in any dimension (memory, SMs, sessions), and releasing what was
allocated restores every counter exactly."""
from __future__ import annotations

from dataclasses import replace
from decimal import Decimal as D

from hypothesis import given, settings
from hypothesis import strategies as st

from accelerators.allocation.core import DeviceState, FractionalSettings, NodeState, place
from accelerators.allocation.errors import InsufficientResource, NeverSchedulable
from accelerators.allocation.requests import parse_resources

GiB = 1 << 30
SETTINGS = FractionalSettings(unit_mem=2 * GiB, unit_proc=8, quantum=D("0.25"))

device_specs = st.tuples(st.sampled_from([8, 16, 24, 40, 80]), st.sampled_from([40, 80, 108, 132]), st.integers(1, 4))
requests = st.one_of(
    st.builds(lambda a: {"cuda.shares": str(D(a) / 4)}, st.integers(1, 40)),
    st.builds(lambda n: {"cuda.device": n}, st.integers(1, 3)),
    st.builds(lambda n, m, c: {"gpu": n, "gpu_memory": f"{m}G", "gpu_cores": c},
              st.integers(1, 3), st.integers(1, 20), st.integers(0, 100)),
    st.builds(lambda p: {"gpu": 1, "gpu_memory_percentage": p}, st.integers(1, 100)),
    st.builds(lambda f: {"gpu_fraction": str(D(f) / 10)}, st.integers(1, 10)),
)
steps = st.lists(st.one_of(st.tuples(st.just("take"), requests), st.tuples(st.just("release"), st.integers(0, 50))),
                 min_size=1, max_size=25)


def apply(nodes, grants, sign):
    by_device = {g.device_id: g for g in grants}
    return [replace(n, devices=tuple(
        replace(d, memory_used=d.memory_used + sign * by_device[d.device_id].memory,
                proc_used=d.proc_used + sign * by_device[d.device_id].procs,
                sessions=d.sessions + sign) if d.device_id in by_device else d
        for d in n.devices)) for n in nodes]


@settings(max_examples=150, deadline=None, database=None)
@given(st.lists(st.lists(device_specs, min_size=1, max_size=4), min_size=1, max_size=3), steps)
def test_mixed_style_sequences_never_overcommit_and_release_restores_every_counter(layout, sequence):
    nodes = [
        NodeState(node_id=f"n{i}", cpu_total=64, mem_total=256 * GiB, devices=tuple(
            DeviceState(device_id=f"n{i}d{j}", memory_total=mem * GiB, proc_total=sms, max_sessions=split,
                        uuid=f"GPU-{i}-{j}", index=j)
            for j, (mem, sms, split) in enumerate(devices)))
        for i, devices in enumerate(layout)
    ]
    start = nodes
    held = []
    for action, value in sequence:
        if action == "take":
            try:
                placement = place(nodes, parse_resources(value), SETTINGS)
            except (InsufficientResource, NeverSchedulable):
                continue
            nodes = apply(nodes, placement.grants, +1)
            held.append(placement.grants)
        elif held:
            nodes = apply(nodes, held.pop(value % len(held)), -1)
        for n in nodes:
            for d in n.devices:
                assert 0 <= d.memory_used <= d.memory_total, d
                assert 0 <= d.proc_used <= d.proc_total, d
                assert 0 <= d.sessions <= d.max_sessions, d
    while held:
        nodes = apply(nodes, held.pop(), -1)
    assert nodes == start
