"""The virtual nvidia-smi a session finds on its PATH (agent/nvidia_smi.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from agent import nvidia_smi
from tests.fakes.fake_pynvml import GiB, MiB, FakeGpu, FakeMigDevice, FakeNvml, FakeProcess

PROJECT_ROOT = Path(__file__).resolve().parents[1]
GRANTED = "GPU-c59395cd-0d2b-4c33-9d7e-0f5c2a9b1a01"
OTHER = "GPU-c59395cd-0d2b-4c33-9d7e-0f5c2a9b1a02"
MIG = "MIG-11111111-2222-3333-4444-555555555555"


def device(uuid: str = GRANTED, **overrides) -> dict:
    entry = {
        "index": 0, "uuid": uuid, "model_name": "CUDA GPU",
        "memory_limit": 2 * GiB, "memory_total": 8 * GiB,
        "shares": "0.50", "procs": "20.000", "subproc_count": 80, "sm_limit_percent": 25,
        "is_mig_device": False, "mig_profile": "", "pci_bus_id": "",
    }
    return entry | overrides


def write_allocation(tmp_path: Path, devices: list[dict], *, mock: bool = True) -> Path:
    path = tmp_path / "allocation.json"
    path.write_text(json.dumps({
        "session_id": "5f0c7f4e-3a0c-4f57-9c61-0d1e2f3a4b5c", "session_name": "demo", "node": "demo-node",
        "mock": mock, "driver_version": "550.54.15", "cuda_version": "12.4", "devices": devices,
    }))
    return path


def run(capsys, argv: list[str], allocation: Path | None, nvml: FakeNvml | None = None) -> tuple[int, str, str]:
    environ = {} if allocation is None else {"FGPU_ALLOCATION": str(allocation)}
    code = nvidia_smi.main(argv, environ=environ, nvml=nvml)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def other_session_pid():
    """A live process in a session of its own (os.getsid differs from ours)."""
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                               stdin=subprocess.PIPE, start_new_session=True)
    assert os.getsid(process.pid) != os.getsid(0)
    yield process.pid
    process.stdin.close()
    process.wait(timeout=10)


# --- mock mode -----------------------------------------------------------------------------


def test_mock_table_shows_the_memory_limit_as_the_total_and_no_usage(tmp_path, capsys):
    code, out, err = run(capsys, [], write_allocation(tmp_path, [device()]))

    assert code == 0
    assert "|       0MiB /   2048MiB |" in out
    assert "|      0%" in out
    assert "8192MiB /" not in out
    assert "| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |" in out
    assert "No running processes found" in out
    assert err == ""


def test_every_line_of_the_table_is_as_wide_as_nvidia_smis_89_column_layout(tmp_path, capsys):
    _, out, _ = run(capsys, [], write_allocation(tmp_path, [device(), device(OTHER)]))

    framed = [line for line in out.splitlines() if line.startswith(("|", "+"))]
    assert len(framed) > 15
    assert {len(line) for line in framed} == {91}


def test_the_slice_is_stated_under_the_table(tmp_path, capsys):
    _, out, _ = run(capsys, [], write_allocation(tmp_path, [device()]))

    assert out.splitlines()[-1] == (
        "fGPU Console: GPU 0 is a 0.50 fGPU slice of CUDA GPU 8192MiB (2048MiB, 20 of 80 SMs = 25%)"
    )


def test_granted_devices_are_numbered_from_zero_as_cuda_visible_devices_renumbers_them(tmp_path, capsys):
    allocation = write_allocation(tmp_path, [device(GRANTED, index=3), device(OTHER, index=5, memory_limit=4 * GiB)])

    _, out, _ = run(capsys, [], allocation)

    gpu_rows = [line for line in out.splitlines() if line.startswith("|   ") and "CUDA GPU" in line]
    assert [row.split()[1] for row in gpu_rows] == ["0", "1"]
    assert "|   3  " not in out and "|   5  " not in out
    assert "0MiB /   4096MiB" in out


def test_list_gpus_names_each_granted_device_with_its_uuid(tmp_path, capsys):
    allocation = write_allocation(tmp_path, [device(GRANTED, index=2)])

    code, out, _ = run(capsys, ["-L"], allocation)

    assert code == 0
    assert out == f"GPU 0: CUDA GPU (UUID: {GRANTED})\n"


def test_list_gpus_names_a_mig_device_by_its_profile(tmp_path, capsys):
    allocation = write_allocation(tmp_path, [device(MIG, model_name="NVIDIA A100-SXM4-80GB", is_mig_device=True, mig_profile="1g.10gb")])

    _, out, _ = run(capsys, ["--list-gpus"], allocation)

    assert out == f"GPU 0: NVIDIA A100-SXM4-80GB MIG 1g.10gb (UUID: {MIG})\n"


def test_query_gpu_prints_nvidia_smis_csv(tmp_path, capsys):
    allocation = write_allocation(tmp_path, [device()])

    code, out, _ = run(capsys, [
        "--query-gpu=index,name,uuid,memory.total,memory.used,memory.free,utilization.gpu", "--format=csv",
    ], allocation)

    assert code == 0
    assert out.splitlines() == [
        "index, name, uuid, memory.total [MiB], memory.used [MiB], memory.free [MiB], utilization.gpu [%]",
        f"0, CUDA GPU, {GRANTED}, 2048 MiB, 0 MiB, 2048 MiB, 0 %",
    ]


def test_query_gpu_without_header_and_units(tmp_path, capsys):
    allocation = write_allocation(tmp_path, [device(), device(OTHER, memory_limit=3 * GiB)])

    _, out, _ = run(capsys, ["--query-gpu", "index,memory.total,memory.used", "--format", "csv,noheader,nounits"], allocation)

    assert out == "0, 2048, 0\n1, 3072, 0\n"


def test_query_gpu_marks_what_a_mock_device_cannot_know_as_not_available(tmp_path, capsys):
    _, out, _ = run(capsys, ["--query-gpu=temperature.gpu,power.draw", "--format=csv,noheader"],
                    write_allocation(tmp_path, [device()]))

    assert out == "[N/A], [N/A]\n"


def test_an_unknown_query_field_is_refused(tmp_path, capsys):
    code, out, err = run(capsys, ["--query-gpu=index,bogus", "--format=csv"], write_allocation(tmp_path, [device()]))

    assert code == 2
    assert out == ""
    assert 'Field "bogus" is not a valid field to query.' in err


def test_an_unknown_option_is_refused(tmp_path, capsys):
    code, _, err = run(capsys, ["--frobnicate"], write_allocation(tmp_path, [device()]))

    assert code == 2
    assert "nvidia-smi -h" in err


def test_help_works_without_an_allocation(capsys):
    code, out, _ = run(capsys, ["--help"], None)

    assert code == 0
    assert "--query-gpu" in out and "-L" in out


# --- no allocation -------------------------------------------------------------------------


def test_without_fgpu_allocation_it_fails_like_nvidia_smi_without_a_driver(capsys):
    code, out, err = run(capsys, [], None)

    assert code == 9
    assert out == ""
    assert err.startswith("NVIDIA-SMI has failed because")
    assert "FGPU_ALLOCATION" in err


def test_an_allocation_file_that_does_not_exist_exits_9(tmp_path, capsys):
    code, _, err = run(capsys, ["-L"], tmp_path / "missing.json")

    assert code == 9
    assert "NVIDIA-SMI has failed because" in err and "missing.json" in err


def test_an_allocation_file_that_is_not_json_exits_9(tmp_path, capsys):
    path = tmp_path / "allocation.json"
    path.write_text("{not json")

    code, _, err = run(capsys, [], path)

    assert code == 9
    assert "is not JSON" in err


def test_an_allocation_device_without_a_memory_limit_exits_9(tmp_path, capsys):
    entry = device()
    del entry["memory_limit"]

    code, _, err = run(capsys, [], write_allocation(tmp_path, [entry]))

    assert code == 9
    assert "memory_limit" in err


# --- real mode (NVML faked at the pynvml boundary) ----------------------------------------


def real_gpus(other_pid: int) -> list[FakeGpu]:
    return [
        FakeGpu(
            uuid=GRANTED, name="NVIDIA A100-SXM4-80GB", pci_bus_id="00000000:07:00.0",
            utilization=37, temperature=41, power_usage_mw=81_500, power_limit_mw=400_000, perf_state=0,
            processes=[
                FakeProcess(pid=os.getpid(), used_memory=512 * MiB, name="/usr/bin/python3"),
                FakeProcess(pid=other_pid, used_memory=3 * GiB, name="/opt/other/train"),
            ],
        ),
        FakeGpu(uuid=OTHER, pci_bus_id="00000000:0F:00.0",
                processes=[FakeProcess(pid=os.getpid(), used_memory=7 * GiB, name="/usr/bin/python3")]),
    ]


def test_real_mode_counts_only_the_memory_of_this_sessions_processes(tmp_path, capsys, other_session_pid):
    fake = FakeNvml(real_gpus(other_session_pid))
    allocation = write_allocation(tmp_path, [device(model_name="NVIDIA A100-SXM4-80GB")], mock=False)

    code, out, err = run(capsys, [], allocation, fake)

    assert code == 0, err
    assert "|     512MiB /   2048MiB |" in out
    assert f"{os.getpid():>10}      C   /usr/bin/python3" in out
    assert str(other_session_pid) not in out
    assert "/opt/other/train" not in out
    assert "|     37%      Default |" in out
    assert "| N/A   41C    P0             81W /  400W |" in out
    assert "00000000:07:00.0" in out and "00000000:0F:00.0" not in out
    assert not fake.initialized and fake.shutdown_count == 1


def test_real_mode_query_gpu_reports_the_sessions_usage_within_its_limit(tmp_path, capsys, other_session_pid):
    fake = FakeNvml(real_gpus(other_session_pid))
    allocation = write_allocation(tmp_path, [device()], mock=False)

    _, out, _ = run(capsys, ["--query-gpu=memory.total,memory.used,memory.free,utilization.gpu", "--format=csv,noheader"],
                    allocation, fake)

    assert out == "2048 MiB, 512 MiB, 1536 MiB, 37 %\n"


def test_real_mode_never_shows_more_memory_used_than_the_limit(tmp_path, capsys, other_session_pid):
    fake = FakeNvml(real_gpus(other_session_pid))
    allocation = write_allocation(tmp_path, [device(OTHER)], mock=False)  # our process holds 7 GiB there

    _, out, _ = run(capsys, [], allocation, fake)

    assert "|    2048MiB /   2048MiB |" in out


def test_real_mode_reads_a_mig_device_by_its_uuid_and_the_boards_telemetry_from_its_parent(tmp_path, capsys):
    gpu = FakeGpu(
        uuid=OTHER, mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE, temperature=52,
        mig_devices=[FakeMigDevice(
            uuid=MIG, memory_total=9728 * MiB, sm_count=14, gpu_slices=1, gpu_instance_id=9, compute_instance_id=0,
            processes=[FakeProcess(pid=os.getpid(), used_memory=100 * MiB, gpu_instance_id=9, compute_instance_id=0)],
        )],
    )
    allocation = write_allocation(tmp_path, [device(MIG, memory_limit=9728 * MiB, is_mig_device=True, mig_profile="1g.10gb")],
                                  mock=False)

    _, out, _ = run(capsys, [], allocation, FakeNvml([gpu]))

    assert "|     100MiB /   9728MiB |" in out
    assert "52C" in out
    assert f"|    0     9    0{os.getpid():>10}      C" in out
    assert "Enabled |" in out


def test_real_mode_works_with_an_older_pynvml_that_speaks_bytes(tmp_path, capsys, other_session_pid):
    fake = FakeNvml(real_gpus(other_session_pid), legacy_bytes=True)

    _, out, err = run(capsys, [], write_allocation(tmp_path, [device()], mock=False), fake)

    assert err == ""
    assert "|     512MiB /   2048MiB |" in out
    assert "/usr/bin/python3" in out


def test_real_mode_without_nvml_prints_the_table_with_usage_not_available_and_warns(tmp_path, capsys):
    fake = FakeNvml([FakeGpu(uuid=GRANTED)])
    fake.fail("nvmlInit", pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    code, out, err = run(capsys, [], write_allocation(tmp_path, [device()], mock=False), fake)

    assert code == 0
    assert "|        N/A /   2048MiB |" in out
    assert "Driver Not Loaded" in err
    assert out.splitlines()[-1].startswith("fGPU Console: GPU 0 is a 0.50 fGPU slice")


def test_real_mode_with_a_device_nvml_does_not_know_warns_about_that_device(tmp_path, capsys):
    fake = FakeNvml([FakeGpu(uuid=OTHER)])

    code, out, err = run(capsys, [], write_allocation(tmp_path, [device(GRANTED)], mock=False), fake)

    assert code == 0
    assert "N/A /   2048MiB" in out
    assert GRANTED in err and "Not Found" in err
    assert fake.shutdown_count == 1


# --- the installed script ----------------------------------------------------------------


def test_installed_script_runs_from_any_directory_with_a_minimal_environment(tmp_path):
    bin_dir = tmp_path / "session" / "bin"
    script = nvidia_smi.install(bin_dir)
    allocation = write_allocation(tmp_path, [device()])
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()

    result = subprocess.run(
        ["nvidia-smi"], cwd=elsewhere, capture_output=True, text=True, timeout=60,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "FGPU_ALLOCATION": str(allocation)},
    )

    assert script == bin_dir / "nvidia-smi"
    assert os.access(script, os.X_OK)
    assert script.read_text().startswith(f"#!{sys.executable}\n")
    assert result.returncode == 0, result.stderr
    assert "0MiB /   2048MiB" in result.stdout


def test_installed_script_without_an_allocation_exits_9(tmp_path):
    bin_dir = tmp_path / "bin"
    nvidia_smi.install(bin_dir)

    result = subprocess.run([str(bin_dir / "nvidia-smi")], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin"})

    assert result.returncode == 9
    assert "NVIDIA-SMI has failed because" in result.stderr


def test_the_virtual_nvidia_smi_does_not_import_django():
    code = (
        f"import sys; sys.path.insert(0, {str(PROJECT_ROOT)!r}); "
        "import agent.nvidia_smi; print(sorted(m for m in sys.modules if m.split('.')[0] == 'django'))"
    )

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin"})

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
