"""`fgpu launch` flags → the `resources` object of `POST /api/v1/sessions/` (see the request
styles in the README). Pure functions; UsageError for flags that cannot make a request."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SIZE_RE = re.compile(r"^\s*[0-9]+(\.[0-9]+)?\s*([kmgtpe](i?b)?|b)?\s*$", re.IGNORECASE)


class UsageError(Exception):
    """Bad flags (exit 2, like argparse's own errors)."""


def _decimal(text: str, flag: str) -> Decimal:
    try:
        value = Decimal(str(text).strip())
    except InvalidOperation:
        raise UsageError(f"{flag}: {text!r} is not a number") from None
    if not value.is_finite() or value <= 0:
        raise UsageError(f"{flag}: {text!r} must be a number above 0")
    return value


def _size(text: str, flag: str) -> str:
    """Sizes are sent as typed (binary whatever the spelling: 4G = 4GiB); only the shape is
    checked here, the server reads the value."""
    if not _SIZE_RE.match(str(text)):
        raise UsageError(f"{flag}: {text!r} is not a size (e.g. 4G, 512M, 8GiB)")
    return str(text).strip()


def _text(value: Decimal) -> str:
    return format(value.normalize(), "f")


def build_resources(
    *,
    gpu=None,
    gpu_memory=None,
    gpu_cores=None,
    gpus=None,
    fgpu=None,
    mig_profile=None,
    isolation=None,
    slot: str = "cuda",
    cpu=None,
    mem=None,
) -> dict:
    """One accelerator style per session:

    - `--gpu F` (Run:ai): 0 < F < 1 → `{"gpu_fraction": "F"}` (F of one GPU's memory and SMs);
      a whole number N → `{"gpu": N, "gpu_memory_percentage": 100, "gpu_cores": 100}`: N whole
      GPUs, all their memory and SMs (Run:ai's `--gpu 2`);
    - `--gpu-memory 4G [--gpu-cores 60] [--gpus 2]` (Run:ai / HAMi) → `{"gpu": 2,
      "gpu_memory": "4G", "gpu_cores": 60}` (per device); with `--isolation mig|any|shared` →
      `{"gpu": 1, "gpu_memory": "15G", "isolation": "mig"}`: the smallest MIG instance holding it
      (`mig`), a MIG instance or a shared slice (`any`), a shared slice only (`shared`);
    - `--fgpu 2.5` (Backend.AI) → `{"cuda.shares": "2.5"}`;
    - `--mig-profile 2g.20gb` (Run:ai dynamic MIG) → `{"mig_profile": "2g.20gb"}`;
    - none → a CPU-only session.
    `--cpu` (cores) and `--mem` (host memory) go with any."""
    styles = [
        name
        for name, given in (
            ("--gpu", gpu is not None),
            ("--gpu-memory/--gpu-cores/--gpus", any(v is not None for v in (gpu_memory, gpu_cores, gpus))),
            ("--fgpu", fgpu is not None),
            ("--mig-profile", mig_profile is not None),
        )
        if given
    ]
    if len(styles) > 1:
        raise UsageError(f"one GPU request per session: {' and '.join(styles)} cannot be combined")
    if isolation is not None and gpu_memory is None:
        raise UsageError(f"--isolation {isolation}: goes with --gpu-memory, the memory the slice must hold")
    resources: dict = {}
    if gpu is not None:
        value = _decimal(gpu, "--gpu")
        if value == value.to_integral_value():
            resources = {"gpu": int(value), "gpu_memory_percentage": 100, "gpu_cores": 100}
        elif value < 1:
            resources = {"gpu_fraction": _text(value)}
        else:
            raise UsageError(
                f"--gpu {gpu}: a fraction of one GPU (below 1) or a whole number of GPUs; "
                f"for {_text(value)} fGPU over several devices use --fgpu {_text(value)}"
            )
    elif any(v is not None for v in (gpu_memory, gpu_cores, gpus)):
        count = 1 if gpus is None else gpus
        if count < 1:
            raise UsageError(f"--gpus {gpus}: at least 1")
        resources = {"gpu": count}
        if gpu_memory is not None:
            resources["gpu_memory"] = _size(gpu_memory, "--gpu-memory")
        if isolation is not None:
            resources["isolation"] = isolation
        if gpu_cores is not None:
            if not 0 <= gpu_cores <= 100:
                raise UsageError(f"--gpu-cores {gpu_cores}: a percentage from 0 to 100")
            resources["gpu_cores"] = gpu_cores
    elif fgpu is not None:
        if not re.fullmatch(r"[a-z][a-z0-9_-]*", slot or ""):
            raise UsageError(f"--slot {slot!r}: a slot name such as cuda")
        resources = {f"{slot}.shares": _text(_decimal(fgpu, "--fgpu"))}
    elif mig_profile is not None:
        if not mig_profile.strip():
            raise UsageError("--mig-profile: a MIG profile such as 2g.20gb")
        resources = {"mig_profile": mig_profile.strip()}
    if cpu is not None:
        if cpu < 1:
            raise UsageError(f"--cpu {cpu}: at least 1 core")
        resources["cpu"] = cpu
    if mem is not None:
        resources["mem"] = _size(mem, "--mem")
    return resources


def build_body(
    *,
    name=None,
    command=None,
    priority=None,
    image=None,
    preset=None,
    preemptible=None,
    min_runtime=None,
    preempt_signal=None,
    requeue=None,
    **resource_flags,
) -> dict:
    """The launch body: `resources` from the GPU, CPU and memory flags (`build_resources`), and
    `name`, `command`, `priority`, `image` (a registered session image's reference; none: the
    server's default image), `preemptible` (bool), `min_runtime` (seconds, ≥ 0; UsageError
    otherwise), `preempt_signal` (a signal's name, "USR1" or "SIGUSR1": the server checks it) and
    `requeue` (bool) where given. With `preset` (a resource preset's name or id) the body
    names it and `resources` holds only the flags given, which the server merges into the
    preset's request (a GPU flag replaces its GPU request, `--cpu` / `--mem` its cores and
    memory); no flag: exactly the preset's request."""
    body: dict = {"resources": build_resources(**resource_flags)}
    if preset is not None:
        if not preset.strip():
            raise UsageError("--preset: a preset's name or id (fgpu presets lists them)")
        body["preset"] = preset.strip()
        if not body["resources"]:
            del body["resources"]
    if image is not None:
        if not image.strip() or any(c.isspace() for c in image.strip()):
            raise UsageError(
                f"--image {image!r}: an image reference such as nvcr.io/nvidia/pytorch:24.05-py3 "
                "(fgpu images lists the registered ones)"
            )
        body["image"] = image.strip()
    if name:
        body["name"] = name
    if command:
        body["command"] = command
    if priority is not None:
        body["priority"] = priority
    if preemptible is not None:
        body["preemptible"] = preemptible
    if min_runtime is not None:
        if min_runtime < 0:
            raise UsageError(f"--min-runtime {min_runtime}: seconds, 0 or more")
        body["min_runtime"] = min_runtime
    if preempt_signal is not None:
        if not preempt_signal.strip():
            raise UsageError("--preempt-signal: a signal's name, e.g. USR1 or SIGTERM")
        body["preempt_signal"] = preempt_signal.strip()
    if requeue is not None:
        body["requeue"] = requeue
    return body
