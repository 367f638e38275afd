"""Usage in the REST API (issue 15): the accounting report (`GET /api/v1/usage/`, JSON or CSV),
a session's history for its chart (`GET /api/v1/sessions/<id>/usage/`), the newest sample of
sessions for the list's gauges (`GET /api/v1/usage/latest/`) and a node's devices' history
(`GET /api/v1/nodes/<name>/usage/`) and what holds its GPUs now (`GET /api/v1/nodes/<name>/processes/`,
administrators). Thin: parse,
fetch with the permission check, call one selector."""

from __future__ import annotations

import csv
import io
import time
import uuid
from datetime import datetime, time as dtime, timedelta
from datetime import timezone as dt_timezone

from django.shortcuts import get_object_or_404
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import renderers, serializers
from rest_framework.decorators import api_view, permission_classes, renderer_classes
from rest_framework.permissions import IsAdminUser
from rest_framework.response import Response

from common.api_async import AwaitedResponse, awaiting_view
from common.api_support import ErrorSerializer
from common.errors import ApplicationError
from sessions.selectors import session_get_for
from accelerators.models import Node
from usage.processes import node_processes_check, node_processes_wait
from usage.selectors import GROUPS, latest_session_usage, node_device_series, session_series, usage_report

MAX_RANGE = timedelta(days=400)
CSV_FIELDS = ("key", "gpu_hours", "fgpu_hours", "gpu_memory_gib_hours", "used_gpu_hours", "used_gpu_memory_gib_hours", "sessions")


class CSVRenderer(renderers.BaseRenderer):
    """The report's rows as CSV (`?format=csv` or `Accept: text/csv`), a header line first; an
    error answer stays JSON text."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if not isinstance(data, dict) or "rows" not in data:
            return renderers.JSONRenderer().render(data)
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([data["group_by"], *CSV_FIELDS[1:]])
        for row in data["rows"]:
            writer.writerow([row[name] for name in CSV_FIELDS])
        return out.getvalue().encode()


class UsageRowSerializer(serializers.Serializer):
    key = serializers.CharField(help_text='the username, project name ("" for owners in no project) or node name')
    gpu_hours = serializers.DecimalField(
        max_digits=20, decimal_places=6, help_text="granted GPU-hours: time × fraction of the device's memory held"
    )
    fgpu_hours = serializers.DecimalField(max_digits=20, decimal_places=6, help_text="granted fGPU × hours")
    gpu_memory_gib_hours = serializers.DecimalField(max_digits=20, decimal_places=6, help_text="granted GiB × hours")
    used_gpu_hours = serializers.DecimalField(
        max_digits=20, decimal_places=6, help_text="measured GPU utilisation × hours (100 % for an hour = 1)"
    )
    used_gpu_memory_gib_hours = serializers.DecimalField(
        max_digits=20, decimal_places=6, help_text="measured GPU memory GiB × hours"
    )
    sessions = serializers.IntegerField(help_text="sessions that held or used something in the range")


UsageReportSerializer = inline_serializer(
    "UsageReport",
    fields={
        "from": serializers.DateTimeField(help_text="the range's start (inclusive)"),
        "to": serializers.DateTimeField(help_text="the range's end (exclusive)"),
        "group_by": serializers.ChoiceField(choices=GROUPS),
        "rows": UsageRowSerializer(many=True),
    },
)


def _moment(name: str, raw: str | None, default: datetime) -> datetime:
    """`raw` as an aware datetime (ISO 8601; a date alone is its midnight UTC). Raises ApplicationError."""
    if raw is None:
        return default
    try:
        value = parse_datetime(raw)
        if value is None:
            day = parse_date(raw)
            value = None if day is None else datetime.combine(day, dtime.min)
    except ValueError:
        value = None
    if value is None:
        raise ApplicationError(
            f"{name}: {raw!r} is not an ISO 8601 date or time",
            field_errors={name: ["an ISO 8601 date (2026-01-31) or time (2026-01-31T12:00:00Z)"]},
        )
    return value if timezone.is_aware(value) else value.replace(tzinfo=dt_timezone.utc)


@extend_schema(
    summary="GPU-hours per user, project or node",
    tags=["usage"],
    parameters=[
        OpenApiParameter("from", OpenApiTypes.STR, description="start, ISO 8601 date or time (default: 30 days before `to`)"),
        OpenApiParameter("to", OpenApiTypes.STR, description="end, exclusive (default: now); at most 400 days after `from`"),
        OpenApiParameter("group_by", OpenApiTypes.STR, enum=list(GROUPS), description="default: user"),
        OpenApiParameter("format", OpenApiTypes.STR, enum=["json", "csv"], description="csv: the rows as CSV"),
    ],
    responses={
        200: UsageReportSerializer,
        400: OpenApiResponse(ErrorSerializer, description="a bad parameter"),
        404: OpenApiResponse(ErrorSerializer, description="`format` names no format but json and csv"),
    },
    examples=[
        OpenApiExample(
            "by user",
            response_only=True,
            value={
                "from": "2026-01-01T00:00:00Z",
                "to": "2026-02-01T00:00:00Z",
                "group_by": "user",
                "rows": [
                    {
                        "key": "alice",
                        "gpu_hours": "12.500000",
                        "fgpu_hours": "25.000000",
                        "gpu_memory_gib_hours": "100.000000",
                        "used_gpu_hours": "3.250000",
                        "used_gpu_memory_gib_hours": "40.125000",
                        "sessions": 3,
                    }
                ],
            },
        )
    ],
    description="Accounting over [from, to): granted figures from the sessions' allocations (from when each was "
    "granted to its release), used figures from the agents' samples. Administrators see every "
    "session, others their own. A session whose owner is in two projects counts in both.",
)
@api_view(["GET"])
@renderer_classes([renderers.JSONRenderer, renderers.BrowsableAPIRenderer, CSVRenderer])
def usage_view(request):
    """The accounting report (usage.selectors.usage_report)."""
    now = timezone.now()
    end = _moment("to", request.query_params.get("to"), now)
    start = _moment("from", request.query_params.get("from"), end - timedelta(days=30))
    if request.query_params.get("format") == "":  # DRF ignores an empty one; the schema's enum says json or csv
        raise ApplicationError("format: '' is not one of json, csv", field_errors={"format": ["one of json, csv"]})
    group_by = request.query_params.get("group_by", "user")  # given empty: refused, as the schema's enum says
    if group_by not in GROUPS:
        raise ApplicationError(
            f"group_by: {group_by!r} is not one of {', '.join(GROUPS)}",
            field_errors={"group_by": [f"one of {', '.join(GROUPS)}"]},
        )
    if end <= start:
        raise ApplicationError("to must be after from", field_errors={"to": ["after from"]})
    if end - start > MAX_RANGE:
        raise ApplicationError("the range is longer than 400 days", field_errors={"from": ["at most 400 days before to"]})
    rows = usage_report(user=request.user, start=start, end=end, group_by=group_by, now=now)
    response = Response({"from": start, "to": end, "group_by": group_by, "rows": rows})
    if getattr(request, "accepted_renderer", None) is not None and request.accepted_renderer.format == "csv":
        response["Content-Disposition"] = f'attachment; filename="usage-{group_by}-{start:%Y%m%d}-{end:%Y%m%d}.csv"'
    return response


class SessionUsageSerializer(serializers.Serializer):
    t = serializers.ListField(child=serializers.IntegerField(), help_text="epoch seconds")
    gpu_memory = serializers.ListField(child=serializers.IntegerField(allow_null=True), help_text="bytes; null: a gap")
    gpu_util = serializers.ListField(child=serializers.IntegerField(allow_null=True), help_text="percent")
    cpu = serializers.ListField(child=serializers.IntegerField(allow_null=True), help_text="milli-cores")
    mem = serializers.ListField(child=serializers.IntegerField(allow_null=True), help_text="bytes")
    resolution = serializers.ChoiceField(
        choices=["raw", "5m", "1h"], help_text="raw: every sample; 5m: 5-minute means; 1h: hourly means"
    )
    gpu_memory_limit = serializers.IntegerField(help_text="bytes of GPU memory granted (all devices)")
    deadline = serializers.DateTimeField(allow_null=True, help_text="when idle reclamation terminates it, if warned")
    deadline_reason = serializers.CharField(allow_blank=True)
    storage = serializers.IntegerField(
        allow_null=True, help_text="bytes in its home and container layer at its node's newest measure; null: none yet"
    )
    storage_limit = serializers.IntegerField(
        allow_null=True, help_text="bytes: the storage limit its node enforces on that (it stops the session past it)"
    )
    storage_t = serializers.IntegerField(allow_null=True, help_text="epoch seconds of that measure's sample")


EPOCH_SCHEMA = {"type": "integer", "minimum": 0, "maximum": 2**40}


def _epoch(name: str, raw: str | None, default: int) -> int:
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 2**40:
        raise ApplicationError(f"{name}: {raw!r} is not epoch seconds", field_errors={name: ["epoch seconds"]})
    return value


@extend_schema(
    summary="A session's usage history",
    tags=["usage"],
    parameters=[
        OpenApiParameter("session_id", OpenApiTypes.UUID, OpenApiParameter.PATH),
        OpenApiParameter("since", EPOCH_SCHEMA, description="epoch seconds (default: an hour ago)"),
        OpenApiParameter("until", EPOCH_SCHEMA, description="epoch seconds, exclusive, after since (default: now)"),
    ],
    responses={
        200: SessionUsageSerializer,
        400: OpenApiResponse(ErrorSerializer, description="a bad parameter"),
        404: OpenApiResponse(ErrorSerializer, description="no such session (or not yours)"),
    },
    description="GPU memory (against the granted limit), GPU utilisation, CPU and memory over time, column-wise for "
    "a chart; full resolution for the last day, 5-minute means before, hourly means for a range longer "
    "than about a week (2,000 five-minute points). A gap in the samples is a null. `storage` is the "
    "newest measure of its home and container layer against its storage limit, whatever the range.",
)
@api_view(["GET"])
def session_usage_view(request, session_id):
    session = session_get_for(user=request.user, session_id=session_id)
    since, until = _range(request)
    return Response(SessionUsageSerializer(session_series(session=session, since=since, until=until)).data)


def _range(request) -> tuple[int, int]:
    """`since`/`until` from the query (epoch seconds; default the last hour). Raises ApplicationError."""
    now = int(time.time())
    until = _epoch("until", request.query_params.get("until"), now + 1)
    since = _epoch("since", request.query_params.get("since"), now - 3600)
    if until <= since:
        raise ApplicationError("until must be after since", field_errors={"until": ["after since"]})
    return since, until


LATEST_MAX_SESSIONS = 200
LATEST_HORIZON_S = 60  # as /metrics: a sample older than this is not "now"


class SessionUsageNowSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    t = serializers.IntegerField(allow_null=True, help_text="epoch seconds of the newest sample; null: none in the last minute")
    gpu_memory = serializers.IntegerField(allow_null=True, help_text="bytes of GPU memory used; null: unknown")
    gpu_util = serializers.IntegerField(allow_null=True, help_text="percent; null: unknown")
    gpu_memory_limit = serializers.IntegerField(help_text="bytes of GPU memory granted (held allocations)")


@extend_schema(
    summary="Sessions' usage now",
    tags=["usage"],
    parameters=[
        OpenApiParameter(
            "session",
            {"type": "array", "minItems": 1, "maxItems": LATEST_MAX_SESSIONS, "items": {"type": "string", "format": "uuid"}},
            required=True,
            explode=True,
            style="form",
            description=f"a session id, repeated (1 to {LATEST_MAX_SESSIONS})",
        )
    ],
    responses={
        200: inline_serializer("SessionsUsageNow", {"sessions": SessionUsageNowSerializer(many=True)}),
        400: OpenApiResponse(ErrorSerializer, description="a bad or missing session id, or too many"),
    },
    description="The newest sample of the last minute of each session named that you may see (others' are left "
    "out), with the GPU memory it was granted: what the session list's gauges show. Two queries "
    "whatever the number of sessions.",
)
@api_view(["GET"])
def latest_usage_view(request):
    ids = request.query_params.getlist("session")
    if not ids or len(ids) > LATEST_MAX_SESSIONS:
        raise ApplicationError(
            f"session: give 1 to {LATEST_MAX_SESSIONS} session ids", field_errors={"session": [f"1 to {LATEST_MAX_SESSIONS} ids"]}
        )
    try:
        ids = [uuid.UUID(i) for i in ids]
    except ValueError:
        raise ApplicationError("session: not a session id", field_errors={"session": ["a UUID"]}) from None
    rows = latest_session_usage(user=request.user, session_ids=ids, horizon=int(time.time()) - LATEST_HORIZON_S)
    return Response({"sessions": SessionUsageNowSerializer(rows, many=True).data})


class DeviceHistorySerializer(serializers.Serializer):
    index = serializers.IntegerField()
    uuid = serializers.CharField(help_text="the device UUID")
    model_name = serializers.CharField()
    memory_size = serializers.IntegerField(help_text="bytes")
    t = serializers.ListField(child=serializers.IntegerField(), help_text="epoch seconds")
    memory_used = serializers.ListField(child=serializers.IntegerField(allow_null=True), help_text="bytes; null: a gap")
    util = serializers.ListField(child=serializers.IntegerField(allow_null=True), help_text="percent; null: a gap or unknown")


@extend_schema(
    summary="A node's devices' usage history",
    tags=["usage"],
    parameters=[
        OpenApiParameter("name", OpenApiTypes.STR, OpenApiParameter.PATH),
        OpenApiParameter("since", EPOCH_SCHEMA, description="epoch seconds (default: an hour ago)"),
        OpenApiParameter("until", EPOCH_SCHEMA, description="epoch seconds, exclusive, after since (default: now)"),
    ],
    responses={
        200: inline_serializer("NodeDevicesHistory", {"devices": DeviceHistorySerializer(many=True)}),
        400: OpenApiResponse(ErrorSerializer, description="a bad parameter"),
        404: OpenApiResponse(ErrorSerializer, description="no such node"),
    },
    description="Each GPU of the node (MIG instances are charted as their GPU) with its memory used and utilisation "
    "over time, column-wise for a chart, as the node admin page draws it. Readable by every user, as "
    "the nodes are.",
)
@api_view(["GET"])
def node_usage_view(request, name):
    node = get_object_or_404(Node, name=name)
    since, until = _range(request)
    return Response({"devices": DeviceHistorySerializer(node_device_series(node=node, since=since, until=until), many=True).data})


class ProcessSessionSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    owner = serializers.CharField(help_text="the owner's username")
    status = serializers.CharField()
    granted_memory = serializers.IntegerField(allow_null=True, help_text="bytes of this device the session holds")


class GpuProcessSerializer(serializers.Serializer):
    device = serializers.CharField(help_text="the GPU (or MIG) UUID")
    index = serializers.IntegerField(allow_null=True, help_text="the device's index on the node")
    model_name = serializers.CharField(allow_blank=True)
    pid = serializers.IntegerField(help_text="the process id on the node (the host's, also for a container's process)")
    command = serializers.CharField(allow_blank=True, help_text="its command line (at most 256 characters)")
    memory = serializers.IntegerField(allow_null=True, help_text="bytes of GPU memory it holds; null: NVML could not tell")
    kind = serializers.ChoiceField(
        choices=["compute", "graphics", "declared"],
        help_text="NVML's compute or graphics process; declared: a mock node's session",
    )
    session = ProcessSessionSerializer(allow_null=True, help_text="the session it belongs to; null: none")


@extend_schema(
    summary="What holds a node's GPUs now (the host's view)",
    tags=["inventory"],
    parameters=[OpenApiParameter("name", OpenApiTypes.STR, OpenApiParameter.PATH)],
    responses={
        200: inline_serializer(
            "NodeProcesses",
            {
                "node": serializers.CharField(),
                "source": serializers.ChoiceField(
                    choices=["nvml", "declared"], help_text="nvml: NVML's running processes; declared: a mock node's sessions"
                ),
                "at": serializers.IntegerField(help_text="when the agent read them, epoch seconds"),
                "truncated": serializers.BooleanField(help_text="more processes than the 2000 listed"),
                "processes": GpuProcessSerializer(many=True),
            },
        ),
        403: OpenApiResponse(ErrorSerializer, description="not an administrator"),
        404: OpenApiResponse(ErrorSerializer, description="no such node"),
        409: OpenApiResponse(ErrorSerializer, description="the node is not alive: no agent to ask"),
        502: OpenApiResponse(ErrorSerializer, description="the agent could not read its GPUs' processes"),
        504: OpenApiResponse(ErrorSerializer, description="the node's agent did not answer"),
    },
    examples=[
        OpenApiExample(
            "a 0.5 fGPU session's notebook on a mock node",
            response_only=True,
            value={
                "node": "demo-node",
                "source": "declared",
                "at": 1764140000,
                "truncated": False,
                "processes": [
                    {
                        "device": "GPU-00000000-0000-0000-0000-000000000001",
                        "index": 0,
                        "model_name": "CUDA GPU",
                        "pid": 4242,
                        "command": "/bin/bash -l",
                        "memory": 2147483648,
                        "kind": "declared",
                        "session": {
                            "id": "0b4f6b1e-9d1c-4a43-9f0e-3c5d2f1a7b10",
                            "name": "notebook",
                            "owner": "alice",
                            "status": "RUNNING",
                            "granted_memory": 2147483648,
                        },
                    }
                ],
            },
        )
    ],
    description="Which process (pid, command) of which session holds how much memory of which GPU, as the node's "
    "agent reads it now (asked over the channel layer: nothing is stored): NVML's running processes on "
    "a real node (a process of no session has session null), each session's declared use (else its "
    "granted slice) on a mock node. Administrators only: commands are other users'.",
)
@awaiting_view
@api_view(["GET"])
@permission_classes([IsAdminUser])
def node_processes_view(request, name):
    node = node_processes_check(node=get_object_or_404(Node, name=name))
    return AwaitedResponse(lambda: node_processes_wait(node))  # awaited on the event loop: no thread waits
