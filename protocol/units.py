"""Units: binary sizes, decimal amounts and the slot formats' number formatting, once for the
console, the agent and the command line alike (the server's slot formats and messages, the
agent's allocation document and `fgpu`'s tables all call these). Pure Python, standard library
only: `fgpu` ships this package with itself (fgpu_cli/pyproject.toml), so the CLI installs
without the server.

Every formatter truncates (ROUND_DOWN): an amount or a size is never shown larger than it is.

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

BINARY_NAMES = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
DECIMAL_NAMES = ("", "k", "M", "G", "T", "P", "E")
CENT = Decimal("0.01")


def format_binary_size(size: int) -> str:
    """Bytes → the shortest exact-enough binary text, two decimals at most: 2147483648 →
    "2 GiB", 1536 MiB → "1.5 GiB", 512 → "512 B"."""
    value = Decimal(int(size))
    power = 0
    while abs(value) >= 1024 and power < len(BINARY_NAMES) - 1:
        value /= 1024
        power += 1
    text = f"{value.quantize(CENT, rounding=ROUND_DOWN):f}".rstrip("0").rstrip(".")
    return f"{text} {BINARY_NAMES[power]}B"


def format_number(amount: Decimal | str | int, *, binary: bool, round_length: int) -> str:
    """A slot format's `number_format` (DESIGN.md): `binary` → 2^(10n) suffixes (Ki, Mi, Gi)
    instead of 10^(3n) (k, M, G) once the amount reaches the base; `round_length` → fixed-point
    digits (0: integer). Decimal("1.5"), round_length 2 → "1.50"."""
    value = Decimal(amount)
    base = Decimal(1024 if binary else 1000)
    names = BINARY_NAMES if binary else DECIMAL_NAMES
    power = 0
    while abs(value) >= base and power < len(names) - 1:
        value /= base
        power += 1
    step = Decimal(1).scaleb(-round_length) if round_length > 0 else Decimal(1)
    return f"{value.quantize(step, rounding=ROUND_DOWN):f}{names[power]}"


def amount_text(amount: Decimal | str | int) -> str:
    """A Decimal without trailing zeros or exponent, for messages: Decimal("1.000") → "1",
    Decimal("0.500") → "0.5", Decimal("100") → "100"."""
    return format(Decimal(amount).normalize(), "f")


def fgpu_text(amount: Decimal | str | int) -> str:
    """fGPU as the default slot format shows it, two decimals, more only where the amount has
    them: "0.5" → "0.50", "0.125" → "0.125", "2" → "2.00"."""
    value = Decimal(amount)
    cents = value.quantize(CENT, rounding=ROUND_DOWN)
    return f"{cents:f}" if cents == value else amount_text(value)


# --- parsing --------------------------------------------------------------------------------------

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
