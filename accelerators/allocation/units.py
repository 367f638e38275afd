"""Units: binary sizes and the slot formats' number formatting. Pure Python, no Django.

`parse_binary_size` follows Backend.AI's `BinarySize.from_str`: suffixes are binary whatever
their spelling (`4G`, `4g`, `4GB`, `4GiB` are all 4 × 2^30 bytes), a fraction needs a suffix
(`1.1k` = 1126 bytes, truncated), and a bare fraction such as `1.1` is an error.
"""
from __future__ import annotations

import re
from decimal import ROUND_DOWN, Decimal, InvalidOperation

_SUFFIX_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5, "e": 6}
_SIZE_RE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]+)?)\s*(?:(?P<suffix>[kmgtpe])(?:i?b)?|b)?\s*$", re.IGNORECASE)
_BINARY_NAMES = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
_DECIMAL_NAMES = ["", "k", "M", "G", "T", "P", "E"]


class SizeError(ValueError):
    """A memory size that cannot be read: the message says what was wrong."""


def parse_binary_size(value: str | int) -> int:
    """`"40G"` → 42949672960. Accepts an int (bytes) or text with an optional binary suffix.

    Raises SizeError for negatives, garbage, bools, and bare fractions without a suffix.
    """
    if isinstance(value, bool):
        raise SizeError(f"{value!r} is not a size")
    if isinstance(value, int):
        if value < 0:
            raise SizeError(f"{value} is negative")
        return value
    if not isinstance(value, str):
        raise SizeError(f"{value!r} is not a size (expected text like '40G' or a whole number of bytes)")
    match = _SIZE_RE.match(value)
    if not match:
        raise SizeError(f"{value!r} is not a size (expected a number with an optional suffix k, M, G, T, e.g. '40G')")
    number, suffix = match.group("num"), (match.group("suffix") or "").lower()
    if "." in number and not suffix:
        raise SizeError(f"{value!r}: a fractional size needs a unit suffix (e.g. '1.5G')")
    scaled = Decimal(number) * (Decimal(1024) ** _SUFFIX_POWERS[suffix])
    return int(scaled.to_integral_value(rounding=ROUND_DOWN))


def format_binary_size(size: int) -> str:
    """Bytes → the shortest exact-enough binary text: 2147483648 → "2 GiB", 1536 MiB → "1.5 GiB"."""
    value = Decimal(size)
    power = 0
    while abs(value) >= 1024 and power < len(_BINARY_NAMES) - 1:
        value /= 1024
        power += 1
    text = f"{value.quantize(Decimal('0.01'), rounding=ROUND_DOWN):f}".rstrip("0").rstrip(".")
    return f"{text} {_BINARY_NAMES[power]}B"


def format_number(amount: Decimal, *, binary: bool, round_length: int) -> str:
    """A slot format's `number_format`: `binary` → 2^(10n) suffixes (Ki, Mi, Gi) instead of
    10^(3n) (k, M, G) once the amount reaches the base; `round_length` → fixed-point digits
    (0: integer). Truncates, never rounds up, so an amount is never shown larger than it is.
    """
    value = Decimal(amount)
    base = Decimal(1024 if binary else 1000)
    names = _BINARY_NAMES if binary else _DECIMAL_NAMES
    power = 0
    while abs(value) >= base and power < len(names) - 1:
        value /= base
        power += 1
    step = Decimal(1).scaleb(-round_length) if round_length > 0 else Decimal(1)
    text = f"{value.quantize(step, rounding=ROUND_DOWN):f}"
    return f"{text}{names[power]}"


def amount_text(amount: Decimal) -> str:
    """A Decimal without trailing zeros or exponent, for messages: Decimal("1.000") → "1",
    Decimal("0.500") → "0.5", Decimal("100") → "100"."""
    return format(Decimal(amount).normalize(), "f")


def parse_decimal(value: str | int | Decimal, *, what: str) -> Decimal:
    """A non-negative, finite Decimal from text or an int (never a float). Raises ValueError."""
    if isinstance(value, (bool, float)):
        raise ValueError(f"{what}: {value!r} must be given as text or an integer, not a {type(value).__name__}")
    try:
        number = Decimal(str(value).strip())
    except (InvalidOperation, ValueError):
        raise ValueError(f"{what}: {value!r} is not a number") from None
    if not number.is_finite():
        raise ValueError(f"{what}: {value!r} is not a finite number")
    if number < 0:
        raise ValueError(f"{what}: {value!r} is negative")
    return number
