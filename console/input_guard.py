"""Characters the database refuses are refused at the door, before any view reads them.

PostgreSQL's text types cannot hold a NUL character (U+0000): a query that compares a column with
one fails with DataError ("PostgreSQL text fields cannot contain NUL (0x00) bytes"), which a view
that looked an object up by a path id or filtered by a query parameter answered with a 500. This
middleware checks the request's path and every query parameter (names and values) once, for every
view, instead of each lookup and filter checking its own:

- a NUL in the path is a 404: no object's id or name holds one (under /api/ the API's error shape,
  type "not-found"; elsewhere Django's page);
- a NUL in a query parameter is a 400 naming the parameter(s) (under /api/ the error shape, type
  "invalid-parameter", `field_errors` {name: [why]}; elsewhere Django's 400 page).

Bodies are the serializers' business: DRF's CharField refuses NUL itself, and the fields that hold
free JSON check their own (sessions.serializers). Request paths and query strings reach Django
already percent-decoded and UTF-8-decoded (invalid UTF-8 stays percent-encoded or becomes U+FFFD),
so no unpaired surrogate, which PostgreSQL refuses as well, can come this way.
"""

from __future__ import annotations

from django.core.exceptions import BadRequest
from django.http import Http404, JsonResponse
from django.utils.deprecation import MiddlewareMixin

from console.api_errors import error_body

REFUSED = "\x00"  # every character that PostgreSQL's text types refuse
WHY = "must not contain a NUL character (U+0000)"


def refused_parameters(query) -> list[str]:
    """The names (printable: a NUL in a name is shown as `\\x00`) of the parameters of `query` (a
    QueryDict) whose name or any value holds a character of REFUSED, in order, each once."""
    names = []
    for name, values in query.lists():
        if any(c in REFUSED for c in name) or any(c in REFUSED for value in values for c in value):
            names.append(name.encode("unicode_escape").decode("ascii"))
    return names


class RefusedCharactersMiddleware(MiddlewareMixin):
    """Answers a request whose path or query holds a character of REFUSED itself (see the module
    docstring): 404 for the path, 400 naming the parameters for the query. MiddlewareMixin: sync
    and async alike, no thread hop."""

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
        detail = "; ".join(f"{name}: {WHY}" for name in names)
        if api:
            body = error_body("invalid-parameter", "Invalid request", detail, {name: [WHY] for name in names})
            return JsonResponse(body, status=400)
        raise BadRequest(detail)
