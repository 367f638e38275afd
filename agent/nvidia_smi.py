"""The virtual `nvidia-smi` a session finds on its PATH: the granted slice, in nvidia-smi's words.

The agent writes the session's allocation to a JSON file and names it in `FGPU_ALLOCATION`
(all sizes in bytes):

    {"session_id": "…", "session_name": "demo", "node": "demo-node", "mock": true,
     "driver_version": "550.54.15", "cuda_version": "12.4",
     "devices": [{"index": 0, "uuid": "GPU-…", "model_name": "CUDA GPU",
                  "memory_limit": 2147483648, "memory_total": 8589934592,
                  "shares": "0.50", "procs": "20.000", "subproc_count": 80,
                  "sm_limit_percent": 25, "is_mig_device": false, "mig_profile": "",
                  "pci_bus_id": ""}]}

`main()` prints, for the granted devices only, numbered 0..n-1 in the order of `devices` (the
order of CUDA_VISIBLE_DEVICES, which CUDA renumbers the same way):

- no option: nvidia-smi's summary table in the 89-column layout of drivers 535 and later
  (date line, header box, GPU box, Processes box; widths copied from nvidia-smi 550.54.15),
  with the memory total = the session's `memory_limit` in MiB, then one line per device
  saying which slice it is ("fGPU Console: GPU 0 is a 0.50 fGPU slice of …");
- `-L` / `--list-gpus`: "GPU 0: CUDA GPU (UUID: GPU-…)";
- `--query-gpu=FIELD,… --format=csv[,noheader][,nounits]`: nvidia-smi's CSV ("memory.total
  [MiB]" headers, "2048 MiB" values, ", " between fields, "[N/A]" for what is unknown);
- `-h` / `--help`.

Figures: in mock mode (`"mock": true`) usage is 0 MiB and 0 %, and what only a real GPU can
report (temperature, power, fan, bus id …) is N/A. In real mode NVML (pynvml) is asked, per
device by UUID: memory used = the sum of `usedGpuMemory` of the compute processes that belong
to this session (same session id, `os.getsid`, as this process), never shown above the limit;
utilisation, temperature, power and performance state of the device; the session's processes
in the Processes box. If NVML fails the table still prints, with N/A usage, and a warning
goes to stderr (exit status 0).

Exit status: 0 done; 2 bad arguments; 9 no allocation (`FGPU_ALLOCATION` unset, file missing
or unreadable) — 9 is real nvidia-smi's status when it cannot talk to the driver.

This module must not import Django: `install()` writes a script that runs it in any shell.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, TextIO

EXIT_OK = 0
EXIT_BAD_ARGUMENTS = 2
EXIT_NO_ALLOCATION = 9  # nvidia-smi: "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"

MiB = 1024 * 1024
_NVML_NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId of a process outside MIG
_NVML_PSTATE_UNKNOWN = 32
_NVML_TEMPERATURE_GPU = 0
_NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
_NVML_VOLATILE_ECC = 0
_COMPUTE_MODES = {0: "Default", 1: "E. Thread", 2: "Prohibited", 3: "E. Process"}

USAGE = """\
NVIDIA System Management Interface -- fGPU Console session edition.

Shows the GPU slice granted to this session: devices numbered as the session's CUDA sees
them, memory totals equal to the session's memory limit.

nvidia-smi [OPTION1 [ARG1]] [OPTION2 [ARG2]] ...

    -h,   --help                Print usage information and exit.

  LIST OPTIONS:

    -L,   --list-gpus           Display a list of GPUs granted to this session.

  SUMMARY OPTIONS (no option):

    The summary table of the granted devices, then one line per device describing the slice.

  SELECTIVE QUERY OPTIONS:

          --query-gpu           Information about GPU.
                                Pass comma separated list of properties you want to query.
                                e.g. --query-gpu=index,name,memory.total,memory.used
                                Properties: {fields}
          --format=             Comma separated list of format options:
                                  csv - comma separated values (MANDATORY)
                                  noheader - skip the first line with column headers
                                  nounits - don't print units for numerical values

The allocation is read from the JSON file named by FGPU_ALLOCATION.
"""


class AllocationError(Exception):
    """The allocation file is missing or does not have the shape the agent writes."""


@dataclass(frozen=True)
class GrantedDevice:
    """One device of the allocation. Sizes in bytes; `shares` the fGPU amount as written
    ("0.50"); `procs` SMs granted (Decimal text, "20.000"); `sm_limit_percent` percent."""

    uuid: str
    model_name: str
    memory_limit: int
    memory_total: int
    shares: str = ""
    procs: Decimal = Decimal(0)
    subproc_count: int = 0
    sm_limit_percent: int = 0
    is_mig_device: bool = False
    mig_profile: str = ""
    pci_bus_id: str = ""
    node_index: int = 0


@dataclass(frozen=True)
class Allocation:
    """The session's allocation file, parsed."""

    session_id: str
    session_name: str
    node: str
    mock: bool
    driver_version: str
    cuda_version: str
    devices: list[GrantedDevice]


@dataclass
class ProcessRow:
    """One row of the Processes box. `used_memory` in bytes (None: NVML could not tell)."""

    pid: int
    name: str
    used_memory: int | None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass
class DeviceStatus:
    """What the table shows for one device; None means N/A. Memory in bytes, power in mW."""

    memory_used: int | None = None
    utilization: int | None = None
    temperature: int | None = None
    power_usage_mw: int | None = None
    power_limit_mw: int | None = None
    perf_state: int | None = None
    fan_speed: int | None = None
    persistence_mode: bool | None = None
    display_active: bool | None = None
    ecc_uncorrected: int | None = None
    compute_mode: int | None = None
    mig_mode: bool | None = None
    bus_id: str = ""
    processes: list[ProcessRow] = field(default_factory=list)


# --- entry points ------------------------------------------------------------------------


def main(argv: list[str] | None = None, *, environ: Mapping[str, str] | None = None, nvml: Any = None) -> int:
    """Run `nvidia-smi [argv]` for the session whose allocation `environ["FGPU_ALLOCATION"]`
    names (default: os.environ). `nvml`: the pynvml module (default, imported only in real
    mode) or a fake. Writes to stdout/stderr; returns the exit status (0, 2 or 9).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    environ = os.environ if environ is None else environ
    out, err = sys.stdout, sys.stderr
    command = _parse_arguments(argv)
    if isinstance(command, str):
        print(command, file=err)
        print("Please run 'nvidia-smi -h' for help.", file=err)
        return EXIT_BAD_ARGUMENTS
    if command.help:
        out.write(USAGE.format(fields=", ".join(_QUERY_FIELDS)))
        return EXIT_OK

    path = environ.get("FGPU_ALLOCATION", "")
    if not path:
        print(
            "NVIDIA-SMI has failed because no fGPU allocation was found: FGPU_ALLOCATION is not set. "
            "Run nvidia-smi inside an fGPU Console session.",
            file=err,
        )
        return EXIT_NO_ALLOCATION
    try:
        allocation = read_allocation(Path(path))
    except AllocationError as error:
        print(f"NVIDIA-SMI has failed because the fGPU allocation could not be read: {error}", file=err)
        return EXIT_NO_ALLOCATION

    if command.list_gpus:
        out.write(render_list(allocation))
        return EXIT_OK
    statuses = collect_status(allocation, nvml=nvml, warn=err)
    if command.query_fields:
        out.write(render_csv(allocation, statuses, command.query_fields, header=command.header, units=command.units))
    else:
        out.write(render_table(allocation, statuses, now=time.localtime()))
    return EXIT_OK


def install(bin_dir: Path) -> Path:
    """Write an executable `nvidia-smi` into `bin_dir` (created if need be); return its path.

    The script's shebang is this interpreter (`sys.executable`); it puts the project root (the
    directory holding the `agent` package) first on sys.path and calls `main()`, so it runs
    from any working directory without PYTHONPATH, and imports no Django.
    """
    bin_dir = Path(bin_dir)
    bin_dir.mkdir(parents=True, exist_ok=True)
    project_root = Path(__file__).resolve().parents[1]
    script = bin_dir / "nvidia-smi"
    script.write_text(
        f"#!{sys.executable}\n"
        "# fGPU Console's virtual nvidia-smi, written by agent.nvidia_smi.install().\n"
        "import sys\n"
        f"sys.path.insert(0, {str(project_root)!r})\n"
        "from agent.nvidia_smi import main\n"
        "sys.exit(main())\n"
    )
    script.chmod(0o755)
    return script


def install_portable(bin_dir: Path) -> Path:
    """Write an `nvidia-smi` for another machine's or a container's own `python3` into `bin_dir`:
    a copy of this module (it imports only the standard library, and pynvml where the session
    has it) beside a launcher that finds it next to itself. Returns the launcher's path."""
    bin_dir = Path(bin_dir)
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "fgpu_nvidia_smi.py").write_text(Path(__file__).read_text())
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/usr/bin/env python3\n"
        "# fGPU Console's virtual nvidia-smi, written by agent.nvidia_smi.install_portable().\n"
        "import os, sys\n"
        "sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))\n"
        "from fgpu_nvidia_smi import main\n"
        "sys.exit(main())\n"
    )
    script.chmod(0o755)
    return script


# --- the allocation file -----------------------------------------------------------------


def read_allocation(path: Path) -> Allocation:
    """Parse the agent's allocation JSON (shape in the module docstring). Raises AllocationError."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise AllocationError(f"{path} does not exist") from None
    except OSError as error:
        raise AllocationError(f"{path}: {error.strerror or error}") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise AllocationError(f"{path} is not JSON: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list):
        raise AllocationError(f"{path} has no 'devices' list")
    devices = [_granted_device(raw, position, path) for position, raw in enumerate(data["devices"])]
    return Allocation(
        session_id=str(data.get("session_id", "")),
        session_name=str(data.get("session_name", "")),
        node=str(data.get("node", "")),
        mock=bool(data.get("mock", False)),
        driver_version=str(data.get("driver_version") or "N/A"),
        cuda_version=str(data.get("cuda_version") or "N/A"),
        devices=devices,
    )


def _granted_device(raw: Any, position: int, path: Path) -> GrantedDevice:
    where = f"{path}: devices[{position}]"
    if not isinstance(raw, dict):
        raise AllocationError(f"{where} is not an object")
    try:
        uuid = raw["uuid"]
        memory_limit = raw["memory_limit"]
    except KeyError as missing:
        raise AllocationError(f"{where} has no {missing.args[0]!r}") from None
    integers = {}
    for key in ("memory_limit", "memory_total", "subproc_count", "sm_limit_percent", "index"):
        value = raw.get(key, memory_limit if key == "memory_total" else 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise AllocationError(f"{where}.{key} = {value!r} is not a whole non-negative number")
        integers[key] = value
    try:
        procs = Decimal(str(raw.get("procs", "0")))
    except InvalidOperation:
        raise AllocationError(f"{where}.procs = {raw.get('procs')!r} is not a number") from None
    return GrantedDevice(
        uuid=str(uuid),
        model_name=str(raw.get("model_name") or "CUDA GPU"),
        memory_limit=integers["memory_limit"],
        memory_total=integers["memory_total"],
        shares=str(raw.get("shares", "")),
        procs=procs,
        subproc_count=integers["subproc_count"],
        sm_limit_percent=integers["sm_limit_percent"],
        is_mig_device=bool(raw.get("is_mig_device", False)),
        mig_profile=str(raw.get("mig_profile") or ""),
        pci_bus_id=str(raw.get("pci_bus_id") or ""),
        node_index=integers["index"],
    )


# --- figures -----------------------------------------------------------------------------


def collect_status(allocation: Allocation, *, nvml: Any = None, warn: TextIO | None = None) -> list[DeviceStatus]:
    """One DeviceStatus per granted device, in allocation order.

    Mock mode: 0 bytes used, 0 % utilisation, the rest N/A. Real mode: from NVML (see the
    module docstring); where NVML fails, that device's figures are N/A and a warning line
    goes to `warn` (stderr by default).
    """
    warn = sys.stderr if warn is None else warn
    if allocation.mock:
        return [
            DeviceStatus(memory_used=0, utilization=0, mig_mode=True if d.is_mig_device else None, bus_id=d.pci_bus_id)
            for d in allocation.devices
        ]
    fallback = [DeviceStatus(bus_id=d.pci_bus_id, mig_mode=True if d.is_mig_device else None) for d in allocation.devices]
    if nvml is None:
        try:
            import pynvml
        except ImportError as error:
            print(f"fGPU Console: NVML is not available ({error}); usage is shown as N/A.", file=warn)
            return fallback
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        print(f"fGPU Console: NVML could not be initialised ({error}); usage is shown as N/A.", file=warn)
        return fallback
    try:
        statuses = []
        own_session = os.getsid(0)
        for device, empty in zip(allocation.devices, fallback):
            try:
                statuses.append(_device_status(nvml, device, own_session))
            except nvml.NVMLError as error:
                print(f"fGPU Console: NVML could not read {device.uuid} ({error}); its usage is shown as N/A.", file=warn)
                statuses.append(empty)
        return statuses
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass  # the figures are already read; a failed shutdown changes nothing for the user


def _device_status(nvml: Any, device: GrantedDevice, own_session: int) -> DeviceStatus:
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(device.uuid)
    except TypeError:  # pynvml before nvidia-ml-py 11.515 wants bytes
        handle = nvml.nvmlDeviceGetHandleByUUID(device.uuid.encode())
    # A MIG device handle answers memory and processes; the board's telemetry (temperature,
    # power, fan …) is read from its parent GPU, as nvidia-smi shows it for MIG.
    board = handle
    if device.is_mig_device:
        board = _try(nvml, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle) or handle
    processes = [
        _process_row(nvml, p, mig=device.is_mig_device)
        for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        if _session_of(p.pid) == own_session
    ]
    utilization = _try(nvml, "nvmlDeviceGetUtilizationRates", handle)
    pci = _try(nvml, "nvmlDeviceGetPciInfo", board)
    mig_mode = _try(nvml, "nvmlDeviceGetMigMode", board)
    persistence = _try(nvml, "nvmlDeviceGetPersistenceMode", board)
    display = _try(nvml, "nvmlDeviceGetDisplayActive", board)
    perf_state = _try(nvml, "nvmlDeviceGetPerformanceState", board)
    return DeviceStatus(
        memory_used=sum(p.used_memory or 0 for p in processes),
        utilization=None if utilization is None else int(utilization.gpu),
        temperature=_try(nvml, "nvmlDeviceGetTemperature", board, _NVML_TEMPERATURE_GPU),
        power_usage_mw=_try(nvml, "nvmlDeviceGetPowerUsage", board),
        power_limit_mw=_try(nvml, "nvmlDeviceGetEnforcedPowerLimit", board),
        perf_state=None if perf_state in (None, _NVML_PSTATE_UNKNOWN) else int(perf_state),
        fan_speed=_try(nvml, "nvmlDeviceGetFanSpeed", board),
        persistence_mode=None if persistence is None else bool(persistence),
        display_active=None if display is None else bool(display),
        ecc_uncorrected=_try(nvml, "nvmlDeviceGetTotalEccErrors", board, _NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _NVML_VOLATILE_ECC),
        compute_mode=_try(nvml, "nvmlDeviceGetComputeMode", handle),
        mig_mode=True if device.is_mig_device else (None if mig_mode is None else bool(mig_mode[0])),
        bus_id=_text(pci.busId) if pci is not None else device.pci_bus_id,
        processes=processes,
    )


def _process_row(nvml: Any, process: Any, *, mig: bool) -> ProcessRow:
    name = _try(nvml, "nvmlSystemGetProcessName", process.pid)
    if not name:
        try:
            name = Path(f"/proc/{process.pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            name = b""
    gi = getattr(process, "gpuInstanceId", _NVML_NO_INSTANCE)
    ci = getattr(process, "computeInstanceId", _NVML_NO_INSTANCE)
    return ProcessRow(
        pid=int(process.pid),
        name=_text(name) or "N/A",
        used_memory=process.usedGpuMemory,
        gpu_instance_id=gi if mig and gi != _NVML_NO_INSTANCE else None,
        compute_instance_id=ci if mig and ci != _NVML_NO_INSTANCE else None,
    )


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone, or in another PID namespace
        return None


def _try(nvml: Any, call: str, *args: Any) -> Any:
    """`nvml.<call>(*args)`, or None where NVML (or this binding) cannot answer."""
    function = getattr(nvml, call, None)
    if function is None:
        return None
    try:
        return function(*args)
    except nvml.NVMLError:
        return None


def _text(value: str | bytes) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").rstrip("\x00")
    return str(value)


# --- output ------------------------------------------------------------------------------

_TOP = "+" + "-" * 89 + "+"
_GPU_SEPARATOR = "+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+"
# Header rows copied from nvidia-smi 550.54.15.
_GPU_HEADER = [
    "|-----------------------------------------+------------------------+----------------------+",
    "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
    "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
    "|                                         |                        |               MIG M. |",
    "|=========================================+========================+======================|",
]
_PROCESS_HEADER = [
    "| Processes:                                                                              |",
    "|  GPU   GI   CI        PID   Type   Process name                              GPU Memory |",
    "|        ID   ID                                                               Usage      |",
    "|=========================================================================================|",
]
NA = "N/A"


def render_table(allocation: Allocation, statuses: list[DeviceStatus], *, now: time.struct_time) -> str:
    """nvidia-smi's summary table (89 columns inside the frame, as drivers 535+ print it),
    then the fGPU slice lines. Memory in MiB, total = the device's memory_limit."""
    lines = [time.asctime(now) + "       ", _TOP]
    lines.append(
        f"| NVIDIA-SMI {allocation.driver_version:<23}Driver Version: {allocation.driver_version:<15}"
        f"CUDA Version: {allocation.cuda_version:<9}|"
    )
    lines.extend(_GPU_HEADER)
    for number, (device, status) in enumerate(zip(allocation.devices, statuses)):
        lines.extend(_gpu_rows(number, device, status))
        lines.append(_GPU_SEPARATOR)
    lines.append(" " * 89)
    lines.append(_TOP)
    lines.extend(_PROCESS_HEADER)
    rows = [_process_line(number, p) for number, status in enumerate(statuses) for p in status.processes]
    lines.extend(rows or [f"|  {'No running processes found':<87}|"])
    lines.append(_TOP)
    lines.extend(slice_line(number, device) for number, device in enumerate(allocation.devices))
    return "\n".join(lines) + "\n"


def slice_line(number: int, device: GrantedDevice) -> str:
    """ "fGPU Console: GPU 0 is a 0.50 fGPU slice of CUDA GPU 8192MiB (2048MiB, 20 of 80 SMs = 25%)".

    Memory in MiB (whole device: `memory_total`; slice: `memory_limit`); SMs granted (`procs`)
    of the device's `subproc_count`; the compute cap in percent (0 or ≥100: none, shown 100%).
    """
    total, limit = device.memory_total // MiB, device.memory_limit // MiB
    procs = _plain(device.procs)
    percent = device.sm_limit_percent if 0 < device.sm_limit_percent < 100 else 100
    if device.is_mig_device:
        return (
            f"fGPU Console: GPU {number} is MIG device {device.mig_profile or NA} of {device.model_name} "
            f"{total}MiB ({limit}MiB, {procs} SMs)"
        )
    return (
        f"fGPU Console: GPU {number} is a {device.shares or NA} fGPU slice of {device.model_name} {total}MiB "
        f"({limit}MiB, {procs} of {device.subproc_count} SMs = {percent}%)"
    )


def render_list(allocation: Allocation) -> str:
    """`nvidia-smi -L`: "GPU 0: CUDA GPU (UUID: GPU-…)" per granted device; a MIG device is
    named as NVML names it ("NVIDIA A100-SXM4-80GB MIG 1g.10gb")."""
    lines = []
    for number, device in enumerate(allocation.devices):
        name = device.model_name
        if device.is_mig_device and device.mig_profile:
            name = f"{name} MIG {device.mig_profile}"
        lines.append(f"GPU {number}: {name} (UUID: {device.uuid})")
    return "".join(line + "\n" for line in lines)


def render_csv(allocation: Allocation, statuses: list[DeviceStatus], fields: list[str], *, header: bool, units: bool) -> str:
    """`--query-gpu=… --format=csv[,noheader][,nounits]` as nvidia-smi writes it: headers with
    their unit in brackets ("memory.total [MiB]", kept under nounits as nvidia-smi does),
    values joined by ", ", unit after a space ("2048 MiB"), "[N/A]" where unknown."""
    lines = []
    if header:
        lines.append(", ".join(_QUERY_FIELDS[f].header for f in fields))
    for number, (device, status) in enumerate(zip(allocation.devices, statuses)):
        cells = []
        for name in fields:
            spec = _QUERY_FIELDS[name]
            value = spec.value(number, device, status, allocation)
            if value is None:
                cells.append("[N/A]")
            else:
                cells.append(f"{value} {spec.unit}" if spec.unit and units else str(value))
        lines.append(", ".join(cells))
    return "".join(line + "\n" for line in lines)


def _gpu_rows(number: int, device: GrantedDevice, status: DeviceStatus) -> list[str]:
    name = device.model_name if len(device.model_name) <= 31 else device.model_name[:28] + "..."
    bus_id = status.bus_id or NA
    limit = device.memory_limit
    used = NA if status.memory_used is None else f"{min(status.memory_used, limit) // MiB}MiB"
    usage = NA if status.power_usage_mw is None else f"{status.power_usage_mw // 1000}W"
    cap = NA if status.power_limit_mw is None else f"{status.power_limit_mw // 1000}W"
    compute = NA if status.compute_mode is None else _COMPUTE_MODES.get(status.compute_mode, NA)
    if device.is_mig_device or status.mig_mode:
        mig = "Enabled"
    else:
        mig = NA if status.mig_mode is None else "Disabled"
    return [
        f"|{number:>4}  {name:<31}{_on_off(status.persistence_mode):<3} |"
        f"{bus_id:>19} {_on_off(status.display_active):>3} |"
        f"{_or_na(status.ecc_uncorrected):>21} |",
        f"|{_or_na(status.fan_speed, '%'):>4}   {_or_na(status.temperature, 'C'):>3}   "
        f"{NA if status.perf_state is None else f'P{status.perf_state}':>3}{usage:>16} / {cap:>5} |"
        f"{used:>11} / {f'{limit // MiB}MiB':>9} |"
        f"{_or_na(status.utilization, '%'):>8}{compute:>13} |",
        f"|{'':41}|{'':24}|{mig:>21} |",
    ]


def _process_line(number: int, process: ProcessRow) -> str:
    name = process.name if len(process.name) <= 38 else "..." + process.name[-35:]
    memory = NA if process.used_memory is None else f"{process.used_memory // MiB}MiB"
    return (
        f"|{number:>5}{_or_na(process.gpu_instance_id):>6}{_or_na(process.compute_instance_id):>5}"
        f"{process.pid:>10}{'C':>7}   {name:<38}{memory:>14} |"
    )


def _on_off(value: bool | None) -> str:
    return NA if value is None else ("On" if value else "Off")


def _or_na(value: int | None, unit: str = "") -> str:
    return NA if value is None else f"{value}{unit}"


def _plain(value: Decimal) -> str:
    """Decimal("20.000") → "20", Decimal("20.500") → "20.5"."""
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


# --- --query-gpu fields (names, headers and units as nvidia-smi --help-query-gpu) ----------


@dataclass(frozen=True)
class _Field:
    header: str
    unit: str
    value: Any  # (number, device, status, allocation) -> str | int | None


def _memory_used_mib(device: GrantedDevice, status: DeviceStatus) -> int | None:
    if status.memory_used is None:
        return None
    return min(status.memory_used, device.memory_limit) // MiB


def _watts(milliwatts: int | None) -> str | None:
    return None if milliwatts is None else f"{Decimal(milliwatts) / 1000:.2f}"


_QUERY_FIELDS: dict[str, _Field] = {
    "index": _Field("index", "", lambda n, d, s, a: n),
    "name": _Field("name", "", lambda n, d, s, a: d.model_name),
    "uuid": _Field("uuid", "", lambda n, d, s, a: d.uuid),
    "driver_version": _Field("driver_version", "", lambda n, d, s, a: a.driver_version),
    "count": _Field("count", "", lambda n, d, s, a: len(a.devices)),
    "pci.bus_id": _Field("pci.bus_id", "", lambda n, d, s, a: s.bus_id or None),
    "memory.total": _Field("memory.total [MiB]", "MiB", lambda n, d, s, a: d.memory_limit // MiB),
    "memory.used": _Field("memory.used [MiB]", "MiB", lambda n, d, s, a: _memory_used_mib(d, s)),
    "memory.free": _Field(
        "memory.free [MiB]",
        "MiB",
        lambda n, d, s, a: None if s.memory_used is None else d.memory_limit // MiB - _memory_used_mib(d, s),
    ),
    "utilization.gpu": _Field("utilization.gpu [%]", "%", lambda n, d, s, a: s.utilization),
    "temperature.gpu": _Field("temperature.gpu", "", lambda n, d, s, a: s.temperature),
    "power.draw": _Field("power.draw [W]", "W", lambda n, d, s, a: _watts(s.power_usage_mw)),
    "power.limit": _Field("power.limit [W]", "W", lambda n, d, s, a: _watts(s.power_limit_mw)),
    "pstate": _Field("pstate", "", lambda n, d, s, a: None if s.perf_state is None else f"P{s.perf_state}"),
    "compute_mode": _Field(
        "compute_mode", "", lambda n, d, s, a: None if s.compute_mode is None else _COMPUTE_MODES.get(s.compute_mode)
    ),
    "mig.mode.current": _Field(
        "mig.mode.current", "", lambda n, d, s, a: None if s.mig_mode is None else ("Enabled" if s.mig_mode else "Disabled")
    ),
}
_FIELD_ALIASES = {"gpu_name": "name", "gpu_uuid": "uuid", "gpu_bus_id": "pci.bus_id", "memory.limit": "memory.total"}


# --- arguments ---------------------------------------------------------------------------


@dataclass
class _Command:
    help: bool = False
    list_gpus: bool = False
    query_fields: list[str] = field(default_factory=list)
    header: bool = True
    units: bool = True


def _parse_arguments(argv: list[str]) -> _Command | str:
    """The options nvidia-smi users reach for; an error message (str) for anything else."""
    command = _Command()
    query: str | None = None
    format_spec: str | None = None
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            command.help = True
        elif arg in ("-L", "--list-gpus"):
            command.list_gpus = True
        elif arg.startswith("--query-gpu") or arg.startswith("--format"):
            option, has_value, value = arg.partition("=")
            if option not in ("--query-gpu", "--format"):
                return f'Invalid option "{arg}".'
            if not has_value:
                if not args:
                    return f'Option "{option}" needs a value.'
                value = args.pop(0)
            if option == "--query-gpu":
                query = value
            else:
                format_spec = value
        else:
            return f'Invalid combination of input arguments: "{arg}" is not supported here.'
    if command.help:
        return command
    if format_spec is not None:
        options = [o.strip() for o in format_spec.split(",") if o.strip()]
        unknown = [o for o in options if o not in ("csv", "noheader", "nounits")]
        if "csv" not in options or unknown:
            return f'"--format={format_spec}" is not valid: use csv, optionally with noheader and nounits.'
        command.header = "noheader" not in options
        command.units = "nounits" not in options
    if query is not None:
        if command.list_gpus:
            return "Invalid combination of input arguments: -L and --query-gpu."
        for raw in query.split(","):
            name = _FIELD_ALIASES.get(raw.strip(), raw.strip())
            if name not in _QUERY_FIELDS:
                return f'Field "{raw.strip()}" is not a valid field to query.'
            command.query_fields.append(name)
        if not command.query_fields:
            return "--query-gpu needs at least one field."
    elif format_spec is not None:
        return "--format is only valid with --query-gpu."
    return command
