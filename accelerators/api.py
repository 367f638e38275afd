"""REST API for the inventory (read-only for everyone signed in): nodes and their devices."""
from __future__ import annotations

from rest_framework import serializers, viewsets

from accelerators.models import Device, Node
from accelerators.selectors import device_fgpu_summary


class DeviceSerializer(serializers.ModelSerializer):
    capacity_fgpu = serializers.SerializerMethodField(help_text="fGPU; null in discrete mode")
    allocated_fgpu = serializers.SerializerMethodField()
    free_fgpu = serializers.SerializerMethodField(help_text="fGPU; null in discrete mode")
    parent = serializers.CharField(source="parent.device_id", default=None, read_only=True)

    class Meta:
        model = Device
        fields = ["id", "slot_name", "device_id", "index", "mother_uuid", "model_name", "numa_node", "subproc_count",
                  "memory_size", "is_mig_device", "mig_profile", "parent", "capacity_fgpu", "allocated_fgpu", "free_fgpu"]

    def _summary(self, device):
        cache = self.context.setdefault("fgpu", {})
        if device.pk not in cache:
            cache.update(device_fgpu_summary(self.context.get("devices") or [device]))
        return cache[device.pk]

    def get_capacity_fgpu(self, device):
        value = self._summary(device).capacity
        return None if value is None else f"{value:.2f}"

    def get_allocated_fgpu(self, device):
        return f"{self._summary(device).allocated:.2f}"

    def get_free_fgpu(self, device):
        value = self._summary(device).free
        return None if value is None else f"{value:.2f}"


class NodeSerializer(serializers.ModelSerializer):
    devices = serializers.SerializerMethodField()
    resource_group = serializers.CharField(source="resource_group.name", default=None, read_only=True)
    oversubscribed = serializers.BooleanField(source="is_oversubscribed", read_only=True,
                                              help_text="memory or SM scaling above 1: deliberate over-subscription")

    class Meta:
        model = Node
        fields = ["id", "name", "status", "last_heartbeat", "registered_at", "cpu_count", "memory_size", "plugins",
                  "attributes", "resource_group", "device_split_count", "memory_scaling", "core_scaling",
                  "oversubscribed", "devices"]

    def get_devices(self, node):
        devices = list(node.devices.all())
        context = {"devices": devices, "fgpu": self.context.setdefault("fgpu", {})}
        return DeviceSerializer(devices, many=True, context=context).data


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    """GPU nodes with their devices and each device's capacity, allocated and free fGPU."""

    queryset = Node.objects.prefetch_related("devices__parent")
    serializer_class = NodeSerializer
    lookup_field = "name"
    lookup_value_regex = r"[A-Za-z0-9_.\-]+"
