"""What a pytest-xdist worker of the suite keeps to itself (`pytest -n 2`, `make test XDIST=2`; issue 34.5).

A pytest plugin (pyproject.toml's addopts: `-p tests.xdist_worker`), imported before pytest-django
reads the settings, so that what it changes is what Django, the stacks' processes and every test see.
Outside a worker (PYTEST_XDIST_WORKER unset: a plain run, or xdist's controller) it changes nothing.

Worker `gwN` of a run whose REDIS_URL names database B:

- REDIS_URL names database B + 1 + 2N (the channel layer, Celery's broker, the cache of the tests
  that use Redis), and FGPU_TEST_STACK_REDIS_DB is B + 2 + 2N (every distributed stack of the
  worker, flushed when it starts, in place of the fixed databases 7 … 15 the modules name for a
  serial run). FGPU_TEST_WORKER_REDIS_DBS (comma-separated, two a worker: REDIS_URL's then the
  stacks') chooses them instead, for a run that shares the Redis server with others. Redis has
  databases 0 … 15: B = 0 (make test) leaves room for 3 workers beside the serial numbers' 7 … 15.
- FGPU_CGROUP_TAG gets `_gwN` after the tag it inherits (tests/conftest.py's `test<pid>` of the
  controller, which made it before starting the workers; the last 32 characters, the agent's
  limit), so a worker's no_cgroups_left fixture sees its own agents' cgroups only, never a
  neighbour's running ones.
- PostgreSQL needs nothing here: pytest-django names each worker's test database
  `test_<name>_gwN`, and the stacks' processes take the test database's URL.
"""

from __future__ import annotations

import os

WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")


def worker_redis_dbs(worker: int, base: int, chosen: str) -> tuple[int, int]:
    """(REDIS_URL's database, the stacks' database) of worker `worker` (0, 1, …) from REDIS_URL's
    database `base`, or from `chosen` ("14,14,15,15": two a worker) where given. ValueError when
    `chosen` names too few, or a database is outside Redis' 0 … 15."""
    if chosen:
        dbs = [int(d) for d in chosen.split(",")]
        if len(dbs) < 2 * worker + 2:
            raise ValueError(f"FGPU_TEST_WORKER_REDIS_DBS names {len(dbs)} databases: worker {worker} needs two")
        pair = dbs[2 * worker], dbs[2 * worker + 1]
    else:
        pair = base + 1 + 2 * worker, base + 2 + 2 * worker
    if not all(0 <= db <= 15 for db in pair):
        raise ValueError(f"worker {worker}'s Redis databases {pair} are outside 0 … 15: set FGPU_TEST_WORKER_REDIS_DBS")
    return pair


def _keep_to_this_worker() -> None:
    number = int(WORKER.removeprefix("gw"))
    url = os.environ.get("REDIS_URL")
    if url:
        head, _, db = url.rpartition("/")
        own, stacks = worker_redis_dbs(number, int(db or 0), os.environ.get("FGPU_TEST_WORKER_REDIS_DBS", ""))
        os.environ["REDIS_URL"] = f"{head}/{own}"
        os.environ["FGPU_TEST_STACK_REDIS_DB"] = str(stacks)
    if os.environ.get("FGPU_CGROUP_TAG"):
        os.environ["FGPU_CGROUP_TAG"] = f"{os.environ['FGPU_CGROUP_TAG']}_{WORKER}"[-32:]


if WORKER:
    _keep_to_this_worker()
