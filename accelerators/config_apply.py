"""The database writes of an accelerator configuration import (`accelerators.config_import`), each
recording what it did in the ImportReport: slot formats, fractional settings, a node's device
inventory and links. The caller holds the transaction."""

from __future__ import annotations

from accelerators.config_parse import (
    DEFAULT_ALLOCATION_MODE,
    DEFAULT_QUANTUM_SIZE,
    DEFAULT_UNIT_MEM,
    DEFAULT_UNIT_PROC,
    MOCK_PLUGIN_NAME,
    FractionalSpec,
    MockAcceleratorConfig,
)
from accelerators.config_report import ImportReport


def slot_formats_apply(config: MockAcceleratorConfig, report: ImportReport) -> None:
    from accelerators.models import SlotFormat

    for subtype, spec in config.formats.items():
        values = {
            "display_unit": spec.display_unit,
            "display_icon": spec.display_icon,
            "human_readable_name": spec.human_readable_name,
            "description": spec.description,
            "number_binary": spec.number_binary,
            "number_round_length": spec.number_round_length,
        }
        key = f"{config.slot_name}.{subtype}"
        row = SlotFormat.objects.select_for_update().filter(slot_name=config.slot_name, subtype=subtype).first()
        if row is None:
            SlotFormat.objects.create(slot_name=config.slot_name, subtype=subtype, **values)
            report.slot_formats_created.append(key)
            continue
        changed = [name for name, value in values.items() if getattr(row, name) != value]
        if not changed:
            report.slot_formats_unchanged.append(key)
            continue
        for name in changed:
            setattr(row, name, values[name])
        row.save(update_fields=changed)
        report.slot_formats_updated.append(key)


def fractional_settings_ensure(slot_name: str, report: ImportReport) -> None:
    from accelerators.models import FractionalSettings

    _, created = FractionalSettings.objects.get_or_create(
        slot_name=slot_name,
        defaults={
            "allocation_mode": DEFAULT_ALLOCATION_MODE,
            "unit_mem": DEFAULT_UNIT_MEM,
            "unit_proc": DEFAULT_UNIT_PROC,
            "quantum_size": DEFAULT_QUANTUM_SIZE,
        },
    )
    (report.fractional_settings_created if created else report.fractional_settings_unchanged).append(slot_name)


def fractional_settings_apply(spec: FractionalSpec, report: ImportReport) -> None:
    from accelerators.models import FractionalSettings

    values = {
        "allocation_mode": spec.allocation_mode,
        "unit_mem": spec.unit_mem,
        "unit_proc": spec.unit_proc,
        "quantum_size": spec.quantum_size,
    }
    row = FractionalSettings.objects.select_for_update().filter(slot_name=spec.slot_name).first()
    if row is None:
        FractionalSettings.objects.create(slot_name=spec.slot_name, **values)
        report.fractional_settings_created.append(spec.slot_name)
        return
    changed = [name for name, value in values.items() if getattr(row, name) != value]
    if not changed:
        report.fractional_settings_unchanged.append(spec.slot_name)
        return
    for name in changed:
        setattr(row, name, values[name])
    row.save(update_fields=[*changed, "updated_at"])
    report.fractional_settings_updated.append(spec.slot_name)


def node_inventory_import(config: MockAcceleratorConfig, node_name: str, report: ImportReport) -> None:
    from accelerators.services import node_inventory_apply, node_links_apply

    node = node_inventory_apply(
        node_name=node_name,
        devices=list(config.devices),
        plugins=[MOCK_PLUGIN_NAME],
        attributes=dict(config.attributes),
    )
    node_links_apply(node=node, links=[link.as_dict() for link in config.links])
    report.node_name = node_name
    report.device_count = len(config.devices)
    report.mig_device_count = sum(1 for device in config.devices if device.is_mig_device)
    report.link_count = len(config.links)
