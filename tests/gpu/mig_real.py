"""Create and destroy real MIG instances through the agent's own MIG code, and print how long
each step took. Needs root and a MIG-capable GPU (A100, H100, H200, B200) with MIG mode on
(`nvidia-smi -i 0 -mig 1`, which may need a GPU reset on A100). Not collected by pytest.

    sudo .venv/bin/python -m tests.gpu.mig_real [--gpu 0] [--profiles 1g.10gb,3g.40gb] [--repeat 3]

For each profile (default: every profile of the GPU without media extensions, smallest
first), the dynamic-MIG planner (`accelerators.allocation.mig.plan_instance`) picks a
placement on the GPU as it is now (instances already there count as in use and are left
alone), `agent.mig.MigManager.prepare` creates the GPU and compute instance through
pynvml (`NvmlMigBackend`), the MIG device UUID is printed, and `MigManager.destroy` removes
it again. Prints one line per step and a summary (median create / destroy seconds).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import django


def main(argv: list[str] | None = None, *, nvml=None, euid: int | None = None) -> int:
    """`nvml`: the pynvml module (default) or the test's fake; `euid`: the effective user id
    (default: the process's)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU")
    parser.add_argument("--profiles", default="", help="comma-separated profile names (default: all)")
    parser.add_argument("--repeat", type=int, default=3, help="create/destroy rounds per profile")
    args = parser.parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    django.setup()
    import pynvml as real_pynvml

    pynvml = nvml if nvml is not None else real_pynvml

    from accelerators.allocation import mig
    from accelerators.plugins import cuda_mig
    from accelerators.plugins.cuda import _text
    from agent.mig import MigError, MigManager, NvmlMigBackend
    from protocol.messages import MigBlock, MigPlacement
    from protocol.mig_messages import MigGpu

    if (os.geteuid() if euid is None else euid) != 0:
        print("needs root (NVML refuses MIG changes otherwise: NO_PERMISSION)", file=sys.stderr)
        return 2
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(args.gpu)
        gpu = _text(pynvml.nvmlDeviceGetUUID(handle))
        name = _text(pynvml.nvmlDeviceGetName(handle))
        memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        try:
            cuda_mig.mig_enabled(pynvml, handle)
        except cuda_mig.MigNvmlError as exc:
            print(f"GPU {args.gpu} ({name}): {exc.reason}", file=sys.stderr)
            return 2
    finally:
        pynvml.nvmlShutdown()

    manager = MigManager(NvmlMigBackend(pynvml))
    block = {"gpu": gpu, "model_name": name, "memory_size": memory, "subproc_count": 0}
    catalog = manager.catalog(MigGpu.decode(block))
    print(f"GPU {args.gpu}: {name} {gpu}, driver {driver}, {mig.format_binary_size(memory)}")
    print("profiles (NVML):", ", ".join(f"{p.name} [{p.size} slices @ {list(p.starts)}]" for p in catalog.profiles))
    wanted = [p for p in catalog.profiles if not p.media_extensions]
    if args.profiles:
        wanted = [catalog.profile(n) for n in args.profiles.split(",")]
    existing = [mig.MigInstance(key=i.uuid or str(i.gpu_instance_id), profile=i.profile, start=i.start, in_use=True)
                for i in manager.backend.instances(gpu)]
    if existing:
        print("left alone (already there):", ", ".join(f"{i.profile}@{i.start}" for i in existing))
    creates: dict[str, list[float]] = {}
    destroys: dict[str, list[float]] = {}
    for profile in wanted:
        for round_ in range(args.repeat):
            try:
                plan = mig.plan_instance(catalog, existing, mig.MigRequest(profile=profile.name))
            except mig.InsufficientResource as exc:
                print(f"{profile.name}: skipped ({exc})")
                break
            step = {**block, "profile": profile.name, "start": plan.start}
            try:
                made = manager.prepare(MigBlock.decode(step))  # as a start spec's MIG block
                created = manager.timings[-1][3]
                manager.destroy(MigGpu.decode(step), MigPlacement.decode(step))
                destroyed = manager.timings[-1][3]
            except MigError as exc:
                print(f"{profile.name}@{plan.start}: FAILED: {exc}")
                return 1
            creates.setdefault(profile.name, []).append(created)
            destroys.setdefault(profile.name, []).append(destroyed)
            print(f"{profile.name}@{plan.start} round {round_ + 1}: {made.uuid} "
                  f"{mig.format_binary_size(made.memory)} {made.sm_count} SMs: "
                  f"create {created:.3f} s, destroy {destroyed:.3f} s")
    print("\nprofile      create median  destroy median  (s, over rounds)")
    for name_, times in creates.items():
        print(f"{name_:<12} {statistics.median(times):>13.3f}  {statistics.median(destroys[name_]):>14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
