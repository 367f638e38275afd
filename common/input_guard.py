"""Characters the database refuses are refused at the door, before any view reads them.

PostgreSQL's text types cannot hold a NUL character (U+0000): a query that compares a column with
one fails with DataError ("PostgreSQL text fields cannot contain NUL (0x00) bytes"), which a view
that looked an object up by a path id or filtered by a query parameter answered with a 500. This
middleware checks the request's path and every query parameter (names and values) once, for every
view, instead of each lookup and filter checking its own:

- a NUL in the path is a 404: no object's id or name holds one (under /api/ the API's error shape,
  type "not-found"; elsewhere Django's page);
- a NUL in a query parameter is, under /api/, a 400 naming the parameter(s) in the error shape
  (type "invalid-parameter", `field_errors` {name: [why]}); the pages, which ignore a filter they
  cannot use (`?page=x` is the first page), ignore such a parameter too: it is dropped from
  `request.GET` before the view (the admin's search included) reads it.

Bodies are the serializers' business: DRF's CharField refuses NUL itself, and the fields that hold
free JSON check their own (sessions.api.serializers). Request paths and query strings reach Django
already percent-decoded and UTF-8-decoded (invalid UTF-8 stays percent-encoded or becomes U+FFFD),
so no unpaired surrogate, which PostgreSQL refuses as well, can come this way.
"""

from __future__ import annotations

from django.http import Http404, JsonResponse
from django.utils.deprecation import MiddlewareMixin

from common.api_errors import error_body

REFUSED = "\x00"  # every character that PostgreSQL's text types refuse
WHY = "must not contain a NUL character (U+0000)"


def refused_parameters(query) -> list[str]:
    """The names of the parameters of `query` (a QueryDict) whose name or any value holds a
    character of REFUSED, in order, each once, as sent."""
    return [name for name, values in query.lists() if any(c in REFUSED for text in (name, *values) for c in text)]


def shown(name: str) -> str:
    """`name` printable: a NUL (or any control character) as its escape, `\\x00`."""
    return name.encode("unicode_escape").decode("ascii")


class RefusedCharactersMiddleware(MiddlewareMixin):
    """Answers a request whose path holds a character of REFUSED itself (404), and one whose query
    does (400 naming the parameters under /api/; elsewhere the parameters are dropped): see the
    module docstring. MiddlewareMixin: sync and async alike, no thread hop."""

    def process_request(self, request):
        api = request.path.startswith("/api/")
        if any(c in REFUSED for c in request.path):
            if api:
                return JsonResponse(
                    error_body("not-found", "Not found", "No such object: its id cannot hold a NUL character."), status=404
                )
            raise Http404("no path holds a NUL character")
        names = refused_parameters(request.GET)
        if not names:
            return None
        if api:
            detail = "; ".join(f"{shown(name)}: {WHY}" for name in names)
            body = error_body("invalid-parameter", "Invalid request", detail, {shown(name): [WHY] for name in names})
            return JsonResponse(body, status=400)
        kept = request.GET.copy()
        for name in names:
            del kept[name]
        kept._mutable = False
        request.GET = kept
        return None
