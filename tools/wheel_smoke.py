"""Package smoke test (``make wheel-smoke``, run by CI): solosave works as an installed wheel.

    .venv/bin/python tools/wheel_smoke.py [--keep]

1. builds the sdist, then the wheel *from the sdist* (``python -m build``, isolated as pip
   does it), so a file a build needs but the sdist lacks fails here; checks that both hold every
   module of ``src/solosave`` (and ``py.typed``) and that their version is ``solosave.__version__``;
2. creates a fresh virtual environment and installs ``torch==2.13.0`` (the pinned CPU wheel) and
   the wheel into it: not editable, not from ``src``;
3. in a directory outside the repository, with no ``PYTHONPATH``, checks that ``solosave`` is
   imported from that environment, then runs a 2-rank ``solosave train`` (create, then reuse
   saves of prepared metadata; ``--keep-last 1 --keep-every 4``) and ``solosave verify`` on its
   last checkpoint.

Exits non-zero with the failing step's output; prints each step's elapsed time. The work
directory (a temporary one) is removed unless ``--keep``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = "torch==2.13.0"  # as pinned in requirements-train.txt: the CPU wheel on this machine's disk
SMALL = ["--nproc", "2", "--no-progress", "--layers", "1", "--d-model", "64", "--heads", "2",
         "--vocab", "128", "--seq-len", "32", "--batch-size", "4"]
T0 = time.perf_counter()


class SmokeError(Exception):
    """A step failed; the message holds its output."""


def step(what: str) -> None:
    print(f"== {what} ({time.perf_counter() - T0:.1f} s)", flush=True)


def sh(cmd: list[str], cwd: str, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise SmokeError(f"{' '.join(cmd)} exited with {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def source_version() -> str:
    with open(os.path.join(ROOT, "src", "solosave", "__init__.py")) as f:
        m = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M)
    if m is None:
        raise SmokeError("no __version__ = \"...\" line in src/solosave/__init__.py")
    return m.group(1)


def package_files() -> set[str]:
    """Every module and data file of the package in the source tree, relative to ``src``."""
    src = os.path.join(ROOT, "src")
    found = glob.glob(os.path.join(src, "solosave", "**", "*.py"), recursive=True)
    return {os.path.relpath(p, src) for p in found} | {os.path.join("solosave", "py.typed")}


def check_artifacts(dist: str, version: str, want: set[str]) -> str:
    """Check that the sdist and the wheel hold ``want``; return the wheel's path."""
    sdists = glob.glob(os.path.join(dist, f"solosave-{version}.tar.gz"))
    wheels = glob.glob(os.path.join(dist, f"solosave-{version}-py3-none-any.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        raise SmokeError(f"expected one sdist and one wheel of version {version}, got {os.listdir(dist)}")
    with tarfile.open(sdists[0]) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = {os.path.join("src", f) for f in want} | {"pyproject.toml", "README.md", "LICENSE"}
    missing -= in_sdist
    with zipfile.ZipFile(wheels[0]) as whl:
        in_wheel = set(whl.namelist())
    missing |= {f"wheel:{f}" for f in want - in_wheel}
    if not any(n.endswith("entry_points.txt") for n in in_wheel):
        missing.add("wheel:entry_points.txt (the `solosave` command)")
    if missing:
        raise SmokeError(f"missing from the sdist / wheel: {sorted(missing)}")
    return wheels[0]


def run_job(venv: str, run_dir: str, version: str) -> None:
    """From ``run_dir`` (outside the repository): the installed package trains 2 ranks and verifies."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", PATH=os.path.join(venv, "bin") + os.pathsep + env.get("PATH", ""))
    py, cli = os.path.join(venv, "bin", "python"), os.path.join(venv, "bin", "solosave")
    where = sh([py, "-c", "import solosave; print(solosave.__file__)"], run_dir, env).strip()
    if not os.path.realpath(where).startswith(os.path.realpath(venv) + os.sep):
        raise SmokeError(f"solosave was imported from {where}, not from the fresh environment {venv}")
    if sh([cli, "--version"], run_dir, env).strip() != f"solosave {version}":
        raise SmokeError(f"`solosave --version` does not say {version}")
    step("2-rank job from the installed wheel")
    out = sh([cli, "train", *SMALL, "--steps", "6", "--save", "ckpt", "--save-interval", "2", "--async-save",
              "--use-persistent-ckpt-worker", "--ckpt-metadata", "prepared.metadata", "--ckpt-metadata-create",
              "--keep-last", "1", "--keep-every", "4", "--json-log", "log.jsonl"], run_dir, env, timeout=600)
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        modes = [r["mode"] for r in map(json.loads, f) if r["event"] == "save"]
    kept = sorted(n for n in os.listdir(os.path.join(run_dir, "ckpt")) if n.startswith("iter_"))
    if modes != ["create", "reuse", "reuse"] or kept != ["iter_0000004", "iter_0000006"]:
        raise SmokeError(f"save modes {modes}, checkpoints kept {kept}\n{out}")
    step("solosave verify")
    sh([cli, "verify", "ckpt/iter_0000006", "--prepared", "prepared.metadata"], run_dir, env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the work directory (its path is printed)")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="solosave-wheel-smoke-")
    try:
        version, want = source_version(), package_files()  # listed before the build starts
        step(f"build sdist, then the wheel from it (solosave {version}) into {work}/dist")
        sh([sys.executable, "-m", "build", "--outdir", os.path.join(work, "dist"), ROOT], work)
        wheel = check_artifacts(os.path.join(work, "dist"), version, want)
        step(f"fresh virtual environment: {TORCH} and {os.path.basename(wheel)}")
        venv = os.path.join(work, "venv")
        sh([sys.executable, "-m", "venv", venv], work)
        # --no-compile: byte-compiling all of torch at install took 36 s of 62 here; the job
        # compiles only what it imports
        sh([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q", "--no-compile", TORCH, wheel],
           work)
        os.makedirs(os.path.join(work, "run"))
        run_job(venv, os.path.join(work, "run"), version)
    except (SmokeError, subprocess.TimeoutExpired) as e:
        print(f"wheel smoke: FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wheel smoke: ok ({time.perf_counter() - T0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
