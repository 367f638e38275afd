"""Names NVML gives and the names NVIDIA's tools print for them, shared by the CUDA plugin
(accelerators.plugins.cuda) and its MIG half (accelerators.plugins.cuda_mig). No pynvml here."""

from __future__ import annotations

import math
from fractions import Fraction

_MiB = 1024 * 1024
_GiB = 1024 * 1024 * 1024


def mig_profile_name(*, gpu_slices: int, compute_slices: int, memory_mib: int, parent_memory: int) -> str:
    """The MIG profile name NVIDIA tools print for a MIG device: "1g.10gb", "1c.3g.20gb".

    `memory_mib`: the MIG device's memory (nvmlDeviceGetAttributes.memorySizeMB, MiB);
    `parent_memory`: the whole GPU's memory in bytes. Rule copied from NVIDIA go-nvlib
    (`getMigMemorySizeGB` in pkg/nvlib/device/mig_profile.go): the slice's share of the GPU's
    memory is rounded up to eighths and multiplied by the GPU's memory in whole GiB (rounded
    up), then rounded to the nearest integer. A100 40GB: 4864 MiB of 40 GiB → "1g.5gb";
    H100 80GB: 9984 MiB → "1g.10gb". The "<c>c." prefix appears only when the compute
    instance holds fewer slices than its GPU instance.
    """
    share = Fraction(memory_mib * _MiB, parent_memory)
    eighths = Fraction(math.ceil(share * 8), 8)
    whole_gib = -(-parent_memory // _GiB)
    size = eighths * whole_gib
    gigabytes = math.floor(size + Fraction(1, 2))  # Go's math.Round: halves away from zero
    prefix = f"{compute_slices}c." if compute_slices and compute_slices != gpu_slices else ""
    return f"{prefix}{gpu_slices}g.{gigabytes}gb"


def nvml_text(value: str | bytes) -> str:
    """NVML strings: str from nvidia-ml-py ≥ 11.515, bytes from older pynvml releases."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").rstrip("\x00")
    return str(value)
