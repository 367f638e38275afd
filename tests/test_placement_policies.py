"""Node-choice policies and the incremental cluster index (accelerators/allocation/cluster.py),
the allocator's use of them (core.place), and the scheduler's use of a resource group's policy.

The small clusters are hand-made in openb's units (milli-cores, MiB, milli-GPU per device).
"""
from __future__ import annotations

from decimal import Decimal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accelerators.allocation import cluster
from accelerators.allocation.cluster import NONE, SHARE, SPAN, WHOLE, ClusterIndex, Shape, Workload
from accelerators.allocation.core import (
    FractionalSettings,
    ResourceRequest,
    apply_placement,
    cluster_index,
    node_row,
    place,
)
from tests.builders import gpu, node

GiB = 1 << 30
DEMO = FractionalSettings(unit_mem=4 * GiB, unit_proc=40, quantum=Decimal("0.25"))


def index(*nodes: tuple[int, int, list[int]], models: list[str] | None = None) -> ClusterIndex:
    """Nodes as (cpu milli-cores, memory MiB, [free milli-GPU per device]); devices hold 1000."""
    width = max(len(n[2]) for n in nodes)
    cap = np.zeros((len(nodes), width), dtype=np.int64)
    free = np.zeros((len(nodes), width), dtype=np.int64)
    for i, (_, _, devices) in enumerate(nodes):
        cap[i, :len(devices)] = 1000
        free[i, :len(devices)] = devices
    return ClusterIndex(names=[f"n{i}" for i in range(len(nodes))], cpu_total=[n[0] for n in nodes],
                        mem_total=[n[1] for n in nodes], models=models or ["G"] * len(nodes), cap=cap, free=free)


def share(milli: int, cpu: int = 1000, mem: int = 1024, **kw) -> Shape:
    return Shape(SHARE, cpu=cpu, mem=mem, count=1, amount=milli, **kw)


def whole(count: int, cpu: int = 1000, mem: int = 1024) -> Shape:
    return Shape(WHOLE, cpu=cpu, mem=mem, count=count, amount=1000)


def naive_fragmentation(cpu: int, mem: int, model: str, free: list[int], workload: Workload) -> float:
    """Σ_m p_m F_n(m) straight from the paper's definition (Weng et al. ATC'23, §4.1), one
    shape at a time: the reference the vectorised index must agree with."""
    total = 0.0
    for shape, count in workload.counts().items():
        fits = shape.cpu <= cpu and shape.mem <= mem and (not shape.models or model in shape.models)
        if shape.kind == SHARE:
            fits = fits and any(f >= shape.amount for f in free)
            frag = sum(f for f in free if f < shape.amount)
        elif shape.kind == WHOLE:
            fits = fits and sum(1 for f in free if f == 1000) >= shape.count
            frag = sum(f for f in free if f < 1000)
        else:
            frag = 0
        total += count * (frag if fits else sum(free))
    return total


# --- each policy's choice -------------------------------------------------------------------

def test_fgd_avoids_leaving_a_sliver_the_seen_workload_cannot_use():
    # n0 has a GPU with 0.7 free: a 0.5 pod there leaves 0.2, useless to the 0.5 pods seen so far;
    # on n1's idle GPU it leaves 0.5, which the next 0.5 pod can use.
    idx = index((8000, 8192, [700]), (8000, 8192, [1000]))
    workload = Workload({share(500): 9, share(200, cpu=500): 1})
    assert idx.choose(share(500), "fgd", workload) == (1, 0)
    assert idx.choose(share(500), "best-fit", workload) == (0, 0)  # best fit fills the fuller node


def test_fgd_picks_the_device_within_a_node_by_the_fragmentation_it_leaves():
    idx = index((8000, 8192, [700, 1000]))
    assert idx.choose(share(500), "fgd", Workload({share(500): 1})) == (0, 1)
    assert idx.choose(share(700), "fgd", Workload({share(700): 1})) == (0, 0)


def test_fgd_counts_a_node_whose_cpu_a_pod_exhausts_as_all_fragment():
    # A CPU-only pod on n0 would leave 1 core there, stranding its idle GPU for the 4-core GPU
    # pods seen so far; n1 has cores to spare.
    idx = index((5000, 8192, [1000]), (32000, 8192, [1000]))
    workload = Workload({whole(1, cpu=4000): 5})
    assert idx.choose(Shape(NONE, cpu=4000, mem=1024), "fgd", workload) == (1, -1)
    assert idx.choose(Shape(NONE, cpu=4000, mem=1024), "best-fit", workload) == (0, -1)


def test_fgd_plus_packs_where_fgd_is_indifferent():
    # n0 has 2 idle GPUs, n1 one of two left: a 1-GPU pod leaves no fragment for the 1-GPU pods
    # seen on either, so FGD takes the first node; fgd-plus fills n1, keeping n0's pair whole.
    idx = index((32000, 65536, [1000, 1000]), (32000, 65536, [0, 1000]))
    workload = Workload({whole(1): 3})
    assert idx.choose(whole(1), "fgd", workload)[0] == 0
    assert idx.choose(whole(1), "fgd-plus", workload)[0] == 1


def test_fgd_plus_keeps_gpu_less_pods_off_nodes_whose_gpus_they_would_strand():
    # Seen GPU pods bring 8 cores per GPU. A 12-core CPU-only pod on n0 (16 cores, 2 idle GPUs)
    # leaves 4 cores for 2 GPUs; on n1 (64 cores, 2 idle GPUs) it strands nothing.
    idx = index((16000, 65536, [1000, 1000]), (64000, 65536, [1000, 1000]))
    workload = Workload({whole(1, cpu=8000): 4, Shape(NONE, cpu=12000): 1})
    assert idx.choose(Shape(NONE, cpu=12000), "fgd-plus", workload)[0] == 1


def test_binpack_and_spread_and_their_ties():
    idx = index((8000, 8192, [500]), (8000, 8192, [1000]), (8000, 8192, [1000]))
    assert idx.choose(share(300), "binpack")[0] == 0
    assert idx.choose(share(300), "spread")[0] == 1  # the emptiest; of two equal, the first


def test_gpu_spec_restricts_models_and_infeasible_shapes_get_none():
    idx = index((8000, 8192, [1000]), (8000, 8192, [1000]), models=["T4", "V100"])
    assert idx.choose(whole(1) if False else Shape(WHOLE, cpu=1000, count=1, amount=1000, models=frozenset({"V100"})),
                      "best-fit") == (1, -1)
    assert idx.choose(whole(2), "fgd", Workload({whole(2): 1})) is None
    assert idx.place(Shape(NONE, cpu=9000), "binpack") is None


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown placement policy"):
        index((8000, 8192, [1000])).choose(share(100), "first-fit")


def test_the_fragmentation_rate_follows_eq_6():
    idx = index((8000, 8192, [300, 1000]), (8000, 8192, [1000]))
    workload = Workload({share(500): 1})
    # Only n0's 0.3 is a fragment for 0.5 pods: 300 / 2300 free.
    assert idx.fragmentation_rate(workload) == pytest.approx(100 * 300 / 2300)


# --- the incremental index agrees with a recomputation ---------------------------------------

shapes = st.one_of(
    st.builds(lambda m, c: share(m, cpu=c), st.sampled_from([100, 250, 470, 500, 810]), st.sampled_from([0, 2000, 6000])),
    st.builds(lambda n, c: whole(n, cpu=c), st.sampled_from([1, 2, 4]), st.sampled_from([1000, 8000])),
    st.builds(lambda c, m: Shape(NONE, cpu=c, mem=m), st.sampled_from([1000, 12000]), st.sampled_from([0, 4096])),
)


@settings(max_examples=40, deadline=None)
@given(specs=st.lists(st.tuples(st.sampled_from([16000, 64000]), st.sampled_from([1, 2, 4])), min_size=1, max_size=6),
       pods=st.lists(shapes, min_size=1, max_size=40),
       policy=st.sampled_from(cluster.POLICIES))
def test_the_incremental_index_matches_a_recomputation_after_any_placements(specs, pods, policy):
    idx = index(*[(cpu, 65536, [1000] * gpus) for cpu, gpus in specs])
    workload = Workload()
    expected = [{"cpu": cpu, "mem": 65536, "free": [1000] * gpus} for cpu, gpus in specs]
    for pod in pods:
        workload.observe(pod)
        placed = idx.place(pod, policy, workload)
        if placed is None:
            continue
        row, takes = placed
        node = expected[row]
        node["cpu"] -= pod.cpu
        node["mem"] -= pod.mem
        for slot, amount in takes.items():
            node["free"][slot] -= amount
        assert node["cpu"] >= 0 and node["mem"] >= 0 and min(node["free"]) >= 0
        assert sum(takes.values()) == pod.gpu_amount
    fresh = index(*[(n["cpu"], n["mem"], n["free"]) for n in expected])
    assert idx.cpu_free.tolist() == fresh.cpu_free.tolist()
    assert idx.mem_free.tolist() == fresh.mem_free.tolist()
    assert idx.free.tolist() == fresh.free.tolist()
    # Equal states share an equivalence class, unequal ones do not.
    keys = [(n["cpu"], n["mem"], tuple(sorted(n["free"])), len(n["free"])) for n in expected]
    for i in range(len(keys)):
        for j in range(len(keys)):
            assert (idx.state[i] == idx.state[j]) == (keys[i] == keys[j])
    arrays = workload.arrays(idx.model_ids)
    got = idx.frag(np.arange(len(idx)), arrays)
    want = [naive_fragmentation(n["cpu"], n["mem"], "G", n["free"], workload) for n in expected]
    assert got.tolist() == pytest.approx(want)


def test_a_placement_that_would_over_commit_is_refused():
    idx = index((8000, 8192, [1000]))
    with pytest.raises(ValueError, match="over-commit"):
        idx.commit(0, cpu=9000, mem=0, takes={})


# --- the allocator ranks nodes with the index ------------------------------------------------

def test_place_takes_the_group_policy_and_the_request_may_override_it():
    # n0: one device with 1.25 fGPU free (of 2.00); n1: one idle device. 0.5 on n0 leaves 0.75,
    # too little for the 1.0 fGPU requests seen so far; on n1 it leaves 1.5.
    nodes = [node("n0", gpu("a", memory_used=3 * GiB, proc_used="30", sessions=1)), node("n1", gpu("b"))]
    req = ResourceRequest(kind="shares", amount=Decimal("0.5"))
    assert place(nodes, req, DEMO, policy="binpack").node_id == "n0"
    assert place(nodes, req, DEMO, policy="spread").node_id == "n1"
    seen = Workload({cluster.Shape(SPAN, cpu=1, amount=4, memory=8 * GiB): 5})  # 1.0 fGPU requests
    assert place(nodes, req, DEMO, policy="fgd", workload=seen).node_id == "n1"
    assert place(nodes, ResourceRequest(kind="shares", amount=Decimal("0.5"), policy="best-fit"), DEMO,
                 policy="spread").node_id == "n0"


def test_a_kept_index_follows_apply_placement_exactly():
    nodes = [node("n0", gpu("a"), gpu("b")), node("n1", gpu("c"))]
    idx = cluster_index(nodes, DEMO)
    req = ResourceRequest(kind="shares", amount=Decimal("1.5"), cpu=2)
    for _ in range(3):
        placement = place(nodes, req, DEMO, index=idx)
        row = idx.row[placement.node_id]
        nodes[row] = apply_placement(nodes[row], req, placement)
        idx.set_row(row, **node_row(nodes[row], DEMO))
        fresh = cluster_index(nodes, DEMO)
        assert idx.free.tolist() == fresh.free.tolist() and idx.cpu_free.tolist() == fresh.cpu_free.tolist()
    with pytest.raises(Exception, match="1.5 fGPU requested|free"):
        place(nodes, req, DEMO, index=idx)


def test_fgd_plus_leaves_the_gpu_model_that_requests_name_to_them():
    # Half the GPU requests seen must run on T4; a request naming no model goes to the V100 node
    # even though the T4 node is the better fit.
    idx = index((32000, 65536, [0, 1000]), (32000, 65536, [1000, 1000]), models=["T4", "V100"])
    t4 = Shape(WHOLE, cpu=1000, mem=1024, count=1, amount=1000, models=frozenset({"T4"}))
    workload = Workload({t4: 2, whole(1): 2})
    assert idx.choose(whole(1), "best-fit", workload)[0] == 0
    assert idx.choose(whole(1), "fgd-plus", workload)[0] == 1
