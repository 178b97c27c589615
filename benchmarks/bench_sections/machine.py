"""What a run records about where it ran: the torch interpreter, the distgrad snapshot, the machine."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .common import BenchError, HERE, ROOT, TORCH_VENV_PYTHON, say
from .runner import Runner


def find_torch(option: str | None, env: dict[str, str]) -> tuple[str | None, str]:
    """An interpreter that can import torch, and a note saying which (or why none)."""
    if option == "none":
        return None, "skipped: --torch-python none"
    candidates = [option] if option else [sys.executable, os.environ.get("DISTGRAD_BENCH_TORCH_PYTHON"),
                                          str(TORCH_VENV_PYTHON)]
    for python in filter(None, candidates):
        if not Path(python).exists():
            continue
        try:
            r = subprocess.run([python, "-c", "import torch, numpy, torch.distributed as d; "
                                "print(torch.__version__, d.is_gloo_available())"],
                               capture_output=True, text=True, timeout=120, env=env)
        except subprocess.TimeoutExpired:
            continue
        if r.returncode == 0 and r.stdout.split()[-1:] == ["True"]:
            return python, f"torch {r.stdout.split()[0]} from {python}"
    return None, (f"skipped: no interpreter with torch (and numpy) found among {[c for c in candidates if c]}; "
                  f"create one with `python3 -m venv {TORCH_VENV_PYTHON.parent.parent} && "
                  f"{TORCH_VENV_PYTHON.parent}/pip install torch numpy`")


SNAPSHOT_TRIES = 5
SNAPSHOT_RETRY_S = 5.0


def snapshot_distgrad(dest: Path, env: dict[str, str]) -> dict[str, Any]:
    """Copy distgrad/ to ``dest/distgrad`` and check that it imports; every process then runs this copy.

    The package is edited while benchmarks run: a run measures one version of
    it from start to end, and a copy caught mid-edit (it does not import) is
    taken again after a pause.
    """
    error = ""
    for attempt in range(SNAPSHOT_TRIES):
        shutil.rmtree(dest / "distgrad", ignore_errors=True)
        shutil.copytree(ROOT / "distgrad", dest / "distgrad", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        check = subprocess.run([sys.executable, "-c", "import distgrad.cli, distgrad.run.serving, distgrad.run.inprocess, "
                                "distgrad.run.launcher; print(distgrad.__file__)"], cwd=dest, env=env,
                               capture_output=True, text=True, timeout=60)
        if check.returncode == 0 and check.stdout.strip().startswith(str(dest)):
            digest = hashlib.sha256()
            for path in sorted((dest / "distgrad").rglob("*")):
                if path.is_file():
                    digest.update(str(path.relative_to(dest)).encode() + b"\0" + path.read_bytes())
            return {"path": str(dest / "distgrad"), "sha256": digest.hexdigest(), "attempts": attempt + 1}
        error = (check.stdout + check.stderr).strip().splitlines()[-1:] or ["imported from elsewhere"]
        say(f"the copy of distgrad/ does not import ({error[0]}); copying again in {SNAPSHOT_RETRY_S:g} s")
        time.sleep(SNAPSHOT_RETRY_S)
    raise BenchError(f"no importable copy of distgrad/ after {SNAPSHOT_TRIES} tries: {error}")


def machine_info(runner: Runner) -> dict[str, Any]:
    info: dict[str, Any] = {"nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
                            "uname": f"{platform.system()} {platform.release()} {platform.machine()}",
                            "python": platform.python_version(), "loadavg_start": os.getloadavg()}
    try:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                           if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        info["children"] = runner.run_json("info", [sys.executable, str(HERE / "_peers.py"), "info"], 60)
    except BenchError as e:
        info["children"] = {"error": str(e)}
    for key, cmd in (("git_head", ["git", "rev-parse", "HEAD"]),
                     ("git_dirty", ["git", "status", "--short", "--", "distgrad"])):
        try:
            info[key] = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            info[key] = None
    return info
