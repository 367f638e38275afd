"""The pure allocator's states for the tests (accelerators.allocation.core), built once here:
devices and nodes as the scheduler hands them to `place`. Defaults are the walkthrough's: an
8 GiB, 80-SM GPU (2.0 fGPU at 4 GiB and 40 SMs per fGPU) on NUMA node 0, on a node of 8 CPU
cores and 32 GiB of memory."""
from __future__ import annotations

from decimal import Decimal

from accelerators.allocation.core import DeviceState, NodeState

GiB = 1 << 30
FGPU_MEMORY, FGPU_SMS = 4 * GiB, 40  # one fGPU of the walkthrough's settings (unit_mem, unit_proc)


def gpu(device_id: str, *, memory: int = 8 * GiB, sms: int = 80, memory_used: int = 0, proc_used: str | Decimal = "0",
        sessions: int = 0, numa: int | None = 0, **more) -> DeviceState:
    """A device in base units: `memory` and `memory_used` in bytes, `sms` and `proc_used` in
    SMs, `sessions` holding it; `more`: other DeviceState fields (max_sessions, uuid, index…)."""
    return DeviceState(device_id=device_id, memory_total=memory, proc_total=sms, memory_used=memory_used,
                       proc_used=Decimal(proc_used), sessions=sessions, numa_node=numa, **more)


def gpu_in_fgpu(device: int | str, *, total: Decimal = Decimal(2), free: Decimal | None = None, sessions: int = 0,
                **more) -> DeviceState:
    """A device of `total` fGPU (4 GiB and 40 SMs each) with `free` fGPU of it left (None: all).
    An int `device` i is named "d<i>", with uuid "GPU-000<i>" and index i; a str is its id."""
    used = total - (total if free is None else free)
    names = {"device_id": f"d{device}", "uuid": f"GPU-{device:04d}", "index": device} if isinstance(device, int) \
        else {"device_id": device}
    return gpu(memory=int(total * FGPU_MEMORY), sms=int(total * FGPU_SMS), memory_used=int(used * FGPU_MEMORY),
               proc_used=used * FGPU_SMS, sessions=sessions, **names, **more)


def node(node_id: str, *devices: DeviceState, cpu: int = 8, mem: int = 32 * GiB, cpu_used: int = 0, mem_used: int = 0,
         **more) -> NodeState:
    """A node holding `devices`: `cpu` cores and `mem` bytes, of which `cpu_used` and `mem_used`
    are taken; `more`: other NodeState fields (links, weights)."""
    return NodeState(node_id=node_id, cpu_total=cpu, mem_total=mem, cpu_used=cpu_used, mem_used=mem_used,
                     devices=tuple(devices), **more)
