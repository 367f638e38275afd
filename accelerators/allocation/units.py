"""Units: binary sizes and the slot formats' number formatting. Pure Python, no Django.

`parse_binary_size` follows Backend.AI's `BinarySize.from_str`: suffixes are binary whatever
their spelling (`4G`, `4g`, `4GB`, `4GiB` are all 4 × 2^30 bytes), a fraction needs a suffix
(`1.1k` = 1126 bytes, truncated), and a bare fraction such as `1.1` is an error.

Bounds, so that no parsed value overflows the database columns that hold it (memory in a
BigIntegerField, amounts in DecimalField(max_digits=12, decimal_places=3)) or the Decimal
arithmetic done with it: a size is at most MAX_SIZE (1 EiB), a decimal below MAX_DECIMAL (10^9)
with at most MAX_DECIMAL_PLACES (6) digits after the point.
"""

from __future__ import annotations

import re
from decimal import ROUND_DOWN, Decimal, InvalidOperation

# How amounts and sizes are written: one formatter of each for the server, the agent and `fgpu`.
from fgpu_cli.units import (  # re-exported: the explicit `x as x` form (mypy --strict's no_implicit_reexport)
    amount_text as amount_text,
    fgpu_text as fgpu_text,
    format_binary_size as format_binary_size,
    format_number as format_number,
)

MAX_SIZE = 1 << 60  # 1 EiB: far above any machine's memory, far below a BigIntegerField's 2^63 - 1
MAX_DECIMAL = 10**9  # amounts are stored with 9 digits before the point (max_digits 12, decimal_places 3)
MAX_DECIMAL_PLACES = 6

_SUFFIX_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5, "e": 6}
_SIZE_RE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]+)?)\s*(?:(?P<suffix>[kmgtpe])(?:i?b)?|b)?\s*$", re.IGNORECASE)


class SizeError(ValueError):
    """A memory size that cannot be read: the message says what was wrong."""


def parse_binary_size(value: object) -> int:
    """`"40G"` → 42949672960. Accepts an int (bytes) or text with an optional binary suffix.

    Raises SizeError for negatives, garbage, bools, bare fractions without a suffix, and sizes
    above MAX_SIZE (1 EiB).
    """
    if isinstance(value, bool):
        raise SizeError(f"{value!r} is not a size")
    if isinstance(value, int):
        if value < 0:
            raise SizeError(f"{value} is negative")
        if value > MAX_SIZE:
            raise _too_large(value)
        return value
    if not isinstance(value, str):
        raise SizeError(f"{value!r} is not a size (expected text like '40G' or a whole number of bytes)")
    match = _SIZE_RE.match(value)
    if not match:
        raise SizeError(f"{value!r} is not a size (expected a number with an optional suffix k, M, G, T, e.g. '40G')")
    number, suffix = match.group("num"), (match.group("suffix") or "").lower()
    if "." in number and not suffix:
        raise SizeError(f"{value!r}: a fractional size needs a unit suffix (e.g. '1.5G')")
    if len(number.split(".")[0].lstrip("0")) > len(str(MAX_SIZE)):  # before any arithmetic on 10^4000
        raise _too_large(value)
    scaled = Decimal(number) * (Decimal(1024) ** _SUFFIX_POWERS[suffix])
    if scaled > MAX_SIZE:
        raise _too_large(value)
    return int(scaled.to_integral_value(rounding=ROUND_DOWN))


def _too_large(value: str | int) -> SizeError:
    return SizeError(f"{_short(value)} is too large: at most 1 EiB ({MAX_SIZE} bytes)")


def parse_decimal(value: object, *, what: str) -> Decimal:
    """A non-negative, finite Decimal from text or an int (never a float), below MAX_DECIMAL
    (10^9) and with at most MAX_DECIMAL_PLACES (6) digits after the point (trailing zeros
    aside): "0.5", "2", "1.500". Raises ValueError saying which rule `value` breaks ("NaN",
    "1e309", "1e-9", "0.1234567")."""
    if isinstance(value, (bool, float)):
        raise ValueError(f"{what}: {value!r} must be given as text or an integer, not a {type(value).__name__}")
    try:
        number = Decimal(str(value).strip())
    except (InvalidOperation, ValueError):
        raise ValueError(f"{what}: {_short(value)} is not a number") from None
    if not number.is_finite():
        raise ValueError(f"{what}: {value!r} is not a finite number")
    if number < 0:
        raise ValueError(f"{what}: {_short(value)} is negative")
    if number >= MAX_DECIMAL:
        raise ValueError(f"{what}: {_short(value)} is too large (at most {MAX_DECIMAL - 1})")
    if number != number.quantize(Decimal(1).scaleb(-MAX_DECIMAL_PLACES)):
        raise ValueError(f"{what}: {_short(value)} has too many digits after the point (at most {MAX_DECIMAL_PLACES})")
    return number


def _short(value: object) -> str:
    """`value` for a message (its repr), cut after 20 characters when longer than 40."""
    if isinstance(value, int) and value.bit_length() > 128:
        return "a number of more than 38 digits"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}…"
