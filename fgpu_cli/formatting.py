"""Human output: tables, sizes and fGPU amounts (written by protocol.units, as the server writes
them), ages. Pure functions."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from decimal import ROUND_DOWN, Decimal, InvalidOperation

from protocol.units import amount_text, fgpu_text, format_binary_size, format_number

GiB = 1 << 30
FINAL_STATUSES = ("TERMINATED", "ERROR", "CANCELLED")
LIVE_STATUSES = ("PENDING", "SCHEDULED", "PREPARING", "RUNNING", "TERMINATING")

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # C0, DEL, C1
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(value) -> str:
    """`value` as text with every control character (C0, DEL, C1) escaped: newline, return and
    tab as `\\n`, `\\r`, `\\t`, the others as `\\x1b`. Text from the server that users chose
    (a session's name, a command, a reason quoting them) then cannot move the cursor, recolour
    or retitle the terminal, or break a table's rows. Not for a session's own output (logs,
    the terminal), which is shown as it is."""
    return _CONTROL.sub(lambda m: _NAMED.get(m.group(), f"\\x{ord(m.group()):02x}"), str(value))


def table(headers: list[str], rows: list[list]) -> str:
    """Left-aligned columns, two spaces apart; None → "-"; control characters escaped (`printable`)."""
    cells = [[printable("-" if c is None or c == "" else c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def key_values(pairs: list[tuple[str, object]]) -> str:
    """One `Key:  value` line per pair, values aligned; None → "-"; control characters escaped
    (`printable`)."""
    rows = [(printable(k) + ":", printable("-" if v is None or v == "" else v)) for k, v in pairs]
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def size(num_bytes) -> str:
    """Bytes → binary units (protocol.units.format_binary_size): 8589934592 → "8 GiB"; None → "-"."""
    return "-" if num_bytes is None else format_binary_size(int(num_bytes))


def gib(num_bytes) -> str:
    """Bytes → GiB with 2 decimals at most: 2147483648 → "2", 1610612736 → "1.5"."""
    value = Decimal(int(num_bytes)) / GiB
    return f"{value.quantize(Decimal('0.01'), rounding=ROUND_DOWN):f}".rstrip("0").rstrip(".")


def amount(value, *, unit: str = "fGPU", round_length: int = 2, binary: bool = False) -> str:
    """An amount as the slot format's number_format shows it (protocol.units.format_number, as the
    server writes it) with its unit: "1.5" → "1.50 fGPU"; None → "-"."""
    if value is None or value == "":
        return "-"
    try:
        text = format_number(Decimal(str(value)), binary=binary, round_length=round_length)
    except InvalidOperation:
        return str(value)
    return f"{text} {unit}".rstrip()


def decimal_text(value) -> str:
    """ "20.000" → "20", "0.500" → "0.5" (protocol.units.amount_text); None → "-"."""
    if value is None:
        return "-"
    try:
        return amount_text(Decimal(str(value)))
    except InvalidOperation:
        return str(value)


def shares_text(value) -> str:
    """fGPU shares as the server's default slot format shows them (protocol.units.fgpu_text):
    "0.500" → "0.50", "0.125" → "0.125"; None → "-"."""
    if value is None:
        return "-"
    try:
        return fgpu_text(Decimal(str(value)))
    except InvalidOperation:
        return str(value)


def parse_time(text):
    if not text:
        return None
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None


def age(text, now: datetime | None = None) -> str:
    """ISO time → "42s", "5m", "3h", "2d" ago."""
    moment = parse_time(text)
    if moment is None:
        return "-"
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    seconds = max(0, int(((now or datetime.now(timezone.utc)) - moment).total_seconds()))
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds // span}{unit}"
    return f"{seconds}s"


def until(text, now: datetime | None = None) -> str:
    """ISO time → "now", "in 42s", "in 5m", "in 3h", "in 2d" from `now`; "-" for none."""
    moment = parse_time(text)
    if moment is None:
        return "-"
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    seconds = int((moment - (now or datetime.now(timezone.utc))).total_seconds())
    if seconds <= 30:
        return "now"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"in {seconds // span}{unit}"
    return f"in {seconds}s"


def clock(text) -> str:
    """ISO time → "2026-11-26 09:40 UTC"; "-" for none."""
    moment = parse_time(text)
    if moment is None:
        return "-"
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def eta_band(earliest, latest) -> str:
    """An ETA band (ISO times; `latest` None: unknown) → "2026-11-26 09:40 UTC – 10:30 UTC (in 40m – in 1h)"."""
    if not earliest:
        return "-"
    if not latest:
        return f"from {clock(earliest)} ({until(earliest)}; latest unknown)"
    if clock(earliest) == clock(latest):
        return f"{clock(earliest)} ({until(earliest)})"
    return f"{clock(earliest)} – {clock(latest)[11:]} ({until(earliest)} – {until(latest)})"


def eta_start(eta: dict) -> str:
    """A pending session's ETA (GET /api/v1/sessions/<id>/eta/) → its "Estimated start" text, as
    the session page words it: "now" only for one that fits now; one that waits for sessions
    due to end now starts "any moment" (sessions.scheduling.eta.band_agreed)."""
    outcome = eta.get("outcome")
    if outcome == "now":
        return "now: it fits and starts at the next scheduler pass"
    if outcome == "never":
        return "never, as asked"
    if outcome != "estimate":
        return "unknown"
    text = eta_band(eta.get("earliest"), eta.get("latest"))
    return text if eta.get("fits_now") else text.replace("(now", "(any moment").replace(" now)", " any moment)")


def short_id(session_id: str) -> str:
    return str(session_id)[:8]


def flatten(value, prefix: str = "") -> list[tuple[str, object]]:
    """Nested JSON → ("a.b", value) pairs, for objects whose shape the CLI does not know."""
    if isinstance(value, dict):
        pairs = []
        for key, item in value.items():
            pairs += flatten(item, f"{prefix}.{key}" if prefix else str(key))
        return pairs or [(prefix, "{}")]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        pairs = []
        for i, item in enumerate(value):
            pairs += flatten(item, f"{prefix}[{i}]")
        return pairs
    if isinstance(value, list):
        return [(prefix, ", ".join(str(v) for v in value) or "[]")]
    return [(prefix, value)]
