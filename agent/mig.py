"""The agent's MIG manager: makes the GPU instance a session's start spec names, and reconciles.

The manager (scheduler + `accelerators.allocation.mig.plan_instance`) decides the layout; the
agent carries it out. A start spec with a `mig` block (protocol.messages.MigBlock) —

    {"gpu": "GPU-…", "model_name": "H100-80GB", "memory_size": 85899345920, "subproc_count": 132,
     "profile": "1g.20gb", "start": 6, "reuse": false,
     "destroy": [{"profile": "1g.10gb", "start": 6}]}

— gets its idle instances in `destroy` destroyed (compute instance, then GPU instance), then
the instance at `start` created (or, when one of that profile is already there, reused), and
the MIG device's UUID, memory (bytes) and SMs back (`LiveInstance`). The agent then puts that
UUID into CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES and the instance's memory into the
virtual nvidia-smi. When the session ends nothing is destroyed (lazy teardown).

While the agent runs, the manager pushes a changed layout (an administrator's change, or a
heartbeat whose `layout_digest` differed from the expected one) as a typed message
(protocol.mig_messages.MigReconcile): `apply_layout` destroys the idle instances the manager no
longer plans, creates the missing ones and reports strangers (protocol.mig_messages.MigReport).

Backends: `NvmlMigBackend` (real GPUs, through `accelerators.plugins.cuda_mig`) and
`MockMigBackend` (mock nodes: an in-memory layout checked against the built-in catalog, so
the whole flow runs without a GPU). Failures raise `MigError` with the reason in words.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Protocol

import pynvml

from accelerators.allocation import mig as catalog_mod
from accelerators.allocation.errors import AllocationError
from accelerators.plugins import cuda_mig
from accelerators.plugins.cuda_mig import LiveInstance, MigNvmlError
from protocol.messages import HardwareId, MigBlock, MigPlacement, StartDevice, StartSpec
from protocol.mig_messages import Layout, MigFailure, MigGpu, MigInstance, MigReconcile, MigReport, MigSlot

log = logging.getLogger(__name__)


class MigError(RuntimeError):
    """A MIG step failed; `str()` is the reason in words (what the session's ERROR says)."""


class MockMigBackend:
    """MIG on a mock node: the layout of each GPU kept in memory, checked against the built-in
    catalog of its model as NVML would check it. MIG device UUIDs are derived from the GPU, the
    profile and the placement ("MIG-" + a UUID5), so a re-created instance keeps its UUID.
    `attached` holds UUIDs with a process attached: destroying those fails as IN_USE does."""

    def __init__(self) -> None:
        self.layouts: dict[str, dict[int, LiveInstance]] = {}
        self.attached: set[str] = set()
        self._lock = threading.Lock()
        self.catalogs: dict[str, catalog_mod.MigCatalog] = {}

    def catalog(self, gpu: str, *, model_name: str, memory_size: int = 0, subproc_count: int = 0) -> catalog_mod.MigCatalog:
        if gpu not in self.catalogs:
            self.catalogs[gpu] = catalog_mod.catalog_get(model_name, memory_size=memory_size)
        return self.catalogs[gpu]

    def instances(self, gpu: str) -> list[LiveInstance]:
        with self._lock:
            return sorted(self.layouts.get(gpu, {}).values(), key=lambda i: i.start)

    def create(self, gpu: str, profile: catalog_mod.MigProfile, start: int, *, subproc_count: int = 0) -> LiveInstance:
        with self._lock:
            layout = self.layouts.setdefault(gpu, {})
            existing = [catalog_mod.MigInstance(key=str(i.start), profile=i.profile, start=i.start) for i in layout.values()]
            problems = catalog_mod.layout_problems(
                self.catalogs[gpu], [*existing, catalog_mod.MigInstance(key="new", profile=profile.name, start=start)]
            )
            if problems:
                raise MigError(
                    f"the GPU has no room for a {profile.name} instance at memory slice {start} "
                    f"(insufficient resources: {'; '.join(problems)})"
                )
            ids = {i.gpu_instance_id for i in layout.values()}
            instance = LiveInstance(
                gpu=gpu,
                profile=profile.name,
                start=start,
                size=profile.size,
                gpu_instance_id=next(n for n in range(1, 64) if n not in ids),
                uuid=f"MIG-{uuidlib.uuid5(uuidlib.NAMESPACE_URL, f'{gpu}/{profile.name}/{start}')}",
                memory=profile.memory,
                sm_count=profile.sm_count_for(subproc_count),
            )
            layout[start] = instance
            return instance

    def destroy(self, gpu: str, instance: LiveInstance) -> None:
        with self._lock:
            if instance.uuid in self.attached:
                raise MigError(cuda_mig.reason_in_words(pynvml.NVML_ERROR_IN_USE))
            self.layouts.get(gpu, {}).pop(instance.start, None)


class NvmlMigBackend:
    """MIG on real GPUs through NVML (`nvml`: the pynvml module, or a fake). Every method opens
    and closes NVML (reference-counted by NVML itself). Needs root for create and destroy."""

    def __init__(self, nvml: Any = None) -> None:
        self.nvml = nvml if nvml is not None else pynvml
        self.catalogs: dict[str, catalog_mod.MigCatalog] = {}

    @contextmanager
    def _gpu(self, gpu: str) -> Iterator[Any]:
        self.nvml.nvmlInit()
        try:
            yield cuda_mig.call(self.nvml, "nvmlDeviceGetHandleByUUID", gpu)
        finally:
            self.nvml.nvmlShutdown()

    def catalog(self, gpu: str, *, model_name: str, memory_size: int = 0, subproc_count: int = 0) -> catalog_mod.MigCatalog:
        if gpu not in self.catalogs:
            with self._gpu(gpu) as handle:
                self.catalogs[gpu] = cuda_mig.catalog_from_nvml(
                    self.nvml, handle, model=model_name, memory_total=memory_size, sm_count=subproc_count
                )
        return self.catalogs[gpu]

    def instances(self, gpu: str) -> list[LiveInstance]:
        with self._gpu(gpu) as handle:
            return cuda_mig.list_instances(self.nvml, handle, gpu=gpu, catalog=self.catalogs[gpu])

    def create(self, gpu: str, profile: catalog_mod.MigProfile, start: int, *, subproc_count: int = 0) -> LiveInstance:
        with self._gpu(gpu) as handle:
            return cuda_mig.create_instance(self.nvml, handle, gpu=gpu, profile=profile, start=start)

    def destroy(self, gpu: str, instance: LiveInstance) -> None:
        with self._gpu(gpu) as handle:
            cuda_mig.destroy_instance(self.nvml, handle, gpu_instance_id=instance.gpu_instance_id)


class MigBackend(Protocol):
    """What MigManager asks of MIG on the node (MockMigBackend, NvmlMigBackend). GPUs by UUID."""

    def catalog(self, gpu: str, *, model_name: str, memory_size: int = 0, subproc_count: int = 0) -> catalog_mod.MigCatalog: ...

    def instances(self, gpu: str) -> list[LiveInstance]: ...

    def create(self, gpu: str, profile: catalog_mod.MigProfile, start: int, *, subproc_count: int = 0) -> LiveInstance: ...

    def destroy(self, gpu: str, instance: LiveInstance) -> None: ...


Created = Callable[[tuple[str, int]], bool]  # which missing (profile, start) a reconcile creates


class MigManager:
    """Carries out the manager's MIG decisions on one node through `backend`. `timings` keeps
    (step, GPU, profile, seconds) of every create / destroy, for `tests/gpu/mig_real.py`;
    `on_report` gets each report (protocol.mig_messages.MigReport), outside the lock (the agent
    sends it to the manager)."""

    def __init__(self, backend: MigBackend, *, on_report: Callable[[MigReport], None] | None = None) -> None:
        self.backend = backend
        self.timings: list[tuple[str, str, str, float]] = []
        self.reports: list[MigReport] = []  # what reconciling each GPU found (see `reconcile`)
        self.on_report = on_report
        self._reconciled: set[str] = set()
        self.known: dict[HardwareId, MigGpu] = {}  # the MIG GPUs the manager named, for layout_digest
        self._lock = threading.Lock()

    def reconcile_at_start(self, message: MigReconcile) -> MigReport:
        """At agent start (a MigReconcile of kind "start"): `apply_layout` on its GPUs except those a
        start spec already reconciled (a session prepared there first: its spec carried a newer
        layout). Returns the report (also in `reports`, and passed to `on_report`), whose `gpus`
        lists the GPUs whose instances could be listed."""
        with self._lock:
            self._know(message.gpus)
            report = self._apply([gpu for gpu in message.gpus if gpu.gpu not in self._reconciled], message)
        self._report(report)
        return report

    def apply_layout(self, message: MigReconcile) -> MigReport:
        """While the agent runs (an administrator changed the layout, or a heartbeat's digest
        differed): on every GPU of `message`, destroy the instances in its `destroy` (idle ones
        the manager no longer plans; one the layout expects is kept, one with a process attached
        fails IN_USE and stays, reported in `errors`), then `reconcile` against its `expected`
        (missing ones created, strangers reported). Returns the report — `reconcile`'s with
        `destroyed` (the `destroy` items no longer on the GPU), and the message's `kind` and
        `seq` — also in `reports` and passed to `on_report`."""
        with self._lock:
            self._know(message.gpus)
            report = self._apply(list(message.gpus), message)
        self._report(report)
        return report

    def _know(self, gpus: Iterable[MigGpu]) -> None:
        for gpu in gpus:
            self.known[gpu.gpu] = gpu

    def _apply(self, gpus: list[MigGpu], message: MigReconcile) -> MigReport:
        destroyed: list[MigSlot] = []
        errors: list[MigFailure] = []
        for gpu in gpus:
            destroyed.extend(
                self._destroy_listed(gpu, message.expected.get(gpu.gpu, ()), message.destroy.get(gpu.gpu, ()), errors)
            )
        found = self.reconcile(gpus, message.expected)
        report = replace(found, errors=(*errors, *found.errors), destroyed=tuple(destroyed), kind=message.kind, seq=message.seq)
        self._reconciled.update(report.gpus)
        self.reports.append(report)
        return report

    def _destroy_listed(
        self, gpu: MigGpu, expected: Iterable[MigPlacement], doomed: Iterable[MigPlacement], errors: list[MigFailure]
    ) -> list[MigSlot]:
        """Destroy the instances of `doomed` on GPU `gpu` that `expected` does not list; failures
        go to `errors`. Returns the `doomed` items no longer on the GPU."""
        keep = {(item.profile, item.start) for item in expected}
        doomed_at = [(item.profile, item.start) for item in doomed]
        if not doomed_at:
            return []
        try:
            self.catalog(gpu)
            live = {(i.profile, i.start): i for i in self._instances(gpu.gpu)}
        except MigError:
            return []  # `reconcile` reports why the GPU cannot be listed
        gone = []
        for profile, start in doomed_at:
            if (profile, start) in keep:
                continue
            if (profile, start) in live:
                try:
                    self._destroy(gpu.gpu, live[(profile, start)])
                except MigError as exc:
                    errors.append(MigFailure(gpu=gpu.gpu, profile=profile, start=start, reason=str(exc)))
                    continue
            gone.append(MigSlot(gpu=gpu.gpu, profile=profile, start=start))
        return gone

    def layout_digest(self) -> str | None:
        """The digest (`accelerators.allocation.mig.layout_digest`) of every GPU instance on the
        MIG GPUs the manager named (`known`), for the heartbeat; a GPU that cannot be listed adds
        a marker no expected layout has. None when no MIG GPU is known yet, or while a MIG step
        holds the lock (the layout is changing: the next heartbeat tells)."""
        if not self.known or not self._lock.acquire(blocking=False):
            return None
        try:
            found: list[tuple[str, str, int]] = []
            for uuid, gpu in sorted(self.known.items()):
                try:
                    self.catalog(gpu)
                    found.extend((uuid, i.profile, i.start) for i in self._instances(uuid))
                except MigError:
                    found.append((uuid, "?", -1))
        finally:
            self._lock.release()
        return catalog_mod.layout_digest(self.known, found)

    def _report(self, report: MigReport) -> None:
        if report.gpus:
            log.info(
                "reconciled MIG GPU(s) %s: %d instance(s) re-created, %d destroyed, %d unknown, %d error(s)",
                ", ".join(report.gpus),
                len(report.recreated),
                len(report.destroyed),
                len(report.unknown),
                len(report.errors),
            )
        for item in report.unknown:
            log.warning(
                "MIG instance %s@%s (%s) on GPU %s is not the manager's; left in place",
                item.profile,
                item.start,
                item.uuid,
                item.gpu,
            )
        for failure in report.errors:
            log.warning(
                "could not apply MIG instance %s@%s on GPU %s: %s", failure.profile, failure.start, failure.gpu, failure.reason
            )
        if self.on_report is not None:
            try:
                self.on_report(report)
            except Exception:
                log.exception("could not send a MIG reconcile report to the manager")

    def catalog(self, gpu: MigGpu) -> catalog_mod.MigCatalog:
        """The MIG profiles of `gpu` (read once, then kept). Raises MigError."""
        try:
            return self.backend.catalog(
                gpu.gpu, model_name=gpu.model_name, memory_size=gpu.memory_size, subproc_count=gpu.subproc_count
            )
        except (MigNvmlError, AllocationError) as exc:
            raise MigError(f"cannot read the MIG profiles of GPU {gpu.gpu}: {exc}") from exc

    def prepare(self, block: MigBlock) -> LiveInstance:
        """Destroy the idle instances the start spec's MIG block lists, then create (or reuse) its
        instance. Returns it with its MIG device UUID. Raises MigError with the reason in words; an
        instance created here that cannot be completed is destroyed again (nothing leaks).
        The first prepare on a GPU the agent did not reconcile at start reconciles it here.
        `on_report` gets what reconciling found, then a report with `prepared` (that instance)
        so that the manager learns the MIG device UUID."""
        reports: list[MigReport] = []
        try:
            with self._lock:
                instance = self._prepare(block, reports)
            reports.append(
                MigReport(
                    prepared=(MigInstance(gpu=block.gpu, profile=instance.profile, start=instance.start, uuid=instance.uuid),)
                )
            )
            return instance
        finally:
            for report in reports:
                self._report(report)

    def _prepare(self, block: MigBlock, reports: list[MigReport]) -> LiveInstance:
        gpu, start = block.gpu, block.start
        catalog = self.catalog(block.mig_gpu)
        try:
            profile = catalog.profile(block.profile)
        except AllocationError as exc:
            raise MigError(str(exc)) from exc
        if gpu not in self._reconciled:
            reports.append(self._reconcile_first_use(block, profile, start))
        live = {i.start: i for i in self._instances(gpu)}
        for gone in block.destroy:
            instance = live.get(gone.start)
            if instance is not None and instance.profile == gone.profile:
                self._destroy(gpu, instance)
                live.pop(instance.start)
        existing = live.get(start)
        if existing is not None and existing.profile == profile.name and existing.uuid:
            return existing
        if existing is not None:
            raise MigError(
                f"memory slice {start} of GPU {gpu} holds a {existing.profile} instance, "
                f"not the {profile.name} the manager expects; the node's layout needs reconciling"
            )
        return self._create(gpu, profile, start, subproc_count=block.subproc_count)

    def _reconcile_first_use(self, block: MigBlock, profile: catalog_mod.MigProfile, start: int) -> MigReport:
        """The first time this agent touches a GPU it did not reconcile at start: report
        instances the manager does not know and re-create the other instances of the manager's
        expected layout (`block.layout`), leaving out the one being prepared and those about
        to be destroyed. Returns the report (also kept in `reports`)."""
        gone = {(d.profile, d.start) for d in block.destroy}
        expected = [e for e in block.layout if (e.profile, e.start) not in gone and e.start != start]
        self._reconciled.add(block.gpu)
        # Those about to be destroyed are the manager's too: not reported unknown, not re-created.
        known = (*expected, *(MigPlacement(p, s) for p, s in gone), MigPlacement(profile.name, start))
        report = self.reconcile(
            [block.mig_gpu],
            {block.gpu: known},
            create=lambda item: item[1] != start and item not in gone,
        )
        self.reports.append(report)
        return report

    def destroy(self, gpu: MigGpu, placement: MigPlacement) -> bool:
        """Destroy the instance of `placement` on `gpu` (compute instance, then GPU instance).
        False when there is none. Raises MigError (IN_USE while a process is attached: the
        instance stays)."""
        with self._lock:
            self.catalog(gpu)
            for instance in self._instances(gpu.gpu):
                if instance.start == placement.start and instance.profile == placement.profile:
                    self._destroy(gpu.gpu, instance)
                    return True
            return False

    def reconcile(self, gpus: Iterable[MigGpu], expected: Layout, *, create: Created | None = None) -> MigReport:
        """Compare each MIG GPU of `gpus` with the manager's `expected` layout (GPU →
        placements): instances the manager does not know are reported `unknown` (left in place:
        they may hold someone's work), expected ones that are missing (instances do not survive
        a reboot) are created again (`recreated`). The report's `gpus` are the GPUs whose
        instances could be listed; `errors` what failed. `create((profile, start))` may say which
        missing ones to create (all by default). Not locked: callers hold the lock (`prepare`,
        `reconcile_at_start`) or own the manager."""
        listed: list[HardwareId] = []
        unknown: list[MigInstance] = []
        recreated: list[MigInstance] = []
        errors: list[MigFailure] = []
        for gpu in gpus:
            uuid = gpu.gpu
            try:
                catalog = self.catalog(gpu)
                live = {(i.profile, i.start): i for i in self._instances(uuid)}
            except MigError as exc:
                errors.append(MigFailure(gpu=uuid, reason=str(exc)))
                continue
            listed.append(uuid)
            wanted = {(item.profile, item.start) for item in expected.get(uuid, ())}
            for (profile, start), instance in sorted(live.items(), key=lambda kv: kv[0][1]):
                if (profile, start) not in wanted:
                    unknown.append(MigInstance(gpu=uuid, profile=profile, start=start, uuid=instance.uuid))
            for profile_name, start in sorted(wanted - set(live), key=lambda ps: ps[1]):
                if create is not None and not create((profile_name, start)):
                    continue
                try:
                    created = self._create(uuid, catalog.profile(profile_name), start, subproc_count=gpu.subproc_count)
                except (MigError, AllocationError) as exc:
                    errors.append(MigFailure(gpu=uuid, profile=profile_name, start=start, reason=str(exc)))
                    continue
                recreated.append(MigInstance(gpu=uuid, profile=profile_name, start=start, uuid=created.uuid))
        return MigReport(gpus=tuple(listed), unknown=tuple(unknown), recreated=tuple(recreated), errors=tuple(errors))

    def _instances(self, gpu: str) -> list[LiveInstance]:
        try:
            return self.backend.instances(gpu)
        except MigNvmlError as exc:
            raise MigError(f"cannot list the MIG instances of GPU {gpu}: {exc.reason}") from exc

    def _create(self, gpu: str, profile: catalog_mod.MigProfile, start: int, *, subproc_count: int) -> LiveInstance:
        began = time.perf_counter()
        try:
            instance = self.backend.create(gpu, profile, start, subproc_count=subproc_count)
        except MigNvmlError as exc:
            raise MigError(
                f"could not create a {profile.name} MIG instance at memory slice {start} of GPU {gpu}: {exc.reason}"
            ) from exc
        self.timings.append(("create", gpu, profile.name, time.perf_counter() - began))
        if not instance.uuid:
            self._destroy(gpu, instance)
            raise MigError(f"the {profile.name} MIG instance on GPU {gpu} has no MIG device; it was destroyed again")
        return instance

    def _destroy(self, gpu: str, instance: LiveInstance) -> None:
        began = time.perf_counter()
        try:
            self.backend.destroy(gpu, instance)
        except MigNvmlError as exc:
            raise MigError(
                f"could not destroy the idle {instance.profile} MIG instance at memory slice "
                f"{instance.start} of GPU {gpu}: {exc.reason}"
            ) from exc
        self.timings.append(("destroy", gpu, instance.profile, time.perf_counter() - began))


def device_entry(device: StartDevice, instance: LiveInstance) -> StartDevice:
    """A start spec's device turned into the MIG device the session gets: its UUID as hardware id,
    its memory as both total and limit (bytes), its SMs, all of them granted."""
    return replace(
        device,
        hardware_id=HardwareId(instance.uuid),
        memory_total=instance.memory,
        memory_limit=instance.memory,
        subproc_count=instance.sm_count,
        procs=str(instance.sm_count),
        shares="1",
        is_mig_device=True,
        mig_profile=instance.profile,
    )


def prepare_spec(manager: MigManager, spec: StartSpec) -> StartSpec:
    """The start spec with its `mig` block carried out: the block's GPU's device (or a new one)
    replaced by the MIG device, first. Specs without a `mig` block come back unchanged (the same
    object). Raises MigError."""
    block = spec.mig
    if block is None:
        return spec
    instance = manager.prepare(block)
    devices = [d for d in spec.devices if d.hardware_id != block.gpu]
    base = next((d for d in spec.devices if d.hardware_id == block.gpu), None) or StartDevice(
        hardware_id=block.gpu,
        index=block.index,
        model_name=block.model_name,
        memory_total=0,
        subproc_count=0,
        memory_limit=0,
        procs="0",
        shares="0",
    )
    return replace(spec, devices=(device_entry(base, instance), *devices))
