"""Human output: tables, sizes, fGPU amounts as the slot formats show them, ages, and the
environment limits a session's allocations give it. Pure functions."""
from __future__ import annotations

import re
from datetime import datetime, timezone
from decimal import ROUND_DOWN, Decimal, InvalidOperation

MiB = 1 << 20
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
    """Bytes → binary units, exact where it can be: 8589934592 → "8 GiB", 1.5 GiB → "1.5 GiB"."""
    if num_bytes is None:
        return "-"
    value = Decimal(int(num_bytes))
    names = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    power = 0
    while abs(value) >= 1024 and power < len(names) - 1:
        value /= 1024
        power += 1
    text = f"{value.quantize(Decimal('0.01'), rounding=ROUND_DOWN):f}".rstrip("0").rstrip(".")
    return f"{text} {names[power]}"


def gib(num_bytes) -> str:
    """Bytes → GiB with 2 decimals at most: 2147483648 → "2", 1610612736 → "1.5"."""
    value = Decimal(int(num_bytes)) / GiB
    return f"{value.quantize(Decimal('0.01'), rounding=ROUND_DOWN):f}".rstrip("0").rstrip(".")


def amount(value, *, unit: str = "fGPU", round_length: int = 2, binary: bool = False) -> str:
    """An amount as the slot format's number_format shows it (the server's format_number):
    fixed-point with `round_length` digits, truncated; from 1000 (1024 when `binary`) on with
    k/M/G (Ki/Mi/Gi) suffixes. "1.5" → "1.50 fGPU"; None → "-"."""
    if value is None or value == "":
        return "-"
    try:
        number = Decimal(str(value))
    except InvalidOperation:
        return str(value)
    base = Decimal(1024 if binary else 1000)
    names = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"] if binary else ["", "k", "M", "G", "T", "P", "E"]
    power = 0
    while abs(number) >= base and power < len(names) - 1:
        number /= base
        power += 1
    step = Decimal(1).scaleb(-round_length) if round_length > 0 else Decimal(1)
    text = f"{number.quantize(step, rounding=ROUND_DOWN):f}{names[power]}"
    return f"{text} {unit}".rstrip()


def decimal_text(value) -> str:
    """"20.000" → "20", "0.500" → "0.5"."""
    if value is None:
        return "-"
    try:
        return format(Decimal(str(value)).normalize(), "f")
    except InvalidOperation:
        return str(value)


def shares_text(value) -> str:
    """fGPU shares as the server's default slot format shows them, at least 2 decimals:
    "0.500" → "0.50", "0.125" → "0.125"."""
    if value is None:
        return "-"
    try:
        number = Decimal(str(value)).normalize()
    except InvalidOperation:
        return str(value)
    return f"{number:.2f}" if number == number.quantize(Decimal("0.01")) else format(number, "f")


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


def short_id(session_id: str) -> str:
    return str(session_id)[:8]


def sm_percent(procs, subproc_count) -> int | None:
    """Granted SMs as a whole percentage of the device's (as the agent computes
    CUDA_DEVICE_SM_LIMIT): 100 = the whole device, 0 = no compute share; None if unknown."""
    if not subproc_count:
        return None if subproc_count is None else 100
    granted = Decimal(str(procs or 0))
    if granted >= subproc_count:
        return 100
    if granted == 0:
        return 0
    share = granted * 100 / Decimal(subproc_count)
    return max(1, min(100, int(share.to_integral_value(rounding=ROUND_DOWN))))


def session_environment(allocations: list[dict], subproc_counts: dict[str, int] | None = None) -> dict[str, str]:
    """The environment contract's limits, derived from a session's allocations (the agent
    writes the same: CUDA_DEVICE_MEMORY_LIMIT_<i> in MiB per device, CUDA_DEVICE_SM_LIMIT =
    the smallest limited SM percentage, 0 = no compute limit). `subproc_counts`: device UUID →
    SMs, from the nodes API; without it the SM limits are left out."""
    if not allocations:
        return {"CUDA_VISIBLE_DEVICES": ""}
    uuids = ",".join(a["device"] for a in allocations)
    env = {"CUDA_VISIBLE_DEVICES": uuids, "NVIDIA_VISIBLE_DEVICES": uuids}
    for i, a in enumerate(allocations):
        env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{int(a['memory']) // MiB}m"
    percents = [sm_percent(a["procs"], (subproc_counts or {}).get(a["device"])) for a in allocations]
    percent = None
    if None not in percents:
        limited = [p for p in percents if 0 < p < 100]
        percent = min(limited) if limited else 0
        env["CUDA_DEVICE_SM_LIMIT"] = str(percent)
    env["AMP_VGPU_ENABLE"] = "1"
    env["GPU_MEM_PER_DEVICE"] = str(min(int(a["memory"]) for a in allocations))
    if percent is not None:
        env["GPU_UTIL_PER_DEVICE"] = str(percent)
    return env


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
