"""Device topology (accelerators/allocation/topology.py): link kinds, scores and the choice of
devices for multi-device and one-device requests. Pure: no database."""
from __future__ import annotations

import math

import pytest

from accelerators.allocation.topology import (
    EXACT_SEARCH_LIMIT,
    METAXLINK,
    NODE,
    NVLINK,
    PHB,
    PIX,
    PXB,
    SELF,
    SYS,
    Link,
    best_set,
    link_score,
    loneliest,
    pair_score,
    parse_link_kind,
)


def nv(a: str, b: str, lanes: int) -> Link:
    return Link(a, b, NVLINK, lanes)


def dgx_like(*, islands: int = 2, size: int = 4, lanes: int = 2) -> tuple[list[str], list[Link], dict[str, int]]:
    """`islands` NVLink islands of `size` GPUs each (every two GPUs of an island joined by
    `lanes` lanes); one island per NUMA node; between islands only SYS (no link declared),
    except one single-lane NVLink from each island's first GPU to the next island's first, as
    on DGX-1's hybrid cube mesh."""
    gpus = [f"gpu{i}" for i in range(islands * size)]
    links, numa = [], {}
    for island in range(islands):
        members = gpus[island * size:(island + 1) * size]
        for device in members:
            numa[device] = island
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                links.append(nv(a, b, lanes))
        if island + 1 < islands:
            links.append(nv(members[0], gpus[(island + 1) * size], 1))
    return gpus, links, numa


# --------------------------------------------------------------------------- scores


def test_link_scores_order_nvlink_above_pcie_switches_above_host_bridge_numa_and_cpus():
    ranked = [link_score(NVLINK, 2), link_score(NVLINK, 1), link_score(PIX), link_score(PXB), link_score(PHB),
              link_score(NODE), link_score(SYS)]

    assert ranked == sorted(ranked, reverse=True)
    assert len(set(ranked)) == len(ranked)


def test_more_nvlink_lanes_score_higher_and_metaxlink_scores_like_nvlink():
    assert link_score(NVLINK, 12) > link_score(NVLINK, 4) > link_score(NVLINK, 1)
    assert link_score(METAXLINK, 4) == link_score(NVLINK, 4)


def test_link_score_refuses_unknown_kinds_and_lane_counts_below_one():
    with pytest.raises(ValueError, match="unknown link kind 'PCIE'"):
        link_score("PCIE")
    with pytest.raises(ValueError, match="at least 1 lane"):
        link_score(NVLINK, 0)


def test_a_missing_pair_counts_as_sys_or_as_node_when_both_devices_share_a_numa_node():
    numa = {"a": 0, "b": 0, "c": 1, "d": None, "e": None}

    assert pair_score("a", "b", []) == link_score(SYS)
    assert pair_score("a", "b", [], numa=numa) == link_score(NODE)
    assert pair_score("a", "c", [], numa=numa) == link_score(SYS)
    assert pair_score("d", "e", [], numa=numa) == link_score(SYS)  # unknown NUMA nodes are not "the same"


def test_a_declared_link_wins_over_the_numa_fallback_in_either_direction():
    links = [Link("b", "a", SYS), Link("a", "c", PIX)]
    numa = {"a": 0, "b": 0, "c": 1}

    assert pair_score("a", "b", links, numa=numa) == link_score(SYS)
    assert pair_score("c", "a", links, numa=numa) == link_score(PIX)


def test_the_best_of_several_links_between_one_pair_counts():
    assert pair_score("a", "b", [Link("a", "b", PHB), nv("b", "a", 2)]) == link_score(NVLINK, 2)


def test_links_refuse_unknown_kinds_lanes_on_pcie_kinds_and_self_links():
    with pytest.raises(ValueError, match="unknown link kind"):
        Link("a", "b", "NV4")  # the nvidia-smi cell; parse_link_kind turns it into (NVLINK, 4)
    with pytest.raises(ValueError, match="a PIX link has no lanes"):
        Link("a", "b", PIX, 2)
    with pytest.raises(ValueError, match="not 'a' with itself"):
        Link("a", "a", NVLINK, 1)
    with pytest.raises(ValueError, match="≥ 1"):
        Link("a", "b", NVLINK, 0)


def test_a_link_round_trips_through_the_plugin_inventory_dict():
    link = nv("GPU-1", "GPU-2", 4)

    assert link.as_dict() == {"a": "GPU-1", "b": "GPU-2", "kind": "NVLINK", "count": 4}
    assert Link.from_dict(link.as_dict()) == link
    assert Link.from_dict({"a": "x", "b": "y", "kind": "PIX"}).count == 1
    with pytest.raises(ValueError, match="needs 'kind'"):
        Link.from_dict({"a": "x", "b": "y"})


# --------------------------------------------------------------------------- nvidia-smi topo cells


@pytest.mark.parametrize(
    ("cell", "expected"),
    [
        ("NV4", (NVLINK, 4)),
        ("nv12", (NVLINK, 12)),
        ("NV18", (NVLINK, 18)),
        ("NVLINK", (NVLINK, 1)),
        ("METAXLINK", (METAXLINK, 1)),
        ("MetaXLink7", (METAXLINK, 7)),
        (" PIX ", (PIX, 1)),
        ("PXB", (PXB, 1)),
        ("PHB", (PHB, 1)),
        ("NODE", (NODE, 1)),
        ("SYS", (SYS, 1)),
        ("SOC", (SYS, 1)),  # older nvidia-smi's name for SYS
        ("X", (SELF, 0)),
    ],
)
def test_parse_link_kind_reads_nvidia_smi_topo_cells_and_the_mock_tables_spelling(cell, expected):
    assert parse_link_kind(cell) == expected


@pytest.mark.parametrize("cell", ["", "NV", "NV0", "PCIE", "NVLINK-4", "N/A"])
def test_parse_link_kind_refuses_anything_else(cell):
    with pytest.raises(ValueError, match="unknown link kind"):
        parse_link_kind(cell)


# --------------------------------------------------------------------------- multi-device requests


def test_best_set_takes_the_nvlink_pair_over_a_pix_pair():
    links = [Link("a", "b", PIX), nv("c", "d", 1), Link("a", "c", PHB)]

    assert best_set(["a", "b", "c", "d"], 2, links) == ("c", "d")


def test_best_set_prefers_the_pair_with_more_nvlink_lanes():
    links = [nv("a", "b", 2), nv("c", "d", 4), nv("a", "c", 1)]

    assert best_set(["a", "b", "c", "d"], 2, links) == ("c", "d")


def test_best_set_maximises_the_weakest_pair_before_the_sum():
    # {a, b, c} has two 4-lane NVLinks but a SYS pair; {a, d, e} is PIX throughout.
    links = [nv("a", "b", 4), nv("b", "c", 4), Link("a", "d", PIX), Link("a", "e", PIX), Link("d", "e", PIX)]

    assert best_set(["a", "b", "c", "d", "e"], 3, links) == ("a", "d", "e")


def test_best_set_takes_a_whole_nvlink_island_for_four_of_eight_gpus():
    gpus, links, numa = dgx_like()

    assert best_set(gpus, 4, links, numa=numa) == ("gpu0", "gpu1", "gpu2", "gpu3")


def test_best_set_takes_the_other_island_when_one_gpu_of_the_first_is_busy():
    gpus, links, numa = dgx_like()
    free = [g for g in gpus if g != "gpu2"]

    assert best_set(free, 4, links, numa=numa) == ("gpu4", "gpu5", "gpu6", "gpu7")


def test_best_set_prefers_the_island_with_more_lanes_whatever_the_candidate_order():
    gpus, links, numa = dgx_like()
    links = [link for link in links if not {link.a, link.b} <= {"gpu4", "gpu5", "gpu6", "gpu7"}]
    links += [nv(a, b, 6) for i, a in enumerate(gpus[4:]) for b in gpus[4 + i + 1:]]

    assert best_set(gpus, 4, links, numa=numa) == ("gpu4", "gpu5", "gpu6", "gpu7")
    assert best_set(list(reversed(gpus)), 4, links, numa=numa) == ("gpu7", "gpu6", "gpu5", "gpu4")


def test_best_set_without_links_keeps_devices_on_one_numa_node():
    numa = {"a": 0, "b": 1, "c": 0, "d": 1}

    assert best_set(["a", "b", "c", "d"], 2, [], numa=numa) == ("a", "c")
    assert best_set(["b", "a", "d", "c"], 2, [], numa=numa) == ("b", "d")


def test_best_set_breaks_ties_by_candidate_order_and_returns_candidates_in_that_order():
    assert best_set(["d", "c", "b", "a"], 2, []) == ("d", "c")
    assert best_set(["d", "c", "b", "a"], 2, [nv("a", "c", 2)]) == ("c", "a")


def test_best_set_of_one_or_of_every_candidate():
    assert best_set(["b", "a"], 1, [nv("a", "c", 2)]) == ("b",)
    assert best_set(["b", "a", "c"], 3, []) == ("b", "a", "c")


def test_best_set_refuses_impossible_requests():
    with pytest.raises(ValueError, match="cannot choose 3 devices from 2"):
        best_set(["a", "b"], 3, [])
    with pytest.raises(ValueError, match="k must be"):
        best_set(["a", "b"], 0, [])
    with pytest.raises(ValueError, match="more than once: a"):
        best_set(["a", "b", "a"], 2, [])


def test_best_set_beyond_the_exact_search_still_finds_a_whole_nvlink_island():
    # Three islands of 8: C(24, 8) subsets is far beyond the exact search.
    gpus, links, numa = dgx_like(islands=3, size=8, lanes=2)
    busy = {"gpu3"}  # the first island is no longer whole
    assert math.comb(len(gpus) - len(busy), 8) > EXACT_SEARCH_LIMIT

    chosen = best_set([g for g in gpus if g not in busy], 8, links, numa=numa)

    assert chosen == tuple(f"gpu{i}" for i in range(8, 16))


def test_best_set_beyond_the_exact_search_still_maximises_the_weakest_pair():
    # 20 GPUs on one PIX switch each pair, plus a 4-lane NVLink chain 0-1-2-3 whose ends are SYS:
    # the chain's sum is high but its weakest pair is SYS, so 10 PIX GPUs beat it.
    gpus = [f"g{i:02}" for i in range(20)]
    links = [Link(a, b, PIX) for i, a in enumerate(gpus) for b in gpus[i + 1:] if {a, b} != {"g00", "g03"}]
    links = [link for link in links if {link.a, link.b} not in ({"g00", "g01"}, {"g01", "g02"}, {"g02", "g03"})]
    links += [nv("g00", "g01", 4), nv("g01", "g02", 4), nv("g02", "g03", 4), Link("g00", "g03", SYS)]

    chosen = best_set(gpus, 10, links)

    assert not {"g00", "g03"} <= set(chosen)
    assert min(pair_score(a, b, links) for i, a in enumerate(chosen) for b in chosen[i + 1:]) == link_score(PIX)


# --------------------------------------------------------------------------- one-device requests


def test_loneliest_keeps_an_nvlink_pair_free():
    links = [nv("a", "b", 4), Link("c", "d", PIX), Link("a", "c", SYS)]
    free = ["a", "b", "c", "d"]

    assert loneliest(free, free, links) == "c"


def test_loneliest_takes_a_gpu_whose_nvlink_partner_is_already_busy():
    links = [nv("a", "b", 4), nv("c", "d", 4)]

    assert loneliest(["a", "c", "d"], ["a", "c", "d"], links) == "a"  # b is busy: a has no good partner left


def test_loneliest_on_a_dgx_like_node_takes_the_gpu_cut_off_from_its_island():
    gpus, links, numa = dgx_like()

    # Every GPU has 2-lane partners in its island; ties go to candidate order …
    assert loneliest(gpus, gpus, links, numa=numa) == "gpu0"
    # … and once three GPUs of the second island are busy, its fourth is the lonely one.
    free = gpus[:5]
    assert loneliest(gpus[:5], free, links, numa=numa) == "gpu4"


def test_loneliest_uses_the_numa_fallback_and_counts_a_device_with_no_free_neighbour_as_loneliest():
    numa = {"a": 0, "b": 0, "c": 1}

    assert loneliest(["a", "b", "c"], ["a", "b", "c"], [], numa=numa) == "c"
    assert loneliest(["b", "a"], ["a"], [nv("a", "b", 1)]) == "a"  # a's only free neighbour would be itself


def test_loneliest_needs_candidates():
    with pytest.raises(ValueError, match="no candidates"):
        loneliest([], ["a"], [])
