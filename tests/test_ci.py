"""The suite reports what it skips, and CI fails where an optional module it installs is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _pytest(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Run pytest on this suite with torch made unimportable (a stand-in package that raises)."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError('torch hidden by test_ci', name='torch')\n")
    environment = {k: v for k, v in os.environ.items() if k != "DISTGRAD_REQUIRE"}
    environment.update(PYTHONPATH=str(fake.parent), **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=TESTS.parent,
                          capture_output=True, text=True, timeout=120, env=environment, stdin=subprocess.DEVNULL)


def test_skipped_torch_tests_say_why_in_the_summary(tmp_path):
    result = _pytest(["tests/test_torch.py", "tests/test_ci.py::test_ci_requires_the_optional_modules_it_installs"],
                     tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.split("short test summary info")[-1]
    assert "SKIPPED" in summary and "torch is not installed" in summary


def test_a_required_module_that_is_missing_fails_the_run(tmp_path):
    result = _pytest(["tests/test_torch.py"], tmp_path, DISTGRAD_REQUIRE="numpy,torch")
    assert result.returncode != 0
    assert "DISTGRAD_REQUIRE names 'torch' but it cannot be imported" in result.stdout + result.stderr


def test_ci_requires_the_optional_modules_it_installs():
    ci = (TESTS.parent / ".ci" / "run").read_text()
    assert "torch" in ci and "DISTGRAD_REQUIRE=torch" in ci
    required = ci.split("DISTGRAD_REQUIRE=", 1)[1].split()[0].split(",")
    assert "tensorboardX" in required and ".[tensorboard]" in ci        # the --tensorboard extra
