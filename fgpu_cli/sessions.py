"""Naming a session on the command line: a full UUID, a unique prefix of one, or the name of
one of the caller's sessions (live sessions win over ended ones of the same name)."""

from __future__ import annotations

import re
import uuid

from fgpu_cli.client import ApiError
from fgpu_cli.formatting import FINAL_STATUSES, short_id

SESSIONS = "/api/v1/sessions/"


class NotFound(Exception):
    """No session, or several, answer to the reference (exit 1)."""


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return len(text.replace("-", "")) == 32


def pick(sessions: list[dict], ref: str, *, username: str = "") -> dict:
    """The one session in `sessions` that `ref` names. Order: exact id, exact name (the
    caller's own where `username` is known; live before ended), unique id prefix."""
    ref = ref.strip()
    if not ref:
        raise NotFound("a session id or name is needed")
    for s in sessions:
        if str(s["id"]) == ref.lower():
            return s
    mine = [s for s in sessions if not username or s.get("owner") == username]
    named = [s for s in mine if s.get("name") == ref]
    if len(named) > 1:
        live = [s for s in named if s.get("status") not in FINAL_STATUSES]
        named = live if live else named
        if len(named) > 1 and not live:
            named = sorted(named, key=lambda s: s.get("created_at") or "")[-1:]  # the latest ended one
    if len(named) == 1:
        return named[0]
    if len(named) > 1:
        raise NotFound(
            f"{len(named)} live sessions are named {ref!r} ({', '.join(short_id(s['id']) for s in named)}): give the id"
        )
    if re.fullmatch(r"[0-9a-fA-F-]+", ref):
        prefix = ref.lower()
        matches = [s for s in sessions if str(s["id"]).startswith(prefix)]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise NotFound(
                f"{ref!r} is the start of {len(matches)} session ids "
                f"({', '.join(short_id(s['id']) for s in matches[:5])}{', …' if len(matches) > 5 else ''}): "
                "give more of it"
            )
    raise NotFound(f"no session {ref!r}")


def resolve(client, ref: str, *, username: str = "") -> dict:
    """The API object of the session `ref` names (fetched fresh)."""
    ref = ref.strip()
    if _is_uuid(ref):
        try:
            return client.get(f"{SESSIONS}{str(uuid.UUID(ref))}/")
        except ApiError as exc:
            if exc.status == 404:
                raise NotFound(f"no session {ref!r}") from None
            raise
    session = pick(client.get_all(SESSIONS), ref, username=username)
    return session
