"""REST API of a node's drain (issue 37.4; `accelerators.drain`):
`POST /api/v1/nodes/<name>/drain/` with `{"evict": bool, "reason": str}` and
`POST /api/v1/nodes/<name>/undrain/`, administrators only. Both are idempotent and answer the
node's drain state (`DrainStateSerializer`): draining a draining node is a 200 with its state."""

from __future__ import annotations

from django.http import Http404
from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import IsAdminUser
from rest_framework.response import Response

from accelerators.drain import MAX_REASON_CHARS, DrainState, node_drain, node_undrain
from accelerators.models import Node
from common.api_support import ErrorSerializer


class DrainRequestSerializer(serializers.Serializer):
    evict = serializers.BooleanField(
        default=False,
        help_text="true: running sessions get the preemption notice and grace "
        "(FGPU_PREEMPTION_GRACE_SECONDS), then are stopped and requeued as new sessions; false: they run to their end",
    )
    reason = serializers.CharField(
        default="", allow_blank=True, max_length=MAX_REASON_CHARS, help_text="why, shown with the state (free text)"
    )


class DrainStateSerializer(serializers.Serializer):
    node = serializers.CharField(help_text="the node's name")
    state = serializers.ChoiceField(
        choices=["in service", "draining", "drained"],
        help_text='"draining" while any of its sessions is active (SCHEDULED to TERMINATING), then "drained"',
    )
    # DRF's metaclass takes it as a field; the stubs see Field.label, a string.
    label = serializers.CharField(  # type: ignore[assignment]
        help_text='as the admin shows it: "draining: 2 sessions left", "drained", "in service"'
    )
    sessions_left = serializers.IntegerField(help_text="its active sessions")
    evict = serializers.BooleanField(help_text="the drain evicts its running sessions (false in service)")
    reason = serializers.CharField(allow_blank=True, help_text="the drain's reason (empty in service)")
    by = serializers.CharField(allow_blank=True, help_text="the administrator who drained it (empty in service)")
    since = serializers.DateTimeField(allow_null=True, help_text="when the drain began; null in service")


def _answer(node: Node, state: DrainState) -> Response:
    return Response({"node": node.name, **state.as_dict()})


@extend_schema(
    summary="Drain a node (administrators)",
    tags=["inventory"],
    request=DrainRequestSerializer,
    responses={200: DrainStateSerializer, 400: ErrorSerializer, 403: ErrorSerializer, 404: ErrorSerializer},
    examples=[
        OpenApiExample("Cordon: let running sessions finish", request_only=True, value={"reason": "driver upgrade"}),
        OpenApiExample("Evict: notice, grace, requeue", request_only=True, value={"evict": True, "reason": "disk swap"}),
    ],
    description="As `kubectl drain` or Slurm's DRAIN: no new session is placed on the node (the scheduler, the "
    "launch preview, ETAs and the what-if leave it out); its running sessions go on, or with `evict` each gets the "
    "preemption notice (its terminal and log, its signal) and FGPU_PREEMPTION_GRACE_SECONDS of grace, then is "
    "stopped and requeued as a new session. Its agent keeps heartbeating; the drain outlives restarts. Idempotent: "
    "draining a draining node answers its state (`evict` true turns eviction on; a reason replaces the last).",
)
@api_view(["POST"])
@permission_classes([IsAdminUser])
def node_drain_view(request, name: str):
    """The node's DrainStateSerializer after `accelerators.drain.node_drain`."""
    body = DrainRequestSerializer(data=request.data)
    body.is_valid(raise_exception=True)
    try:
        node, state = node_drain(
            node_name=name,
            evict=body.validated_data["evict"],
            reason=body.validated_data["reason"],
            by=request.user.get_username(),
        )
    except Node.DoesNotExist:
        raise Http404 from None
    return _answer(node, state)


@extend_schema(
    summary="Undrain a node (administrators)",
    tags=["inventory"],
    request=None,
    responses={200: DrainStateSerializer, 403: ErrorSerializer, 404: ErrorSerializer},
    description="Puts a drained or draining node back in service: new sessions may be placed on it again, and "
    "eviction notices that have not run out are taken back. Idempotent: a node in service answers its state.",
)
@api_view(["POST"])
@permission_classes([IsAdminUser])
def node_undrain_view(request, name: str):
    """The node's DrainStateSerializer after `accelerators.drain.node_undrain`."""
    try:
        node, state = node_undrain(node_name=name, by=request.user.get_username())
    except Node.DoesNotExist:
        raise Http404 from None
    return _answer(node, state)
