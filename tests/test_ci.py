"""The suite reports what it skips, and CI fails where an optional module it installs is missing; CI runs the
README's commands as on a fresh machine, then the slow set."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert "dp_accounting" in required and ".[privacy]" in ci          # the label-DP budget's accountant
    assert "sklearn" in required       # test_metrics compares the held-out metrics with scikit-learn's


def _ci_commands() -> list[str]:
    """The lines of .ci/run that are commands (not comments or blank)."""
    lines = (TESTS.parent / ".ci" / "run").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def test_ci_runs_the_readme_commands_on_an_empty_home_then_the_slow_set():
    """CI runs `make demo` and `make test` as on a fresh machine (HOME, XDG_CACHE_HOME
    and MPLCONFIGDIR new empty folders, made after the installs), then the slow set."""
    commands = _ci_commands()
    position = {command: i for i, command in enumerate(commands)}
    fresh = next(i for i, c in enumerate(commands) if c.startswith("export HOME="))
    for variable in ("HOME", "XDG_CACHE_HOME", "MPLCONFIGDIR"):
        assert f'{variable}="$fresh/' in commands[fresh], variable
    assert 'fresh="$(mktemp -d)"' in position and position['fresh="$(mktemp -d)"'] < fresh
    assert 'mkdir "$HOME" "$XDG_CACHE_HOME" "$MPLCONFIGDIR"' in position
    installs = [i for i, c in enumerate(commands) if "pip install" in c or c == "make install"]
    assert installs and max(installs) < fresh
    assert fresh < position["make demo"] < position["make test"] < position["make test-slow"]


def test_make_test_runs_one_worker_more_than_the_cores_and_test_slow_runs_the_slow_set():
    makefile = (TESTS.parent / "Makefile").read_text()
    assert "TEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print((os.cpu_count() or 1) + 1)')" in makefile
    assert "-m pytest -n $(TEST_WORKERS)" in makefile
    recipes = dict(re.findall(r"^([a-z-]+): \$\(BIN\)/\.installed\n\t(.+)$", makefile, re.M))
    assert recipes["test"] == "$(PYTEST)" and recipes["test-slow"] == "$(PYTEST) -m slow"


# Slow: a nested pytest on a fresh matplotlib cache. CI's own `make test` runs on an empty HOME with no caches
# (test_ci_runs_the_readme_commands_on_an_empty_home_then_the_slow_set holds that it does), which is this check.
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed: the plot tests skip (pip install 'distgrad[plot]')")
def test_the_plot_tests_pass_with_an_empty_home_and_no_caches(tmp_path):
    """On a machine where matplotlib never ran, its first import builds the font cache in a
    subprocess; the suite builds it before the first test (conftest), so the plot tests stay unit tests."""
    fresh = {name: tmp_path / name.lower() for name in ("HOME", "XDG_CACHE_HOME", "MPLCONFIGDIR")}
    for folder in fresh.values():
        folder.mkdir()
    result = _pytest(["tests/test_client_outputs.py::test_plot_draws_one_loss_line_per_client",
                      "tests/test_client_outputs.py::test_plot_of_a_two_stage_metrics_file_has_one_unlabelled_line",
                      "tests/test_evaluations.py::test_plot_draws_the_held_out_loss_and_accuracy_per_client"],
                     tmp_path, DISTGRAD_REQUIRE="matplotlib", **{k: str(v) for k, v in fresh.items()})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "3 passed" in result.stdout
    assert any(fresh["MPLCONFIGDIR"].iterdir())          # matplotlib's cache went to the new folder


def test_ci_lints_the_repository_before_the_fresh_home():
    """CI runs `make lint` (ruff, configured in pyproject.toml) after its installs and before the tests."""
    commands = _ci_commands()
    fresh = next(i for i, c in enumerate(commands) if c.startswith("export HOME="))
    assert "make lint" in commands and commands.index("make lint") < fresh
    assert "ruff check" in (TESTS.parent / "Makefile").read_text()
