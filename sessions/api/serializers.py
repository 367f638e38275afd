"""API shapes of compute sessions. Amounts: shares in fGPU (text), memory in bytes, procs in SMs."""

from __future__ import annotations

import threading
import uuid

from django.urls import reverse
from django.core.exceptions import ObjectDoesNotExist
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from accelerators.models import Node
from accelerators.selectors import SlotFormats
from protocol.environment import DeviceLimit, limits_environment
from protocol.messages import HardwareId
from common.api_support import ModelSerializer
from protocol.channel import PREEMPT_SIGNALS, preempt_signal_name
from sessions.models import Allocation, ComputeSession
from sessions.policy.data_folders import folders_note_for
from sessions.selectors import configuration_text, session_allocations, session_configuration_parts, session_gpu_instance
from sessions.serving.session_apps import session_app_links


class AllocationSerializer(ModelSerializer):
    device = serializers.CharField(source="device.device_id", help_text="the device (GPU or MIG) UUID")
    device_index = serializers.IntegerField(source="device.index")
    model_name = serializers.CharField(source="device.model_name")
    memory = serializers.IntegerField(help_text="bytes of device memory")
    procs = serializers.DecimalField(max_digits=12, decimal_places=3, help_text="SMs")
    shares = serializers.DecimalField(max_digits=12, decimal_places=3, help_text="fGPU (1 per whole device)")

    class Meta:
        model = Allocation
        fields = ["device", "device_index", "model_name", "shares", "memory", "procs", "released_at"]


class SessionAppSerializer(serializers.Serializer):
    name = serializers.CharField(help_text='the app\'s name in its image, e.g. "jupyter"')
    title = serializers.CharField(help_text='what the pages show, e.g. "JupyterLab"')
    url = serializers.CharField(
        help_text="the console's page that starts it and then opens it: "
        "/sessions/<id>/open/<name>/ (it is served under /sessions/<id>/apps/<name>/)"
    )


def _activity(session):
    """The session's usage.SessionActivity (its reclamation warning), or None."""
    try:
        return session.activity
    except ObjectDoesNotExist:
        return None


def _session_id(source: str, help_text: str) -> serializers.UUIDField:
    """A read-only, nullable id of another session (`source`: the foreign key's `_id` column)."""
    return serializers.UUIDField(source=source, read_only=True, allow_null=True, help_text=help_text)


# Give it sessions from `sessions.selectors.sessions_shown` (their relations read with them): then
# a page costs one query more (the slot formats, read once and kept in the context for every row)
# whatever its length. (A comment: the schema shows a serializer's docstring.)
class SessionSerializer(ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    node = serializers.CharField(
        source="node.name", read_only=True, default=None, allow_null=True, help_text="node name; null until scheduled"
    )
    configuration = serializers.SerializerMethodField()
    requested = serializers.SerializerMethodField()
    grant = serializers.SerializerMethodField()
    mig_profile = serializers.SerializerMethodField()
    allocations = AllocationSerializer(many=True, read_only=True, source="allocation_list")
    image = serializers.CharField(
        source="image.reference",
        read_only=True,
        default=None,
        allow_null=True,
        help_text="the session image's reference; null for a session from before images",
    )
    terminal_url = serializers.SerializerMethodField()
    apps = serializers.SerializerMethodField()
    fraction_enforcement = serializers.SerializerMethodField()
    data_folders_note = serializers.SerializerMethodField()
    environment = serializers.SerializerMethodField()
    preempt_at = serializers.DateTimeField(
        read_only=True, allow_null=True, help_text="under notice of preemption: when it will be stopped; else null"
    )
    preempted_for = _session_id("preempted_for_id", "the waiting session it is (or was) preempted for; null: none")
    preempt_signal = serializers.CharField(
        source="preempt_signal_sent",
        read_only=True,
        help_text="the signal it gets when chosen for preemption (\"SIGTERM\"): its launch's, else its image's, else SIGTERM",
    )
    requeued_from = _session_id("requeued_from_id", "the preempted or moved session this one was launched again for; null: none")
    requeued_as = _session_id(
        "requeued_as_id", "once preempted or moved and ended: the session launched again for it; null: none (yet)"
    )
    deadline = serializers.SerializerMethodField(
        help_text="warned by idle reclamation or its maximum lifetime: when it is terminated; else null"
    )
    deadline_reason = serializers.SerializerMethodField(
        help_text='why ("idle for 2 h (GPU utilisation < 1 %)", "reached its maximum lifetime of 8 h"); "" when not warned'
    )

    class Meta:
        model = ComputeSession
        fields = [
            "id",
            "name",
            "owner",
            "status",
            "status_reason",
            "node",
            "image",
            "resources",
            "priority",
            "configuration",
            "requested",
            "grant",
            "mig_profile",
            "allocations",
            "command",
            "created_at",
            "scheduled_at",
            "started_at",
            "terminated_at",
            "exit_code",
            "terminal_url",
            "apps",
            "fraction_enforcement",
            "data_folders_note",
            "version",
            "environment",
            "preemptible",
            "min_runtime",
            "preempt_at",
            "preempted_for",
            "preempt_signal",
            "requeue",
            "requeued_from",
            "requeued_as",
            "deadline",
            "deadline_reason",
        ]
        read_only_fields = fields

    def to_representation(self, session):
        session.allocation_list = session_allocations(session)  # read with it by sessions_shown, else now
        # One per request, shared by the rows.
        slot_formats = self.context.setdefault("slot_formats", SlotFormats())  # type: ignore[attr-defined]  # stubs: a read-only Mapping; DRF's is the dict it was given
        self._parts = session_configuration_parts(session, slot_formats=slot_formats)  # for the four fields below
        return super().to_representation(session)

    @extend_schema_field(serializers.DateTimeField(allow_null=True))
    def get_deadline(self, session) -> str | None:
        """The reclamation warning's deadline (usage.services.usage_idle_check; its activity row is
        read with the session by `sessions.selectors.sessions_shown`), ISO 8601, or None."""
        activity = _activity(session)
        if activity is None or activity.deadline is None:
            return None
        return serializers.DateTimeField().to_representation(activity.deadline)

    def get_deadline_reason(self, session) -> str:
        activity = _activity(session)
        return activity.reason if activity is not None and activity.deadline is not None else ""

    def get_configuration(self, session) -> str:
        """The request formatted, then " — " and what a MIG or isolation-"any" session got and why
        (as `sessions.selectors.session_configuration`)."""
        return configuration_text(self._parts)

    def get_requested(self, session) -> str:
        """The request formatted by the slot formats: "MIG instance of at least 15 GiB · 1 core · 1 GiB"."""
        return self._parts["requested"]

    def get_grant(self, session) -> str:
        """What a MIG or isolation-"any" session got and why, in words ("" for others and until placed)."""
        return self._parts["grant"]

    def get_mig_profile(self, session) -> str:
        """The MIG profile the session got ("1g.20gb", or a static slice's "10g"); "" for none."""
        return self._parts["mig_profile"]

    def get_fraction_enforcement(self, session) -> str:
        """What holds the session to a shared GPU slice on its node, as its agent reports it:
        "hami-core", "mps", or "none" (the limits are in its environment only; a program may use
        the whole device); "" for a session without a shared slice (whole devices, a MIG
        instance, no GPU) or not placed yet."""
        if self._parts["mig_profile"] or session.node is None:
            return ""
        shared = any(a.memory < a.device.memory_size for a in session.allocation_list if a.released_at is None)
        return (session.node.attributes or {}).get("fraction_enforcement", "none") if shared else ""

    def get_data_folders_note(self, session) -> str:
        """Placed on a node without shared storage (agent.toml [storage]) in a cluster of several:
        the sentence saying its ~/data and project folders are local to that node
        (sessions.policy.data_folders.folders_note); "" otherwise. The node count is read once
        per call of the serializer, and only for such a session."""
        if session.node is None or session.node.shared_storage:
            return ""
        if "nodes_registered" not in self.context:
            self.context["nodes_registered"] = Node.objects.count()  # type: ignore[index]  # stubs: a read-only Mapping; DRF's is the dict it was given
        return folders_note_for(node=session.node, nodes_registered=self.context["nodes_registered"])

    @extend_schema_field(serializers.DictField(child=serializers.CharField()))
    def get_environment(self, session) -> dict[str, str]:
        """The variables its allocation puts into the session's environment, as its agent sets them
        (protocol.environment.limits_environment: CUDA_VISIBLE_DEVICES, CUDA_DEVICE_MEMORY_LIMIT_<i>,
        CUDA_DEVICE_SM_LIMIT, eGPU's, MPS's where the node runs MPS); an ended session's as it had
        them; {} until placed."""
        if session.node is None:
            return {}
        held = [a for a in session.allocation_list if a.released_at is None] or session.allocation_list
        devices = [
            DeviceLimit(HardwareId(a.device.device_id), a.memory, a.procs, a.device.subproc_count)
            for a in sorted(held, key=lambda a: a.device.index)
        ]
        instance = session_gpu_instance(session) if self._parts["mig_profile"] else None
        if instance is not None:  # a GPU instance made for it: the MIG device first, as agent.mig.prepare_spec does
            devices = [
                DeviceLimit(
                    HardwareId(instance.uuid or instance.parent.device_id),
                    instance.memory_size,
                    instance.subproc_count,
                    instance.subproc_count,
                ),
                *(d for d in devices if d.hardware_id != instance.parent.device_id),
            ]
        return limits_environment(devices, mps=bool((session.node.attributes or {}).get("mps")))

    @extend_schema_field(SessionAppSerializer(many=True))
    def get_apps(self, session) -> list[dict]:
        """The web apps of its image besides the terminal (sessions.serving.session_apps): `url` opens one."""
        return session_app_links(session)

    def get_terminal_url(self, session) -> str:
        # One reverse() per request, not per row (it reads the URLconf from a thread-local behind
        # asgiref's process-wide lock): the sessions' paths differ only by their ids.
        template = self.context.get("terminal_url")
        if template is None:
            # djangorestframework-stubs type `context` a read-only Mapping; DRF's is the dict it was given.
            template = self.context["terminal_url"] = reverse(  # type: ignore[index]
                "session-terminal", kwargs={"session_id": ANY_ID}
            )
        return template.replace(str(ANY_ID), str(session.pk))


ANY_ID = uuid.UUID(int=0)  # stands for a session's id in the terminal path get_terminal_url builds


_kept = threading.local()  # .serializer: this thread's SessionSerializer for session_shapes


def session_shapes(sessions) -> list[dict]:
    """SessionSerializer's representation of each of `sessions` (read by
    `sessions.selectors.sessions_shown`), in order: what `SessionSerializer(sessions, many=True).data`
    holds, from one serializer per thread whose fields were built once. DRF builds a
    ModelSerializer's fields anew at every instantiation (about 2 ms for this one's 29 on a 2-core
    machine, two thirds of serializing one session), which a notice or a write's answer, one
    session each, paid every time (issue 14). Each call starts from an empty context, so the
    slot formats are read anew, as for a new serializer."""
    serializer = getattr(_kept, "serializer", None)
    if serializer is None:
        serializer = _kept.serializer = SessionSerializer()
    serializer._context = {}  # DRF's own attribute behind `context`, which its fields read through the root
    return [serializer.to_representation(session) for session in sessions]


def session_shape(session) -> dict:
    """`session_shapes` of one session."""
    return session_shapes([session])[0]


MAX_MIN_RUNTIME = 30 * 86400  # a launch's longest minimum runtime, seconds (30 days)
MAX_COMMAND_BYTES = 64 * 1024  # far below Linux's 128 KiB for one argument (MAX_ARG_STRLEN)


def validate_command(command: str | list[str]) -> None:
    """A command line (text) or argument vector (list of text) a process can be started with:
    no NUL character (execve ends every argument at one), no unpaired surrogate (not UTF-8),
    and `validate_command_size`. Raises ValidationError."""
    parts = [command] if isinstance(command, str) else command
    if any("\x00" in part for part in parts):
        raise serializers.ValidationError("contains a NUL character, which no command can hold")
    try:
        "".join(parts).encode("utf-8")
    except UnicodeEncodeError:
        raise serializers.ValidationError("contains an unpaired surrogate (not UTF-8 text)") from None
    validate_command_size(command)


def validate_command_size(command: str | list[str]) -> None:
    """At most MAX_COMMAND_BYTES (64 KiB) of UTF-8 in all (an argument vector's parts with a
    separator each). Raises ValidationError. (A CharField refuses NUL and surrogates itself.)"""
    parts = [command] if isinstance(command, str) else command
    size = sum(len(part.encode("utf-8", "surrogatepass")) + 1 for part in parts) - 1
    if size > MAX_COMMAND_BYTES:
        raise serializers.ValidationError(
            f"at most {MAX_COMMAND_BYTES // 1024} KiB (UTF-8), got {size} bytes; "
            "put a long script in a file in the session and run that"
        )


class StrictCharField(serializers.CharField):
    """A CharField that refuses numbers and booleans instead of turning them into text."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """A BooleanField that takes only JSON true and false (not 0, 1, "yes", "true")."""

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class SessionCreateSerializer(serializers.Serializer):
    name = StrictCharField(max_length=64, required=False, allow_blank=True, default="")
    resources = serializers.DictField(
        required=False,
        help_text='e.g. {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}; '
        "required unless `preset` is given, then merged into "
        "the preset's request (`sessions.admission.presets`)",
    )
    preset = StrictCharField(
        required=False,
        allow_blank=False,
        max_length=64,
        help_text="a resource preset's name or id (GET /api/v1/presets/): its request and image; "
        "keys of `resources` replace the preset's (any GPU key its whole GPU request, "
        "null removes one), `image` replaces its image; another "
        "`resources.resource_group` than the preset's is refused (400)",
    )
    command = StrictCharField(
        required=False,
        allow_blank=True,
        default="",
        validators=[validate_command_size],
        help_text="batch command (at most 64 KiB); blank for an interactive shell",
    )
    priority = serializers.IntegerField(
        required=False, default=0, min_value=-100, max_value=100, help_text="higher starts first; above 0 for administrators only"
    )
    image = StrictCharField(
        required=False,
        allow_null=True,
        allow_blank=True,
        default=None,
        max_length=255,
        help_text="a registered session image's reference (GET /api/v1/images/), e.g. "
        '"fgpu-session:test"; absent, null or empty: the default image',
    )
    preemptible = StrictBooleanField(
        required=False,
        allow_null=True,
        default=None,
        help_text="may be stopped (warned first) to make room for a waiting session "
        "of higher priority or of an owner under its fair share; absent or "
        "null: true for a batch command, false for an interactive shell",
    )
    min_runtime = serializers.IntegerField(
        required=False,
        default=0,
        min_value=0,
        max_value=MAX_MIN_RUNTIME,
        help_text=f"seconds after its start during which it is never preempted (0 to {MAX_MIN_RUNTIME}, default 0)",
    )

    preempt_signal = StrictCharField(
        required=False,
        allow_blank=True,
        default="",
        max_length=16,
        help_text="the signal sent to it when it is chosen for preemption, at the start of its grace period "
        '(Slurm\'s --signal): "TERM", "SIGUSR1", … (one of ' + ", ".join(PREEMPT_SIGNALS) + "); absent or empty: its "
        "image's, else SIGTERM",
    )
    requeue = StrictBooleanField(
        required=False,
        default=True,
        help_text="once preempted or moved (and ended), launch it again as a new session with the same request, "
        "command and image, keeping its place by arrival (default true)",
    )

    def validate_preempt_signal(self, value: str) -> str:
        if not value:
            return ""
        try:
            return preempt_signal_name(value)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None

    def validate(self, attrs):
        if "resources" not in attrs and not attrs.get("preset"):
            raise serializers.ValidationError({"resources": ["required (or name a `preset`)"]})
        return attrs


class TerminalTicketSerializer(serializers.Serializer):
    ticket = serializers.CharField(help_text="one-time secret, valid once and until expires_at")
    url = serializers.CharField(help_text="websocket path to open with the ticket: /ws/sessions/<id>/terminal/?ticket=…")
    expires_at = serializers.DateTimeField()


class PreviewDeviceSerializer(serializers.Serializer):
    device = serializers.CharField(help_text="device (GPU or MIG) UUID")
    device_index = serializers.IntegerField()
    model_name = serializers.CharField()
    memory = serializers.IntegerField(help_text="bytes of device memory the session would get")
    procs = serializers.CharField(help_text="SMs the session would get (decimal text)")
    sm_percent = serializers.IntegerField(help_text="SMs as a percentage of the device's (0 or 100: no limit)")
    shares = serializers.CharField(help_text="fGPU equivalent (decimal text)")


class PreviewMigSerializer(serializers.Serializer):
    profile = serializers.CharField(help_text='the MIG profile the session would get: "1g.20gb" (or a static slice\'s name)')
    plan = serializers.CharField(
        help_text='how, in words: "creates a 1g.20gb instance at memory slice 0", '
        '"reuses the idle 1g.20gb instance at memory slice 2"'
    )


class PreviewNeverSerializer(serializers.Serializer):
    asked = serializers.CharField(help_text='what was asked: "cuda: 64 GPUs asked, each with 4 GiB and 25% of its cores."')
    most = serializers.CharField(help_text='the most any node can give: "The most one node can give is 8 such GPUs (n3)."')
    advice = serializers.CharField(help_text='what to do: "Ask for at most 8 GPUs per session (a session runs on one node)."')


class PreviewSerializer(serializers.Serializer):
    outcome = serializers.ChoiceField(
        ["starts", "waits", "refused"],
        help_text="what launching it does now: starts on `node`, waits in the queue, or is refused (400: never fits, or a quota)",
    )
    refusal = serializers.CharField(
        allow_blank=True,
        help_text="the launch's error type when refused: "
        '"never-schedulable", "quota-exceeded", '
        '"resource-group-reserved", or for pinned `devices` no node in reach has "unknown-device", '
        '"device-not-in-group", "device-not-usable", or "name-taken" (`name_error`); "" otherwise',
    )
    name_error = serializers.CharField(
        allow_blank=True,
        required=False,
        help_text='the launch\'s refusal of its `name` (one of your sessions not ended has it); "" when the name is free',
    )
    fits_now = serializers.BooleanField(help_text="a node can take it right now")
    never = serializers.BooleanField(help_text="no registered node could ever take it")
    reason = serializers.CharField(allow_blank=True, help_text="why it waits or is refused; blank when it fits")
    never_detail = PreviewNeverSerializer(
        allow_null=True,
        help_text="`never`'s reason in parts where it has them (a per-device request no node could give): null otherwise",
    )
    status_reason = serializers.CharField(
        allow_blank=True, help_text='the reason its session would show while it waits ("waiting for capacity: …")'
    )
    problems = serializers.ListField(
        child=serializers.CharField(), help_text="a quota's refusal: one sentence per limit passed, as the launch answers"
    )
    node = serializers.CharField(allow_null=True, help_text="where it would go, when it fits now")
    configuration = serializers.CharField(help_text='the request formatted by the slot formats: "0.50 fGPU · 1 core · 1 GiB"')
    devices = PreviewDeviceSerializer(many=True)
    mig = PreviewMigSerializer(
        allow_null=True, help_text="null unless a MIG instance would hold it now; then `devices` is its GPU (or static slice)"
    )
    storage_note = serializers.CharField(
        allow_blank=True,
        help_text="placed on a node without shared storage in a cluster of several: the sentence saying its ~/data and "
        'project folders are local to that node (agent.toml [storage]); "" otherwise',
    )


class LaunchSlotSerializer(serializers.Serializer):
    slot = serializers.CharField(help_text='"cuda.shares" (fractional mode) or "cuda.device" (discrete mode)')
    slot_name = serializers.CharField()
    subtype = serializers.CharField()
    allocation_mode = serializers.CharField()
    display_unit = serializers.CharField()
    display_icon = serializers.CharField()
    human_readable_name = serializers.CharField()
    binary = serializers.BooleanField()
    round_length = serializers.IntegerField()
    quantum = serializers.CharField(help_text="decimal text")
    min = serializers.CharField(help_text="decimal text: the quantum")
    step = serializers.CharField(help_text="decimal text: the quantum")
    max_now = serializers.CharField(help_text="largest amount one session could get now, capped by the caller's quotas")
    max_ever = serializers.CharField(help_text="largest amount one session could get on empty nodes")
    free_now = serializers.CharField(help_text="largest amount one session could get now, quotas aside")
    quota_max = serializers.CharField(
        allow_null=True, help_text="largest amount the caller's quotas allow now (null: no quota limits it)"
    )
    quota_limit = serializers.CharField(
        allow_blank=True, help_text='the limit that sets `quota_max`: "fgpu", "devices", "gpu_memory", "sessions" or ""'
    )
    unit_mem = serializers.IntegerField(help_text="bytes in 1.0 fGPU")
    unit_proc = serializers.IntegerField(help_text="SMs in 1.0 fGPU")


class MaxNowEverSerializer(serializers.Serializer):
    max_now = serializers.IntegerField()
    max_ever = serializers.IntegerField()


class LaunchMigProfileSerializer(serializers.Serializer):
    name = serializers.CharField(help_text='what `{"mig_profile": name}` asks for: "2g.20gb" (or a static slice\'s "10g")')
    memory = serializers.IntegerField(help_text="bytes of GPU memory (the least over the GPUs that have the profile)")
    memory_text = serializers.CharField(help_text='the memory as the console shows sizes: "19.62 GiB"')
    sm_count = serializers.IntegerField(help_text="SMs (0: unknown)")
    compute_slices = serializers.IntegerField(help_text="compute slices of 7 (0: unknown, a static slice named by size)")
    memory_slices = serializers.IntegerField(help_text="memory slices of 8 (0: a static slice)")
    models = serializers.ListField(child=serializers.CharField(), help_text="GPU models (or static slices) that have it")
    max_now = serializers.IntegerField(
        help_text="sessions that could get one now, one after another: idle instances "
        "reused, new ones as the planner would place them, free static "
        "slices; capped by free CPU cores and the caller's session quota"
    )
    idle_now = serializers.IntegerField(help_text="of max_now, how many reuse an idle instance")
    max_ever = serializers.IntegerField(
        help_text="the same on emptied nodes (a fixed layout: the instances it has); 0: it can never be had"
    )


class LaunchMigSerializer(serializers.Serializer):
    slot_name = serializers.CharField(help_text="the slot whose GPUs MIG splits")
    profiles = LaunchMigProfileSerializer(many=True, help_text="smallest first; empty without a MIG node in reach")
    isolation = serializers.ListField(
        child=serializers.ChoiceField(choices=["shared", "mig", "any"]),
        help_text="the `isolation` a memory-sized request may ask for: shared "
        "(a slice of a shared GPU), mig (a MIG instance), any (either, the "
        "scheduler decides); empty without a MIG node in reach",
    )


class LaunchOptionsSerializer(serializers.Serializer):
    slots = LaunchSlotSerializer(many=True)
    mig = LaunchMigSerializer()
    cpu = MaxNowEverSerializer(help_text="cores")
    mem = MaxNowEverSerializer(help_text="bytes")
