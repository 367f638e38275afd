"""Django admin pages for the accelerator configuration and inventory.

Slot formats and fractional settings are edited here; nodes and devices are registered by
their agents, so their pages are read-only (a node may be deleted once decommissioned).
Memory is always shown in binary units (`protocol.units.format_binary_size`), fGPU as Decimal text.
"""

from __future__ import annotations

import json
from decimal import ROUND_DOWN, Decimal
from typing import TYPE_CHECKING

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Count, QuerySet
from django.forms.models import BaseInlineFormSet
from django.http import HttpRequest, JsonResponse
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join

from accelerators.admin_display import EMPTY, BinarySizeField, size_html, when_html
from accelerators.admin_drain import DRAIN_ACTIONS, NodeDrainAdminMixin
from accelerators.allocation import core, topology
from protocol import units
from accelerators.allocation.errors import InvalidResourceRequest
from accelerators.config_import import MAX_UPLOAD_BYTES, ConfigError, import_accelerator_config_upload
from accelerators.fleet import NO_GROUP, SORTS, STATES, NodeFigures, fleet_nodes
from accelerators.mig_selectors import (
    device_mig_catalog,
    mig_exclusion,
    mig_gpu_pictures,
    node_mig_gpus,
    node_mig_sync_view,
)
from accelerators.mig_services import node_mig_settings_apply, node_mig_settings_check
from accelerators.models import (
    Device,
    DeviceLink,
    FractionalSettings,
    GpuInstance,
    MigMode,
    Node,
    ResourceGroup,
    SlotFormat,
)
from accelerators.selectors import FgpuSummary, device_fgpu_summary
from accelerators.services import SHARING_FIELDS, node_mark_dead, node_settings_saved

_EXAMPLE_AMOUNTS = (Decimal("0.5"), Decimal("2"), Decimal("1536"))
_CENTI = Decimal("0.01")


def _fgpu_number(value: Decimal) -> str:
    """fGPU with two decimals, truncated (Backend.AI's capacities are truncated to 0.01)."""
    return f"{value.quantize(_CENTI, rounding=ROUND_DOWN):f}"


class ConfigImportForm(forms.Form):
    file = forms.FileField(
        label="Configuration file",
        help_text="a Backend.AI mock-accelerator TOML (.toml: slot formats, and with a node name that node's devices) "
        'or the etcd-style JSON of fractional settings (.json: {"config": {"plugins": {"accelerator": '
        '{"cuda": {…}}}}}); at most 1 MiB',
    )
    node = forms.CharField(
        label="Node",
        required=False,
        max_length=128,
        help_text="TOML only: register or update this node with the file's devices (replaces its inventory); "
        "empty: slot formats only",
    )
    check_only = forms.BooleanField(
        label="Check only",
        required=False,
        help_text="run the import and roll it back: see what it would do and its warnings, import nothing",
    )

    def clean_file(self):
        upload = self.cleaned_data["file"]
        if upload.size > MAX_UPLOAD_BYTES:
            raise forms.ValidationError(f"{upload.size:,} bytes; at most {MAX_UPLOAD_BYTES:,} (1 MiB) are taken")
        return upload


def config_import_view(model_admin: _ConfigImportLink, request: HttpRequest) -> TemplateResponse:
    """Upload a configuration file and import it (`import_accelerator_config_upload`: one
    transaction, nothing half-imported), showing the summary, each warning, or the error with
    its file, field and problem."""
    if not model_admin.has_import_permission(request):
        raise PermissionDenied
    report = error = None
    if request.method == "POST":
        form = ConfigImportForm(request.POST, request.FILES)
        if form.is_valid():
            upload = form.cleaned_data["file"]
            try:
                report = import_accelerator_config_upload(
                    name=upload.name,
                    data=upload.read(),
                    node_name=form.cleaned_data["node"] or None,
                    check_only=form.cleaned_data["check_only"],
                )
            except ConfigError as exc:
                error = exc
    else:
        form = ConfigImportForm()
    context = {
        **model_admin.admin_site.each_context(request),
        "title": "Import an accelerator configuration",
        "opts": model_admin.model._meta,
        "form": form,
        "report": report,
        "summary": _summary_lines(report, checked_only=bool(report and form.cleaned_data.get("check_only"))),
        "checked_only": bool(report) and form.cleaned_data.get("check_only"),
        "error": error,
    }
    return TemplateResponse(request, "admin/accelerators/config_import.html", context)


def _summary_lines(report, *, checked_only: bool) -> list[str]:
    if report is None:
        return []
    lines = report.summary().splitlines()
    if checked_only and lines[0].startswith("Imported "):
        lines[0] = "Would import " + lines[0].removeprefix("Imported ")
    return lines


if TYPE_CHECKING:  # for the type checker: the admin class _ConfigImportLink is mixed into
    _MixedInto = admin.ModelAdmin
else:
    _MixedInto = object


class _ConfigImportLink(_MixedInto):
    """Adds `<changelist>/import/` (the upload page) and its button to a change list."""

    change_list_template = "admin/accelerators/change_list_with_import.html"

    def get_urls(self):
        name = f"{self.model._meta.app_label}_{self.model._meta.model_name}_import"
        view = self.admin_site.admin_view(lambda request: config_import_view(self, request))
        return [path("import/", view, name=name), *super().get_urls()]

    def has_import_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("accelerators.change_fractionalsettings") and request.user.has_perm(
            "accelerators.change_slotformat"
        )

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None):
        extra_context = {
            **(extra_context or {}),
            "import_url": reverse(f"admin:{self.model._meta.app_label}_{self.model._meta.model_name}_import")
            if self.has_import_permission(request)
            else "",
        }
        return super().changelist_view(request, extra_context)


@admin.register(SlotFormat)
class SlotFormatAdmin(_ConfigImportLink, admin.ModelAdmin):
    list_display = (
        "slot_key",
        "display_unit",
        "display_icon",
        "number_binary",
        "number_round_length",
        "human_readable_name",
        "example",
    )
    list_filter = ("slot_name",)
    search_fields = ("slot_name", "subtype", "display_unit", "human_readable_name")
    readonly_fields = ("example",)

    @admin.display(description="slot", ordering="slot_name")
    def slot_key(self, obj: SlotFormat) -> str:
        return obj.slot_key

    @admin.display(description="example")
    def example(self, obj: SlotFormat) -> str:
        """How 0.5, 2 and 1536 of this subtype are displayed (truncated, never rounded up)."""
        if obj.pk is None:
            return "—"
        return " · ".join(f"{amount} → {obj.format_amount(amount)}" for amount in _EXAMPLE_AMOUNTS)


def capacity_lines(settings: FractionalSettings) -> list[str]:
    """One line per distinct device model (model name, memory, SMs) of the slot's whole GPUs:
    "CUDA GPU (40 GiB, 108 SMs): 1 physical GPU = 13.50 fGPU", capacity by `core.device_capacity`
    (min of memory / unit_mem and SMs / unit_proc, truncated to 2 decimals, as Backend.AI)."""
    models = (
        Device.objects.filter(slot_name=settings.slot_name, is_mig_device=False)
        .values_list("model_name", "memory_size", "subproc_count")
        .distinct()
        .order_by("model_name", "memory_size", "subproc_count")
    )
    pure = settings.as_allocation_settings()
    # Models whose every GPU serves MIG (mig_exclusion): their capacity is what they would hold.
    shared = set(
        Device.objects.filter(slot_name=settings.slot_name, is_mig_device=False)
        .exclude(mig_exclusion())
        .values_list("model_name", "memory_size", "subproc_count")
        .distinct()
    )
    lines = []
    for model_name, memory_size, subproc_count in models:
        capacity = core.device_capacity(memory_size=memory_size, subproc_count=subproc_count, settings=pure)
        line = (
            f"{model_name} ({units.format_binary_size(memory_size)}, {subproc_count} SMs): "
            f"1 physical GPU = {_fgpu_number(capacity)} fGPU"
        )
        if not settings.is_fractional:
            line += " (in fractional mode; the slot is discrete now)"
        elif (model_name, memory_size, subproc_count) not in shared:
            line += " (none now: every such GPU serves MIG)"
        lines.append(line)
    return lines


class FractionalSettingsForm(forms.ModelForm):
    unit_mem = BinarySizeField(
        label="Memory in 1.0 fGPU", help_text='device memory in 1.0 fGPU, e.g. "4G" or "512M" (binary units; at least 512 MiB)'
    )

    class Meta:
        model = FractionalSettings
        fields = ("slot_name", "allocation_mode", "unit_mem", "unit_proc", "quantum_size")

    def clean_unit_mem(self):
        value = self.cleaned_data.get("unit_mem")
        if value is None:
            raise forms.ValidationError("This field is required.")
        return value


@admin.register(FractionalSettings)
class FractionalSettingsAdmin(_ConfigImportLink, admin.ModelAdmin):
    form = FractionalSettingsForm
    list_display = ("slot_name", "allocation_mode", "unit_mem_display", "unit_proc", "quantum_size", "capacity", "updated")
    readonly_fields = ("capacity", "updated")
    fields = ("slot_name", "allocation_mode", "unit_mem", "unit_proc", "quantum_size", "capacity", "updated")

    @admin.display(description="memory in 1.0 fGPU", ordering="unit_mem")
    def unit_mem_display(self, obj: FractionalSettings) -> str:
        return size_html(obj.unit_mem)

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, obj: FractionalSettings) -> str:
        return when_html(obj.updated_at)

    @admin.display(description="capacity per physical GPU")
    def capacity(self, obj: FractionalSettings) -> str:
        if obj.pk is None:
            return "—"
        lines = capacity_lines(obj)
        if not lines:
            return f"no {obj.slot_name} GPUs registered yet"
        return format_html_join("", "<div>{}</div>", ((line,) for line in lines))


def _summary(device: Device) -> FgpuSummary | None:
    """The device's fGPU figures, batched by the page where it can (`_fgpu_summary`)."""
    cached = vars(device)  # the instance's own attributes: the page's cache lives there
    if "_fgpu_summary" not in cached:
        cached["_fgpu_summary"] = device_fgpu_summary([device]).get(device.pk)
    return cached["_fgpu_summary"]


def _attach_summaries(devices: list[Device]) -> None:
    summaries = device_fgpu_summary(devices)
    for device in devices:
        vars(device)["_fgpu_summary"] = summaries.get(device.pk)


def _fgpu_text(summary: FgpuSummary) -> str:
    """Free fGPU, or why there is none to give: the slot is discrete, or the GPU serves MIG."""
    if summary.mig:
        return format_html(
            '<span title="{}">none ({})</span>',
            f"this GPU serves {summary.mig}: one GPU is never MIG and fGPU shares at once",
            summary.mig,
        )
    return "— (discrete)" if summary.free is None else _fgpu_number(summary.free)


class _DeviceFields:
    """Display columns shared by the Device admin and the Node page's device inline."""

    @admin.display(description="memory", ordering="memory_size")
    def memory(self, obj: Device) -> str:
        return size_html(obj.memory_size)

    @admin.display(description="SMs", ordering="subproc_count")
    def sms(self, obj: Device) -> int:
        return obj.subproc_count

    @admin.display(description="MIG slice", ordering="is_mig_device")
    def mig_slice(self, obj: Device) -> str:
        """The slice's profile ("2g.20gb"), "—" for a whole GPU."""
        return (obj.mig_profile or "yes") if obj.is_mig_device else EMPTY

    @admin.display(description="parent")
    def parent_display(self, obj: Device) -> str:
        return f"#{parent.index} {parent.device_id}" if obj.parent_id and (parent := obj.parent) else "—"

    @admin.display(description="allocated fGPU")
    def allocated(self, obj: Device) -> str:
        summary = _summary(obj)
        return "—" if summary is None else _fgpu_number(summary.allocated)

    @admin.display(description="free fGPU")
    def free(self, obj: Device) -> str:
        summary = _summary(obj)
        return "—" if summary is None else _fgpu_text(summary)


class _DeviceInlineFormSet(BaseInlineFormSet):
    """Fetches the fGPU figures of all the node's devices in one call."""

    def get_queryset(self) -> QuerySet:
        queryset = super().get_queryset()
        if not getattr(self, "_summaries_attached", False):
            _attach_summaries(list(queryset))  # the queryset caches these very instances
            self._summaries_attached = True
        return queryset


class DeviceInline(_DeviceFields, admin.TabularInline):
    model = Device
    fk_name = "node"
    formset = _DeviceInlineFormSet
    extra = 0
    can_delete = False
    show_change_link = True
    fields = (
        "index",
        "slot_name",
        "model_name",
        "mother_uuid",
        "numa_node",
        "sms",
        "memory",
        "is_mig_device",
        "mig_profile",
        "parent_display",
        "allocated",
        "free",
    )
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).select_related("node", "parent")

    def has_add_permission(self, request: HttpRequest, obj: Node | None = None) -> bool:
        return False


class DeviceLinkInline(admin.TabularInline):
    """The node's device links (NVLink lanes, PCIe paths), as its agent reported them."""

    model = DeviceLink
    fk_name = "node"
    extra = 0
    can_delete = False
    verbose_name = "device link"
    fields = ("device_a_display", "device_b_display", "kind", "lanes")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).select_related("node", "device_a", "device_b")

    @admin.display(description="device")
    def device_a_display(self, obj: DeviceLink) -> str:
        return f"#{obj.device_a.index} {obj.device_a.device_id}"

    @admin.display(description="linked to")
    def device_b_display(self, obj: DeviceLink) -> str:
        return f"#{obj.device_b.index} {obj.device_b.device_id}"

    @admin.display(description="lanes")
    def lanes(self, obj: DeviceLink) -> str:
        return str(obj.count) if obj.kind in topology.LANE_KINDS else "—"

    def has_add_permission(self, request: HttpRequest, obj: Node | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Node | None = None) -> bool:
        return False


_SLICE_STATES = ("used", "idle", "unknown", "free", "stranded")  # each a CSS class .mig-<state> (static/css/admin.css)


class MigLayoutWidget(forms.Textarea):
    """The fixed MIG layout as rows of GPU, profile and start (static/js/mig_layout.js), each
    profile offering only its allowed starts, checked live by the server as the form will check
    it (`NodeAdmin.mig_check_view`) and drawn as the 8 memory slices it would take. The JSON
    stays in the textarea the script writes (folded under "Edit as JSON"), so the form also
    works without the script. `gpus`: the node's MIG-capable GPUs with their catalogs."""

    editor_template = "admin/accelerators/mig_layout_widget.html"  # around Django's textarea

    def __init__(self, *, gpus: list[dict], check_url: str = "", attrs=None):
        super().__init__(attrs={"rows": 4, "cols": 60, **(attrs or {})})
        self.gpus, self.check_url = gpus, check_url

    def render(self, name, value, attrs=None, renderer=None):
        """The editor around Django's own textarea (the project's template folder is not the form
        renderer's, so the editor is rendered by the template loader)."""
        textarea = super().render(name, value, attrs, renderer)
        final = self.build_attrs(self.attrs, attrs)
        return render_to_string(
            self.editor_template,
            {
                "widget": {
                    "textarea": textarea,
                    "gpus": self.gpus,
                    "check_url": self.check_url,
                    "textarea_id": final.get("id", ""),
                    "gpus_id": f"{final.get('id') or name}-gpus",
                }
            },
        )

    class Media:
        js = ("js/mig_layout.js",)


def mig_layout_editor_gpus(node: Node) -> list[dict]:
    """What the layout editor offers per MIG-capable GPU of `node`: index, device id, model and
    its catalog's profiles (name, allowed starts, memory slices spanned, memory, most instances)."""
    gpus = []
    for device in node_mig_gpus(node=node):
        catalog = device_mig_catalog(device)
        gpus.append(
            {
                "index": device.index,
                "device_id": device.device_id,
                "model": catalog.model,
                "profiles": [
                    {
                        "name": p.name,
                        "starts": list(p.starts),
                        "size": p.size,
                        "memory": units.format_binary_size(p.memory),
                        "max": p.max_instances,
                        "compute": p.compute_slices,
                    }
                    for p in catalog.profiles
                ],
            }
        )
    return gpus


class NodeForm(forms.ModelForm):
    """Checks a fixed MIG layout against each GPU's MIG catalog before it is saved."""

    class Meta:
        model = Node
        fields = "__all__"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        field = self.fields.get("mig_layout")
        if field is not None and self.instance.pk:
            field.widget = MigLayoutWidget(
                gpus=mig_layout_editor_gpus(self.instance),
                check_url=reverse("admin:accelerators_node_mig_check", args=[self.instance.pk]),
            )
            field.help_text = (
                'for mode "fixed": the GPU instances each GPU keeps (profile and first memory slice); '
                "checked as you edit, against the GPU's MIG catalog"
            )

    def clean(self):
        data = super().clean() or {}  # Django's returns cleaned_data (its stub: or None)
        try:
            node_mig_settings_check(node=self.instance, mig_mode=data.get("mig_mode") or "", mig_layout=data.get("mig_layout"))
        except InvalidResourceRequest as exc:
            raise forms.ValidationError({"mig_layout": str(exc)}) from None
        return data


def _edges(cells) -> list[bool]:
    """For each cell of a picture's row, whether an instance begins there right after another
    one's cell (drawn with an edge, so two instances of one profile side by side read as two).
    By position in the row: a row's slots need not be numbered 0, 1, 2, … (a 7g.80gb's memory
    row is numbered by memory slice)."""
    return [
        bool(c.instance) and i > 0 and bool(cells[i - 1].instance) and cells[i - 1].instance != c.instance
        for i, c in enumerate(cells)
    ]


def mig_picture_html(node: Node) -> str:
    """Each MIG-capable GPU of `node` as two rows of cells (8 memory slices, 7 compute slices):
    in use (title: instance and session), idle (reusable), unknown (found on the GPU by its agent,
    never planned here: title gives its MIG device UUID), free, stranded. Each state is a class
    `mig-<state>` whose colours keep AA contrast in the light and the dark theme."""
    pictures = mig_gpu_pictures(node=node)
    if not pictures:
        return "no MIG-capable GPU (the model is not in the MIG catalog)"

    def row(title, cells):
        return format_html(
            "<tr><th scope='row'>{}</th>{}</tr>",
            title,
            format_html_join(
                "",
                "<td class='mig-cell mig-{}{}' title='{}'>{}</td>",
                (
                    (
                        c.state,
                        " mig-edge" if edge else "",
                        f"slice {c.slot}: {c.state} {c.instance} {c.session}".strip(),
                        c.instance.split("@")[0] if c.instance else c.state,
                    )
                    for c, edge in zip(cells, _edges(cells))
                ),
            ),
        )

    blocks = []
    for picture in pictures:
        listing = (
            format_html_join(
                ", ",
                "{} {}{}",
                (
                    (label, state, (f" by {who}" if state == "used" else f" ({who})") if who else "")
                    for label, state, who in picture.instances
                ),
            )
            or "none"
        )
        blocks.append(
            format_html(
                "<div class='mig-gpu-picture'><strong>GPU {} · {}</strong><table class='mig-slices'>{}{}</table>"
                "instances: {}</div>",
                picture.device.index,
                picture.model,
                row("memory", picture.memory),
                row("compute", picture.compute),
                listing,
            )
        )
    legend = format_html_join("", "<span class='mig-cell mig-{}'>{}</span>", ((state, state) for state in _SLICE_STATES))
    return format_html("{}<div class='mig-legend'>{}</div>", format_html_join("", "{}", ((b,) for b in blocks)), legend)


def _attribute_text(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def mig_sync_text(view: dict) -> str:
    """The sync view (`node_mig_sync_view`) in one line: the state's words, and that changes
    wait for sessions (how many) when they do."""
    text = view["detail"] or "nothing sent yet"
    if view["pending"] and view["applied"] != "pending":
        text += f"; {len(view['pending'])} change(s) wait for sessions to end"
    return text


def mig_sync_html(node: Node) -> str:
    """How far the node's agent has applied the expected MIG layout: the state and its words,
    when it was sent and reported, and each pending change, error and instance to destroy."""
    view = node_mig_sync_view(node=node)
    if not view["applied"]:
        return "nothing sent to the agent yet"
    lines = [(f"{p['profile']}@{p['start']} on GPU {p['index']}: {p['action']} waits — {p['reason']}",) for p in view["pending"]]
    lines += [(f"error: {e['profile'] or 'GPU'}@{e['start']} on {e['gpu']}: {e['reason']}",) for e in view["errors"]]
    lines += [(f"to destroy: {d['profile']}@{d['start']} on {d['gpu']}",) for d in view["destroying"]]
    return format_html(
        "<strong>{}</strong> — {}<br>sent {} ({}, #{}), reported {}<ul>{}</ul>",
        view["applied"],
        mig_sync_text(view),
        when_html(view["sent_at"]) if view["sent_at"] else "never",
        view["kind"] or "—",
        view["seq"] or 0,
        when_html(view["reported_at"]) if view["reported_at"] else "not yet",
        format_html_join("", "<li>{}</li>", lines),
    )


@admin.register(Node)
class NodeAdmin(NodeDrainAdminMixin, admin.ModelAdmin):
    list_display = (
        "name",
        "status",
        "drain_column",
        "resource_group",
        "heartbeat",
        "cpu_count",
        "memory",
        "device_count",
        "free_fgpu",
        "idle_gpus",
        "free_mig",
        "load",
        "sharing",
    )
    change_list_template = "admin/accelerators/node_change_list.html"
    list_filter = ("status", "resource_group")
    search_fields = ("name",)
    inlines = (DeviceInline, DeviceLinkInline)
    reported = (
        "name",
        "status",
        "heartbeat",
        "registered",
        "cpu_count",
        "memory",
        "plugin_list",
        "attribute_list",
        "held_images",
    )
    fieldsets = (
        ("Reported by the agent", {"fields": reported}),
        (
            "Sharing (set by administrators)",
            {"fields": ("resource_group", "device_split_count", "memory_scaling", "core_scaling")},
        ),
        ("MIG (set by administrators)", {"fields": ("mig_mode", "mig_layout", "mig_picture", "mig_status")}),
        ("Drain (take the node out of service)", {"fields": ("drain_control",)}),
        ("Usage (live: the last hour, day, week or month)", {"fields": ("usage_charts",)}),
        ("Processes on its GPUs (live: the host's view)", {"fields": ("gpu_processes",)}),
    )
    readonly_fields = (*reported, "mig_picture", "mig_status", "drain_control", "usage_charts", "gpu_processes")
    form = NodeForm
    actions = ("mark_dead", *DRAIN_ACTIONS)

    @admin.action(description="Mark dead: its processes are gone, end its sessions (LOST nodes only)", permissions=["change"])
    def mark_dead(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        """Fencing's administrator's word (accelerators.services.node_mark_dead): each selected LOST
        node's sessions end and their devices are released; an ALIVE node is refused, named."""
        from common.errors import ApplicationError

        for node in queryset.order_by("name"):
            try:
                ended = node_mark_dead(node_name=node.name, by=request.user.get_username())
            except ApplicationError as exc:
                self.message_user(request, exc.detail, messages.ERROR)
                continue
            self.message_user(request, f"Node {node.name} marked dead: {ended} session(s) ended, their devices released")

    class Media:
        css = {"all": ("vendor/uplot/uPlot.min.css", "css/usage.css")}
        js = ("vendor/uplot/uPlot.iife.min.js", "js/usage.js", "js/node_processes.js")

    def get_urls(self):
        check = self.admin_site.admin_view(self.mig_check_view)
        fleet = self.admin_site.admin_view(self.fleet_view)
        return [
            path("fleet/", fleet, name="accelerators_node_fleet"),
            path("<path:object_id>/mig-check/", check, name="accelerators_node_mig_check"),
            *self.drain_urls(),
            *super().get_urls(),
        ]

    def fleet_view(self, request: HttpRequest) -> TemplateResponse:
        """The fleet overview page (issue 36.4): its filters, drawn by static/js/fleet.js from
        GET /api/v1/fleet/ (`accelerators.api_fleet`), polled every few seconds while shown."""
        if not request.user.is_staff or not self.has_view_permission(request):
            raise PermissionDenied
        models = Device.objects.filter(is_mig_device=False).order_by("model_name").values_list("model_name", flat=True)
        context = {
            **self.admin_site.each_context(request),
            "title": "Fleet overview",
            "opts": self.model._meta,
            "api_url": reverse("api-fleet"),
            "states": STATES,
            "sorts": SORTS,
            "no_group": NO_GROUP,
            "groups": ResourceGroup.objects.order_by("name").values_list("name", flat=True),
            "models": models.distinct(),
            "node_count": Node.objects.count(),
            "query": request.GET,
        }
        return TemplateResponse(request, "admin/accelerators/fleet.html", context)

    def get_changelist_instance(self, request: HttpRequest):
        """The change list, its page's nodes given their capacity (`accelerators.fleet`: four
        queries for the page, none per node) for the capacity columns."""
        changelist = super().get_changelist_instance(request)
        shown = list(changelist.result_list)  # evaluated once: the template iterates these very rows
        figures = {n.pk: n for n in fleet_nodes(only=Node.objects.filter(pk__in=[n.pk for n in shown]))}
        for node in shown:
            node._fleet = figures.get(node.pk)  # read by the capacity columns below
        self.drain_annotate(shown)
        return changelist

    @staticmethod
    def _figures(obj: Node) -> NodeFigures | None:
        return getattr(obj, "_fleet", None)

    def _free_of(self, obj: Node, free: str, total: str, text=str) -> str:
        """ "<free> / <in all>" of two NodeFigures fields, each shown by `text`; — for none."""
        figures = self._figures(obj)
        if figures is None or not getattr(figures, total):
            return EMPTY
        return f"{text(getattr(figures, free))} / {text(getattr(figures, total))}"

    @admin.display(description="free fGPU")
    def free_fgpu(self, obj: Node) -> str:
        """fGPU free / in all over its GPUs shared by fGPU."""
        return self._free_of(obj, "fgpu_free", "fgpu_capacity", _fgpu_number)

    @admin.display(description="idle GPUs")
    def idle_gpus(self, obj: Node) -> str:
        """GPUs nobody holds / its GPUs that serve no MIG."""
        return self._free_of(obj, "gpus_idle", "gpus_plain")

    @admin.display(description="free MIG slices")
    def free_mig(self, obj: Node) -> str:
        """Free MIG compute slices / in all over its GPUs that serve MIG."""
        return self._free_of(obj, "mig_free", "mig_total")

    @admin.display(description="allocated")
    def load(self, obj: Node) -> str:
        """Its GPUs' mean load: the larger of memory and SMs allocated (MIG: compute slices held)."""
        figures = self._figures(obj)
        if figures is None or not figures.gpus:
            return EMPTY
        return format_html(
            "<span class='fleet-load' title='its GPUs allocated, on average (memory or SMs, the larger; MIG: compute "
            "slices)'>{} %</span>",
            figures.load,
        )

    def mig_check_view(self, request: HttpRequest, object_id: str) -> JsonResponse:
        """POST {"mig_mode", "mig_layout"} → {"ok": true} or {"ok": false, "error": "…"}: the check the
        form runs on save (`node_mig_settings_check`), for the layout editor to run as one types.
        Writes nothing."""
        node = self.get_object(request, object_id)
        if request.method != "POST":
            return JsonResponse({"ok": False, "error": "POST the layout"}, status=405)
        if node is None or not self.has_change_permission(request, node):
            raise PermissionDenied
        try:
            body = json.loads(request.body or b"{}")
            if not isinstance(body, dict):
                raise ValueError
        except ValueError:
            return JsonResponse({"ok": False, "error": "the body is not a JSON object"}, status=400)
        try:
            node_mig_settings_check(node=node, mig_mode=MigMode.FIXED, mig_layout=body.get("mig_layout"))
        except InvalidResourceRequest as exc:
            return JsonResponse({"ok": False, "error": str(exc)})
        return JsonResponse({"ok": True, "error": ""})

    @admin.display(description="each GPU")
    def usage_charts(self, obj: Node) -> str:
        """Where static/js/usage.js draws each GPU's memory used and utilisation, from
        GET /api/v1/nodes/<name>/usage/ (polled every few seconds)."""
        if not obj.pk:
            return "—"
        return format_html(
            "<div id='node-usage-charts' data-url='{}'>Loading…</div>", reverse("api-node-usage", kwargs={"name": obj.name})
        )

    @admin.display(description="which process holds what")
    def gpu_processes(self, obj: Node) -> str:
        """Where static/js/node_processes.js lists what holds the node's GPUs now, from
        GET /api/v1/nodes/<name>/processes/ (asked of its agent every few seconds while shown)."""
        if not obj.pk:
            return "—"
        return format_html(
            "<div id='node-processes' data-url='{}' aria-live='polite'>Asking the agent…</div>",
            reverse("api-node-processes", kwargs={"name": obj.name}),
        )

    @admin.display(description="session images it holds")
    def held_images(self, obj: Node) -> str:
        return ", ".join(sorted(obj.images or {})) or "none"

    @admin.display(description="MIG slices")
    def mig_picture(self, obj: Node) -> str:
        return mig_picture_html(obj) if obj.pk else "—"

    @admin.display(description="MIG layout on the agent")
    def mig_status(self, obj: Node) -> str:
        return mig_sync_html(obj) if obj.pk else "—"

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        if change:  # as the API's writes: a scheduler pass once it commits (sharing changed)
            node_settings_saved(node=obj, fields=set(form.changed_data) & set(SHARING_FIELDS))
        if change and all(form.initial.get(name) == getattr(obj, name) for name in ("mig_mode", "mig_layout")):
            return  # no MIG change (compared as values: the JSON text may differ): nothing to tell the agent
        node_mig_settings_apply(node=obj)  # the agent is told once the admin's transaction commits
        view = node_mig_sync_view(node=obj)
        level = messages.WARNING if view["applied"] in ("pending-agent-offline", "error") or view["pending"] else messages.INFO
        self.message_user(request, f"MIG layout of {obj.name}: {view['applied']} — {mig_sync_text(view)}", level)

    @admin.display(description="sharing")
    def sharing(self, obj: Node) -> str:
        """Split count, and scaling shown as what it is: deliberate over-subscription."""
        text = f"≤ {obj.device_split_count} sessions/GPU"
        if obj.is_oversubscribed:
            text += f" · over-subscribed: memory × {obj.memory_scaling}, SMs × {obj.core_scaling}"
        return text

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).annotate(_device_count=Count("devices"))

    @admin.display(description="main memory", ordering="memory_size")
    def memory(self, obj: Node) -> str:
        return size_html(obj.memory_size)

    @admin.display(description="last heartbeat", ordering="last_heartbeat")
    def heartbeat(self, obj: Node) -> str:
        return when_html(obj.last_heartbeat)

    @admin.display(description="registered", ordering="registered_at")
    def registered(self, obj: Node) -> str:
        return when_html(obj.registered_at)

    @admin.display(description="compute plugins")
    def plugin_list(self, obj: Node) -> str:
        return ", ".join(obj.plugins or []) or "none"

    @admin.display(description="driver and runtime")
    def attribute_list(self, obj: Node) -> str:
        """The agent's report, one "name: value" per line (what it says, not JSON)."""
        items = sorted((obj.attributes or {}).items())
        if not items:
            return EMPTY
        return format_html_join(
            "",
            "<div><span class='muted'>{}:</span> {}</div>",
            ((name.replace("_", " "), _attribute_text(value)) for name, value in items),
        )

    @admin.display(description="devices", ordering="_device_count")
    def device_count(self, obj: Node) -> int:
        return obj._device_count  # type: ignore[attr-defined]  # annotated by get_queryset: django-stubs cannot see it

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # nodes register themselves through their agents


@admin.register(ResourceGroup)
class ResourceGroupAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "policy",
        "weight_memory",
        "weight_cores",
        "weight_sessions",
        "no_fragmentation",
        "node_count",
        "description",
    )
    list_editable = ("policy", "no_fragmentation")

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).annotate(_node_count=Count("nodes"))

    @admin.display(description="nodes", ordering="_node_count")
    def node_count(self, obj: ResourceGroup) -> int:
        return obj._node_count  # type: ignore[attr-defined]  # annotated by get_queryset: django-stubs cannot see it


@admin.register(Device)
class DeviceAdmin(_DeviceFields, admin.ModelAdmin):
    list_display = ("gpu", "node", "index", "model_name", "memory", "sms", "mig_slice", "allocated", "free")
    list_filter = ("node", "slot_name", "is_mig_device")
    list_select_related = ("node",)
    search_fields = ("device_id", "mother_uuid", "model_name", "node__name")
    fields = (
        "node",
        "slot_name",
        "device_id",
        "index",
        "mother_uuid",
        "model_name",
        "numa_node",
        "sms",
        "memory",
        "is_mig_device",
        "mig_profile",
        "parent_display",
        "allocated",
        "free",
    )
    readonly_fields = fields

    @admin.display(description="device", ordering="device_id")
    def gpu(self, obj: Device) -> str:
        """Its id on the node, short: "GPU-c59395cd…" (the node, index and model have columns)."""
        return obj.device_id if len(obj.device_id) <= 16 else f"{obj.device_id[:12]}…"

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None):
        response = super().changelist_view(request, extra_context)
        changelist = (getattr(response, "context_data", None) or {}).get("cl")
        if changelist is not None:
            _attach_summaries(list(changelist.result_list))  # the page's queryset caches these instances
        return response

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # devices are reported by their node's agent


@admin.register(GpuInstance)
class GpuInstanceAdmin(admin.ModelAdmin):
    """MIG GPU instances the manager planned (read-only: the scheduler and fixed layouts write them),
    and those its agents found on their GPUs at start that nobody planned ("unknown since": made by
    hand or by another tool; their slices count as taken until an agent start no longer finds them)."""

    list_display = ("__str__", "node", "profile", "slices", "memory", "uuid", "session", "last_used", "unknown")
    fields = (
        "node",
        "parent",
        "profile",
        "slices",
        "memory",
        "subproc_count",
        "uuid",
        "session",
        "created",
        "last_used",
        "unknown",
    )
    readonly_fields = fields
    list_filter = ("node", "profile", ("unknown_since", admin.EmptyFieldListFilter))
    list_select_related = ("node", "parent", "session")

    @admin.display(description="memory", ordering="memory_size")
    def memory(self, obj: GpuInstance) -> str:
        return size_html(obj.memory_size)

    @admin.display(description="memory slices", ordering="placement_start")
    def slices(self, obj: GpuInstance) -> str:
        last = obj.placement_start + obj.placement_size - 1
        return str(obj.placement_start) if last == obj.placement_start else f"{obj.placement_start}–{last}"

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: GpuInstance) -> str:
        return when_html(obj.created_at)

    @admin.display(description="last used", ordering="last_used_at")
    def last_used(self, obj: GpuInstance) -> str:
        return when_html(obj.last_used_at)

    @admin.display(description="unknown since", ordering="unknown_since")
    def unknown(self, obj: GpuInstance) -> str:
        """When an agent found it on its GPU without the manager having planned it; "—": planned here."""
        return when_html(obj.unknown_since)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False
