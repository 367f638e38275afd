"""REST API of the queue's answers (issue 17.3, 17.5): a pending session's ETA
(`GET /api/v1/sessions/<id>/eta/`) and the administrators' what-if
(`POST /api/v1/scheduler/what-if/`). Both replay the scheduler (`sessions.scheduling.eta`); nothing is
written. Times are ISO 8601 (UTC)."""

from __future__ import annotations

import json

from django.utils import timezone
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import IsAdminUser
from rest_framework.response import Response

from accelerators.allocation import cluster
from accelerators.allocation import replay as pure
from accelerators.models import Node, ResourceGroup
from common.api_support import ErrorSerializer
from common.errors import ApplicationError
from sessions.scheduling import eta
from sessions.scheduling import fairshare
from sessions.models import Project, SessionStatus
from sessions.policy.images import image_for_launch
from sessions.scheduling.placement import request_validate
from sessions.selectors import session_get_for
from sessions.api.serializers import PreviewSerializer


ETA_OUTCOMES = ["now", "estimate", "unknown", "never"]  # sessions.scheduling.eta.band_outcome
WHAT_IF_CHANGES = ["sooner", "later", "same", "unknown"]  # sessions.scheduling.eta.WhatIfRow.change


class FitsAfterSerializer(serializers.Serializer):
    session = serializers.UUIDField(allow_null=True, help_text="its id; null for another user's session")
    name = serializers.CharField(allow_null=True, help_text="its name; null for another user's session")
    owner = serializers.CharField(allow_null=True, help_text="its owner's username (administrators only; else null)")
    node = serializers.CharField(help_text="the node it runs on")
    ends_earliest = serializers.DateTimeField(allow_null=True, help_text="its earliest expected end; null: unknown")
    ends_latest = serializers.DateTimeField(allow_null=True, help_text="its latest expected end; null: unknown")
    basis = serializers.CharField(
        help_text='why that end: "maximum lifetime of 8 h", "batch history of this image '
        '(12 runs)", "idle timeout of 1 h", "reclamation deadline (…)", '
        '"no declared end (…)"'
    )


class MigOfferSerializer(serializers.Serializer):
    profile = serializers.CharField(help_text='a MIG profile ("2g.20gb") or static slice name')
    memory = serializers.IntegerField(help_text="its memory, bytes")


class EtaSerializer(serializers.Serializer):
    session = serializers.UUIDField()
    outcome = serializers.ChoiceField(
        ETA_OUTCOMES,
        help_text=(
            '"now": it fits now and starts at the next scheduler pass; "estimate": it starts between `earliest` and '
            '`latest` (latest null: unknown, `reason` says why); "unknown": no estimate (`reason`); "never": no node '
            "could ever hold it (`reason`)"
        ),
    )
    earliest = serializers.DateTimeField(
        allow_null=True, help_text="the earliest start: every running session ends at its earliest expected end"
    )
    latest = serializers.DateTimeField(
        allow_null=True, help_text="the latest start: every running session ends at its latest expected end; null: unknown"
    )
    reason = serializers.CharField(allow_blank=True, help_text="why there is no estimate, or no latest start")
    position = serializers.IntegerField(help_text="its place in the queue, 1 first (priority, fair share, arrival)")
    waiting_reason = serializers.CharField(allow_blank=True, help_text="why the last scheduler pass left it waiting, per node")
    fits_now = serializers.BooleanField(help_text="the cluster has room for it now (the queue aside)")
    fits_after = FitsAfterSerializer(
        many=True,
        help_text="the fewest running sessions, in order of their expected "
        "end, whose ends would make room for it; empty when it "
        "fits now or when no ends would",
    )
    computed_at = serializers.DateTimeField()
    mig_now = MigOfferSerializer(
        many=True,
        required=False,
        help_text="for a MIG request that does not fit now: smaller MIG profiles it could get now, largest first "
        "(launching again with one of them starts sooner); empty otherwise",
    )


class PreviewBandSerializer(serializers.Serializer):
    outcome = serializers.ChoiceField(
        ETA_OUTCOMES,
        help_text='as a pending session\'s ETA: "now" (it fits now and starts at the next pass), "estimate" (between '
        '`earliest` and `latest`; latest null: unknown), "unknown" (`reason`), "never" (it would be refused)',
    )
    earliest = serializers.DateTimeField(allow_null=True)
    latest = serializers.DateTimeField(allow_null=True)
    reason = serializers.CharField(allow_blank=True)
    position = serializers.IntegerField(help_text="its place in the queue were it launched now, 1 first (0: refused)")


class PreviewWithEtaSerializer(PreviewSerializer):
    eta = PreviewBandSerializer(
        help_text="when it would start were it launched now: the queue replayed as a pending session's ETA is, with "
        "this request joining it in its place (priority, fair share, arrival)"
    )


def preview_eta(*, user, fields: dict, preview: dict) -> dict:
    """`PreviewBandSerializer`'s data for a launch `preview` (`sessions.admission.launch.launch_preview`'s
    answer) of the launch body's `fields` (`launch_with_preset`'s): "never" with the preview's
    reason when it would be refused, else `eta.request_eta`'s band and place."""
    if preview["outcome"] == "refused":
        return {"outcome": "never", "earliest": None, "latest": None, "reason": preview["reason"], "position": 0}
    request, _ = request_validate(resources=fields["resources"])
    image = image_for_launch(reference=fields.get("image"), slot=request.slot)
    band, position, outcome = eta.request_eta(
        owner=user,
        request=request,
        image=image,
        command=fields.get("command") or "",
        priority=fields.get("priority") or 0,
        fits_now=preview["fits_now"],
    )
    if outcome == "now" or (preview["fits_now"] and band.earliest is None):
        now = timezone.now()
        return {"outcome": "now", "earliest": now, "latest": now, "reason": "", "position": position}
    return {
        "outcome": outcome,
        "earliest": eta.as_datetime(band.earliest),
        "latest": eta.as_datetime(band.latest),
        "reason": band.reason,
        "position": position,
    }


NOT_PENDING = OpenApiResponse(ErrorSerializer, description='The session is not PENDING (type "not-pending").')


def eta_shape(answer: eta.Eta, *, session_id, user) -> dict:
    """`EtaSerializer`'s data for `answer`: another user's session in `fits_after` shows only its
    node and end (administrators see every name and owner)."""

    def shown(row: eta.FitsAfter) -> dict:
        visible = user.is_staff or row.session.owner_id == user.pk
        return {
            "session": row.session.pk if visible else None,
            "name": row.session.name if visible else None,
            "owner": row.session.owner.get_username() if user.is_staff else None,
            "node": row.node,
            "ends_earliest": eta.as_datetime(row.end.earliest),
            "ends_latest": eta.as_datetime(row.end.latest),
            "basis": row.end.basis,
        }

    return EtaSerializer(
        {
            "session": session_id,
            "outcome": answer.outcome,
            "earliest": answer.earliest,
            "latest": answer.latest,
            "reason": answer.reason,
            "position": answer.position,
            "waiting_reason": answer.waiting_reason,
            "fits_now": answer.fits_now,
            "fits_after": [shown(r) for r in answer.fits_after],
            "computed_at": answer.computed_at,
            "mig_now": [{"profile": o.profile, "memory": o.memory} for o in answer.mig_now],
        }
    ).data


@extend_schema(
    summary="When will a pending session start?",
    tags=["sessions"],
    responses={
        200: EtaSerializer,
        404: OpenApiResponse(ErrorSerializer, description="No such session of yours."),
        409: NOT_PENDING,
    },
    description="An estimate from a replay of the scheduler (the same placement as its passes) over the running "
    "sessions' expected ends: their resource group's maximum lifetime and idle timeout, the idle "
    "reclamation deadline they were warned of, and for batch sessions the runtimes of their owner's "
    "earlier batch sessions (5th–95th percentile). A band: `earliest` if every running session ends "
    "at its earliest expected end, `latest` if at its latest (null: some have no known end). Also the "
    "reason per node the last pass gave and which running sessions' ends would make room now. MIG "
    "requests are replayed with the scheduler's MIG choice: an ending session's GPU instance becomes idle "
    "(reused, or on a dynamic node destroyed for its slices), a static slice comes free; `mig_now` names "
    "smaller MIG profiles free now. Not replayed: sessions launched later, terminations by hand.",
    examples=[
        OpenApiExample(
            "Waiting for one session",
            response_only=True,
            value={
                "session": "0b7e3c1e-4d4e-4c8a-9d55-3f0f7d1f2a10",
                "outcome": "estimate",
                "earliest": "2026-11-26T09:40:00Z",
                "latest": "2026-11-26T10:30:00Z",
                "reason": "",
                "position": 2,
                "waiting_reason": "waiting for capacity: n1: device 0: 0.00 fGPU free, 1.00 asked",
                "fits_now": False,
                "fits_after": [
                    {
                        "session": None,
                        "name": None,
                        "owner": None,
                        "node": "n1",
                        "ends_earliest": "2026-11-26T09:40:00Z",
                        "ends_latest": "2026-11-26T10:30:00Z",
                        "basis": "batch history of this image (12 runs)",
                    }
                ],
                "computed_at": "2026-11-26T09:00:00Z",
                "mig_now": [],
            },
        )
    ],
)
@api_view(["GET"])
def session_eta_view(request, session_id):
    """`{"session", "outcome", "earliest", "latest", "reason", "position", "waiting_reason", "fits_now", "fits_after",
    "computed_at", "mig_now"}`; 404 for a session the caller may not see, 409 for one not PENDING."""
    session = session_get_for(user=request.user, session_id=session_id)
    if session.status != SessionStatus.PENDING:
        raise ApplicationError(
            f"session {session.name} is {session.status}, not waiting: no ETA",
            type="not-pending",
            title="Not pending",
            status=409,
        )
    return Response(eta_shape(eta.session_eta(session=session), session_id=session.pk, user=request.user))


# --- what-if ------------------------------------------------------------------------------------------


WHAT_IF_MAX_NAMES = 1000  # projects, resource groups or nodes one what-if may name


class WhatIfRequestSerializer(serializers.Serializer):
    """The what-if's body: any of its fields, nothing else (an unknown key is a 400 naming it).
    Every number is bounded: weights 1 … fairshare.MAX_SHARE_WEIGHT (Project.share_weight's
    column), the backfill limit 0 … 10000, at most WHAT_IF_MAX_NAMES names per field."""

    share_weights = serializers.DictField(
        child=serializers.IntegerField(min_value=1, max_value=fairshare.MAX_SHARE_WEIGHT),
        required=False,
        help_text=f'project name → fair-share weight (1 … {fairshare.MAX_SHARE_WEIGHT}), e.g. {{"vision": 4}}',
    )
    policies = serializers.DictField(
        child=serializers.ChoiceField(list(cluster.POLICIES)),
        required=False,
        help_text='resource group name ("" for requests naming none) → placement policy, e.g. {"default": "spread"}',
    )
    backfill_limit = serializers.IntegerField(
        min_value=0, max_value=10000, required=False, help_text="FGPU_BACKFILL_LIMIT's value (0: strict first in, first out)"
    )
    drain = serializers.ListField(
        child=serializers.CharField(max_length=64),
        required=False,
        max_length=WHAT_IF_MAX_NAMES,
        help_text="node names: they take no new session and their running sessions are stopped and requeued "
        '(as `kubectl drain`), e.g. ["gpu-node-3"]',
    )

    def to_internal_value(self, data):
        if isinstance(data, dict):
            unknown = sorted(str(k) for k in data if k not in self.fields)
            if unknown:
                raise serializers.ValidationError(
                    {k: [f"unknown field (known: {', '.join(self.fields)})"] for k in unknown}
                    | {"non_field_errors": [f"unknown field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}"]}
                )
        return super().to_internal_value(data)

    @staticmethod
    def _bounded(value):
        if len(value) > WHAT_IF_MAX_NAMES:
            raise serializers.ValidationError(f"at most {WHAT_IF_MAX_NAMES} names")
        return value

    def validate_share_weights(self, value):
        self._bounded(value)
        unknown = sorted(set(value) - set(Project.objects.filter(name__in=list(value)).values_list("name", flat=True)))
        if unknown:
            raise serializers.ValidationError(f"no project {', '.join(map(repr, unknown))}")
        return value

    def validate_policies(self, value):
        self._bounded(value)
        names = set(ResourceGroup.objects.filter(name__in=list(value)).values_list("name", flat=True)) | {""}
        unknown = sorted(set(value) - names)
        if unknown:
            raise serializers.ValidationError(f"no resource group {', '.join(map(repr, unknown))}")
        return value

    def validate_drain(self, value):
        names = set(Node.objects.filter(name__in=value).values_list("name", flat=True))
        unknown = sorted(set(value) - names)
        if unknown:
            raise serializers.ValidationError(f"no node {', '.join(map(repr, unknown))}")
        return sorted(set(value))

    def validate(self, attrs):
        if not any(attrs.get(k) not in (None, {}, []) for k in ("share_weights", "policies", "backfill_limit", "drain")):
            raise serializers.ValidationError("say what to change: share_weights, policies, backfill_limit or drain")
        return attrs


class BandSerializer(serializers.Serializer):
    outcome = serializers.ChoiceField(ETA_OUTCOMES)
    earliest = serializers.DateTimeField(allow_null=True)
    latest = serializers.DateTimeField(allow_null=True)
    reason = serializers.CharField(allow_blank=True)


class WhatIfRowSerializer(serializers.Serializer):
    session = serializers.UUIDField()
    name = serializers.CharField()
    owner = serializers.CharField()
    position_today = serializers.IntegerField()
    position_what_if = serializers.IntegerField()
    today = BandSerializer()
    what_if = BandSerializer()
    change = serializers.ChoiceField(WHAT_IF_CHANGES, help_text="the what-if's start against today's (earliest, then latest)")


class WhatIfMoveSerializer(serializers.Serializer):
    session = serializers.UUIDField()
    name = serializers.CharField()
    owner = serializers.CharField()
    from_node = serializers.CharField(help_text="the drained node it runs on now")
    what_if = BandSerializer(help_text="when it would start again, requeued by arrival with its request")
    to_node_earliest = serializers.CharField(
        allow_blank=True, help_text="where it would start again if the running sessions end early (blank: nowhere)"
    )
    to_node_latest = serializers.CharField(
        allow_blank=True, help_text="where it would start again if they end late (blank: nowhere)"
    )


class WhatIfSerializer(serializers.Serializer):
    computed_at = serializers.DateTimeField()
    changes = WhatIfRequestSerializer()
    sessions = WhatIfRowSerializer(many=True, help_text="every pending session, in today's queue order")
    moves = WhatIfMoveSerializer(
        many=True, help_text="the running sessions a drain stops and requeues, in arrival order (empty without drain)"
    )


def band_shape(band: pure.Band, now: float) -> dict:
    return {
        "outcome": eta.band_outcome(band, now),
        "earliest": eta.as_datetime(band.earliest),
        "latest": eta.as_datetime(band.latest),
        "reason": band.reason,
    }


_shaped: dict[tuple, tuple[object, dict]] = {}  # (id(answer), changes) → (the answer, its body)


def what_if_shape_kept(answer: eta.WhatIf, *, changes: dict, now) -> dict:
    """`what_if_shape`, made once per kept answer (`eta.scheduler_what_if` keeps them until a
    change) and changes: asked again, the body of 1,000 rows is not shaped again."""
    key = (id(answer), json.dumps(changes, sort_keys=True, default=str), now)
    found = _shaped.get(key)
    if found is not None and found[0] is answer:
        return found[1]
    body = what_if_shape(answer, changes=changes, now=now)
    if len(_shaped) >= 64:
        _shaped.clear()
    _shaped[key] = (answer, body)
    return body


def what_if_shape(answer: eta.WhatIf, *, changes: dict, now) -> dict:
    """`WhatIfSerializer`'s data."""
    epoch = now.timestamp()
    return WhatIfSerializer(
        {
            "computed_at": now,
            "changes": changes,
            "sessions": [
                {
                    "session": r.session.pk,
                    "name": r.session.name,
                    "owner": r.session.owner.get_username(),
                    "position_today": r.position_today,
                    "position_what_if": r.position_what_if,
                    "today": band_shape(r.today, epoch),
                    "what_if": band_shape(r.what_if, epoch),
                    "change": r.change,
                }
                for r in answer.rows
            ],
            "moves": [
                {
                    "session": m.session.pk,
                    "name": m.session.name,
                    "owner": m.session.owner.get_username(),
                    "from_node": m.from_node,
                    "what_if": band_shape(m.what_if, epoch),
                    "to_node_earliest": m.to_early,
                    "to_node_latest": m.to_late,
                }
                for m in answer.moves
            ],
        }
    ).data


@extend_schema(
    summary="What if the scheduler's rules changed?",
    tags=["scheduler"],
    request=WhatIfRequestSerializer,
    responses={
        200: WhatIfSerializer,
        400: OpenApiResponse(
            ErrorSerializer,
            description="A malformed body, an unknown key (named), a number out of its bounds, an unknown project, "
            "resource group or node, or nothing to change.",
        ),
        403: OpenApiResponse(ErrorSerializer, description="Administrators only."),
    },
    description="Replays the current queue twice — under today's rules and under the body's changes (projects' "
    "fair-share weights, resource groups' placement policies, the backfill limit, nodes drained) — and answers each "
    "pending session's place and start band under both, and whether it would start sooner or later; for a drain, "
    "each running session on the drained nodes that would be stopped and requeued (`moves`): when and where it "
    "would start again. Nothing is changed. Quotas are not among the changes: the scheduler does not apply them to a "
    "session already waiting (they are checked at launch, where waiting sessions count).",
    examples=[
        OpenApiExample("Weights", request_only=True, value={"share_weights": {"nlp": 4}}),
        OpenApiExample("Policy", request_only=True, value={"policies": {"default": "spread"}}),
        OpenApiExample("Drain", request_only=True, value={"drain": ["gpu-node-3"]}),
    ],
)
@api_view(["POST"])
@permission_classes([IsAdminUser])
def what_if_view(request):
    """`{"share_weights", "policies", "backfill_limit", "drain"}` → `{"computed_at", "changes", "sessions": [...],
    "moves": [...]}`."""
    body = WhatIfRequestSerializer(data=request.data)
    body.is_valid(raise_exception=True)
    changes = body.validated_data
    answer = eta.scheduler_what_if(
        weights=changes.get("share_weights"),
        policies=changes.get("policies"),
        backfill_limit=changes.get("backfill_limit"),
        drain=frozenset(changes.get("drain") or ()),
    )
    return Response(what_if_shape_kept(answer, changes=changes, now=answer.computed_at or timezone.now()))
