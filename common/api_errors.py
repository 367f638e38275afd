"""One JSON error shape for the whole API: `{"type", "title", "detail", "field_errors"}`.

`exception_handler` (DRF's EXCEPTION_HANDLER) renders every error an API view raises in it; a
broker that cannot be reached (Redis down: kombu's OperationalError, redis-py's ConnectionError
or TimeoutError, from Celery or the channel layer) or a database that cannot be (PostgreSQL down
or its connection cut: Django's OperationalError or InterfaceError, psycopg_pool's PoolTimeout
among them, after console.settings.DATABASE_POOL's timeout) is a 503 "service-unavailable" with
`Retry-After`. What no view handles ends in Django's handler500, which answers the same shape
under /api/ (`common.api_support.server_error`).
"""

from __future__ import annotations

import logging
import threading

from django.core.exceptions import PermissionDenied
from django.db import DEFAULT_DB_ALIAS, connections
from django.db import InterfaceError as DatabaseInterfaceError
from django.db import OperationalError as DatabaseOperationalError
from django.http import Http404
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from common.errors import ApplicationError

log = logging.getLogger(__name__)

BROKER_ERRORS = (KombuOperationalError, RedisConnectionError, RedisTimeoutError)
# The database could not be reached or its connection broke: no connection within the pool's
# timeout (PoolTimeout, wrapped by Django), a backend terminated (pg_terminate_backend, a restart),
# a connection already closed. A statement's transaction was rolled back: nothing of it was kept.
DATABASE_ERRORS = (DatabaseOperationalError, DatabaseInterfaceError)
UNAVAILABLE_ERRORS = BROKER_ERRORS + DATABASE_ERRORS
RETRY_AFTER_S = 5  # what a 503 asks the client to wait before trying again

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


def error_body(type: str, title: str, detail: str, field_errors: dict[str, list[str]] | None = None) -> dict:
    """`{"type", "title", "detail", "field_errors"}`: the API's one error shape."""
    return {"type": type, "title": title, "detail": detail, "field_errors": field_errors or {}}


def unavailable_service(exc: BaseException) -> str:
    """What `exc` (one of UNAVAILABLE_ERRORS) says cannot be reached: "database" or "broker"."""
    return "database" if isinstance(exc, DATABASE_ERRORS) else "broker"


_pool_checking = threading.Lock()


def database_pool_check() -> None:
    """Test every idle connection of this process's database pool and replace the broken ones
    (psycopg_pool's `ConnectionPool.check`), on a thread of its own, one check at a time; nothing
    where there is no pool (SQLite). After a database restart or terminated backends the pool
    holds dead connections, and a request handed two of them in a row waits out psycopg_pool's
    1 s backoff, past the pool's timeout: a 503 although the database is back. One request's 503
    has the rest of them replaced, so the next requests get live ones."""
    if not _pool_checking.acquire(blocking=False):
        return

    def check() -> None:
        try:
            pool = getattr(connections[DEFAULT_DB_ALIAS], "pool", None)
            if pool is not None:
                pool.check()
        except Exception:
            log.info("could not check the database pool's connections", exc_info=True)
        finally:
            _pool_checking.release()

    threading.Thread(target=check, name="database-pool-check", daemon=True).start()


def service_unavailable(exc: BaseException) -> tuple[dict, int, dict[str, str]]:
    """(body, 503, headers) for a broker or database error `exc` (one of UNAVAILABLE_ERRORS),
    which is logged (one line: an outage answers many requests)."""
    service = unavailable_service(exc)
    if service == "database":
        database_pool_check()
    what = "The database (PostgreSQL)" if service == "database" else "The message broker (Redis)"
    log.warning("answering 503: the %s cannot be reached (%s: %s)", service, type(exc).__name__, str(exc).strip()[:200])
    body = error_body(
        "service-unavailable", "Service unavailable", f"{what} cannot be reached right now; try again in a few seconds."
    )
    return body, 503, {"Retry-After": str(RETRY_AFTER_S)}


def exception_handler(exc, context):
    """DRF's handler, answering `error_body` for every error (`field_errors` from a
    ValidationError's fields, nested ones dotted: "resources.cuda.shares"), and a 503 for
    UNAVAILABLE_ERRORS; None (Django's handler500 then) for any other exception."""
    if isinstance(exc, ApplicationError):
        return Response(error_body(exc.type, exc.title, exc.detail, exc.field_errors), status=exc.status)
    if isinstance(exc, UNAVAILABLE_ERRORS):
        body, status, headers = service_unavailable(exc)
        return Response(body, status=status, headers=headers)
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
    response.data = error_body(slug, _TITLES.get(code, "Error"), detail, field_errors)
    return response
