"""REST API for MIG (issues 4 and 5): the MIG catalog of each GPU model, the layout of every
MIG-capable GPU, and a node's MIG settings (administrators write, If-Match as for the node's
sharing settings).

Facts about profiles and placements follow NVIDIA's MIG User Guide ("Supported MIG Profiles",
"Placement"): a MIG-capable GPU has 8 memory slices and 7 compute slices; a GPU instance of a
profile spans `size` memory slices from one of the profile's allowed starts. Memory is in
bytes, compute in SMs and slices. Who holds an instance in use (its session) is shown only to
that session's owner and to administrators, so session ids do not leak.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema, extend_schema_field, extend_schema_view
from rest_framework import mixins, serializers, viewsets

from accelerators.allocation.errors import InvalidResourceRequest
from accelerators.mig_selectors import mig_catalog_list, mig_gpu_layouts, node_mig_sync_view
from accelerators.mig_services import node_mig_settings_apply, node_mig_settings_check
from accelerators.models import MigMode, Node
from common.api_support import ETAG_NOTE, IF_MATCH, ETagMixin, IsAdminOrReadOnly, ListETagMixin
from common.errors import ApplicationError

TAGS = ["MIG"]
CATALOG_SOURCES = ["built-in", "nvml"]  # where a GPU's MIG catalog comes from (mig_selectors.mig_catalog_source)


class MigListViewSet(ListETagMixin, mixins.ListModelMixin, viewsets.GenericViewSet):
    """A read-only list built by a selector (`get_queryset` returns a list), paginated, with a
    weak ETag; everyone signed in reads it."""

    permission_classes = [IsAdminOrReadOnly]
    filter_backends: list = []


def page_example(name: str, item: dict) -> OpenApiExample:
    return OpenApiExample(name, response_only=True, value={"count": 1, "next": None, "previous": None, "results": [item]})


# --- the catalog ----------------------------------------------------------------------------------


class MigPlacementSerializer(serializers.Serializer):
    start = serializers.IntegerField(help_text="first memory slice (0–7)")
    size = serializers.IntegerField(help_text="memory slices the instance spans")


class MigProfileSerializer(serializers.Serializer):
    name = serializers.CharField(help_text='the profile name nvidia-smi shows: "1g.10gb", "3g.40gb", "1g.10gb+me"')
    profile_id = serializers.IntegerField(help_text="the profile id of `nvidia-smi mig -lgip` (`-cgi <id>`)")
    nvml_profile = serializers.IntegerField(help_text="NVML_GPU_INSTANCE_PROFILE_* value")
    compute_slices = serializers.IntegerField(help_text="compute slices of 7")
    memory_slices = serializers.IntegerField(help_text="memory slices of 8")
    memory = serializers.IntegerField(help_text="bytes of GPU memory an instance has")
    memory_assumed = serializers.BooleanField(help_text="true: no capture gave this memory figure; it is derived")
    sm_count = serializers.IntegerField(help_text="SMs of an instance; 0: unknown (a 7th of the GPU's per compute slice)")
    max_instances = serializers.IntegerField(help_text="the most instances of this profile one GPU holds")
    placements = serializers.SerializerMethodField(help_text="the allowed placements (start, size)")

    @extend_schema_field(MigPlacementSerializer(many=True))
    def get_placements(self, profile) -> list[dict]:
        return [{"start": start, "size": profile.size} for start in profile.starts]


class MigCatalogSerializer(serializers.Serializer):
    model = serializers.CharField(
        source="catalog.model", help_text='the GPU model: a built-in key ("H100-80GB") or the name NVML reported'
    )
    source = serializers.ChoiceField(
        choices=CATALOG_SOURCES,  # type: ignore[assignment]  # DRF's metaclass moves declared fields off the class: no clash
        help_text='"nvml": read by a node\'s agent from NVML and used for its GPUs '
        'instead of the built-in table; "built-in": the table in '
        "accelerators/allocation/mig.py",
    )
    source_note = serializers.CharField(source="catalog.source", help_text="where the figures come from, in words")
    built_in_model = serializers.CharField(help_text='the built-in model the GPUs\' names give ("" when none)')
    nodes = serializers.ListField(child=serializers.CharField(), help_text="nodes whose GPUs are planned with this catalog")
    profiles = MigProfileSerializer(source="catalog.profiles", many=True, help_text="smallest first")


MODEL_PARAMETER = OpenApiParameter(
    "model",
    OpenApiTypes.STR,
    OpenApiParameter.QUERY,
    required=False,
    description='only this GPU model: a built-in key ("H100-80GB") or a name as NVML or an inventory gives it '
    '("H100", "NVIDIA A100-SXM4-40GB"); a name that is no MIG-capable model is a 400',
)

CATALOG_EXAMPLE = {
    "model": "H100-80GB",
    "source": "built-in",
    "source_note": "captured: H100 80GB HBM3 lgip/lgipp capture (public repo notes)",
    "built_in_model": "H100-80GB",
    "nodes": ["gpu-node-1"],
    "profiles": [
        {
            "name": "1g.10gb",
            "profile_id": 19,
            "nvml_profile": 0,
            "compute_slices": 1,
            "memory_slices": 1,
            "memory": 10468982784,
            "memory_assumed": False,
            "sm_count": 16,
            "max_instances": 7,
            "placements": [{"start": s, "size": 1} for s in range(7)],
        },
        {
            "name": "7g.80gb",
            "profile_id": 0,
            "nvml_profile": 4,
            "compute_slices": 7,
            "memory_slices": 8,
            "memory": 85094694912,
            "memory_assumed": False,
            "sm_count": 132,
            "max_instances": 1,
            "placements": [{"start": 0, "size": 8}],
        },
    ],
}


@extend_schema_view(
    list=extend_schema(
        summary="List MIG profiles per GPU model",
        tags=TAGS,
        parameters=[MODEL_PARAMETER],
        description="Each GPU model's MIG profiles: name, profile id, compute and memory slices, memory (bytes), SMs, "
        "max instances and allowed placements. The built-in table's models come first, then every distinct "
        "catalog a node's agent read from NVML (`source: \"nvml\"`), which the planner uses for that node's "
        "GPUs instead of the built-in one.",
        examples=[page_example("H100 80GB (two of its seven profiles)", CATALOG_EXAMPLE)],
    )
)
class MigProfileViewSet(MigListViewSet):
    """MIG catalogs, one per GPU model (built-in) or per catalog agents reported (NVML)."""

    serializer_class = MigCatalogSerializer

    def get_queryset(self):
        try:
            return mig_catalog_list(model=self.request.query_params.get("model", ""))
        except InvalidResourceRequest as exc:
            detail = str(exc).removeprefix("model: ")
            raise ApplicationError(detail, type="unknown-model", field_errors={"model": [detail]}) from None


# --- layouts ------------------------------------------------------------------------------------------


class MigSessionSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    owner = serializers.CharField(source="owner.get_username")


class GpuInstanceSerializer(serializers.Serializer):
    id = serializers.UUIDField(source="row.id", help_text="the manager's id of the GPU instance")
    profile = serializers.CharField(source="row.profile")
    placement = serializers.SerializerMethodField()
    memory = serializers.IntegerField(source="row.memory_size", help_text="bytes")
    sm_count = serializers.IntegerField(source="row.subproc_count", help_text="SMs")
    compute_slices = serializers.IntegerField(help_text="compute slices of 7")
    state = serializers.ChoiceField(
        choices=["in_use", "idle", "unknown"],
        help_text='"in_use": a live session holds it; "idle": nobody does (reused by the next request that fits, '
        'destroyed only when its slices are needed); "unknown": the node\'s agent found it on the GPU at '
        "start and the manager never planned it (its slices count as taken; see `uuid`, `unknown_since`)",
    )
    uuid = serializers.CharField(source="row.uuid", help_text='the MIG device UUID ("MIG-…"); "" until the agent created it')
    session = serializers.SerializerMethodField(
        help_text="the session using it: shown to that session's owner and to administrators only, else null"
    )
    last_used_at = serializers.DateTimeField(source="row.last_used_at", allow_null=True)
    unknown_since = serializers.DateTimeField(
        source="row.unknown_since", allow_null=True, help_text="when an agent first reported it unknown"
    )

    @extend_schema_field(MigPlacementSerializer)
    def get_placement(self, view) -> dict:
        return {"start": view.row.placement_start, "size": view.row.placement_size}

    @extend_schema_field(MigSessionSerializer(allow_null=True))
    def get_session(self, view) -> dict | None:
        session = view.row.session if view.state == "in_use" else None
        user = getattr(self.context.get("request"), "user", None)
        if session is None or user is None or not (user.is_staff or session.owner_id == user.pk):
            return None
        return MigSessionSerializer(session).data


class MigGpuSerializer(serializers.Serializer):
    index = serializers.IntegerField(source="device.index")
    device_id = serializers.CharField(source="device.device_id", help_text="the GPU UUID")
    model_name = serializers.CharField(source="device.model_name")


SYNC_STATES = ["", "not-managed", "pending-agent-offline", "sent", "applied", "pending", "error"]


class MigPendingSerializer(serializers.Serializer):
    gpu = serializers.CharField(help_text="the GPU UUID")
    index = serializers.IntegerField(help_text="the GPU's index on its node")
    profile = serializers.CharField()
    start = serializers.IntegerField(help_text="first memory slice")
    action = serializers.ChoiceField(choices=["destroy", "create"], help_text="what waits")
    reason = serializers.CharField(help_text="why it waits, in words")


class MigSyncErrorSerializer(serializers.Serializer):
    gpu = serializers.CharField(allow_null=True, help_text="the GPU UUID")
    profile = serializers.CharField(help_text='the instance\'s profile; "" when the whole GPU failed')
    start = serializers.IntegerField(allow_null=True)
    reason = serializers.CharField(help_text='in words: "MIG mode is off on this GPU …", "the GPU must be reset …"')


class MigDestroySerializer(serializers.Serializer):
    gpu = serializers.CharField()
    profile = serializers.CharField()
    start = serializers.IntegerField()


class MigSyncSerializer(serializers.Serializer):
    """`accelerators.mig_selectors.node_mig_sync_view`."""

    applied = serializers.ChoiceField(
        choices=SYNC_STATES,
        help_text='how far the node\'s agent has applied the expected MIG layout: "sent" (pushed, waiting for its '
        'report), "applied", "pending" (applied except for changes waiting for sessions to end: see '
        '`pending`), "error" (see `errors`), "pending-agent-offline" (the node is LOST: applied when its '
        'agent next starts), "not-managed" (MIG mode off or static: nothing is sent), "" (never sent)',
    )
    detail = serializers.CharField(help_text="the state in words")
    kind = serializers.ChoiceField(
        choices=["start", "layout", "drift"],
        allow_null=True,
        help_text='why the last layout was sent: the agent registered ("start"), an '
        'administrator changed it ("layout"), a heartbeat\'s layout digest '
        'differed ("drift")',
    )
    seq = serializers.IntegerField(allow_null=True, help_text="number of the last layout message sent")
    changed_at = serializers.DateTimeField(allow_null=True, help_text="the administrator's last change")
    sent_at = serializers.DateTimeField(allow_null=True)
    reported_at = serializers.DateTimeField(allow_null=True, help_text="the agent's report on the last message")
    pending = MigPendingSerializer(many=True, help_text="changes that wait for sessions to end (or unknown instances to go)")
    errors = MigSyncErrorSerializer(many=True, help_text="what the agent could not do")  # type: ignore[assignment]  # DRF's metaclass moves declared fields off the class: no clash
    destroying = MigDestroySerializer(
        many=True, help_text="idle instances the agent is to destroy and has not yet reported destroyed"
    )


class MigGpuLayoutSerializer(serializers.Serializer):
    node = serializers.CharField(source="node.name")
    mig_mode = serializers.ChoiceField(source="node.mig_mode", choices=MigMode.choices)
    gpu = MigGpuSerializer(source="*")
    model = serializers.CharField(source="catalog.model", help_text="the MIG catalog's model")
    catalog_source = serializers.ChoiceField(choices=CATALOG_SOURCES)
    instances = GpuInstanceSerializer(many=True, help_text="by first memory slice")
    free_slices = serializers.SerializerMethodField(help_text="memory slices (0–7) no instance holds")
    stranded_slices = serializers.SerializerMethodField(
        help_text="free memory slices no instance could be created over as the GPU is laid out now"
    )
    free_compute_slices = serializers.IntegerField(help_text="compute slices (of 7) no instance holds")
    sync = serializers.SerializerMethodField(
        help_text="how far the node's agent has applied the layout the manager expects on this GPU"
    )

    @extend_schema_field(MigSyncSerializer)
    def get_sync(self, layout) -> dict:
        return MigSyncSerializer(node_mig_sync_view(node=layout.node, gpu=layout.device.device_id)).data

    def get_free_slices(self, layout) -> list[int]:
        return sorted(layout.free)

    def get_stranded_slices(self, layout) -> list[int]:
        return sorted(layout.stranded)


LAYOUT_EXAMPLE = {
    "node": "gpu-node-1",
    "mig_mode": "dynamic",
    "gpu": {"index": 0, "device_id": "GPU-a1000000-0000-0000-0000-000000000001", "model_name": "H100-80GB"},
    "model": "H100-80GB",
    "catalog_source": "built-in",
    "instances": [
        {
            "id": "6a1f5e0c-3b1e-4a55-9a43-7c0d1e2f3a4b",
            "profile": "4g.40gb",
            "placement": {"start": 0, "size": 4},
            "memory": 42412802048,
            "sm_count": 64,
            "compute_slices": 4,
            "state": "in_use",
            "uuid": "MIG-5c3bb3f4-7e0f-5b5e-9d6a-0a1b2c3d4e5f",
            "session": {"id": "27eafb9b-d987-401d-8aab-0bc8d1cd89cd", "name": "notebook", "owner": "alice"},
            "last_used_at": "2026-01-01T10:00:00Z",
            "unknown_since": None,
        },
        {
            "id": "0d9e8f7a-6b5c-4d3e-8f2a-1b0c9d8e7f6a",
            "profile": "1g.10gb",
            "placement": {"start": 6, "size": 1},
            "memory": 10468982784,
            "sm_count": 16,
            "compute_slices": 1,
            "state": "unknown",
            "uuid": "MIG-0f1e2d3c-4b5a-5968-8776-a5b4c3d2e1f0",
            "session": None,
            "last_used_at": None,
            "unknown_since": "2026-01-01T09:00:00Z",
        },
    ],
    "free_slices": [4, 5, 7],
    "stranded_slices": [7],
    "free_compute_slices": 2,
    "sync": {
        "applied": "applied",
        "detail": "the agent applied the expected layout",
        "kind": "start",
        "seq": 1,
        "changed_at": None,
        "sent_at": "2026-01-01T08:59:58Z",
        "reported_at": "2026-01-01T09:00:00Z",
        "pending": [],
        "errors": [],
        "destroying": [],
    },
}


@extend_schema_view(
    list=extend_schema(
        summary="List MIG layouts per GPU",
        tags=TAGS,
        parameters=[
            OpenApiParameter(
                "node", OpenApiTypes.STR, OpenApiParameter.QUERY, required=False, description="only this node's GPUs"
            )
        ],
        description="Every MIG-capable GPU (its model has a MIG catalog) with its node's MIG mode, its GPU instances "
        "(profile, placement, state in_use / idle / unknown, the session using it for its owner and "
        "administrators), its free and stranded memory slices and free compute slices.",
        examples=[page_example("An H100 with one instance in use and one unknown", LAYOUT_EXAMPLE)],
    )
)
class MigLayoutViewSet(MigListViewSet):
    """The MIG layout of every MIG-capable GPU, by node and GPU index."""

    serializer_class = MigGpuLayoutSerializer

    def get_queryset(self):
        nodes = Node.objects.all()
        if self.request.query_params.get("node"):
            nodes = nodes.filter(name=self.request.query_params["node"])
        return mig_gpu_layouts(nodes=nodes)


# --- one node's MIG settings and layout ---------------------------------------------------------------


class NodeMigSerializer(serializers.ModelSerializer):
    applied = serializers.SerializerMethodField(
        help_text="`sync.applied`: how far the node's agent has applied the "
        'expected layout (after a PUT/PATCH: "sent", '
        '"pending-agent-offline" or "not-managed")'
    )
    sync = serializers.SerializerMethodField(help_text="the state of the layout on the node's agent")
    gpus = serializers.SerializerMethodField(help_text="the node's MIG-capable GPUs and their layouts")

    class Meta:
        model = Node
        fields = ["name", "mig_mode", "mig_layout", "applied", "sync", "gpus"]

    @extend_schema_field(serializers.ChoiceField(choices=SYNC_STATES))
    def get_applied(self, node) -> str:
        return node_mig_sync_view(node=node)["applied"]

    @extend_schema_field(MigSyncSerializer)
    def get_sync(self, node) -> dict:
        return MigSyncSerializer(node_mig_sync_view(node=node)).data

    @extend_schema_field(MigGpuLayoutSerializer(many=True))
    def get_gpus(self, node) -> list[dict]:
        # djangorestframework-stubs types .data as a ReturnDict; with many=True it is a ReturnList.
        return MigGpuLayoutSerializer(mig_gpu_layouts(nodes=[node]), many=True, context=self.context).data  # type: ignore[return-value]


class NodeMigSettingsSerializer(serializers.ModelSerializer):
    """What an administrator may change: the node's MIG mode and fixed layout, checked as the
    admin form checks them (`accelerators.mig_services.node_mig_settings_check`), then applied
    and pushed to the node's agent (`node_mig_settings_apply`). Answers with NodeMigSerializer,
    whose `applied` and `sync` say how far that got."""

    class Meta:
        model = Node
        fields = ["mig_mode", "mig_layout"]

    def validate(self, attrs):
        node = self.instance
        assert node is not None  # NodeMigViewSet only updates a node
        try:
            node_mig_settings_check(
                node=node, mig_mode=attrs.get("mig_mode", node.mig_mode), mig_layout=attrs.get("mig_layout", node.mig_layout)
            )
        except InvalidResourceRequest as exc:
            raise serializers.ValidationError({"mig_layout": [str(exc)]}) from None
        return attrs

    def update(self, instance, validated_data):
        with transaction.atomic():
            node = super().update(instance, validated_data)
            node_mig_settings_apply(node=node)  # the agent is told once this commits
        return node

    def to_representation(self, node):
        return NodeMigSerializer(node, context=self.context).data


NODE_MIG_EXAMPLES = [
    OpenApiExample("Dynamic MIG", request_only=True, value={"mig_mode": "dynamic"}),
    OpenApiExample(
        "A fixed layout on GPU 0: 3g.40gb + 2g.20gb + 2 × 1g.10gb",
        request_only=True,
        value={
            "mig_mode": "fixed",
            "mig_layout": {
                "0": [
                    {"profile": "3g.40gb", "start": 4},
                    {"profile": "2g.20gb", "start": 0},
                    {"profile": "1g.10gb", "start": 2},
                    {"profile": "1g.10gb", "start": 3},
                ]
            },
        },
    ),
    OpenApiExample(
        "A node's MIG",
        response_only=True,
        value={
            "name": "gpu-node-1",
            "mig_mode": "dynamic",
            "mig_layout": {},
            "applied": "applied",
            "sync": LAYOUT_EXAMPLE["sync"],
            "gpus": [LAYOUT_EXAMPLE],
        },
    ),
    OpenApiExample(
        "A fixed layout changed while a session uses an instance it drops",
        response_only=True,
        value={
            "name": "gpu-node-1",
            "mig_mode": "fixed",
            "mig_layout": {"0": [{"profile": "7g.80gb", "start": 0}]},
            "applied": "sent",
            "sync": {
                "applied": "sent",
                "detail": "sent to the node's agent; waiting for its report",
                "kind": "layout",
                "seq": 2,
                "changed_at": "2026-01-01T10:00:00Z",
                "sent_at": "2026-01-01T10:00:00Z",
                "reported_at": "2026-01-01T09:00:00Z",
                "errors": [],
                "pending": [
                    {
                        "gpu": "GPU-a1000000-0000-0000-0000-000000000001",
                        "index": 0,
                        "profile": "4g.40gb",
                        "start": 0,
                        "action": "destroy",
                        "reason": "in use by a running session: destroyed when the session ends",
                    },
                    {
                        "gpu": "GPU-a1000000-0000-0000-0000-000000000001",
                        "index": 0,
                        "profile": "7g.80gb",
                        "start": 0,
                        "action": "create",
                        "reason": "its memory slices are held by 4g.40gb@0 (in use): created once they are free",
                    },
                ],
                "destroying": [{"gpu": "GPU-a1000000-0000-0000-0000-000000000001", "profile": "1g.10gb", "start": 6}],
            },
            "gpus": [],
        },
    ),
]
NODE_MIG_DOC = (
    "A node's MIG mode (`off`, `static`: the MIG slices its inventory declares or NVML finds, `dynamic`: "
    "instances created on demand and torn down lazily, `fixed`: the administrator's `mig_layout`, "
    '`{"<GPU index or UUID>": [{"profile", "start"}]}`) and the layout of each MIG-capable GPU. '
)

NODE_MIG_PUSH_DOC = (
    "Once saved, the new expected layout is sent to the node's running agent, which destroys the idle "
    "instances that no longer belong and creates the missing ones at once; instances in use by a "
    "session are never destroyed: those changes are listed in `sync.pending` and made when the "
    'sessions end. `applied` says "sent" (see `sync` and `GET /api/v1/mig/layouts/?node=` for the '
    "agent's report), \"pending-agent-offline\" (the node is LOST: applied at its agent's next "
    'start) or "not-managed" (mode off or static).'
)

_NODE_MIG_WRITE: dict[str, Any] = {
    "tags": TAGS,
    "parameters": [IF_MATCH],
    "request": NodeMigSettingsSerializer,
    "responses": {200: NodeMigSerializer},
    "examples": NODE_MIG_EXAMPLES,
}


@extend_schema_view(
    retrieve=extend_schema(
        summary="A node's MIG mode, fixed layout and GPU layouts",
        tags=TAGS,
        description=NODE_MIG_DOC + ETAG_NOTE,
        examples=NODE_MIG_EXAMPLES[2:3],
    ),
    update=extend_schema(
        summary="Replace a node's MIG settings (administrators; If-Match required)",
        description=NODE_MIG_DOC + ETAG_NOTE + " A fixed layout is checked against each GPU's MIG "
        "catalog (allowed starts, disjoint memory slices, max counts) and applied at once as idle "
        "instances; instances in use stay until their sessions end. " + NODE_MIG_PUSH_DOC,
        **_NODE_MIG_WRITE,
    ),
    partial_update=extend_schema(
        summary="Change a node's MIG settings (administrators; If-Match required)",
        description=NODE_MIG_DOC + ETAG_NOTE + " " + NODE_MIG_PUSH_DOC,
        **_NODE_MIG_WRITE,
    ),
)
class NodeMigViewSet(ETagMixin, mixins.RetrieveModelMixin, mixins.UpdateModelMixin, viewsets.GenericViewSet):
    """One node's MIG settings and its GPUs' layouts; administrators change the settings with the
    ETag from a GET (the same If-Match code as the node's sharing settings)."""

    queryset = Node.objects.all()
    permission_classes = [IsAdminOrReadOnly]
    lookup_field = "name"
    lookup_value_regex = r"[A-Za-z0-9_.\-]+"
    etag_fields = ["mig_mode", "mig_layout"]
    filter_backends: list = []

    def get_serializer_class(self):
        return NodeMigSettingsSerializer if self.request and self.request.method in ("PUT", "PATCH") else NodeMigSerializer
