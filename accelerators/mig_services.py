"""Writes for MIG (issue 4): a node's MIG settings and fixed layout (set by administrators), what
its agent found on its GPUs (reconcile), and keeping a running agent in step: a settings change
is pushed to the agent at once (`node_mig_settings_apply` → `node_mig_push`), changes that wait
for sessions are made when they end (`node_mig_pending_retry`), and a heartbeat whose layout
digest differs from the expected one asks for a full reconcile (`node_mig_heartbeat_check`).
How far the agent got is kept in `Node.mig_sync` (read with
`accelerators.mig_selectors.node_mig_sync_view`)."""

from __future__ import annotations

import logging

from dataclasses import dataclass, replace
from functools import partial

from django.db import transaction
from django.utils import timezone

import protocol
from accelerators.allocation import mig
from accelerators.allocation.errors import InvalidResourceRequest
from accelerators.mig_selectors import device_mig_catalog, gpu_instance_holds, node_mig_gpus, node_mig_layout_digest
from accelerators.models import Device, GpuInstance, MigMode, Node, NodeStatus
from accelerators.services import node_settings_saved
from protocol.messages import HardwareId, MigPlacement, NodeName
from protocol.mig_messages import MigGpu, MigInstance, MigReconcile, MigReport

log = logging.getLogger(__name__)


def node_mig_settings_check(*, node: Node, mig_mode: str, mig_layout: object) -> None:
    """The check an administrator's change of a node's MIG settings passes, in the admin form and
    the API alike: in mode "fixed" the layout must be creatable on each named GPU
    (`mig_layout_check`); other modes keep the layout without using it. Raises
    InvalidResourceRequest naming the GPU and the problem."""
    if mig_mode == MigMode.FIXED and node.pk:
        mig_layout_check(node=node, layout=mig_layout or {})


def mig_layout_check(*, node: Node, layout: object) -> dict:
    """`layout` as an administrator wrote it, `{"<GPU device id or index>": [{"profile":
    "3g.40gb", "start": 0}, …]}`, checked against each GPU's catalog (allowed starts, disjoint
    memory slices, max counts: `accelerators.allocation.mig.layout_problems`). Returns it keyed
    by device pk: {pk: [(profile, start), …]}. Raises InvalidResourceRequest naming the GPU and
    the problem."""
    if not isinstance(layout, dict):
        raise InvalidResourceRequest('mig_layout: expected {"<GPU id or index>": [{"profile": …, "start": …}]}')
    gpus = list(node.devices.filter(is_mig_device=False))
    out = {}
    for key, entries in layout.items():
        device = next((d for d in gpus if str(key) in (d.device_id, str(d.index))), None)
        if device is None:
            raise InvalidResourceRequest(f"mig_layout: node {node.name} has no GPU {key!r}")
        catalog = device_mig_catalog(device)
        if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("profile"), str) and isinstance(e.get("start"), int) for e in entries
        ):
            raise InvalidResourceRequest(f'mig_layout[{key!r}]: expected a list of {{"profile": …, "start": …}}')
        wanted = [
            mig.MigInstance(key=f"{e['profile']}@{e['start']}", profile=e["profile"].lower(), start=e["start"]) for e in entries
        ]
        problems = mig.layout_problems(catalog, wanted)
        if problems:
            raise InvalidResourceRequest(f"mig_layout[{key!r}] on {catalog.model}: {'; '.join(problems)}")
        out[device.pk] = [(i.profile, i.start) for i in wanted]
    return out


@dataclass(frozen=True)
class MigLayoutChange:
    """What `node_mig_layout_apply` changed: `removed` the idle planned instances it deleted
    (their agent destroys them), `added` the idle ones it planned (their agent creates them),
    `pending` the changes that wait: {"gpu" (UUID), "index", "profile", "start", "action":
    "destroy" | "create", "reason"} — an instance in use by a running session that is not in
    the layout (destroyed when its session ends), a layout instance whose memory slices such an
    instance, or an unknown one, holds (created when they are free). Items of `removed` and
    `added` are {"gpu", "index", "profile", "start"}."""

    removed: tuple[dict, ...] = ()
    added: tuple[dict, ...] = ()
    pending: tuple[dict, ...] = ()


def _item(device: Device, profile: str, start: int, **extra) -> dict:
    return {"gpu": device.device_id, "index": device.index, "profile": profile, "start": start, **extra}


def _holder_state(row: GpuInstance) -> str:
    return "unknown: not the manager's" if row.unknown_since else "in use"


@transaction.atomic
def node_mig_layout_apply(*, node: Node) -> MigLayoutChange:
    """Make a fixed-layout node's GpuInstance rows match its `mig_layout`: missing instances are
    added (idle), idle ones not in the layout removed. Instances in use, and unknown ones (found
    on the GPU, never planned here), stay; layout instances whose memory slices they hold wait
    (`MigLayoutChange.pending`). No-op (an empty change) unless the mode is "fixed". The rows
    only: `node_mig_settings_apply` also tells the node's agent. Raises InvalidResourceRequest
    (see `mig_layout_check`)."""
    if node.mig_mode != MigMode.FIXED:
        return MigLayoutChange()
    layout = mig_layout_check(node=node, layout=node.mig_layout)
    rows = list(GpuInstance.objects.select_for_update(of=("self",)).filter(node=node).select_related("session", "parent"))
    kept, removed, added, pending = [], [], [], []
    for row in rows:
        wanted = (row.profile, row.placement_start) in layout.get(row.parent_id, [])
        if wanted or gpu_instance_holds(row):
            kept.append(row)
            if not wanted and row.unknown_since is None:
                pending.append(
                    _item(
                        row.parent,
                        row.profile,
                        row.placement_start,
                        action="destroy",
                        reason="in use by a running session: destroyed when the session ends",
                    )
                )
        else:
            removed.append(_item(row.parent, row.profile, row.placement_start))
            row.delete()
    existing = {(r.parent_id, r.profile, r.placement_start) for r in kept}
    holder = {(r.parent_id, s): r for r in kept for s in range(r.placement_start, r.placement_start + r.placement_size)}
    for device in node.devices.filter(pk__in=list(layout)).order_by("index"):
        catalog = device_mig_catalog(device)
        for profile_name, start in layout[device.pk]:
            if (device.pk, profile_name, start) in existing:
                continue
            profile = catalog.profile(profile_name)
            blockers = sorted(
                {holder[(device.pk, s)] for s in range(start, start + profile.size) if (device.pk, s) in holder},
                key=lambda r: r.placement_start,
            )
            if blockers:  # the layout's instance takes the slices once they are free
                held = ", ".join(f"{b.profile}@{b.placement_start} ({_holder_state(b)})" for b in blockers)
                pending.append(
                    _item(
                        device,
                        profile.name,
                        start,
                        action="create",
                        reason=f"its memory slices are held by {held}: created once they are free",
                    )
                )
                continue
            GpuInstance.objects.create(
                node=node,
                parent=device,
                profile=profile.name,
                placement_start=start,
                placement_size=profile.size,
                memory_size=profile.memory,
                subproc_count=profile.sm_count_for(device.subproc_count),
            )
            added.append(_item(device, profile.name, start))
    return MigLayoutChange(removed=tuple(removed), added=tuple(added), pending=tuple(pending))


def node_mig_expected(*, node: Node) -> MigReconcile | None:
    """What the agent of `node` reconciles its MIG GPUs against, the message of the task
    `fgpu.agent.mig_reconcile` (protocol.mig_messages.MigReconcile, of kind "start" and no `seq`:
    node_mig_push sets them): its MIG GPUs (`gpus`), every GPU instance the manager planned on each
    (`expected`: in use or idle; unknown ones are left out, so the agent reports them again if
    they are still there), and the idle instances a layout change removed that the agent has not
    yet reported destroyed (`destroy`: `node.mig_sync["destroy"]`, less any the layout expects
    again). None unless the node is in dynamic or fixed MIG mode and has a MIG-capable GPU."""
    if node.mig_mode not in (MigMode.DYNAMIC, MigMode.FIXED):
        return None
    gpus: list[MigGpu] = []
    expected: dict[HardwareId, tuple[MigPlacement, ...]] = {}
    rows = GpuInstance.objects.filter(node=node, unknown_since__isnull=True).order_by("placement_start")
    for device in node_mig_gpus(node=node):
        gpu = HardwareId(device.device_id)
        gpus.append(
            MigGpu(
                gpu=gpu,
                index=device.index,
                model_name=device.model_name,
                memory_size=device.memory_size,
                subproc_count=device.subproc_count,
            )
        )
        expected[gpu] = tuple(MigPlacement(r.profile, r.placement_start) for r in rows if r.parent_id == device.pk)
    if not gpus:
        return None
    destroy: dict[HardwareId, tuple[MigPlacement, ...]] = {}
    for gpu_text, items in (node.mig_sync or {}).get("destroy", {}).items():
        gpu = HardwareId(gpu_text)
        wanted = set(expected.get(gpu, ()))
        left = tuple(p for p in (MigPlacement(i["profile"], i["start"]) for i in items) if p not in wanted)
        if gpu in expected and left:
            destroy[gpu] = left
    return MigReconcile(node=NodeName(node.name), gpus=tuple(gpus), expected=expected, destroy=destroy)


# --- telling a running agent: pushes, their reports, and drift seen in heartbeats ---------------------

DRIFT_REASK_S = 300  # a mismatch a full reconcile was asked about is not asked about again for this long


def _sync_detail(sync: dict, mode: str) -> str:
    """The words for `sync["state"]` (see `accelerators.mig_selectors.node_mig_sync_view`)."""
    state = sync.get("state") or ""
    waiting = "; ".join(f"{p['profile']}@{p['start']} on GPU {p['index']}: {p['reason']}" for p in sync.get("pending", []))
    return {
        "not-managed": f"MIG mode {mode}: the manager plans no GPU instances on this node (or it has no MIG-capable "
        "GPU), so nothing is sent to its agent",
        "pending-agent-offline": "the node's agent is offline (LOST): the layout is applied when it next starts and registers",
        "sent": "sent to the node's agent; waiting for its report",
        "applied": "the agent applied the expected layout",
        "pending": f"the agent applied the layout except for changes that wait: {waiting}",
        "error": "the agent could not apply all of the layout: "
        + "; ".join(
            f"{e.get('profile') or 'GPU'}@{e.get('start')} on {e.get('gpu')}: {e.get('reason')}"
            if e.get("profile")
            else f"GPU {e.get('gpu')}: {e.get('reason')}"
            for e in sync.get("errors", [])
        ),
    }.get(state, "")


def _send_mig_reconcile(node_name: str, message: MigReconcile) -> None:
    """Send `message` to `node_name`'s agent (its queue is the node's: the message names it too)."""
    from common.celery import agent_send

    agent_send(protocol.MIG_RECONCILE, **{**message.encode(), "node": node_name})


@transaction.atomic
def node_mig_push(*, node: Node, kind: str, change: MigLayoutChange | None = None) -> dict:
    """Send `node`'s agent the MIG layout the manager expects (`node_mig_expected`) with task
    `fgpu.agent.mig_reconcile`, after the transaction commits: `kind` "start" (the agent just
    registered), "layout" (an administrator changed the MIG settings; `change` is what
    `node_mig_layout_apply` did: its removed instances join the ones to destroy, its pending
    ones are recorded) or "drift" (a heartbeat's digest differed). Nothing is sent in MIG mode
    off or static or without a MIG-capable GPU (state "not-managed") nor to a LOST node (state
    "pending-agent-offline": the message goes out when the agent registers again). Records and
    returns the node's sync record (`Node.mig_sync`: "state", "detail", "kind", "seq" (one more
    per message sent, echoed by the agent's report), "changed_at", "sent_at", "reported_at",
    "pending", "destroy", "errors"); `node.mig_sync` is set to it too."""
    locked = Node.objects.select_for_update().get(pk=node.pk)
    sync = dict(locked.mig_sync or {})
    now = timezone.now().isoformat()
    if change is not None:
        sync["changed_at"], sync["pending"] = now, list(change.pending)
        destroy = {gpu: list(items) for gpu, items in sync.get("destroy", {}).items()}
        for item in change.removed:
            entry = {"profile": item["profile"], "start": item["start"]}
            if entry not in destroy.setdefault(item["gpu"], []):
                destroy[item["gpu"]].append(entry)
        sync["destroy"] = destroy
    locked.mig_sync = sync
    message = node_mig_expected(node=locked)
    if message is None:
        sync.update(state="not-managed", pending=[], destroy={}, errors=[])
    else:
        sync.update(destroy={gpu: [p.encode() for p in items] for gpu, items in message.destroy.items()}, errors=[], kind=kind)
        if locked.status != NodeStatus.ALIVE:
            sync["state"] = "pending-agent-offline"
        else:
            sync.update(state="sent", seq=int(sync.get("seq", 0)) + 1, sent_at=now)
            transaction.on_commit(partial(_send_mig_reconcile, locked.name, replace(message, kind=kind, seq=sync["seq"])))
    sync["detail"] = _sync_detail(sync, locked.mig_mode)
    locked.save(update_fields=["mig_sync"])
    node.mig_sync = sync
    return sync


@transaction.atomic
def node_mig_settings_apply(*, node: Node) -> dict:
    """After an administrator saved `node`'s MIG mode or fixed layout — the one step the API
    (`PUT/PATCH /api/v1/nodes/<name>/mig/`) and the admin form share, inside their transaction:
    make the GpuInstance rows match a fixed layout (`node_mig_layout_apply`) and send the node's
    running agent the new expected layout once the transaction commits (`node_mig_push`, kind
    "layout"), so it destroys the idle instances that no longer belong and creates the missing
    ones at once. Instances in use are never destroyed: those changes are recorded as pending
    and made when their sessions end (`node_mig_pending_retry`). Returns the sync record (see
    `node_mig_push`; its "state" says "sent", "pending-agent-offline" or "not-managed"). Raises
    InvalidResourceRequest for a layout the GPUs cannot hold (see `mig_layout_check`)."""
    sync = node_mig_push(node=node, kind="layout", change=node_mig_layout_apply(node=node))
    node_settings_saved(node=node, fields=("mig_mode", "mig_layout"))  # a scheduler pass after commit
    return sync


def node_mig_pending_retry(*, node_id) -> dict | None:
    """After a session on node `node_id` ended (called on commit): when a fixed-layout change
    waits for sessions (`Node.mig_sync["pending"]`), apply the layout again and, if rows changed
    or what waits changed, push it to the agent (`node_mig_push`, kind "layout"). Returns the
    new sync record, or None when nothing waited or nothing changed. One query when nothing
    waits."""
    node = Node.objects.filter(pk=node_id, mig_mode=MigMode.FIXED).first()
    if node is None or not (node.mig_sync or {}).get("pending"):
        return None
    with transaction.atomic():
        change = node_mig_layout_apply(node=node)
        if not change.removed and not change.added and list(change.pending) == node.mig_sync["pending"]:
            return None
        return node_mig_push(node=node, kind="layout", change=change)


def node_mig_heartbeat_check(*, node_name: str, digest: str | None) -> bool:
    """Compare the MIG layout digest a heartbeat of `node_name`'s agent carried (over the GPU
    instances it finds on its MIG GPUs, `accelerators.allocation.mig.layout_digest`; None: it
    knows no MIG GPU yet or is changing the layout) with the manager's (`node_mig_layout_digest`).
    Equal (the usual case): nothing is written or sent. Different: the mismatch is noted, and
    when the next heartbeat shows the same one (not a layout in the middle of changing) and no
    session on the node is being prepared, a full reconcile is asked for (`node_mig_push`, kind
    "drift"); the agent's report then records unknown instances (`node_mig_report_apply`). The
    same mismatch is not asked about again for DRIFT_REASK_S seconds. Returns whether it asked.
    Nodes not in dynamic or fixed MIG mode are skipped."""
    if digest is None:
        return False
    node = Node.objects.filter(name=node_name, mig_mode__in=[MigMode.DYNAMIC, MigMode.FIXED]).first()
    if node is None:
        return False
    expected = node_mig_layout_digest(node=node)
    if expected is None or digest == expected:
        if node.mig_drift:
            Node.objects.filter(pk=node.pk).update(mig_drift={})
        return False
    pair, drift, now = f"{digest}/{expected}", dict(node.mig_drift or {}), timezone.now().timestamp()
    if drift.get("asked") == pair and now - float(drift.get("asked_at", 0)) < DRIFT_REASK_S:
        return False
    if drift.get("seen") != pair:
        Node.objects.filter(pk=node.pk).update(mig_drift={**drift, "seen": pair})
        return False
    if node.sessions.filter(status__in=protocol.SESSION_STARTING_STATES).exists():
        return False  # a start spec is changing the layout: look again at the next heartbeat
    Node.objects.filter(pk=node.pk).update(mig_drift={"asked": pair, "asked_at": now})
    log.info(
        "node %s: MIG layout digest %s differs from the expected %s; asking for a full reconcile", node_name, digest, expected
    )
    node_mig_push(node=node, kind="drift")
    return True


def _sync_record_report(node: Node, report: MigReport) -> None:
    """Fold a full reconcile report (one answering `node_mig_push`: it has a `kind` and `seq`)
    into `node.mig_sync`: instances it destroyed leave "destroy"; when it answers the latest
    push, its errors and the state ("applied", "pending" or "error") replace the old ones."""
    sync = dict(node.mig_sync or {})
    gone = {(d.gpu, d.profile, d.start) for d in report.destroyed}
    destroy = {
        gpu: [d for d in items if (gpu, d["profile"], d["start"]) not in gone] for gpu, items in sync.get("destroy", {}).items()
    }
    sync["destroy"] = {gpu: items for gpu, items in destroy.items() if items}
    if report.seq == sync.get("seq"):
        sync["reported_at"] = timezone.now().isoformat()
        sync["errors"] = [e.encode() for e in report.errors]
        sync["state"] = "error" if sync["errors"] else "pending" if sync.get("pending") else "applied"
        sync["detail"] = _sync_detail(sync, node.mig_mode)
    node.mig_sync = sync
    node.save(update_fields=["mig_sync"])


@transaction.atomic
def node_mig_report_apply(*, node_name: str, report: MigReport) -> list[GpuInstance]:
    """Record what the agent of `node_name` found when it reconciled its MIG GPUs
    (protocol.mig_messages.MigReport, built by `agent.mig.MigManager`: `gpus` the GPUs it could
    list, `unknown` the instances it found there that the manager does not know, `recreated`,
    `errors`; an answer to `node_mig_push` has a `kind`, `seq` and `destroyed`, and is folded into
    `Node.mig_sync`; after a start spec's instance was made or reused, `prepared`).

    For each listed GPU the unknown instances become GpuInstance rows with `unknown_since` set
    (the planner then counts their slices as taken and never reuses or destroys them), rows of
    unknown instances no longer found are deleted, and an idle planned row at the start an
    unknown instance holds is replaced by it (the GPU cannot hold both). Re-created and prepared
    instances get their MIG device UUID. A planned row in use where an unknown instance sits is kept and
    the clash logged. Returns the unknown rows of the listed GPUs. Unknown nodes, GPUs and
    profiles are logged and skipped."""
    gpu_ids = {*report.gpus, *(item.gpu for item in report.prepared)}
    node = Node.objects.select_for_update().filter(name=node_name).first()
    if node is None:
        log.warning("MIG reconcile report from unregistered node %s", node_name)
        return []
    now = timezone.now()
    gpus = {d.device_id: d for d in Device.objects.filter(node=node, is_mig_device=False, device_id__in=gpu_ids)}
    listed = [d for gpu, d in gpus.items() if gpu in report.gpus]  # those whose unknown ones are news
    rows = list(GpuInstance.objects.select_for_update(of=("self",)).filter(parent__in=listed).select_related("session"))
    for made in [*report.recreated, *report.prepared]:
        device = gpus.get(made.gpu)
        if device is not None and made.uuid:
            GpuInstance.objects.filter(
                parent=device, profile=made.profile, placement_start=made.start, unknown_since__isnull=True
            ).update(uuid=made.uuid)
    for failure in report.errors:
        log.warning(
            "node %s could not re-create MIG instance %s@%s on GPU %s: %s",
            node_name,
            failure.profile,
            failure.start,
            failure.gpu,
            failure.reason,
        )
    listed_ids = {d.device_id for d in listed}
    found: dict[tuple[str, int], MigInstance] = {
        (item.gpu, item.start): item for item in report.unknown if item.gpu in listed_ids
    }
    unknown, uuid_of = [], {d.pk: d.device_id for d in gpus.values()}
    for row in rows:
        key = (uuid_of[row.parent_id], row.placement_start)
        item = found.get(key)
        if row.unknown_since is not None:
            if item is not None and item.profile == row.profile:
                row.uuid = item.uuid or row.uuid
                row.save(update_fields=["uuid"])
                unknown.append(row)
                found.pop(key)
            else:
                row.delete()  # gone from the GPU (or replaced by another one, recorded below)
        elif item is not None and not gpu_instance_holds(row):
            row.delete()  # planned and idle, but the GPU holds another instance there
    taken = {(r.parent_id, r.placement_start) for r in GpuInstance.objects.filter(parent__in=listed)}
    for (gpu, start), item in sorted(found.items()):
        device = gpus[gpu]
        if (device.pk, start) in taken:
            log.warning(
                "node %s: MIG instance %s@%s (%s) on GPU %s is not the manager's, but a session's instance is planned there",
                node_name,
                item.profile,
                start,
                item.uuid,
                gpu,
            )
            continue
        try:
            profile = device_mig_catalog(device).profile(item.profile)
        except InvalidResourceRequest as exc:
            log.warning("node %s: unknown MIG instance on GPU %s skipped: %s", node_name, gpu, exc)
            continue
        unknown.append(
            GpuInstance.objects.create(
                node=node,
                parent=device,
                profile=profile.name,
                placement_start=start,
                placement_size=profile.size,
                memory_size=profile.memory,
                subproc_count=profile.sm_count_for(device.subproc_count),
                uuid=item.uuid,
                unknown_since=now,
            )
        )
        log.warning(
            "node %s: MIG instance %s@%s (%s) on GPU %s was not planned by the manager; its slices count as "
            "taken until it is gone",
            node_name,
            profile.name,
            start,
            item.uuid,
            gpu,
        )
    if report.kind is not None:  # the answer to a push (node_mig_push): how far the agent got
        _sync_record_report(node, report)
    return unknown
