"""How amounts and sizes are written, once, for the console and the command line alike: the
server's slot formats, messages and the agent's allocation document (through
accelerators.allocation.units) and `fgpu`'s tables all call these. Pure Python: no Django, no
third-party import, so the CLI installs without the server (fgpu_cli/pyproject.toml).

Every formatter truncates (ROUND_DOWN): an amount or a size is never shown larger than it is.
"""

from __future__ import annotations

from decimal import ROUND_DOWN, Decimal

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
