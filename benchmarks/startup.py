"""How long each process of the distributed console takes to start (issue 33.6: web ready and the
manager and an agent registered within 3 s of their start on an idle 2-core machine).

    .venv/bin/python benchmarks/startup.py [--repeat 3] [--out benchmarks/results/startup.txt]

Each run starts, one at a time and as tests/stack.py starts them, against a private redis-server
and the benchmark's own PostgreSQL database (FGPU_BENCH_DATABASE_URL, created and migrated when
missing):

- **web**: `uvicorn console.asgi:application`, from its spawn to its first answer to `GET /login/`
  (a page that needs no database);
- **manager**: `celery -A console worker -Q manager` (the stack's options), from its spawn to the
  worker's "ready." line, when it takes tasks;
- **agent**: `python manage.py agent` of a node never seen before (mock GPUs), with the manager
  running, from its spawn to its node's row in the database with every device: registered.

and, in the same run for a baseline, `python -c "import django"` (the interpreter and Django's
package alone) and uvicorn serving a bare ASGI app (spawn to its first answer). Each figure is in
seconds with the 1-minute load average when it began (the machine may be shared: read the
figures against the baselines and the load), and the CPU seconds the process had used by then,
which a busy machine stretches far less (about the wall time on an idle one, since a process
starts on one core). Prints one JSON line per run and the medians; the lines go to --out too.
Every process it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not benchmarks/: a script there named like a standard module would hide it
from benchmarks.agent_scale import setup_django  # noqa: E402 (after the path)
from tests.stack import BIN, PYTHON, Proc, free_port, mock_inventory, web_command  # noqa: E402

DATABASE_URL = os.environ.get("FGPU_BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/fgpu_bench_startup")
POLL_S = 0.02
TIMEOUT_S = 120
BARE_APP = """async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})
"""


def load() -> float:
    return round(os.getloadavg()[0], 2)


def until(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {TIMEOUT_S} s")
        time.sleep(POLL_S)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status < 500
    except urllib.error.HTTPError as exc:
        return exc.code < 500
    except OSError:
        return False


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: the stat's fields 14, 15


def timed_start(name: str, argv: list[str], env: dict, work: Path, ready, procs: list[Proc], cwd: Path = ROOT) -> dict:
    """Spawn `argv` and wait for `ready(proc)`: {"s": seconds from the spawn, "cpu_s": CPU seconds
    the process used by then (what a busy machine cannot stretch much), "load": the load then}."""
    began_load = load()
    began = time.monotonic()
    proc = Proc(f"{name}-{uuid.uuid4().hex[:6]}", argv, env=env, log_dir=work, cwd=cwd)
    procs.append(proc)

    def check() -> bool:
        if not proc.alive():
            raise RuntimeError(f"{name} exited:\n{proc.output()[-3000:]}")
        return ready(proc)

    until(check, f"{name} ready")
    return {"s": round(time.monotonic() - began, 2), "cpu_s": round(cpu_s(proc.pid), 2), "load": began_load}


def node_registered(node: str, devices: int) -> bool:
    from django.db import connection

    from accelerators.models import Device

    connection.close()
    return Device.objects.filter(node__name=node, node__last_heartbeat__isnull=False).count() >= devices


def one_run(work: Path, env: dict) -> dict:
    procs: list[Proc] = []
    try:
        began_load = load()
        began = time.monotonic()
        subprocess.run([PYTHON, "-c", "import django"], check=True)
        out: dict = {"python_import_django": {"s": round(time.monotonic() - began, 2), "load": began_load}}

        (work / "bare_app.py").write_text(BARE_APP)
        port = free_port()
        out["uvicorn_bare_app"] = timed_start(
            "bare",
            [str(BIN / "uvicorn"), "--host", "127.0.0.1", "--port", str(port), "--app-dir", str(work), "bare_app:app"],
            env,
            work,
            lambda _: answers(f"http://127.0.0.1:{port}/"),
            procs,
        )
        port = free_port()
        out["web"] = timed_start("web", web_command(port), env, work, lambda _: answers(f"http://127.0.0.1:{port}/login/"), procs)
        argv = [
            str(BIN / "celery"),
            "-A",
            "console",
            "worker",
            "-Q",
            "manager",
            "--pool",
            "threads",
            "--concurrency",
            "4",
            "--without-gossip",
            "--without-mingle",
            "--loglevel",
            "INFO",
            "--hostname",
            f"manager-{uuid.uuid4().hex[:8]}@%h",
        ]
        out["manager"] = timed_start("manager", argv, env, work, lambda proc: " ready." in proc.output(), procs)

        node = f"startup-{uuid.uuid4().hex[:8]}"
        node_dir = work / "nodes" / node
        node_dir.mkdir(parents=True)
        (node_dir / "mock-accelerator.toml").write_text(mock_inventory(gpus=2))
        (node_dir / "agent.toml").write_text(
            f'[agent]\nid = "{node}"\nallowed-compute-plugins = ["ai.backend.accelerator.mock"]\ncpu-count = 4\n'
            f'memory = "16G"\n[container]\nscratch-root = "scratches"\nruntime = "process"\n'
        )
        agent_env = {**env, "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none"}
        argv = [PYTHON, "manage.py", "agent", "--config", str(node_dir / "agent.toml")]
        out["agent"] = timed_start("agent", argv, agent_env, work, lambda _: node_registered(node, 2), procs)
        return out
    finally:
        for proc in procs:
            proc.stop(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "startup.txt"))
    args = parser.parse_args()
    setup_django(DATABASE_URL)
    header = f"# benchmarks/startup.py {' '.join(sys.argv[1:])}  ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores)"
    lines = [header]
    print(header, flush=True)
    with tempfile.TemporaryDirectory(prefix="fgpu-startup-") as tmp:
        work = Path(tmp)
        redis_port = free_port()
        redis = Proc(
            "redis",
            ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp],
            env=dict(os.environ),
            log_dir=work,
        )
        env = {
            **os.environ,
            "DATABASE_URL": DATABASE_URL,
            "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
            "FGPU_DATA_DIR": str(work / "data"),
            "PYTHONUNBUFFERED": "1",
            "FGPU_HEARTBEAT_INTERVAL": "2",
        }
        env.pop("FGPU_CELERY_EAGER", None)
        if len(env.get("FGPU_SECRET_KEY", "")) < 32:
            import secrets

            env["FGPU_SECRET_KEY"] = secrets.token_urlsafe(48)
        runs = []
        try:
            until(lambda: "Ready to accept connections" in redis.output(), "redis-server")
            for i in range(args.repeat):
                runs.append(one_run(work / f"run-{i}", env) if (work / f"run-{i}").mkdir() is None else {})
                lines.append("run: " + json.dumps(runs[-1]))
                print(lines[-1], flush=True)
        finally:
            redis.stop()
    for figure in ("s", "cpu_s"):
        keys = [key for key in runs[0] if figure in runs[0][key]]
        medians = {key: round(statistics.median(run[key][figure] for run in runs), 2) for key in keys}
        lines.append(f"median_{figure}: {json.dumps(medians)}  (load at the end {load()})")
        print(lines[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
