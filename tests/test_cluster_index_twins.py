"""`ClusterIndex.choose` scores one node of each twin class (nodes alike in every figure a
scorer reads: `ClusterIndex._twin_id`), the lowest row, and chooses what scoring every node
chooses (issue 35.2: a pass over 1,000 sessions on 1,000 alike nodes scored all 1,000 for each)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from accelerators.allocation import cluster
from accelerators.allocation.cluster import POLICIES, SPAN, Shape, Workload
from tests.test_placement_policies import index, share, whole

TEMPLATES = [
    (8000, 8192, [1000, 1000, 1000, 1000]),
    (8000, 8192, [1000, 500, 1000, 250]),
    (16000, 16384, [1000, 1000]),
    (4000, 8192, [750, 1000, 1000, 1000]),
]


def span(milli: int) -> Shape:
    return Shape(SPAN, cpu=500, mem=512, count=1, amount=milli)


def full_best(idx, shape: Shape, policy: str, workload: Workload) -> tuple[int, int] | None:
    """The best (row, slot) with every feasible node scored."""
    cand, slots = idx.candidates(shape, np.nonzero(idx.feasible(shape))[0])
    if not len(cand):
        return None
    rows, slots, keys = cluster.POLICY_SCORERS[policy](idx, shape, cand, slots, workload)
    best = np.lexsort(keys)[0]
    return int(rows[best]), int(slots[best])


@pytest.mark.parametrize("policy", POLICIES)
def test_choose_scores_one_node_of_each_twin_class_and_chooses_as_scoring_all(policy, monkeypatch):
    rng = random.Random(f"twins-{policy}")
    idx = index(*[rng.choice(TEMPLATES) for _ in range(60)], models=[rng.choice("AB") for _ in range(60)])
    shapes = [share(250), share(500), whole(1), whole(2), span(1500), span(600)]
    workload = Workload({share(250): 3, whole(1): 1, span(1500): 1})
    scored: list[int] = []
    scorer = cluster.POLICY_SCORERS[policy]

    def counting(i, s, cand, slots, *args, **kwargs):
        scored.append(len(set(cand.tolist())))  # the nodes scored
        return scorer(i, s, cand, slots, *args, **kwargs)

    monkeypatch.setitem(cluster.POLICY_SCORERS, policy, counting)
    for _ in range(80):
        shape = rng.choice(shapes)
        expected = full_best(idx, shape, policy, workload)
        scored.clear()
        chosen = idx.choose(shape, policy, workload)
        assert chosen == expected
        if chosen is None:
            continue
        feasible = np.nonzero(idx.feasible(shape))[0]
        assert scored[0] == len(set(idx.twin[feasible].tolist())) < len(feasible)
        row, slot = chosen
        idx.commit(row, cpu=shape.cpu, mem=shape.mem, takes=idx.takes(row, shape, slot))
        workload.observe(shape)


def test_a_copy_keeps_its_twins_apart_from_the_original():
    idx = index(*[TEMPLATES[0]] * 4)
    other = idx.copy()
    other.commit(0, cpu=1000, mem=1024, takes={0: 500})

    assert idx.twin.tolist() == [0, 0, 0, 0]
    assert other.twin[0] != other.twin[1] and other.twin[1:].tolist() == [0, 0, 0]
    assert idx.choose(share(500), "binpack") == (0, 0)
    assert other.choose(share(500), "binpack") == (0, 0)  # the fullest device that holds it: row 0's half-used one
