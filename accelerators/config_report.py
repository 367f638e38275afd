"""What an accelerator configuration import did (`accelerators.config_import`): the report the
command prints, the admin page shows and an upload's check answers. Pure, no Django."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from accelerators.config_parse import KIND_TOML


@dataclass
class ImportReport:
    """What `import_accelerator_config` did. Counts are of database rows."""

    path: str
    kind: str  # "mock-accelerator TOML" or "etcd JSON"
    slot_names: list[str] = field(default_factory=list)
    slot_formats_created: list[str] = field(default_factory=list)  # "cuda.shares"
    slot_formats_updated: list[str] = field(default_factory=list)
    slot_formats_unchanged: list[str] = field(default_factory=list)
    fractional_settings_created: list[str] = field(default_factory=list)  # slot names
    fractional_settings_updated: list[str] = field(default_factory=list)
    fractional_settings_unchanged: list[str] = field(default_factory=list)
    node_name: str | None = None
    device_count: int = 0
    mig_device_count: int = 0
    link_count: int = 0
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """Several lines of plain text for a terminal or a log."""
        slots = "slots" if len(self.slot_names) > 1 else "slot"
        lines = [f"Imported {self.path} ({self.kind}; {slots} {', '.join(self.slot_names) or '—'})."]
        if self.kind == KIND_TOML:
            lines.append(
                "  slot formats: "
                + _counted(
                    ("created", self.slot_formats_created),
                    ("updated", self.slot_formats_updated),
                    ("unchanged", self.slot_formats_unchanged),
                )
            )
        lines.append(
            "  fractional settings: "
            + _counted(
                ("created", self.fractional_settings_created),
                ("updated", self.fractional_settings_updated),
                (
                    "kept as they were" if self.kind == KIND_TOML else "unchanged",
                    self.fractional_settings_unchanged,
                ),
            )
        )
        if self.node_name is not None:
            lines.append(
                f"  node {self.node_name}: {self.device_count} devices"
                f" ({self.device_count - self.mig_device_count} GPUs, {self.mig_device_count} MIG slices)"
            )
            if self.link_count:
                lines.append(f"  links between its devices: {self.link_count}")
        elif self.kind == KIND_TOML:
            lines.append("  devices: not imported (give a node name to import the device inventory)")
        if self.warnings:
            lines.append(f"  {len(self.warnings)} warning{'s' if len(self.warnings) != 1 else ''}")
        return "\n".join(lines)


def _counted(*groups: tuple[str, list[str]]) -> str:
    parts = [f"{len(items)} {label}" + (f" ({', '.join(items)})" if items else "") for label, items in groups]
    return ", ".join(parts)


def report_shown_as(report: ImportReport, folder: str) -> ImportReport:
    """The report with the temporary folder left out of its path and warnings."""
    prefix = folder + os.sep
    report.path = report.path.replace(prefix, "")
    report.warnings = [warning.replace(prefix, "") for warning in report.warnings]
    return report
