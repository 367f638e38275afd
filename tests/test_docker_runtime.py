"""The docker runtime for real (issue 13): a real Agent drives real containers of the session
test image (tests/images/build.sh) through Docker Engine on this machine, network `none`.
The manager is the recording stand-in of tests/test_agent_runtime.py.

On CI a missing Docker Engine or test image fails these tests (tests/docker_support.py)."""
from __future__ import annotations

import asyncio
import json
import re
import uuid

import pytest
from channels.layers import InMemoryChannelLayer

from agent.core import Agent
from agent.direct import DirectServer
from agent.docker_runtime import LABEL_NODE, DockerRuntime
from tests.conftest import GiB
from tests.test_agent_runtime import DEVICE, Harness, RecordingManager, start_spec, typed_spec
from tests.test_terminal_flow import direct_reader
from protocol.messages import StartSpec

pytestmark = pytest.mark.docker
MiB = 1 << 20
TEST_IMAGE = "fgpu-session:test"  # built by tests/images/build.sh (.ci/run runs it)


@pytest.fixture(scope="module")
def docker_client():
    """Docker Engine on this machine. Missing on CI is a failure, never a skip (.ci/run starts it)."""
    import docker

    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:
        pytest.fail(f"Docker Engine is not reachable ({exc}); .ci/run installs docker.io and starts dockerd")
    return client


@pytest.fixture(scope="module")
def test_image(docker_client):
    import docker

    try:
        docker_client.images.get(TEST_IMAGE)
    except docker.errors.ImageNotFound:
        pytest.fail(f"image {TEST_IMAGE} is missing: run tests/images/build.sh (.ci/run does)")
    return TEST_IMAGE


def docker_agent(tmp_path, client, image: str, node: str, **runtime_options) -> Agent:
    runtime = DockerRuntime(node=node, default_image=image, network="none", client=client, **runtime_options)
    inventory = {"devices": [DEVICE.as_dict()], "plugins": ["ai.backend.accelerator.mock"], "attributes": {},
                 "cpu_count": 8, "memory_size": 32 * GiB}
    return Agent(node=node, inventory=inventory, channel_layer=run_docker.layer, manager=run_docker.manager,
                 scratch_root=tmp_path / "scratch", mock=True, heartbeat_s=60, runtime=runtime)


def run_docker(tmp_path, client, image, scenario, **runtime_options):
    node = f"docker-node-{uuid.uuid4().hex[:8]}"

    async def main():
        run_docker.layer = InMemoryChannelLayer()
        run_docker.manager = RecordingManager(asyncio.get_running_loop())
        agent = docker_agent(tmp_path, client, image, node, **runtime_options)
        await agent.start()
        try:
            return await scenario(Harness(agent, run_docker.manager, run_docker.layer))
        finally:
            await agent.shutdown()

    try:
        return asyncio.run(main())
    finally:
        for container in client.containers.list(all=True, filters={"label": f"{LABEL_NODE}={node}"}):
            container.remove(force=True)


def test_the_agent_reports_the_service_ports_label_of_the_images_it_holds(tmp_path, docker_client, test_image):
    """Backend.AI's ai.backend.service-ports label, as the test image carries it (tests/images/build.sh),
    goes with the registration by image id: the manager gives the image record its apps from it."""
    async def scenario(h):
        return h.manager.images[0], h.manager.service_ports[0]

    images, service_ports = run_docker(tmp_path, docker_client, test_image, scenario)

    assert service_ports[images[TEST_IMAGE]] == "jupyterlab:http:8090"
    assert set(service_ports) <= set(images.values())


def containers_of(client, session_id: str) -> list:
    return client.containers.list(all=True, filters={"label": f"fgpu.session={session_id}"})


def test_a_session_runs_in_its_own_container_as_a_user_with_its_slice_and_nothing_else(tmp_path, docker_client,
                                                                                          test_image):
    async def scenario(h: Harness):
        spec = start_spec(memory_limit=2 * GiB)
        session_id = await h.start_session(spec)
        channel = await h.watch_terminal(session_id)
        await h.type(session_id, "id -u; echo home=$HOME; ps -e | wc -l; nvidia-smi; echo done-$((6*7))\r")
        output = await h.read_until(channel, "done-42")
        [container] = containers_of(docker_client, session_id)
        return output, container.attrs

    output, attrs = run_docker(tmp_path, docker_client, test_image, scenario)
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output).replace("\r", "")  # bash's bracketed-paste toggles
    lines = [line.strip() for line in plain.split("\n")]
    assert "1000" in lines, output  # not root inside
    assert "home=/home/work" in lines, output
    assert "2048MiB" in output, output  # the virtual nvidia-smi shows the 2 GiB slice
    # Its own PID namespace: init, the shell, ps, wc and the header line, not the host's processes.
    assert any(line.isdigit() and int(line) <= 8 for line in lines), output
    host = attrs["HostConfig"]
    assert host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"]
    assert host["NanoCpus"] == 1_000_000_000 and host["Memory"] == GiB and host["MemorySwap"] == GiB
    assert host["NetworkMode"] == "none" and host["Init"] is True and host["PidsLimit"] > 0
    assert not any("docker.sock" in m["Source"] for m in attrs["Mounts"])
    assert {m["Destination"]: m["RW"] for m in attrs["Mounts"]} == {"/home/work": True, "/opt/fgpu": False}


def test_stopping_a_session_removes_its_container(tmp_path, docker_client, test_image):
    async def scenario(h: Harness):
        session_id = await h.start_session(start_spec())
        assert len(containers_of(docker_client, session_id)) == 1
        await h.agent._stop(session_id, reason="terminated")
        await h.manager.wait_for_report(session_id, "TERMINATED")
        return session_id

    session_id = run_docker(tmp_path, docker_client, test_image, scenario)
    assert containers_of(docker_client, session_id) == []


def test_a_batch_command_reports_its_exit_code(tmp_path, docker_client, test_image):
    async def scenario(h: Harness):
        spec = start_spec(command="exit 7")
        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        return await h.manager.wait_for_report(spec["session_id"], "TERMINATED")

    status, reason, code = run_docker(tmp_path, docker_client, test_image, scenario)
    assert code == 7 and "code 7" in reason


def test_a_session_past_its_memory_limit_ends_saying_out_of_memory(tmp_path, docker_client, test_image):
    async def scenario(h: Harness):
        spec = {**start_spec(command="python3 -c 'b = []\nwhile True: b.append(bytearray(16 << 20))'"), "mem": 256 * MiB}
        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        return await h.manager.wait_for_report(spec["session_id"], "TERMINATED")

    status, reason, code = run_docker(tmp_path, docker_client, test_image, scenario)
    assert reason.startswith("killed: out of memory at its 256 MiB limit"), reason
    assert code == 137


def test_exec_runs_in_the_container_and_its_timeout_kills_it(tmp_path, docker_client, test_image):
    async def scenario(h: Harness):
        session_id = await h.start_session(start_spec())
        running = h.agent.sessions[session_id]
        ok = await asyncio.to_thread(h.agent._run_exec, running, "id -u; pwd; echo $FGPU_SESSION_ID; echo oops >&2", 20)
        slow = await asyncio.to_thread(h.agent._run_exec, running, ["sleep", "30"], 1)
        return session_id, ok, slow

    session_id, ok, slow = run_docker(tmp_path, docker_client, test_image, scenario)
    assert ok["exit_code"] == 0 and ok["stdout"].split() == ["1000", "/home/work", session_id], ok
    assert ok["stderr"] == "oops\n"
    assert slow["timed_out"] is True and slow["duration_ms"] < 20_000


def test_an_agent_that_starts_again_adopts_its_running_containers_and_removes_ended_ones(tmp_path, docker_client,
                                                                                           test_image):
    node = f"docker-node-{uuid.uuid4().hex[:8]}"

    async def main():
        run_docker.layer = InMemoryChannelLayer()
        run_docker.manager = RecordingManager(asyncio.get_running_loop())
        first = docker_agent(tmp_path, docker_client, test_image, node)
        await first.start()
        h = Harness(first, run_docker.manager, run_docker.layer)
        keep = await h.start_session(start_spec())
        ended = await h.start_session(start_spec())
        # The agent dies (no shutdown: its containers go on); one session's container ends meanwhile.
        for task in first._tasks:
            task.cancel()
        for running in first.sessions.values():
            first.loop.remove_reader(running.process.fd)
        docker_client.containers.get(f"fgpu-{ended}").kill()
        second = docker_agent(tmp_path, docker_client, test_image, node)
        second.direct = DirectServer(second, host="127.0.0.1")  # direct terminal streams (agent.direct) on
        await second.start()
        try:
            assert set(second.sessions) == {keep}
            assert run_docker.manager.registered[-1][2] == [keep]  # the manager hears it still runs
            h2 = Harness(second, run_docker.manager, run_docker.layer)
            channel = await h2.watch_terminal(keep)  # a terminal of the first agent's: it never attached here
            reader, _ = await direct_reader(h2, keep)  # … beside one that reads a direct stream
            await h2.type(keep, "echo still-$((40+2))\r")
            await h2.read_until(channel, "still-42")
            direct = ""
            async with asyncio.timeout(20):
                while "still-42" not in direct:
                    direct += json.loads(await reader.readline()).get("data", "")
            return keep, ended
        finally:
            await second.shutdown()

    try:
        keep, ended = asyncio.run(main())
    finally:
        for container in docker_client.containers.list(all=True, filters={"label": f"{LABEL_NODE}={node}"}):
            container.remove(force=True)
    assert containers_of(docker_client, ended) == []
    assert containers_of(docker_client, keep) == []  # stopped and removed at the second agent's shutdown


def test_an_agent_of_another_installation_with_the_same_node_name_leaves_the_containers_alone(tmp_path, docker_client,
                                                                                              test_image):
    """Two consoles on one host whose nodes share a name (both `make run`'s demo-node; issue 31 item 8):
    the second's start neither adopts nor removes the first's containers, running or ended."""
    node = f"docker-node-{uuid.uuid4().hex[:8]}"

    async def main():
        run_docker.layer = InMemoryChannelLayer()
        run_docker.manager = RecordingManager(asyncio.get_running_loop())
        first = docker_agent(tmp_path / "first", docker_client, test_image, node, instance="console-one")
        await first.start()
        h = Harness(first, run_docker.manager, run_docker.layer)
        running = await h.start_session(start_spec())
        ended = str(uuid.uuid4())  # a container of the first's that is not running (created, never started)
        docker_client.containers.create(test_image, ["true"], name=f"fgpu-{ended}", labels={
            "fgpu.session": ended, LABEL_NODE: node, "fgpu.instance": "console-one"})
        second = docker_agent(tmp_path / "second", docker_client, test_image, node, instance="console-two")
        await second.start()
        try:
            assert second.sessions == {}
            assert docker_client.containers.get(f"fgpu-{running}").status == "running"
            assert len(containers_of(docker_client, ended)) == 1  # the first's to remove, not the second's
        finally:
            await second.shutdown()
            await first.shutdown()
        return running

    try:
        running = asyncio.run(main())
    finally:
        for container in docker_client.containers.list(all=True, filters={"label": f"{LABEL_NODE}={node}"}):
            container.remove(force=True)
    assert containers_of(docker_client, running) == []


def test_a_cuda_node_asks_docker_for_exactly_the_granted_devices(tmp_path, docker_client, test_image):
    runtime = DockerRuntime(node="gpu-node", default_image=test_image, network="none", client=docker_client, gpus=True)
    spec = typed_spec()
    (tmp_path / ".fgpu").mkdir()
    config = runtime.container_config(spec=spec, argv=["/bin/bash"], env={"A": "1"}, work_dir=tmp_path)
    container = docker_client.containers.create(**config)  # created, not started: this machine has no GPU
    try:
        [request] = container.attrs["HostConfig"]["DeviceRequests"]
        assert request["Driver"] == "nvidia" and request["Capabilities"] == [["gpu"]]
        assert request["DeviceIDs"] == [DEVICE.device_id]
        assert "A=1" in container.attrs["Config"]["Env"]
    finally:
        container.remove(force=True)


def test_hami_core_and_mps_are_mounted_and_named_in_the_environment_as_agent_toml_says(tmp_path, docker_client,
                                                                                        test_image):
    libvgpu = tmp_path / "libvgpu.so"
    libvgpu.write_bytes(b"\x7fELF")
    pipes = tmp_path / "nvidia-mps"
    pipes.mkdir()
    (tmp_path / "work" / ".fgpu").mkdir(parents=True)
    runtime = DockerRuntime(node="gpu-node", default_image=test_image, network="none", client=docker_client, gpus=True,
                            hami_core=libvgpu, mps_pipe_directory=pipes)
    config = runtime.container_config(spec=typed_spec(), argv=["/bin/bash"], env={"CUDA_DEVICE_SM_LIMIT": "25"},
                                      work_dir=tmp_path / "work")
    container = docker_client.containers.create(**config)  # created, not started: this machine has no GPU
    try:
        mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
        assert mounts["/usr/local/vgpu/libvgpu.so"]["Source"] == str(libvgpu)
        assert mounts["/usr/local/vgpu/libvgpu.so"]["RW"] is False
        assert mounts[str(pipes)]["Source"] == str(pipes)
        env = container.attrs["Config"]["Env"]
        assert "LD_PRELOAD=/usr/local/vgpu/libvgpu.so" in env and f"CUDA_MPS_PIPE_DIRECTORY={pipes}" in env
        assert "CUDA_DEVICE_SM_LIMIT=25" in env
        assert container.attrs["HostConfig"]["IpcMode"] == "host"
    finally:
        container.remove(force=True)
    plain = DockerRuntime(node="gpu-node", default_image=test_image, network="none", client=docker_client, gpus=True)
    config = plain.container_config(spec=typed_spec(), argv=["/bin/bash"], env={}, work_dir=tmp_path / "work")
    assert "LD_PRELOAD" not in config["environment"] and "ipc_mode" not in config
    assert [m["Target"] for m in config["mounts"]] == ["/home/work", "/opt/fgpu"]


def test_a_missing_image_ends_the_start_in_error_with_the_reason(tmp_path, docker_client, test_image):
    async def scenario(h: Harness):
        spec = {**start_spec(), "image": "fgpu-no-such-image:never"}
        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        return await h.manager.wait_for_report(spec["session_id"], "ERROR")

    status, reason, code = run_docker(tmp_path, docker_client, test_image, scenario, pull=False)
    assert "fgpu-no-such-image:never" in reason and "is not on node" in reason


def test_an_image_whose_registry_cannot_be_reached_ends_the_start_in_error_in_the_registrys_words(
        tmp_path, docker_client, test_image):
    async def scenario(h: Harness):
        spec = {**start_spec(), "image": "127.0.0.1:9/fgpu-no-such-image:never"}  # nothing listens on port 9
        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        return await h.manager.wait_for_report(spec["session_id"], "ERROR")

    status, reason, code = run_docker(tmp_path, docker_client, test_image, scenario)
    assert "pulling image '127.0.0.1:9/fgpu-no-such-image:never' failed" in reason, reason
    assert "connection refused" in reason.lower(), reason


@pytest.mark.parametrize("reference, parts", [
    ("fgpu-session:test", ("fgpu-session", "test")),
    ("ubuntu", ("ubuntu", "latest")),
    ("127.0.0.1:5000/team/img:v1", ("127.0.0.1:5000/team/img", "v1")),
    ("127.0.0.1:5000/team/img", ("127.0.0.1:5000/team/img", "latest")),
    ("img@sha256:" + "a" * 64, ("img@sha256:" + "a" * 64, None)),
])
def test_a_reference_splits_into_repository_and_tag_as_docker_pull_takes_it(reference, parts):
    from agent.docker_runtime import _split_reference

    assert _split_reference(reference) == parts


@pytest.fixture
def local_registry(tmp_path):
    """A Docker registry on this machine (Debian's docker-registry, the Distribution registry) on
    a free port of 127.0.0.1, which Docker Engine reaches without TLS. Yields its address."""
    import shutil
    import subprocess

    from tests.stack import free_port, wait_until

    binary = shutil.which("docker-registry")
    if binary is None:
        pytest.fail("docker-registry is not installed; .ci/run installs it")
    port = free_port()
    config = tmp_path / "registry.yml"
    config.write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'registry'}\n"
                      f"http:\n  addr: 127.0.0.1:{port}\nlog:\n  level: warn\n")
    server = subprocess.Popen([binary, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    import urllib.request

    def answers() -> bool:
        if server.poll() is not None:
            pytest.fail("the local registry exited before it answered")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1)
            return True
        except OSError:
            return False

    try:
        wait_until(answers, timeout=20, what="the local registry to answer")
    except BaseException:
        server.kill()
        raise
    yield f"127.0.0.1:{port}"
    server.kill()
    server.wait()


def test_a_session_in_an_image_the_node_lacks_pulls_it_with_progress_then_runs(tmp_path, docker_client, test_image,
                                                                              local_registry):
    # An image with a layer of its own (8 MiB of random bytes), pushed to the local registry and
    # then removed here, so that the session's start must download that layer.
    builder = docker_client.containers.run(test_image, ["sh", "-c", "head -c 8388608 /dev/urandom > /blob"],
                                           network_mode="none", detach=True)
    builder.wait()
    reference = f"{local_registry}/fgpu-pull-test:{uuid.uuid4().hex[:8]}"
    repository, tag = reference.rsplit(":", 1)
    image = builder.commit(repository=repository, tag=tag)
    builder.remove()
    for line in docker_client.api.push(repository, tag=tag, stream=True, decode=True):
        assert "error" not in line, line
    docker_client.images.remove(image.id, force=True)
    assert not docker_client.images.list(name=repository)

    async def scenario(h: Harness):
        spec = {**start_spec(), "image": reference}
        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        await h.manager.wait_for_report(spec["session_id"], "RUNNING")
        channel = await h.watch_terminal(spec["session_id"])
        await h.type(spec["session_id"], "ls -l /blob | cut -d' ' -f5\r")
        await h.read_until(channel, "8388608")
        return h.manager.reports_for(spec["session_id"])

    try:
        reports = run_docker(tmp_path, docker_client, test_image, scenario)
    finally:
        for found in docker_client.images.list(name=repository):
            docker_client.images.remove(found.id, force=True)
    preparing = [reason for status, reason, _ in reports if status == "PREPARING"]
    assert any(re.match(rf"pulling image {re.escape(reference)}: \d+ % \(\d+ of \d+ MiB\)$", r) for r in preparing), \
        preparing
    assert f"pulled image {reference}; starting the session" in preparing
    assert [status for status, _, _ in reports][-1] == "RUNNING"


RELAYED_APP = {"name": "files", "command": "cd $HOME && echo relayed > hello.txt && exec python3 -m http.server {port} "
                                           "--bind {host}", "port": 8000, "base_url": False}  # serves hello.txt: "relayed"


async def relay_agent(tmp_path, client, image: str, node: str, runtimes: list, *, network: str, app_address: str) -> Harness:
    """A started agent of node `node` with the docker runtime on `network` that relays its sessions'
    apps on `app_address` (agent.toml `app-relay = true`); its runtime is put in `runtimes` (for
    run_removing)."""
    layer, manager = InMemoryChannelLayer(), RecordingManager(asyncio.get_running_loop())
    runtime = DockerRuntime(node=node, default_image=image, network=network, client=client, instance=uuid.uuid4().hex[:10])
    runtimes.append(runtime)
    agent = Agent(node=node, inventory={"devices": [DEVICE.as_dict()], "plugins": [], "attributes": {}, "cpu_count": 8,
                                        "memory_size": 32 * GiB}, channel_layer=layer, manager=manager,
                  scratch_root=tmp_path / "scratch", mock=True, heartbeat_s=60, runtime=runtime,
                  app_address=app_address, app_relay=True)
    await agent.start()
    return Harness(agent, manager, layer)


async def app_answer(h: Harness, session_id: str, app: dict) -> dict:
    """Open `app` in the session (pty.app_open, as the web does) and wait for its answer past the
    progress notes: `app.ready` {host, port} or the error."""
    from tests.test_agent_runtime import TIMEOUT

    reply = await h.layer.new_channel("test.")
    await h.to_pty(session_id, {"type": "pty.app_open", "app": app, "base_url": "/", "token": "t", "timeout": 60,
                                "reply_channel": reply})
    async with asyncio.timeout(TIMEOUT * 3):
        while (answer := await h.layer.receive(reply))["type"] == "app.progress":
            pass
    return answer


def run_removing(main, client, node: str, runtimes: list):
    """asyncio.run(main()), then remove node `node`'s containers and the networks and iptables chains
    of the docker runtimes main put in `runtimes`, whatever happened."""
    try:
        return asyncio.run(main())
    finally:
        for container in client.containers.list(all=True, filters={"label": f"{LABEL_NODE}={node}"}):
            container.remove(force=True)
        for runtime in runtimes:
            runtime.session_network.remove()


async def through_relay(host: str, port: int, first: bytes) -> bytes:
    """Everything a connection to host:port that writes `first`, then a GET of /hello.txt, is
    answered before the far end closes it (b"": closed without a byte)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=10)
    try:
        writer.write(first + b"GET /hello.txt HTTP/1.0\r\nHost: app\r\n\r\n")
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout=30)
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


def test_with_app_relay_the_agent_relays_a_containers_app_on_its_app_address_until_the_session_ends(
        tmp_path, docker_client, test_image):
    """agent.toml `[container] app-relay = true`: the web is told the agent's own address (a free
    port of app-address), not the container's, and reaches the app through the agent; the relay
    closes with the session. (Web hosts that cannot route to the node's bridge network reach the app so.)
    Only a connection that first proves it comes from the web (protocol.app_relay: an HMAC under the
    node's relay key, here the agent's random one, as it has no node key) reaches the app: one
    without the proof, with a proof under another key, for another app, or replayed is closed
    without a byte from the app."""
    from protocol.app_relay import RELAY_KEY, relay_hello

    node = f"docker-node-{uuid.uuid4().hex[:8]}"

    async def main():
        # "bridge": the old name of "outbound" (agent.network)
        h = await relay_agent(tmp_path, docker_client, test_image, node, runtimes, network="bridge", app_address="127.0.0.1")
        agent, manager = h.agent, h.manager
        try:
            session_id = await h.start_session(start_spec())
            answer = await app_answer(h, session_id, RELAYED_APP)
            assert answer["type"] == "app.ready", answer
            key, where = answer[RELAY_KEY], (answer["host"], answer["port"])
            proven = relay_hello(key, node=node, session_id=session_id, app="files")
            tries = {
                "none": await through_relay(*where, b""),
                "forged": await through_relay(*where, relay_hello("0" * 64, node=node, session_id=session_id,
                                                                  app="files")),
                "other app": await through_relay(*where, relay_hello(key, node=node, session_id=session_id,
                                                                     app="other")),
                "proven": await through_relay(*where, proven),
                "replayed": await through_relay(*where, proven),
            }
            body = tries.pop("proven")
            assert tries == {"none": b"", "forged": b"", "other app": b"", "replayed": b""}, tries
            container_host = await asyncio.to_thread(lambda: agent.sessions[session_id].process.app_address()[1])
            await asyncio.to_thread(agent.submit_stop, session_id)
            await manager.wait_for_report(session_id, "TERMINATED")
            try:
                await asyncio.wait_for(asyncio.open_connection(answer["host"], answer["port"]), timeout=2)
                after = "connected"
            except (OSError, TimeoutError):
                after = "refused"
            return answer, body, container_host, after
        finally:
            await agent.shutdown()

    runtimes: list = []
    answer, body, container_host, after = run_removing(main, docker_client, node, runtimes)

    assert answer["host"] == "127.0.0.1" and answer["port"] != 8000 and container_host != "127.0.0.1"
    assert body.startswith(b"HTTP/1.0 200") and body.endswith(b"\r\n\r\nrelayed\n"), body
    assert after == "refused"
