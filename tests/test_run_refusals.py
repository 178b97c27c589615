"""``distgrad run`` never accepts and ignores a setting: what a stage process would refuse (exit 2) it
refuses too, with the same reason, before any stage starts; ``--privacy-meter`` on an experiment none of
whose stages can meter (feature parties, clients, one stage) is refused with the stage's reason."""

from __future__ import annotations

import pytest

from conftest import run_cli, run_main

EXIT_USAGE = 2
METER_REASON = "'privacy_meter' (or --privacy-meter) is not supported with [clients] or 'aggregate' yet"


def _error(result) -> str:
    return result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""


@pytest.mark.integration
def test_the_privacy_meter_of_a_vertical_run_is_refused_through_the_cli_as_the_stage_refuses_it(tmp_path):
    result = run_cli(["run", "vertical-classify", "--privacy-meter", "--steps", "2", "--summary", tmp_path / "s.json"])
    assert result.returncode == EXIT_USAGE, result.stdout + result.stderr
    assert METER_REASON in result.stderr
    assert not (tmp_path / "s.json").exists() and "stage" not in result.stdout     # nothing ran
    stage = run_main(["stage", "g", "--experiment", "vertical-classify", "--bind", "tcp://127.0.0.1:*",
                      "--privacy-meter"])
    assert stage.returncode == EXIT_USAGE and METER_REASON in stage.stderr


@pytest.mark.parametrize("experiment, extra", [("vertical-classify", []), ("vertical-classify", ["--in-process"]),
                                               ("digits-clients", []), ("digits-splitfed", ["--in-process"])])
def test_the_privacy_meter_is_refused_where_no_stage_can_meter(experiment, extra):
    result = run_main(["run", experiment, "--privacy-meter", "--steps", "2", *extra])
    assert result.returncode == EXIT_USAGE, result.stderr
    assert METER_REASON in result.stderr


@pytest.mark.parametrize("experiment", ["seed-reverse", "vertical-classify", "digits-clients", "chain4-classify"])
@pytest.mark.parametrize("flag, value, reason", [("--liveness", "0", "--liveness must be > 0 seconds"),
                                                 ("--timeout", "-1", "--timeout must be > 0 seconds"),
                                                 ("--peer-deadline", "0", "--peer-deadline must be > 0 seconds")])
def test_what_a_stage_process_refuses_run_refuses_before_any_stage_starts(experiment, flag, value, reason):
    """run_main fails the test if the command starts a process or opens a socket."""
    result = run_main(["run", experiment, "--steps", "2", flag, value])
    assert result.returncode == EXIT_USAGE, result.stderr
    assert reason in _error(result)
