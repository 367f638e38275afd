"""Attacks on the web tier and the deployment's secrets (issue 31.7); each test fails if its attack
succeeds. Against compose.yaml as `docker-compose config` resolves it with an `.env` that
deploy/make_env.py wrote (compose cannot be started here: no registry), against the login token
store, and against a real uvicorn for the body checks (tests/test_upload_guard.py has the rest)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.stack import ROOT

COMPOSE = shutil.which("docker-compose")
KNOWN_DEFAULTS = ("change-me", "admin-change-me", "change-me-metrics-token")


def compose_env() -> dict:
    """This process's environment without the console's variables: compose substitutes from both."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("FGPU_", "DATABASE_URL", "REDIS_URL"))}


def compose_config(env_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run([COMPOSE, "--env-file", str(env_file), "-f", str(ROOT / "compose.yaml"), "config"], cwd=ROOT,
                          env=compose_env(), capture_output=True, text=True, timeout=60)


def volume(entry) -> dict:
    """A service's volume as {"source", "target", "read_only"}: docker-compose 1.x writes the short
    syntax (`source:target[:mode]`), 2.x the long one."""
    if isinstance(entry, dict):
        return {"source": entry.get("source", ""), "target": entry["target"], "read_only": bool(entry.get("read_only"))}
    source, target, *mode = entry.split(":")
    return {"source": source, "target": target, "read_only": mode == ["ro"]}


def host_ip(port) -> str:
    """The address a published port listens on ("" for every address), from the short syntax
    (`[ip:]published:target[/proto]`) or the long one."""
    if isinstance(port, dict):
        return port.get("host_ip", "")
    parts = str(port).split("/")[0].split(":")
    return parts[0] if len(parts) == 3 else ""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> tuple[dict, dict, Path]:
    """(the .env's variables, compose's resolved config, the ACL file) of a deployment made by
    deploy/make_env.py."""
    if COMPOSE is None:
        pytest.fail("docker-compose is not installed (Debian's docker-compose; .ci/run installs it)")
    where = tmp_path_factory.mktemp("compose")
    made = subprocess.run([sys.executable, str(ROOT / "deploy" / "make_env.py"), "--env-file", str(where / ".env"),
                           "--acl-file", str(where / "users.acl")], cwd=ROOT, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    variables = dict(line.split("=", 1) for line in (where / ".env").read_text().splitlines()
                     if line and not line.startswith("#"))
    out = compose_config(where / ".env")
    assert out.returncode == 0, out.stderr
    return variables, yaml.safe_load(out.stdout), where


def test_compose_without_an_env_file_does_not_start_with_default_secrets(tmp_path):
    empty = tmp_path / ".env"
    empty.write_text("")

    out = compose_config(empty)

    assert out.returncode != 0, "compose resolved a deployment with no secrets at all"
    assert "run deploy/make_env.py first" in out.stderr


NOT_SECRET = ("FGPU_APPS_ORIGIN",)  # what make_env.py writes to .env besides the secrets


def test_no_secret_of_the_deployment_is_a_known_default(deployment):
    variables, config, _ = deployment
    variables = {name: value for name, value in variables.items() if name not in NOT_SECRET}
    assert set(variables) >= {"FGPU_SECRET_KEY", "FGPU_METRICS_TOKEN", "FGPU_ADMIN_PASSWORD", "FGPU_GRAFANA_PASSWORD",
                              "FGPU_POSTGRES_PASSWORD", "FGPU_REDIS_WEB_PASSWORD", "FGPU_REDIS_MANAGER_PASSWORD",
                              "FGPU_REDIS_AGENT_PASSWORD"}
    assert len(set(variables.values())) == len(variables), "two secrets are the same"
    assert all(len(value) >= 24 for value in variables.values())
    text = yaml.safe_dump(config)
    for default in KNOWN_DEFAULTS:
        assert default not in text, f"compose still carries {default!r}"
    assert config["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == variables["FGPU_GRAFANA_PASSWORD"]
    assert config["services"]["web"]["environment"]["FGPU_SECRET_KEY"] == variables["FGPU_SECRET_KEY"]


def test_a_second_make_env_does_not_silently_replace_the_deployments_secrets(deployment):
    variables, _, where = deployment
    again = subprocess.run([sys.executable, str(ROOT / "deploy" / "make_env.py"), "--env-file", str(where / ".env"),
                            "--acl-file", str(where / "users.acl")], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 1
    assert f"FGPU_SECRET_KEY={variables['FGPU_SECRET_KEY']}" in (where / ".env").read_text()
    assert (where / ".env").stat().st_mode & 0o777 == 0o600


def test_redis_lets_no_one_in_without_a_role_and_each_process_holds_its_own_user(deployment):
    variables, config, where = deployment
    services = config["services"]
    redis = services["redis"]
    assert "--aclfile" in redis["command"]
    (acl_mount,) = [v for v in map(volume, redis["volumes"]) if v["target"] == "/etc/redis/users.acl"]
    assert acl_mount["source"].endswith("deploy/redis/users.acl") and acl_mount["read_only"]
    acl = (where / "users.acl").read_text()
    assert acl.splitlines()[0] == "user default off"
    for name, secret in variables.items():
        assert name in NOT_SECRET or secret not in acl  # only digests
    urls = {name: services[name]["environment"]["REDIS_URL"] for name in ("web", "manager", "beat", "agent")}
    assert urls["web"].startswith(f"redis://fgpu-web:{variables['FGPU_REDIS_WEB_PASSWORD']}@")
    assert urls["manager"] == urls["beat"]
    assert urls["manager"].startswith(f"redis://fgpu-manager:{variables['FGPU_REDIS_MANAGER_PASSWORD']}@")
    assert urls["agent"].startswith(f"redis://fgpu-agent-compose-node:{variables['FGPU_REDIS_AGENT_PASSWORD']}@")
    assert "DATABASE_URL" not in services["agent"]["environment"]  # a node holds no database credentials


def test_only_the_webs_port_is_reachable_from_other_hosts(deployment):
    _, config, _ = deployment
    for name, service in config["services"].items():
        for port in service.get("ports", []):
            if name != "web":
                assert host_ip(port) == "127.0.0.1", f"{name} publishes {port} beyond this host"


def test_web_manager_and_beat_are_not_root_and_only_the_agent_has_the_docker_socket(deployment):
    _, config, _ = deployment
    services = config["services"]
    for name in ("web", "manager", "beat", "migrate"):
        assert services[name].get("user") == "fgpu", f"{name} runs as root"
    assert "USER fgpu" in (ROOT / "Dockerfile").read_text()
    for name, service in services.items():
        sockets = [v for v in map(volume, service.get("volumes", [])) if "docker.sock" in v["source"] + v["target"]]
        assert not sockets or name == "agent", f"{name} holds the Docker socket"
    assert any("docker.sock" in str(v) for v in services["agent"]["volumes"])
    assert "deploy/agent.toml" in services["agent"]["command"]
    assert 'runtime = "docker"' in (ROOT / "deploy" / "agent.toml").read_text()


def test_apps_are_served_on_an_origin_of_their_own_that_the_web_publishes(deployment):
    variables, config, _ = deployment
    web = config["services"]["web"]
    origin = urlsplit(web["environment"]["FGPU_APPS_ORIGIN"])

    assert web["environment"]["FGPU_APPS_ORIGIN"] == variables["FGPU_APPS_ORIGIN"] == "http://localhost:8001"
    # Another host name than the console's (http://127.0.0.1:8000), so the browser sends it none of the
    # console's cookies; the same server behind a second published port, told apart by the Host header.
    assert origin.hostname not in ("127.0.0.1", "web") and origin.port != 8000
    published = {(int(p["published"]), int(p["target"])) if isinstance(p, dict) else tuple(map(int, str(p).split(":")[-2:]))
                 for p in web["ports"]}
    assert published == {(8000, 8000), (origin.port, 8000)}
    assert "--port" in web["command"] and web["command"][web["command"].index("--port") + 1] == "8000"


def test_compose_sessions_get_the_outbound_network_guarded_by_an_agent_on_the_hosts_network(deployment):
    from agent.config import load_agent_config

    _, config, _ = deployment
    services, agent = config["services"], config["services"]["agent"]
    read = load_agent_config(ROOT / "deploy" / "agent.toml")
    gateway = config["networks"]["default"]["ipam"]["config"][0]["gateway"]
    redis_address = services["redis"]["networks"]["default"]["ipv4_address"]

    assert (read.runtime, read.network, read.app_relay) == ("docker", "outbound", True)
    assert read.block_private_networks  # sessions reach neither this stack's subnet nor the site's
    # The agent puts its iptables chain into the host's tables, and the web reaches its relays on the
    # stack network's gateway, an address of the host; it reaches Redis by the address compose fixes.
    assert agent["network_mode"] == "host" and agent["cap_add"] == ["NET_ADMIN"]
    assert read.app_address == gateway
    assert urlsplit(agent["environment"]["REDIS_URL"]).hostname == redis_address
    assert not services["redis"].get("ports"), "Redis is published"
    assert "iptables" in (ROOT / "Dockerfile").read_text()


def test_the_image_does_not_carry_the_deployments_secrets():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".env" in ignored and "deploy/redis/users.acl" in ignored


@pytest.mark.django_db
def test_a_stolen_database_holds_no_usable_login_token(django_user_model):
    from accounts.models import ApiToken
    from accounts.services import api_token_create, login_token_issue

    alice = django_user_model.objects.create_user("alice")
    keys = [login_token_issue(user=alice), api_token_create(user=alice, name="ci")[0]]
    stored = list(ApiToken.objects.filter(user=alice).values_list("digest", "prefix", "name"))

    for key in keys:
        for row in stored:
            assert all(key not in str(value) for value in row), "a token's key is stored"
    from rest_framework.authtoken.models import Token

    assert not Token.objects.exists(), "a plaintext DRF authtoken was made"
