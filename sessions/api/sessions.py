"""REST API for sessions (`/api/v1/`). Thin: validate → fetch with permission check → one service."""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from functools import partial

from django.conf import settings
from django.core.validators import RegexValidator
from django_filters import rest_framework as filters
from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action, api_view
from rest_framework.response import Response

from accelerators.allocation.errors import InvalidResourceRequest
from common.api_async import AwaitedResponse, awaiting_view
from common.api_support import ErrorSerializer, ListETagMixin, etag_answer
from common.errors import ApplicationError
from sessions.lifecycle import events
from sessions.admission import idempotency
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.api.shapes import session_shapes, shapes_kept, with_shape_keys
from protocol.exec_store import STATES, STREAMS
from sessions.api.eta import PreviewWithEtaSerializer, preview_eta
from sessions.admission.launch import launch_options, launch_preview
from sessions.models import ComputeSession, SessionStatus
from sessions.admission.names import session_name_check
from sessions.admission.presets import launch_with_preset
from sessions.serving.session_apps import session_app_get, session_app_open
from sessions.selectors import (
    LOG_READ_MAX_CHARS,
    session_get_for,
    session_list_for,
    session_log_read,
    session_to_change_for,
    sessions_shown_by_id,
)
from sessions.api.serializers import (
    LaunchOptionsSerializer,
    SessionCreateSerializer,
    SessionSerializer,
    session_shape,
    TerminalTicketSerializer,
    validate_command,
)

REQUEST_EXAMPLES = [
    OpenApiExample(
        "fGPU (Backend.AI)",
        request_only=True,
        description="Half a GPU's worth of fGPU; may span devices for amounts above one device.",
        value={"name": "notebook", "resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}},
    ),
    OpenApiExample(
        "Memory + cores per device (HAMi, eGPU)",
        request_only=True,
        description="One device, 4 GiB of its memory and 60 % of its SMs.",
        value={"name": "train", "resources": {"gpu": 1, "gpu_memory": "4G", "gpu_cores": 60}},
    ),
    OpenApiExample(
        "Fraction of one GPU (Run:ai --gpu 0.2)",
        request_only=True,
        description="20 % of one device's memory and SMs.",
        value={"name": "small", "resources": {"gpu_fraction": "0.2"}},
    ),
    OpenApiExample(
        "Whole devices",
        request_only=True,
        description="Two whole GPUs (the slot must be in discrete mode).",
        value={"name": "big", "resources": {"cuda.device": 2, "cpu": 4, "mem": "16G"}},
    ),
    OpenApiExample(
        "MIG profile (static slice or dynamic MIG)",
        request_only=True,
        description="One MIG instance of this profile (on static nodes also an inventory's name, "
        'e.g. "10g"); see launch options for the profiles in reach.',
        value={"name": "mig", "resources": {"mig_profile": "2g.20gb"}},
    ),
    OpenApiExample(
        "Memory on a MIG instance (Run:ai dynamic MIG)",
        request_only=True,
        description='The smallest MIG instance that holds 15 GiB; `isolation: "any"` lets the '
        "scheduler give a shared slice instead where no MIG instance can be had.",
        value={"name": "isolated", "resources": {"gpu_memory": "15G", "isolation": "mig"}},
    ),
    OpenApiExample(
        "HAMi resource names",
        request_only=True,
        value={"resources": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000, "nvidia.com/gpucores": 30}},
    ),
    OpenApiExample(
        "A resource preset",
        request_only=True,
        description="An administrator's preset (GET /api/v1/presets/), here with 4 CPU cores instead of its own.",
        value={"name": "notebook", "preset": "Small notebook", "resources": {"cpu": 4}},
    ),
    OpenApiExample(
        "Batch command in a resource group",
        request_only=True,
        value={
            "name": "job",
            "command": "python train.py",
            "resources": {"cuda.shares": "1.5", "resource_group": "training", "policy": "spread"},
        },
    ),
]


class AppOpenedSerializer(serializers.Serializer):
    url = serializers.CharField(
        help_text="where the app is served on this console: /sessions/<id>/apps/<name>/ and the app's own path (its `path`)"
    )
    reused = serializers.BooleanField(help_text="it was running already")


class LogQuerySerializer(serializers.Serializer):
    since = serializers.IntegerField(
        min_value=0, default=0, required=False, help_text="offset (characters) to read from: 0, or `next` of the previous read"
    )
    limit = serializers.IntegerField(
        min_value=1,
        max_value=LOG_READ_MAX_CHARS,
        default=LOG_READ_MAX_CHARS,
        required=False,
        help_text="the most characters to return",
    )


class SessionLogSerializer(serializers.Serializer):
    text = serializers.CharField(help_text="output from `start` on (terminal output: control sequences included)")
    start = serializers.IntegerField(help_text="offset of the first character of `text`")
    next = serializers.IntegerField(help_text="the `since` to send next")
    length = serializers.IntegerField(help_text="characters of output received so far")
    truncated = serializers.BooleanField(help_text="output before `start` was dropped by the size cap")
    complete = serializers.BooleanField(help_text="the session ended and `text` reaches the end of its output: stop following")


class CommandField(serializers.Field):
    """An argument vector (list of strings) or one shell command line (a string); at most
    64 KiB, no NUL character (`sessions.api.serializers.validate_command`)."""

    default_error_messages = {
        "invalid": "a list of strings (an argument vector) or a string (a shell command line)",
        "empty": "the command is empty",
    }

    def to_internal_value(self, data):
        if isinstance(data, str):
            if not data.strip():
                self.fail("empty")
        elif isinstance(data, list) and all(isinstance(part, str) for part in data):
            if not data or not data[0]:
                self.fail("empty")
        else:
            self.fail("invalid")
        validate_command(data)
        return data

    def to_representation(self, value):
        return value


class CommandFieldSchema(OpenApiSerializerFieldExtension):
    target_class = CommandField

    def map_serializer_field(self, auto_schema, direction):
        return {
            "oneOf": [{"type": "array", "items": {"type": "string"}, "minItems": 1}, {"type": "string", "minLength": 1}],
            "description": "an argument vector, or one shell command line run by `bash -c`; at most 64 KiB "
            "(UTF-8) in all, no NUL character",
        }


class ExecSerializer(serializers.Serializer):
    command = CommandField()
    timeout = serializers.IntegerField(
        min_value=1,
        max_value=settings.FGPU_EXEC_MAX_TIMEOUT,
        default=settings.FGPU_EXEC_DEFAULT_TIMEOUT,
        required=False,
        help_text="seconds; the command is killed after it (504)",
    )
    stream = serializers.BooleanField(
        default=False,
        required=False,
        help_text="true: answer 202 with the exec's id at once and keep its output to "
        "read with GET …/exec/<exec_id>/ (cancel with DELETE); false: answer "
        "200 with the result when it exits",
    )


class ExecResultSerializer(serializers.Serializer):
    exit_code = serializers.IntegerField(help_text="the command's exit status (128+N when killed by signal N)")
    stdout = serializers.CharField(allow_blank=True, help_text="at most 1 MiB")
    stderr = serializers.CharField(allow_blank=True, help_text="at most 1 MiB")
    truncated = serializers.BooleanField(help_text="stdout or stderr was cut at 1 MiB")
    duration_ms = serializers.IntegerField(help_text="milliseconds the command ran")


class ExecStateSerializer(serializers.Serializer):
    id = serializers.UUIDField(help_text="the exec's id: GET or DELETE …/exec/<id>/")
    session = serializers.UUIDField()
    command = CommandField()
    timeout = serializers.IntegerField(help_text="seconds")
    state = serializers.ChoiceField(
        STATES,
        help_text="starting (no agent took it yet), running, exited, timed_out "
        "(killed at its timeout), cancelled, failed (see `error`)",
    )
    running = serializers.BooleanField(help_text="starting or running")
    exit_code = serializers.IntegerField(
        allow_null=True, help_text="null until it ends; 128+N when killed by signal N; null when cancelled before it ran"
    )
    cancelled = serializers.BooleanField(help_text="stopped by a DELETE")
    timed_out = serializers.BooleanField(help_text="killed at its timeout")
    error = serializers.CharField(allow_blank=True, help_text="why it failed; empty otherwise")
    truncated = serializers.BooleanField(help_text="stdout or stderr passed 1 MiB: later output of it was dropped")
    duration_ms = serializers.IntegerField(allow_null=True, help_text="milliseconds it ran; null until it ends")
    created_at = serializers.DateTimeField()


class ExecChunkSerializer(serializers.Serializer):
    stream = serializers.ChoiceField(STREAMS)
    data = serializers.CharField(allow_blank=True, trim_whitespace=False, help_text="text (UTF-8; bad bytes replaced)")  # type: ignore[assignment]  # DRF's metaclass moves declared fields off the class: no clash


class ExecOutputSerializer(ExecStateSerializer):
    chunks = ExecChunkSerializer(many=True, help_text="output from chunk `since` on, in the order it was read")
    since = serializers.IntegerField(help_text="offset (chunks) of the first chunk returned")
    next = serializers.IntegerField(help_text="the `since` to send next")
    complete = serializers.BooleanField(help_text="it ended and this read reaches the end of its output: stop following")


class ExecQuerySerializer(serializers.Serializer):
    # At most 2^53: the exec store (Redis LRANGE) takes 64-bit offsets; a larger one was a 500.
    since = serializers.IntegerField(
        min_value=0,
        max_value=2**53,
        default=0,
        required=False,
        help_text="offset (chunks, not bytes) to read from: 0, or `next` of the previous read",
    )


EXEC_ID_PARAMETER = OpenApiParameter(
    "exec_id", OpenApiTypes.UUID, OpenApiParameter.PATH, description="the `id` a streamed exec's POST answered"
)
EXEC_STATE_EXAMPLE = {
    "id": "5b0f3c1e-8a52-4d3e-9c55-0d0c9f1b2a77",
    "session": "27eafb9b-d987-401d-8aab-0bc8d1cd89cd",
    "command": "for i in 1 2 3; do echo step $i; sleep 1; done",
    "timeout": 60,
    "state": "starting",
    "running": True,
    "exit_code": None,
    "cancelled": False,
    "timed_out": False,
    "error": "",
    "truncated": False,
    "duration_ms": None,
    "created_at": "2025-01-07T10:12:03.120000Z",
}


# What a node name and a username can be (agent.toml's `id`; Django's username validator): the
# filters refuse anything else (a NUL character, a control character) with a 400, as the schema says.
NODE_PATTERN = r"^[A-Za-z0-9._-]*$"
OWNER_PATTERN = r"^[\w.@+-]*$"


class SessionFilter(filters.FilterSet):
    status = filters.CharFilter(
        method="filter_status",
        help_text="one status or a comma list, any case: PENDING, SCHEDULED, PREPARING, "
        "RUNNING, TERMINATING, TERMINATED, ERROR, CANCELLED",
    )
    # Not stripped, and \Z, not the schema's $ (Python's $ also matches before a final newline):
    # "demo-node\n" is refused as the schema says, not read as "demo-node".
    owner = filters.CharFilter(
        field_name="owner__username",
        strip=False,
        validators=[RegexValidator(OWNER_PATTERN[:-1] + r"\Z")],
        help_text="owner's username (administrators; a user only ever sees their own)",
    )
    node = filters.CharFilter(
        field_name="node__name", strip=False, validators=[RegexValidator(NODE_PATTERN[:-1] + r"\Z")], help_text="node name"
    )

    class Meta:
        model = ComputeSession
        fields = ["status", "owner", "node"]

    def filter_status(self, queryset, name, value):
        wanted = [part.strip().upper() for part in value.split(",") if part.strip()]
        unknown = [part for part in wanted if part not in SessionStatus.values]
        if unknown:
            raise serializers.ValidationError(
                {"status": [f"unknown status {', '.join(unknown)}; one of {', '.join(SessionStatus.values)}"]}
            )
        return queryset.filter(status__in=wanted) if wanted else queryset


IDEMPOTENCY_KEY_PARAMETER = OpenApiParameter(
    idempotency.HEADER,
    {"type": "string", "minLength": 1, "maxLength": idempotency.MAX_KEY_LENGTH, "pattern": "^[\\x20-\\x7e]+$"},
    OpenApiParameter.HEADER,
    required=False,
    description="a key of your choosing (1 to 255 printable ASCII characters; a fresh UUID per launch) that makes "
    "repeating the launch safe: the same key within 24 h answers the first launch again and creates "
    "nothing (a different body with it: 422). Keys are per user.",
)
STATUS_PARAMETER = OpenApiParameter(
    "status",
    {"type": "array", "items": {"type": "string", "enum": list(SessionStatus.values)}},
    OpenApiParameter.QUERY,
    style="form",
    explode=False,
    description="one status or a comma list (any case): `?status=PENDING,RUNNING`",
)
NODE_PARAMETER = OpenApiParameter(
    "node", {"type": "string", "pattern": NODE_PATTERN}, OpenApiParameter.QUERY, description="node name"
)
OWNER_PARAMETER = OpenApiParameter(
    "owner",
    {"type": "string", "pattern": OWNER_PATTERN},
    OpenApiParameter.QUERY,
    description="owner's username (administrators; a user only ever sees their own)",
)


AWAITING_ACTIONS = {"exec", "app_open"}  # SessionViewSet's actions that wait for an agent's answer


@extend_schema_view(
    list=extend_schema(
        summary="List sessions",
        parameters=[STATUS_PARAMETER, NODE_PARAMETER, OWNER_PARAMETER],
        description="Your sessions, newest first (administrators: everyone's).",
    ),
)
class SessionViewSet(ListETagMixin, mixins.ListModelMixin, viewsets.GenericViewSet):
    """Compute sessions. Users see their own, staff all; another user's session is a 404."""

    serializer_class = SessionSerializer
    filterset_class = SessionFilter
    lookup_url_kwarg = "session_id"

    @classmethod
    def as_view(cls, actions=None, **initkwargs):
        """DRF's view, except those of the actions that wait for an agent (the blocking exec, an
        app's opening), which wait on the event loop, holding no web thread and no database
        connection (common.api_async)."""
        view = super().as_view(actions, **initkwargs)
        return awaiting_view(view) if actions and AWAITING_ACTIONS & set(actions.values()) else view

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation: no caller
            return ComputeSession.objects.none()
        return session_list_for(user=self.request.user)

    def get_object(self):
        return session_get_for(user=self.request.user, session_id=self.kwargs["session_id"])

    def list(self, request, *args, **kwargs):
        """A page of sessions, from the shapes this process kept while their rows are unchanged
        (sessions.api.shapes), with an ETag over the page's fingerprints."""
        if not shapes_kept():
            return super().list(request, *args, **kwargs)
        page = self.paginate_queryset(with_shape_keys(self.filter_queryset(self.get_queryset())))
        data, digest = session_shapes(page or [], render=self._render)
        response = self.get_paginated_response(data)
        links = f"{response.data['count']}|{response.data['next']}|{response.data['previous']}|{digest}"
        return etag_answer(request, response, f'W/"{hashlib.sha256(links.encode()).hexdigest()[:32]}"')

    def _render(self, ids: Collection) -> dict:
        """{id: API shape} of the sessions `ids`, read now as the list reads them."""
        sessions = sessions_shown_by_id(ids)
        return {session.pk: shape for session, shape in zip(sessions, self.get_serializer(sessions, many=True).data)}

    @extend_schema(
        summary="Launch a session",
        request=SessionCreateSerializer,
        parameters=[IDEMPOTENCY_KEY_PARAMETER],
        responses={
            201: SessionSerializer,
            422: OpenApiResponse(
                ErrorSerializer,
                description=f'The `{idempotency.HEADER}` was used for a different request body (type "idempotency-key-reused").',
            ),
        },
        examples=REQUEST_EXAMPLES,
        description="Validates the request (one request style per session) and the caller's quotas, "
        "writes the session PENDING; the scheduler places it.\n\n"
        f"With an `{idempotency.HEADER}` header, repeating the request (after a timeout or a "
        "5xx) is safe: the same key from the same user within 24 h answers the first "
        "launch's status and body again (header `Idempotent-Replayed: true`) and creates no "
        "second session, also when the two requests race. A refused launch keeps nothing.\n\n"
        "With `preset` (a resource preset's name or id, GET /api/v1/presets/) the launch starts "
        "from the preset's request and image: keys of `resources` replace the preset's (`cpu`, "
        "`mem` and options one by one; any GPU key replaces its whole GPU request; null removes "
        "a key), `image` replaces its image, and another `resources.resource_group` than the "
        'preset\'s is refused (400, type "preset-conflict"). A preset alone launches exactly '
        'its request. 400 (type "unknown-preset") for a preset you may not use.\n\n'
        "Your sessions that have not ended have distinct names (an ended one's name may be used "
        'again): a `name` one of them has is refused, 400 type "name-taken" (field `name`), also '
        "between two launches at once. Without a `name` the session gets a free one (session-<n>).",
    )
    def create(self, request):
        """`{"name", "resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}, "command"}` → 201 PENDING;
        with `Idempotency-Key`, a repeat → the first answer (sessions.admission.idempotency)."""
        key = idempotency.idempotency_key_check(request.headers.get(idempotency.HEADER))
        data = SessionCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)

        def launch() -> tuple[int, dict, ComputeSession]:
            fields = launch_with_preset(user=request.user, data=data.validated_data)
            session = admission.session_create(owner=request.user, **fields)
            return status.HTTP_201_CREATED, self._shown(session), session

        if key is None:
            code, body, _ = launch()
            return Response(body, status=code)
        answer = idempotency.idempotency_key_answer(
            user=request.user, key=key, answer=launch, fingerprint=idempotency.request_fingerprint(request.data)
        )
        return Response(answer.body, status=answer.status, headers={"Idempotent-Replayed": "true"} if answer.replayed else None)

    @extend_schema(summary="One session with its allocations")
    def retrieve(self, request, session_id=None):
        return Response(session_shape(self.get_object()))

    @extend_schema(
        summary="Terminate a session",
        responses={202: SessionSerializer},
        description="202 with the session: TERMINATING, or CANCELLED if it was still pending. Its "
        '`status_reason` says who asked ("at the request of <username>") and stays so '
        "once it is TERMINATED; `exit_code` is then the process's (128+N: killed by "
        "signal N).",
    )
    def destroy(self, request, session_id=None):
        """Terminate: 202 with the session (TERMINATING, or CANCELLED if it was still pending)."""
        session = services.session_terminate(
            session=session_to_change_for(user=request.user, session_id=self.kwargs["session_id"]),
            reason=services.REQUESTED + request.user.get_username(),
        )
        return Response(self._shown(session), status=status.HTTP_202_ACCEPTED)

    def _shown(self, session: ComputeSession) -> dict:
        """The session's API shape after a write: the one its notice rendered (same state), else read."""
        return events.shape_shown(session) or session_shape(session_get_for(user=self.request.user, session_id=session.pk))

    @extend_schema(
        summary="Preview a launch",
        request=SessionCreateSerializer,
        responses={200: PreviewWithEtaSerializer},
        examples=REQUEST_EXAMPLES,
        description="What launching this request would do now: the launch's checks (the caller's "
        "quotas included) and the scheduler's placement, one decision "
        "(sessions.scheduling.placement); per device what it would get, or why it waits or is "
        "refused; and when it would start (`eta`, a band from the queue's replay with this request "
        "joining it, as a pending session's ETA). Same body as launching; nothing is created. "
        'A `name` one of your sessions not ended has is answered as the launch would refuse it: `outcome` "refused", '
        '`refusal` "name-taken", `name_error` what the launch\'s 400 says of the field `name`.',
    )
    @action(detail=False, methods=["post"])
    def preview(self, request):
        """What this request would get now (same body as create); nothing is created."""
        data = SessionCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        fields = launch_with_preset(user=request.user, data=data.validated_data)
        answer = launch_preview(resources=fields["resources"], image=fields["image"], owner=request.user)
        answer["eta"] = preview_eta(user=request.user, fields=fields, preview=answer)
        try:  # a name taken is a refusal of the launch, said as the others are: in the answer
            session_name_check(owner=request.user, name=fields.get("name", ""))
            answer["name_error"] = ""
        except ApplicationError as exc:
            answer.update(outcome="refused", refusal=exc.type, name_error=exc.field_errors["name"][0])
        return Response(answer)

    @extend_schema(
        summary="Get a terminal ticket",
        request=None,
        responses={200: TerminalTicketSerializer},
        description="A one-time, short-lived ticket for the session's terminal websocket. 409 unless the session is RUNNING.",
    )
    @action(detail=True, methods=["post"], url_path="terminal-ticket")
    def terminal_ticket(self, request, session_id=None):
        """A one-time ticket for the terminal websocket: `{"ticket", "url", "expires_at"}`."""
        session = self.get_object()
        ticket, row = services.terminal_ticket_create(session=session, user=request.user)
        return Response(
            {"ticket": ticket, "url": f"/ws/sessions/{session.pk}/terminal/?ticket={ticket}", "expires_at": row.expires_at}
        )

    @extend_schema(
        summary="Read a session's output",
        parameters=[LogQuerySerializer],
        responses={
            200: SessionLogSerializer,
            400: OpenApiResponse(ErrorSerializer, description="`since` or `limit` out of range."),
        },
        description="What the session's process wrote to its terminal (batch and interactive sessions), "
        "kept after the session ends: the last 4 Mi characters (about 4 MiB). Follow it by "
        "asking again with `?since=<next>` until `complete` is true; the agent ships output "
        "about every 0.5 s.",
        examples=[
            OpenApiExample(
                "A read",
                response_only=True,
                value={"text": "hello\r\n", "start": 0, "next": 7, "length": 7, "truncated": False, "complete": True},
            )
        ],
    )
    @action(detail=True, methods=["get"])
    def logs(self, request, session_id=None):
        """`?since=<offset>` → `{"text", "start", "next", "length", "truncated", "complete"}`."""
        session = self.get_object()  # first: another user's session is a 404 whatever the query
        # A plain dict, not the QueryDict: DRF reads an empty `?since=` in a QueryDict as "not sent".
        query = LogQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        return Response(session_log_read(session=session, **query.validated_data))

    @extend_schema(
        summary="Run a command in a session",
        request=ExecSerializer,
        responses={
            200: ExecResultSerializer,
            202: OpenApiResponse(
                ExecStateSerializer, description="`stream` true: started; follow it at GET …/exec/<id>/ (the `Location` header)."
            ),
            502: OpenApiResponse(ErrorSerializer, description="The agent could not start the command."),
            504: OpenApiResponse(
                ErrorSerializer, description="The command ran past its timeout, or the node's agent did not answer."
            ),
        },
        description="Runs the command on the session's node beside its process: the session's environment "
        "(allocation limits, the virtual nvidia-smi on PATH), working directory, stdin from "
        "/dev/null; batch sessions too. 409 unless RUNNING; 504 when it runs past `timeout` "
        "(killed) or the node's agent does not answer.\n\n"
        'With `"stream": true` it answers 202 at once with the exec\'s `id` (and its URL '
        "in `Location`) instead of waiting: read the output while it runs with GET "
        "…/exec/<id>/?since=<next>, stop it with DELETE …/exec/<id>/. Its output is kept "
        "(1 MiB per stream) for an hour after it ends, readable from any web process.",
        examples=[
            OpenApiExample("nvidia-smi", request_only=True, value={"command": ["nvidia-smi"], "timeout": 30}),
            OpenApiExample(
                "Streamed",
                request_only=True,
                value={"command": "for i in 1 2 3; do echo step $i; sleep 1; done", "timeout": 60, "stream": True},
            ),
            OpenApiExample("Streamed: started", response_only=True, status_codes=["202"], value=EXEC_STATE_EXAMPLE),
            OpenApiExample("A shell line", request_only=True, value={"command": "echo $CUDA_DEVICE_SM_LIMIT; exit 3"}),
            OpenApiExample(
                "Result",
                response_only=True,
                value={"exit_code": 3, "stdout": "25\n", "stderr": "", "truncated": False, "duration_ms": 12},
            ),
        ],
    )
    @action(detail=True, methods=["post"])
    def exec(self, request, session_id=None):
        """`{"command": ["nvidia-smi"], "timeout": 30}` → 200 `{"exit_code", "stdout", "stderr", …}`; with
        `"stream": true` → 202 with the exec's state (GET/DELETE …/exec/<id>/ follow or cancel it)."""
        session = self.get_object()  # first: another user's session is a 404 whatever the body
        data = ExecSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        if not data.validated_data.pop("stream"):
            call = services.session_exec_call(session=session, **data.validated_data)
            return AwaitedResponse(partial(services.session_exec_wait, call))
        started = services.session_exec_start(session=session, **data.validated_data)
        return Response(
            ExecStateSerializer(started).data,
            status=status.HTTP_202_ACCEPTED,
            headers={"Location": f"/api/v1/sessions/{session.pk}/exec/{started['id']}/"},
        )

    @extend_schema(
        summary="Open a session app",
        request=None,
        responses={
            200: AppOpenedSerializer,
            404: OpenApiResponse(
                ErrorSerializer, description='No such session for you, or its image declares no such app (type "unknown-app").'
            ),
            409: OpenApiResponse(ErrorSerializer, description="The session is not RUNNING."),
            502: OpenApiResponse(
                ErrorSerializer,
                description="The app's command exited, or its "
                "port did not answer within its timeout (`detail` ends with its "
                "last output).",
            ),
            504: OpenApiResponse(ErrorSerializer, description="The node's agent did not answer."),
        },
        description="Starts one of the web apps the session's image declares (the session's `apps`) "
        "inside the session unless it runs, waits until its port answers (up to the app's "
        "timeout), and answers where it is served on this console: `/sessions/<id>/apps/"
        "<name>/…`, for the session's owner and administrators signed in to the console "
        "(the proxy adds the app's token, which is never shown). Opening a running app "
        "answers at once (`reused`). The pages do the same over the websocket "
        "`/ws/sessions/<id>/open/<name>/`, which also reports progress.",
        examples=[
            OpenApiExample(
                "JupyterLab",
                response_only=True,
                value={"url": "/sessions/27eafb9b-d987-401d-8aab-0bc8d1cd89cd/apps/jupyter/lab", "reused": False},
            )
        ],
    )
    @action(detail=True, methods=["post"], url_path=r"apps/(?P<app>[a-z][a-z0-9-]{0,31})", url_name="app-open")
    def app_open(self, request, session_id=None, app=None):
        """→ `{"url", "reused"}` once the app answers (sessions.serving.session_apps.session_app_open)."""
        session = self.get_object()  # first: another user's session is a 404 whatever the app
        found = session_app_get(session=session, name=app)
        node = session.node.name if session.node_id else ""
        return AwaitedResponse(partial(session_app_open, session=session, app=found, node=node))

    @extend_schema(
        methods=["GET"],
        summary="Read a streamed exec",
        parameters=[EXEC_ID_PARAMETER, ExecQuerySerializer],
        responses={200: ExecOutputSerializer, 400: OpenApiResponse(ErrorSerializer, description="`since` out of range.")},
        description="A streamed exec's state and its output from chunk `since` on: stdout and stderr "
        "chunks in the order the agent read them, each with its stream. Follow it by asking "
        "again with `?since=<next>` until `complete` is true; the agent pushes output as it "
        "comes. 404 when the session has no such exec or its output expired (an hour after "
        "it ended). An exec no agent took within 10 s shows as `failed`.",
        examples=[
            OpenApiExample(
                "Still running",
                response_only=True,
                value={
                    **EXEC_STATE_EXAMPLE,
                    "state": "running",
                    "chunks": [{"stream": "stdout", "data": "step 1\n"}, {"stream": "stderr", "data": "warn\n"}],
                    "since": 0,
                    "next": 2,
                    "complete": False,
                },
            ),
            OpenApiExample(
                "Ended",
                response_only=True,
                value={
                    **EXEC_STATE_EXAMPLE,
                    "state": "exited",
                    "running": False,
                    "exit_code": 0,
                    "duration_ms": 3012,
                    "chunks": [{"stream": "stdout", "data": "step 2\nstep 3\n"}],
                    "since": 2,
                    "next": 3,
                    "complete": True,
                },
            ),
        ],
    )
    @extend_schema(
        methods=["DELETE"],
        summary="Cancel a streamed exec",
        parameters=[EXEC_ID_PARAMETER],
        request=None,
        responses={
            200: OpenApiResponse(ExecStateSerializer, description="It has ended (`cancelled` true when this stopped it)."),
            202: OpenApiResponse(
                ExecStateSerializer, description="Asked to stop; the agent has not reported the end within 5 s."
            ),
        },
        description="Kills the command: the agent sends SIGTERM to every process it started, SIGKILL 2 s "
        "later; one no agent took yet never runs. Waits up to 5 s for the agent to report the "
        "end. An exec that already ended is left as it is (200 with its state).",
        examples=[
            OpenApiExample(
                "Cancelled",
                response_only=True,
                status_codes=["200"],
                value={
                    **EXEC_STATE_EXAMPLE,
                    "state": "cancelled",
                    "running": False,
                    "exit_code": 143,
                    "cancelled": True,
                    "duration_ms": 1840,
                },
            )
        ],
    )
    @action(detail=True, methods=["get", "delete"], url_path=r"exec/(?P<exec_id>[0-9a-fA-F-]{36})", url_name="exec-detail")
    def exec_detail(self, request, session_id=None, exec_id=None):
        """GET `?since=<next>` → state + `chunks`, `next`, `complete`; DELETE → cancel."""
        session = self.get_object()  # first: another user's session is a 404 whatever the exec
        if request.method == "DELETE":
            state = services.session_exec_cancel(session=session, exec_id=exec_id.lower())
            return Response(
                ExecStateSerializer(state).data, status=status.HTTP_202_ACCEPTED if state["running"] else status.HTTP_200_OK
            )
        query = ExecQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        return Response(
            ExecOutputSerializer(
                services.session_exec_read(session=session, exec_id=exec_id.lower(), **query.validated_data)
            ).data
        )


class LaunchOptionsQuerySerializer(serializers.Serializer):
    resource_group = serializers.CharField(
        required=False, default="", allow_blank=True, help_text="only this resource group's nodes; empty: any node"
    )


LAUNCH_OPTIONS_EXAMPLE = OpenApiExample(
    "With a dynamic-MIG H100 node",
    response_only=True,
    value={
        "slots": [
            {
                "slot": "cuda.shares",
                "slot_name": "cuda",
                "subtype": "shares",
                "allocation_mode": "fractional",
                "display_unit": "fGPU",
                "display_icon": "gpu1",
                "human_readable_name": "fGPU",
                "binary": False,
                "round_length": 2,
                "quantum": "0.25",
                "min": "0.25",
                "step": "0.25",
                "max_now": "1.50",
                "max_ever": "2.00",
                "unit_mem": 4294967296,
                "unit_proc": 40,
            }
        ],
        "mig": {
            "slot_name": "cuda",
            "isolation": ["shared", "mig", "any"],
            "profiles": [
                {
                    "name": "1g.10gb",
                    "memory": 10468982784,
                    "memory_text": "9.75 GiB",
                    "sm_count": 16,
                    "compute_slices": 1,
                    "memory_slices": 1,
                    "models": ["H100-80GB"],
                    "max_now": 6,
                    "idle_now": 0,
                    "max_ever": 7,
                },
                {
                    "name": "1g.20gb",
                    "memory": 21072183296,
                    "memory_text": "19.62 GiB",
                    "sm_count": 26,
                    "compute_slices": 1,
                    "memory_slices": 2,
                    "models": ["H100-80GB"],
                    "max_now": 3,
                    "idle_now": 1,
                    "max_ever": 4,
                },
                {
                    "name": "7g.80gb",
                    "memory": 85094039552,
                    "memory_text": "79.25 GiB",
                    "sm_count": 132,
                    "compute_slices": 7,
                    "memory_slices": 8,
                    "models": ["H100-80GB"],
                    "max_now": 0,
                    "idle_now": 0,
                    "max_ever": 1,
                },
            ],
        },
        "cpu": {"max_now": 7, "max_ever": 8},
        "mem": {"max_now": 33285996544, "max_ever": 34359738368},
    },
)


@extend_schema(
    summary="Launch options",
    parameters=[LaunchOptionsQuerySerializer],
    responses={200: LaunchOptionsSerializer, 404: OpenApiResponse(ErrorSerializer, description="No such resource group.")},
    tags=["sessions"],
    examples=[LAUNCH_OPTIONS_EXAMPLE],
    description="What the launch dialog may offer the caller now: per slot the quantum and the largest "
    "amount placeable now (capped by the caller's quotas) and ever; the MIG profiles one may "
    'ask for (`{"mig_profile": name}`) where a node with MIG (static slices, dynamic or a '
    "fixed layout) is in reach, each with its memory and how many sessions could get one now "
    "(idle instances reused, new ones as the planner would place them, free static slices) "
    "and ever; the isolations a memory-sized request may ask for (`isolation`: shared, mig, "
    "any; empty without MIG); CPU cores and memory. `?resource_group=` limits it to that "
    "group's nodes.",
)
@api_view(["GET"])
def launch_options_view(request):
    """What the launch dialog may offer now (see sessions.admission.launch.launch_options)."""
    query = LaunchOptionsQuerySerializer(data=request.query_params.dict())
    query.is_valid(raise_exception=True)
    try:
        return Response(launch_options(user=request.user, **query.validated_data))
    except InvalidResourceRequest as exc:
        raise ApplicationError(
            str(exc), type="not-found", title="Not found", status=404, field_errors={"resource_group": [str(exc)]}
        ) from None
