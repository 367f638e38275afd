"""fgd-plus's device packing plan (accelerators/allocation/packing.py): the cutting-stock LP,
its on-plan table, and its use by the index (openb's SHARE requests) and by the allocator
(the scheduler's fGPU requests); and the index's kept F rows giving the same choices as a
fresh computation.

Hand-made clusters are in openb's units (milli-cores, MiB, milli-GPU per device of 1000).
"""
from __future__ import annotations

from decimal import Decimal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accelerators.allocation import cluster
from accelerators.allocation.cluster import NONE, SHARE, SPAN, WHOLE, ClusterIndex, Shape, Workload
from accelerators.allocation.core import FractionalSettings, ResourceRequest, place
from accelerators.allocation.packing import solve_packing_plan
from tests.builders import gpu_in_fgpu, node

GiB = 1 << 30


def index(*nodes: tuple[int, list[int]]) -> ClusterIndex:
    """Nodes as (cpu milli-cores, [free milli-GPU per device]); devices hold 1000, 64 GiB."""
    width = max(len(n[1]) for n in nodes)
    cap = np.zeros((len(nodes), width), dtype=np.int64)
    free = np.zeros((len(nodes), width), dtype=np.int64)
    for i, (_, devices) in enumerate(nodes):
        cap[i, :len(devices)] = 1000
        free[i, :len(devices)] = devices
    return ClusterIndex(names=[f"n{i}" for i in range(len(nodes))], cpu_total=[n[0] for n in nodes],
                        mem_total=[65536] * len(nodes), models=["G"] * len(nodes), cap=cap, free=free)


def share(milli: int, cpu: int = 1000) -> Shape:
    return Shape(SHARE, cpu=cpu, mem=1024, count=1, amount=milli)


# --- the plan ---------------------------------------------------------------------------------

def test_the_plan_pairs_amounts_that_fill_a_device():
    plan = solve_packing_plan(1000, {810: 10, 160: 10})
    assert plan.bins == pytest.approx(10)  # each 0.81 with a 0.16: ten devices
    assert ((160, 1), (810, 1)) in plan.patterns
    # A device with 0.81 taken waits for a 0.16 and the other way round; an idle one takes either.
    assert plan.on_plan(np.array([0, 810, 160, 470]), 160).tolist() == [True, True, False, False]
    assert plan.on_plan(np.array([0, 810, 160]), 810).tolist() == [True, False, True]
    assert plan.on_plan(np.array([810]), 300).tolist() == [False]  # an amount it does not know


def test_spare_room_in_a_pattern_takes_the_largest_amounts_that_fit():
    # 0.47 + 0.47 leaves 0.06: a 0.05 request may take it, so a device at 0.94 is on plan for 0.05.
    plan = solve_packing_plan(1000, {470: 20, 50: 1})
    assert plan.on_plan(np.array([940, 470]), 50).tolist() == [True, True]


def test_nothing_to_plan_gives_none_and_amounts_above_the_capacity_are_left_out():
    assert solve_packing_plan(1000, {}) is None
    assert solve_packing_plan(1000, {1500: 3, 0: 2}) is None
    plan = solve_packing_plan(1000, {1500: 3, 500: 4})
    assert plan.amounts == (500,) and plan.bins == pytest.approx(2)


@settings(max_examples=30, deadline=None)
@given(demand=st.dictionaries(st.sampled_from([50, 110, 230, 320, 470, 550, 650, 810, 1000]),
                              st.integers(1, 40), min_size=1, max_size=6))
def test_the_lp_covers_the_demand_with_patterns_that_fit_and_bounds_the_devices_needed(demand):
    plan = solve_packing_plan(1000, demand)
    for pattern in plan.patterns:
        assert sum(a * n for a, n in pattern) <= 1000
    for amount, need in demand.items():
        covered = sum(x * dict(p).get(amount, 0) for p, x in zip(plan.patterns, plan.frequency))
        assert covered >= need - 1e-6
    assert plan.bins >= sum(a * n for a, n in demand.items()) / 1000 - 1e-6
    assert plan.bins == pytest.approx(sum(plan.frequency))
    # Starting from another demand's plan reaches the same optimum.
    warm = solve_packing_plan(1000, demand, start=solve_packing_plan(1000, {470: 3, 810: 2}))
    assert warm.bins == pytest.approx(plan.bins)


def test_a_fine_capacity_is_priced_in_coarser_steps_and_stays_within_it():
    plan = solve_packing_plan(10 ** 6, {333_333: 5, 1: 2})
    for pattern in plan.patterns:
        assert sum(a * n for a, n in pattern) <= 10 ** 6


# --- the index follows it (openb's SHARE requests) ---------------------------------------------

def test_fgd_plus_puts_a_share_on_a_device_on_plan_before_an_idle_one_and_an_idle_before_an_off_plan_one():
    # n0: 0.82 taken (0.18 free, off plan for 0.16); n1: 0.81 taken (on plan: 0.81 + 0.16); n2: idle.
    workload = Workload({share(810): 5, share(160): 5, share(470): 4})
    idx = index((8000, [180]), (8000, [190]), (8000, [1000]))
    assert idx.choose(share(160), "best-fit", workload)[0] == 0  # the tightest fit
    assert idx.choose(share(160), "fgd-plus", workload) == (1, 0)
    assert index((8000, [180]), (8000, [1000])).choose(share(160), "fgd-plus", workload)[0] == 1
    # Both candidates kept in the full ranking: the plan orders them.
    assert idx.ranking(share(160), "fgd-plus", workload)[:2] == [1, 2]


def test_without_a_plan_a_share_has_no_preference_for_idle_devices():
    # Only whole-GPU requests seen: no fractional amounts to plan, so fgd-plus's own score packs
    # the 0.3 onto the used device rather than opening the idle one.
    workload = Workload({Shape(WHOLE, cpu=1000, mem=1024, count=1, amount=1000): 3})
    assert workload.packing_plan(1000) is None
    assert index((8000, [500]), (8000, [1000])).choose(share(300), "fgd-plus", workload) == (0, 0)


def test_the_plan_is_solved_again_as_the_workload_grows_and_when_an_amount_is_new():
    workload = Workload({share(500): 4})
    first = workload.packing_plan(1000)
    assert workload.packing_plan(1000) is first  # nothing new: kept
    workload.observe(share(250))
    second = workload.packing_plan(1000)
    assert second is not first and 250 in second.amounts
    for _ in range(cluster.REPLAN_GROWTH.__ceil__() * 5):
        workload.observe(share(500))
    assert workload.packing_plan(1000) is not second


# --- the allocator follows it (the scheduler's fGPU requests) ----------------------------------

DEMO = FractionalSettings(unit_mem=4 * GiB, unit_proc=40, quantum=Decimal("0.25"))


def test_a_real_fgpu_request_goes_to_the_node_and_device_the_plan_names():
    # Seen: 1.0 and 0.5 fGPU requests (4 and 2 quanta); the plan fills a 2.0 device as 1.0 + 0.5 + 0.5.
    seen = Workload({Shape(SPAN, cpu=1, amount=4): 5, Shape(SPAN, cpu=1, amount=2): 10})
    plan = seen.packing_plan(8)
    assert plan.on_plan(np.array([4, 5]), 2).tolist() == [True, False]
    req = ResourceRequest(kind="shares", amount=Decimal("0.5"), cpu=1)
    # One node, two devices: 1.25 taken (0.75 free, the tighter fit, off plan) and 1.0 taken (on plan).
    # (2.0 fGPU devices: 8 GiB and 80 SMs at 4 GiB / 40 SMs an fGPU, 8 quanta of 0.25.)
    one = [node("n0", gpu_in_fgpu("a", free=Decimal("0.75"), sessions=1), gpu_in_fgpu("b", free=Decimal("1.0"), sessions=1))]
    assert place(one, req, DEMO, policy="best-fit").grants[0].device_id == "a"
    assert place(one, req, DEMO, policy="fgd-plus", workload=seen).grants[0].device_id == "b"
    # Two nodes with one device each: the node choice follows the plan too.
    two = [node("n0", gpu_in_fgpu("a", free=Decimal("0.75"), sessions=1)),
           node("n1", gpu_in_fgpu("b", free=Decimal("1.0"), sessions=1))]
    assert place(two, req, DEMO, policy="best-fit").node_id == "n0"
    assert place(two, req, DEMO, policy="fgd-plus", workload=seen).node_id == "n1"


# --- kept F rows: the same choices as computing afresh ------------------------------------------

pods = st.one_of(
    st.builds(lambda m, c: share(m, cpu=c), st.sampled_from([160, 250, 470, 500, 810]), st.sampled_from([0, 2000, 6000])),
    st.builds(lambda n, c: Shape(WHOLE, cpu=c, mem=1024, count=n, amount=1000), st.sampled_from([1, 2]),
              st.sampled_from([1000, 8000])),
    st.builds(lambda c: Shape(NONE, cpu=c, mem=512), st.sampled_from([1000, 12000])),
)


@settings(max_examples=40, deadline=None)
@given(specs=st.lists(st.tuples(st.sampled_from([16000, 64000]), st.sampled_from([1, 2, 4])), min_size=2, max_size=8),
       stream=st.lists(pods, min_size=1, max_size=60), policy=st.sampled_from(["fgd", "fgd-plus"]))
def test_kept_rows_choose_as_a_fresh_index_does(specs, stream, policy):
    idx = index(*[(cpu, [1000] * gpus) for cpu, gpus in specs])
    workload = Workload()
    for pod in stream:
        workload.observe(pod)
        fresh = idx.copy()  # same state ids, nothing kept (compared before `idx` scores: fresh is cold)
        expected = fresh.choose(pod, policy, workload)
        ranked = fresh.ranking(pod, policy, workload)  # scores every candidate: no class left out
        assert (expected is None) == (not ranked)
        assert expected is None or expected[0] == ranked[0]
        kept, fresh_keys = idx.scores(pod, policy, workload)[2], fresh.scores(pod, policy, workload)[2]
        assert all(np.array_equal(a, b) for a, b in zip(kept, fresh_keys, strict=True))  # exact, not close
        assert idx.choose(pod, policy, workload) == expected
        idx.place(pod, policy, workload)


@pytest.mark.parametrize("policy", ["fgd", "fgd-plus"])
def test_a_request_that_fits_nowhere_gets_none_after_new_shapes_widen_the_workload(policy):
    idx = index((8000, [1000]), (8000, [1000]))
    workload = Workload()
    for milli in (100, 200, 300):  # rows kept for 3 shapes
        workload.observe(share(milli))
        idx.place(share(milli), policy, workload)
    for cpu in range(1000, 40000, 1000):  # many shapes seen since, none scored
        workload.observe(Shape(NONE, cpu=cpu, mem=64))
    too_big = Shape(WHOLE, cpu=1000, mem=1024, count=4, amount=1000)
    workload.observe(too_big)
    assert idx.choose(too_big, policy, workload) is None
    assert idx.ranking(too_big, policy, workload) == []


def test_dropping_the_kept_after_rows_at_their_cap_changes_no_score(monkeypatch):
    monkeypatch.setattr(cluster, "AFTER_ROWS", 8)  # dropped and refilled many times below
    drops = 0
    clear = cluster._FragCache.after_ids

    def counting(self, shape, keys):
        nonlocal drops
        drops += self.after_used + len(keys) > cluster.AFTER_ROWS
        return clear(self, shape, keys)

    monkeypatch.setattr(cluster._FragCache, "after_ids", counting)
    rng = np.random.default_rng(7)
    idx = index(*[(int(rng.choice([16000, 64000])), [1000] * int(rng.choice([1, 2, 4]))) for _ in range(12)])
    workload = Workload()
    menu = [share(160), share(470), share(810), Shape(WHOLE, cpu=2000, mem=1024, count=1, amount=1000),
            Shape(NONE, cpu=4000, mem=512)]
    for _ in range(80):
        pod = menu[int(rng.integers(len(menu)))]
        workload.observe(pod)
        fresh = idx.copy()
        want, got = fresh.scores(pod, "fgd-plus", workload)[2], idx.scores(pod, "fgd-plus", workload)[2]
        assert all(np.array_equal(a, b) for a, b in zip(want, got, strict=True))
        assert len(idx._by_state.after_cols) == 64  # never grown past its first 64 rows: dropped instead
        idx.place(pod, "fgd-plus", workload)
    assert drops > 10
