"""Clusters and sessions for tests and benchmarks, written through the services a real cluster
writes them with: nodes and devices by `node_inventory_apply` (what an agent's registration
does), sessions by `session_create` and placed by one `schedule_pending` pass, ended by
`session_report_apply`.

No pytest here: benchmarks/api.py uses it as well, after `django.setup()`.
"""
from __future__ import annotations

from decimal import Decimal

from django.contrib.auth.hashers import PBKDF2PasswordHasher

from accelerators.plugins.base import DeviceInfo

GiB = 1 << 30

# One request of each style a session may use (DESIGN.md), each reading a different part of a
# session when it is shown: the slot format (fGPU amounts), the per-device description, the MIG
# grant (a GPU instance), "isolation any" (MIG first, else a shared slice), and no GPU at all.
SESSION_STYLES = (
    {"cuda.shares": "0.5"},
    {"gpu": 1, "gpu_memory": "2G", "gpu_cores": 25},
    {"gpu_fraction": "0.25"},
    {"mig_profile": "1g.10gb"},
    {"gpu_memory": "8G", "isolation": "any"},
    {"cpu": 1},
)


def mock_gpu(index: int = 0, *, memory: int = 8 * GiB, sms: int = 80, numa: int | None = 0, node: int = 0,
             model: str = "CUDA GPU") -> DeviceInfo:
    """A GPU as an agent's inventory lists it: GPU `index` of node number `node` (its UUID is
    unique over both), `memory` bytes, `sms` SMs."""
    uuid = f"GPU-{node:08d}-0000-0000-0000-{index:012d}"
    return DeviceInfo(slot_name="cuda", device_id=uuid, index=index, mother_uuid=uuid[4:], model_name=model,
                      numa_node=numa, subproc_count=sms, memory_size=memory)


def make_cluster(*, nodes: dict[str, list[DeviceInfo]], unit_mem: int = 4 * GiB, unit_proc: int = 40,
                 quantum: str = "0.25", mode: str = "fractional", cpu: int = 8, mem: int = 32 * GiB):
    """Register `nodes` ({name: devices}) as their agents would, each with `cpu` cores and `mem`
    bytes, and set slot "cuda" to `mode` with `unit_mem` bytes and `unit_proc` SMs per fGPU (the
    defaults: an 8 GiB / 80-SM GPU is 2 fGPU), quantum `quantum`, amounts shown as "0.50 fGPU".
    Returns {name: Node}."""
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


def gpu_cluster(*, nodes: int, gpus: int = 8, mig_gpus: int = 0, prefix: str = "gpu-node") -> None:
    """`nodes` nodes named `<prefix>-<n>` of `gpus` 8 GiB / 80-SM GPUs each (2 fGPU a GPU, as
    `make_cluster`), and with `mig_gpus` the node "mig-node" of that many H100 80GB GPUs in
    dynamic MIG mode (seven 1g.10gb instances a GPU). Every node has room for hundreds of
    sessions' CPU and memory (256 cores, 1 TiB)."""
    from accelerators.models import MigMode, Node

    room = {"cpu": 256, "mem": 1024 * GiB}
    make_cluster(nodes={f"{prefix}-{n}": [mock_gpu(i, node=n) for i in range(gpus)] for n in range(nodes)}, **room)
    if mig_gpus:
        h100s = [mock_gpu(i, node=nodes, memory=80 * GiB, sms=132, model="H100-80GB") for i in range(mig_gpus)]
        make_cluster(nodes={"mig-node": h100s}, **room)
        Node.objects.filter(name="mig-node").update(mig_mode=MigMode.DYNAMIC)


def sessions_in_every_style(*, owner, count: int) -> list:
    """`count` sessions of `owner` named s0, s1, …, taking SESSION_STYLES in turn, placed by one
    scheduler pass; then every tenth (s9, s19, …) ended (TERMINATED: its allocations released,
    a MIG instance left idle), and a tenth more launched after the pass, left PENDING. Needs a
    cluster with room for them (`gpu_cluster` with MIG GPUs for the MIG styles: about 0.06 H100
    and 0.2 fGPU per session). Returns the sessions, oldest first."""
    from django.db import transaction

    from sessions.models import ComputeSession
    from sessions.scheduling.scheduler import schedule_pending
    from sessions.lifecycle.services import session_report_apply
    from sessions.admission.launch import session_create

    def launch(i: int):
        return session_create(owner=owner, name=f"s{i}", resources={**SESSION_STYLES[i % len(SESSION_STYLES)],
                                                                     "mem": "64M"})

    placed = count - count // 10
    with transaction.atomic():  # one commit: its after-commit work (passes, notices) runs once, at the end
        sessions = [launch(i) for i in range(placed)]
        schedule_pending()
        for session in sessions[9::10]:
            session_report_apply(session_id=str(session.pk), status="TERMINATED", reason="done", exit_code=0)
        sessions += [launch(i) for i in range(placed, count)]
    return list(ComputeSession.objects.filter(pk__in=[s.pk for s in sessions]).order_by("created_at"))


class OneRoundPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    """Django's PBKDF2-SHA256 at one iteration, for the tests' own process (one_round_password_hashing)."""

    iterations = 1


def one_round_password_hashing() -> None:
    """Make this process hash passwords with OneRoundPBKDF2PasswordHasher (tests only). Django's
    default, PBKDF2-SHA256 at 1,000,000 iterations, cost 0.55 s of CPU a hash on the 2-core machine
    (10 s of a test's wall time at a load of 30): every user a test makes with a password, every
    sign-in it checks in-process. The algorithm's name and format are Django's own, so the processes
    a test starts (uvicorn, standalone) verify these hashes with their own settings. Hashing is not
    under test (tests/test_accounts.py's throttle tests use MD5 for the same reason)."""
    from django.conf import settings
    from django.contrib.auth import hashers

    pbkdf2 = "django.contrib.auth.hashers.PBKDF2PasswordHasher"
    settings.PASSWORD_HASHERS = ["tests.seed.OneRoundPBKDF2PasswordHasher",
                                 *(h for h in settings.PASSWORD_HASHERS if h != pbkdf2)]
    hashers.get_hashers.cache_clear()
    hashers.get_hashers_by_algorithm.cache_clear()
