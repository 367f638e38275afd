"""Admin pages of usage: the idle policies per resource group, and the accounting report
(GPU-hours per user, project or node over a date range, with its CSV export)."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import admin
from django.template.response import TemplateResponse
from django.utils import timezone

from common.errors import ApplicationError
from usage.api import _moment
from usage.models import IdlePolicy, UsageReport
from usage.selectors import GROUPS, NO_PROJECT, usage_report


@admin.register(IdlePolicy)
class IdlePolicyAdmin(admin.ModelAdmin):
    list_display = ("__str__", "gpu_util_threshold", "idle_timeout", "max_lifetime", "grace")
    fieldsets = (
        (
            None,
            {
                "fields": ("resource_group", "gpu_util_threshold", "idle_timeout", "max_lifetime", "grace"),
                "description": "An interactive session whose GPU utilisation stays under the threshold and "
                "whose terminal sees no input for the idle timeout is warned (terminal and "
                "page), then terminated after the grace period; any session is terminated at "
                "its maximum lifetime. Batch sessions are never reclaimed as idle.",
            },
        ),
    )


@admin.register(UsageReport)
class UsageReportAdmin(admin.ModelAdmin):
    """One page: the report for ?from=&to=&group_by= (default: the last 30 days by user)."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def has_view_permission(self, request, obj=None) -> bool:
        return request.user.is_active and request.user.is_staff

    def changelist_view(self, request, extra_context=None):
        now = timezone.now()
        error, rows = "", []
        group_by = request.GET.get("group_by") or "user"
        try:
            end = _moment("to", request.GET.get("to"), now)
            start = _moment("from", request.GET.get("from"), end - timedelta(days=30))
            rows = usage_report(user=request.user, start=start, end=end, group_by=group_by, now=now)
        except (ApplicationError, ValueError) as exc:
            error = getattr(exc, "detail", str(exc))
            start, end = now - timedelta(days=30), now
        for row in rows:
            row["label"] = "(no project)" if row["key"] == NO_PROJECT else row["key"]
        context = {
            **self.admin_site.each_context(request),
            "title": "Usage report",
            "opts": self.model._meta,
            "rows": rows,
            "error": error,
            "groups": GROUPS,
            "group_by": group_by,
            "start": start,
            "end": end,
            "start_text": request.GET.get("from") or f"{start:%Y-%m-%d}",
            "end_text": request.GET.get("to") or "",
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/usage/usage_report.html", context)
