"""`GET /api/v1/fleet/`: the fleet overview's page of nodes (administrators only; issue 36.4).

The logic is `accelerators.fleet`; this view validates the query, calls `fleet_overview` and
shapes its answer. Amounts: memory in bytes, fGPU as decimal text ("1.50"), load and
utilisation in percent, MIG in compute slices (7 a GPU).
"""

from __future__ import annotations

from decimal import Decimal

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import IsAdminUser
from rest_framework.response import Response

from protocol.units import format_number
from accelerators.fleet import NO_GROUP, PAGE_SIZE, PAGE_SIZE_MAX, SORTS, STATES, FleetFilter, fleet_overview
from common.api_support import ErrorSerializer


def _fgpu(value: Decimal | None) -> str | None:
    return None if value is None else format_number(value, binary=False, round_length=2)


class FleetQuerySerializer(serializers.Serializer):
    state = serializers.ChoiceField(list(STATES), required=False, help_text="only nodes in this state (default: any)")
    resource_group = serializers.CharField(
        required=False, default="", max_length=64, help_text=f'only nodes of this resource group ("{NO_GROUP}": in none)'
    )
    model = serializers.CharField(
        required=False, default="", max_length=128, help_text="only nodes with a GPU whose model contains this (any case)"
    )
    name = serializers.CharField(required=False, default="", max_length=128, help_text="only nodes whose name contains this")
    min_free_fgpu = serializers.DecimalField(
        required=False,
        default=Decimal(0),
        max_digits=None,  # any number of digits the schema's "number" allows: it is only compared
        decimal_places=None,
        min_value=Decimal(0),
        max_value=Decimal(10_000_000),
        coerce_to_string=False,  # the schema says a number with its minimum (as text it would say a pattern only)
        help_text="fGPU free, at least",
    )
    min_idle_gpus = serializers.IntegerField(required=False, default=0, min_value=0, max_value=10_000)
    min_free_mig = serializers.IntegerField(
        required=False, default=0, min_value=0, max_value=100_000, help_text="free MIG compute slices, at least"
    )
    sort = serializers.ChoiceField(
        list(SORTS),
        required=False,
        default="name",
        help_text="name; free: most free fGPU (then idle GPUs, MIG slices) first; load: least loaded first; -load: most",
    )
    page = serializers.IntegerField(required=False, default=1, min_value=1, max_value=1_000_000)
    page_size = serializers.IntegerField(required=False, default=PAGE_SIZE, min_value=1, max_value=PAGE_SIZE_MAX)


class FleetGpuSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    uuid = serializers.CharField(source="device_id")
    model = serializers.CharField()
    memory_size = serializers.IntegerField(help_text="bytes")
    kind = serializers.ChoiceField(
        ["fgpu", "whole", "mig"], help_text="fgpu: shared by fGPU; whole: discrete mode; mig: serves MIG instances only"
    )
    capacity_fgpu = serializers.SerializerMethodField(help_text='fGPU ("2.00"); null but for kind fgpu')
    allocated_fgpu = serializers.SerializerMethodField(help_text="fGPU held by live allocations (1 per whole-device grant)")
    free_fgpu = serializers.SerializerMethodField(help_text="fGPU; null but for kind fgpu")
    memory_allocated = serializers.IntegerField(help_text="bytes held by live allocations")
    sessions = serializers.IntegerField(help_text="live allocations on it")
    mig_total = serializers.IntegerField(help_text="MIG compute slices (0 but for kind mig)")
    mig_used = serializers.IntegerField(help_text="MIG compute slices held by sessions or by instances the agent found")
    load = serializers.IntegerField(help_text="percent allocated: the larger of memory and SMs (MIG: compute slices)")
    used = serializers.DictField(
        allow_null=True,
        help_text='the newest usage sample of the last 2 minutes, {"memory_used": bytes, "util": percent or null, "t": '
        "epoch s}; null: none (its agent is silent)",
    )

    def get_capacity_fgpu(self, gpu) -> str | None:
        return _fgpu(gpu.capacity)

    def get_allocated_fgpu(self, gpu) -> str:
        return _fgpu(gpu.allocated) or "0.00"

    def get_free_fgpu(self, gpu) -> str | None:
        return _fgpu(gpu.free)


class FleetNodeSerializer(serializers.Serializer):
    id = serializers.UUIDField(source="pk")
    name = serializers.CharField()
    state = serializers.ChoiceField(list(STATES))
    status = serializers.CharField(help_text="ALIVE or LOST, as heartbeats say")
    last_heartbeat = serializers.DateTimeField(allow_null=True)
    resource_group = serializers.CharField(allow_blank=True, help_text='"": in none')
    mig_mode = serializers.CharField()
    cpu_used = serializers.IntegerField(help_text="cores its active sessions hold")
    mem_used = serializers.IntegerField(help_text="bytes of main memory its active sessions hold")
    fgpu_capacity = serializers.SerializerMethodField(help_text="fGPU over its fgpu GPUs")
    fgpu_free = serializers.SerializerMethodField()
    fgpu_allocated = serializers.SerializerMethodField()
    gpus_idle = serializers.IntegerField(help_text="non-MIG GPUs nobody holds")
    mig_total = serializers.IntegerField()
    mig_free = serializers.IntegerField()
    memory_total = serializers.IntegerField(help_text="bytes of GPU memory")
    memory_allocated = serializers.IntegerField()
    sessions = serializers.IntegerField()
    load = serializers.IntegerField(help_text="percent: its GPUs' mean load")
    gpus = FleetGpuSerializer(many=True)

    def get_fgpu_capacity(self, node) -> str:
        return _fgpu(node.fgpu_capacity) or "0.00"

    def get_fgpu_free(self, node) -> str:
        return _fgpu(node.fgpu_free) or "0.00"

    def get_fgpu_allocated(self, node) -> str:
        return _fgpu(node.fgpu_allocated) or "0.00"


class FleetTotalsSerializer(serializers.Serializer):
    nodes = serializers.IntegerField()
    gpus = serializers.IntegerField()
    gpus_idle = serializers.IntegerField()
    fgpu_capacity = serializers.CharField()
    fgpu_free = serializers.CharField()
    fgpu_allocated = serializers.CharField()
    memory_total = serializers.IntegerField(help_text="bytes")
    memory_allocated = serializers.IntegerField(help_text="bytes")
    mig_gpus = serializers.IntegerField()
    mig_total = serializers.IntegerField(help_text="MIG compute slices")
    mig_free = serializers.IntegerField()
    sessions = serializers.IntegerField()
    load = serializers.IntegerField(help_text="percent: the GPUs' mean load")


class FleetUsedSerializer(serializers.Serializer):
    gpus_sampled = serializers.IntegerField(help_text="GPUs with a sample in the last 2 minutes")
    memory_used = serializers.IntegerField(help_text="bytes: the sum of their mean memory used")
    util = serializers.IntegerField(allow_null=True, help_text="percent: their mean utilisation; null: none known")


class FleetHeatSerializer(serializers.Serializer):
    name = serializers.CharField()
    state = serializers.CharField()
    resource_group = serializers.CharField(allow_blank=True)
    load = serializers.IntegerField(help_text="percent")
    fgpu_free = serializers.CharField()
    gpus_idle = serializers.IntegerField()
    mig_free = serializers.IntegerField()


class FleetSerializer(serializers.Serializer):
    states = serializers.DictField(child=serializers.IntegerField(), help_text="the whole fleet's nodes by state")
    groups = serializers.ListField(child=serializers.CharField(), help_text="resource groups (the filter's choices)")
    models = serializers.ListField(child=serializers.CharField(), help_text="GPU models (the filter's choices)")
    totals = FleetTotalsSerializer(help_text="over the nodes the filters keep")
    used = FleetUsedSerializer(help_text="what their GPUs really use, from the agents' usage samples")
    heat = FleetHeatSerializer(many=True, help_text="every node the filters keep, sorted: the heat map")
    count = serializers.IntegerField(help_text="nodes the filters keep")
    page = serializers.IntegerField()
    pages = serializers.IntegerField()
    page_size = serializers.IntegerField()
    nodes = FleetNodeSerializer(many=True, help_text="the page's nodes with their GPUs")


def fleet_response(query: dict) -> dict:
    """A validated FleetQuerySerializer's data → the overview as the API answers it."""
    filters = FleetFilter(
        state=query.get("state", ""),
        resource_group=query["resource_group"].strip(),
        model=query["model"].strip(),
        name=query["name"].strip(),
        min_free_fgpu=query["min_free_fgpu"],
        min_idle_gpus=query["min_idle_gpus"],
        min_free_mig=query["min_free_mig"],
    )
    found = fleet_overview(filters=filters, sort=query["sort"], page=query["page"], page_size=query["page_size"])
    totals = found["totals"]
    for key in ("fgpu_capacity", "fgpu_free", "fgpu_allocated"):
        totals[key] = _fgpu(totals[key])
    for row in found["heat"]:
        row["fgpu_free"] = _fgpu(row["fgpu_free"])
    return FleetSerializer(found).data


@extend_schema(
    summary="Fleet overview: a page of nodes with their GPUs",
    tags=["nodes"],
    parameters=[FleetQuerySerializer],
    responses={
        200: FleetSerializer,
        400: OpenApiResponse(ErrorSerializer, description="a bad parameter (`field_errors` names it)"),
        403: OpenApiResponse(ErrorSerializer, description="not an administrator"),
    },
    description="Every node and GPU at a glance, for administrators: each node's state (ready, mig-pending, "
    "mig-error, lost), and per GPU what live allocations hold (allocated), what its agent's newest usage "
    "sample says it uses (used) and what a new session could still get (free: fGPU, idle GPUs, MIG compute "
    "slices). Filter by state, resource group, GPU model, name and free capacity; `heat` lists every node the "
    "filters keep (load in percent, for a heat map), `nodes` one page of them with their GPUs. Computed from "
    "the database on each call (a few aggregate queries, none per node); the fleet overview page polls it.",
)
@api_view(["GET"])
@permission_classes([IsAdminUser])
def fleet_view(request):
    """The fleet overview (`accelerators.fleet.fleet_overview`)."""
    # A plain dict, not the QueryDict: DRF reads a form's empty value as an omitted one, and the schema
    # says "?state=" is no state (a 400 naming it, as every other bad parameter).
    query = FleetQuerySerializer(data=request.query_params.dict())
    query.is_valid(raise_exception=True)
    return Response(fleet_response(query.validated_data))
