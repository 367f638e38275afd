"""What an agent is sent to start a session (`fgpu.agent.session_start`'s `spec`,
protocol.messages.StartSpec): built by the scheduler's pass, the MIG path and the heartbeat's
reconcile (a start sent again). Its MIG block has one builder, `mig_block`."""

from __future__ import annotations

from typing import Any

from protocol.units import amount_text
from accelerators.models import Device, GpuInstance
from protocol.messages import (
    HardwareId,
    MigBlock,
    MigPlacement,
    ProjectRef,
    RowId,
    SessionId,
    SharedFolderRef,
    StartDevice,
    StartSpec,
    UserId,
)
from sessions.models import Allocation, ComputeSession, Project
from sessions.policy.shares import SharedMount, shared_mounts


def owner_projects(owner_ids) -> dict[int, list[dict]]:
    """user id → the projects they are a member of, `[{"id", "name"}]` by name (one query): whose
    persistent folders their sessions get (agent.files)."""
    found: dict[int, list[dict]] = {}
    links = (
        Project.members.through.objects.filter(user_id__in=owner_ids)
        .values_list("user_id", "project_id", "project__name")
        .order_by("project__name")
    )
    for user_id, project_id, name in links:
        found.setdefault(user_id, []).append({"id": str(project_id), "name": name})
    return found


def session_start_spec(
    session: ComputeSession,
    allocations: list[Allocation],
    *,
    projects: list[dict] | None = None,
    shared: list[SharedMount] | None = None,
) -> dict[str, Any]:
    """What the agent needs to start the session: `session_start_message`'s, encoded (JSON-safe)."""
    return session_start_message(session, allocations, projects=projects, shared=shared).encode()


def session_start_message(
    session: ComputeSession,
    allocations: list[Allocation],
    *,
    projects: list[dict] | None = None,
    mig: MigBlock | None = None,
    shared: list[SharedMount] | None = None,
) -> StartSpec:
    """The start spec of `session` on its `allocations` (protocol.messages.StartSpec: sizes in
    bytes, procs in SMs), with MIG block `mig` (`mig_block`) where it gets a GPU instance.
    `image`: the session image's reference ("" for a session from before images: the docker
    runtime then takes agent.toml's `default-image`); `shell`: the image's interactive shell
    ("": the runtime's). `projects`: the owner's projects (`owner_projects`; None: read now),
    whose persistent folders the session gets as ~/projects/<name>; `shared`: the folders shared
    with the owner (sessions.policy.shares.shared_mounts_by_user; None: read now, two queries),
    which it gets at ~/shared/<name>."""
    image = session.image if session.image_id else None
    if projects is None:
        projects = owner_projects([session.owner_id]).get(session.owner_id, [])
    if shared is None:
        shared = shared_mounts(user_id=session.owner_id)
    return StartSpec(
        session_id=SessionId(str(session.pk)),
        image=image.reference if image else "",
        shell=image.shell if image else "",
        name=session.name,
        owner=session.owner.get_username(),
        owner_id=UserId(session.owner_id),  # names the owner's persistent folder on the node (agent.files)
        owner_is_staff=session.owner.is_staff,  # an administrator's session may run unconfined (agent.sandbox)
        projects=tuple(ProjectRef(id=p["id"], name=p["name"]) for p in projects),
        shared=tuple(SharedFolderRef(name=m.name, kind=m.kind, id=m.id, read_only=m.read_only) for m in shared),
        command=session.command,
        cpu=session.cpu,
        mem=session.mem,
        slot_name=session.slot_name,
        slot_subtype=session.slot_subtype,
        devices=tuple(
            StartDevice(
                hardware_id=HardwareId(a.device.device_id),  # the plugin's id, not the row's
                index=a.device.index,
                model_name=a.device.model_name,
                memory_total=a.device.memory_size,
                subproc_count=a.device.subproc_count,
                memory_limit=a.memory,
                procs=amount_text(a.procs),
                shares=amount_text(a.shares),
                is_mig_device=a.device.is_mig_device,
                mig_profile=a.device.mig_profile,
            )
            for a in sorted(allocations, key=lambda a: a.device.index)
        ),
        mig=mig,
    )


def mig_block(*, gpu: Device, instance: GpuInstance, reuse: bool, destroy: list[GpuInstance] | None = None) -> MigBlock:
    """The start spec's MIG block for a session given GPU instance `instance` (a row, created or
    `reuse`d) on MIG GPU `gpu`, once the idle instances `destroy` are gone: with the GPU's whole
    expected layout after that (its instances' rows but those the agent reported unknown: it
    reports them again if still there), for the agent to re-apply after a reboot. One query."""
    return MigBlock(
        gpu=HardwareId(gpu.device_id),
        index=gpu.index,
        model_name=gpu.model_name,
        memory_size=gpu.memory_size,
        subproc_count=gpu.subproc_count,
        profile=instance.profile,
        start=instance.placement_start,
        reuse=reuse,
        instance_id=RowId(str(instance.pk)),
        destroy=tuple(MigPlacement(g.profile, g.placement_start) for g in destroy or []),
        layout=tuple(
            MigPlacement(g.profile, g.placement_start)
            for g in GpuInstance.objects.filter(parent=gpu, unknown_since__isnull=True).order_by("placement_start")
        ),
    )
