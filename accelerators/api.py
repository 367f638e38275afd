"""REST API for the accelerator configuration and inventory (`/api/v1/`).

Everyone signed in reads; administrators write slot formats, fractional settings, resource
groups and nodes' sharing settings (split count, memory / SM scaling, resource group), each edit
guarded by ETag / If-Match (`common.api_support`). Nodes and devices are registered by their
agents; the rest of a node is read-only here. Amounts: memory in bytes, compute in SMs,
fGPU as decimal text ("1.50"), never floats.
"""

from __future__ import annotations

import hashlib
import json
import dataclasses
import threading
from dataclasses import dataclass

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection
from django.db.models import Prefetch
from django.http import Http404
from django_filters import rest_framework as filters
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, extend_schema, extend_schema_field, extend_schema_view
from rest_framework import mixins, serializers, viewsets
from rest_framework.fields import SkipField
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import IsAdminUser
from rest_framework.renderers import BrowsableAPIRenderer, JSONRenderer
from rest_framework.response import Response

from protocol.units import format_number
from accelerators.models import AllocationMode, Device, FractionalSettings, Node, NodeStatus, ResourceGroup, SlotFormat
from accelerators.cluster_view import NodeEntry, Snapshot, cluster_view
from accelerators.drain import node_drain_state
from accelerators.selectors import device_fgpu_summary, devices_with_usage
from accelerators.services import node_mark_dead, node_settings_update
from common.api_support import (
    ETAG_NOTE,
    ErrorSerializer,
    IF_MATCH,
    ETagMixin,
    IsAdminOrReadOnly,
    ListETagMixin,
    ModelSerializer,
    TextFilter,
    ViewMixinBase,
    admin_write_docs,
    page_etag,
)


# --- inventory: nodes and devices ---------------------------------------------------------------


class DeviceSerializer(serializers.ModelSerializer):
    capacity_fgpu = serializers.SerializerMethodField(help_text="fGPU; null in discrete mode and on a GPU serving MIG")
    allocated_fgpu = serializers.SerializerMethodField(help_text="fGPU held by live allocations (1 per whole device)")
    free_fgpu = serializers.SerializerMethodField(help_text="fGPU; null in discrete mode and on a GPU serving MIG")
    parent = serializers.CharField(
        source="parent.device_id",
        default=None,
        read_only=True,
        allow_null=True,  # type: ignore[assignment]  # DRF's metaclass moves declared fields off the class: no clash
        help_text="a MIG slice's parent GPU UUID",
    )

    class Meta:
        model = Device
        fields = [
            "id",
            "slot_name",
            "device_id",
            "index",
            "mother_uuid",
            "model_name",
            "numa_node",
            "subproc_count",
            "memory_size",
            "is_mig_device",
            "mig_profile",
            "parent",
            "capacity_fgpu",
            "allocated_fgpu",
            "free_fgpu",
        ]

    def _summary(self, device):
        """The device's FgpuSummary, computed at the first call for all the context's `devices`
        (the page's: `PageDevicesMixin`) and kept in the context for the others."""
        cache = self.context.setdefault("fgpu", {})  # type: ignore[attr-defined]  # stubs: a read-only Mapping; DRF's is the dict it was given
        if device.pk not in cache:
            devices = self.context.get("devices") or []
            cache.update(device_fgpu_summary(devices if device in devices else [device]))
        return cache[device.pk]

    # fGPU with two decimals by the one amount formatter (protocol.units): it
    # truncates; the figures come truncated to 2 decimals already, so the text is as f"{:.2f}" wrote it.
    def get_capacity_fgpu(self, device) -> str | None:
        value = self._summary(device).capacity
        return None if value is None else format_number(value, binary=False, round_length=2)

    def get_allocated_fgpu(self, device) -> str:
        return format_number(self._summary(device).allocated, binary=False, round_length=2)

    def get_free_fgpu(self, device) -> str | None:
        value = self._summary(device).free
        return None if value is None else format_number(value, binary=False, round_length=2)


class DeviceUsageSerializer(DeviceSerializer):
    """A device with its node and its live allocation totals."""

    node = serializers.CharField(source="node.name", read_only=True)
    allocated_memory = serializers.IntegerField(
        source="memory_used", read_only=True, help_text="bytes of device memory held by live allocations"
    )
    allocated_procs = serializers.DecimalField(
        source="proc_used", max_digits=12, decimal_places=3, read_only=True, help_text="SMs held by live allocations"
    )
    session_count = serializers.IntegerField(read_only=True, help_text="live allocations (sessions) on the device")

    class Meta(DeviceSerializer.Meta):
        fields = ["node", *DeviceSerializer.Meta.fields, "allocated_memory", "allocated_procs", "session_count"]


class NodeSerializer(ModelSerializer):
    devices = DeviceSerializer(many=True, read_only=True)
    resource_group = serializers.CharField(
        source="resource_group.name", default=None, read_only=True, allow_null=True, help_text="node pool; null: the default pool"
    )
    oversubscribed = serializers.BooleanField(
        source="is_oversubscribed", read_only=True, help_text="memory or SM scaling above 1: deliberate over-subscription"
    )
    images = serializers.DictField(
        child=serializers.CharField(),
        read_only=True,
        help_text="the session images its agent reports holding: {reference: image id}",
    )
    drain = serializers.SerializerMethodField(
        help_text='null in service; draining: {"state": "draining" or "drained", "label": "draining: 2 sessions left", '
        '"sessions_left", "evict", "reason", "by", "since"} (accelerators.drain; POST …/drain/ and …/undrain/)'
    )

    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "status",
            "last_heartbeat",
            "registered_at",
            "cpu_count",
            "memory_size",
            "plugins",
            "attributes",
            "images",
            "shared_storage",
            "resource_group",
            "device_split_count",
            "memory_scaling",
            "core_scaling",
            "oversubscribed",
            "drain",
            "devices",
        ]

    def get_drain(self, node) -> dict | None:
        # A query for a draining node only: an in-service one's is null without one.
        return node_drain_state(node).as_dict() if node.drain_since is not None else None

    def to_representation(self, node):
        page: NodePage | None = self.context.get("node_page")
        if page is None or node.pk not in page.devices:
            # The devices whose fGPU figures DeviceSerializer computes at once: a page's
            # (PageDevicesMixin), or one node's own.
            self.context.setdefault("devices", list(node.devices.all()))  # type: ignore[attr-defined]  # stubs: a read-only Mapping; DRF's is the dict it was given
            return super().to_representation(node)
        return page.shown(node, lambda: self._shown_with(node, page.devices[node.pk]))

    def _shown_with(self, node, devices: list) -> dict:
        """The node as DRF's Serializer.to_representation shows it, `devices` already shown."""
        data: dict = {}
        for field in self._readable_fields:
            if field.field_name == "devices":
                data["devices"] = devices
                continue
            try:
                attribute = field.get_attribute(node)
            except SkipField:
                continue
            data[field.field_name] = None if attribute is None else field.to_representation(attribute)
        return data


def _devices_shown():
    """Devices as NodeSerializer shows them: each read with its live usage (`devices_with_usage`)
    and its MIG parent, in slot and index order."""
    return devices_with_usage(Device.objects.select_related("parent")).order_by("slot_name", "index", "device_id")


def nodes_with_devices():
    """Nodes with their resource group and their devices (`_devices_shown`): what NodeSerializer
    shows, in two queries for any number of nodes."""
    return Node.objects.select_related("resource_group").prefetch_related(Prefetch("devices", queryset=_devices_shown()))


@dataclass(frozen=True)
class _Shown:
    """One node of the list as shown (NodePage), and what it was shown from."""

    entry: NodeEntry  # the kept cluster view's entry for the node then
    settings: tuple  # the fractional settings' rows then
    devices: list  # DeviceSerializer's dicts
    row: tuple = ()  # the node's row and its resource group's name ((): not shown whole yet)
    text: _NodeText | None = None  # NodeSerializer's dict, its JSON and digest


@dataclass(frozen=True)
class _NodeText:
    """One node's dict as NodeSerializer shows it, its JSON as the list's renderer writes it
    (NodeListRenderer), and 32 hex digits of SHA-256 over that JSON."""

    data: dict
    json: bytes
    digest: str


def _node_text(data: dict) -> _NodeText:
    text = JSONRenderer().render(data)
    return _NodeText(data=data, json=text, digest=hashlib.sha256(text).hexdigest()[:32])


_SHOWN: dict[str, _Shown] = {}  # str(node pk) → _Shown; per process, as the kept view is (`_shown_prune`)
_pruned = 0  # the kept view's `removed` version that _SHOWN was last pruned at
_PRUNE_LOCK = threading.Lock()


def _shown_prune(snapshot: Snapshot) -> None:
    """Drop from _SHOWN the nodes that have left the kept view since the last prune (deleted:
    issue 35.2's review), so that it holds at most one entry per node of the cluster. Only when
    the view says a node has left (`Snapshot.removed`): a request with no node gone costs one
    comparison, one after a deletion a pass over the kept keys (about 1 ms at 10,000 nodes)."""
    global _pruned
    if snapshot.version < 0 or snapshot.removed <= _pruned:
        return
    with _PRUNE_LOCK:
        if snapshot.removed <= _pruned:
            return
        for pk in _SHOWN.keys() - snapshot.entries.keys():
            _SHOWN.pop(pk, None)
        _pruned = snapshot.removed


def _row(node: Node) -> tuple:
    """What NodeSerializer reads of `node` itself: its row's values and its group's name."""
    group = node.resource_group.name if node.resource_group is not None else None  # select_related: no query
    return (*(getattr(node, f.attname) for f in Node._meta.concrete_fields), group)


@dataclass
class NodePage:
    """A page of the node list as `node_list_page` read it (issue 35.2: a page costs what
    changed, not the cluster). `devices`: each node's devices as DeviceSerializer shows them;
    `entries`: the kept cluster view's entries then ({}: nothing is kept); `texts`: node name →
    its dict, JSON and digest, for each node shown so far (kept with the node)."""

    settings: tuple
    entries: dict
    devices: dict
    texts: dict = dataclasses.field(default_factory=dict)

    def shown(self, node: Node, render) -> dict:
        """NodeSerializer's dict for `node`: the one kept from an earlier request while the node's
        entry in the kept view, the fractional settings and the node's row are the same, else
        `render()` (and kept, with its JSON and digest)."""
        pk = str(node.pk)
        entry, kept = self.entries.get(pk), _SHOWN.get(pk)
        row = _row(node)
        if entry is not None and kept is not None and kept.entry is entry and kept.settings == self.settings:
            if kept.text is not None and kept.row == row:
                self.texts[node.name] = kept.text
                return kept.text.data
        text = self.texts[node.name] = _node_text(render())
        if entry is not None:
            _SHOWN[pk] = _Shown(entry=entry, settings=self.settings, devices=self.devices[node.pk], row=row, text=text)
        return text.data

    def results_texts(self, results) -> list[_NodeText] | None:
        """The texts of `results` (a page's shown dicts, in order), or None when one of them is
        not the dict this page showed for its node."""
        try:
            texts = [self.texts[node["name"]] for node in results]
        except (KeyError, TypeError):
            return None
        return texts if all(text.data is node for text, node in zip(texts, results, strict=True)) else None

    def etag(self, data: dict) -> str | None:
        """The list's weak ETag for `data` (the paginated body: count, next, previous, results)
        from its nodes' digests, as `page_etag` changes with any change to the body but without
        encoding it whole; None when a node of `results` was not shown through this page."""
        texts = self.results_texts(data.get("results")) if isinstance(data, dict) else None
        if texts is None:
            return None
        outline = {key: value for key, value in data.items() if key != "results"}
        body = json.dumps([outline, [text.digest for text in texts]], sort_keys=True, cls=DjangoJSONEncoder).encode()
        return f'W/"{hashlib.sha256(body).hexdigest()[:32]}"'


class NodeListRenderer(JSONRenderer):
    """DRF's JSONRenderer, except that a page of the node list is written from its nodes' JSON
    as NodePage keeps it (the same bytes: JSON without indent is the concatenation of its
    items'), not encoded again; anything else as JSONRenderer writes it."""

    def render(self, data, accepted_media_type=None, renderer_context=None):
        page: NodePage | None = getattr((renderer_context or {}).get("view"), "node_page", None)
        paged = isinstance(data, dict) and list(data)[-1:] == ["results"]
        texts = page.results_texts(data["results"]) if page is not None and paged else None
        if texts is None or self.get_indent(accepted_media_type, renderer_context or {}) is not None:
            return super().render(data, accepted_media_type, renderer_context)
        head = super().render({**data, "results": []}, accepted_media_type, renderer_context)
        return head[: -len(b"[]}")] + b"[" + b",".join(text.json for text in texts) + b"]}"


def node_list_page(nodes: list[Node]) -> NodePage:
    """A page of the node list, read: its nodes' devices and their fGPU figures are shown once
    per change and kept (per process). They are reused while the kept cluster view
    (`accelerators.cluster_view`) still holds the same entry for the node — a new one comes
    with any logged write to the node's placement fields, devices, device links, allocations or
    sessions, which covers every input of DeviceSerializer and of the node's `drain` — and the
    fractional settings (not logged: read here, one query) are the same; a node's whole dict
    also while its row is the same (heartbeats are not logged: NodePage.shown compares the row).
    The others' devices are read in one query with their usage and shown with one
    `device_fgpu_summary`. The view is brought up to date first, so a change committed before
    the request is never shown stale. On SQLite, or inside a transaction (where the view may
    hold the transaction's own writes: a test's), nothing is kept: all are read, as before."""
    entries: dict = {}
    settings: tuple = ()
    if connection.vendor == "postgresql" and not connection.in_atomic_block:  # a GET, in autocommit
        settings = tuple(FractionalSettings.objects.order_by("slot_name").values_list())
        snapshot = cluster_view().snapshot()
        entries = snapshot.entries if snapshot.version >= 0 else {}
        _shown_prune(snapshot)
    devices: dict = {}
    missing: list[Node] = []
    for node in nodes:
        entry, kept = entries.get(str(node.pk)), _SHOWN.get(str(node.pk))
        if entry is not None and kept is not None and kept.entry is entry and kept.settings == settings:
            devices[node.pk] = kept.devices
        else:
            missing.append(node)
    if missing:
        read = list(_devices_shown().select_related("node").filter(node__in=[n.pk for n in missing]))
        by_node: dict = {}
        for device in read:
            by_node.setdefault(device.node_id, []).append(device)
        context = {"devices": read}
        for node in missing:
            devices[node.pk] = list(DeviceSerializer(by_node.get(node.pk, []), many=True, context=context).data)
            entry = entries.get(str(node.pk))
            if entry is not None:
                _SHOWN[str(node.pk)] = _Shown(entry=entry, settings=settings, devices=devices[node.pk])
    return NodePage(settings=settings, entries=entries, devices=devices)


class PageDevicesMixin(ViewMixinBase):
    """For a list view whose rows show devices' fGPU figures (DeviceSerializer): the devices of
    the page go into the serializer's context, so one `device_fgpu_summary` serves the whole
    page (one query: both lists read their devices with their usage). `page_devices` says
    which they are."""

    def page_devices(self, rows: list) -> list[Device]:
        raise NotImplementedError

    def get_serializer(self, *args, **kwargs):
        if kwargs.get("many") and args and args[0] is not None:
            rows = list(args[0])
            kwargs["context"] = {**self.get_serializer_context(), "devices": self.page_devices(rows)}
            args = (rows, *args[1:])
        return super().get_serializer(*args, **kwargs)


def _sent_empty(query_filter, value) -> bool:
    """Whether the filter's parameter was sent with an empty value (`?status=`)."""
    return value in (None, "") and query_filter.field_name in (getattr(query_filter.parent, "data", None) or {})


class StrictChoiceFilter(filters.ChoiceFilter):
    """django-filter's ChoiceFilter, except that a parameter sent empty is a 400 naming it, as
    a value off the choices is, instead of filtering nothing."""

    def filter(self, qs, value):
        if _sent_empty(self, value):
            raise serializers.ValidationError(
                {self.field_name: [f"expected one of {', '.join(str(choice) for choice, _ in self.extra['choices'])}"]}
            )
        return super().filter(qs, value)


class NodeFilter(filters.FilterSet):
    status = StrictChoiceFilter(choices=NodeStatus.choices, help_text="ALIVE or LOST")
    resource_group = TextFilter(field_name="resource_group__name", help_text="node pool name")

    class Meta:
        model = Node
        fields = ["status", "resource_group"]


class NodeSettingsSerializer(serializers.ModelSerializer):
    """What an administrator may change on a node: how its devices are shared. Answers with the
    whole node (NodeSerializer)."""

    resource_group = serializers.SlugRelatedField(
        slug_field="name",
        queryset=ResourceGroup.objects.all(),
        allow_null=True,
        required=False,
        help_text="node pool by name; null: the default pool",
    )

    class Meta:
        model = Node
        fields = ["device_split_count", "memory_scaling", "core_scaling", "resource_group"]
        extra_kwargs = {"device_split_count": {"min_value": 1, "max_value": 1000}}

    def update(self, node, validated_data):
        return node_settings_update(node=node, changes=validated_data)  # with its scheduler pass after commit

    def to_representation(self, node):
        return NodeSerializer(node, context=self.context).data


NODE_SETTINGS_EXAMPLES = [
    OpenApiExample("Share each GPU among at most 4 sessions", value={"device_split_count": 4}),
    OpenApiExample(
        "Over-subscribe memory by half, move to a pool",
        value={"memory_scaling": "1.50", "core_scaling": "1.00", "resource_group": "training"},
    ),
]
NODE_SETTINGS_DOC = (
    "Administrators: the node's sharing settings — `device_split_count` (the most sessions per "
    "device, HAMi's deviceSplitCount), `memory_scaling` and `core_scaling` (accounted memory and "
    "SMs × this; above 1 is deliberate over-subscription), `resource_group` (a pool name or null). "
    "Pending sessions are reconsidered at once. "
    + ETAG_NOTE
    + " The ETag covers these four settings only, so heartbeats do not make it stale."
)


class MarkDeadSerializer(serializers.Serializer):
    node = serializers.CharField(help_text="the node's name")
    sessions_ended = serializers.IntegerField(help_text="how many of its sessions ended, their devices released")


@extend_schema_view(
    list=extend_schema(
        summary="List GPU nodes",
        tags=["inventory"],
        description="Nodes with their devices and each device's capacity, allocated and free fGPU.",
    ),
    retrieve=extend_schema(summary="One GPU node by name", tags=["inventory"], description=ETAG_NOTE),
    update=extend_schema(
        summary="Replace a node's sharing settings (administrators; If-Match required)",
        tags=["inventory"],
        parameters=[IF_MATCH],
        request=NodeSettingsSerializer,
        responses={200: NodeSerializer},
        examples=NODE_SETTINGS_EXAMPLES,
        description=NODE_SETTINGS_DOC,
    ),
    partial_update=extend_schema(
        summary="Change a node's sharing settings (administrators; If-Match required)",
        tags=["inventory"],
        parameters=[IF_MATCH],
        request=NodeSettingsSerializer,
        responses={200: NodeSerializer},
        examples=NODE_SETTINGS_EXAMPLES,
        description=NODE_SETTINGS_DOC,
    ),
)
class NodeViewSet(ETagMixin, mixins.UpdateModelMixin, viewsets.ReadOnlyModelViewSet):
    """GPU nodes with their devices and each device's capacity, allocated and free fGPU;
    administrators change a node's sharing settings (NodeSettingsSerializer). The list reads a
    page of nodes and shows them through `node_list_page` (kept per change)."""

    queryset = nodes_with_devices()
    serializer_class = NodeSerializer
    filterset_class = NodeFilter
    permission_classes = [IsAdminOrReadOnly]
    lookup_field = "name"
    lookup_value_regex = r"[A-Za-z0-9_.\-]+"
    http_method_names = ["get", "put", "patch", "head", "options"]
    etag_fields = ["device_split_count", "memory_scaling", "core_scaling", "resource_group_id"]
    renderer_classes = [NodeListRenderer, BrowsableAPIRenderer]  # DRF's defaults, JSONRenderer's place taken

    def get_serializer_class(self):
        return NodeSettingsSerializer if self.request and self.request.method in ("PUT", "PATCH") else NodeSerializer

    def get_queryset(self):
        if self.action == "list":  # the page's devices: node_list_page, not a prefetch
            return Node.objects.select_related("resource_group")
        return super().get_queryset()

    def get_serializer(self, *args, **kwargs):
        if kwargs.get("many") and args and args[0] is not None:  # a page of the list
            rows = list(args[0])
            self.node_page = node_list_page(rows)
            kwargs["context"] = {**self.get_serializer_context(), "node_page": self.node_page}
            args = (rows, *args[1:])
        return super().get_serializer(*args, **kwargs)

    def list_etag(self, data) -> str:
        """From the page's nodes' digests (NodePage.etag): no encoding of the body for it."""
        page: NodePage | None = getattr(self, "node_page", None)
        tag = page.etag(data) if page is not None else None
        return page_etag(data) if tag is None else tag


@extend_schema(
    summary="Mark a LOST node dead (administrators)",
    tags=["inventory"],
    request=None,
    responses={200: MarkDeadSerializer, 403: ErrorSerializer, 404: ErrorSerializer, 409: ErrorSerializer},
    description="Fencing: the node's processes are gone (the machine is off or reinstalled), so every session on it "
    "ends and its devices are released now, instead of when its agent confirms or after FGPU_FENCE_TIMEOUT_SECONDS of "
    "silence. The node stays LOST until its agent registers again. 409 `node-alive` unless the node is LOST.",
)
@api_view(["POST"])
@permission_classes([IsAdminUser])
def node_mark_dead_view(request, name: str):
    """`{"node": name, "sessions_ended": n}` (accelerators.services.node_mark_dead)."""
    try:
        ended = node_mark_dead(node_name=name, by=request.user.get_username())
    except Node.DoesNotExist:
        raise Http404 from None
    return Response({"node": name, "sessions_ended": ended})


@extend_schema_field(OpenApiTypes.BOOL)
class StrictBooleanFilter(filters.CharFilter):
    """`true` or `false` (any case); anything else, an empty value included, is a 400 naming
    the parameter, where django-filter's BooleanFilter would ignore it and filter nothing."""

    def filter(self, qs, value):
        if value in (None, ""):
            if _sent_empty(self, value):  # `?is_mig_device=`
                raise serializers.ValidationError({self.field_name: ["expected true or false"]})
            return qs
        wanted = {"true": True, "false": False}.get(value.lower())
        if wanted is None:
            raise serializers.ValidationError({self.field_name: ["expected true or false"]})
        return qs.filter(**{self.field_name: wanted})


class DeviceFilter(filters.FilterSet):
    node = TextFilter(field_name="node__name", help_text="node name")
    slot_name = TextFilter(help_text="accelerator family: cuda, rocm, …")
    is_mig_device = StrictBooleanFilter(help_text="true: MIG slices only; false: whole GPUs only")

    class Meta:
        model = Device
        fields = ["node", "slot_name", "is_mig_device"]


@extend_schema_view(
    list=extend_schema(
        summary="List devices",
        tags=["inventory"],
        description="Every device (GPU or MIG slice) of every node, with its live allocation: fGPU "
        "capacity / allocated / free, bytes and SMs held, and how many sessions it hosts.",
    ),
    retrieve=extend_schema(summary="One device by id", tags=["inventory"]),
)
class DeviceViewSet(PageDevicesMixin, ListETagMixin, viewsets.ReadOnlyModelViewSet):
    """Devices with their live allocation totals."""

    serializer_class = DeviceUsageSerializer
    filterset_class = DeviceFilter

    def get_queryset(self):
        # Meta.ordering is dropped from aggregating queries: order explicitly, as nvidia-smi numbers GPUs.
        return devices_with_usage(Device.objects.select_related("node", "parent")).order_by(
            "node__name", "slot_name", "index", "device_id"
        )

    def page_devices(self, rows: list) -> list[Device]:
        return rows


# --- configuration: slot formats, fractional settings, resource groups ------------------------


class NumberFormatSerializer(serializers.Serializer):
    binary = serializers.BooleanField(
        source="number_binary", required=False, help_text="suffixes by 2^(10n) (KiB, MiB, GiB) instead of 10^(3n)"
    )
    round_length = serializers.IntegerField(
        source="number_round_length", required=False, min_value=0, max_value=32, help_text="fixed-point digits; 0: integer"
    )


class SlotFormatSerializer(serializers.ModelSerializer):
    slot = serializers.CharField(source="slot_key", read_only=True, help_text='"<slot_name>.<subtype>", the URL key')
    number_format = NumberFormatSerializer(source="*", required=False)
    example = serializers.SerializerMethodField(help_text="how 0.5 of this subtype is shown")

    class Meta:
        model = SlotFormat
        fields = [
            "slot",
            "slot_name",
            "subtype",
            "display_icon",
            "display_unit",
            "human_readable_name",
            "description",
            "number_format",
            "example",
        ]

    def get_example(self, fmt) -> str:
        return fmt.format_amount("0.5")

    def validate(self, attrs):
        if self.instance is not None:
            for key in ("slot_name", "subtype"):
                if key in attrs and attrs[key] != getattr(self.instance, key):
                    raise serializers.ValidationError({key: ["cannot change; create a new slot format instead"]})
        return attrs


class FractionalSettingsSerializer(serializers.ModelSerializer):
    class Meta:
        model = FractionalSettings
        fields = ["slot_name", "allocation_mode", "unit_mem", "unit_proc", "quantum_size", "updated_at"]
        read_only_fields = ["updated_at"]

    def validate_slot_name(self, value):
        if self.instance is not None and value != self.instance.slot_name:
            raise serializers.ValidationError("cannot change; it is the URL key of these settings")
        return value


class ResourceGroupSerializer(serializers.ModelSerializer):
    nodes: serializers.SlugRelatedField[Node] = serializers.SlugRelatedField(
        many=True, read_only=True, slug_field="name", help_text="names of the nodes in the pool (set on each node by an admin)"
    )

    class Meta:
        model = ResourceGroup
        fields = [
            "name",
            "description",
            "policy",
            "weight_memory",
            "weight_cores",
            "weight_sessions",
            "no_fragmentation",
            "nodes",
        ]

    def validate_name(self, value):
        if self.instance is not None and value != self.instance.name:
            raise serializers.ValidationError("cannot change; it is the URL key of the group")
        return value


@extend_schema_view(
    **admin_write_docs(
        "slot format",
        tags=["configuration"],
        examples=[
            OpenApiExample(
                "fGPU shares",
                value={
                    "slot_name": "cuda",
                    "subtype": "shares",
                    "display_icon": "gpu1",
                    "display_unit": "fGPU",
                    "human_readable_name": "fGPU",
                    "description": "CUDA-capable GPU (fractional)",
                    "number_format": {"binary": False, "round_length": 2},
                },
            ),
            OpenApiExample(
                "Whole devices",
                value={
                    "slot_name": "cuda",
                    "subtype": "device",
                    "display_unit": "GPU",
                    "human_readable_name": "GPU",
                    "number_format": {"binary": False, "round_length": 0},
                },
            ),
        ],
        patch_examples=[
            OpenApiExample("Change the unit only", value={"display_unit": "fGPU"}),
            OpenApiExample("Three decimals", value={"number_format": {"round_length": 3}}),
        ],
    )
)
class SlotFormatViewSet(ETagMixin, viewsets.ModelViewSet):
    """How amounts of each slot subtype are shown; keyed by `<slot_name>.<subtype>`."""

    queryset = SlotFormat.objects.all()
    serializer_class = SlotFormatSerializer
    permission_classes = [IsAdminOrReadOnly]
    filterset_fields = ["slot_name"]
    lookup_url_kwarg = "slot"
    lookup_value_regex = r"[^/]+"

    def get_object(self):
        slot_name, _, subtype = self.kwargs["slot"].partition(".")
        found = self.get_queryset().filter(slot_name=slot_name, subtype=subtype).first()
        if found is None:
            raise Http404("no such slot format")
        self.check_object_permissions(self.request, found)
        return found


@extend_schema_view(
    **{
        **admin_write_docs(
            "fractional setting",
            tags=["configuration"],
            examples=[
                OpenApiExample(
                    "1 physical GPU of 8 GiB / 80 SMs = 2 fGPU",
                    value={
                        "slot_name": "cuda",
                        "allocation_mode": "fractional",
                        "unit_mem": 4 << 30,
                        "unit_proc": 40,
                        "quantum_size": "0.25",
                    },
                ),
            ],
            patch_examples=[
                OpenApiExample("Back to whole devices", value={"allocation_mode": AllocationMode.DISCRETE}),
                OpenApiExample("Finer steps", value={"quantum_size": "0.1"}),
            ],
        ),
        "destroy": extend_schema(exclude=True),
    }
)
class FractionalSettingsViewSet(ETagMixin, mixins.CreateModelMixin, mixins.UpdateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Per-slot fractional settings: 1.0 fGPU = `unit_mem` bytes and `unit_proc` SMs; requests in
    steps of `quantum_size`. Keyed by slot name. Not deletable here (sessions depend on them)."""

    queryset = FractionalSettings.objects.all().order_by("slot_name")
    serializer_class = FractionalSettingsSerializer
    permission_classes = [IsAdminOrReadOnly]
    lookup_field = "slot_name"
    lookup_value_regex = r"[^/.]+"
    http_method_names = ["get", "post", "put", "patch", "head", "options"]


@extend_schema_view(
    **admin_write_docs(
        "resource group",
        tags=["configuration"],
        examples=[
            OpenApiExample(
                "Training pool, spread",
                value={
                    "name": "training",
                    "description": "A100 nodes for long jobs",
                    "policy": "spread",
                    "weight_memory": "1.00",
                    "weight_cores": "2.00",
                    "weight_sessions": "0.50",
                    "no_fragmentation": True,
                },
            ),
        ],
        patch_examples=[
            OpenApiExample("Switch to binpack", value={"policy": "binpack"}),
        ],
    )
)
class ResourceGroupViewSet(ETagMixin, viewsets.ModelViewSet):
    """Node pools with their placement rules; keyed by name."""

    queryset = ResourceGroup.objects.prefetch_related("nodes")
    serializer_class = ResourceGroupSerializer
    permission_classes = [IsAdminOrReadOnly]
    lookup_field = "name"
    lookup_value_regex = r"[^/.]+"
