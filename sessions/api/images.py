"""REST API for session images (`/api/v1/images/`): everyone signed in reads them (the launch
dialog and `fgpu images` list them), administrators register, change and delete them
(ETag / If-Match, `common.api_support`; writes through `sessions.policy.images`)."""

from __future__ import annotations

from django.db import transaction
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import serializers, status, viewsets
from rest_framework.response import Response

import protocol
from accelerators.models import Node, NodeStatus
from common.api_support import (
    IF_MATCH_OPTIONAL,
    ErrorSerializer,
    ETagMixin,
    IsAdminOrReadOnly,
    admin_write_docs,
    if_match_check,
)
from sessions.policy.images import image_delete, image_save
from sessions.models import (
    SLOT_NAME_RE,
    SessionImage,
    validate_image_accelerators,
    validate_image_apps,
    validate_image_labels,
)
from sessions.api.serializers import StrictCharField


def _django_validator(check):
    """A model field validator (raising Django's ValidationError) as a DRF one."""

    def run(value):
        from django.core.exceptions import ValidationError as DjangoValidationError

        try:
            check(value)
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.messages) from None

    return run


class SessionImageSerializer(serializers.ModelSerializer):
    accelerators = serializers.ListField(
        child=serializers.RegexField(SLOT_NAME_RE, max_length=32),
        required=False,
        max_length=32,
        validators=[_django_validator(validate_image_accelerators)],
        help_text='slot names the image supports, e.g. ["cuda"]; empty: any (CPU-only sessions too)',
    )
    labels = serializers.DictField(
        child=StrictCharField(allow_blank=True, max_length=1024),
        required=False,
        validators=[_django_validator(validate_image_labels)],
        help_text='free-form text labels, e.g. {"framework": "pytorch"}',
    )
    apps = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        max_length=16,
        validators=[_django_validator(validate_image_apps)],
        help_text="web apps it offers besides the built-in terminal, opened through the console's proxy: "
        '[{"name": "jupyter", "title": "JupyterLab", "command": "jupyter lab --no-browser --ip={host} '
        '--port={port} --ServerApp.base_url={base_url} --IdentityProvider.token={token}", "port": 8888, '
        '"protocol": "http", "base_url": true, "path": "lab", "timeout": 120}]; the agent replaces {host}, '
        "{port}, {base_url} and {token} (set by the console, never shown)",
    )
    nodes = serializers.SerializerMethodField(help_text="the alive nodes whose agents report holding it, by name")

    class Meta:
        model = SessionImage
        fields = [
            "id",
            "reference",
            "display_name",
            "description",
            "accelerators",
            "shell",
            "labels",
            "is_default",
            "apps",
            "preempt_signal",
            "nodes",
            "created_at",
        ]
        read_only_fields = ["id", "created_at"]
        # "At most one default" is kept by sessions.policy.images.image_save, which moves the mark.
        extra_kwargs: dict[str, dict] = {"is_default": {"validators": []}}

    def get_nodes(self, image) -> list[str]:
        alive = self.context.get("alive_images")
        if alive is None:
            # djangorestframework-stubs type `context` a read-only Mapping; DRF's is the dict it was given.
            alive = self.context["alive_images"] = list(  # type: ignore[index]
                Node.objects.filter(status=NodeStatus.ALIVE).order_by("name").values_list("name", "images")
            )
        wanted = {image.reference, protocol.image_key(image.reference)}
        return [name for name, held in alive if isinstance(held, dict) and wanted & held.keys()]

    def create(self, validated_data):
        return image_save(image=SessionImage(**validated_data))

    def update(self, instance, validated_data):
        for key, value in validated_data.items():
            setattr(instance, key, value)
        return image_save(image=instance)


EXAMPLES = [
    OpenApiExample(
        "NGC PyTorch for CUDA sessions",
        value={
            "reference": "nvcr.io/nvidia/pytorch:24.05-py3",
            "display_name": "PyTorch 24.05 (NGC)",
            "description": "NVIDIA's PyTorch container: CUDA 12.4, Python 3.10",
            "accelerators": ["cuda"],
            "shell": "/bin/bash",
            "labels": {"framework": "pytorch"},
            "is_default": False,
        },
    ),
    OpenApiExample(
        "The test image, made the default",
        value={"reference": "fgpu-session:test", "display_name": "Debian minimal", "is_default": True},
    ),
]


DOCS = admin_write_docs(
    "session image",
    tags=["images"],
    examples=EXAMPLES,
    patch_examples=[
        OpenApiExample("Make it the default", value={"is_default": True}),
        OpenApiExample("Describe it", value={"description": "CUDA 12.4, Python 3.10, PyTorch 2.4"}),
    ],
)
DOCS["destroy"] = extend_schema(
    summary="Delete a session image (administrators)",
    tags=["images"],
    parameters=[IF_MATCH_OPTIONAL],
    responses={
        204: None,
        409: OpenApiResponse(
            ErrorSerializer,
            description=('Sessions waiting or running in it use it (type "image-in-use"); ended sessions keep no image.'),
        ),
    },
)


@extend_schema_view(**DOCS)
class SessionImageViewSet(ETagMixin, viewsets.ModelViewSet):
    """Session images sessions may run in (`"image"` of a launch), the default first. Each lists
    the alive nodes that hold it: a session is placed only on one of those."""

    queryset = SessionImage.objects.all()
    serializer_class = SessionImageSerializer
    permission_classes = [IsAdminOrReadOnly]

    def destroy(self, request, *args, **kwargs):
        """204; 409 while sessions that have not ended use it (`sessions.policy.images.image_delete`)."""
        found = self.get_object()
        with transaction.atomic():
            image = SessionImage.objects.select_for_update().get(pk=found.pk)
            if_match_check(request, image, required=False)
            image_delete(image=image)
        return Response(status=status.HTTP_204_NO_CONTENT)
