"""A newcomer's first run (issue 35.4): from a fresh clone, how long `make run` takes to serve its
first page (target 60 s with pip's cache warm), and a restart in the same tree (target 5 s).

    python3 benchmarks/first_run.py [--source /work/main] [--dest /tmp/h2-clone] [--port 0] [--keep]
        [--warm] [--plain-pip] [--uv DIR] [--restarts 3]

Needs only the standard library (it runs before any virtualenv exists). Each step:

0. with --warm, the caches warmed as a user's are after an earlier install: `make install` in a
   clone of its own, untimed, with the pip and uv caches the timed run uses (PIP_CACHE_DIR and
   UV_CACHE_DIR, the benchmark's own directories, so that no other cache on the machine counts);
   their sizes are printed. pip's stays empty on a machine whose package index answers without
   Cache-Control, ETag or Last-Modified (pip's HTTP cache, CacheControl, stores nothing then,
   and pip 23 keeps in its wheel cache only wheels it built): there a warm pip cache is
   what this machine has, each wheel fetched again from the index's mirror;
1. `git clone SOURCE DEST` (the committed tree: what a newcomer gets), timed on its own;
2. `make run PORT=<port>` in DEST, from its spawn until `GET http://127.0.0.1:<port>/` answers
   (the sign-in page, after the redirect): the first run, venv created and installed (by uv or
   pip: `make run` chooses, see the Makefile; the one it chose is printed);
3. Ctrl-C (SIGINT to its process group: `make run`'s background JupyterLab install, an
   asynchronous command of make's shell, ignores it and goes on);
4. `make run` again in the same tree, --restarts times, each timed alike: the restart, which
   must install nothing (its output is checked for the install line); their median is the figure;
5. how long after the first spawn JupyterLab's background install finished (its stamp
   `.venv/.installed-jupyter`), waited for at most --jupyter-timeout seconds.

--restart-ab A B (trees already installed, e.g. two --keep clones of two commits) times restarts
alone, interleaved: `make run` in A, then in B, --restarts rounds, the medians of each (wall and
CPU seconds) with the load at each start.

--plain-pip runs without this machine's pip configuration (PIP_CONFIG_FILE=/dev/null and no PIP_*
variables): pip as installed, with PyPI alone, where `make run` may choose uv. --uv DIR puts DIR
(holding a `uv` executable) first on PATH.

Prints each figure in seconds, the 1-minute load average at each start, the CPU seconds each run
had used when its page answered (`Run.cpu_s`: on a shared machine, read the wall times against
them), and one JSON line. The
console's environment is this one's without DATABASE_URL, REDIS_URL and FGPU_* (a newcomer's
shell), with FGPU_ADMIN_PASSWORD set. Every process it started is stopped at the end, and DEST is
removed unless --keep. Exits 1 when a target is missed or a page never answers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST_PAGE_TARGET_S = 60.0
RESTART_TARGET_S = 5.0
INSTALL_LINE = "Installing what the console needs to run"
POLL_S = 0.1


def load() -> float:
    return round(os.getloadavg()[0], 2)


def free_port() -> int:
    """A free TCP port whose successor (the session apps' port, PORT + 1) is free too."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port >= 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def newcomer_env(password: str, *, plain_pip: bool = False, uv_dir: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FGPU_") and k not in ("DATABASE_URL", "REDIS_URL")}
    env["FGPU_ADMIN_PASSWORD"] = password
    if plain_pip:
        env = {k: v for k, v in env.items() if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT")}
        env["PIP_CONFIG_FILE"] = os.devnull
    if uv_dir:
        env["PATH"] = f"{uv_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def warm_caches(source: str, where: Path, env: dict[str, str]) -> dict[str, int]:
    """`make install` in a clone of its own under `where` (removed after), with `env`'s caches:
    what a user's caches hold after an earlier install. Returns each cache's size in bytes."""
    clone = where / "warm-clone"
    subprocess.run(["git", "clone", "--quiet", source, str(clone)], check=True)
    try:
        subprocess.run(["make", "install"], cwd=clone, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    finally:
        shutil.rmtree(clone, ignore_errors=True)
    return {name: dir_bytes(Path(env[name])) for name in ("PIP_CACHE_DIR", "UV_CACHE_DIR")}


class Run:
    """One `make run` in `tree`, its output in `log`."""

    def __init__(self, tree: Path, port: int, env: dict[str, str], log: Path) -> None:
        self.log = log
        self.load = load()
        self.started = time.monotonic()
        self.wall = time.time()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                ["make", "run", f"PORT={port}"],
                cwd=tree,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_page(self, url: str, timeout_s: float) -> float:
        """Seconds from the spawn until `url` answers 200. Raises RuntimeError when make exits
        first or `timeout_s` passes (with the output's tail)."""
        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            if answers(url):
                return round(time.monotonic() - self.started, 2)
            if self.proc.poll() is not None:
                raise RuntimeError(f"make run exited with {self.proc.returncode} before {url} answered:\n{self.tail()}")
            time.sleep(POLL_S)
        raise RuntimeError(f"{url} did not answer within {timeout_s} s:\n{self.tail()}")

    def cpu_s(self) -> float:
        """CPU seconds used so far by this run's process group (make, the venv's creation, pip and
        the console: each live process's own and its reaped children's, /proc/<pid>/stat), less the
        background install of JupyterLab (nice 19, left out). What a busy machine stretches far
        less than the wall time: about the wall time an idle one would take, but for pip's waits
        on the network."""
        total = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.proc.pid and int(fields[16]) < 19:  # its process group, not the niced install
                total += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
        return round(total / os.sysconf("SC_CLK_TCK"), 2)

    def end_background(self) -> None:
        """SIGTERM to what is left of this run's process group: `make run`'s background JupyterLab
        install or bytecode compile, which Ctrl-C leaves running (and which wrote into the clone's
        .venv while it was being removed, leaving it behind)."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(POLL_S)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def stop(self) -> None:
        """Ctrl-C, as at a terminal; SIGKILL to the group after 30 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def restart_ab(trees: list[str], rounds: int, env: dict[str, str], timeout_s: float) -> int:
    """Restarts of installed trees, interleaved (see the module's docstring); prints the figures
    and one JSON line. Exits 1 when a start installs anything or a page never answers."""
    figures: dict[str, list[dict]] = {tree: [] for tree in trees}
    logs = Path(tempfile.mkdtemp(prefix="fgpu-restart-ab-"))
    installed_again = False
    for n in range(rounds):
        for i, tree in enumerate(trees):
            port = free_port()
            run = Run(Path(tree), port, env, logs / f"{i}-{n}.log")
            try:
                page_s = run.wait_page(f"http://127.0.0.1:{port}/", timeout_s)
                figures[tree].append({"s": page_s, "cpu_s": run.cpu_s(), "load": run.load})
                installed_again = installed_again or INSTALL_LINE in run.output()
            finally:
                run.stop()
    shutil.rmtree(logs, ignore_errors=True)
    for tree, runs in figures.items():
        each = ", ".join(f"{r['s']} s ({r['cpu_s']} CPU-s, load {r['load']})" for r in runs)
        wall, cpu = statistics.median(r["s"] for r in runs), statistics.median(r["cpu_s"] for r in runs)
        print(f"restart {tree}: median {wall:.2f} s, {cpu:.2f} CPU-s  (each: {each})")
    print(json.dumps({"restart_ab": figures, "installed_again": installed_again}))
    return 1 if installed_again else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default=str(ROOT), help="the repository to clone (default: this checkout)")
    parser.add_argument("--dest", default=None, help="where to clone (default: a new temporary directory)")
    parser.add_argument("--port", type=int, default=0, help="PORT for make run (default: a free one)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each first page")
    parser.add_argument("--jupyter-timeout", type=float, default=300.0, help="seconds to wait for JupyterLab's install")
    parser.add_argument("--keep", action="store_true", help="keep the clone (its .venv and var/)")
    parser.add_argument("--warm", action="store_true", help="warm the pip and uv caches first (an untimed install)")
    parser.add_argument("--plain-pip", action="store_true", help="pip without this machine's configuration: PyPI alone")
    parser.add_argument("--uv", default=None, help="a directory holding uv, put first on PATH")
    parser.add_argument("--restarts", type=int, default=3, help="restarts timed (their median is the figure)")
    parser.add_argument("--restart-ab", nargs=2, metavar=("A", "B"), help="time restarts of two installed trees, interleaved")
    args = parser.parse_args()
    if args.restart_ab:
        return restart_ab(args.restart_ab, args.restarts, newcomer_env("first-run-pass"), args.timeout)

    dest = Path(args.dest) if args.dest else Path(tempfile.mkdtemp(prefix="fgpu-first-run-")) / "clone"
    if dest.exists() and any(dest.iterdir()):
        parser.error(f"--dest {dest} exists and is not empty")
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}/"
    env = newcomer_env("first-run-pass", plain_pip=args.plain_pip, uv_dir=args.uv)
    caches = Path(tempfile.mkdtemp(prefix="fgpu-first-run-caches-"))
    env["PIP_CACHE_DIR"], env["UV_CACHE_DIR"] = str(caches / "pip"), str(caches / "uv")
    result: dict = {"port": port, "source": args.source, "plain_pip": args.plain_pip, "uv": args.uv, "warm": args.warm}
    runs: list[Run] = []
    jupyter_lines: list[str] = []
    try:
        if args.warm:
            result["cache_bytes"] = warm_caches(args.source, caches, env)
        began = time.monotonic()
        subprocess.run(["git", "clone", "--quiet", args.source, str(dest)], check=True)
        result["clone_s"] = round(time.monotonic() - began, 2)
        logs = dest.parent if not args.dest else Path(tempfile.mkdtemp(prefix="fgpu-first-run-logs-"))

        first = Run(dest, port, env, logs / "first.log")
        runs.append(first)
        result["first_page_s"] = first.wait_page(url, args.timeout)
        result["first_load"] = first.load
        result["first_cpu_s"] = first.cpu_s()
        first.stop()
        installer = dest / ".venv" / ".installer"
        result["installer"] = installer.read_text().strip() if installer.exists() else None

        restarts = []
        for n in range(max(1, args.restarts)):
            restart = Run(dest, port, env, logs / f"restart{n}.log")
            runs.append(restart)
            page_s = restart.wait_page(url, args.timeout)
            restarts.append({"s": page_s, "cpu_s": restart.cpu_s(), "load": restart.load})
            result["restart_installed_again"] = result.get("restart_installed_again") or INSTALL_LINE in restart.output()
            restart.stop()
        result["restarts"] = restarts
        result["restart_s"] = statistics.median(r["s"] for r in restarts)
        result["restart_cpu_s"] = statistics.median(r["cpu_s"] for r in restarts)
        result["restart_load"] = restarts[len(restarts) // 2]["load"]

        stamp = dest / ".venv" / ".installed-jupyter"
        deadline = first.started + args.jupyter_timeout
        while not stamp.exists() and time.monotonic() < deadline:
            time.sleep(1)
        result["jupyterlab_installed_s"] = round(stamp.stat().st_mtime - first.wall, 1) if stamp.exists() else None
        jupyter_lines = [line for line in first.output().splitlines() if "JupyterLab" in line]
    finally:
        for run in runs:
            run.stop()
            run.end_background()
        if not args.keep:
            shutil.rmtree(dest.parent if not args.dest else dest, ignore_errors=True)
        shutil.rmtree(caches, ignore_errors=True)

    first_s, restart_s = result["first_page_s"], result["restart_s"]
    again = "yes" if result["restart_installed_again"] else "no"
    if "cache_bytes" in result:
        sizes = ", ".join(f"{name} {size / 1e6:.1f} MB" for name, size in result["cache_bytes"].items())
        print(f"caches warmed:            {sizes}")
    print(f"installer:                {result['installer']}  (plain pip: {'yes' if args.plain_pip else 'no'})")
    print(f"clone:                    {result['clone_s']:.2f} s")
    print(f"first page (fresh clone): {first_s:.2f} s  (target {FIRST_PAGE_TARGET_S:.0f} s; load {result['first_load']})")
    print(
        f"restart (same tree):      {restart_s:.2f} s  (target {RESTART_TARGET_S:.0f} s; load {result['restart_load']}; ", end=""
    )
    each = ", ".join(f"{r['s']} s ({r['cpu_s']} CPU-s, load {r['load']})" for r in result["restarts"])
    print(f"installed again: {again}; each: {each})")
    print(f"CPU seconds by then:      first {result['first_cpu_s']}, restart {result['restart_cpu_s']}")
    print(f"JupyterLab installed:     {result['jupyterlab_installed_s']} s after the first spawn (in the background)")
    for line in jupyter_lines:
        print(f"  make run said: {line}")
    print(json.dumps(result))
    met = (
        result["first_page_s"] <= FIRST_PAGE_TARGET_S
        and result["restart_s"] <= RESTART_TARGET_S
        and not result["restart_installed_again"]
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
