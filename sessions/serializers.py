"""API shapes of compute sessions. Amounts: shares in fGPU (text), memory in bytes, procs in SMs."""
from __future__ import annotations

from django.urls import reverse
from rest_framework import serializers

from sessions.models import Allocation, ComputeSession
from sessions.selectors import session_configuration


class AllocationSerializer(serializers.ModelSerializer):
    device = serializers.CharField(source="device.device_id", help_text="the device (GPU or MIG) UUID")
    device_index = serializers.IntegerField(source="device.index")
    model_name = serializers.CharField(source="device.model_name")
    memory = serializers.IntegerField(help_text="bytes of device memory")
    procs = serializers.DecimalField(max_digits=12, decimal_places=3, help_text="SMs")
    shares = serializers.DecimalField(max_digits=12, decimal_places=3, help_text="fGPU (1 per whole device)")

    class Meta:
        model = Allocation
        fields = ["device", "device_index", "model_name", "shares", "memory", "procs", "released_at"]


class SessionSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    node = serializers.CharField(source="node.name", read_only=True, default=None)
    configuration = serializers.SerializerMethodField()
    allocations = AllocationSerializer(many=True, read_only=True)
    terminal_url = serializers.SerializerMethodField()

    class Meta:
        model = ComputeSession
        fields = ["id", "name", "owner", "status", "status_reason", "node", "resources", "priority", "configuration",
                  "allocations", "command", "created_at", "scheduled_at", "started_at", "terminated_at", "exit_code",
                  "terminal_url"]
        read_only_fields = fields

    def get_configuration(self, session) -> str:
        return session_configuration(session)

    def get_terminal_url(self, session) -> str:
        return reverse("session-terminal", kwargs={"session_id": session.pk})


class SessionCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=64, required=False, allow_blank=True, default="")
    resources = serializers.DictField(help_text='e.g. {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}')
    command = serializers.CharField(required=False, allow_blank=True, default="",
                                    help_text="batch command; blank for an interactive shell")
    priority = serializers.IntegerField(required=False, default=0, min_value=-100, max_value=100,
                                        help_text="higher starts first; above 0 for administrators only")
