"""Quotas per user and per project: what each allows, what is in use, the check that refuses a
launch naming the quota, and the headroom the launch dialog's slider may offer.

A session counts against its owner's own quota and against the quota of every project its
owner is a member of (a session carries no project). Per quota, "in use" is, over the
sessions of its subjects (the user, or the project's members):

- sessions: those PENDING or active (SCHEDULED, PREPARING, RUNNING, TERMINATING);
- fGPU: the `shares` of live allocations (`released_at` null) of fGPU and per-device
  sessions: a per-device grant's `shares` is its fGPU equivalent (0 where the slot is in
  discrete mode). Whole-device sessions (`<slot>.device`, discrete mode, where fGPU is not
  defined) count against `max_devices` and `max_gpu_memory`, not against `max_fgpu`;
- devices: distinct devices with a live allocation;
- GPU memory: the `memory` of live allocations, bytes.

A PENDING session holds no allocation yet; it counts as what it asked: fGPU = its amount
for a shares request (0 otherwise); devices = its amount for a device or per-device request
(0 for a shares request, whose devices are known only once placed); GPU memory = amount ×
the slot's `unit_mem` for a shares request, count × bytes for a per-device request in
bytes, and 0 where the bytes depend on the device not yet chosen (per-device percentages
and eGPU proportions, whole devices). Released (TERMINATED, ERROR, CANCELLED) sessions no
longer count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from decimal import ROUND_DOWN, Decimal

from django.db import transaction
from django.db.models import Count, Q, Sum

from accelerators.allocation.core import ResourceRequest
from protocol.units import fgpu_text, format_binary_size
from accelerators.models import FractionalSettings
from common.errors import ApplicationError
from sessions.models import ACTIVE_STATUSES, Allocation, ComputeSession, Quota, SessionStatus
from sessions.selectors import session_request

ZERO = Decimal(0)
COUNTED_STATUSES = (SessionStatus.PENDING, *ACTIVE_STATUSES)
DEVICE_KINDS = ("device", "per_device")


@dataclass(frozen=True)
class QuotaUsage:
    """One quota and what its subjects hold now: `fgpu` in fGPU, `devices` distinct devices,
    `gpu_memory` bytes of device memory, `sessions` running or waiting."""

    quota: Quota
    fgpu: Decimal
    devices: int
    gpu_memory: int
    sessions: int

    def remaining(self) -> dict[str, Decimal | int | None]:
        """`{"fgpu", "devices", "gpu_memory", "sessions"}`: what the quota still allows (never
        below 0), None where it sets no limit."""
        quota = self.quota
        return {
            "fgpu": None if quota.max_fgpu is None else max(quota.max_fgpu - self.fgpu, ZERO),
            "devices": None if quota.max_devices is None else max(quota.max_devices - self.devices, 0),
            "gpu_memory": None if quota.max_gpu_memory is None else max(quota.max_gpu_memory - self.gpu_memory, 0),
            "sessions": None if quota.max_sessions is None else max(quota.max_sessions - self.sessions, 0),
        }


def quota_list_for(*, user, lock: bool = False) -> list[Quota]:
    """The quotas that apply to `user`: their own first, then their projects' by project name.
    With `lock`, the rows are locked (`select_for_update`, pk order) until the transaction
    ends; must then run inside `transaction.atomic()`."""
    quotas = Quota.objects.filter(Q(user=user) | Q(project__in=user.projects.all()))
    if lock:
        list(quotas.select_for_update().order_by("pk").values_list("pk", flat=True))
    found = list(quotas.select_related("user", "project"))
    return sorted(found, key=lambda q: (q.project_id is not None, q.project.name if q.project else ""))


def _owned(quota: Quota, prefix: str = "") -> Q:
    """Rows of the quota's subjects: `prefix` leads from the row to the session ("session__")."""
    if quota.project_id is not None:
        return Q(**{f"{prefix}owner__projects": quota.project_id})
    return Q(**{f"{prefix}owner": quota.user_id})


def quota_usage_of(*, quota: Quota) -> QuotaUsage:
    """What `quota`'s subjects hold now (the counting rules of the module docstring)."""
    live = Allocation.objects.filter(_owned(quota, "session__"), released_at__isnull=True).aggregate(
        fgpu=Sum("shares", filter=~Q(session__slot_subtype="device"), default=ZERO),
        devices=Count("device", distinct=True),
        gpu_memory=Sum("memory", default=0),
    )
    sessions = ComputeSession.objects.filter(_owned(quota), status__in=COUNTED_STATUSES).count()
    fgpu, devices, memory = Decimal(live["fgpu"]), live["devices"], live["gpu_memory"]
    unit_mem: dict[str, int | None] = {}
    pending = ComputeSession.objects.filter(_owned(quota), status=SessionStatus.PENDING).only(
        "request_spec", "slot_name", "slot_subtype", "amount", "cpu", "mem"
    )
    for session in pending:
        claim = pending_claim(session=session, unit_mem=unit_mem)
        fgpu, devices, memory = fgpu + claim.fgpu, devices + claim.devices, memory + claim.gpu_memory
    return QuotaUsage(quota=quota, fgpu=fgpu, devices=devices, gpu_memory=memory, sessions=sessions)


@dataclass(frozen=True)
class QuotaClaim:
    """What one session counts against a quota before it is placed (the module docstring's
    rules): `fgpu` fGPU, `devices` devices, `gpu_memory` bytes, `sessions` (always 1)."""

    fgpu: Decimal = ZERO
    devices: int = 0
    gpu_memory: int = 0
    sessions: int = 1

    def asked(self) -> dict[str, Decimal | int]:
        """`{"fgpu", "devices", "gpu_memory", "sessions"}`, as `quota_problems` takes them."""
        return {"fgpu": self.fgpu, "devices": self.devices, "gpu_memory": self.gpu_memory, "sessions": self.sessions}


def request_claim(request: ResourceRequest, *, unit_mem: dict[str, int | None] | None = None) -> QuotaClaim:
    """The one quota claim rule: what a session asking `request` counts as until it is placed.
    Used for a launch (`quota_check`), the launch preview, the dialog's maximum
    (`claim_max_amount`) and the PENDING sessions in use (`quota_usage_of`).

    shares → its amount in fGPU and amount × the slot's `unit_mem` bytes (truncated);
    device / per-device → `request.amount` devices, and for a per-device size in bytes count ×
    (bytes − reserved); everything else (CPU only, MIG, sizes relative to a device not chosen
    yet) → nothing but the session. `unit_mem` caches the slots' `unit_mem` (bytes, None: the
    slot has no fractional settings) between calls."""
    if request.kind == "shares":
        per_fgpu = slot_unit_mem(request.slot, cache=unit_mem)
        memory = 0 if per_fgpu is None else int((Decimal(per_fgpu) * request.amount).to_integral_value(rounding=ROUND_DOWN))
        return QuotaClaim(fgpu=request.amount, gpu_memory=memory)
    if request.kind in DEVICE_KINDS:
        count = int(request.amount)
        memory = 0
        if request.kind == "per_device" and request.memory is not None and request.memory.bytes:
            memory = count * max(0, request.memory.bytes - request.memory.reserved)
        return QuotaClaim(devices=count, gpu_memory=memory)
    return QuotaClaim()


def slot_unit_mem(slot: str, *, cache: dict[str, int | None] | None = None) -> int | None:
    """Bytes in 1.0 fGPU of `slot` (its FractionalSettings row), None without a row; `cache`
    (slot → bytes) saves the query on later calls."""
    cache = {} if cache is None else cache
    if slot not in cache:
        cache[slot] = FractionalSettings.objects.filter(slot_name=slot).values_list("unit_mem", flat=True).first()
    return cache[slot]


def pending_claim(*, session: ComputeSession, unit_mem: dict[str, int | None] | None = None) -> QuotaClaim:
    """What a PENDING `session` counts as: `request_claim` of its request. `unit_mem` caches
    the slots' `unit_mem` between calls."""
    return request_claim(session_request(session), unit_mem=unit_mem)


def quota_usage(*, user) -> list[QuotaUsage]:
    """For each quota that applies to `user` (their own first, then their projects' by name),
    what its subjects hold now. Empty when no quota applies (nothing is limited)."""
    return [quota_usage_of(quota=quota) for quota in quota_list_for(user=user)]


def quota_label(quota: Quota, *, user=None) -> str:
    """How a refusal names the quota: "your quota" (seen by its own user), 'quota of project
    "vision"', 'quota of user "alice"'."""
    if quota.user_id is not None and user is not None and quota.user_id == user.pk:
        return "your quota"
    return f"quota of {quota.subject}"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def quota_problems(usage: QuotaUsage, *, asked: dict[str, Decimal | int], user=None) -> list[str]:
    """Each limit of `usage.quota` that `asked` ({"fgpu": fGPU, "devices": count,
    "gpu_memory": bytes, "sessions": count}) would pass, as a sentence naming the quota and
    the figures. A limit the request asks nothing of is not checked (a quota lowered below
    what is in use does not block CPU-only sessions, say)."""
    quota, label, problems = usage.quota, quota_label(usage.quota, user=user), []
    if quota.max_sessions is not None and asked["sessions"] > 0 and usage.sessions + asked["sessions"] > quota.max_sessions:
        problems.append(f"{label}: {_plural(usage.sessions, 'session')} running or waiting, at most {quota.max_sessions}")
    if quota.max_fgpu is not None and asked["fgpu"] > 0 and usage.fgpu + asked["fgpu"] > quota.max_fgpu:
        problems.append(
            f"{label}: {fgpu_text(usage.fgpu)} fGPU in use + {fgpu_text(asked['fgpu'])} asked > "
            f"{fgpu_text(quota.max_fgpu)} allowed"
        )
    if quota.max_devices is not None and asked["devices"] > 0 and usage.devices + asked["devices"] > quota.max_devices:
        problems.append(
            f"{label}: {_plural(usage.devices, 'device')} in use + {asked['devices']} asked > {quota.max_devices} allowed"
        )
    if (
        quota.max_gpu_memory is not None
        and asked["gpu_memory"] > 0
        and usage.gpu_memory + asked["gpu_memory"] > quota.max_gpu_memory
    ):
        problems.append(
            f"{label}: {format_binary_size(usage.gpu_memory)} GPU memory in use + "
            f"{format_binary_size(int(asked['gpu_memory']))} asked > "
            f"{format_binary_size(quota.max_gpu_memory)} allowed"
        )
    return problems


def quota_refusals(*, user, request: ResourceRequest, lock: bool = True) -> list[str]:
    """Each limit of a quota of `user` or of one of their projects that launching `request`
    (its `request_claim`) would pass, one sentence per limit (see `quota_problems`), e.g.
    'quota of project "vision": 1.50 fGPU in use + 1.00 asked > 2.00 allowed' or "your quota:
    3 sessions running or waiting, at most 3". Empty: the quotas allow it.

    With `lock`, inside `transaction.atomic()`, it locks the applicable Quota rows until the
    transaction ends, so two launches drawing on one quota are checked one after the other
    (call it in the transaction that writes the session); a preview reads without `lock`."""
    asked = request_claim(request).asked()
    lock = lock and transaction.get_connection().in_atomic_block
    problems = []
    for quota in quota_list_for(user=user, lock=lock):
        problems += quota_problems(quota_usage_of(quota=quota), asked=asked, user=user)
    return problems


def quota_refusal_error(problems: list[str]) -> ApplicationError:
    """The API's error for a launch `quota_refusals` refused: 400, type "quota-exceeded", title
    "Quota exceeded", `field_errors["resources"]` the sentences."""
    return ApplicationError(
        "; ".join(problems), type="quota-exceeded", title="Quota exceeded", field_errors={"resources": list(problems)}
    )


def quota_check(*, user, request: ResourceRequest) -> None:
    """Refuse a launch of `request` by `user` that would pass a quota of theirs or of one of
    their projects (`quota_refusals`, locking as it does). Raises `quota_refusal_error`'s
    ApplicationError (400, type "quota-exceeded")."""
    problems = quota_refusals(user=user, request=request)
    if problems:
        raise quota_refusal_error(problems)


def quota_headroom(*, user) -> dict[str, Decimal | int | None]:
    """What `user` may still launch: `{"fgpu": Decimal fGPU, "devices": int, "gpu_memory": int
    bytes, "sessions": int}`, each the smallest remaining allowance over the quotas that apply
    (never below 0), None where none of them limits it. The fGPU figure is not rounded to a
    slot's quantum; the launch dialog rounds it down to its step."""
    headroom: dict[str, Decimal | int | None] = {"fgpu": None, "devices": None, "gpu_memory": None, "sessions": None}
    for usage in quota_usage(user=user):
        for key, left in usage.remaining().items():
            current = headroom[key]
            if left is not None and (current is None or left < current):
                headroom[key] = left
    return headroom


def claim_max_amount(
    *, request: ResourceRequest, headroom: dict, unit_mem: dict[str, int | None] | None = None
) -> tuple[Decimal | None, str]:
    """The largest amount of a request like `request` (its kind and slot; its amount ignored)
    whose `request_claim` the quota `headroom` (`quota_headroom`'s figures) still allows, and the
    limit that caps it ("fgpu", "devices", "gpu_memory" or "sessions"): the dialog's maximum
    under the quotas, from the same rule as the launch (the claim grows in step with the
    amount). `(None, "")` when no quota limits it; `(0, "sessions")` when no session is left.
    Not rounded to a quantum (fGPU, or devices). `unit_mem`: as `request_claim`'s."""
    sessions = headroom.get("sessions")
    if sessions is not None and sessions < 1:
        return ZERO, "sessions"
    per_unit = request_claim(replace(request, amount=Decimal(1)), unit_mem=unit_mem).asked()
    best: Decimal | None = None
    limit = ""
    for key in ("fgpu", "devices", "gpu_memory"):
        left = headroom.get(key)
        if left is None or not per_unit[key]:
            continue
        amount = Decimal(left) / Decimal(per_unit[key])
        if best is None or amount < best:
            best, limit = amount, key
    return best, limit


# --- what the API and the account page show -----------------------------------------------


def quota_figures(*, fgpu, devices, gpu_memory, sessions) -> dict:
    """Figures for QuotaFiguresSerializer: fGPU as decimal text, the rest as they are; None: unlimited."""
    return {"fgpu": None if fgpu is None else fgpu_text(fgpu), "devices": devices, "gpu_memory": gpu_memory, "sessions": sessions}


def quota_report(*, user) -> dict:
    """`{"user", "quotas": [{"id", "scope", "name", "limits", "used", "remaining"}], "headroom"}`
    for `user`, from sessions.policy.quotas.quota_usage / quota_headroom."""
    quotas = []
    for usage in quota_usage(user=user):
        quota = usage.quota
        quotas.append(
            {
                "id": quota.pk,
                "scope": "project" if quota.project_id is not None else "user",
                "name": quota.project.name if quota.project is not None else quota.user.get_username() if quota.user else "",
                "limits": quota_figures(
                    fgpu=quota.max_fgpu, devices=quota.max_devices, gpu_memory=quota.max_gpu_memory, sessions=quota.max_sessions
                ),
                "used": quota_figures(
                    fgpu=usage.fgpu, devices=usage.devices, gpu_memory=usage.gpu_memory, sessions=usage.sessions
                ),
                "remaining": quota_figures(**usage.remaining()),
            }
        )
    return {"user": user.get_username(), "quotas": quotas, "headroom": quota_figures(**quota_headroom(user=user))}
