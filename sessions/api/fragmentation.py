"""`GET /api/v1/fragmentation/` (administrators): each resource group's fragmentation map and
compaction plan (sessions.scheduling.compaction); `POST /api/v1/fragmentation/apply/` applies one group's
plan, as the admin page's button does. Amounts in fGPU (text), work in fGPU-seconds.

Nodes in no resource group form the implicit group "default" (issue 32.5) when no group of that
name exists: the scheduler places a request naming no group on any alive node under fgd-plus
(`accelerators.selectors.placement_scope`, `placement_options`), so that group's map is every
alive node's, with the shapes of the requests naming no group (`compaction.fragmentation_report`
with group None). It is listed when no group is defined or some alive node is in none."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.decorators import api_view
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response

from protocol.units import amount_text
from accelerators.models import Node, NodeStatus, ResourceGroup
from accelerators.selectors import DEFAULT_GROUP
from common.api_support import ErrorSerializer
from common.errors import ApplicationError
from sessions.scheduling.compaction import compaction_apply, fragmentation_report_kept
from sessions.selectors import request_configuration


class DeviceFreeSerializer(serializers.Serializer):
    node = serializers.CharField()
    device = serializers.CharField(help_text="the device's label: index and UUID")
    free = serializers.CharField(help_text="fGPU free now")
    capacity = serializers.CharField(help_text="fGPU in all")
    sessions = serializers.IntegerField()
    stranded = serializers.BooleanField(help_text="free, but no request shape seen lately could use it")


class MoveSerializer(serializers.Serializer):
    session = serializers.UUIDField()
    name = serializers.CharField()
    owner = serializers.CharField()
    from_node = serializers.CharField()
    to_node = serializers.CharField(help_text="where the allocator would place it again after the target")
    fgpu = serializers.CharField()
    ran_seconds = serializers.FloatField()


class PlanSerializer(serializers.Serializer):
    node = serializers.CharField(help_text="where the target fits once the moves are made")
    fits_now = serializers.BooleanField(help_text="nothing to move: the scheduler's next pass places it")
    sessions_moved = serializers.IntegerField()
    work_lost_fgpu_seconds = serializers.FloatField(help_text="Σ fGPU × seconds run of the moved sessions")
    moves = MoveSerializer(many=True)


class FragmentationSerializer(serializers.Serializer):
    group = serializers.CharField()
    implicit = serializers.BooleanField(
        help_text='true: "default", the nodes in no resource group (no group of that name exists): requests naming '
        "no group, placed on any alive node"
    )
    slot = serializers.CharField()
    fractional = serializers.BooleanField(help_text="false: the slot is in discrete mode, no fGPU map")
    free = serializers.CharField(allow_null=True)
    stranded = serializers.CharField(allow_null=True)
    largest_fgpu = serializers.CharField(allow_null=True, help_text="the most fGPU one request could get now")
    largest_shape = serializers.CharField(allow_null=True, help_text="the largest recent shape that fits now")
    shapes = serializers.ListField(child=serializers.CharField(), help_text="the request shapes seen lately")
    devices = DeviceFreeSerializer(many=True)
    target = serializers.DictField(allow_null=True, help_text="the largest waiting session: {id, name, owner, request}")
    plan = PlanSerializer(allow_null=True, help_text="null: nothing waits, or no move set makes it fit")


def _shape(report) -> dict:
    found, plan, now = report.map, report.plan, report.now.timestamp()
    body = {
        "group": report.name or DEFAULT_GROUP,
        "implicit": report.group is None,
        "slot": report.slot,
        "fractional": report.fractional,
        "free": None,
        "stranded": None,
        "largest_fgpu": None,
        "largest_shape": None,
        "shapes": [],
        "devices": [],
        "target": None,
        "plan": None,
    }
    if found is not None:
        body.update(
            free=amount_text(found.free),
            stranded=amount_text(found.stranded),
            largest_fgpu=amount_text(found.largest_fgpu),
            largest_shape=request_configuration(found.largest_shape) if found.largest_shape else None,
            shapes=[request_configuration(s) for s in found.shapes],
            devices=[
                {
                    "node": d.node_id,
                    "device": d.label,
                    "free": amount_text(d.free),
                    "capacity": amount_text(d.capacity),
                    "sessions": d.sessions,
                    "stranded": d.stranded,
                }
                for d in found.devices
            ],
        )
    if report.target is not None:
        t = report.target
        body["target"] = {"id": str(t.pk), "name": t.name, "owner": t.owner.get_username(), "request": t.resources}
    if plan is not None:
        moves = []
        for m in plan.moves:
            s = report.sessions.get(m.holder.session_id)
            moves.append(
                {
                    "session": m.holder.session_id,
                    "name": m.holder.name,
                    "owner": s.owner.get_username() if s is not None else "",
                    "from_node": m.holder.node_id,
                    "to_node": m.to_node,
                    "fgpu": amount_text(m.holder.shares),
                    "ran_seconds": m.holder.ran(now),
                }
            )
        body["plan"] = {
            "node": plan.node_id,
            "fits_now": plan.fits_now,
            "sessions_moved": plan.sessions_moved,
            "work_lost_fgpu_seconds": round(plan.work_lost, 3),
            "moves": moves,
        }
    return body


_shaped: dict[int, tuple[object, dict]] = {}  # id(report) → (the report, its body): kept reports' bodies


def _shape_kept(report) -> dict:
    """`_shape(report)`, made once per report: a kept report (`fragmentation_report_kept`) is
    answered again without shaping its thousands of devices again."""
    found = _shaped.get(id(report))
    if found is not None and found[0] is report:
        return found[1]
    body = _shape(report)
    if len(_shaped) >= 64:
        _shaped.clear()
    _shaped[id(report)] = (report, body)
    return body


def implicit_default_group() -> bool:
    """Whether the nodes in no resource group form the implicit group "default" (module
    docstring): no group of that name, and no group at all or an alive node in none. Two queries."""
    if ResourceGroup.objects.filter(name=DEFAULT_GROUP).exists():
        return False
    return not ResourceGroup.objects.exists() or Node.objects.filter(status=NodeStatus.ALIVE, resource_group=None).exists()


def fragmentation_group(name: str) -> ResourceGroup | None:
    """The resource group of `name` for an apply; None for the implicit "default". Raises
    ApplicationError (400) for a name that is neither."""
    group = ResourceGroup.objects.filter(name=name).first()
    if group is None and not (name == DEFAULT_GROUP and implicit_default_group()):
        raise ApplicationError(f"group: no resource group {name!r}", field_errors={"group": ["a resource group's name"]})
    return group


def _groups(request) -> list[ResourceGroup | None]:
    """Every resource group and the implicit "default" (None) where there is one, by name, or
    those named `?group=` (a filter: none for an unknown name)."""
    if not request.user.is_staff:
        raise PermissionDenied("Only administrators may see the fragmentation map.")
    name = request.query_params.get("group")
    groups = ResourceGroup.objects.order_by("name")
    found: list[ResourceGroup | None] = list(groups if name is None else groups.filter(name=name))
    if name in (None, DEFAULT_GROUP) and implicit_default_group():
        found.append(None)
        found.sort(key=lambda g: g.name if g is not None else DEFAULT_GROUP)
    return found


@extend_schema(
    summary="Fragmentation map and compaction plan",
    tags=["scheduler"],
    parameters=[
        OpenApiParameter(
            "group",
            OpenApiTypes.STR,
            description='only the resource group of this name ("default": the nodes in no group where no group has '
            "that name; without it every one; an unknown name: none)",
        )
    ],
    responses={200: FragmentationSerializer(many=True), 403: ErrorSerializer},
    description="Per resource group (administrators), and for the nodes in no group as the implicit group "
    "'default' (`implicit`: true) when no group has that name: free fGPU by device, stranded capacity (free but unusable by "
    "any request shape launched in the group in the last 7 days), the largest request that fits now, "
    "and the compaction plan for the largest waiting session: the fewest preemptible sessions to move "
    "(stop and start again elsewhere) so that it fits, with its cost. Non-preemptible sessions are "
    "never moved.",
)
@api_view(["GET"])
def fragmentation_view(request):
    return Response([_shape_kept(fragmentation_report_kept(group=g)) for g in _groups(request)])


class CompactionApplySerializer(serializers.Serializer):
    group = serializers.CharField(
        max_length=64, help_text='the resource group\'s name ("default" for the nodes in no group, where no group has that name)'
    )
    expected = serializers.ListField(
        child=serializers.UUIDField(),
        required=False,
        allow_null=True,
        default=None,
        max_length=1000,
        help_text="the moved sessions' ids you saw (GET /api/v1/fragmentation/); "
        'another plan now is refused with 409 "plan-changed"',
    )


class MovedSerializer(serializers.Serializer):
    session = serializers.UUIDField(help_text="the moved session (now under notice: stopped at preempt_at)")
    restarted_as = serializers.UUIDField(
        allow_null=True,
        help_text="null: it runs until preempt_at, then is stopped and launched again as a new PENDING "
        "session (the moved session's requeued_as)",
    )
    to_node = serializers.CharField(help_text="where the plan expects it to start again")
    preempt_at = serializers.DateTimeField(help_text="when it is stopped: now + FGPU_PREEMPTION_GRACE_SECONDS")


class CompactionAppliedSerializer(serializers.Serializer):
    target = serializers.UUIDField(help_text="the waiting session the moves make room for")
    node = serializers.CharField(help_text="where it fits once they are gone")
    moved = MovedSerializer(many=True)
    work_lost = serializers.FloatField(help_text="fGPU-seconds of the moved sessions' work")


@extend_schema(
    summary="Apply a compaction plan",
    tags=["scheduler"],
    request=CompactionApplySerializer,
    examples=[
        OpenApiExample(
            "The plan you saw",
            request_only=True,
            value={"group": "default", "expected": ["5b0f3c1e-8a8e-4d7e-9f6a-2f4f6b1e7c11"]},
        )
    ],
    responses={200: CompactionAppliedSerializer, 403: ErrorSerializer, 409: ErrorSerializer},
    description="Applies the group's plan as it stands now (administrators; logged in the admin history): each moved "
    "session gets a preemption notice (its signal, a line in its log, `preempt_at`), is stopped at `preempt_at` and "
    "starts again as a new session (`requeued_as`) unless launched with `requeue: false`. "
    '`expected`: the moved sessions\' ids you saw; 409 "plan-changed" when the plan differs now, '
    '409 "nothing-to-apply" when nothing waits or nothing needs moving.',
)
@api_view(["POST"])
def fragmentation_apply_view(request):
    if not request.user.is_staff:
        raise PermissionDenied("Only administrators may apply a compaction plan.")
    data = CompactionApplySerializer(data=request.data)
    data.is_valid(raise_exception=True)
    group = fragmentation_group(data.validated_data["group"])
    expected = data.validated_data["expected"]
    done = compaction_apply(
        admin=request.user, group=group, expected=[str(e) for e in expected] if expected is not None else None
    )
    return Response(CompactionAppliedSerializer(done).data)
