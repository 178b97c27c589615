"""``distgrad run`` never accepts and ignores a setting: what a stage process would refuse (exit 2) it
refuses too, with the same reason, before any stage starts; ``--privacy-meter`` meters every data owner and the
label owner of feature parties and clients alike."""

from __future__ import annotations

import pytest

from conftest import read_json, run_launcher, run_main, splitfed_every
from test_defenses import _defended

EXIT_USAGE = 2
GUARD_REASON = "'input_guard' is a setting of a feature party, which holds the inputs"


def _error(result) -> str:
    return result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""


@pytest.mark.integration
def test_an_input_guard_on_the_label_owner_is_refused_through_the_cli_as_the_stage_refuses_it(tmp_path):
    path = _defended(tmp_path, "vertical-classify", {3: "input_guard = { max_r2 = 0.75 }"}, "guarded.toml")
    result = run_launcher(["run", path, "--steps", "2", "--summary", tmp_path / "s.json"])
    assert result.returncode == EXIT_USAGE, result.stdout + result.stderr
    assert GUARD_REASON in result.stderr
    assert not (tmp_path / "s.json").exists() and "stage" not in result.stdout     # nothing ran
    stage = run_main(["stage", "g", "--experiment", path, "--bind", "tcp://127.0.0.1:*"])
    assert stage.returncode == EXIT_USAGE and GUARD_REASON in stage.stderr


@pytest.mark.parametrize("experiment, owners", [("vertical-classify", {"a", "b", "c"}),
                                                ("digits-splitfed", {"f@0", "f@1", "f@2"})])
def test_the_privacy_meter_meters_every_data_owner_of_parties_and_clients(experiment, owners, tmp_path):
    if experiment == "digits-splitfed":             # averaging within the run's 2 steps
        experiment = splitfed_every(tmp_path, 2)
    result = run_main(["run", experiment, "--privacy-meter", "--steps", "2", "--in-process",
                       "--summary", tmp_path / "s.json"])
    assert result.returncode == 0, result.stderr
    summary = read_json(tmp_path / "s.json")
    assert set(summary["input_meters"]) == owners and set(summary["label_meters"]) == owners, sorted(summary)


@pytest.mark.parametrize("experiment", ["seed-reverse", "vertical-classify", "digits-clients", "chain4-classify"])
@pytest.mark.parametrize("flag, value, reason", [("--liveness", "0", "--liveness must be > 0 seconds"),
                                                 ("--timeout", "-1", "--timeout must be > 0 seconds"),
                                                 ("--peer-deadline", "0", "--peer-deadline must be > 0 seconds")])
def test_what_a_stage_process_refuses_run_refuses_before_any_stage_starts(experiment, flag, value, reason):
    """run_main fails the test if the command starts a process or opens a socket."""
    result = run_main(["run", experiment, "--steps", "2", flag, value])
    assert result.returncode == EXIT_USAGE, result.stderr
    assert reason in _error(result)


@pytest.mark.parametrize("mode", [[], ["--in-process"]], ids=["run", "in-process"])
def test_the_privacy_meter_of_an_experiment_without_batches_is_refused_not_ignored(mode):
    """seed-reverse steps one sample at a time: no figure of a meter (each scores a batch of rows) has
    anything to score, so the flag is refused with the reason, before any stage starts, not accepted with
    empty figures."""
    result = run_main(["run", "seed-reverse", "--privacy-meter", "--steps", "2", *mode])
    assert result.returncode == EXIT_USAGE, result.stdout + result.stderr
    assert "'privacy_meter' (or --privacy-meter) scores a batch of rows" in result.stderr


def test_a_tensorboard_folder_that_is_a_file_or_an_output_is_refused_before_any_stage_starts(tmp_path):
    """``--tensorboard FILE`` failed the label owner as it started ('Not a directory'), and ``--tensorboard tb
    --summary tb/g`` lost the summary of a finished run (tb/g is g's event folder): each exits 2 before any
    stage starts, naming the folder; the file is kept."""
    pytest.importorskip("tensorboardX")
    afile = tmp_path / "afile"
    afile.write_text("kept\n")
    result = run_launcher(["run", "seed-reverse", "--steps", "2", "--tensorboard", afile])
    assert result.returncode == EXIT_USAGE and f"{afile} is a file, not a folder" in result.stderr, result.stderr
    assert afile.read_text() == "kept\n" and "[g]" not in result.stdout + result.stderr
    board = tmp_path / "tb"
    result = run_launcher(["run", "seed-reverse", "--steps", "2", "--tensorboard", board, "--summary", board / "g"])
    assert result.returncode == EXIT_USAGE, result.stderr
    assert f"--summary {board / 'g'} is the folder --tensorboard gives process g's event files" in result.stderr
    assert not board.exists()
