"""Session names (issue 36.6): a user's sessions that have not ended have distinct names; an
ended session's name (TERMINATED, ERROR, CANCELLED) may be used again. Backend.AI's rule (its
partial unique index ix_sessions_unique_name_nonterminal, per user). The database holds it
(sessions.models.ComputeSession's constraint "session_name_unique_live"), so of two launches
at once with one name one is refused; these give the refusal its words."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import IntegrityError

from common.errors import ApplicationError
from sessions.models import ComputeSession
from sessions.selectors import session_name_holder

NAME_TAKEN = "name-taken"  # the error's type


def name_taken_error(holder: ComputeSession) -> ApplicationError:
    """400, type "name-taken", field `name`: the session of that name not ended, and what to do."""
    message = (
        f"you already have a session named {holder.name!r} that has not ended ({holder.status}): choose another "
        "name, or end that session first (an ended session's name may be used again)"
    )
    return ApplicationError(f"name: {message}", type=NAME_TAKEN, title="Name in use", field_errors={"name": [message]})


def session_name_check(*, owner, name: str) -> None:
    """Raises `name_taken_error` where a session of `owner` not ended is named `name` (stripped;
    a blank name gets a free default at launch, so it passes). One query."""
    name = (name or "").strip()
    holder = session_name_holder(owner=owner, name=name) if name else None
    if holder is not None:
        raise name_taken_error(holder)


@contextmanager
def name_taken_refused(*, owner, name: str) -> Iterator[None]:
    """Around a launch's transaction (outside it: its rollback comes first): the constraint's
    IntegrityError, where a session of `owner` not ended holds `name`, becomes
    `name_taken_error`; any other IntegrityError goes on as it is."""
    try:
        yield
    except IntegrityError:
        holder = session_name_holder(owner=owner, name=name) if name else None
        if holder is None:
            raise
        raise name_taken_error(holder) from None
