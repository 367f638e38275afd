"""Tiny helpers that read settings from the environment and refuse bad values.

Every variable read here is listed in `.env.example`. A bad value stops start-up with a
message naming the variable, the value and what was expected (`ImproperlyConfigured`).
"""

from __future__ import annotations

import os

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str = "") -> str:
    """The variable's value, or `default` when unset."""
    return os.environ.get(name, default)


def env_bool(name: str, default: bool = False) -> bool:
    """`1/true/yes/on` or `0/false/no/off` (any case). Raises ImproperlyConfigured otherwise."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer within [minimum, maximum]. Raises ImproperlyConfigured otherwise."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r}: expected an integer") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={raw!r}: must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise ImproperlyConfigured(f"{name}={raw!r}: must be at most {maximum}")
    return value


def env_list(name: str, default: list[str] | None = None) -> list[str]:
    """A comma-separated list; blank items are dropped."""
    raw = os.environ.get(name)
    if raw is None:
        return list(default or [])
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_url(name: str, default: str, *, schemes: tuple[str, ...]) -> str:
    """A URL whose scheme is one of `schemes`. Raises ImproperlyConfigured otherwise."""
    value = os.environ.get(name) or default
    scheme = value.split("://", 1)[0] if "://" in value else ""
    if scheme not in schemes:
        raise ImproperlyConfigured(f"{name}={value!r}: expected a URL starting with {' or '.join(s + '://' for s in schemes)}")
    return value
