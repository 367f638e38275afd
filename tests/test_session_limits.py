"""A process-runtime session's memory, CPU and pids held by its cgroups (issue 31, items 2 and 6):
agent.limits finds each controller in cgroup v2 or, on a hybrid machine such as this one and CI's,
in the v1 hierarchies (/sys/fs/cgroup/memory, …/cpu, …/pids), the session's leader joins them all
before it execs, and removal leaves nothing behind (tests/conftest.py's no_cgroups_left checks the
v1 hierarchies too).

Real processes, real cgroups (CI runs as root with them writable: a test fails, never skips,
where they are not)."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent import runtimes
from agent.limits import CPU_PERIOD_US, SessionLimits, cgroup_v1_mounts, cpu_quota_us
from agent.runtimes import CGROUP_AUTO, open_session_cgroups, parent_cgroup_name
from tests.conftest import CGROUP_TAG
from tests.stack import wait_until

MiB = 1 << 20


@pytest.fixture
def limited(tmp_path):
    """An agent's sessions' cgroups with small limits: 64 MiB of memory by default, 64 pids a
    session, 100 for all together."""
    limits = SessionLimits(default_memory=64 * MiB, session_pids=64, node_pids=100)
    cgroups, why = open_session_cgroups(CGROUP_AUTO, name=parent_cgroup_name("limits", tmp_path, tag=CGROUP_TAG),
                                        limits=limits)
    assert cgroups is not None, why
    assert cgroups.hierarchies is not None and not cgroups.hierarchies.missing, cgroups.hierarchies
    yield cgroups
    cgroups.clean_up()
    cgroups.close()


def leader(cgroup, argv: list[str], **kw) -> subprocess.Popen:
    return runtimes.popen_leader(argv, cgroup=cgroup, stdin=subprocess.DEVNULL, stdout=kw.get("stdout", subprocess.PIPE),
                                 stderr=subprocess.DEVNULL, cwd="/", env={"PATH": "/usr/bin:/bin"})


def pids_file(cgroups, name: str, file: str) -> Path:
    directory = cgroups.hierarchies.directory("pids")
    return directory / name / file if name else directory / file


def test_a_session_that_allocates_past_its_memory_is_killed_and_says_so(limited):
    cgroup = limited.create("greedy", mem=64 * MiB)
    process = leader(cgroup, [sys.executable, "-c", "b = b'x' * (256 << 20); print('survived', flush=True)"])
    out, _ = process.communicate(timeout=60)
    assert b"survived" not in out
    assert process.returncode == -9
    assert cgroup.oom_kills() >= 1 and cgroup.memory_limit() == 64 * MiB
    handle = runtimes.SessionHandle("greedy", process, -1, env={}, work_dir=Path("/"), cgroup=cgroup)
    assert handle.end_reason(-9).startswith("killed: out of memory at its 64 MiB limit")
    cgroup.remove()


def test_a_session_that_asks_no_memory_gets_the_default(limited):
    cgroup = limited.create("plain")
    try:
        assert cgroup.memory_limit() == 64 * MiB
    finally:
        cgroup.remove()


# 10,000 forks of `sleep 30`, each refused fork counted (a shell ends at its first; perl-base is in
# every Debian): prints "<forked> <refused>" once all were tried.
FORK_BOMB = [
    "perl", "-e",
    'my ($ok, $no) = (0, 0); for (1 .. 10000) { my $p = fork; if (!defined $p) { $no++ } elsif ($p == 0) '
    '{ exec "sleep", "30" } else { $ok++ } } $| = 1; print "$ok $no\\n"; sleep 60',
]


def test_a_fork_bomb_is_capped_at_its_session_s_pids_and_the_node_s_and_the_host_stays_responsive(limited):
    first, second = limited.create("bomb1", cpu=1), limited.create("bomb2", cpu=1)
    processes = [leader(first, FORK_BOMB), leader(second, FORK_BOMB)]
    try:
        wait_until(lambda: int(pids_file(limited, "", "pids.current").read_text()) == 100, timeout=30,
                   what="the sessions' processes at the node's cap")
        started = time.monotonic()  # while both still fork
        subprocess.run(["true"], check=True, timeout=10)
        assert time.monotonic() - started < 2.0, "the host did not start a process in 2 s"
        forked = [process.stdout.readline().split() for process in processes]  # once all 10,000 forks were tried
        assert all(int(ok) <= 63 and int(refused) >= 10000 - 63 for ok, refused in forked), forked
        for name in ("session-bomb1", "session-bomb2"):
            assert int(pids_file(limited, name, "pids.current").read_text()) <= 64
            assert int(pids_file(limited, name, "pids.events").read_text().split()[1]) > 0  # forks refused
        # 2 × 64 would pass the node's 100: its cap held both sessions together, to the last pid.
        assert sum(int(ok) for ok, _ in forked) + 2 == 100, forked
        assert int(pids_file(limited, "", "pids.current").read_text()) == 100
    finally:
        for process in processes:
            process.kill()
        first.remove()
        second.remove()
    assert not first.path.exists() and not any(d.exists() for d in first.v1 + second.v1)


def test_a_session_s_cpu_is_held_to_its_cores(limited):
    """0.1 core: a busy loop of 2 s of wall time gets about 0.2 s of CPU (without the quota, up to
    2 s)."""
    cgroup = limited.create("busy", cpu="0.1")
    busy = textwrap.dedent("""\
        import time
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            pass
        print(time.process_time(), flush=True)
        """)
    try:
        process = leader(cgroup, [sys.executable, "-c", busy])
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0
        assert float(out) < 0.45, f"{float(out):.2f} s of CPU in 2 s at 0.1 core"
    finally:
        cgroup.remove()


def test_the_leader_joins_every_hierarchy_that_limits_it_and_removal_leaves_none(limited):
    cgroup = limited.create("joined", mem=128 * MiB, cpu=2)
    process = leader(cgroup, ["sleep", "300"])
    try:
        wait_until(lambda: all(process.pid in runtimes.SessionCgroup(d).pids() for d in cgroup.v1), timeout=10,
                   what="the leader in each v1 hierarchy")
        assert process.pid in runtimes.SessionCgroup(cgroup.path).pids()
        cpu = limited.hierarchies.directory("cpu") / cgroup.path.name
        if "cpu" in limited.hierarchies.controllers:
            assert (cpu / "cpu.max").read_text().split() == [str(2 * CPU_PERIOD_US), str(CPU_PERIOD_US)]
        else:
            assert int((cpu / "cpu.cfs_quota_us").read_text()) == 2 * CPU_PERIOD_US
    finally:
        assert cgroup.remove()
        process.wait()
    assert not cgroup.path.exists() and not any(d.exists() for d in cgroup.v1)


def test_cgroup_v1_mounts_and_cpu_quotas():
    mountinfo = "\n".join([
        "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw",
        "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct",
        "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory",
        "39 31 0:36 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids",
        "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw",
    ])
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".mountinfo") as f:
        f.write(mountinfo + "\n")
        f.flush()
        assert cgroup_v1_mounts(mountinfo=f.name) == {
            "cpu": Path("/sys/fs/cgroup/cpu,cpuacct"), "memory": Path("/sys/fs/cgroup/memory"),
            "pids": Path("/sys/fs/cgroup/pids")}
    assert cpu_quota_us(2) == 200_000 and cpu_quota_us("0.5") == 50_000 and cpu_quota_us("0.001") == 1000
    assert cpu_quota_us(None) == 0 and cpu_quota_us("x") == 0 and cpu_quota_us(0) == 0 and cpu_quota_us("NaN") == 0
    assert SessionLimits().memory_for(0) == 4 << 30 and SessionLimits().memory_for(5) == 5
    assert SessionLimits().for_session() == {"memory": 4 << 30, "cpu": CPU_PERIOD_US, "pids": 4096}  # 1 core by default
    assert SessionLimits().for_session(mem=5 * MiB, cpu=2) == {"memory": 5 * MiB, "cpu": 2 * CPU_PERIOD_US, "pids": 4096}
    assert SessionLimits().for_session(mem=0, cpu=0) == SessionLimits().for_session()  # a spec's 0: none asked


# --- storage (agent.storage) ------------------------------------------------------------------------


def test_measure_counts_allocated_blocks_each_inode_once_and_no_symlinked_tree(tmp_path):
    from agent.storage import measure

    tree = tmp_path / "home"
    (tree / "sub").mkdir(parents=True)
    (tree / "a").write_bytes(b"x" * (3 * MiB))
    (tree / "sub" / "b").write_bytes(b"y" * MiB)
    (tree / "sub" / "b-again").hardlink_to(tree / "sub" / "b")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"z" * (8 * MiB))
    (tree / "link").symlink_to(outside)
    with open(tree / "sparse", "wb") as f:
        f.truncate(1 << 30)  # 1 GiB long, nothing written: nothing allocated
    used, complete = measure(tree)
    assert complete
    assert 4 * MiB <= used < 5 * MiB, used
    assert measure(tree, budget=2) == (measure(tree, budget=2)[0], False)
    assert measure(tmp_path / "missing") == (0, True)


def storage_limited(h, **limits) -> None:
    """The agent's [limits] as an operator would set them (agent.storage reads them at each measure)."""
    h.agent.storage.configure(SessionLimits(**limits))


def test_a_session_that_writes_past_its_storage_limit_is_stopped_with_the_reason(tmp_path):
    from tests.test_agent_runtime import Harness, run_agent, start_spec

    async def scenario(h: Harness):
        storage_limited(h, session_storage=8 * MiB)
        spec = start_spec(command="head -c 20971520 /dev/zero > big && echo WRITTEN && sleep 300")
        channel = await h.watch_terminal(spec["session_id"])
        await h.start_session(spec)
        await h.read_until(channel, "WRITTEN")
        assert await h.agent.storage.check_now() == [(spec["session_id"], "used 20 MiB of its 8 MiB storage limit (home)")]
        _, reason, _ = await h.manager.wait_for_report(spec["session_id"], "TERMINATED")
        assert reason == "used 20 MiB of its 8 MiB storage limit (home)"

    run_agent(tmp_path, scenario, cgroup_root=CGROUP_AUTO)


def test_a_user_s_data_folder_past_its_limit_stops_the_session_and_below_it_the_use_is_sampled(tmp_path):
    from tests.test_agent_runtime import Harness, run_agent, start_spec

    async def scenario(h: Harness):
        storage_limited(h, user_data_storage=4 * MiB)
        spec = {**start_spec(command="head -c 2097152 /dev/zero > data/small && echo WRITTEN && sleep 300"), "owner_id": 7}
        channel = await h.watch_terminal(spec["session_id"])
        await h.start_session(spec)
        await h.read_until(channel, "WRITTEN")
        assert await h.agent.storage.check_now() == []
        assert (tmp_path / "data" / "users" / "7" / "small").stat().st_size == 2 * MiB
        rows = h.agent.usage.sample().sessions
        assert rows[0].storage is not None and rows[0].storage < MiB  # its home; ~/data is the user's
        (tmp_path / "data" / "users" / "7" / "more").write_bytes(b"m" * (3 * MiB))  # as another session of hers would
        over = await h.agent.storage.check_now()
        assert over == [(spec["session_id"], "used 5 MiB of its 4 MiB storage limit (~/data)")], over
        _, reason, _ = await h.manager.wait_for_report(spec["session_id"], "TERMINATED")
        assert reason.endswith("storage limit (~/data)")

    run_agent(tmp_path, scenario, cgroup_root=CGROUP_AUTO, data_root=tmp_path / "data")


# --- agent.toml's [limits] ------------------------------------------------------------------------


def agent_toml(tmp_path, limits: str, *, memory: str = "32G") -> Path:
    (tmp_path / "mock-accelerator.toml").write_text("")
    path = tmp_path / "agent.toml"
    path.write_text(f'[agent]\nid = "n1"\nmemory = "{memory}"\n[limits]\n{limits}\n')
    return path


def test_agent_toml_limits_are_read_with_their_defaults(tmp_path):
    from agent.config import load_agent_config

    limits = load_agent_config(agent_toml(tmp_path, "")).limits
    assert limits == SessionLimits()
    assert limits.default_memory == 4 << 30 and limits.session_pids == 4096 and limits.node_pids == 16384
    assert limits.session_storage == limits.user_data_storage == 10 << 30 and limits.storage_interval_s == 60
    assert load_agent_config(agent_toml(tmp_path, "", memory="2G")).limits.default_memory == 2 << 30  # the node's, if less
    read = load_agent_config(agent_toml(tmp_path, 'default-memory = "512M"\nsession-pids = 256\nnode-pids = 1024\n'
                                                  'session-storage = "1G"\nuser-data-storage = "50G"\nstorage-interval = 30'))
    assert read.limits == SessionLimits(default_memory=512 * MiB, session_pids=256, node_pids=1024, session_storage=1 << 30,
                                        user_data_storage=50 << 30, storage_interval_s=30)


@pytest.mark.parametrize(("line", "says"), [
    ('default-memory = "1K"', "limits.default-memory: '1K' is less than 16 MiB"),
    ('default-memory = "lots"', "limits.default-memory"),
    ("session-pids = 0", "limits.session-pids: 0 is not a whole number from 16 to 4194304"),
    ("node-pids = true", "limits.node-pids"),
    ("storage-interval = 1", "limits.storage-interval: 1 is not a whole number from 5 to 3600"),
    ('session-storage = "-1G"', "limits.session-storage"),
])
def test_a_bad_limit_stops_the_agent_naming_the_key(tmp_path, line, says):
    from agent.config import AgentConfigError, load_agent_config

    with pytest.raises(AgentConfigError, match=re.escape(says)):
        load_agent_config(agent_toml(tmp_path, line))


def test_a_bad_cgroup_tag_stops_the_agent(tmp_path, monkeypatch):
    from agent.config import AgentConfigError, load_agent_config

    monkeypatch.setenv("FGPU_CGROUP_TAG", "../escape")
    with pytest.raises(AgentConfigError, match="FGPU_CGROUP_TAG"):
        load_agent_config(agent_toml(tmp_path, ""))


def test_on_cgroup_v2_with_controllers_the_limits_go_in_its_files(tmp_path):
    """A unified hierarchy that offers memory, cpu and pids (a pure cgroup v2 machine; this one's
    offers none, so its kernel files are stood in for by plain files of the same names): the
    controllers are enabled for the parent's children from the root down, the node's cap is the
    parent's pids.max, a session's limits its memory.max (no swap), cpu.max and pids.max, and no
    v1 hierarchy is used. (What subtree_control holds is the kernel's to keep: a plain file only
    keeps bytes.)"""
    from agent.limits import Hierarchies

    root = tmp_path / "cgroup"
    parent = root / "fgpu-agent-n-0123456789"
    session = parent / "session-s1"
    session.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for directory in (root, parent):
        (directory / "cgroup.subtree_control").write_text("")
    for name in ("pids.max",):
        (parent / name).write_text("")
    for name in ("memory.max", "memory.swap.max", "cpu.max", "pids.max", "memory.events"):
        (session / name).write_text("")
    v1_only = tmp_path / "mountinfo"
    v1_only.write_text("35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    hierarchies = Hierarchies.open(parent, node_pids=100, mountinfo=str(v1_only))
    assert hierarchies.controllers == {"memory", "cpu", "pids"} and hierarchies.v1 == {} and hierarchies.missing == {}
    assert (parent / "pids.max").read_text() == "100"
    hierarchies.apply("session-s1", SessionLimits(default_memory=64 * MiB, session_pids=64).for_session(cpu="1.5"))
    assert (session / "memory.max").read_text() == str(64 * MiB) and (session / "memory.swap.max").read_text() == "0"
    assert (session / "cpu.max").read_text() == f"150000 {CPU_PERIOD_US}" and (session / "pids.max").read_text() == "64"
    (session / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert hierarchies.oom_kills("session-s1") == 1 and hierarchies.memory_limit("session-s1") == 64 * MiB


def test_a_project_folder_past_its_limit_stops_every_session_that_mounts_it(tmp_path):
    from tests.test_agent_runtime import Harness, run_agent, start_spec

    async def scenario(h: Harness):
        storage_limited(h, project_data_storage=4 * MiB)
        project = [{"id": "p-77", "name": "vision"}]
        specs = [{**start_spec(command="echo UP && sleep 300"), "owner_id": owner, "projects": project} for owner in (7, 8)]
        for spec in specs:
            channel = await h.watch_terminal(spec["session_id"])
            await h.start_session(spec)
            await h.read_until(channel, "UP")
        folder = tmp_path / "data" / "projects" / "p-77"
        assert folder.is_dir()
        (folder / "weights").write_bytes(b"w" * (5 * MiB))  # as one member's session writes into ~/projects/vision
        over = sorted(await h.agent.storage.check_now())
        reason = "used 5 MiB of its 4 MiB storage limit (~/projects/vision)"
        assert over == sorted((spec["session_id"], reason) for spec in specs), over
        for spec in specs:
            _, reported, _ = await h.manager.wait_for_report(spec["session_id"], "TERMINATED")
            assert reported == reason

    run_agent(tmp_path, scenario, cgroup_root=CGROUP_AUTO, data_root=tmp_path / "data")


def test_a_controller_found_nowhere_is_named_with_the_reason_and_the_rest_still_hold(tmp_path):
    """Only the memory hierarchy among the v1 mounts (the machine's real one): cpu and pids are
    missing with why, memory still limits, and removal leaves nothing."""
    root = runtimes.cgroup2_root(CGROUP_AUTO)[0]
    memory = cgroup_v1_mounts().get("memory")
    assert root is not None and memory is not None
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"41 31 0:38 / {root} rw - cgroup2 cgroup2 rw\n35 31 0:32 / {memory} rw - cgroup cgroup rw,memory\n")
    limits = SessionLimits(default_memory=64 * MiB)
    cgroups, why = open_session_cgroups(CGROUP_AUTO, name=parent_cgroup_name("partial", tmp_path, tag=CGROUP_TAG),
                                        limits=limits, mountinfo=str(mountinfo))
    assert cgroups is not None, why
    try:
        missing = cgroups.hierarchies.missing
        assert set(missing) == {"cpu", "pids"}, missing
        assert missing["pids"] == "neither cgroup v2 nor a cgroup v1 hierarchy offers it"
        cgroup = cgroups.create("s")
        assert cgroup.memory_limit() == 64 * MiB and [d.parent.parent for d in cgroup.v1] == [memory]
        assert cgroup.remove()
    finally:
        cgroups.clean_up()
        cgroups.close()
    assert not (memory / cgroups.parent.name).exists() and not cgroups.parent.exists()
