"""`GET /api/v1/fragmentation/` (administrators): each resource group's fragmentation map and
compaction plan (sessions.compaction); `POST /api/v1/fragmentation/apply/` applies one group's
plan, as the admin page's button does. Amounts in fGPU (text), work in fGPU-seconds."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.decorators import api_view
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response

from accelerators.allocation.units import amount_text
from accelerators.models import ResourceGroup
from console.api_support import ErrorSerializer
from console.errors import ApplicationError
from sessions.compaction import compaction_apply, fragmentation_report
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
        "group": report.name,
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


def _groups(request) -> list[ResourceGroup]:
    """Every resource group, or those named `?group=` (a filter: none for an unknown name)."""
    if not request.user.is_staff:
        raise PermissionDenied("Only administrators may see the fragmentation map.")
    name = request.query_params.get("group")
    groups = ResourceGroup.objects.order_by("name")
    return list(groups if name is None else groups.filter(name=name))


@extend_schema(
    summary="Fragmentation map and compaction plan",
    tags=["scheduler"],
    parameters=[
        OpenApiParameter(
            "group",
            OpenApiTypes.STR,
            description="only the resource group of this name (default: every one; an unknown name: none)",
        )
    ],
    responses={200: FragmentationSerializer(many=True), 403: ErrorSerializer},
    description="Per resource group (administrators): free fGPU by device, stranded capacity (free but unusable by "
    "any request shape launched in the group in the last 7 days), the largest request that fits now, "
    "and the compaction plan for the largest waiting session: the fewest preemptible sessions to move "
    "(stop and start again elsewhere) so that it fits, with its cost. Non-preemptible sessions are "
    "never moved.",
)
@api_view(["GET"])
def fragmentation_view(request):
    return Response([_shape(fragmentation_report(group=g)) for g in _groups(request)])


class CompactionApplySerializer(serializers.Serializer):
    group = serializers.CharField(max_length=64, help_text="the resource group's name")
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
    group = ResourceGroup.objects.filter(name=data.validated_data["group"]).first()
    if group is None:
        raise ApplicationError(
            f"group: no resource group {data.validated_data['group']!r}", field_errors={"group": ["a resource group's name"]}
        )
    expected = data.validated_data["expected"]
    preempt_at = serializers.DateTimeField(help_text="when it is stopped: now + FGPU_PREEMPTION_GRACE_SECONDS")
    done = compaction_apply(
        admin=request.user, group=group, expected=[str(e) for e in expected] if expected is not None else None
    )
    return Response(CompactionAppliedSerializer(done).data)
