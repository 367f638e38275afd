"""One JSON error shape for the whole API: `{"type", "title", "detail", "field_errors"}`."""
from __future__ import annotations

from django.core.exceptions import PermissionDenied
from django.http import Http404
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from console.errors import ApplicationError

_TITLES = {
    400: "Invalid request",
    401: "Not authenticated",
    403: "Permission denied",
    404: "Not found",
    405: "Method not allowed",
    409: "Conflict",
    415: "Unsupported media type",
    429: "Too many requests",
}


def _flatten(detail) -> dict[str, list[str]]:
    if isinstance(detail, dict):
        out: dict[str, list[str]] = {}
        for key, value in detail.items():
            if isinstance(value, dict):
                for sub, messages in _flatten(value).items():
                    out[f"{key}.{sub}"] = messages
            else:
                out[key] = [str(v) for v in (value if isinstance(value, list) else [value])]
        return out
    return {}


def exception_handler(exc, context):
    if isinstance(exc, ApplicationError):
        body = {"type": exc.type, "title": exc.title, "detail": exc.detail, "field_errors": exc.field_errors}
        return Response(body, status=exc.status)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    code = response.status_code
    field_errors = _flatten(response.data) if isinstance(exc, exceptions.ValidationError) else {}
    if field_errors:
        detail = "; ".join(f"{k}: {' '.join(v)}" for k, v in field_errors.items())
    else:
        raw = response.data.get("detail", response.data) if isinstance(response.data, dict) else response.data
        detail = " ".join(str(x) for x in raw) if isinstance(raw, list) else str(raw)
    slug = getattr(exc, "default_code", "error").replace("_", "-")
    response.data = {"type": slug, "title": _TITLES.get(code, "Error"),
                     "detail": detail, "field_errors": field_errors}
    return response
