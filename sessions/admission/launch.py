"""What the launch dialog may offer now: per slot the quantum and the largest placeable amount,
the MIG profiles in reach; and what a request would get now (the preview)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.db import transaction

from accelerators.allocation import core
from accelerators.allocation.requests import request_to_spec
from accelerators.models import AllocationMode, Device
from accelerators.selectors import fractional_settings_get, node_states, resource_group_get, slot_format_get
from protocol.units import format_binary_size
from sessions.scheduling import mig as mig_scheduling
from sessions.admission.names import name_taken_refused
from sessions.policy.data_folders import folders_note_named
from sessions.policy.images import image_for_launch
from sessions.policy.quotas import claim_max_amount, quota_headroom
from common.errors import ApplicationError
from sessions.lifecycle import events
from sessions.lifecycle.passes import schedule_pending_soon
from sessions.models import ComputeSession
from sessions.selectors import request_configuration
from sessions.scheduling.backfill import PreviewView
from sessions.scheduling.placement import CAPACITY, NEVER, PLACED, WAITING, placement_decide, request_validate
from protocol.environment import sm_percent
from protocol.units import fgpu_text as shares_text


MIG_SLOT_NAME = "cuda"  # the slot whose GPUs MIG splits (sessions.scheduling.mig places on it)
ISOLATIONS = ("shared", "mig", "any")  # a memory-sized request's isolation (accelerators.allocation.requests)


def launch_options(*, user=None, resource_group: str = "") -> dict:
    """`{"slots": [...], "mig": {...}, "cpu": {"max_now", "max_ever"}, "mem": {...}}`: for each
    slot with registered devices, min/step = the quantum, `max_now` = the largest amount one
    session could be given right now (a request may span one node's devices), `max_ever` = the
    same on empty nodes; with `user`, `max_now` is also capped by their quota headroom:
    `quota_max` is the largest amount their quotas allow now (null: unlimited), from the launch's
    claim rule (`sessions.policy.quotas.claim_max_amount`), `quota_limit` the limit that sets it
    ("fgpu", "devices", "gpu_memory", "sessions"; "" when none does), and `free_now` the amount
    free now without quotas. Amounts as text; memory in bytes. `resource_group` ("" for any
    node) limits it all to that group's nodes.

    `mig` (see `mig_launch_options`): the MIG profiles of slot `mig.slot_name` one may ask for
    and how many could be placed now and ever, and the isolations a memory-sized request may
    ask for. Raises InvalidResourceRequest for an unknown resource group."""
    slots: list[dict] = []
    all_nodes: list[core.NodeState] = []
    group = resource_group_get(name=resource_group)
    headroom = quota_headroom(user=user) if user is not None else {}
    for slot_name in sorted(set(Device.objects.filter(is_mig_device=False).values_list("slot_name", flat=True))):
        every = node_states(slot_name=slot_name, group=group)
        all_nodes = all_nodes or every
        nodes = [n for n in every if n.cpu_total - n.cpu_used >= 1]  # a session needs at least one core
        settings = fractional_settings_get(slot_name=slot_name)
        subtype: core.RequestKind
        if settings.allocation_mode == AllocationMode.FRACTIONAL:
            pure = settings.as_allocation_settings()
            subtype, quantum = "shares", Decimal(settings.quantum_size).normalize()
            max_now, max_ever = core.max_shares(nodes, pure), core.max_shares(core.emptied(every), pure)
        else:
            subtype, quantum = "device", Decimal(1)
            max_now, max_ever = Decimal(core.max_devices(nodes)), Decimal(core.max_devices(core.emptied(every)))
        # The quotas' cap, from the launch's own claim rule (sessions.policy.quotas.claim_max_amount).
        quota_max, quota_limit = claim_max_amount(
            request=core.ResourceRequest(kind=subtype, amount=quantum, slot=slot_name),
            headroom=headroom,
            unit_mem={slot_name: settings.unit_mem if settings.pk else None},
        )
        if quota_max is not None:
            quota_max = core.truncate(quota_max, quantum)
        free_now = max_now
        if quota_max is not None:  # the dialog never offers more than the user's quotas allow now
            max_now = min(max_now, quota_max)
        fmt = slot_format_get(slot_name=slot_name, subtype=subtype)
        slots.append(
            {
                "slot": f"{slot_name}.{subtype}",
                "slot_name": slot_name,
                "subtype": subtype,
                "allocation_mode": settings.allocation_mode,
                "display_unit": fmt.display_unit,
                "display_icon": fmt.display_icon,
                "human_readable_name": fmt.human_readable_name,
                "binary": fmt.number_binary,
                "round_length": fmt.number_round_length,
                "quantum": str(quantum),
                "min": str(quantum),
                "step": str(quantum),
                "max_now": _amount_text(subtype, max_now),
                "max_ever": _amount_text(subtype, max_ever),
                "free_now": _amount_text(subtype, free_now),
                "quota_limit": quota_limit,
                "quota_max": None if quota_max is None else _amount_text(subtype, quota_max),
                "unit_mem": settings.unit_mem,
                "unit_proc": settings.unit_proc,
            }
        )
    if not all_nodes:
        all_nodes = node_states(slot_name="cuda", group=group)
    return {
        "slots": slots,
        "mig": mig_launch_options(resource_group=resource_group, sessions_left=_sessions_left(headroom)),
        "cpu": {
            "max_now": max((n.cpu_total - n.cpu_used for n in all_nodes), default=0),
            "max_ever": max((n.cpu_total for n in all_nodes), default=0),
        },
        "mem": {
            "max_now": max((n.mem_total - n.mem_used for n in all_nodes), default=0),
            "max_ever": max((n.mem_total for n in all_nodes), default=0),
        },
    }


def _sessions_left(headroom: dict) -> int | None:
    """`quota_headroom`'s "sessions" figure (a count; None: no quota limits it)."""
    left = headroom.get("sessions")
    return None if left is None else int(left)


def _amount_text(subtype: str, amount: Decimal) -> str:
    """A slot's amount as the dialog reads it: fGPU as `shares_text` ("0.50"), devices as "2"."""
    return shares_text(str(amount)) if subtype == "shares" else str(amount)


def mig_launch_options(*, resource_group: str = "", sessions_left: int | None = None) -> dict:
    """`{"slot_name": "cuda", "profiles": [{"name", "memory" (bytes), "memory_text" ("19.62 GiB"),
    "sm_count" (SMs, 0: unknown), "compute_slices" (of 7, 0: unknown), "memory_slices" (of 8),
    "models", "max_now", "idle_now", "max_ever"}], "isolation": ["shared", "mig", "any"]}`:
    the profiles of `sessions.scheduling.mig.mig_profile_availability` (alive nodes in static,
    dynamic or fixed-layout MIG mode), smallest first, `max_now` capped by `sessions_left` (the
    caller's quota of concurrent sessions). `profiles` and `isolation` are empty when no such
    node is in reach: then only shared slices can be had."""
    profiles = []
    for offer in mig_scheduling.mig_profile_availability(resource_group=resource_group, slot_name=MIG_SLOT_NAME):
        max_now = offer.max_now if sessions_left is None else min(offer.max_now, sessions_left)
        profiles.append(
            {
                "name": offer.name,
                "memory": offer.memory,
                "memory_text": format_binary_size(offer.memory),
                "sm_count": offer.sm_count,
                "compute_slices": offer.compute_slices,
                "memory_slices": offer.memory_slices,
                "models": list(offer.models),
                "max_now": max_now,
                "idle_now": min(offer.idle_now, max_now),
                "max_ever": offer.max_ever,
            }
        )
    return {"slot_name": MIG_SLOT_NAME, "profiles": profiles, "isolation": list(ISOLATIONS) if profiles else []}


def launch_preview(*, resources: dict, image: str | None = None, owner=None) -> dict:
    """What launching this request would do now, without creating anything: the one placement
    decision (`sessions.scheduling.placement.placement_decide`: the launch's checks, quotas of `owner`
    included when given, then the scheduler's placement), read without locks.

    `{"outcome", "refusal", "fits_now", "never", "reason", "never_detail", "status_reason", "problems", "node",
    "configuration", "devices": [{"device", "device_index", "model_name", "memory" (bytes),
    "procs" (SMs), "sm_percent", "shares"}], "mig"}`. `outcome`: "starts" (`fits_now`: placed
    now on `node`), "waits" (admitted; waits in the queue with `status_reason`, the reason its
    session would show, "waiting for capacity: …"), "refused" (the launch answers 400: `never`
    — no registered node could ever hold it, type "never-schedulable" — or a quota refuses it,
    type "quota-exceeded", `problems` one sentence per limit passed — or the resource group is
    reserved for projects the caller is not in, 403 type "resource-group-reserved"; `refusal` is
    that type, "" unless refused). `reason`: why it waits
    or is refused, in words (without the "waiting for capacity: " prefix); `never_detail` null,
    or that refusal in parts, `{"asked", "most", "advice"}` (NeverSchedulable.parts). `mig` is null, or
    for a request MIG would hold now `{"profile": "1g.20gb", "plan": "creates a 1g.20gb
    instance at memory slice 0"}` (then `devices` is the parent GPU, or the static slice, with
    the instance's memory and SMs). Requests with isolation "any" are previewed as the scheduler
    places them: a MIG instance where one can be had now, else a shared slice. `image`: the
    session image (a registered reference; None: the default), placed as the scheduler places
    it: only on nodes holding it. `storage_note`: "" or, placed on a node without shared
    storage in a cluster of more than one node, the sentence saying its data folders are local
    to that node (sessions.policy.data_folders). Raises ApplicationError for a malformed request or image (the
    same checks as session_create)."""
    request, _ = request_validate(resources=resources)
    session_image = image_for_launch(reference=image, slot=request.slot)
    decision = placement_decide(
        request=request, image=session_image.reference if session_image else "", owner=owner, view=PreviewView()
    )
    outcome = {PLACED: "starts", WAITING: "waits"}.get(decision.outcome, "refused")
    refusal = decision.refusal()
    result: dict[str, Any] = {
        "outcome": outcome,
        "refusal": refusal.type if refusal else "",
        "fits_now": decision.outcome == PLACED,
        "never": decision.outcome == NEVER,
        "reason": decision.reason.removeprefix(CAPACITY),
        "never_detail": decision.parts or None,
        "status_reason": decision.reason if decision.outcome == WAITING else "",
        "problems": list(decision.problems),
        "node": None,
        "configuration": request_configuration(request),
        "devices": [],
        "mig": None,
    }
    if decision.mig_preview is not None:
        shown = decision.mig_preview
        device = shown.device
        result.update(
            node=shown.node,
            mig={"profile": shown.profile, "plan": shown.plan},
            devices=[
                {
                    "device": device.device_id,
                    "device_index": device.index,
                    "model_name": device.model_name,
                    "memory": shown.memory,
                    "procs": str(shown.procs),
                    "sm_percent": sm_percent(shown.procs, device.subproc_count),
                    "shares": "0",
                }
            ],
        )
    elif decision.placement is not None:
        placement = decision.placement
        devices = {str(d.pk): d for d in Device.objects.filter(pk__in=[g.device_id for g in placement.grants])}
        result["node"] = placement.node_id
        for grant in placement.grants:
            device = devices[grant.device_id]
            result["devices"].append(
                {
                    "device": device.device_id,
                    "device_index": device.index,
                    "model_name": device.model_name,
                    "memory": grant.memory,
                    "procs": format(grant.procs.normalize(), "f"),
                    "sm_percent": sm_percent(grant.procs, device.subproc_count),
                    "shares": shares_text(str(grant.shares)),
                }
            )
    result["storage_note"] = folders_note_named(result["node"])
    return result


MAX_NAME = 64


def session_create(
    *,
    owner,
    name: str,
    resources: dict,
    command: str = "",
    priority: int = 0,
    image: str | None = None,
    preemptible: bool | None = None,
    min_runtime: int = 0,
    preempt_signal: str = "",
    requeue: bool = True,
) -> ComputeSession:
    """Validate `resources` (see accelerators.allocation.requests) and write the session PENDING;
    the scheduler runs after commit. `image`: a registered session image's reference (None or
    "": the default image, `sessions.policy.images.image_default`); the scheduler places the session
    only on a node that holds it. `preemptible` (None: true for a batch `command`, false for an
    interactive shell) and `min_runtime` (seconds, ≥ 0): whether and from when the scheduler may
    stop it for a waiting session (sessions.scheduling.preemption); `preempt_signal` (a name of
    protocol.channel.PREEMPT_SIGNALS; "": the image's, else SIGTERM) the signal it gets when
    chosen, and `requeue` whether it is launched again once preempted.

    Without a `name` (empty or blank) the session gets `session_default_name`'s, unique among
    the owner's sessions.

    Raises ApplicationError (400) for a name longer than MAX_NAME or holding a control character,
    a malformed request, one off the quantum grid, one in the wrong mode, one larger than any
    registered node could ever hold (naming the slot and the largest amount a node holds), and
    an image no administrator registered or one that does not support the request's slot
    (`sessions.policy.images.image_for_launch`, field `image`), and a `name` one of the owner's
    sessions not ended has (type "name-taken", `sessions.admission.names`: the database's
    constraint decides between launches at once); ApplicationError (403) for a resource
    group reserved for projects the owner is not a member of (`sessions.policy.group_access`).
    """
    name = (name or "").strip()
    if priority > 0 and not owner.is_staff:
        raise ApplicationError(
            "priority: only administrators may raise a session's priority above 0",
            field_errors={"priority": ["only administrators may raise a session's priority above 0"]},
        )
    if len(name) > MAX_NAME:
        raise ApplicationError(f"name: at most {MAX_NAME} characters", field_errors={"name": [f"at most {MAX_NAME} characters"]})
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in name):  # C0, DEL and C1 controls: escapes, newlines
        raise ApplicationError(
            "name: control characters (newline, tab, escape, …) are not allowed",
            field_errors={"name": ["control characters (newline, tab, escape, …) are not allowed"]},
        )
    request, _ = request_validate(resources=resources)
    session_image = image_for_launch(reference=image, slot=request.slot)
    with name_taken_refused(owner=owner, name=name), transaction.atomic():
        # The one placement decision's admission (sessions.scheduling.placement): the resource group is open
        # to the owner (sessions.policy.group_access), the request fits some
        # registered node, LOST ones included (a request that fits a node whose agent is
        # restarting waits for it instead of being refused), and the quotas allow its claim
        # (their rows stay locked until this transaction ends).
        decision = placement_decide(request=request, image=session_image.reference if session_image else "", owner=owner)
        refusal = decision.refusal()
        if refusal is not None:
            raise refusal
        name = name or session_default_name(owner=owner, lock=True)
        session = ComputeSession.objects.create(
            owner=owner,
            name=name,
            resources=resources,
            request_spec=request_to_spec(request),
            slot_name=request.slot,
            slot_subtype=request.kind if request.slot else "",
            amount=request.amount,
            cpu=request.cpu,
            mem=request.mem,
            command=command or "",
            priority=priority,
            image=session_image,
            status_reason=decision.reason,
            preemptible=bool(command) if preemptible is None else preemptible,
            min_runtime=max(0, int(min_runtime)),
            preempt_signal=preempt_signal,
            requeue=requeue,
        )
        # The pass first: the launch does not wait for the page's notice (a page that hears the
        # pass's state first keeps it: it has the higher version). Both are best-effort after the
        # commit (robust: logged, never raised), and the notice's shape, which is the launch's
        # answer too (events.shape_shown), is read here, before the commit: nothing after the
        # commit can turn the launch into an error answer (issue 33).
        transaction.on_commit(schedule_pending_soon, robust=True)
        events.session_notify_rendered(session)
    return session


DEFAULT_NAME_PREFIX = "session-"


def session_default_name(*, owner, lock: bool = False) -> str:
    """The name a session of `owner` launched without one gets: "session-<n>", n one more than
    the largest among the owner's sessions so named (ended ones too), so a default name never
    repeats for one owner and reads in launch order. With `lock` (inside a transaction) the
    owner's row is locked first, so two launches at once get different names."""
    if lock:
        list(type(owner).objects.select_for_update().filter(pk=owner.pk).values_list("pk", flat=True))
    names = ComputeSession.objects.filter(owner=owner, name__regex=rf"^{DEFAULT_NAME_PREFIX}[0-9]{{1,18}}$")
    numbers = [int(name[len(DEFAULT_NAME_PREFIX) :]) for name in names.values_list("name", flat=True)]
    return f"{DEFAULT_NAME_PREFIX}{max(numbers, default=0) + 1}"
