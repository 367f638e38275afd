"""The console's Content-Security-Policy (issue 31.4): Django 5.2 has none built in, so this small
middleware sets `settings.CONTENT_SECURITY_POLICY` on every answer that has none of its own. The
other headers come from Django's own middleware and settings (console.settings: X-Frame-Options
DENY, Referrer-Policy same-origin, X-Content-Type-Options nosniff, HSTS over TLS)."""

from __future__ import annotations

from django.conf import settings
from django.utils.deprecation import MiddlewareMixin


class ContentSecurityPolicyMiddleware(MiddlewareMixin):
    """Adds `Content-Security-Policy: <settings.CONTENT_SECURITY_POLICY>` to each response (a
    view that set its own keeps it). MiddlewareMixin: sync and async alike, no thread hop."""

    def process_response(self, request, response):
        policy = settings.CONTENT_SECURITY_POLICY
        if policy and "Content-Security-Policy" not in response:
            response["Content-Security-Policy"] = policy
        return response
