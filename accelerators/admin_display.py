"""How the admin pages show sizes and times, in the field's words.

Sizes are binary ("4 GiB", "19.62 GiB") with the exact byte count on hover; times are
"2026-11-26 02:27:26 UTC" (seconds, never microseconds) with how long ago on hover. Used by
every admin module (accelerators, sessions, accounts), so each page reads the same.
"""

from __future__ import annotations

import datetime as dt

from django import forms
from django.utils import timezone
from django.utils.html import format_html
from django.utils.timesince import timesince

from protocol.units import SizeError, format_binary_size, parse_binary_size

EMPTY = "—"


def size_html(value: int | None) -> str:
    """Bytes as a binary size, the exact bytes in the title: `<span title="4,294,967,296 bytes">4 GiB</span>`;
    None → "—"."""
    if value is None:
        return EMPTY
    return format_html('<span class="size" title="{} bytes">{}</span>', f"{int(value):,}", format_binary_size(int(value)))


def when_text(value: dt.datetime | str | None) -> str:
    """A time as "2026-11-26 02:27:26 UTC" (the site's time zone, whole seconds); an ISO 8601
    string is read first (the MIG sync record stores them so); None or "" → "—"."""
    moment = _moment(value)
    if moment is None:
        return EMPTY
    local = timezone.localtime(moment)
    return f"{local:%Y-%m-%d %H:%M:%S} {local.tzname() or ''}".strip()


def when_html(value: dt.datetime | str | None) -> str:
    """`when_text` in a <time> element whose title says how long ago (or from now) it is."""
    moment = _moment(value)
    if moment is None:
        return EMPTY
    now = timezone.now()
    relative = f"{timesince(moment, now)} ago" if moment <= now else f"in {timesince(now, moment)}"
    return format_html(
        '<time datetime="{}" title="{}">{}</time>', moment.replace(microsecond=0).isoformat(), relative, when_text(moment)
    )


def _moment(value: dt.datetime | str | None) -> dt.datetime | None:
    if value in (None, ""):
        return None
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError:
            return None
    if timezone.is_naive(value):
        value = timezone.make_aware(value, dt.timezone.utc)
    return value


class BinarySizeField(forms.CharField):
    """A size in bytes typed as "40G", "40 GiB", "512M" or a whole number of bytes; empty → None.
    Shown as the binary size it is ("4G" for 4294967296), never a rounded one."""

    def prepare_value(self, value):
        if isinstance(value, int) and not isinstance(value, bool):
            text = format_binary_size(value)
            return text if parse_binary_size(text) == value else str(value)
        return value

    def to_python(self, value):
        value = (super().to_python(value) or "").strip()
        if not value:
            return None
        try:
            return parse_binary_size(int(value) if value.isdigit() else value)
        except SizeError as exc:
            raise forms.ValidationError(str(exc)) from None
