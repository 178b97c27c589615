"""With ``keep_best`` the run's result is the kept model's, the one ``--save`` writes: ``distgrad run`` prints
its test accuracy and the step it comes from, and the summary holds them (``best_evaluation``), in two
processes as in one."""

from __future__ import annotations

import re

from conftest import read_json, run_launcher, run_main
from test_metrics import BEST, JUDGED, STOPPED, _digits


def _printed_accuracy(stdout: str) -> tuple[float, str]:
    line = next(line for line in stdout.splitlines() if line.startswith("test accuracy "))
    return float(re.match(r"test accuracy ([0-9.]+)", line).group(1)), line


def test_the_kept_models_accuracy_and_step_are_printed_and_in_the_summary(tmp_path):
    path = _digits(tmp_path, JUDGED)
    reference = run_main(["run", path, "--in-process", "--summary", tmp_path / "ref.json"])
    assert reference.returncode == 0, reference.stderr
    result = run_launcher(["run", path, "--summary", tmp_path / "run.json", "--save", tmp_path / "saved",
                           "--progress", "off"])
    assert result.returncode == 0, result.stdout + result.stderr
    for stdout, summary in ((reference.stdout, read_json(tmp_path / "ref.json")),
                            (result.stdout, read_json(tmp_path / "run.json"))):
        kept = next(e for e in summary["evaluations"] if e["step"] == BEST)
        assert summary["best_step"] == BEST and summary["steps"] == STOPPED
        assert summary["best_evaluation"] == kept
        assert kept["test_accuracy"] != summary["test_accuracy"]       # the last step's differs
        accuracy, line = _printed_accuracy(stdout)
        assert accuracy == round(kept["test_accuracy"], 4), line
        assert f"of the kept model, after step {BEST}" in line
        assert f"after the last step, {STOPPED}: {summary['test_accuracy']:.4f}" in line


def test_a_choice_on_the_reported_rows_is_said_to_be_optimistic_and_a_validation_split_is_not(tmp_path):
    """keep_best and early_stopping without validation_fraction choose on the held-out rows whose figures are
    reported as the test ones: the printed result says the figure is optimistic and how to get an honest one;
    with a validation split (the test rows never seen by the choice) it does not."""
    from distgrad.cli import SELECTED_ON_TEST_ROWS

    path = _digits(tmp_path, JUDGED, steps=80)
    result = run_main(["run", path, "--in-process"])
    assert result.returncode == 0, result.stderr
    assert SELECTED_ON_TEST_ROWS in result.stdout.splitlines()
    path.write_text(path.read_text().replace("test_fraction = 0.2\n", "test_fraction = 0.2\nvalidation_fraction = 0.2\n"))
    result = run_main(["run", path, "--in-process"])
    assert result.returncode == 0, result.stderr
    assert "validation rows" in result.stdout and SELECTED_ON_TEST_ROWS not in result.stdout
