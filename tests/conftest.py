"""Shared fixtures. The suite runs against real PostgreSQL and Redis (`make test` sets
DATABASE_URL and REDIS_URL); in-process tests run Celery tasks eagerly, the end-to-end
tests start real daphne, Celery and agent processes."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import pytest

from accelerators.plugins.base import DeviceInfo

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


@pytest.fixture(autouse=True)
def eager_celery():
    """In-process tests run tasks where they are sent (the e2e tests use real workers)."""
    from console.celery import app

    before = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = before


@pytest.fixture(autouse=True)
def private_cache(request):
    """Each in-process test gets a cache of its own: the login throttle counts failed logins
    per address (all tests log in from 127.0.0.1) in the default cache, which is the shared
    Redis database when REDIS_URL is set, so counts would carry over between tests and runs.
    tests/test_accounts.py checks the throttle against the configured Redis cache as well.
    (override_settings, not pytest-django's `settings`: some tests have a parameter of that name.)"""
    from django.test import override_settings

    with override_settings(CACHES={"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                               "LOCATION": request.node.nodeid}}):
        yield


def wait_until(predicate, *, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value; fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process whose output goes to a log file, shown when a test fails."""

    def __init__(self, name: str, argv: list[str], *, env: dict, log_dir: Path, cwd: Path = ROOT):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, 15)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, 9)
                self.popen.wait()
        self._log.close()


@pytest.fixture
def procs(tmp_path, request):
    """Start processes with `procs.start(name, argv, env)`; stopped (and their logs printed on
    failure) at teardown."""

    class Procs(list):
        def start(self, name, argv, env):
            proc = Proc(name, argv, env=env, log_dir=tmp_path)
            self.append(proc)
            return proc

    started = Procs()
    yield started
    for proc in reversed(started):
        proc.stop()
    report = getattr(request.node, "rep_call", None)
    if report is None or report.failed:
        for proc in started:
            sys.stderr.write(f"\n----- {proc.name} log -----\n{proc.log_path.read_text(errors='replace')[-8000:]}\n")


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def mock_gpu(index: int = 0, *, memory: int = 8 * GiB, sms: int = 80, numa: int | None = 0) -> DeviceInfo:
    uuid = f"GPU-00000000-0000-0000-0000-{index:012d}"
    return DeviceInfo(slot_name="cuda", device_id=uuid, index=index, mother_uuid=uuid[4:], model_name="CUDA GPU",
                      numa_node=numa, subproc_count=sms, memory_size=memory)


@pytest.fixture
def demo_cluster(db):
    """The walkthrough's cluster: node `demo-node`, one 8 GiB / 80-SM GPU, fractional mode with
    unit_mem 4 GiB and unit_proc 40 ("1 physical GPU = 2 fGPU"), quantum 0.25."""
    return make_cluster(nodes={"demo-node": [mock_gpu(0)]})


def make_cluster(*, nodes: dict[str, list[DeviceInfo]], unit_mem: int = 4 * GiB, unit_proc: int = 40,
                 quantum: str = "0.25", mode: str = "fractional", cpu: int = 8, mem: int = 32 * GiB):
    from accelerators.models import FractionalSettings, SlotFormat
    from accelerators.services import node_inventory_apply

    created = {name: node_inventory_apply(node_name=name, devices=devices, plugins=["ai.backend.accelerator.mock"],
                                          attributes={}, cpu_count=cpu, memory_size=mem)
               for name, devices in nodes.items()}
    FractionalSettings.objects.update_or_create(
        slot_name="cuda", defaults={"allocation_mode": mode, "unit_mem": unit_mem, "unit_proc": unit_proc,
                                    "quantum_size": Decimal(quantum)})
    SlotFormat.objects.update_or_create(slot_name="cuda", subtype="shares",
                                        defaults={"display_unit": "fGPU", "human_readable_name": "fGPU",
                                                  "number_round_length": 2})
    return created
