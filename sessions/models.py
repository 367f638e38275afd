"""Compute sessions, their device allocations and one-time terminal tickets.

Amounts: `shares` in fGPU (Decimal), `memory` in bytes, `procs` in SMs (Decimal, since
0.1 fGPU × 8 SMs is 0.8 SM), `cpu` in cores, `mem` in bytes.
"""

from __future__ import annotations

import re
import uuid

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models

import protocol
from protocol.channel import DEFAULT_PREEMPT_SIGNAL, preempt_signal_name
from accelerators.models import ResourceGroup
from sessions.service_ports import SERVICE_PORTS_LABEL, ServicePortsError, parse_service_ports


class SessionStatus(models.TextChoices):
    PENDING = "PENDING"
    SCHEDULED = "SCHEDULED"
    PREPARING = "PREPARING"
    RUNNING = "RUNNING"
    TERMINATING = "TERMINATING"
    TERMINATED = "TERMINATED"
    ERROR = "ERROR"
    CANCELLED = "CANCELLED"


ACTIVE_STATUSES = tuple(SessionStatus(state) for state in protocol.SESSION_ACTIVE_STATES)
FINAL_STATUSES = (SessionStatus.TERMINATED, SessionStatus.ERROR, SessionStatus.CANCELLED)

# `ComputeSession.version` after a write that changes what a session shows (status, reason, node,
# times): an update sets `version=NEXT_VERSION`, or a `save(update_fields=[…, "version"])` after
# `session.version = NEXT_VERSION`. Raised in the database, so concurrent writers never reuse one.
NEXT_VERSION = models.F("version") + 1


IMAGE_REFERENCE_RE = r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$"
SLOT_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]*$")


def validate_image_accelerators(value) -> None:
    """A list of slot names (`["cuda"]`), each once; empty: any. Raises ValidationError."""
    if not isinstance(value, list) or not all(isinstance(v, str) and SLOT_NAME_RE.match(v) for v in value):
        raise ValidationError(
            'a list of slot names such as ["cuda"] (lower-case letters, digits, "-" and "_"); empty: any accelerator'
        )
    if len(set(value)) != len(value):
        raise ValidationError("each slot name once")


def validate_image_labels(value) -> None:
    """An object of text values (`{"framework": "pytorch"}`). Raises ValidationError."""
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValidationError('an object whose values are text, e.g. {"framework": "pytorch"}')
    if SERVICE_PORTS_LABEL in value:  # Backend.AI's apps label: its apps are the image's too (service_ports)
        try:
            parse_service_ports(value[SERVICE_PORTS_LABEL])
        except ServicePortsError as exc:
            raise ValidationError(str(exc)) from None


APP_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
APP_FIELDS = {"name", "title", "command", "port", "protocol", "base_url", "path", "timeout"}
APP_PROTOCOLS = ("http",)
TERMINAL_APP = "terminal"  # the built-in app: the web terminal (never declared by an image)
MAX_APPS = 16


def validate_image_apps(value) -> None:
    """The web apps an image declares (issue 16; Backend.AI's service ports): a list of
    `{"name": "jupyter", "title": "JupyterLab", "command": "jupyter lab --ip={host} --port={port}
    --ServerApp.base_url={base_url} --IdentityProvider.token={token}", "port": 8888, "protocol":
    "http", "base_url": true, "path": "lab", "timeout": 120}`. `name`: lower-case letters, digits
    and "-", unique, not "terminal" (built in); `command`: one shell command line, in which the
    agent replaces `{host}` (the address to listen on), `{port}`, `{base_url}` (the console's
    prefix, "/sessions/<id>/apps/<name>/") and `{token}` (the app's token, set by the console);
    `port`: 1-65535, where it listens inside a container (the process runtime gives `{port}` a
    free port of the node); `base_url`: whether the app is served under the prefix (true: it
    gets the whole path; false: the prefix is taken off); `path`: where opening it goes, under
    the prefix; `timeout`: seconds to wait for its port (1-600, default 60). Raises ValidationError."""
    if not isinstance(value, list) or len(value) > MAX_APPS:
        raise ValidationError(
            f"a list of at most {MAX_APPS} apps, each "
            '{"name", "command", "port"} and optionally "title", "protocol", "base_url", "path", '
            '"timeout"'
        )
    names = set()
    for i, app in enumerate(value):
        where = f"app {i + 1}"
        if not isinstance(app, dict):
            raise ValidationError(f"{where}: an object with name, command and port")
        unknown = set(app) - APP_FIELDS
        if unknown:
            raise ValidationError(
                f"{where}: unknown field(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(APP_FIELDS))})"
            )
        name = app.get("name")
        if not isinstance(name, str) or not APP_NAME_RE.match(name):
            raise ValidationError(f"{where}: name: lower-case letters, digits and '-', starting with a letter, at most 32")
        where = f"app {name!r}"
        if name == TERMINAL_APP or name in names:
            raise ValidationError(f"{where}: name: " + ("the terminal is built in" if name == TERMINAL_APP else "each name once"))
        names.add(name)
        command = app.get("command")
        if not isinstance(command, str) or not command.strip() or len(command) > 4096 or "\x00" in command or not _utf8(command):
            raise ValidationError(f"{where}: command: one shell command line (1-4096 characters)")
        port = app.get("port")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValidationError(f"{where}: port: a whole number from 1 to 65535")
        if app.get("protocol", "http") not in APP_PROTOCOLS:
            raise ValidationError(f"{where}: protocol: {', '.join(APP_PROTOCOLS)}")
        if not isinstance(app.get("base_url", True), bool):
            raise ValidationError(f"{where}: base_url: true or false")
        title, path = app.get("title", ""), app.get("path", "")
        if not isinstance(title, str) or len(title) > 64 or any(ord(c) < 32 or ord(c) == 127 for c in title) or not _utf8(title):
            raise ValidationError(f"{where}: title: text of at most 64 characters")
        if (
            not isinstance(path, str)
            or len(path) > 255
            or not re.fullmatch(r"[A-Za-z0-9._~/?=&%+-]*", path)
            or path.startswith("/")
            or ".." in path
        ):
            raise ValidationError(f'{where}: path: a relative path such as "lab" (no "..")')
        timeout = app.get("timeout", 60)
        if isinstance(timeout, bool) or not isinstance(timeout, int) or not 1 <= timeout <= 600:
            raise ValidationError(f"{where}: timeout: seconds from 1 to 600")


def _utf8(text: str) -> bool:
    """Whether `text` has no unpaired surrogate (which PostgreSQL cannot store)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate_preempt_signal(value: str) -> None:
    """A preemption signal's name in the form protocol.channel.preempt_signal_name gives ("SIGUSR1")."""
    try:
        name = preempt_signal_name(value)
    except ValueError as exc:
        raise ValidationError(str(exc)) from None
    if name != value:
        raise ValidationError(f"write it {name}")


class SessionImage(models.Model):
    """A container image sessions may run in, registered by an administrator (Backend.AI's kernel
    images): `reference` as Docker names it ("nvcr.io/nvidia/pytorch:24.05-py3",
    "fgpu-session:test"), what people read (`display_name`, `description`), the accelerator
    slots it supports (`accelerators`, e.g. ["cuda"]; empty: any, CPU-only sessions too), the
    interactive shell it has (`shell`, a path inside it; empty: the runtime's, bash), free-form
    `labels`. At most one is the default (`is_default`): the image of a launch that names none;
    where none is marked, the built-in "host" is. "host" is the process runtime's one image:
    the node's own system (created by migration 0007). A session runs only on a node whose agent
    reports holding its image (`Node.images`)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    reference = models.CharField(
        max_length=255,
        unique=True,
        validators=[
            RegexValidator(
                IMAGE_REFERENCE_RE,
                'an image reference such as "nvcr.io/nvidia/pytorch:24.05-py3" (letters, digits and . _ / : @ + -)',
            )
        ],
        help_text='as Docker names it: "registry/repository:tag" or "…@sha256:…"; "host": the process runtime\'s',
    )
    display_name = models.CharField(max_length=128, blank=True, help_text="what the launch dialog shows; empty: the reference")
    description = models.TextField(blank=True)
    accelerators = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_image_accelerators],
        help_text='slot names it supports, e.g. ["cuda"]; empty: any (CPU-only too)',
    )
    shell = models.CharField(
        max_length=255,
        blank=True,
        validators=[RegexValidator(r"^/\S+$", "an absolute path inside the image, e.g. /bin/bash")],
        help_text="the interactive shell inside the image, e.g. /bin/bash; empty: the runtime's",
    )
    labels = models.JSONField(
        default=dict,
        blank=True,
        validators=[validate_image_labels],
        help_text='free-form text labels, e.g. {"framework": "pytorch"}',
    )
    is_default = models.BooleanField("default", default=False, help_text="the image of a launch that names none (at most one)")
    preempt_signal = models.CharField(
        max_length=8,
        blank=True,
        validators=[validate_preempt_signal],
        help_text="the signal its sessions get at a preemption notice unless the launch names one "
        '("SIGUSR1"; Slurm\'s --signal); empty: SIGTERM',
    )
    apps = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_image_apps],
        help_text='web apps it offers besides the terminal (sessions.serving.session_apps), e.g. [{"name": '
        '"jupyter", "title": "JupyterLab", "command": "jupyter lab --ip={host} '
        '--port={port} …", "port": 8888, "base_url": true, "path": "lab"}]',
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-is_default", "reference"]
        verbose_name = "session image"
        constraints = [
            models.UniqueConstraint(
                fields=["is_default"],
                condition=models.Q(is_default=True),
                name="session_image_one_default",
                violation_error_message="another image is the default already",
            )
        ]

    def __str__(self) -> str:
        return self.reference

    def validate_constraints(self, exclude=None):
        """As Django's, but "at most one default" is not a form error: `sessions.policy.images.image_save`
        moves the mark from the old default (the database constraint still holds)."""
        super().validate_constraints(exclude={*(exclude or ()), "is_default"})


class ComputeSession(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=64)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="compute_sessions")
    status = models.CharField(max_length=12, choices=SessionStatus.choices, default=SessionStatus.PENDING, db_index=True)
    status_reason = models.TextField(blank=True)
    resources = models.JSONField(default=dict, help_text="the request as the user sent it")
    request_spec = models.JSONField(
        default=dict, blank=True, help_text="the request normalised (accelerators.allocation.requests.request_to_spec)"
    )
    slot_name = models.CharField(max_length=32, blank=True, help_text="accelerator slot requested, blank for CPU-only")
    slot_subtype = models.CharField(max_length=32, blank=True, help_text='"shares", "device" or "per_device"')
    amount = models.DecimalField(
        max_digits=12, decimal_places=3, default=0, help_text="fGPU shares, or a device count (device, per_device)"
    )
    cpu = models.PositiveIntegerField(default=1, help_text="CPU cores")
    mem = models.BigIntegerField(default=0, help_text="main memory, bytes")
    command = models.TextField(blank=True, help_text="batch command; blank for an interactive shell")
    image = models.ForeignKey(
        SessionImage,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="sessions",
        help_text="the image it runs in; empty for sessions from before images (any node)",
    )
    priority = models.SmallIntegerField(default=0, help_text="higher starts first; equal priorities in arrival order")
    overtaken = models.PositiveIntegerField(default=0, help_text="how many later sessions were backfilled past it")
    node = models.ForeignKey("accelerators.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="sessions")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    scheduled_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    terminated_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    version = models.PositiveBigIntegerField(
        default=0, help_text="raised by every write a page shows (status, reason, node, times): the newest state has the highest"
    )
    preemptible = models.BooleanField(
        default=False,
        help_text="may be stopped to make room for a waiting session of higher priority or of an owner "
        "under its fair share (sessions.scheduling.preemption); a launch's default: batch yes, "
        "interactive no",
    )
    min_runtime = models.PositiveIntegerField(default=0, help_text="seconds after its start during which it is never preempted")
    preempted_for = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="preempting",
        help_text="the waiting session it is (or was) preempted to make room for",
    )
    preempt_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="when it is stopped, having been warned (the warning + the grace period); null: not under notice",
    )
    preempt_signal = models.CharField(
        max_length=8,
        blank=True,
        validators=[validate_preempt_signal],
        help_text="the signal sent to it at a preemption notice, as Slurm's --signal (\"SIGUSR1\"); empty: its image's, "
        "else SIGTERM",
    )
    requeue = models.BooleanField(
        default=True, help_text="once preempted or moved, it is launched again as a new session (requeued_as)"
    )
    requeued_from = models.OneToOneField(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="the preempted or moved session this one asks again for (same request, command and image)",
    )
    requeued_as = models.OneToOneField(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="the session launched again for this one once it was preempted or moved",
    )

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "compute session"
        constraints = [
            # A user's sessions not ended have distinct names; an ended one's name may be used
            # again (Backend.AI's ix_sessions_unique_name_nonterminal, per user). In the
            # database, so two launches at once cannot both take a name (issue 36.6).
            models.UniqueConstraint(
                fields=["owner", "name"],
                condition=~models.Q(status__in=["TERMINATED", "ERROR", "CANCELLED"]),
                name="session_name_unique_live",
                violation_error_message="you have a session of this name that has not ended",
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.status})"

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE_STATUSES

    @property
    def preempt_signal_sent(self) -> str:
        """The signal it gets at a preemption notice: its launch's `preempt_signal`, else its
        image's, else SIGTERM (a name of protocol.channel.PREEMPT_SIGNALS). Reads its image."""
        image = self.image.preempt_signal if self.image is not None else ""
        return self.preempt_signal or image or DEFAULT_PREEMPT_SIGNAL


class Allocation(models.Model):
    """What one session holds on one device. Live while `released_at` is null."""

    session = models.ForeignKey(ComputeSession, on_delete=models.CASCADE, related_name="allocations")
    device = models.ForeignKey("accelerators.Device", on_delete=models.PROTECT, related_name="allocations")
    shares = models.DecimalField(max_digits=12, decimal_places=3, help_text="fGPU (1 for a whole device)")
    memory = models.BigIntegerField(help_text="bytes of device memory")
    procs = models.DecimalField(max_digits=12, decimal_places=3, help_text="SMs")
    created_at = models.DateTimeField(auto_now_add=True)
    released_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["session", "device__index"]


class TerminalTicket(models.Model):
    """A one-time, short-lived credential for opening one session's terminal websocket.

    Only the SHA-256 digest of the ticket is stored.
    """

    digest = models.CharField(max_length=64, unique=True)
    session = models.ForeignKey(ComputeSession, on_delete=models.CASCADE, related_name="terminal_tickets")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)


class Project(models.Model):
    """A group of users sharing one quota (besides each member's own). Its members' sessions
    count against every quota of the project."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=64, unique=True)
    description = models.TextField(blank=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, related_name="projects", blank=True)
    resource_groups = models.ManyToManyField(
        "accelerators.ResourceGroup",
        related_name="projects",
        blank=True,
        verbose_name="resource groups",
        help_text="resource groups reserved for this project's members (with every other project naming them); "
        "a group no project names is open to everyone",
    )
    share_weight = models.PositiveIntegerField(
        default=1,
        validators=[MinValueValidator(1)],
        verbose_name="fair-share weight",
        help_text="the project's share of the cluster over time against the other projects' weights (and 1 for "
        "each user in no project): its members' sessions start ahead while it used less than its share "
        "(sessions.scheduling.fairshare)",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ResourcePreset(models.Model):
    """A named request administrators define for users to launch (Backend.AI's resource presets,
    Run:ai's compute resources): "Small notebook: 0.25 fGPU, 2 cores, 8 GiB".

    `resources` is the GPU part of a launch's `resources`, in any request style a launch takes
    (`{"cuda.shares": "0.25"}`, `{"gpu": 1, "gpu_memory": "4G", "gpu_cores": 50}`,
    `{"mig_profile": "1g.10gb"}`, …, plus options such as `policy`; `{}`: CPU only); `cpu` in
    cores and `mem` in bytes are its own columns, and so is the scope: a preset with a
    `resource_group` launches into that group and is offered only to users who may use the group
    (`sessions.admission.presets`); one without is offered to everyone and goes to any node. `image`: the
    session image it launches in (empty: the default image; deleting the image empties it).
    `request()` is the whole `resources` a launch by this preset sends. Checked as a launch is
    checked by `sessions.admission.presets.preset_check`."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(
        max_length=64,
        unique=True,
        validators=[RegexValidator(r"^[^\x00-\x1f\x7f-\x9f]+$", "no control characters (newline, tab, escape, …)")],
        help_text='what users pick, e.g. "Small notebook"; `fgpu launch --preset` takes it',
    )
    description = models.CharField(max_length=255, blank=True, help_text="one line the launch dialog shows under it")
    resources = models.JSONField(
        default=dict,
        blank=True,
        verbose_name="GPU request",
        help_text='in any request style a launch takes, e.g. {"cuda.shares": "0.25"}, '
        '{"gpu": 1, "gpu_memory": "4G", "gpu_cores": 50}, {"gpu_fraction": "0.2"}, '
        '{"mig_profile": "1g.10gb"}; {} for a CPU-only session',
    )
    cpu = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)], verbose_name="CPU cores")
    mem = models.BigIntegerField(
        default=1 << 30, validators=[MinValueValidator(1)], verbose_name="host memory", help_text="bytes"
    )
    image = models.ForeignKey(
        SessionImage,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="presets",
        help_text="empty: the default image",
    )
    resource_group = models.ForeignKey(
        "accelerators.ResourceGroup",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="presets",
        verbose_name="resource group",
        help_text="launches into this group and is offered only to those who may use it; empty: any node, everyone",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "resource preset"

    def __str__(self) -> str:
        return self.name

    def request(self) -> dict:
        """The `resources` of a launch by this preset: the GPU request, `cpu` (cores), `mem`
        (bytes) and `resource_group` (its name) where it has one."""
        request = {**(self.resources if isinstance(self.resources, dict) else {}), "cpu": self.cpu, "mem": self.mem}
        if self.resource_group_id is not None and (group := self.resource_group) is not None:
            request["resource_group"] = group.name
        return request


class Quota(models.Model):
    """Limits for one user or one project (exactly one of the two). A limit left empty is
    unlimited. `max_fgpu` in fGPU (shares requests and the fGPU equivalent of per-device
    grants), `max_devices` distinct devices held at once, `max_gpu_memory` bytes of device
    memory, `max_sessions` sessions running or waiting (PENDING and the active statuses).
    Rules and counting: sessions.policy.quotas."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="quotas")
    project = models.ForeignKey(Project, null=True, blank=True, on_delete=models.CASCADE, related_name="quotas")
    max_fgpu = models.DecimalField(
        max_digits=12, decimal_places=3, null=True, blank=True, help_text="fGPU held at once; empty: unlimited"
    )
    max_devices = models.PositiveIntegerField(null=True, blank=True, help_text="distinct devices held at once; empty: unlimited")
    max_gpu_memory = models.BigIntegerField(
        null=True, blank=True, help_text="bytes of device memory held at once; empty: unlimited"
    )
    max_sessions = models.PositiveIntegerField(
        null=True, blank=True, help_text="sessions running or waiting at once; empty: unlimited"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["project__name", "user__username"]
        constraints = [
            models.CheckConstraint(
                condition=(
                    models.Q(user__isnull=False, project__isnull=True) | models.Q(user__isnull=True, project__isnull=False)
                ),
                name="quota_user_xor_project",
                violation_error_message="a quota is for one user or for one project: set exactly one of the two",
            ),
            models.UniqueConstraint(
                fields=["user"],
                condition=models.Q(user__isnull=False),
                name="quota_one_per_user",
                violation_error_message="this user already has a quota",
            ),
            models.UniqueConstraint(
                fields=["project"],
                condition=models.Q(project__isnull=False),
                name="quota_one_per_project",
                violation_error_message="this project already has a quota",
            ),
            models.CheckConstraint(
                condition=models.Q(max_fgpu__gte=0) | models.Q(max_fgpu__isnull=True),
                name="quota_max_fgpu_not_negative",
                violation_error_message="max fGPU cannot be negative",
            ),
            models.CheckConstraint(
                condition=models.Q(max_gpu_memory__gte=0) | models.Q(max_gpu_memory__isnull=True),
                name="quota_max_gpu_memory_not_negative",
                violation_error_message="max GPU memory cannot be negative",
            ),
        ]

    def __str__(self) -> str:
        return f"quota of {self.subject}"

    @property
    def subject(self) -> str:
        """'project "vision"' or 'user "alice"'."""
        if self.project_id is not None and (project := self.project) is not None:
            return f'project "{project.name}"'
        return f'user "{user.get_username()}"' if self.user_id is not None and (user := self.user) is not None else "nobody"


class SessionLog(models.Model):
    """The output log of one session, as its agent shipped it (sessions.lifecycle.services.session_log_append).

    Offsets count characters (Unicode code points) of the session's output from its start.
    `length` is the offset just past the last character received; `complete` is set when the
    agent sent its last batch (the session's process ended). Only the last
    FGPU_SESSION_LOG_MAX_CHARS characters (settings; about 4 MiB of plain text) are kept.
    """

    session = models.OneToOneField(ComputeSession, primary_key=True, on_delete=models.CASCADE, related_name="log")
    length = models.BigIntegerField(default=0, help_text="characters received so far (the end offset)")
    complete = models.BooleanField(default=False, help_text="the agent sent the last batch")
    updated_at = models.DateTimeField(auto_now=True)


class SessionLogChunk(models.Model):
    """One batch of a session's output: characters `offset` … `offset + len(text)`. `seq`
    numbers the agent's batches from 0; (session, seq) is unique, so a batch delivered twice is
    stored once. `end` is `offset + len(text)`, kept for trimming."""

    session = models.ForeignKey(ComputeSession, on_delete=models.CASCADE, related_name="log_chunks")
    seq = models.PositiveIntegerField()
    offset = models.BigIntegerField()
    end = models.BigIntegerField()
    text = models.TextField(blank=True)

    class Meta:
        ordering = ["session", "seq"]
        constraints = [models.UniqueConstraint(fields=["session", "seq"], name="session_log_chunk_unique_seq")]
        indexes = [models.Index(fields=["session", "end"], name="session_log_chunk_end")]  # reads from a cursor


class IdempotencyKey(models.Model):
    """The answer to a launch (`POST /api/v1/sessions/`) sent with an `Idempotency-Key`
    header, kept so that the same user repeating the key gets the same answer and no second
    session (sessions.admission.idempotency). (user, key) is unique: of two requests racing with one key,
    the second waits on the first's row and then replays its answer. `fingerprint` is the
    SHA-256 of the request body, to refuse a key reused for another request. Rows older than
    sessions.admission.idempotency.KEY_TTL are ignored and deleted."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=255, help_text="the header's value: 1 to 255 printable ASCII characters")
    fingerprint = models.CharField(max_length=64, help_text="SHA-256 (hex) of the request body's JSON, keys sorted")
    session = models.ForeignKey(
        ComputeSession,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="the session the request created",
    )
    status_code = models.PositiveSmallIntegerField(
        null=True, help_text="the HTTP status answered (null only inside the transaction that answers)"
    )
    response = models.TextField(blank=True, help_text="the body answered, as JSON text (jsonb would reorder its keys)")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "key"], name="idempotency_key_unique_per_user")]


class FragmentationMap(ResourceGroup):
    """A resource group seen through its fragmentation map and compaction plan (issue 17.4): the
    admin's page per group (sessions.admin, sessions.scheduling.compaction). A proxy: no table of its own."""

    class Meta:
        proxy = True
        verbose_name = "fragmentation map"
        verbose_name_plural = "fragmentation maps"


class SharePermission(models.TextChoices):
    READ_ONLY = "ro", "read-only"
    READ_WRITE = "rw", "read-write"


class FolderShare(models.Model):
    """A data folder shared with a user or a project (issue 36.5; Backend.AI's vfolder invitations as
    the model, but granted at once: no invitation to accept). The folder is a user's persistent
    folder (`owner`: their ~/data) or a project's (`project`: ~/projects/<name>), one of the two;
    the grantee a user (`user`) or every member of a project (`to_project`), one of the two.
    `permission`: "ro" (the node mounts it read-only: bwrap --ro-bind, a read-only Docker volume;
    the file API refuses writes) or "rw". Recipients see it at ~/shared/<share_name>. One share
    per (folder, grantee): sharing again changes its permission."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="folder_shares_out",
        help_text="whose ~/data is shared (or null: a project's folder)",
    )  # fmt: skip
    project = models.ForeignKey(
        Project, null=True, blank=True, on_delete=models.CASCADE, related_name="folder_shares_out",
        help_text="whose project folder is shared (or null: a user's ~/data)",
    )  # fmt: skip
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="folder_shares_in",
        help_text="the user it is shared with (or null: a project)",
    )  # fmt: skip
    to_project = models.ForeignKey(
        Project, null=True, blank=True, on_delete=models.CASCADE, related_name="folder_shares_in",
        help_text="the project whose members it is shared with (or null: a user)",
    )  # fmt: skip
    permission = models.CharField(max_length=2, choices=SharePermission.choices, default=SharePermission.READ_ONLY)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(owner__isnull=False, project__isnull=True)
                | models.Q(owner__isnull=True, project__isnull=False),
                name="folder_share_one_folder",
            ),
            models.CheckConstraint(
                condition=models.Q(user__isnull=False, to_project__isnull=True)
                | models.Q(user__isnull=True, to_project__isnull=False),
                name="folder_share_one_grantee",
            ),
            models.UniqueConstraint(
                fields=["owner", "project", "user", "to_project"], name="folder_share_unique", nulls_distinct=False
            ),
        ]

    def __str__(self) -> str:
        return f"{self.share_name} → {self.user or self.to_project} ({self.permission})"

    @property
    def share_name(self) -> str:
        """The folder's name under ~/shared: "<user name>-data" or "<project name>-project"."""
        return share_name(owner=self.owner, project=self.project)


def share_name(*, owner=None, project=None) -> str:
    """ "<user name>-data" for a user's ~/data, "<project name>-project" for a project's folder:
    distinct for any two folders (the suffix says which kind, user and project names are unique)."""
    return f"{owner.get_username()}-data" if owner is not None else f"{project.name}-project"
