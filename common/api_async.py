"""API views that wait on something outside the process (an agent's answer) without holding a
web thread or a database connection while they wait.

Django serves a DRF view on a thread of the request's own (asgiref's thread-sensitive
executor, one per request) and the request keeps its database connection until
it ends: a view that waits minutes for an agent would hold both, and a few dozen such requests
would take every connection of the pool (settings.DATABASE_POOL) from the rest of the site.

`awaiting_view(view)` wraps a DRF view as an async Django view. The DRF view runs as usual
(authentication, throttling, permission checks, validation, its one service call: everything
that reads the database); when it answers an `AwaitedResponse`, the wrapper gives the database
connection back to the pool, lets the request's thread end, and awaits the response's
coroutine on the event loop. Its result becomes the body; an exception it raises is rendered
by the API's exception handler (common.api_errors: the one error shape, 503 for a broker
error), as if the view had raised it. The headers, status and content negotiation are the DRF
view's. A result that is itself a Django response (a StreamingHttpResponse over an async
iterator, for a download streamed as the agent reads it) is answered as it is, with the DRF
view's headers it does not set (Allow, Vary). Under Django's test client (a sync caller) the
same code runs on the caller's thread.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import SyncToAsync, sync_to_async
from django.db import connections
from django.http import HttpResponseBase
from rest_framework.response import Response

from common.api_errors import exception_handler


class AwaitedResponse(Response):
    """A DRF view's answer whose body is the result of `wait()` (a coroutine function taking no
    argument), awaited by `awaiting_view` after the view returned; `status` is the answer's
    status when `wait()` returns (200 by default). When `wait()` returns an HttpResponseBase,
    that response is the answer instead (with this one's headers it lacks)."""

    def __init__(self, wait: Callable[[], Awaitable[Any]], *, status: int = 200):
        super().__init__(None, status=status)
        self.wait = wait


def awaiting_view(view: Callable) -> Callable:
    """An async Django view serving `view` (a DRF view function, `as_view()`'s), awaiting the
    AwaitedResponse it may answer (see the module docstring). Keeps `view`'s attributes
    (`csrf_exempt`, and `cls`, `initkwargs`, `actions` that the schema generator reads)."""

    async def awaiting(request, *args, **kwargs):
        response = await sync_to_async(_serve, thread_sensitive=True)(view, request, *args, **kwargs)
        if not isinstance(response, AwaitedResponse):
            return response
        _request_thread_release()
        try:
            result = await response.wait()
            if isinstance(result, HttpResponseBase):
                for header, value in response.items():
                    result.setdefault(header, value)
                return result
            response.data = result
        except Exception as exc:
            error = exception_handler(exc, response.renderer_context)  # type: ignore[attr-defined]  # set by DRF, not in its stubs
            if error is None:
                raise
            response.data, response.status_code = error.data, error.status_code
            for header, value in error.items():
                response[header] = value
        return response

    functools.update_wrapper(awaiting, view, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=())
    for name in ("csrf_exempt", "cls", "initkwargs", "actions"):
        if hasattr(view, name):
            setattr(awaiting, name, getattr(view, name))
    return awaiting


def _serve(view: Callable, request, *args, **kwargs):
    """Run `view`; before an AwaitedResponse goes back to the event loop, give this thread's
    database connections back (to the pool: Django's close()), except one inside a transaction
    (a test's, which the caller's thread goes on using)."""
    response = view(request, *args, **kwargs)
    if isinstance(response, AwaitedResponse):
        for connection in connections.all(initialized_only=True):
            if not connection.in_atomic_block:
                connection.close()
    return response


def _request_thread_release() -> None:
    """Let the request's thread-sensitive thread end now rather than when the request does: it
    is idle until the wait is over (its connections were given back by `_serve`), and a later
    thread-sensitive call of the request (middleware, rendering, Django's request_finished) gets
    a new one. asgiref keeps one executor per request context (`ThreadSensitiveContext`, which
    Django's ASGIHandler enters for every request) in `SyncToAsync.context_to_thread_executor`;
    where that is not so (another asgiref, or a sync caller such as the test client) nothing
    is done and the thread simply waits idle, as before."""
    contexts = getattr(SyncToAsync, "context_to_thread_executor", None)
    current = getattr(SyncToAsync, "thread_sensitive_context", None)
    context = current.get(None) if current is not None else None
    if context is None or contexts is None:
        return
    executor = contexts.pop(context, None)
    if executor is not None:
        executor.shutdown(wait=False)
