"""`Idempotency-Key` for launches: a client that repeats `POST /api/v1/sessions/` with the same
key (after a timeout, a dropped connection, a 5xx) gets the first answer again — same status,
same body, same session — and no second session.

Rules (as the IETF's draft "The Idempotency-Key HTTP Header Field" and Stripe's API apply
them): a key is 1 to MAX_KEY_LENGTH (255) printable ASCII characters (a UUID is a good one),
its own per user (two users' equal keys never meet), and kept KEY_TTL (24 h) after the first
request; then it may be used afresh. The same key with another request body is refused
(422, type "idempotency-key-reused"). Only an answered launch is kept: a refused one (400, a
quota, a request too large) writes nothing, so the key may be sent again once the reason is
fixed. The key's row is written in the same transaction as the session, so the two exist
together or not at all.

Concurrency: the row of (user, key) is unique and written first in that transaction. A second
request with the key waits on it (PostgreSQL holds an insert that conflicts with an
uncommitted row until that transaction ends), then finds the committed row and replays its
answer; if the first one was refused and rolled back, the second goes ahead on its own.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, transaction
from django.utils import timezone

from common.errors import ApplicationError
from sessions.models import ComputeSession, IdempotencyKey

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255
KEY_TTL = timedelta(hours=24)
SWEEP_BATCH = 100  # expired rows deleted per keyed launch, at most

_KEY = re.compile(r"[\x20-\x7e]+")  # printable ASCII, the space included


@dataclass(frozen=True)
class Answer:
    """What to answer: `status` (HTTP), `body` (JSON-ready), `replayed` (True when this is the
    kept answer of an earlier request with the key)."""

    status: int
    body: dict
    replayed: bool


def idempotency_key_check(value: str | None) -> str | None:
    """The header's value as sent, or None when the request has none. Raises ApplicationError
    (400, `field_errors` naming the header) for an empty value, one longer than 255
    characters, or one with a character outside printable ASCII (0x20-0x7E)."""
    if value is None:
        return None
    if not value:
        problem = "must not be empty"
    elif len(value) > MAX_KEY_LENGTH:
        problem = f"at most {MAX_KEY_LENGTH} characters, got {len(value)}"
    elif not _KEY.fullmatch(value):
        problem = "printable ASCII characters only (a UUID is a good key)"
    else:
        return value
    raise ApplicationError(f"{HEADER}: {problem}", type="invalid-idempotency-key", field_errors={HEADER: [problem]})


def request_fingerprint(data) -> str:
    """SHA-256 (hex) of a parsed request body as JSON with its keys sorted, so the same
    request in another key order or spacing has the same fingerprint. Form bodies (a
    QueryDict) count by their lists of values."""
    if hasattr(data, "lists"):
        data = dict(data.lists())
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), cls=DjangoJSONEncoder)
    return hashlib.sha256(text.encode()).hexdigest()


def idempotency_key_answer(*, user, key: str, fingerprint: str, answer: Callable[[], tuple[int, dict, ComputeSession]]) -> Answer:
    """Answer a request of `user` carrying `key` once: the first time, `answer()` runs in a
    transaction with the key's row (it returns the HTTP status, the body and the session it
    created) and the answer is kept; later (or concurrent) requests with the key get the kept
    answer, `replayed`. Exceptions of `answer()` roll everything back and propagate: nothing is
    kept. Deletes up to SWEEP_BATCH rows older than KEY_TTL on the way.

    Raises ApplicationError 422 "idempotency-key-reused" when the kept answer was for a
    request with another `fingerprint` (request_fingerprint); 409 "conflict" in the rare case
    the key's row disappears between the collision and the read (expired meanwhile): retry."""
    _sweep_expired()
    kept = _kept(user, key)
    if kept is None:
        try:
            with transaction.atomic():
                row = _claim(user, key, fingerprint)
                status, body, session = answer()
                row.status_code, row.response, row.session = status, _json_text(body), session
                row.save(update_fields=["status_code", "response", "session"])
                return Answer(status, json.loads(row.response), replayed=False)
        except _Taken:
            kept = _kept(user, key)
        if kept is None:
            raise ApplicationError(
                f"another request with this {HEADER} was being answered; send it again",
                type="conflict",
                title="Conflict",
                status=409,
                field_errors={HEADER: ["in use"]},
            )
    if kept.fingerprint != fingerprint:
        problem = (
            "was used for a different request in the last 24 h; send a new key for a new request, "
            "the same body to repeat that one"
        )
        raise ApplicationError(
            f"{HEADER}: {problem}",
            type="idempotency-key-reused",
            title="Idempotency key reused",
            status=422,
            field_errors={HEADER: [problem]},
        )
    return Answer(cast(int, kept.status_code), json.loads(kept.response), replayed=True)  # _kept: rows with a status


class _Taken(Exception):
    """Another request holds (user, key): its answer is kept (or it was rolled back)."""


def _claim(user, key: str, fingerprint: str) -> IdempotencyKey:
    """Insert the row of (user, key), in the caller's transaction; an expired one gives way.
    Waits while a concurrent transaction holds the key. Raises _Taken when its row exists."""
    IdempotencyKey.objects.filter(user=user, key=key, created_at__lt=timezone.now() - KEY_TTL).delete()
    try:
        with transaction.atomic():  # a savepoint: the unique violation must not break the caller's transaction
            return IdempotencyKey.objects.create(user=user, key=key, fingerprint=fingerprint)
    except IntegrityError:
        raise _Taken from None


def _kept(user, key: str) -> IdempotencyKey | None:
    """The answered row of (user, key) younger than KEY_TTL, or None."""
    return IdempotencyKey.objects.filter(
        user=user, key=key, created_at__gte=timezone.now() - KEY_TTL, status_code__isnull=False
    ).first()


def _sweep_expired() -> None:
    """Delete up to SWEEP_BATCH rows older than KEY_TTL, skipping rows another transaction
    holds (no waiting, no deadlock between two launches sweeping at once)."""
    with transaction.atomic():
        stale = list(
            IdempotencyKey.objects.select_for_update(skip_locked=True)
            .filter(created_at__lt=timezone.now() - KEY_TTL)
            .values_list("pk", flat=True)[:SWEEP_BATCH]
        )
        if stale:
            IdempotencyKey.objects.filter(pk__in=stale).delete()


def _json_text(body: dict) -> str:
    """`body` as JSON text (UUIDs, datetimes and Decimals as text, keys in their order): the
    first answer is read back from it too, so that it and its replays are the same bytes."""
    return json.dumps(body, cls=DjangoJSONEncoder)
