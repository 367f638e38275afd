"""The MIG catalog and the dynamic-MIG planner (pure): examples, then property tests over random
request/release sequences on every catalog model."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accelerators.allocation import mig
from accelerators.allocation.errors import InsufficientResource, InvalidResourceRequest, NeverSchedulable

GiB = 1 << 30
H100 = mig.CATALOGS["H100-80GB"]


def test_the_catalog_has_every_model_the_issue_names_with_seven_profiles_each():
    for model in ("A100-40GB", "A100-80GB", "H100-80GB", "H100-94GB", "H200-141GB", "B200-180GB"):
        catalog = mig.CATALOGS[model]
        assert len(catalog.profiles) == 7
        assert catalog.largest.memory_slices == 8 and catalog.largest.compute_slices == 7
        assert mig.layout_problems(catalog, []) == []


def test_captured_memory_is_read_in_nvml_128_mib_steps():
    assert H100.profile("1g.10gb").memory == 9984 * (1 << 20)
    assert H100.profile("1g.20gb").memory == 20096 * (1 << 20)
    assert mig.CATALOGS["A100-40GB"].profile("1g.5gb").memory == 4864 * (1 << 20)
    assert H100.profile("3g.40gb").sm_count == 60


def test_figures_no_capture_has_are_marked_assumed():
    assert mig.CATALOGS["B200-180GB"].profile("1g.23gb").memory_assumed
    assert not H100.profile("1g.20gb").memory_assumed
    assert mig.CATALOGS["A100-80GB"].profile("1g.20gb").memory == mig.CATALOGS["A100-80GB"].profile("2g.20gb").memory


@pytest.mark.parametrize("name, model", [
    ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA H100 NVL", "H100-94GB"), ("NVIDIA H200", "H200-141GB"), ("NVIDIA B200", "B200-180GB"), ("H100-80GB", "H100-80GB"),
])
def test_model_names_as_nvml_gives_them_find_their_catalog(name, model):
    assert mig.catalog_get(name).model == model


def test_a_gpu_without_mig_has_no_catalog():
    with pytest.raises(InvalidResourceRequest, match="not a MIG-capable"):
        mig.catalog_get("NVIDIA GeForce RTX 4090")


def test_fifteen_gib_on_an_h100_gets_a_1g_20gb_instance():
    plan = mig.plan_instance(H100, [], mig.MigRequest(memory=15 * GiB))
    assert plan.profile.name == "1g.20gb" and plan.creates and plan.start in (0, 2, 4, 6)


def test_an_idle_instance_of_the_profile_is_reused_rather_than_a_new_one_created():
    layout = (mig.MigInstance("a", "1g.20gb", 2), mig.MigInstance("b", "3g.40gb", 4, in_use=True))
    plan = mig.plan_instance(H100, layout, mig.MigRequest(memory=15 * GiB))
    assert plan.reuse == "a" and plan.destroy == ()


def test_an_idle_instance_is_destroyed_only_when_its_slices_are_needed():
    layout = (mig.MigInstance("big", "7g.80gb", 0),)
    plan = mig.plan_instance(H100, layout, mig.MigRequest(memory=4 * GiB))
    assert plan.profile.name == "1g.10gb" and plan.destroy == ("big",)
    layout = (mig.MigInstance("idle", "1g.10gb", 0), mig.MigInstance("used", "1g.10gb", 1, in_use=True))
    plan = mig.plan_instance(H100, layout, mig.MigRequest(profile="3g.40gb"))
    assert plan.start == 4 and plan.destroy == ()


def test_a_creation_keeps_the_largest_profile_possible_and_strands_nothing():
    plan = mig.plan_instance(H100, [], mig.MigRequest(memory=15 * GiB))
    after = mig.apply_plan([], plan, key="x")
    assert mig.creatable(H100, after)[-1][0].name == "4g.40gb"  # 4g@0 still possible
    assert mig.stranded_slices(H100, after) == set()


def test_instances_in_use_are_never_destroyed_and_a_full_gpu_says_what_holds_it():
    layout = (mig.MigInstance("a", "4g.40gb", 0, in_use=True), mig.MigInstance("b", "3g.40gb", 4, in_use=True))
    with pytest.raises(InsufficientResource, match="4g.40gb@0, 3g.40gb@4"):
        mig.plan_instance(H100, layout, mig.MigRequest(memory=1 * GiB))


def test_more_memory_than_the_largest_profile_is_never_schedulable():
    with pytest.raises(NeverSchedulable, match="7g.80gb"):
        mig.plan_instance(H100, [], mig.MigRequest(memory=100 * GiB))


def test_an_unknown_profile_name_is_refused_with_the_known_ones():
    with pytest.raises(InvalidResourceRequest, match="1g.10gb"):
        mig.plan_instance(H100, [], mig.MigRequest(profile="5g.50gb"))


def test_media_extension_profiles_are_given_only_by_name():
    plan = mig.plan_instance(H100, [], mig.MigRequest(profile="1g.10gb+me"))
    assert plan.profile.media_extensions
    assert not mig.plan_instance(H100, [], mig.MigRequest(memory=GiB)).profile.media_extensions
    layout = (mig.MigInstance("me", "1g.10gb+me", 0, in_use=True),)
    with pytest.raises(InsufficientResource):
        mig.plan_instance(H100, layout, mig.MigRequest(profile="1g.10gb+me"))


def test_a_layout_over_allowed_starts_overlaps_or_counts_is_reported():
    bad = (mig.MigInstance("a", "2g.20gb", 1), mig.MigInstance("b", "4g.40gb", 0), mig.MigInstance("c", "4g.40gb", 4))
    problems = mig.layout_problems(H100, bad)
    assert any("cannot start at memory slice 1" in p for p in problems)
    assert any("already held" in p for p in problems)
    assert any("at most 1" in p for p in problems)


# --- properties --------------------------------------------------------------------------

def _placeable_oracle(catalog, layout, profile) -> bool:
    """Brute force: an idle instance of `profile`, or an allowed start clear of every instance in
    use, with the profile's instances in use under its max."""
    if any(not i.in_use and i.profile == profile.name for i in layout):
        return True
    by_name = {p.name: p for p in catalog.profiles}
    used = {s for i in layout if i.in_use for s in mig.slices_of(by_name[i.profile], i.start)}
    in_use_count = sum(1 for i in layout if i.in_use and i.profile == profile.name)
    return in_use_count < profile.max_instances and any(
        not used & set(mig.slices_of(profile, s)) and s + profile.size <= 8 for s in profile.starts)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("memory"), st.integers(min_value=1, max_value=200 * GiB)),
        st.tuples(st.just("profile"), st.integers(min_value=0, max_value=6)),
        st.tuples(st.just("release"), st.integers(min_value=0, max_value=100)),
    ),
    min_size=1, max_size=40,
)


@pytest.mark.parametrize("model", sorted(mig.CATALOGS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations)
def test_random_request_and_release_sequences_keep_every_layout_creatable(model, ops):
    catalog = mig.CATALOGS[model]
    layout: tuple[mig.MigInstance, ...] = ()
    for n, (op, value) in enumerate(ops):
        if op == "release":
            held = [i for i in layout if i.in_use]
            if held:
                layout = mig.release(layout, held[value % len(held)].key)
            continue
        request = mig.MigRequest(memory=value) if op == "memory" else mig.MigRequest(profile=catalog.profiles[value].name)
        try:
            candidates = mig.candidate_profiles(catalog, request)
        except NeverSchedulable:
            assert value > catalog.largest.memory
            continue
        try:
            plan = mig.plan_instance(catalog, layout, request)
        except InsufficientResource:
            assert not any(_placeable_oracle(catalog, layout, p) for p in candidates)
            continue
        # never a larger profile than the smallest that fits and is placeable
        smaller = candidates[:candidates.index(plan.profile)]
        assert not any(_placeable_oracle(catalog, layout, p) for p in smaller)
        if request.memory:
            assert plan.profile.memory >= request.memory
        idle_same = [i for i in layout if not i.in_use and i.profile == plan.profile.name]
        # released instances are reused before new ones are created
        assert bool(plan.reuse) == bool(idle_same)
        # only idle instances are destroyed, and only when no placement without destroying existed
        by_key = {i.key: i for i in layout}
        assert all(not by_key[k].in_use for k in plan.destroy)
        if plan.destroy:
            assert not any(p == plan.profile for p, _ in mig.creatable(catalog, layout))
        layout = mig.apply_plan(layout, plan, key=f"i{n}")
        # every layout is creatable: allowed starts, disjoint slices, counts within max
        assert mig.layout_problems(catalog, layout) == []
