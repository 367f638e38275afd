"""Each placement policy is a scorer of its own (accelerators.allocation.cluster.POLICY_SCORERS,
which ClusterIndex.scores calls), tested here one by one on a hand-made cluster in openb's units
(milli-cores, MiB, milli-GPU per device; a device holds 1000):

    n0: two idle devices [1000, 1000]
    n1: one device half used [500, 1000]
    n2: both devices in use [250, 750]
"""
from __future__ import annotations

import numpy as np
import pytest

from accelerators.allocation import cluster
from accelerators.allocation.cluster import POLICIES, POLICY_SCORERS, Workload
from tests.test_placement_policies import index, share, whole


@pytest.fixture
def three_nodes():
    return index((8000, 8192, [1000, 1000]), (8000, 8192, [500, 1000]), (8000, 8192, [250, 750]))


def workload() -> Workload:
    return Workload({share(250): 3, whole(1): 1})


def scored(idx, scorer, shape, **kw):
    """(rows, slots, keys) of `scorer` on `shape`'s feasible candidates, and the (row, slot) it ranks first."""
    cand, slots = idx.candidates(shape, np.nonzero(idx.feasible(shape))[0])
    rows, slots, keys = scorer(idx, shape, cand, slots, **kw)
    best = np.lexsort(keys)[0]
    return rows, slots, keys, (int(rows[best]), int(slots[best]))


def test_every_policy_has_its_scorer_and_an_unknown_policy_is_refused(three_nodes):
    assert set(POLICY_SCORERS) == set(POLICIES)
    with pytest.raises(ValueError, match="unknown placement policy 'firstfit'"):
        three_nodes.scores(share(250), "firstfit")


def test_binpack_takes_the_node_with_least_gpu_left_and_its_fullest_device_that_holds_it(three_nodes):
    *_, best = scored(three_nodes, cluster.score_binpack, share(250))

    assert best == (2, 0)  # n2's 250 free: filled exactly
    assert three_nodes.choose(share(250), "binpack") == (2, 0)
    assert three_nodes.choose(whole(1), "binpack")[0] == 1  # n1 still has one idle device; n0 stays whole


def test_spread_takes_the_node_with_most_gpu_left_and_its_emptiest_device(three_nodes):
    *_, best = scored(three_nodes, cluster.score_spread, share(250))

    assert best == (0, 0)
    assert three_nodes.choose(share(600), "spread") == (0, 0)
    assert three_nodes.choose(whole(1), "spread")[0] == 0


def test_spread_orders_the_candidates_exactly_opposite_to_binpack_on_distinct_scores(three_nodes):
    shape = whole(1)  # one candidate per node, each with its own GPU left
    rows_b, _, keys_b, _ = scored(three_nodes, cluster.score_binpack, shape)
    rows_s, _, keys_s, _ = scored(three_nodes, cluster.score_spread, shape)

    assert list(rows_b[np.lexsort(keys_b)]) == list(rows_s[np.lexsort(keys_s)])[::-1]


def test_best_fit_takes_the_node_the_request_fills_best_and_the_tightest_device(three_nodes):
    *_, best = scored(three_nodes, cluster.score_best_fit, share(600))

    assert best == (2, 1)  # n2's 750: 150 left, the least of the devices that hold 600
    assert three_nodes.choose(whole(1), "best-fit")[0] == 1


@pytest.mark.parametrize("scorer", [cluster.score_fgd, cluster.score_fgd_plus])
def test_fragmentation_aware_scorers_need_the_workload(three_nodes, scorer):
    with pytest.raises(ValueError, match="needs the workload"):
        scored(three_nodes, scorer, share(250))


def test_fgd_takes_the_candidate_whose_fragmentation_grows_least_the_first_on_a_tie(three_nodes):
    rows, slots, keys, best = scored(three_nodes, cluster.score_fgd, share(250), workload=workload())
    delta = keys[-1]

    least = np.flatnonzero(delta == delta.min())
    assert best == (int(rows[least].min()), int(slots[least[np.argmin(rows[least])]]))
    assert delta[(rows == 0)].min() > delta.min()  # an idle device of n0 would be cut into


def test_fgd_plus_prefers_a_device_in_use_its_packing_plan_has_room_for(three_nodes):
    rows, slots, keys, best = scored(three_nodes, cluster.score_fgd_plus, share(250), workload=workload())

    row, slot = best
    assert three_nodes.free[row, slot] < 1000  # not an idle device
    assert keys[-2][list(zip(rows, slots, strict=True)).index(best)] == keys[-2].min()  # the best plan rank


def test_fgd_plus_scoring_only_the_best_plan_class_changes_no_choice(three_nodes):
    for shape in (share(250), share(600), whole(1)):
        full = scored(three_nodes, cluster.score_fgd_plus, shape, workload=workload())
        best_only = scored(three_nodes, cluster.score_fgd_plus, shape, workload=workload(), best_only=True)

        assert best_only[3] == full[3]
        assert len(best_only[0]) <= len(full[0])
