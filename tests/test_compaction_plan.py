"""The fragmentation map and the compaction plan (accelerators.allocation.compaction), pure: unit
cases, and properties over random clusters filled by the allocator: applying a plan makes its
target fit and every moved session fit again, it never moves a session that is not preemptible
or inside its minimum runtime, and no smaller set of sessions would have done."""
from __future__ import annotations

from decimal import Decimal
from itertools import combinations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accelerators.allocation import core
from accelerators.allocation.compaction import compaction_plan, fragmentation_map, movable
from accelerators.allocation.errors import AllocationError
from accelerators.allocation.preemption import release
from tests.test_preemption_choice import FRACTIONAL, NOW, fill, node, shares

D = Decimal


def test_free_capacity_no_recent_shape_can_use_is_stranded():
    nodes, _ = fill([node("n1"), node("n2")], [
        ("a", "1.75", {}), ("b", "2", {}),  # n1: 0.25 fGPU free on device 0, none on device 1
        ("c", "1", {}),                     # n2: 1 free on device 0, 2 on device 1
    ])
    recent = [shares("0.5"), shares("1")]

    found = fragmentation_map(nodes, FRACTIONAL, shapes=recent)

    by_device = {d.device_id: d for d in found.devices}
    assert by_device["n1-d0"].free == D("0.25") and by_device["n1-d0"].stranded
    assert not by_device["n2-d0"].stranded and not by_device["n2-d1"].stranded
    assert (found.free, found.stranded) == (D("3.25"), D("0.25"))
    assert found.largest_fgpu == D("3") and found.largest_shape.amount == D("1")


def test_a_node_without_cores_left_strands_all_its_free_fgpu():
    nodes, _ = fill([node("n1", cpu=1)], [("a", "0.5", {})])  # the one core is taken: 3.5 fGPU no one can use
    found = fragmentation_map(nodes, FRACTIONAL, shapes=[shares("0.5")])
    assert found.stranded == found.free == D("3.5") and found.largest_shape is None


def test_the_plan_moves_the_cheapest_preemptible_sessions_to_where_they_fit_again():
    one, on_one = fill([node("n1", gpus=1)], [("keep", "1", {"preemptible": False}),
                                              ("other", "0.5", {"preemptible": True, "started_at": 5_000.0})])
    two, on_two = fill([node("n2", gpus=1)], [("big", "1", {"preemptible": True, "started_at": 0.0}),
                                              ("small", "0.5", {"preemptible": True, "started_at": 9_000.0})])
    nodes, holders = one + two, on_one + on_two

    plan = compaction_plan(nodes, holders, shares("1"), FRACTIONAL, now=NOW)

    # Moving "big" would free the most but it fits nowhere after; "other" or "small" would do:
    # "small" ran least (0.5 fGPU × 1,000 s), so it goes, to n1's free half.
    assert [(m.holder.session_id, m.to_node) for m in plan.moves] == [("small", "n1")]
    assert (plan.node_id, plan.sessions_moved, plan.work_lost) == ("n2", 1, 0.5 * 1_000)


def test_no_plan_when_the_moved_sessions_could_not_start_again():
    nodes, holders = fill([node("n1", gpus=1)], [("a", "2", {"preemptible": True})])  # nowhere else to go
    assert compaction_plan(nodes, holders, shares("1"), FRACTIONAL, now=NOW) is None


def test_a_target_that_fits_needs_no_move():
    nodes, holders = fill([node("n1")], [("a", "1", {"preemptible": True})])
    plan = compaction_plan(nodes, holders, shares("1"), FRACTIONAL, now=NOW)
    assert plan.fits_now and plan.sessions_moved == 0 and plan.work_lost == 0


# --- properties -----------------------------------------------------------------------------------

def simulate(nodes, node_id, victims, target):
    """Apply a move set independently of the planner: free the victims on `node_id`, place the
    target there, then every victim (largest first) anywhere; the nodes after, or None."""
    after = [release(n, victims) if n.node_id == node_id else n for n in nodes]
    row = next(i for i, n in enumerate(after) if n.node_id == node_id)
    try:
        placement = core.place([after[row]], target, FRACTIONAL)
        after[row] = core.apply_placement(after[row], target, placement)
        for v in sorted(victims, key=lambda h: (-h.shares, h.session_id)):
            request = core.ResourceRequest("shares", amount=v.shares, cpu=v.cpu, mem=v.mem)
            p = core.place(after, request, FRACTIONAL)
            i = next(i for i, n in enumerate(after) if n.node_id == p.node_id)
            after[i] = core.apply_placement(after[i], request, p)
    except AllocationError:
        return None
    return after


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gpus=st.lists(st.integers(min_value=1, max_value=2), min_size=1, max_size=3),
       specs=st.lists(st.tuples(st.sampled_from(["0.25", "0.5", "1", "1.5", "2"]), st.booleans(),
                                st.integers(min_value=0, max_value=9_999), st.sampled_from([0, 600, 3_600])),
                      min_size=1, max_size=6),
       want=st.sampled_from(["0.5", "1", "1.5", "2", "3"]))
def test_applying_a_plan_makes_the_target_fit_and_never_moves_a_session_that_may_not_be_moved(gpus, specs, want):
    nodes, holders = fill([node(f"n{i}", gpus=g) for i, g in enumerate(gpus)], [
        (f"s{i}", amount, {"preemptible": p, "started_at": float(t), "min_runtime": m})
        for i, (amount, p, t, m) in enumerate(specs)])
    target = shares(want)

    plan = compaction_plan(nodes, holders, target, FRACTIONAL, now=NOW)

    allowed = [h for h in holders if movable(h, NOW)]
    smallest = None
    for n in nodes:
        mine = [h for h in allowed if h.node_id == n.node_id]
        for size in range(len(mine) + 1):
            if smallest is not None and size >= smallest:
                break
            if any(simulate(nodes, n.node_id, list(subset), target) for subset in combinations(mine, size)):
                smallest = size
                break
    if plan is None:
        assert smallest is None  # no move set would have done it
        return
    victims = [m.holder for m in plan.moves]
    assert all(v.preemptible and v.ran(NOW) >= v.min_runtime and v.node_id == plan.node_id for v in victims)
    assert simulate(nodes, plan.node_id, victims, target) is not None  # applied: the target and every moved session fit
    assert len(victims) == smallest  # the fewest
