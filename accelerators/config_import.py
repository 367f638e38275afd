"""Import accelerator configuration written for Backend.AI: the mock-accelerator TOML of its
`ai.backend.accelerator.mock` plugin and the etcd-style JSON of its fractional settings (the
formats and the rules taken from Backend.AI: `accelerators.config_parse`).

Three parts: `accelerators.config_parse` reads a file (pure, no Django: the agent's mock plugin
uses it) into dataclasses or raises `ConfigError` naming the file, the field and the problem;
`accelerators.config_apply` writes slot formats, fractional settings and a node's device
inventory; `accelerators.config_report` is what an import did. Here, the entry points (the
`import_accelerator_config` command's, standalone mode's, the admin's upload page's):
`import_accelerator_config` parses everything first, then writes in one transaction (all or
nothing); `import_accelerator_config_upload` does it for an uploaded file. The parse module's
public names are re-exported.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from django.db import transaction

from accelerators.config_apply import (
    fractional_settings_apply,
    fractional_settings_ensure,
    node_inventory_import,
    slot_formats_apply,
)
from accelerators.config_parse import (  # noqa: F401 (re-exported: the import's public names)
    KIND_JSON,
    KIND_TOML,
    MOCK_PLUGIN_NAME,
    ConfigError,
    FormatSpec,
    FractionalSpec,
    MockAcceleratorConfig,
    _MAX_NODE_NAME,
    detect_kind,
    parse_etcd_json,
    parse_mock_accelerator_toml,
)
from accelerators.config_report import ImportReport, report_shown_as

__all__ = [
    "MOCK_PLUGIN_NAME",
    "ConfigError",
    "FormatSpec",
    "FractionalSpec",
    "ImportReport",
    "MockAcceleratorConfig",
    "import_accelerator_config",
    "import_accelerator_config_upload",
    "parse_etcd_json",
    "parse_mock_accelerator_toml",
]


def import_accelerator_config(path: str | Path, *, node_name: str | None = None) -> ImportReport:
    """Import a mock-accelerator TOML or an etcd-style JSON file into the database.

    TOML: upserts one SlotFormat per format table (`<slot>.<subtype>`); creates the slot's
    FractionalSettings with Backend.AI's defaults when missing (never overwrites existing
    settings); when `node_name` is given, replaces that node's device inventory with the
    file's devices through `accelerators.services.node_inventory_apply` (plugin
    `ai.backend.accelerator.mock`, attributes from `[attributes]`) and its device links with
    the file's `links` through `accelerators.services.node_links_apply` (none declared: the
    node keeps no links).
    JSON: creates or updates FractionalSettings of each slot with the file's values (absent
    keys take Backend.AI's defaults, as in etcd); `node_name` is ignored with a warning.

    Everything is parsed before anything is written, and all writes share one transaction:
    on any error nothing is imported. Raises ConfigError (file, field, problem).
    """
    kind = detect_kind(path)
    report = ImportReport(path=str(path), kind=kind)
    if node_name is not None:
        node_name = node_name.strip()
        if not node_name or len(node_name) > _MAX_NODE_NAME:
            raise ConfigError(path, "--node", f"{node_name!r}: a node name has 1 to {_MAX_NODE_NAME} characters")

    if kind == KIND_TOML:
        config = parse_mock_accelerator_toml(path)
        report.warnings.extend(config.warnings)
        report.slot_names = [config.slot_name]
        with transaction.atomic():
            slot_formats_apply(config, report)
            fractional_settings_ensure(config.slot_name, report)
            if node_name is not None:
                node_inventory_import(config, node_name, report)
        return report

    specs = parse_etcd_json(path, warnings=report.warnings)
    report.slot_names = [spec.slot_name for spec in specs]
    if node_name is not None:
        report.warnings.append(f"{path}: --node {node_name}: ignored (fractional settings declare no devices)")
    with transaction.atomic():
        for spec in specs:
            fractional_settings_apply(spec, report)
    return report


MAX_UPLOAD_BYTES = 1 << 20  # 1 MiB: Backend.AI's largest sample configurations are a few KiB
_UPLOAD_NAME = re.compile(r"[^A-Za-z0-9._-]+")


class _CheckOnly(Exception):
    """Raised inside the import's transaction to roll it back (a check that imports nothing)."""


def import_accelerator_config_upload(
    *, name: str, data: bytes, node_name: str | None = None, check_only: bool = False
) -> ImportReport:
    """`import_accelerator_config` for a file uploaded through the admin: `name` is the uploaded
    file's name (its extension picks the format as on the command line; shown in the report and
    in errors instead of a temporary path), `data` its bytes (at most MAX_UPLOAD_BYTES).

    The import runs in one transaction: on any ConfigError nothing is written. `check_only`
    runs the very same import and rolls it back, so the report (counts and warnings) says what
    an import would do and nothing is written. Raises ConfigError (file, field, problem)."""
    shown = _UPLOAD_NAME.sub("_", os.path.basename(name or "")).strip("._") or "upload"
    if len(data) > MAX_UPLOAD_BYTES:
        raise ConfigError(shown, "", f"{len(data):,} bytes; at most {MAX_UPLOAD_BYTES:,} (1 MiB) are taken")
    if not data.strip():
        raise ConfigError(shown, "", "the file is empty")
    with tempfile.TemporaryDirectory(prefix="fgpu-import-") as folder:
        path = os.path.join(folder, shown)
        with open(path, "wb") as stream:
            stream.write(data)
        try:
            if not check_only:
                return report_shown_as(import_accelerator_config(path, node_name=node_name), folder)
            with transaction.atomic():
                report = import_accelerator_config(path, node_name=node_name)
                raise _CheckOnly
        except _CheckOnly:
            return report_shown_as(report, folder)
        except ConfigError as exc:
            raise ConfigError(exc.path.replace(folder + os.sep, ""), exc.field, exc.problem) from None
