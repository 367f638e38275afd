"""REST API for resource presets (`/api/v1/presets/`): users list the presets they may launch
(those without a resource group and those of the groups they may use, `sessions.admission.presets`);
administrators see every preset and create, change and delete them (ETag / If-Match,
`common.api_support`; every save checked as a launch is, `sessions.admission.presets.preset_check`).
Launch one with `{"preset": "<name or id>"}` in `POST /api/v1/sessions/`."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from drf_spectacular.utils import OpenApiExample, extend_schema, extend_schema_view
from rest_framework import serializers, viewsets

from accelerators.allocation.errors import AllocationError
from accelerators.allocation.requests import parse_resources
from protocol.units import SizeError, parse_binary_size
from accelerators.models import ResourceGroup
from common.api_support import ETagMixin, IsAdminOrReadOnly, admin_write_docs
from sessions.models import ResourcePreset, SessionImage
from sessions.admission.presets import preset_list_for, preset_save
from sessions.selectors import request_configuration


class BinarySizeField(serializers.Field):
    """Bytes: a whole number, or a size as text ("8G", "8 GiB", "512M"; binary units)."""

    default_error_messages = {"invalid": 'a number of bytes or a size such as "8G"'}

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, (int, str)):
            self.fail("invalid")
        try:
            size = parse_binary_size(data)
        except SizeError as exc:
            raise serializers.ValidationError(str(exc)) from None
        if size < 1:
            raise serializers.ValidationError("at least 1 byte")
        return size

    def to_representation(self, value):
        return value


class BinarySizeFieldSchema(OpenApiSerializerFieldExtension):
    target_class = BinarySizeField

    def map_serializer_field(self, auto_schema, direction):
        if direction == "response":
            return {"type": "integer", "description": "bytes"}
        return {
            "oneOf": [{"type": "integer", "minimum": 1}, {"type": "string", "minLength": 1}],
            "description": 'bytes, or a size such as "8G" (binary units: 1G = 2^30 bytes)',
        }


class ResourcePresetSerializer(serializers.ModelSerializer):
    resources = serializers.DictField(
        required=False,
        help_text='the GPU request in any request style a launch takes, e.g. {"cuda.shares": "0.25"}, '
        '{"gpu": 1, "gpu_memory": "4G", "gpu_cores": 50}, {"mig_profile": "1g.10gb"}; '
        "{} (the default) for CPU only. `cpu`, `mem` and `resource_group` are fields of "
        "their own",
    )
    cpu = serializers.IntegerField(required=False, min_value=1, max_value=1 << 16, help_text="CPU cores (default 1)")
    mem = BinarySizeField(
        required=False, help_text='host memory: bytes, or a size such as "8G" when writing (default 1 GiB); read as bytes'
    )
    image = serializers.SlugRelatedField(
        slug_field="reference",
        queryset=SessionImage.objects.all(),
        required=False,
        allow_null=True,
        help_text="a registered session image's reference; null: the default image",
    )
    resource_group = serializers.SlugRelatedField(
        slug_field="name",
        queryset=ResourceGroup.objects.all(),
        required=False,
        allow_null=True,
        help_text="launches into this resource group and is offered only to those who may use it; null: any node, everyone",
    )
    request = serializers.SerializerMethodField()
    configuration = serializers.SerializerMethodField()

    class Meta:
        model = ResourcePreset
        fields = [
            "id",
            "name",
            "description",
            "resources",
            "cpu",
            "mem",
            "image",
            "resource_group",
            "request",
            "configuration",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "created_at", "updated_at"]

    def get_request(self, preset) -> dict:
        """The whole `resources` a launch by this preset sends: the GPU request with `cpu`
        (cores), `mem` (bytes) and `resource_group` (where it has one)."""
        return preset.request()

    def get_configuration(self, preset) -> str:
        """The request formatted as sessions show theirs: "0.25 fGPU · 2 cores · 8 GiB"."""
        try:
            return request_configuration(parse_resources(preset.request()))
        except AllocationError:  # settings changed since it was saved: a launch would say why
            return ""

    def create(self, validated_data):
        return preset_save(preset=ResourcePreset(**validated_data))

    def update(self, instance, validated_data):
        for key, value in validated_data.items():
            setattr(instance, key, value)
        return preset_save(preset=instance)


EXAMPLES = [
    OpenApiExample(
        "Small notebook: 0.25 fGPU, 2 cores, 8 GiB",
        value={
            "name": "Small notebook",
            "description": "A quarter GPU for notebooks and light work",
            "resources": {"cuda.shares": "0.25"},
            "cpu": 2,
            "mem": "8G",
        },
    ),
    OpenApiExample(
        "Training in a resource group, in an image",
        value={
            "name": "Trainer",
            "resources": {"gpu": 1, "gpu_memory": "20G", "gpu_cores": 100},
            "cpu": 8,
            "mem": "64G",
            "image": "nvcr.io/nvidia/pytorch:24.05-py3",
            "resource_group": "training",
        },
    ),
    OpenApiExample("A MIG instance", value={"name": "MIG 1g", "resources": {"mig_profile": "1g.10gb"}}),
]

DOCS = admin_write_docs(
    "resource preset",
    tags=["presets"],
    examples=EXAMPLES,
    patch_examples=[
        OpenApiExample("More memory", value={"mem": "16G"}),
        OpenApiExample("Describe it", value={"description": "For notebooks"}),
    ],
)
DOCS["list"] = extend_schema(
    summary="List resource presets",
    tags=["presets"],
    description='The presets you may launch (`{"preset": name}` in a launch): those without a resource group and '
    "those of the resource groups you may use; administrators: every preset. Each carries its whole "
    "`request` and its `configuration` in words.",
)


@extend_schema_view(**DOCS)
class ResourcePresetViewSet(ETagMixin, viewsets.ModelViewSet):
    """Resource presets: named requests (GPU request, CPU cores, host memory, image, resource
    group) administrators define and users launch."""

    serializer_class = ResourcePresetSerializer
    permission_classes = [IsAdminOrReadOnly]

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation: no caller
            return ResourcePreset.objects.none()
        return preset_list_for(user=self.request.user)
