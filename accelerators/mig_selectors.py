"""Reads for MIG that the fGPU paths need: which devices MIG keeps to itself (issue 4)."""
from __future__ import annotations

from django.db.models import Q

from accelerators.models import Device, MigMode


def mig_exclusion() -> Q:
    """A Q over Device naming the whole GPUs that fGPU shares, whole-device and per-device
    requests must not use, because one physical GPU is never MIG and fGPU at once: every GPU
    of a node in dynamic or fixed-layout MIG mode, and every GPU with MIG slices in the
    inventory (a GPU in MIG mode runs no work outside its instances; NVIDIA MIG User Guide)."""
    with_slices = Device.objects.filter(is_mig_device=True).values("mother_uuid")
    return Q(is_mig_device=False) & (Q(node__mig_mode__in=[MigMode.DYNAMIC, MigMode.FIXED])
                                     | Q(mother_uuid__in=with_slices))
