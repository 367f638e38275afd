"""Request parsing: a session's `resources` object → one normalised ResourceRequest.

Accepted keys (DESIGN.md, request styles): `<slot>.shares` (fGPU, text like "0.5"),
`<slot>.device` (whole devices, integer), `cpu` (cores, integer), `mem` (bytes or a binary
size like "1G"). Pure Python; raises InvalidResourceRequest naming the offending key.
"""
from __future__ import annotations

from decimal import Decimal

from accelerators.allocation.core import ZERO, ResourceRequest
from accelerators.allocation.errors import InvalidResourceRequest
from accelerators.allocation.units import SizeError, parse_binary_size, parse_decimal

DEFAULT_CPU = 1
DEFAULT_MEM = 1 << 30  # 1 GiB


def parse_resources(resources: object) -> ResourceRequest:
    """`{"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}` → ResourceRequest(kind="shares", amount=0.5,
    cpu=1, mem=1073741824, slot="cuda"). At most one accelerator key. Raises InvalidResourceRequest."""
    if not isinstance(resources, dict):
        raise InvalidResourceRequest("resources: expected an object such as {\"cuda.shares\": \"0.5\"}")
    cpu = _parse_cpu(resources.get("cpu", DEFAULT_CPU))
    try:
        mem = parse_binary_size(resources.get("mem", DEFAULT_MEM))
    except SizeError as exc:
        raise InvalidResourceRequest(f"resources.mem: {exc}") from None
    accelerator = {k: v for k, v in resources.items() if k not in ("cpu", "mem")}
    if not accelerator:
        return ResourceRequest(kind="none", amount=ZERO, cpu=cpu, mem=mem, slot="")
    for key in sorted(accelerator):
        slot, _, subtype = key.partition(".")
        if not slot or subtype not in ("shares", "device"):
            raise InvalidResourceRequest(
                f"resources.{key}: unknown resource (expected <slot>.shares, <slot>.device, cpu or mem, e.g. cuda.shares)"
            )
    if len(accelerator) > 1:
        raise InvalidResourceRequest(
            f"resources: one accelerator request per session, got {', '.join(sorted(accelerator))}"
        )
    key, value = next(iter(accelerator.items()))
    slot, _, subtype = key.partition(".")
    try:
        amount = parse_decimal(value, what=f"resources.{key}")
    except ValueError as exc:
        raise InvalidResourceRequest(str(exc)) from None
    if subtype == "device" and amount != amount.to_integral_value():
        raise InvalidResourceRequest(f"resources.{key}: a device count must be a whole number, got {value!r}")
    if amount == 0:
        return ResourceRequest(kind="none", amount=ZERO, cpu=cpu, mem=mem, slot="")
    return ResourceRequest(kind=subtype, amount=Decimal(amount), cpu=cpu, mem=mem, slot=slot)


def _parse_cpu(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidResourceRequest(f"resources.cpu: expected a whole number of cores, got {value!r}")
    try:
        cores = int(value)
    except ValueError:
        raise InvalidResourceRequest(f"resources.cpu: expected a whole number of cores, got {value!r}") from None
    if cores < 1:
        raise InvalidResourceRequest(f"resources.cpu: at least 1 core, got {value!r}")
    return cores
