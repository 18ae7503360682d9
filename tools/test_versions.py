"""Run the test suite against the newest releases of the libraries posttrain relies on, or against its floors.

    python tools/test_versions.py newest [--venv DIR] [--extras dev,peft] [--no-test] [-- PYTEST ARGS...]
    python tools/test_versions.py floors [--venv DIR] [--extras dev,peft] [--no-test] [-- PYTEST ARGS...]

`newest` installs the newest release of every dependency the registry serves, ignoring pyproject.toml's upper
bounds, so that the next rename in transformers (or accelerate, peft, datasets, DeepSpeed, TRL) is found here before
users find it. When the suite passes, raise the bounds it prints. `floors` installs each tracked library at its
declared floor (`>=X` read as `==X`), so that the floors stay true.

Each run builds a fresh virtual environment (default /tmp/posttrain-<mode>), installs torch first (`--torch`, by
default the pin the README gives, so pip never pulls CUDA wheels on a CPU machine; torch itself is not moved), then
posttrain with the extras (default dev and peft), prints the versions pip chose as one JSON line, and runs
`python -m pytest -q tests` with the arguments after `--` (not with --no-test: CI's first phase builds its
environment at the floors this way, without peft, and runs its own checks in it). Exits with pytest's code.
"""

import argparse
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the libraries whose internals posttrain relies on: declared with a tested floor and an upper bound in pyproject.toml
TRACKED = ("transformers", "accelerate", "peft", "datasets", "deepspeed", "trl")
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$")


def requirements(extras: list[str]) -> list[str]:
    """posttrain's core requirements and those of `extras`, as pyproject.toml declares them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = list(project["dependencies"])
    for extra in extras:
        found += project["optional-dependencies"][extra]
    return found


def split(requirement: str) -> tuple[str, str, list[str]]:
    """'transformers>=4.56.2,<5.25' -> ('transformers', '', ['>=4.56.2', '<5.25'])."""
    name, extras, spec = _REQUIREMENT.match(requirement).groups()
    return name, extras or "", [part.strip() for part in spec.split(",") if part.strip()]


def unbounded(requirement: str) -> str:
    """The requirement without its upper bound (`<`, `<=`, and `==` read as `>=`): the newest release is allowed."""
    name, extras, parts = split(requirement)
    kept = [(">=" + part[2:]) if part.startswith("==") else part for part in parts if not part.startswith("<")]
    return name + extras + ",".join(kept)


def at_floor(requirement: str) -> str:
    """A tracked library pinned at its declared floor; any other requirement as declared."""
    name, extras, parts = split(requirement)
    floors = [part[2:] for part in parts if part.startswith(">=")]
    if name.lower() not in TRACKED or not floors:
        return requirement
    return f"{name}{extras}=={floors[0]}"


def upper_bound(version: str) -> str:
    """The bound that admits every patch release of this minor version: 5.24.0 -> <5.25."""
    major, minor = version.split(".")[:2]
    return f"<{major}.{int(minor) + 1}"


def run(*command: str) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def pip_check(python: str, mode: str) -> None:
    """`pip check`: every installed package's requirements met. At the newest releases, posttrain's own upper bounds
    are what is being tested past, so a complaint about them alone (posttrain's installed metadata) is expected."""
    out = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    problems = [line for line in out.stdout.splitlines()
                if line.strip() and not (mode == "newest" and line.startswith("posttrain "))]
    print(out.stdout, end="", flush=True)
    if out.returncode != 0 and (problems or mode != "newest"):
        raise SystemExit(f"pip check found requirements not met: {'; '.join(problems) or out.stderr.strip()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["newest", "floors"])
    ap.add_argument("--venv", help="where to build the environment (default /tmp/posttrain-MODE); made anew")
    ap.add_argument("--torch", default="torch==2.13.0", help="torch's requirement, installed first (default %(default)s)")
    ap.add_argument("--extras", default="dev,peft", help="posttrain's extras to install (default %(default)s)")
    ap.add_argument("--no-test", action="store_true", help="build the environment and print its versions only")
    ap.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest (default: the whole suite)")
    args = ap.parse_args()

    venv = Path(args.venv or f"/tmp/posttrain-{args.mode}")
    run(sys.executable, "-m", "venv", "--clear", str(venv))
    python = str(venv / "bin" / "python")
    run(python, "-m", "pip", "install", "-q", "--upgrade", "pip")
    run(python, "-m", "pip", "install", "-q", args.torch)
    extras = [extra for extra in args.extras.split(",") if extra]
    chosen = [unbounded(r) if args.mode == "newest" else at_floor(r) for r in requirements(extras)]
    # torch stays as installed above: its requirement is dropped here so that pip cannot move it
    chosen = [r for r in chosen if split(r)[0].lower() != "torch"]
    run(python, "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT))
    torch_version = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], check=True,
                                   capture_output=True, text=True).stdout.strip()
    pinned = venv / "torch-constraint.txt"  # every other package's newest release, torch as installed
    pinned.write_text(f"torch=={torch_version}\n")
    strategy = "eager" if args.mode == "newest" else "only-if-needed"
    run(python, "-m", "pip", "install", "-q", "--upgrade", "--upgrade-strategy", strategy, "-c", str(pinned), *chosen)
    pip_check(python, args.mode)
    versions = json.loads(subprocess.run(
        [python, "-m", "pip", "list", "--format", "json"], check=True, capture_output=True, text=True).stdout)
    installed = {v["name"].lower(): v["version"] for v in versions}
    print(json.dumps({"mode": args.mode, "python": sys.version.split()[0],
                      **{name: installed.get(name) for name in ("torch",) + TRACKED}}), flush=True)
    if args.no_test:
        return 0
    code = subprocess.run([python, "-m", "pytest", "-q", "tests", *args.pytest_args], cwd=ROOT).returncode
    if code == 0 and args.mode == "newest":
        print("All passed on the newest releases; the upper bounds they justify in pyproject.toml: "
              + ", ".join(f"{name}{upper_bound(installed[name])}" for name in TRACKED if name in installed))
    return code


if __name__ == "__main__":
    sys.exit(main())
