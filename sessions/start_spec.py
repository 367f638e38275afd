"""What an agent is sent to start a session (`fgpu.agent.session_start`'s `spec`): built by the
scheduler's pass, the MIG path and the heartbeat's reconcile (a start sent again)."""

from __future__ import annotations

from accelerators.allocation.units import amount_text
from sessions.models import Allocation, ComputeSession, Project


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


def session_start_spec(session: ComputeSession, allocations: list[Allocation], *, projects: list[dict] | None = None) -> dict:
    """What the agent needs to start the session (JSON-safe). Sizes in bytes, procs in SMs.
    `image`: the session image's reference ("" for a session from before images: the docker
    runtime then takes agent.toml's `default-image`); `shell`: the image's interactive shell
    ("": the runtime's). `projects`: the owner's projects (`owner_projects`; None: read now),
    whose persistent folders the session gets as ~/projects/<name>."""
    image = session.image if session.image_id else None
    if projects is None:
        projects = owner_projects([session.owner_id]).get(session.owner_id, [])
    return {
        "session_id": str(session.pk),
        "image": image.reference if image else "",
        "shell": image.shell if image else "",
        "name": session.name,
        "owner": session.owner.get_username(),
        "owner_id": session.owner_id,  # names the owner's persistent folder on the node (agent.files)
        "owner_is_staff": session.owner.is_staff,  # an administrator's session may run unconfined (agent.sandbox)
        "projects": projects,
        "command": session.command,
        "cpu": session.cpu,
        "mem": session.mem,
        "slot_name": session.slot_name,
        "slot_subtype": session.slot_subtype,
        "devices": [
            {
                "device_id": a.device.device_id,
                "index": a.device.index,
                "model_name": a.device.model_name,
                "memory_total": a.device.memory_size,
                "subproc_count": a.device.subproc_count,
                "memory_limit": a.memory,
                "procs": amount_text(a.procs),
                "shares": amount_text(a.shares),
                "is_mig_device": a.device.is_mig_device,
                "mig_profile": a.device.mig_profile,
            }
            for a in sorted(allocations, key=lambda a: a.device.index)
        ],
    }
