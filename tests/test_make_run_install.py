"""`make install`'s choice of installer (issue 35.4, the Makefile's `.venv/.installed`): uv where it
is on PATH and pip names no index, links or constraints of its own, pip where uv fails, where pip
has such settings (uv reads none of them) or where UV=no. The real Makefile runs in a copy of the
tree, its recipe's shell as it is, with a `uv` and a Python whose `-m venv` makes a `pip` that only
record how they were called: what each path installs is benchmarks/first_run.py's to measure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_UV = """#!/bin/sh
echo "uv $*" >> "$CALLS"
case "$1" in
  venv) mkdir -p .venv/bin ;;
  pip) [ "$FAKE_UV_FAILS" = yes ] && exit 1 ;;
esac
exit 0
"""
FAKE_PYTHON = """#!/bin/sh
case "$1 $2" in
  "-m venv") mkdir -p "$3/bin"; printf '#!/bin/sh\\necho "venv-pip $*" >> "$CALLS"\\n' > "$3/bin/pip"; chmod +x "$3/bin/pip";
    echo "python -m venv" >> "$CALLS"; exit 0 ;;
esac
exec {python} "$@"
"""


@pytest.fixture
def tree(tmp_path):
    """A copy of the Makefile and pyproject.toml, and a bin/ with the fake uv and Python."""
    work = tmp_path / "tree"
    work.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, work / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "uv").write_text(FAKE_UV)
    (bin_dir / "python").write_text(FAKE_PYTHON.format(python=sys.executable))
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return work


def make_install(
    tree: Path, *, pip_env: dict[str, str] | None = None, uv_fails: bool = False, make_args: tuple[str, ...] = ()
) -> list[str]:
    """Runs `make install` in `tree` with no pip configuration but `pip_env` (PIP_CONFIG_FILE=/dev/null:
    pip reads no file, not even this machine's /etc/pip.conf); returns the calls the fakes recorded
    and checks the stamp."""
    calls = tree.parent / "calls.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        PATH=f"{tree.parent / 'bin'}{os.pathsep}{env['PATH']}",
        PIP_CONFIG_FILE=os.devnull,
        CALLS=str(calls),
        FAKE_UV_FAILS="yes" if uv_fails else "no",
        **(pip_env or {}),
    )
    python = str(tree.parent / "bin" / "python")
    done = subprocess.run(
        ["make", "install", f"PYTHON={python}", *make_args], cwd=tree, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tree / ".venv" / ".installed").exists()
    return calls.read_text().splitlines()


def test_uv_installs_where_pip_names_no_index_of_its_own(tree):
    calls = make_install(tree)
    assert calls[0].startswith("uv venv --seed --allow-existing --python ") and calls[1] == "uv pip install -e ."
    assert len(calls) == 2  # pip never ran
    assert (tree / ".venv" / ".installer").read_text().strip() == str(tree.parent / "bin" / "uv")


def test_pip_installs_where_uv_fails(tree):
    calls = make_install(tree, uv_fails=True)
    assert calls[1] == "uv pip install -e ."
    assert calls[2:] == ["python -m venv", "venv-pip install --no-compile --progress-bar on -e ."]
    assert (tree / ".venv" / ".installer").read_text().strip() == "pip"


@pytest.mark.parametrize("setting", ["PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONSTRAINT"])
def test_pip_installs_where_pip_has_an_index_of_its_own(tree, setting):
    calls = make_install(tree, pip_env={setting: "/somewhere"})
    assert calls == ["python -m venv", "venv-pip install --no-compile --progress-bar on -e ."]


def test_uv_no_installs_with_pip(tree):
    calls = make_install(tree, make_args=("UV=no",))
    assert calls == ["python -m venv", "venv-pip install --no-compile --progress-bar on -e ."]
