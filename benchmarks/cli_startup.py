"""`fgpu` on its own (issue 19.9): what `pip install` of the CLI alone pulls, and how fast
`fgpu --help` starts.

    python benchmarks/cli_startup.py [--repeat 20] [--json]

Copies fgpu_cli/ (its own pyproject.toml: the standard library and websockets) and the protocol/
it ships to a temporary directory, makes a fresh virtual environment there with this interpreter, `pip install`s the
copy into it through pip's configured indexes, and lists every distribution the environment then
holds (Django, numpy and scipy must be absent). Then it runs `fgpu --help` `--repeat` times
(after one warm-up run) and reports the median, minimum and maximum wall time, beside the same
for `python -c pass` in that environment (the interpreter's own start, which no CLI can beat)
and for `fgpu --help` from the console's full install (this interpreter's environment) when it
has one. Target (issue 19): under 200 ms. The temporary directory is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = ("django", "numpy", "scipy")


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kwargs)


def timed(argv: list[str], repeat: int) -> dict:
    """Wall milliseconds of `argv` run `repeat` times after one warm-up: median, min, max."""
    run(argv)
    spent = []
    for _ in range(repeat):
        began = time.perf_counter()
        run(argv)
        spent.append((time.perf_counter() - began) * 1000)
    return {"median_ms": round(statistics.median(spent), 1), "min_ms": round(min(spent), 1), "max_ms": round(max(spent), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="fgpu-cli-bench-") as tmp:
        source = Path(tmp) / "fgpu_cli"
        for package in ("fgpu_cli", "protocol"):  # its pyproject.toml ships ../protocol beside it
            shutil.copytree(
                ROOT / package, Path(tmp) / package, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
            )
        venv = Path(tmp) / "venv"
        run([sys.executable, "-m", "venv", str(venv)])
        began = time.perf_counter()
        run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(source)])
        install_s = time.perf_counter() - began
        listed = json.loads(
            run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"]).stdout
        )
        distributions = sorted(f"{d['name']}=={d['version']}" for d in listed)
        pulled = [d for d in distributions if d.split("==")[0].lower() in FORBIDDEN]
        help_text = run([str(venv / "bin" / "fgpu"), "--help"]).stdout
        result = {
            "distributions": distributions,
            "forbidden_pulled": pulled,
            "install_s": round(install_s, 1),
            "help_first_line": help_text.splitlines()[0] if help_text else "",
            "fgpu_help": timed([str(venv / "bin" / "fgpu"), "--help"], args.repeat),
            "python_pass": timed([str(venv / "bin" / "python"), "-c", "pass"], args.repeat),
        }
    full = Path(sys.executable).parent / "fgpu"
    if full.exists():
        result["fgpu_help_full_install"] = timed([str(full), "--help"], args.repeat)
    if args.json:
        print(json.dumps(result))
        return 0 if not pulled else 1
    print(f"pip install fgpu_cli/ in a fresh venv ({result['install_s']} s): {', '.join(distributions)}")
    print(f"  Django, numpy or scipy pulled: {', '.join(pulled) or 'none'}")
    print(f"times are the median (min, max) of {args.repeat} runs after one warm-up")
    for label, key in (
        ("fgpu --help, the CLI alone", "fgpu_help"),
        ("python -c pass, same venv", "python_pass"),
        ("fgpu --help, the console's full install", "fgpu_help_full_install"),
    ):
        if key in result:
            r = result[key]
            print(f"  {label:40} {r['median_ms']:>7.1f} ms ({r['min_ms']:.1f}, {r['max_ms']:.1f})")
    return 0 if not pulled else 1


if __name__ == "__main__":
    raise SystemExit(main())
