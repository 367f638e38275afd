"""Compute sessions, their device allocations and one-time terminal tickets.

Amounts: `shares` in fGPU (Decimal), `memory` in bytes, `procs` in SMs (Decimal, since
0.1 fGPU × 8 SMs is 0.8 SM), `cpu` in cores, `mem` in bytes.
"""
from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models


class SessionStatus(models.TextChoices):
    PENDING = "PENDING"
    SCHEDULED = "SCHEDULED"
    PREPARING = "PREPARING"
    RUNNING = "RUNNING"
    TERMINATING = "TERMINATING"
    TERMINATED = "TERMINATED"
    ERROR = "ERROR"
    CANCELLED = "CANCELLED"


ACTIVE_STATUSES = (
    SessionStatus.SCHEDULED,
    SessionStatus.PREPARING,
    SessionStatus.RUNNING,
    SessionStatus.TERMINATING,
)
FINAL_STATUSES = (SessionStatus.TERMINATED, SessionStatus.ERROR, SessionStatus.CANCELLED)


class ComputeSession(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=64)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="compute_sessions")
    status = models.CharField(max_length=12, choices=SessionStatus.choices, default=SessionStatus.PENDING, db_index=True)
    status_reason = models.TextField(blank=True)
    resources = models.JSONField(default=dict, help_text="the request as the user sent it")
    request_spec = models.JSONField(default=dict, blank=True,
                                    help_text="the request normalised (accelerators.allocation.requests.request_to_spec)")
    slot_name = models.CharField(max_length=32, blank=True, help_text="accelerator slot requested, blank for CPU-only")
    slot_subtype = models.CharField(max_length=32, blank=True, help_text='"shares", "device" or "per_device"')
    amount = models.DecimalField(max_digits=12, decimal_places=3, default=0,
                                 help_text="fGPU shares, or a device count (device, per_device)")
    cpu = models.PositiveIntegerField(default=1, help_text="CPU cores")
    mem = models.BigIntegerField(default=0, help_text="main memory, bytes")
    command = models.TextField(blank=True, help_text="batch command; blank for an interactive shell")
    node = models.ForeignKey("accelerators.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="sessions")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    scheduled_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    terminated_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "compute session"

    def __str__(self) -> str:
        return f"{self.name} ({self.status})"

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE_STATUSES


class Allocation(models.Model):
    """What one session holds on one device. Live while `released_at` is null."""

    session = models.ForeignKey(ComputeSession, on_delete=models.CASCADE, related_name="allocations")
    device = models.ForeignKey("accelerators.Device", on_delete=models.PROTECT, related_name="allocations")
    shares = models.DecimalField(max_digits=12, decimal_places=3, help_text="fGPU (1 for a whole device)")
    memory = models.BigIntegerField(help_text="bytes of device memory")
    procs = models.DecimalField(max_digits=12, decimal_places=3, help_text="SMs")
    created_at = models.DateTimeField(auto_now_add=True)
    released_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["session", "device__index"]


class TerminalTicket(models.Model):
    """A one-time, short-lived credential for opening one session's terminal websocket.

    Only the SHA-256 digest of the ticket is stored.
    """

    digest = models.CharField(max_length=64, unique=True)
    session = models.ForeignKey(ComputeSession, on_delete=models.CASCADE, related_name="terminal_tickets")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
