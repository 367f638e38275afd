"""Django admin pages for projects, quotas, session images, resource presets and (read-only)
compute sessions.

Quotas show each limit next to what is in use now (`sessions.policy.quotas.quota_usage_of`); GPU
memory is entered and shown in binary units ("40G", "40 GiB"), fGPU as Decimal text.
Sessions are read-only here: they change only through their services (terminate from the
console or the API), so their allocations are released exactly once.
"""

from __future__ import annotations

import json

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Count, QuerySet
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join

from accelerators.allocation.errors import AllocationError
from accelerators.allocation.requests import parse_resources
from accelerators.admin_display import EMPTY, BinarySizeField, size_html, when_html
from protocol.units import format_binary_size
from common.errors import ApplicationError
from sessions.scheduling.fairshare import account_shares, half_life_seconds
from sessions.policy.images import image_save, image_sessions_waiting_or_active
from sessions.models import Allocation, ComputeSession, FragmentationMap, Project, Quota, ResourcePreset, SessionImage
from sessions.admission.presets import preset_check, preset_save
from sessions.policy.quotas import QuotaUsage, fgpu_text, quota_usage_of
from sessions.selectors import request_configuration, session_configuration, session_request


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ("name", "member_count", "description", "share_weight", "fair_share", "created")
    search_fields = ("name", "description", "members__username")
    filter_horizontal = ("members", "resource_groups")
    fields = ("name", "description", "members", "resource_groups", "share_weight")

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).annotate(member_count=Count("members", distinct=True))

    def get_changelist_instance(self, request):
        """The page's projects, each with `fair_share_now` (sessions.scheduling.fairshare.AccountShare, or
        None for an inactive project): the standing is read once per page, not per row."""
        changelist = super().get_changelist_instance(request)
        shares = {a.name: a for a in account_shares() if a.kind == "project"}
        for project in changelist.result_list:
            project.fair_share_now = shares.get(project.name)
        return changelist

    @admin.display(description="fair share now")
    def fair_share(self, obj: Project) -> str:
        """Its factor and usage against its share (sessions.scheduling.fairshare), or why it has none."""
        account = getattr(obj, "fair_share_now", None)
        if account is None:
            return "inactive (no usage, nothing waiting)" if half_life_seconds() else "off"
        return format_html(
            '<span title="{} decayed fGPU-hours; {} waiting">factor {} · {} % used of a {} % share</span>',
            f"{account.usage / 3600:.2f}",
            account.pending,
            f"{account.factor:.3f}",
            f"{account.usage_share * 100:.0f}",
            f"{account.weight_share * 100:.0f}",
        )

    @admin.display(description="members", ordering="member_count")
    def member_count(self, obj: Project) -> int:
        return obj.member_count  # type: ignore[attr-defined]  # annotated by get_queryset: django-stubs cannot see it

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: Project) -> str:
        return when_html(obj.created_at)


class QuotaForm(forms.ModelForm):
    max_gpu_memory = BinarySizeField(
        required=False, label="Max GPU memory", help_text='device memory held at once, e.g. "40G"; empty: unlimited'
    )

    class Meta:
        model = Quota
        fields = ("user", "project", "max_fgpu", "max_devices", "max_gpu_memory", "max_sessions")
        labels = {"max_fgpu": "Max fGPU", "max_devices": "Max devices", "max_sessions": "Max sessions"}


def _usage(obj: Quota) -> QuotaUsage:
    """The quota's usage, computed once per row of the page."""
    cached = vars(obj)  # the instance's own attributes: the page's cache lives there
    if "_usage" not in cached:
        cached["_usage"] = quota_usage_of(quota=obj)
    return cached["_usage"]


def _of(used: str, limit: str | None) -> str:
    return f"{used} / {'unlimited' if limit is None else limit}"


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    form = QuotaForm
    list_display = ("subject_display", "fgpu", "devices", "gpu_memory", "sessions", "updated")
    list_select_related = ("user", "project")
    search_fields = ("user__username", "project__name")
    autocomplete_fields = ("user", "project")
    readonly_fields = ("usage",)
    fields = ("user", "project", "max_fgpu", "max_devices", "max_gpu_memory", "max_sessions", "usage")

    @admin.display(description="for")
    def subject_display(self, obj: Quota) -> str:
        return obj.subject

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, obj: Quota) -> str:
        return when_html(obj.updated_at)

    @admin.display(description="fGPU in use / max")
    def fgpu(self, obj: Quota) -> str:
        return _of(fgpu_text(_usage(obj).fgpu), None if obj.max_fgpu is None else fgpu_text(obj.max_fgpu))

    @admin.display(description="devices in use / max")
    def devices(self, obj: Quota) -> str:
        return _of(str(_usage(obj).devices), None if obj.max_devices is None else str(obj.max_devices))

    @admin.display(description="GPU memory in use / max")
    def gpu_memory(self, obj: Quota) -> str:
        limit = None if obj.max_gpu_memory is None else format_binary_size(obj.max_gpu_memory)
        return _of(format_binary_size(_usage(obj).gpu_memory), limit)

    @admin.display(description="sessions running or waiting / max")
    def sessions(self, obj: Quota) -> str:
        return _of(str(_usage(obj).sessions), None if obj.max_sessions is None else str(obj.max_sessions))

    @admin.display(description="in use now")
    def usage(self, obj: Quota) -> str:
        if obj.pk is None:
            return "—"
        return " · ".join(
            (
                f"fGPU {self.fgpu(obj)}",
                f"devices {self.devices(obj)}",
                f"GPU memory {self.gpu_memory(obj)}",
                f"sessions {self.sessions(obj)}",
            )
        )


@admin.register(SessionImage)
class SessionImageAdmin(admin.ModelAdmin):
    """Session images sessions may run in (Backend.AI's kernel images). Marking one default takes
    the mark from the other (`sessions.policy.images.image_save`); an image that sessions waiting or
    running use cannot be deleted."""

    list_display = ("reference", "display_name", "accelerator_list", "is_default", "holding_nodes", "in_use", "created")
    list_filter = ("is_default",)
    search_fields = ("reference", "display_name", "description")
    fields = (
        "reference",
        "display_name",
        "description",
        "accelerators",
        "shell",
        "labels",
        "apps",
        "preempt_signal",
        "is_default",
        "holding_nodes",
    )
    readonly_fields = ("holding_nodes",)

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: SessionImage) -> str:
        return when_html(obj.created_at)

    @admin.display(description="accelerators")
    def accelerator_list(self, obj: SessionImage) -> str:
        return ", ".join(obj.accelerators) or "any"

    @admin.display(description="on alive nodes")
    def holding_nodes(self, obj: SessionImage) -> str:
        from accelerators.models import Node, NodeStatus
        from accelerators.selectors import node_runs_image

        if obj.pk is None:
            return "—"
        names = Node.objects.filter(node_runs_image(obj.reference), status=NodeStatus.ALIVE).order_by("name")
        return ", ".join(names.values_list("name", flat=True)) or "none (sessions in it wait)"

    @admin.display(description="sessions waiting or running")
    def in_use(self, obj: SessionImage) -> int:
        return image_sessions_waiting_or_active(image=obj)

    def save_model(self, request: HttpRequest, obj: SessionImage, form, change: bool) -> None:
        image_save(image=obj)

    def has_delete_permission(self, request: HttpRequest, obj: SessionImage | None = None) -> bool:
        allowed = super().has_delete_permission(request, obj)
        return allowed and (obj is None or not image_sessions_waiting_or_active(image=obj))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet) -> None:
        """The bulk action deletes only images no waiting or running session uses, and says which
        it kept."""
        kept = [image.reference for image in queryset if image_sessions_waiting_or_active(image=image)]
        queryset.exclude(reference__in=kept).delete()
        if kept:
            self.message_user(request, f"Kept {', '.join(kept)}: sessions waiting or running use them.", messages.WARNING)


class AllocationInline(admin.TabularInline):
    """What the session holds (or held) on each device, in GiB and SMs."""

    model = Allocation
    extra = 0
    can_delete = False
    verbose_name = "allocation"
    fields = ("device", "fgpu", "device_memory", "sms", "held_since", "released")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).select_related("device__node")

    @admin.display(description="fGPU")
    def fgpu(self, obj: Allocation) -> str:
        return fgpu_text(obj.shares)

    @admin.display(description="GPU memory")
    def device_memory(self, obj: Allocation) -> str:
        return size_html(obj.memory)

    @admin.display(description="SMs")
    def sms(self, obj: Allocation) -> str:
        return f"{obj.procs.normalize():f}"

    @admin.display(description="held since")
    def held_since(self, obj: Allocation) -> str:
        return when_html(obj.created_at)

    @admin.display(description="released")
    def released(self, obj: Allocation) -> str:
        return when_html(obj.released_at) if obj.released_at else "still held"

    def has_add_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


@admin.register(ComputeSession)
class ComputeSessionAdmin(admin.ModelAdmin):
    """Read-only: sessions are created, scheduled and ended by their services only. The page
    says what was asked and granted in the console's words; the scheduler's bookkeeping
    (backfill count, version, the normalised request) sits in a folded "Internals" section,
    each field explained."""

    list_display = ("name", "status", "owner", "node", "image", "configuration", "created")
    list_filter = ("status", "node")
    list_select_related = ("owner", "node", "image")
    search_fields = ("name", "owner__username", "=id")
    date_hierarchy = "created_at"
    inlines = (AllocationInline,)
    fieldsets = (
        (None, {"fields": ("name", "owner", "status", "status_reason", "image", "command_text")}),
        ("Request", {"fields": ("configuration", "request_sent", "cpu_cores", "host_memory", "priority")}),
        ("Where and when", {"fields": ("node", "created", "scheduled", "started", "terminated", "exit_code")}),
        (
            "Internals (the scheduler's bookkeeping)",
            {"classes": ("collapse",), "fields": ("backfilled_past", "version", "normalised_request")},
        ),
    )
    readonly_fields = (
        "name",
        "owner",
        "status",
        "status_reason",
        "image",
        "command_text",
        "configuration",
        "request_sent",
        "cpu_cores",
        "host_memory",
        "priority",
        "node",
        "created",
        "scheduled",
        "started",
        "terminated",
        "exit_code",
        "backfilled_past",
        "version",
        "normalised_request",
    )

    @admin.display(description="configuration")
    def configuration(self, obj: ComputeSession) -> str:
        return session_configuration(obj)

    @admin.display(description="command")
    def command_text(self, obj: ComputeSession) -> str:
        return obj.command or "an interactive shell"

    @admin.display(description="request as sent")
    def request_sent(self, obj: ComputeSession) -> str:
        return _json_lines(obj.resources)

    @admin.display(description="CPU cores")
    def cpu_cores(self, obj: ComputeSession) -> int:
        return obj.cpu

    @admin.display(description="host memory")
    def host_memory(self, obj: ComputeSession) -> str:
        return size_html(obj.mem)

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: ComputeSession) -> str:
        return when_html(obj.created_at)

    @admin.display(description="scheduled")
    def scheduled(self, obj: ComputeSession) -> str:
        return when_html(obj.scheduled_at)

    @admin.display(description="started")
    def started(self, obj: ComputeSession) -> str:
        return when_html(obj.started_at)

    @admin.display(description="ended")
    def terminated(self, obj: ComputeSession) -> str:
        return when_html(obj.terminated_at)

    @admin.display(description="overtaken by backfill")
    def backfilled_past(self, obj: ComputeSession) -> str:
        """`overtaken`: how many later, smaller sessions started past this one while it waited; at
        FGPU_BACKFILL_LIMIT nothing more may pass it."""
        times = "once" if obj.overtaken == 1 else f"{obj.overtaken} times"
        return (
            f"{times} — later sessions that started past it while it waited (backfill); once this reaches "
            f"FGPU_BACKFILL_LIMIT nothing more may start before it"
        )

    @admin.display(description="normalised request")
    def normalised_request(self, obj: ComputeSession) -> str:
        return _json_lines(obj.request_spec)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: ComputeSession | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: ComputeSession | None = None) -> bool:
        return False


_BYTE_KEYS = ("mem", "memory", "gpu_memory")


def _json_lines(value: dict) -> str:
    """A JSON object as "key: value" lines (values as JSON; sizes in bytes as binary sizes with the
    bytes on hover), "—" when empty."""
    if not value:
        return EMPTY

    def shown(key, item):
        if key in _BYTE_KEYS and isinstance(item, int) and not isinstance(item, bool):
            return size_html(item)
        return json.dumps(item, ensure_ascii=False)

    return format_html_join("", "<div><code>{}</code>: {}</div>", ((key, shown(key, item)) for key, item in value.items()))


class ResourcePresetForm(forms.ModelForm):
    """A preset's fields in the console's words: the GPU request as JSON in any launch style, host
    memory as a binary size; saved only when `sessions.admission.presets.preset_check` passes, its refusal
    shown under the field it names."""

    resources = forms.JSONField(
        label="GPU request",
        required=False,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        help_text='JSON in any request style a launch takes: {"cuda.shares": "0.25"} (fGPU), {"gpu": 1, '
        '"gpu_memory": "4G", "gpu_cores": 50} (memory + cores), {"gpu_fraction": "0.2"}, {"cuda.device": 1} '
        '(whole GPUs), {"mig_profile": "1g.10gb"}; empty or {} for CPU only. CPU cores, host memory and '
        "the resource group have fields of their own.",
    )
    mem = BinarySizeField(label="Host memory", help_text='e.g. "8G" or "8 GiB" (binary units: 1G = 1024 MiB)')

    class Meta:
        model = ResourcePreset
        fields = ("name", "description", "resources", "cpu", "mem", "image", "resource_group")

    def clean_resources(self):
        value = self.cleaned_data.get("resources")
        return {} if value in (None, "") else value

    def clean(self):
        cleaned = super().clean() or {}  # Django's returns cleaned_data (its stub: or None)
        if self.errors:
            return cleaned
        # The admin's form class lists its fieldsets' names in Meta.fields, read-only ones too.
        preset = ResourcePreset(**{name: cleaned.get(name) for name in self.fields})
        try:
            preset_check(preset=preset)
        except ApplicationError as exc:
            for field, messages_ in (exc.field_errors or {"__all__": [exc.detail]}).items():
                self.add_error(field if field in self.fields else None, messages_)
        return cleaned


@admin.register(ResourcePreset)
class ResourcePresetAdmin(admin.ModelAdmin):
    """Named requests users launch from the dialog's preset picker or `fgpu launch --preset`
    (Backend.AI's resource presets). Each is checked as a launch is when saved."""

    form = ResourcePresetForm
    list_display = ("name", "configuration", "group", "image_reference", "description", "updated")
    list_select_related = ("resource_group", "image")
    list_filter = ("resource_group",)
    search_fields = ("name", "description")
    readonly_fields = ("configuration",)
    fieldsets = (
        (None, {"fields": ("name", "description")}),
        ("Request", {"fields": ("resources", "cpu", "mem", "image", "configuration")}),
        (
            "Who and where",
            {
                "fields": ("resource_group",),
                "description": "A preset of a resource group launches there and is offered only "
                "to those who may use the group (a group that projects name is "
                "theirs; see Projects).",
            },
        ),
    )

    @admin.display(description="request")
    def configuration(self, obj: ResourcePreset) -> str:
        """ "0.25 fGPU · 2 cores · 8 GiB" (as sessions show theirs)."""
        if obj._state.adding:  # its id is set before it is saved: a form shown again after a refusal
            return "—"
        try:
            return request_configuration(parse_resources(obj.request()))
        except AllocationError as exc:
            return f"not valid now: {exc}"

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, obj: ResourcePreset) -> str:
        return when_html(obj.updated_at)

    @admin.display(description="image", ordering="image__reference")
    def image_reference(self, obj: ResourcePreset) -> str:
        return obj.image.reference if obj.image else "the default"

    @admin.display(description="resource group", ordering="resource_group__name")
    def group(self, obj: ResourcePreset) -> str:
        return obj.resource_group.name if obj.resource_group else "any (everyone)"

    def save_model(self, request: HttpRequest, obj: ResourcePreset, form, change: bool) -> None:
        preset_save(preset=obj)


@admin.register(FragmentationMap)
class FragmentationMapAdmin(admin.ModelAdmin):
    """One page per resource group: its fragmentation map and compaction plan
    (sessions.scheduling.compaction); the plan is applied from it by one POST (logged)."""

    list_display = ("name", "policy", "node_count", "map_link")
    ordering = ("name",)

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).annotate(_node_count=Count("nodes"))

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return request.user.is_active and request.user.is_staff

    def has_view_permission(self, request, obj=None) -> bool:
        return request.user.is_active and request.user.is_staff

    @admin.display(description="nodes", ordering="_node_count")
    def node_count(self, obj) -> int:
        return obj._node_count

    @admin.display(description="map")
    def map_link(self, obj) -> str:
        return format_html('<a href="{}/change/">free fGPU, stranded capacity and compaction plan</a>', obj.pk)

    change_list_template = "admin/sessions/fragmentation_list.html"

    def get_urls(self):
        from django.urls import path

        implicit = path(
            "default/",
            self.admin_site.admin_view(self.implicit_view),
            name="compute_sessions_fragmentationmap_default",
        )
        return [implicit, *super().get_urls()]

    def changelist_view(self, request, extra_context=None):
        from sessions.api.fragmentation import implicit_default_group

        return super().changelist_view(
            request,
            {
                "title": "Fragmentation maps: pick a resource group",
                "implicit_default": implicit_default_group(),
                **(extra_context or {}),
            },
        )

    def implicit_view(self, request):
        """The map of the implicit group "default": the nodes in no resource group (issue 32.5;
        `sessions.api.fragmentation.implicit_default_group`), 404 where there is none."""
        from django.http import Http404

        from accelerators.selectors import DEFAULT_GROUP, placement_options
        from sessions.api.fragmentation import implicit_default_group

        if not self.has_view_permission(request) or not implicit_default_group():
            raise Http404("no implicit default group: every node is in a resource group, or one is named default")
        shown = {"name": DEFAULT_GROUP, "policy": placement_options(group=None)["policy"], "implicit": True}
        return self._map_view(request, None, shown)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        from django.shortcuts import get_object_or_404

        group = get_object_or_404(FragmentationMap, pk=object_id)
        return self._map_view(request, group, group, extra_context)

    def _map_view(self, request, group, shown, extra_context=None):
        """The map page of `group` (None: the implicit "default"), shown as `shown` (its name and
        policy); a POST applies its plan."""
        from django.shortcuts import redirect
        from django.template.response import TemplateResponse

        from sessions.scheduling.compaction import compaction_apply, fragmentation_report

        if request.method == "POST":
            if not self.has_change_permission(request, group):
                raise PermissionDenied
            try:
                done = compaction_apply(
                    admin=request.user, group=group, expected=[s for s in request.POST.get("expected", "").split(",") if s]
                )
            except ApplicationError as exc:
                messages.error(request, exc.detail)
            else:
                messages.success(
                    request,
                    f"Moving {len(done['moved'])} session(s) from {done['node']}: each is warned and signalled now, "
                    f"stopped at {done['moved'][0]['preempt_at']:%H:%M:%S} UTC and started again as a new session; "
                    "the waiting session starts where they were.",
                )
            return redirect(request.path)
        report = fragmentation_report(group=group)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Fragmentation map: {shown['name'] if group is None else group.name}",
            "opts": self.model._meta,
            "group": shown,
            "report": report,
            **_report_context(report),
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/sessions/fragmentation.html", context)


def _percent(part, whole) -> str:
    return f"{float(part) * 100 / float(whole):.1f}" if whole else "0"


def _report_context(report) -> dict:
    """What the fragmentation page shows, formatted: nodes with their devices' bars, the recent
    shapes (with whether each fits now), the largest waiting request and the plan's moves."""
    if report.map is None:
        return {}
    found = report.map
    nodes: dict = {}
    for d in found.devices:
        used = d.capacity - d.free
        nodes.setdefault(d.node_id, []).append(
            {
                "label": d.label,
                "free": fgpu_text(d.free),
                "capacity": fgpu_text(d.capacity),
                "sessions": d.sessions,
                "stranded": d.stranded,
                "used_pct": _percent(used, d.capacity),
                "free_pct": _percent(d.free, d.capacity),
            }
        )
    shapes = [{"text": request_configuration(s), "largest": s is found.largest_shape} for s in found.shapes]
    moves = []
    if report.plan is not None:
        for m in report.plan.moves:
            session = report.sessions.get(m.holder.session_id)
            moves.append(
                {
                    "session": session,
                    "from_node": m.holder.node_id,
                    "to_node": m.to_node,
                    "fgpu": fgpu_text(m.holder.shares),
                    "ran_h": f"{m.holder.ran(report.now.timestamp()) / 3600:.2f}",
                    "lost": f"{float(m.holder.shares) * m.holder.ran(report.now.timestamp()) / 3600:.2f}",
                }
            )
    return {
        "nodes": sorted(nodes.items()),
        "shapes": shapes,
        "moves": moves,
        "expected": ",".join(m.holder.session_id for m in report.plan.moves) if report.plan else "",
        "free": fgpu_text(found.free),
        "stranded": fgpu_text(found.stranded),
        "stranded_pct": _percent(found.stranded, found.free),
        "largest_fgpu": fgpu_text(found.largest_fgpu),
        "largest_shape": request_configuration(found.largest_shape) if found.largest_shape else "",
        "target_text": request_configuration(session_request(report.target)) if report.target else "",
        "lost_h": f"{report.plan.work_lost / 3600:.2f}" if report.plan else "",
        "mig_gpus": [
            {
                "node": g.node.name,
                "gpu": g.device.index,
                "model": g.device.model_name,
                "idle": [i.row.profile for i in g.instances if i.state == "idle"],
                "free": len(g.free),
                "stranded": len(g.stranded),
            }
            for g in report.mig
        ],
    }
