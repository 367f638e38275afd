"""`fgpu usage`: GPU-hours per user, project or node (`GET /api/v1/usage/`) as a table or CSV; and
a session's storage as `fgpu describe` shows it (`GET /api/v1/sessions/<id>/usage/`). Pure
functions over the API's JSON."""

from __future__ import annotations

import csv
import io

from fgpu_cli.formatting import size, table

COLUMNS = (
    ("gpu_hours", "GPU-H"),
    ("fgpu_hours", "FGPU-H"),
    ("gpu_memory_gib_hours", "GPU-MEM GIB-H"),
    ("used_gpu_hours", "USED GPU-H"),
    ("used_gpu_memory_gib_hours", "USED GPU-MEM GIB-H"),
    ("sessions", "SESSIONS"),
)


def _hours(text) -> str:
    """ "12.500000" → "12.50" (two decimals for people; the API and CSV keep six)."""
    try:
        return f"{float(text):.2f}" if "." in str(text) else str(text)
    except ValueError:
        return str(text)


def usage_text(report: dict) -> str:
    """The report as a table, its range on the first line."""
    group = str(report.get("group_by", "key"))
    rows = [
        [
            r.get("key") or ("(no project)" if group == "project" else "-"),
            *(_hours(r.get(k)) if k != "sessions" else r.get(k) for k, _ in COLUMNS),
        ]
        for r in report.get("rows") or []
    ]
    head = f"Usage {report.get('from')} – {report.get('to')} by {group}:"
    return head + "\n" + (table([group.upper(), *(label for _, label in COLUMNS)], rows) if rows else "No usage in this range.")


def usage_csv(report: dict) -> str:
    """The rows as CSV, as the API's `?format=csv` gives them (six decimals)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([report.get("group_by", "key"), *(k for k, _ in COLUMNS)])
    for r in report.get("rows") or []:
        writer.writerow([r.get("key"), *(r.get(k) for k, _ in COLUMNS)])
    return out.getvalue()


def storage_text(series: dict | None) -> str | None:
    """A session's storage (its home and container layer) against the limit its node enforces, from
    its usage series (`storage`, `storage_limit`: bytes): "1.2 GiB of 10 GiB (12 %)"; "not measured
    yet" before its node's first measure; None where the server tells nothing of storage."""
    if not series or "storage" not in series:
        return None
    used, limit = series.get("storage"), series.get("storage_limit")
    if used is None:
        return "not measured yet"
    if not limit:
        return size(used)
    return f"{size(used)} of {size(limit)} ({int(used) * 100 // int(limit)} %)"
