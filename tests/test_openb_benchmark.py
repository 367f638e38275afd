"""A small smoke run of benchmarks/openb.py's core: a few hundred openb pods on the 1,213-node
cluster under each policy, and the CLI's JSON shape. Skipped where the trace is not present."""
from __future__ import annotations

import json

import pytest

from accelerators.allocation import cluster
from benchmarks import openb

pytestmark = pytest.mark.skipif(not (openb.TRACE_DIR / "openb_node_list_gpu_node.csv").exists(),
                                reason="the openb trace is not here (FGPU_OPENB_DIR)")


@pytest.fixture(scope="module")
def nodes():
    return openb.load_nodes()


def test_the_openb_cluster_is_the_papers(nodes):
    assert len(nodes) == 1213
    assert int(nodes.cap.sum()) == 6212 * 1000


def test_inflation_reaches_130_percent_of_capacity_and_keeps_the_trace_first():
    pods = openb.load_pods("default")
    inflated = openb.inflate(pods, 42, 6212 * 1000)
    assert sum(p.gpu_amount for p in inflated) >= 1.3 * 6212 * 1000
    assert sorted(inflated[:len(pods)], key=repr) == sorted(pods, key=repr)  # a shuffle, then draws
    assert openb.inflate(pods, 42, 6212 * 1000)[:50] == inflated[:50]  # the seed decides


@pytest.mark.parametrize("policy", cluster.POLICIES)
def test_a_few_hundred_pods_place_without_over_commit_under_each_policy(nodes, policy):
    pods = openb.inflate(openb.load_pods("default"), 42, 6212 * 1000)[:300]
    run = openb.simulate(nodes, pods, policy, levels=5)
    assert run.placements == 300  # an empty cluster holds them all
    assert run.alloc_curve == sorted(run.alloc_curve) and 0 <= run.alloc_curve[-1] <= 100
    assert nodes.free.sum() == nodes.cap.sum()  # the run used a copy


def test_the_cli_prints_one_json_object(capsys, tmp_path, monkeypatch):
    real_inflate = openb.inflate
    monkeypatch.setattr(openb, "inflate", lambda pods, seed, capacity: real_inflate(pods, seed, capacity, target=0.05))
    out = tmp_path / "curves.png"
    assert openb.main(["--seeds", "42-43", "--policy", "fgd-plus", "best-fit", "--json", "--plot", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["trace"] == "default" and result["seeds"] == [42, 43]
    for figures in result["policies"].values():
        assert set(figures) == {"unallocated_pct_at_100", "unallocated_pct_at_100_sd", "first_failure_arrival_pct",
                                "frag_rate_at_90", "placements_per_s"}
    assert result["published"]["fgd"]["unallocated_pct_at_100"] == pytest.approx(4.773)
    assert result["published"]["best-fit"]["unallocated_pct_at_100"] == pytest.approx(7.138)


def test_the_speed_benchmarks_synthetic_cluster_and_timing(nodes):
    from benchmarks import placement_speed

    big = placement_speed.synthetic(nodes, 3000)
    assert len(big) == 3000 and set(big.model_ids) <= set(nodes.model_ids)
    stream = openb.inflate(openb.load_pods("default"), 42, int(big.cap.sum()), target=0.2)
    index, start, workload = placement_speed.filled(big, stream, 5)
    assert 0 < start < len(stream) and index.free.sum() < big.free.sum()
    assert placement_speed.time_policy(index, stream, start, 20, "fgd-plus", workload) > 0


def test_the_offline_bound_packs_the_fractional_pods_that_arrive_by_100_percent(capsys):
    from benchmarks import openb_bound

    # 0.81 + 0.16 and 0.47 + 0.47 on two devices: 0.03 + 0.06 left.
    assert openb_bound.first_fit_decreasing_room([470, 160, 810, 470]) == 90
    assert openb_bound.main(["--seeds", "42", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    run = out["runs"][0]
    assert run["seed"] == 42 and run["share_pods"] > 3000
    # The LP is a lower bound on any packing of the same pods, first-fit decreasing one of them.
    assert 3.0 < run["lp_room_pct"] <= run["ffd_room_pct"] < 5.0
