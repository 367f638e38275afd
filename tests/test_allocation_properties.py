"""Property tests of the pure allocator over random clusters and random request/release sequences.

The test keeps its own model of what each device and node holds: it applies every grant the
allocator returns and releases random earlier ones, then rebuilds the frozen states the
allocator reads. No database.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from decimal import ROUND_DOWN, Decimal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accelerators.allocation.core import (
    DeviceState,
    FractionalSettings,
    NodeState,
    ResourceRequest,
    allocate_shares,
    max_devices,
    max_shares,
    place,
)
from accelerators.allocation.errors import AllocationError, InsufficientResource, NeverSchedulable

GiB = 1 << 30
D = Decimal

fractional_settings = st.builds(
    FractionalSettings,
    unit_mem=st.sampled_from([GiB // 2, GiB, 2 * GiB, 4 * GiB, 5 * GiB]),
    unit_proc=st.sampled_from([4, 8, 20, 40]),
    quantum=st.sampled_from([D("0.01"), D("0.05"), D("0.1"), D("0.25"), D("0.5"), D("1")]),
)

device_totals = st.tuples(
    st.integers(min_value=GiB // 2, max_value=96 * GiB),  # any byte count, not only whole GiB
    st.integers(min_value=1, max_value=144),                # SMs
    st.sampled_from([0, 1, None]),                          # NUMA node
)

clusters = st.lists(
    st.tuples(
        st.integers(min_value=2, max_value=16),             # CPU cores
        st.lists(device_totals, min_size=1, max_size=8),
    ),
    min_size=1,
    max_size=4,
)


@dataclass
class Model:
    """What the test believes every device and node holds, from the grants it applied."""

    nodes: list[tuple[str, int, int]]                      # (node_id, cpu_total, mem_total)
    devices: dict[str, list[tuple[str, int, int, int | None]]]  # node_id → (device_id, memory, SMs, NUMA)
    cpu_used: dict[str, int] = field(default_factory=dict)
    mem_used: dict[str, int] = field(default_factory=dict)
    memory_used: dict[str, int] = field(default_factory=dict)
    proc_used: dict[str, Decimal] = field(default_factory=dict)
    sessions: dict[str, int] = field(default_factory=dict)
    live: list[tuple[str, ResourceRequest, tuple]] = field(default_factory=list)

    def states(self) -> list[NodeState]:
        return [
            NodeState(
                node_id=node_id, cpu_total=cpu, mem_total=mem,
                cpu_used=self.cpu_used.get(node_id, 0), mem_used=self.mem_used.get(node_id, 0),
                devices=tuple(
                    DeviceState(device_id=dev, memory_total=memory, proc_total=sms,
                                memory_used=self.memory_used.get(dev, 0), proc_used=self.proc_used.get(dev, D(0)),
                                sessions=self.sessions.get(dev, 0), numa_node=numa)
                    for dev, memory, sms, numa in self.devices[node_id]
                ),
            )
            for node_id, cpu, mem in self.nodes
        ]

    def apply(self, node_id: str, request: ResourceRequest, grants: tuple, sign: int) -> None:
        self.cpu_used[node_id] = self.cpu_used.get(node_id, 0) + sign * request.cpu
        self.mem_used[node_id] = self.mem_used.get(node_id, 0) + sign * request.mem
        for g in grants:
            self.memory_used[g.device_id] = self.memory_used.get(g.device_id, 0) + sign * g.memory
            self.proc_used[g.device_id] = self.proc_used.get(g.device_id, D(0)) + sign * g.procs
            self.sessions[g.device_id] = self.sessions.get(g.device_id, 0) + sign


def build_model(cluster) -> Model:
    nodes, devices = [], {}
    for n, (cpu, devs) in enumerate(cluster):
        node_id = f"node-{n}"
        nodes.append((node_id, cpu, 64 * GiB))
        devices[node_id] = [(f"{node_id}/gpu-{i}", memory, sms, numa) for i, (memory, sms, numa) in enumerate(devs)]
    return Model(nodes=nodes, devices=devices)


def assert_within_totals(model: Model) -> None:
    for state in model.states():
        assert 0 <= state.cpu_used <= state.cpu_total
        assert 0 <= state.mem_used <= state.mem_total
        for d in state.devices:
            assert 0 <= d.memory_used <= d.memory_total, d
            assert 0 <= d.proc_used <= d.proc_total, d


def check_grants(request: ResourceRequest, placement, nodes: list[NodeState], fs: FractionalSettings) -> None:
    node = next(n for n in nodes if n.node_id == placement.node_id)
    ids = [g.device_id for g in placement.grants]
    assert len(ids) == len(set(ids)), "a device granted twice in one placement"
    assert set(ids) <= {d.device_id for d in node.devices}, "a grant on another node's device"
    if request.kind == "shares":
        assert sum((g.shares for g in placement.grants), D(0)) == request.amount
        for g in placement.grants:
            assert g.shares > 0 and g.shares % fs.quantum == 0
            assert g.memory == int((fs.unit_mem * g.shares).to_integral_value(rounding=ROUND_DOWN))
            assert g.procs == fs.unit_proc * g.shares
    else:
        assert len(placement.grants) == request.amount
        by_id = {d.device_id: d for d in node.devices}
        for g in placement.grants:
            assert by_id[g.device_id].is_idle
            assert (g.memory, g.procs) == (by_id[g.device_id].memory_total, by_id[g.device_id].proc_total)


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(fs=fractional_settings, cluster=clusters, data=st.data())
def test_random_requests_and_releases_never_overcommit_and_grant_exactly_what_was_asked(fs, cluster, data):
    model = build_model(cluster)
    steps = data.draw(st.integers(min_value=1, max_value=30), label="steps")
    for _ in range(steps):
        if model.live and data.draw(st.integers(0, 3), label="release?") == 0:
            node_id, request, grants = model.live.pop(data.draw(st.integers(0, len(model.live) - 1), label="which"))
            model.apply(node_id, request, grants, -1)
            assert_within_totals(model)
            continue

        if data.draw(st.integers(0, 4), label="whole devices?") == 0:
            request = ResourceRequest(kind="device", amount=D(data.draw(st.integers(1, 4), label="count")),
                                      cpu=data.draw(st.integers(1, 4), label="cpu"))
        else:
            quanta = data.draw(st.integers(1, int(4 / fs.quantum)), label="quanta")
            request = ResourceRequest(kind="shares", amount=fs.quantum * quanta,
                                      cpu=data.draw(st.integers(1, 4), label="cpu"),
                                      mem=data.draw(st.sampled_from([0, GiB, 8 * GiB]), label="mem"))
        policy = data.draw(st.sampled_from(["binpack", "spread"]), label="policy")
        strategy = data.draw(st.sampled_from(["evenly", "fill"]), label="strategy")

        nodes = model.states()
        before = copy.deepcopy(nodes)
        eligible = [n for n in nodes
                    if n.cpu_total - n.cpu_used >= request.cpu and n.mem_total - n.mem_used >= request.mem]
        if request.kind == "shares":
            placeable = max_shares(eligible, fs) >= request.amount
        else:
            placeable = max_devices(eligible) >= request.amount

        try:
            placement = place(nodes, request, fs, policy=policy, strategy=strategy)
        except (InsufficientResource, NeverSchedulable) as exc:
            assert not placeable, f"{request} fits {max_shares(eligible, fs)} free fGPU but failed: {exc}"
            assert nodes == before, "a failed placement changed its input"
            continue
        assert nodes == before, "a placement changed its input"
        assert placeable, f"{request} placed although the free capacity said it could not be"
        check_grants(request, placement, nodes, fs)
        model.apply(placement.node_id, request, placement.grants, +1)
        model.live.append((placement.node_id, request, placement.grants))
        assert_within_totals(model)

    # Releasing everything returns every counter to exactly zero (exact Decimal arithmetic).
    for node_id, request, grants in model.live:
        model.apply(node_id, request, grants, -1)
    for state in model.states():
        assert (state.cpu_used, state.mem_used) == (0, 0)
        assert all(d.is_idle for d in state.devices)


@settings(max_examples=80, deadline=None, database=None)
@given(fs=fractional_settings, cluster=clusters, data=st.data())
def test_the_sliders_max_is_always_placeable_on_the_node_that_offers_it(fs, cluster, data):
    model = build_model(cluster)
    # Fill the cluster to a random level with fill-strategy grants, then ask for the max.
    for _ in range(data.draw(st.integers(0, 12), label="fills")):
        nodes = model.states()
        node = nodes[data.draw(st.integers(0, len(nodes) - 1), label="node")]
        amount = fs.quantum * data.draw(st.integers(1, int(2 / fs.quantum)), label="quanta")
        try:
            grants = allocate_shares(node.devices, amount, fs, strategy="fill")
        except InsufficientResource:
            continue
        model.apply(node.node_id, ResourceRequest(kind="shares", amount=amount, cpu=0), grants, +1)
    assert_within_totals(model)

    nodes = model.states()
    largest = max_shares(nodes, fs)
    for node in nodes:
        own_max = max_shares([node], fs)
        assert own_max <= largest
        if own_max == 0:
            continue
        assert own_max % fs.quantum == 0
        for strategy in ("evenly", "fill"):
            grants = allocate_shares(node.devices, own_max, fs, strategy=strategy)
            assert sum((g.shares for g in grants), D(0)) == own_max
            # …and one quantum more never fits that node.
            try:
                allocate_shares(node.devices, own_max + fs.quantum, fs, strategy=strategy)
            except InsufficientResource:
                pass
            else:
                raise AssertionError(f"{own_max + fs.quantum} fGPU fit {node.node_id} beyond its max {own_max}")
    if largest > 0:
        for policy in ("binpack", "spread"):
            placement = place(nodes, ResourceRequest(kind="shares", amount=largest, cpu=1), fs, policy=policy)
            assert sum((g.shares for g in placement.grants), D(0)) == largest


@settings(max_examples=60, deadline=None, database=None)
@given(fs=fractional_settings, cluster=clusters, data=st.data())
def test_a_failed_allocation_returns_nothing_and_leaves_the_devices_untouched(fs, cluster, data):
    model = build_model(cluster)
    node = model.states()[0]
    free = max_shares([node], fs)
    amount = free + fs.quantum * data.draw(st.integers(1, 8), label="beyond")
    devices = list(node.devices)
    before = copy.deepcopy(devices)
    result = None
    try:
        result = allocate_shares(devices, amount, fs, strategy=data.draw(st.sampled_from(["evenly", "fill"])))
    except AllocationError as exc:
        assert isinstance(exc, InsufficientResource)
    assert result is None
    assert devices == before
