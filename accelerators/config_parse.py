"""Parse accelerator configuration written for Backend.AI: pure, no Django (the agent reads the
mock-accelerator TOML through accelerators.plugins.mock). `accelerators.config_import` imports
what this reads (accelerators.config_apply writes it, accelerators.config_report says what it did).

Two formats, both read the way Backend.AI reads them:

- the **mock-accelerator TOML** of Backend.AI's `ai.backend.accelerator.mock` plugin
  (`configs/accelerator/*.toml` in lablup/backend.ai): `slot_name`, `device_plugin_name`,
  `devices = [...]`, `[attributes]`, `[formats.<subtype>]`;
- the **etcd-style JSON** of the fractional settings, which Backend.AI keeps in etcd under
  `config/plugins/accelerator/<slot>`: `{"config": {"plugins": {"accelerator": {"cuda":
  {"allocation_mode": "fractional", "unit_mem": 1073741824, "unit_proc": 10,
  "quantum_size": "0.25"}}}}}`.

Parsing (`parse_mock_accelerator_toml`, `parse_etcd_json`) reads one file and returns
dataclasses or raises `ConfigError` naming the file, the field and the problem.

Rules taken from Backend.AI (src/ai/backend/accelerator/mock/plugin.py):
`memory_size` is a BinarySize (binary whatever the suffix; a fraction needs a suffix);
`numa_node` ≥ 0, `subproc_count` ≥ 1; `is_mig_device` is required only for slot "cuda"; a
MIG slice's profile is the text after the first "-" of its `model_name`; formats are looked
up by subtype `device`, `shares` or `*-mig`; `unit_mem` defaults to 2 GiB (minimum 512 MiB),
`unit_proc` to 8 (minimum 2), `quantum_size` to 0.1, `allocation_mode` to discrete.

One extension of ours, which Backend.AI's mock plugin does not know: an optional top-level
`links` array declaring the links between the file's whole devices, in nvidia-smi topo's
terms (`accelerators.allocation.topology`):

    links = [
      { a = 0, b = 1, kind = "NVLINK", count = 4 },   # a, b: positions in `devices` …
      { a = "c59395cd-…", b = 2, kind = "PIX" },      # … or mother_uuids of whole GPUs
    ]

(a top-level key, so it goes before the first `[table]` header; `[[links]]` tables work
anywhere). `kind`: NVLINK, METAXLINK, NV<lanes> ("NV4", as nvidia-smi prints it), PIX, PXB,
PHB, NODE or SYS; `count`: lanes, NVLINK and METAXLINK only (default 1). Pairs not declared count as
SYS (NODE when both devices declare the same `numa_node`).
"""

from __future__ import annotations

import json
import tomllib
from collections import defaultdict
from dataclasses import dataclass, field
from decimal import ROUND_DOWN, Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from accelerators.allocation.topology import LANE_KINDS, SELF, Link, parse_link_kind
from protocol.units import SizeError, format_binary_size, parse_binary_size
from accelerators.plugins.base import DeviceInfo

MOCK_PLUGIN_NAME = "ai.backend.accelerator.mock"

MiB = 1 << 20
GiB = 1 << 30

# Backend.AI's defaults and minimums for the fractional settings (mock plugin: MIN_MEM_UNIT,
# MIN_SMP_UNIT, _unit_mem, _unit_proc, quantum_size).
DEFAULT_ALLOCATION_MODE = "discrete"
ALLOCATION_MODES = ("discrete", "fractional")
DEFAULT_UNIT_MEM = 2 * GiB
MIN_UNIT_MEM = 512 * MiB
DEFAULT_UNIT_PROC = 8
MIN_UNIT_PROC = 2
DEFAULT_QUANTUM_SIZE = Decimal("0.1")

# Limits of the columns the values land in (accelerators.models).
KIND_TOML = "mock-accelerator TOML"
KIND_JSON = "etcd JSON"

_MAX_BIGINT = (1 << 63) - 1
_MAX_POSITIVE_INT = (1 << 31) - 1
_QUANTUM_PLACES = 3  # FractionalSettings.quantum_size: decimal_places=3, max_digits=6
_QUANTUM_LIMIT = Decimal(1000)
_MAX_ROUND_LENGTH = 12  # more digits than this overflow Decimal's default precision in format_number
_MAX_SLOT_NAME = 32
_MAX_DEVICE_ID = 128
_MAX_MODEL_NAME = 128
_MAX_MIG_PROFILE = 32
_MAX_NODE_NAME = 128
_MAX_LINK_COUNT = 32767  # DeviceLink.count: PositiveSmallIntegerField

FORMAT_SUBTYPES = ("device", "shares", "*-mig")
CUDA_DEVICE_PLUGIN_NAMES = ("CUDADevice", "MockDevice")

_TOP_KEYS = ("slot_name", "device_plugin_name", "devices", "attributes", "formats")
_OPTIONAL_TOP_KEYS = ("links",)  # our extension: Backend.AI's mock plugin never reads it
_LINK_KEYS = ("a", "b", "kind", "count")
_DEVICE_KEYS = ("mother_uuid", "model_name", "numa_node", "subproc_count", "memory_size", "is_mig_device")
_MISSPELLED_MIG_KEY = "is_mig_devices"  # Backend.AI's docs spell it so; its code reads is_mig_device
_FORMAT_KEYS = ("display_unit", "display_icon", "human_readable_name", "description", "number_format")
_FORMAT_LENGTHS = {"display_unit": 32, "display_icon": 32, "human_readable_name": 64, "description": 255}
_NUMBER_FORMAT_KEYS = ("binary", "round_length")
_CUDA_ATTRIBUTE_DEFAULTS = {"nvidia_driver": "450.00.00", "cuda_runtime": "11.0"}
_FRACTIONAL_KEYS = ("allocation_mode", "unit_mem", "unit_proc", "quantum_size")
_IGNORED_FRACTIONAL_KEYS = ("device_mask", "reserved_memory")  # Backend.AI reads them; we do not


class ConfigError(ValueError):
    """A configuration file that cannot be imported. It carries the API's error fields
    (`detail`, `type` "invalid-config", `title`, `status` 400, `field_errors`), as
    common.errors.ApplicationError does, without importing the console: the agent parses
    mock-accelerator TOML too (accelerators.plugins.mock).

    `path` is the file as given, `field` the dotted place inside it (`devices[3].memory_size`,
    "" for the whole file), `problem` what is wrong. `str()` joins them:
    `mock.toml: devices[3].memory_size: '1.1': a fractional size needs a unit suffix (e.g. '1.5G')`.
    """

    type = "invalid-config"
    title = "Invalid accelerator configuration"
    status = 400

    def __init__(self, path: str | Path, field: str, problem: str) -> None:
        self.path = str(path)
        self.field = field
        self.problem = problem
        self.detail = ": ".join(part for part in (self.path, field, problem) if part)
        self.field_errors = {field: [problem]} if field else {}
        super().__init__(self.detail)

    def __str__(self) -> str:
        return self.detail


@dataclass(frozen=True)
class FormatSpec:
    """One `[formats.<subtype>]` table: how amounts of `<slot>.<subtype>` are displayed."""

    subtype: str
    display_unit: str
    display_icon: str
    human_readable_name: str
    description: str
    number_binary: bool
    number_round_length: int


@dataclass
class MockAcceleratorConfig:
    """A parsed mock-accelerator TOML. `devices` in file order (`index` = position);
    `formats` keyed by subtype (`device`, `shares`, `*-mig`); `warnings` are human sentences;
    `links` from the optional `links` table, between device ids, in file order."""

    slot_name: str
    device_plugin_name: str
    devices: list[DeviceInfo]
    attributes: dict[str, str]
    formats: dict[str, FormatSpec]
    warnings: list[str] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)


@dataclass(frozen=True)
class FractionalSpec:
    """One slot's fractional settings from the etcd JSON, Backend.AI defaults filled in.
    `unit_mem` in bytes, `unit_proc` in SMs, `quantum_size` in fGPU."""

    slot_name: str
    allocation_mode: str = DEFAULT_ALLOCATION_MODE
    unit_mem: int = DEFAULT_UNIT_MEM
    unit_proc: int = DEFAULT_UNIT_PROC
    quantum_size: Decimal = DEFAULT_QUANTUM_SIZE


# --------------------------------------------------------------------------- reading helpers


class _Reader:
    """Type checks that raise ConfigError naming the file and the field."""

    def __init__(self, path: str | Path) -> None:
        self.path = path

    def error(self, where: str, problem: str) -> ConfigError:
        return ConfigError(self.path, where, problem)

    def table(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.error(where, f"expected a table, got {_kind(value)}")
        return value

    def text(self, value: Any, where: str, *, max_length: int, allow_empty: bool = False) -> str:
        if not isinstance(value, str):
            raise self.error(where, f"expected text, got {_kind(value)} {value!r}")
        if not allow_empty and not value.strip():
            raise self.error(where, "must not be empty")
        if len(value) > max_length:
            raise self.error(where, f"{value[:40]!r}…: longer than {max_length} characters")
        return value

    def whole(self, value: Any, where: str, *, minimum: int, maximum: int = _MAX_POSITIVE_INT) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(where, f"expected a whole number, got {_kind(value)} {_show(value)}")
        if value < minimum:
            qualifier = "negative" if value < 0 else f"below the minimum {minimum}"
            raise self.error(where, f"{value} is {qualifier}")
        if value > maximum:
            raise self.error(where, f"{value} is above the maximum {maximum}")
        return value

    def boolean(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.error(where, f"expected true or false, got {_kind(value)} {_show(value)}")
        return value

    def unknown_keys(self, table: dict[str, Any], known: tuple[str, ...], where: str) -> None:
        extra = [key for key in table if key not in known]
        if extra:
            place = f"{where}.{extra[0]}" if where else extra[0]
            raise self.error(place, f"unknown key (expected one of: {', '.join(known)})")


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, (float, Decimal)):
        return "a decimal number"
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


def _show(value: Any) -> str:
    if isinstance(value, Decimal):
        return str(value)
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "…"


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _check_slot_name(reader: _Reader, value: Any, where: str) -> str:
    name = reader.text(value, where, max_length=_MAX_SLOT_NAME)
    if any(ch.isspace() or ch in ".:/" for ch in name):
        raise reader.error(where, f"{name!r}: a slot name has no spaces, dots, colons or slashes (e.g. 'cuda')")
    return name


# --------------------------------------------------------------------------- mock-accelerator TOML


def parse_mock_accelerator_toml(path: str | Path) -> MockAcceleratorConfig:
    """Read a Backend.AI mock-accelerator TOML file into a MockAcceleratorConfig.

    Devices: `memory_size` in bytes (Backend.AI BinarySize: `40G` = 40 × 2^30), `numa_node`
    ≥ 0, `subproc_count` ≥ 1 (SMs). `device_id` is `GPU-<mother_uuid>` for a whole GPU (kept
    as is when mother_uuid already starts with `GPU-`) and `MIG-<mother_uuid>/<n>` for the
    n-th MIG slice (from 0) of that mother; a MIG slice's `parent_device_id` is the whole GPU
    with the same mother_uuid when the file declares one, else "" (with a warning).

    Raises ConfigError for unreadable files, TOML syntax errors (with line and column),
    unknown keys, wrong types, negative or missing numbers, duplicate device ids, and (slot
    "cuda") a `device_plugin_name` other than CUDADevice / MockDevice. Oddities Backend.AI
    tolerates (`is_mig_devices`, a `[formats.devices]` table, missing format tables) become
    `warnings`.

    The optional `links` array (our extension, see the module text) becomes `links`: each
    end a position in `devices` or a whole GPU's mother_uuid, resolved to device ids. Raises
    ConfigError naming `links[i].<key>` for unknown keys, a missing a/b/kind, an unknown
    kind, a count on a PCIe kind, an end that names no whole device (or a MIG slice), a
    device linked to itself, and a pair declared twice.
    """
    reader = _Reader(path)
    warnings: list[str] = []
    raw = _load_toml(path)
    reader.unknown_keys(raw, (*_TOP_KEYS, *_OPTIONAL_TOP_KEYS), "")
    for key in _TOP_KEYS:
        if key not in raw:
            raise reader.error(key, "missing (Backend.AI requires it)")

    slot_name = _check_slot_name(reader, raw["slot_name"], "slot_name")
    device_plugin_name = reader.text(raw["device_plugin_name"], "device_plugin_name", max_length=64)
    if slot_name == "cuda" and device_plugin_name not in CUDA_DEVICE_PLUGIN_NAMES:
        raise reader.error(
            "device_plugin_name",
            f"{device_plugin_name!r}: for slot 'cuda' it must be one of {', '.join(CUDA_DEVICE_PLUGIN_NAMES)}",
        )

    devices = _parse_devices(reader, raw["devices"], slot_name=slot_name, warnings=warnings)
    attributes = _parse_attributes(reader, raw["attributes"], slot_name=slot_name, warnings=warnings)
    formats = _parse_formats(reader, raw["formats"], slot_name=slot_name, warnings=warnings)
    links = _parse_links(reader, raw["links"], devices=devices) if "links" in raw else []

    if any(device.is_mig_device for device in devices) and "*-mig" not in formats:
        warnings.append(
            f'{path}: the file declares MIG slices but no [formats."*-mig"] table: '
            f'they have no display format (Backend.AI looks up "*-mig" when a node has MIG slices)'
        )
    return MockAcceleratorConfig(
        slot_name=slot_name,
        device_plugin_name=device_plugin_name,
        devices=devices,
        attributes=attributes,
        formats=formats,
        warnings=warnings,
        links=links,
    )


def _load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as stream:
            return tomllib.load(stream)
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read the file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(path, "", "not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        # Python 3.11's message ends with "(at line L, column C)".
        raise ConfigError(path, "", f"invalid TOML: {exc}") from None


def _gpu_device_id(mother_uuid: str) -> str:
    return mother_uuid if mother_uuid.startswith("GPU-") else f"GPU-{mother_uuid}"


def _parse_devices(reader: _Reader, value: Any, *, slot_name: str, warnings: list[str]) -> list[DeviceInfo]:
    if not isinstance(value, list):
        raise reader.error("devices", f"expected an array of tables, got {_kind(value)}")
    if not value:
        warnings.append(f"{reader.path}: devices: the file declares no devices")

    parsed: list[dict[str, Any]] = []
    for position, entry in enumerate(value):
        where = f"devices[{position}]"
        entry = reader.table(entry, where)
        known = (*_DEVICE_KEYS, _MISSPELLED_MIG_KEY)
        reader.unknown_keys(entry, known, where)
        for key in ("mother_uuid", "model_name", "numa_node", "subproc_count", "memory_size"):
            if key not in entry:
                raise reader.error(_join(where, key), "missing")
        mother_uuid = reader.text(entry["mother_uuid"], f"{where}.mother_uuid", max_length=_MAX_DEVICE_ID - 12)
        model_name = reader.text(entry["model_name"], f"{where}.model_name", max_length=_MAX_MODEL_NAME)
        numa_node = reader.whole(entry["numa_node"], f"{where}.numa_node", minimum=0)
        subproc_count = reader.whole(entry["subproc_count"], f"{where}.subproc_count", minimum=1)
        memory_size = _parse_size(reader, entry["memory_size"], f"{where}.memory_size")

        if "is_mig_device" in entry and _MISSPELLED_MIG_KEY in entry:
            raise reader.error(f"{where}.{_MISSPELLED_MIG_KEY}", "give is_mig_device only (is_mig_devices is its misspelling)")
        mig_key = "is_mig_device"
        if _MISSPELLED_MIG_KEY in entry:
            mig_key = _MISSPELLED_MIG_KEY
            warnings.append(
                f"{reader.path}: {where}.{_MISSPELLED_MIG_KEY}: read as is_mig_device "
                f"(the Backend.AI docs' spelling; Backend.AI's code reads only is_mig_device)"
            )
        if mig_key in entry:
            is_mig = reader.boolean(entry[mig_key], f"{where}.{mig_key}")
        elif slot_name == "cuda":
            raise reader.error(f"{where}.is_mig_device", "missing (required for slot 'cuda')")
        else:
            is_mig = False
        if is_mig and slot_name != "cuda":
            warnings.append(
                f"{reader.path}: {where}.{mig_key}: ignored for slot {slot_name!r} "
                f"(Backend.AI knows MIG slices only for slot 'cuda'); imported as a whole device"
            )
            is_mig = False

        mig_profile = ""
        if is_mig:
            _, dash, mig_profile = model_name.partition("-")
            if not dash or not mig_profile.strip():
                raise reader.error(
                    f"{where}.model_name",
                    f"{model_name!r}: a MIG slice's model_name must be '<prefix>-<profile>', e.g. 'MIG-10g'",
                )
            if len(mig_profile) > _MAX_MIG_PROFILE:
                raise reader.error(f"{where}.model_name", f"MIG profile {mig_profile[:40]!r}… is longer than {_MAX_MIG_PROFILE}")
        parsed.append(
            {
                "position": position,
                "mother_uuid": mother_uuid,
                "model_name": model_name,
                "numa_node": numa_node,
                "subproc_count": subproc_count,
                "memory_size": memory_size,
                "is_mig_device": is_mig,
                "mig_profile": mig_profile,
            }
        )

    # Device ids, duplicates, parents.
    seen: dict[str, int] = {}
    mig_counts: dict[str, int] = defaultdict(int)
    for item in parsed:
        if item["is_mig_device"]:
            number = mig_counts[item["mother_uuid"]]
            mig_counts[item["mother_uuid"]] += 1
            item["device_id"] = f"MIG-{item['mother_uuid']}/{number}"
        else:
            item["device_id"] = _gpu_device_id(item["mother_uuid"])
        if item["device_id"] in seen:
            raise reader.error(
                f"devices[{item['position']}].mother_uuid",
                f"device id {item['device_id']!r} repeats devices[{seen[item['device_id']]}] "
                f"(two whole GPUs with the same mother_uuid)",
            )
        seen[item["device_id"]] = item["position"]

    gpus = {item["device_id"]: item for item in parsed if not item["is_mig_device"]}
    orphans: dict[str, list[int]] = defaultdict(list)
    mig_memory: dict[str, int] = defaultdict(int)
    for item in parsed:
        item["parent_device_id"] = ""
        if not item["is_mig_device"]:
            continue
        parent_id = _gpu_device_id(item["mother_uuid"])
        if parent_id in gpus:
            item["parent_device_id"] = parent_id
            mig_memory[parent_id] += item["memory_size"]
        else:
            orphans[item["mother_uuid"]].append(item["position"])
    for mother_uuid, positions in orphans.items():
        places = ", ".join(f"devices[{p}]" for p in positions)
        warnings.append(
            f"{reader.path}: {places}: MIG slices of mother_uuid {mother_uuid}: the parent GPU "
            f"{_gpu_device_id(mother_uuid)} is not declared; imported without a parent"
        )
    for parent_id, total in mig_memory.items():
        parent = gpus[parent_id]
        if total > parent["memory_size"]:
            warnings.append(
                f"{reader.path}: devices[{parent['position']}]: its MIG slices declare "
                f"{format_binary_size(total)}, more than the GPU's {format_binary_size(parent['memory_size'])}"
            )

    return [
        DeviceInfo(
            slot_name=slot_name,
            device_id=item["device_id"],
            index=item["position"],
            mother_uuid=item["mother_uuid"],
            model_name=item["model_name"],
            numa_node=item["numa_node"],
            subproc_count=item["subproc_count"],
            memory_size=item["memory_size"],
            is_mig_device=item["is_mig_device"],
            mig_profile=item["mig_profile"],
            parent_device_id=item["parent_device_id"],
        )
        for item in parsed
    ]


def _parse_links(reader: _Reader, value: Any, *, devices: list[DeviceInfo]) -> list[Link]:
    if not isinstance(value, list):
        raise reader.error("links", f"expected an array of tables, got {_kind(value)}")
    by_name: dict[str, DeviceInfo] = {}
    for device in devices:
        if not device.is_mig_device:
            by_name[device.mother_uuid] = device
            by_name[device.device_id] = device
    links: list[Link] = []
    seen: dict[frozenset[str], int] = {}
    for position, entry in enumerate(value):
        where = f"links[{position}]"
        entry = reader.table(entry, where)
        reader.unknown_keys(entry, _LINK_KEYS, where)
        for key in ("a", "b", "kind"):
            if key not in entry:
                raise reader.error(_join(where, key), "missing")
        a = _link_end(reader, entry["a"], f"{where}.a", devices=devices, by_name=by_name)
        b = _link_end(reader, entry["b"], f"{where}.b", devices=devices, by_name=by_name)
        if a == b:
            raise reader.error(f"{where}.b", f"the same device as {where}.a ({a}): a link joins two devices")
        text = reader.text(entry["kind"], f"{where}.kind", max_length=32)
        try:
            kind, lanes = parse_link_kind(text)
        except ValueError as exc:
            raise reader.error(f"{where}.kind", str(exc)) from None
        if kind == SELF:
            raise reader.error(f"{where}.kind", f"{text!r} marks a device with itself in nvidia-smi topo; not a link")
        count = lanes
        if "count" in entry:
            count = reader.whole(entry["count"], f"{where}.count", minimum=1, maximum=_MAX_LINK_COUNT)
            if kind not in LANE_KINDS:
                raise reader.error(
                    f"{where}.count", f"a {kind} link has no lanes (only {' and '.join(LANE_KINDS)} do); leave count out"
                )
            if any(ch.isdigit() for ch in text) and count != lanes:
                raise reader.error(f"{where}.count", f"{count} contradicts kind {text!r} ({lanes} lanes)")
        pair = frozenset((a, b))
        if pair in seen:
            raise reader.error(where, f"{a} and {b} are already linked by links[{seen[pair]}]")
        seen[pair] = position
        links.append(Link(a=a, b=b, kind=kind, count=count))
    return links


def _link_end(reader: _Reader, value: Any, where: str, *, devices: list[DeviceInfo], by_name: dict[str, DeviceInfo]) -> str:
    """One end of a link: a position in `devices` or a whole GPU's mother_uuid → its device id."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < len(devices):
            raise reader.error(where, f"no devices[{value}] (the file declares {len(devices)} devices)")
        device = devices[value]
        if device.is_mig_device:
            raise reader.error(where, f"devices[{value}] is a MIG slice; links join whole devices")
        return device.device_id
    if isinstance(value, str):
        named = by_name.get(value.strip())
        if named is None:
            raise reader.error(where, f"{_show(value)} is not the mother_uuid of a whole device in devices")
        return named.device_id
    raise reader.error(where, f"expected a position in devices or a mother_uuid, got {_kind(value)} {_show(value)}")


def _parse_size(reader: _Reader, value: Any, where: str) -> int:
    """Backend.AI BinarySize: an integer of bytes or text such as "40G"; binary suffixes."""
    if isinstance(value, (float, Decimal)):
        raise reader.error(where, f'{_show(value)}: give a size as text with a unit (e.g. "1.5G") or whole bytes')
    try:
        size = parse_binary_size(value)
    except SizeError as exc:
        raise reader.error(where, str(exc)) from None
    if size > _MAX_BIGINT:
        raise reader.error(where, f"{_show(value)} is too large")
    return size


def _parse_attributes(reader: _Reader, value: Any, *, slot_name: str, warnings: list[str]) -> dict[str, str]:
    table = reader.table(value, "attributes")
    attributes: dict[str, str] = {}
    for key, item in table.items():
        where = f"attributes.{key}"
        if key in _CUDA_ATTRIBUTE_DEFAULTS and slot_name == "cuda":
            attributes[key] = reader.text(item, where, max_length=64)
        elif isinstance(item, str):
            attributes[key] = item
        elif isinstance(item, (bool, int)):
            attributes[key] = str(item).lower() if isinstance(item, bool) else str(item)
        else:
            raise reader.error(where, f'expected text, got {_kind(item)} (quote it: "...")')
    if slot_name == "cuda":
        for key, default in _CUDA_ATTRIBUTE_DEFAULTS.items():
            if key not in attributes:
                attributes[key] = default
                warnings.append(f"{reader.path}: attributes.{key}: missing; using Backend.AI's default {default!r}")
    return attributes


def _parse_formats(reader: _Reader, value: Any, *, slot_name: str, warnings: list[str]) -> dict[str, FormatSpec]:
    table = reader.table(value, "formats")
    formats: dict[str, FormatSpec] = {}
    for name, raw in table.items():
        where = f"formats.{name}" if name.replace("_", "").replace("-", "").isalnum() else f'formats."{name}"'
        if name in FORMAT_SUBTYPES:
            formats[name] = _parse_format(reader, raw, where, subtype=name)
        elif name == "devices":
            if "device" in table:
                reader.table(raw, where)
                warnings.append(
                    f"{reader.path}: {where}: ignored: Backend.AI never reads a 'devices' table "
                    f"(it looks up 'device'), and this file also has [formats.device]"
                )
                continue
            formats["device"] = _parse_format(reader, raw, where, subtype="device")
            warnings.append(
                f"{reader.path}: {where}: imported as [formats.device]: Backend.AI never reads a "
                f"'devices' table (it looks up 'device'); rename the table to fix the file"
            )
        else:
            reader.table(raw, where)
            warnings.append(
                f"{reader.path}: {where}: ignored: Backend.AI reads only the format tables "
                f"{', '.join(repr(s) for s in FORMAT_SUBTYPES)}"
            )
    if "device" not in formats:
        warnings.append(
            f"{reader.path}: formats: no [formats.device] table: discrete mode has no display format for {slot_name}.device"
        )
    if "shares" not in formats:
        warnings.append(
            f"{reader.path}: formats: no [formats.shares] table: fractional mode has no display format for {slot_name}.shares"
        )
    return formats


def _parse_format(reader: _Reader, value: Any, where: str, *, subtype: str) -> FormatSpec:
    table = reader.table(value, where)
    reader.unknown_keys(table, _FORMAT_KEYS, where)
    for key in _FORMAT_KEYS:
        if key not in table:
            raise reader.error(f"{where}.{key}", "missing (Backend.AI requires it)")
    texts = {
        key: reader.text(table[key], f"{where}.{key}", max_length=length, allow_empty=key == "description")
        for key, length in _FORMAT_LENGTHS.items()
    }
    number_format = reader.table(table["number_format"], f"{where}.number_format")
    reader.unknown_keys(number_format, _NUMBER_FORMAT_KEYS, f"{where}.number_format")
    for key in _NUMBER_FORMAT_KEYS:
        if key not in number_format:
            raise reader.error(f"{where}.number_format.{key}", "missing (Backend.AI requires it)")
    binary = reader.boolean(number_format["binary"], f"{where}.number_format.binary")
    round_length = reader.whole(
        number_format["round_length"], f"{where}.number_format.round_length", minimum=0, maximum=_MAX_ROUND_LENGTH
    )
    return FormatSpec(
        subtype=subtype,
        display_unit=texts["display_unit"],
        display_icon=texts["display_icon"],
        human_readable_name=texts["human_readable_name"],
        description=texts["description"],
        number_binary=binary,
        number_round_length=round_length,
    )


# --------------------------------------------------------------------------- etcd JSON


def parse_etcd_json(path: str | Path, *, warnings: list[str] | None = None) -> list[FractionalSpec]:
    """Read the etcd-style JSON of fractional settings: one FractionalSpec per slot under
    `config.plugins.accelerator`, in file order, Backend.AI's defaults for absent keys.

    `allocation_mode`: "discrete" | "fractional". `unit_mem`: bytes, as an integer or a size
    text ("1G"), ≥ 512 MiB. `unit_proc`: SMs, an integer (or its text), ≥ 2. `quantum_size`:
    fGPU, text or a JSON number read as Decimal (never float), > 0, at most 3 decimals.
    Keys Backend.AI reads that this project does not (`device_mask`, `reserved_memory`) and
    non-accelerator branches of the document are skipped with a warning appended to
    `warnings` (when given). Raises ConfigError for syntax errors (with line and column),
    missing branches, unknown keys, wrong types and values out of range.
    """
    reader = _Reader(path)
    collected = warnings if warnings is not None else []
    try:
        with open(path, "rb") as stream:
            data = json.loads(stream.read().decode("utf-8"), parse_float=Decimal)
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read the file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(path, "", "not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(path, "", f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None

    node: Any = data
    where = ""
    for key in ("config", "plugins", "accelerator"):
        node = reader.table(node, where or "(document)")
        if key not in node:
            raise reader.error(_join(where, key), 'missing (expected {"config": {"plugins": {"accelerator": {...}}}})')
        for other in node:
            if other != key:
                collected.append(f"{path}: {_join(where, other)}: ignored (not accelerator settings)")
        node = node[key]
        where = _join(where, key)
    accelerator = reader.table(node, where)
    if not accelerator:
        raise reader.error(where, 'no slot settings (expected e.g. {"cuda": {"allocation_mode": "fractional"}})')

    specs = []
    for slot, settings in accelerator.items():
        slot_where = f"{where}.{slot}"
        slot_name = _check_slot_name(reader, slot, slot_where)
        settings = reader.table(settings, slot_where)
        for key in _IGNORED_FRACTIONAL_KEYS:
            if key in settings:
                collected.append(f"{path}: {slot_where}.{key}: ignored (Backend.AI reads it; fGPU Console does not)")
        reader.unknown_keys(settings, (*_FRACTIONAL_KEYS, *_IGNORED_FRACTIONAL_KEYS), slot_where)
        specs.append(_parse_fractional(reader, slot_name, settings, slot_where))
    return specs


def _parse_fractional(reader: _Reader, slot_name: str, settings: dict[str, Any], where: str) -> FractionalSpec:
    mode = settings.get("allocation_mode", DEFAULT_ALLOCATION_MODE)
    if mode not in ALLOCATION_MODES:
        raise reader.error(
            f"{where}.allocation_mode", f"{_show(mode)}: expected {' or '.join(repr(m) for m in ALLOCATION_MODES)}"
        )

    unit_mem = DEFAULT_UNIT_MEM
    if "unit_mem" in settings:
        unit_mem = _parse_size(reader, settings["unit_mem"], f"{where}.unit_mem")
        if unit_mem < MIN_UNIT_MEM:
            raise reader.error(
                f"{where}.unit_mem",
                f"{_show(settings['unit_mem'])} ({format_binary_size(unit_mem)}) is below the minimum "
                f"{format_binary_size(MIN_UNIT_MEM)} (Backend.AI: too small unit_mem)",
            )

    unit_proc = DEFAULT_UNIT_PROC
    if "unit_proc" in settings:
        raw = settings["unit_proc"]
        if isinstance(raw, str) and raw.strip().isdigit():
            raw = int(raw.strip())
        unit_proc = reader.whole(raw, f"{where}.unit_proc", minimum=MIN_UNIT_PROC)

    quantum = DEFAULT_QUANTUM_SIZE
    if "quantum_size" in settings:
        raw = settings["quantum_size"]
        field_name = f"{where}.quantum_size"
        if isinstance(raw, bool) or not isinstance(raw, (str, int, Decimal)):
            raise reader.error(field_name, f"expected a number, got {_kind(raw)}")
        try:
            quantum = Decimal(str(raw).strip())
        except InvalidOperation:
            raise reader.error(field_name, f"{_show(raw)} is not a number") from None
        if not quantum.is_finite() or quantum <= 0:
            raise reader.error(field_name, f"{_show(raw)}: must be greater than 0")
        if quantum != quantum.quantize(Decimal(1).scaleb(-_QUANTUM_PLACES), rounding=ROUND_DOWN):
            raise reader.error(field_name, f"{_show(raw)}: at most {_QUANTUM_PLACES} decimal places")
        if quantum >= _QUANTUM_LIMIT:
            raise reader.error(field_name, f"{_show(raw)}: must be below {_QUANTUM_LIMIT}")

    return FractionalSpec(slot_name=slot_name, allocation_mode=mode, unit_mem=unit_mem, unit_proc=unit_proc, quantum_size=quantum)


def detect_kind(path: str | Path) -> str:
    """KIND_TOML or KIND_JSON: by extension (.toml / .json), else by the first character
    (`{` → JSON). Raises ConfigError when the file cannot be read."""
    suffix = Path(path).suffix.lower()
    if suffix == ".toml":
        return KIND_TOML
    if suffix == ".json":
        return KIND_JSON
    try:
        with open(path, "rb") as stream:
            head = stream.read(4096).lstrip()
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read the file: {exc.strerror or exc}") from None
    return KIND_JSON if head.startswith(b"{") else KIND_TOML
