"""agent.toml loading (agent/config.py): the demo file, and errors that name file and key."""
from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import CUDA_PLUGIN, MOCK_PLUGIN, AgentConfigError, load_agent_config

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo" / "agent.toml"
GiB = 1 << 30


def write_agent(tmp_path: Path, body: str, *, name: str = "node-a.toml", mock: bool = True) -> Path:
    """An agent file in `tmp_path`, with a mock-accelerator.toml beside it unless `mock` is False."""
    if mock:
        (tmp_path / "mock-accelerator.toml").write_text('slot_name = "cuda"\n')
    path = tmp_path / name
    path.write_text(body)
    return path


def test_the_demo_agent_toml_loads_as_the_demo_node_with_the_mock_plugin():
    config = load_agent_config(DEMO)
    assert config.node_name == "demo-node"
    assert config.plugins == (MOCK_PLUGIN,)
    assert config.cpu_count == 4
    assert config.memory_size == 16 * GiB == 17179869184
    assert config.mps is False
    assert config.path == DEMO


def test_the_demo_mock_config_path_is_resolved_next_to_agent_toml():
    config = load_agent_config(DEMO)
    assert config.mock_config == ROOT / "demo" / "mock-accelerator.toml"
    assert config.mock_config.is_absolute() and config.mock_config.exists()


def test_a_relative_path_to_agent_toml_is_resolved_whatever_the_working_directory(monkeypatch):
    monkeypatch.chdir(ROOT / "demo")
    config = load_agent_config("agent.toml")
    assert config.path == DEMO
    assert config.mock_config == ROOT / "demo" / "mock-accelerator.toml"


def test_relative_paths_in_agent_toml_are_relative_to_its_directory(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "gpus.toml").write_text('slot_name = "cuda"\n')
    path = tmp_path / "conf" / "agent.toml"
    path.write_text('[agent]\nid = "n1"\n[plugins.mock]\nconfig = "gpus.toml"\n[container]\nscratch-root = "scratch"\n')
    monkeypatch.chdir(ROOT)
    config = load_agent_config(path)
    assert config.mock_config == tmp_path / "conf" / "gpus.toml"
    assert config.scratch_root == tmp_path / "conf" / "scratch"
    assert config.scratch_retention_s == 3600  # an hour unless the file says otherwise


def test_the_scratch_retention_comes_from_agent_toml_in_seconds(tmp_path):
    path = write_agent(tmp_path, '[agent]\nid = "n1"\n[container]\nscratch-retention = 0\n')
    assert load_agent_config(path).scratch_retention_s == 0


def test_the_process_runtimes_cgroup_root_is_auto_none_or_an_absolute_path_and_reaches_the_runtime(tmp_path):
    from agent.boot import build_runtime

    path = write_agent(tmp_path, '[agent]\nid = "n1"\n')
    assert load_agent_config(path).cgroup_root == "auto"
    for value in ("none", "/sys/fs/cgroup/unified/agents"):
        path.write_text(f'[agent]\nid = "n1"\n[container]\ncgroup-root = "{value}"\n')
        config = load_agent_config(path)
        assert config.cgroup_root == value
        runtime = build_runtime(config)
        assert (runtime.node, runtime.cgroup_root) == ("n1", value)
    for value in ('"unified"', "1"):
        path.write_text(f'[agent]\nid = "n1"\n[container]\ncgroup-root = {value}\n')
        with pytest.raises(AgentConfigError, match="^node-a.toml: container.cgroup-root: "):
            load_agent_config(path)


def test_the_broker_url_comes_from_the_file_or_the_default(tmp_path):
    path = write_agent(tmp_path, '[agent]\nid = "n1"\n')
    assert load_agent_config(path, default_broker="redis://r:6379/0").broker_url == "redis://r:6379/0"
    path.write_text('[agent]\nid = "n1"\n[manager]\nbroker-url = "redis://other:6379/1"\n')
    assert load_agent_config(path, default_broker="redis://r:6379/0").broker_url == "redis://other:6379/1"


def test_the_cuda_plugin_alone_needs_no_mock_config(tmp_path):
    path = write_agent(tmp_path, f'[agent]\nid = "gpu-1"\nallowed-compute-plugins = ["{CUDA_PLUGIN}"]\n', mock=False)
    config = load_agent_config(path)
    assert config.plugins == (CUDA_PLUGIN,)
    assert config.mock_config is None


def test_memory_may_be_given_in_bytes(tmp_path):
    path = write_agent(tmp_path, '[agent]\nid = "n1"\nmemory = 17179869184\n')
    assert load_agent_config(path).memory_size == 16 * GiB


def test_an_unknown_plugin_is_refused_naming_the_file_the_key_and_the_plugin(tmp_path):
    path = write_agent(tmp_path, '[agent]\nid = "n1"\nallowed-compute-plugins = ["ai.backend.accelerator.tpu"]\n')
    with pytest.raises(AgentConfigError) as caught:
        load_agent_config(path)
    message = str(caught.value)
    assert message.startswith("node-a.toml: agent.allowed-compute-plugins: ")
    assert "ai.backend.accelerator.tpu" in message


@pytest.mark.parametrize("memory", ['"lots"', '"1.5"', '"-16G"', "-1", "1.5"])
def test_a_bad_memory_size_is_refused_naming_the_file_and_key(tmp_path, memory):
    path = write_agent(tmp_path, f'[agent]\nid = "n1"\nmemory = {memory}\n')
    with pytest.raises(AgentConfigError, match="^node-a.toml: agent.memory: "):
        load_agent_config(path)


def test_a_missing_mock_config_file_is_refused_naming_the_file_key_and_missing_path(tmp_path):
    path = write_agent(tmp_path, '[agent]\nid = "n1"\n[plugins.mock]\nconfig = "gone.toml"\n', mock=False)
    with pytest.raises(AgentConfigError) as caught:
        load_agent_config(path)
    message = str(caught.value)
    assert message.startswith("node-a.toml: plugins.mock.config: ")
    assert str(tmp_path / "gone.toml") in message


def test_broken_toml_is_refused_naming_the_file(tmp_path):
    path = write_agent(tmp_path, '[agent\nid = "n1"\n')
    with pytest.raises(AgentConfigError, match="^node-a.toml: not valid TOML"):
        load_agent_config(path)


def test_a_missing_agent_toml_is_refused_naming_its_path(tmp_path):
    with pytest.raises(AgentConfigError, match="no such file") as caught:
        load_agent_config(tmp_path / "absent.toml")
    assert str(tmp_path / "absent.toml") in str(caught.value)


@pytest.mark.parametrize("node_id", ['"gpu node"', '"a/b"', '""', '"node;rm"', "7"])
def test_a_bad_node_name_is_refused_naming_the_file_and_key(tmp_path, node_id):
    path = write_agent(tmp_path, f'[agent]\nid = {node_id}\n')
    with pytest.raises(AgentConfigError, match="^node-a.toml: agent.id: "):
        load_agent_config(path)


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ('[agent]\nid = "n1"\ncpu-count = 0\n', "agent.cpu-count"),
        ('[agent]\nid = "n1"\ncpu-count = true\n', "agent.cpu-count"),
        ('[agent]\nid = "n1"\nmps = "yes"\n', "agent.mps"),
        ('[agent]\nid = "n1"\nallowed-compute-plugins = "ai.backend.accelerator.mock"\n', "agent.allowed-compute-plugins"),
        ('agent = "n1"\n', "agent"),
        ('[agent]\nid = "n1"\n[manager]\nbroker-url = "amqp://guest@rabbit//"\n', "manager.broker-url"),
    ],
    ids=["cpu-count-zero", "cpu-count-bool", "mps-text", "plugins-not-a-list", "agent-not-a-table", "broker-not-redis"],
)
def test_other_bad_values_are_refused_naming_the_file_and_key(tmp_path, body, key):
    path = write_agent(tmp_path, body)
    with pytest.raises(AgentConfigError, match=f"^node-a.toml: {key}: "):
        load_agent_config(path)


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ('manager = "redis://r:6379/0"\n[agent]\nid = "n1"\n', "manager"),
        ('[agent]\nid = "n1"\n[manager]\nbroker-url = 6379\n', "manager.broker-url"),
        ('[agent]\nid = "n1"\n[container]\nscratch-root = 5\n', "container.scratch-root"),
        ('[agent]\nid = "n1"\n[container]\nscratch-retention = "1h"\n', "container.scratch-retention"),
        ('[agent]\nid = "n1"\n[container]\nscratch-retention = -1\n', "container.scratch-retention"),
        ('plugins = ["mock"]\n[agent]\nid = "n1"\n', "plugins"),
        ('[agent]\nid = "n1"\n[plugins]\nmock = "mock-accelerator.toml"\n', "plugins.mock"),
        ('[agent]\nid = "n1"\n[container]\napp-relay = "yes"\n', "container.app-relay"),
        ('[agent]\nid = "n1"\n[container]\nterminal-direct = "on"\n', "container.terminal-direct"),
        ('[agent]\nid = "n1"\n[container]\nterminal-port = 70000\n', "container.terminal-port"),
        ('[agent]\nid = "n1"\n[container]\nterminal-port = "7000"\n', "container.terminal-port"),
        ('[agent]\nid = "n1"\n[container]\nterminal-address = "node-1.example"\n', "container.terminal-address"),
    ],
    ids=["manager-not-a-table", "broker-url-integer", "scratch-root-integer", "retention-text", "retention-negative",
         "plugins-not-a-table", "plugins-mock-not-a-table", "app-relay-text", "terminal-direct-text",
         "terminal-port-too-large", "terminal-port-text", "terminal-address-a-name"],
)
def test_a_value_of_the_wrong_type_is_an_agent_config_error_not_a_crash(tmp_path, body, key):
    path = write_agent(tmp_path, body)
    with pytest.raises(AgentConfigError, match=f"^node-a.toml: {key}"):
        load_agent_config(path)


def test_how_a_fraction_is_enforced_follows_runtime_hami_core_and_mps(tmp_path):
    (tmp_path / "libvgpu.so").write_bytes(b"\x7fELF")
    base = '[agent]\nid = "n"\n'

    def enforcement(agent: str = "", container: str = "") -> str:
        return load_agent_config(write_agent(tmp_path, f"{base}{agent}[container]\n{container}")).fraction_enforcement

    assert enforcement() == "none"
    assert enforcement(agent="mps = true\n") == "mps"
    assert enforcement(container='runtime = "docker"\nhami-core = "libvgpu.so"\n') == "hami-core"
    assert enforcement(container='hami-core = "libvgpu.so"\n') == "none"  # the process runtime preloads nothing
    config = load_agent_config(write_agent(tmp_path, f'{base}[container]\nruntime = "docker"\nhami-core = "libvgpu.so"\n'))
    assert config.hami_core == tmp_path / "libvgpu.so"
    assert config.mps_pipe_directory == Path("/tmp/nvidia-mps")


@pytest.mark.parametrize("container, key", [
    ('hami-core = "missing.so"\n', "container.hami-core"),
    ('mps-pipe-directory = "relative/dir"\n', "container.mps-pipe-directory"),
])
def test_a_bad_enforcement_setting_is_refused_naming_the_key(tmp_path, container, key):
    with pytest.raises(AgentConfigError, match=f"node-a.toml: {key}: "):
        load_agent_config(write_agent(tmp_path, f'[agent]\nid = "n"\n[container]\n{container}'))


def test_direct_terminal_streams_are_on_by_default_on_a_free_port_of_the_app_address(tmp_path):
    default = load_agent_config(write_agent(tmp_path, '[agent]\nid = "n"\n'))
    assert (default.terminal_direct, default.terminal_port, default.terminal_address) == (True, 0, "")
    configured = load_agent_config(write_agent(tmp_path, '[agent]\nid = "n"\n[container]\nterminal-direct = false\n'
                                                          'terminal-port = 7010\nterminal-address = "203.0.113.5"\n'))
    assert (configured.terminal_direct, configured.terminal_port, configured.terminal_address) == (
        False, 7010, "203.0.113.5")


@pytest.mark.parametrize(("container", "relayed"), [
    ("", False),  # app-address 127.0.0.1: the web is on this host and reaches the containers' network
    ('app-address = "::1"\n', False),
    ('app-address = "10.20.0.5"\n', True),  # web hosts elsewhere: the relay, proven per node (protocol.app_relay)
    ('app-address = "10.20.0.5"\napp-relay = "auto"\n', True),
    ('app-address = "10.20.0.5"\napp-relay = false\n', False),
    ('app-relay = true\n', True),
])
def test_the_app_relay_is_on_by_default_where_the_app_address_is_not_loopback(tmp_path, container, relayed):
    config = load_agent_config(write_agent(tmp_path, f'[agent]\nid = "n"\n[container]\nruntime = "docker"\n{container}'))
    assert config.app_relay is relayed
