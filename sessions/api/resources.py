"""`GET /api/v1/my-resources/`: what the caller can get, at a glance (`sessions.admission.resources`)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.decorators import api_view
from rest_framework.response import Response

from sessions.admission.resources import my_resources


class UsageFigureSerializer(serializers.Serializer):
    key = serializers.ChoiceField(["fgpu", "gpu_memory", "sessions"])
    used = serializers.JSONField(
        help_text="fGPU: decimal text; gpu_memory: bytes (integer); sessions: running or waiting (integer)"
    )
    limit = serializers.JSONField(
        allow_null=True, help_text="the binding quota's limit, in `used`'s units (null: no quota limits it)"
    )
    left = serializers.JSONField(allow_null=True, help_text="what that quota still allows (never below 0)")
    quota = serializers.CharField(
        allow_null=True, help_text='how a refusal names it: "your quota", \'quota of project "vision"\''
    )


class GroupCapacitySerializer(serializers.Serializer):
    name = serializers.CharField(allow_blank=True, help_text='a resource group; "": every node')
    nodes = serializers.IntegerField()
    nodes_alive = serializers.IntegerField()
    allocation_mode = serializers.CharField(
        help_text='"fractional" (free / total in fGPU, decimal text) or "discrete" (idle / all whole GPUs)'
    )
    free = serializers.CharField()
    total = serializers.CharField()
    memory_free = serializers.IntegerField(help_text="bytes of device memory free on the alive nodes")
    memory_total = serializers.IntegerField(help_text="bytes of device memory on the alive nodes")
    mig_gpus = serializers.IntegerField(help_text="GPUs on the alive nodes that serve MIG (not counted in free / total)")
    mig_free = serializers.IntegerField(help_text="MIG compute slices free on them (7 a GPU)")
    mig_total = serializers.IntegerField(help_text="MIG compute slices on them")


class FolderUseSerializer(serializers.Serializer):
    folder = serializers.CharField(help_text='"~/data" (your own) or "~/projects/<name>" (a project\'s)')
    node = serializers.CharField(help_text="the node whose agent measured it (each node keeps its own folders)")
    used = serializers.IntegerField(help_text="bytes")
    limit = serializers.IntegerField(help_text="bytes: the limit that node enforces (it stops sessions past it)")
    t = serializers.IntegerField(help_text="epoch seconds of the measure")


class MyResourcesSerializer(serializers.Serializer):
    usage = UsageFigureSerializer(many=True)
    groups = GroupCapacitySerializer(many=True)
    storage = FolderUseSerializer(many=True)


@extend_schema(
    summary="My resources",
    tags=["quotas"],
    responses={200: MyResourcesSerializer},
    description="Your fGPU, GPU memory and sessions in use against the quota that binds each (the one "
    'with the least left), the GPU capacity free by resource group ("": every node), and your data '
    "folders' storage use per node against its limit.",
)
@api_view(["GET"])
def my_resources_view(request):
    """The caller's usage against their quotas and the free capacity by resource group."""
    return Response(my_resources(user=request.user))
