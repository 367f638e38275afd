"""Pieces every `/api/v1/` view shares: the error component of the OpenAPI schema, the schema
class that documents it on every operation, the "everyone reads, administrators write"
permission, and optimistic concurrency by ETag / If-Match for administrators' edits.

Concurrency rule (RFC 9110 §13.1.1, as GitHub's and Kubernetes' APIs apply it): a GET of one
object answers an `ETag`, a strong validator derived from the row's fields; PUT and PATCH
must send it back in `If-Match`. A missing `If-Match` is 428 (type "precondition-required"),
a tag that no longer matches is 412 (type "precondition-failed": someone else changed the
row since it was read). `If-Match: *` (RFC 9110: any current representation) is accepted
for scripts that mean to overwrite. DELETE checks `If-Match` when one is sent.

Lists (ListETagMixin) answer a weak ETag over the page's content (RFC 9110 §8.8.1: the same
bytes, not the same rows); a GET that sends it back in `If-None-Match` gets 304 and no body,
so pollers (the CLI's `--wait`, dashboards) can skip unchanged pages. The page is still
computed: this saves bandwidth and parsing, not the server's queries.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import TYPE_CHECKING

from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, models, transaction
from django.http import HttpResponse, JsonResponse
from django.template import loader
from django.utils import timezone
from django.views import defaults
from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema
from drf_spectacular.types import OpenApiTypes
from django_filters import rest_framework as filters
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import permissions, serializers, status
from rest_framework.response import Response

from common.api_errors import RETRY_AFTER_S, UNAVAILABLE_ERRORS, error_body, service_unavailable, unavailable_service
from common.errors import ApplicationError


@extend_schema_field({"type": "string", "pattern": "^[^\\x00]*$"})
class TextFilter(filters.CharFilter):
    """A text query filter (`?node=`, `?user=`, …) whose schema says what it refuses: a NUL
    character, which no name can hold (PostgreSQL text cannot) and which the filter's form field
    answers with a 400 ("Null characters are not allowed."). Anything else is matched as given."""


class ErrorSerializer(serializers.Serializer):
    """The one error shape of the API (`common.api_errors`)."""

    type = serializers.CharField(help_text='a short slug: "invalid-resources", "not-found", "precondition-failed", …')
    title = serializers.CharField(help_text='a short summary of the kind of error: "Invalid request", …')
    detail = serializers.CharField(help_text="one sentence a person can act on")
    field_errors = serializers.DictField(
        child=serializers.ListField(child=serializers.CharField()),
        help_text='request field → messages, e.g. {"resources": ["resources.cuda.shares: not a multiple of the '
        'quantum 0.25"]}; empty when the error is about no one field',
    )


class DefaultTimezoneDateTimeField(serializers.DateTimeField):
    """DRF's DateTimeField in the default time zone (settings.TIME_ZONE) instead of the current
    one: the same text, as no view activates another, without DRF's lookup of the current time
    zone per value (a thread-local behind asgiref's process-wide lock), which a page of rows
    pays hundreds of times."""

    def __init__(self, **kwargs):
        kwargs.setdefault("default_timezone", timezone.get_default_timezone())
        super().__init__(**kwargs)


# DRF's ModelSerializer, its model datetimes shown by DefaultTimezoneDateTimeField: for the
# serializers of long lists. (A comment, not a docstring: the schema would describe every
# serializer built on it with the docstring.)
class ModelSerializer(serializers.ModelSerializer):
    serializer_field_mapping = {
        **serializers.ModelSerializer.serializer_field_mapping,
        models.DateTimeField: DefaultTimezoneDateTimeField,
    }


ERROR_DESCRIPTIONS = {
    400: "Invalid request: `field_errors` names the fields.",
    401: "Not authenticated: send `Authorization: Token <key>` (or a signed-in session cookie).",
    403: "Permission denied: an administrator's action, or a CSRF failure with session auth.",
    404: "Not found, or not yours (another user's session is 404, never 403, so ids do not leak).",
    409: "Conflict with the object's current state.",
    412: "Precondition failed: `If-Match` no longer matches the object's ETag; GET it again.",
    428: "Precondition required: send `If-Match` with the ETag from GET.",
}

IF_MATCH = OpenApiParameter(
    "If-Match",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    required=True,
    description="the `ETag` from the GET of this object (or `*` to overwrite whatever is there)",
)
IF_MATCH_OPTIONAL = OpenApiParameter(
    "If-Match",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    required=False,
    description="when sent, the `ETag` from the GET of this object; a stale one is 412",
)


class AutoSchema(SpectacularAutoSchema):
    """drf-spectacular's schema, plus the error responses each operation may answer, all with
    the `Error` component: 401 and 403 wherever a caller must sign in, 400 where a body or a query
    parameter is read (a NUL in any is refused: common.input_guard), 404
    where the path names an object, 409 on writes, 412 / 428 where `If-Match` is checked."""

    def _error_codes(self) -> list[int]:
        if self.get_auth() == []:  # `auth=[]`: an endpoint for anyone, which documents its own errors
            return []
        codes = [401, 403]
        writes = self.method in ("POST", "PUT", "PATCH")
        # A query parameter holding a NUL is a 400 wherever one is read (common.input_guard).
        reads_query = any(parameter.get("in") == "query" for parameter in self._get_parameters())
        if writes or reads_query or (self.method == "GET" and self._is_list_view()):
            codes.append(400)
        if "{" in self.path:
            codes.append(404)
        if writes or self.method == "DELETE":
            codes.append(409)
        if getattr(self.view, "etag_required", False) and self.method in ("PUT", "PATCH", "DELETE"):
            codes += [412] if self.method == "DELETE" else [412, 428]
        return sorted(codes)

    def get_summary(self):
        """The `@extend_schema` summary, else the first line of the view's description."""
        summary = super().get_summary()
        if summary:
            return summary
        first = (self.get_description() or "").strip().splitlines()
        return first[0].rstrip(".")[:120] if first else None

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        for code in self._error_codes():
            if str(code) not in responses:
                response = self._get_response_for_code(ErrorSerializer, str(code), direction=direction)
                response["description"] = ERROR_DESCRIPTIONS[code]
                responses[str(code)] = response
        return responses


def not_found(request, exception=None):
    """handler404: the error JSON for URLs under /api/ that no route matches, Django's page
    elsewhere."""
    if request.path.startswith("/api/"):
        return JsonResponse(error_body("not-found", "Not found", "No such API endpoint."), status=404)
    return defaults.page_not_found(request, exception)


def bad_request(request, exception=None):
    """handler400: a request Django refused before any view read it (a body over
    DATA_UPLOAD_MAX_MEMORY_SIZE, a bad Host header): the error JSON under /api/, Django's
    page elsewhere."""
    if request.path.startswith("/api/"):
        detail = str(exception) if exception is not None and str(exception) else "The request could not be read."
        return JsonResponse(error_body("bad-request", "Invalid request", detail), status=400)
    return defaults.bad_request(request, exception)


def server_error(request):
    """handler500: when the exception is a broker or database one that says the service cannot
    be reached (`common.api_errors.UNAVAILABLE_ERRORS`), 503 with `Retry-After`: under /api/ the
    error JSON "service-unavailable", elsewhere the pages' own "try again" page (503.html,
    rendered without the request, so without a query). Else, under /api/, 500 "server-error"
    (the exception is logged by Django, not shown); Django's page elsewhere. Django calls it
    while handling the exception, so `sys.exc_info()` holds it."""
    exc = sys.exc_info()[1]
    if isinstance(exc, UNAVAILABLE_ERRORS):
        body, status, headers = service_unavailable(exc)
        if request.path.startswith("/api/"):
            return JsonResponse(body, status=status, headers=headers)
        page = loader.render_to_string("503.html", {"service": unavailable_service(exc), "retry_after": RETRY_AFTER_S})
        return HttpResponse(page, status=status, headers=headers)
    if not request.path.startswith("/api/"):
        return defaults.server_error(request)
    return JsonResponse(
        error_body("server-error", "Server error", "The server failed to answer this request; the error was logged."), status=500
    )


class IsAdminOrReadOnly(permissions.BasePermission):
    """Reads for anyone signed in, writes for administrators (`is_staff`)."""

    message = "Only administrators may change this."

    def has_permission(self, request, view) -> bool:
        user = request.user
        if not (user and user.is_authenticated):
            return False
        return request.method in permissions.SAFE_METHODS or user.is_staff


def row_etag(obj, fields: list[str] | None = None) -> str:
    """A strong ETag of one row: SHA-256 over its concrete fields and many-to-many keys, so
    any change to a stored value changes it (only over `fields`, attnames, when given: for
    rows that other writers touch all the time, such as a node's heartbeat). Compute it on an
    instance fresh from the database (a Decimal assigned as "0.25" is stored and read back as
    "0.250")."""
    values = {
        field.attname: field.value_to_string(obj)
        for field in obj._meta.concrete_fields
        if fields is None or field.attname in fields
    }
    for field in obj._meta.many_to_many:
        if fields is None or field.name in fields:
            values[field.name] = sorted(str(pk) for pk in getattr(obj, field.name).values_list("pk", flat=True))
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, cls=DjangoJSONEncoder).encode()).hexdigest()
    return f'"{digest[:32]}"'


def if_match_check(request, obj, *, required: bool, fields: list[str] | None = None) -> None:
    """Compare the request's `If-Match` with `obj`'s ETag (`row_etag(obj, fields)`; strong
    comparison, as RFC 9110 asks of If-Match). Raises ApplicationError 428 when it is required
    and missing, 412 when no listed tag matches."""
    header = request.headers.get("If-Match", "").strip()
    if not header:
        if required:
            raise ApplicationError(
                "Send If-Match with the ETag from a GET of this object, so a change made since is not overwritten silently.",
                type="precondition-required",
                title="Precondition required",
                status=428,
                field_errors={"If-Match": ["required"]},
            )
        return
    if header == "*":
        return
    current = row_etag(obj, fields)
    if current not in [tag.strip() for tag in header.split(",")]:
        raise ApplicationError(
            "This object was changed since you read it (its ETag is no longer the one in If-Match); "
            "GET it again and re-apply your change.",
            type="precondition-failed",
            title="Precondition failed",
            status=412,
            field_errors={"If-Match": [f"stale: the current ETag is {current}"]},
        )


def _save(serializer):
    """`serializer.save()` in a savepoint; a unique constraint that a concurrent write won is a
    409 (type "conflict") rather than a server error."""
    try:
        with transaction.atomic():
            return serializer.save()
    except IntegrityError as exc:
        raise ApplicationError(
            f"Conflicts with an existing object: {exc}".splitlines()[0], type="conflict", title="Conflict", status=409
        ) from None


def page_etag(data) -> str:
    """A weak ETag over a response body's JSON: `W/"<32 hex digits of SHA-256>"`."""
    body = json.dumps(data, sort_keys=True, cls=DjangoJSONEncoder).encode()
    return f'W/"{hashlib.sha256(body).hexdigest()[:32]}"'


def etag_answer(request, response: Response, tag: str) -> Response:
    """`response` (a 200 list) with `ETag: tag`, or 304 with no body when `If-None-Match` lists it."""
    if _none_match(request, tag):
        return Response(status=status.HTTP_304_NOT_MODIFIED, headers={"ETag": tag})
    response["ETag"] = tag
    return response


def _none_match(request, tag: str) -> bool:
    """Whether `If-None-Match` lists `tag` (weak comparison: W/ prefixes ignored) or is `*`."""
    header = request.headers.get("If-None-Match", "")
    listed = [t.strip().removeprefix("W/") for t in header.split(",") if t.strip()]
    return "*" in listed or tag.removeprefix("W/") in listed


if TYPE_CHECKING:  # for the type checker: the view classes these mixins are mixed into
    from rest_framework.generics import GenericAPIView as ViewMixinBase
    from rest_framework.mixins import ListModelMixin as _ListMixedInto
else:
    ViewMixinBase = _ListMixedInto = object


class ListETagMixin(_ListMixedInto):
    """List responses carry a weak `ETag` over the page; `If-None-Match` with it → 304, no body."""

    def list(self, request, *args, **kwargs):
        response = super().list(request, *args, **kwargs)
        return etag_answer(request, response, self.list_etag(response.data)) if response.status_code == 200 else response

    def list_etag(self, data) -> str:
        """The page's weak ETag: `page_etag` over its body. A view that keeps digests of its rows
        may answer one from them instead, so long as any change to the body changes it."""
        return page_etag(data)


class ETagMixin(ListETagMixin, ViewMixinBase):
    """For ModelViewSets of administrators' settings: GET of one object and every write answer
    the object's `ETag`; PUT and PATCH require a matching `If-Match` (module docstring), checked
    and applied with the row locked (`select_for_update`), so two admins' writes are applied one
    after the other and the second one's stale tag is refused. `etag_fields` (attnames) limits
    the tag to the fields the endpoint writes; None: every field. Lists: ListETagMixin."""

    etag_required = True
    etag_fields: list[str] | None = None

    def _locked(self, obj):
        return type(obj).objects.select_for_update().get(pk=obj.pk)

    def _with_etag(self, response: Response, obj) -> Response:
        obj.refresh_from_db()
        response["ETag"] = row_etag(obj, self.etag_fields)
        return response

    def retrieve(self, request, *args, **kwargs):
        obj = self.get_object()
        return self._with_etag(Response(self.get_serializer(obj).data), obj)

    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        obj = _save(serializer)
        return self._with_etag(Response(self.get_serializer(obj).data, status=status.HTTP_201_CREATED), obj)

    def update(self, request, *args, partial: bool = False, **kwargs):
        found = self.get_object()
        with transaction.atomic():
            obj = self._locked(found)
            if_match_check(request, obj, required=True, fields=self.etag_fields)
            serializer = self.get_serializer(obj, data=request.data, partial=partial)
            serializer.is_valid(raise_exception=True)
            _save(serializer)
        return self._with_etag(Response(self.get_serializer(obj).data), obj)

    def partial_update(self, request, *args, **kwargs):
        return self.update(request, *args, partial=True, **kwargs)

    def destroy(self, request, *args, **kwargs):
        found = self.get_object()
        with transaction.atomic():
            obj = self._locked(found)
            if_match_check(request, obj, required=False, fields=self.etag_fields)
            obj.delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


ETAG_NOTE = (
    "The answer carries an `ETag` header; send it back in `If-Match` to change the object "
    "(PUT/PATCH without it: 428; with a stale one: 412)."
)


def admin_write_docs(noun: str, *, examples: list[OpenApiExample], patch_examples: list[OpenApiExample], tags: list[str]) -> dict:
    """extend_schema_view arguments for an admin-written, ETag-guarded viewset of `noun`."""
    return {
        "list": extend_schema(summary=f"List {noun}s", tags=tags),
        "retrieve": extend_schema(summary=f"One {noun}", description=ETAG_NOTE, tags=tags),
        "create": extend_schema(summary=f"Create a {noun} (administrators)", examples=examples, tags=tags),
        "update": extend_schema(
            summary=f"Replace a {noun} (administrators; If-Match required)", parameters=[IF_MATCH], examples=examples, tags=tags
        ),
        "partial_update": extend_schema(
            summary=f"Change some fields of a {noun} (administrators; If-Match required)",
            parameters=[IF_MATCH],
            examples=patch_examples,
            tags=tags,
        ),
        "destroy": extend_schema(summary=f"Delete a {noun} (administrators)", parameters=[IF_MATCH_OPTIONAL], tags=tags),
    }
