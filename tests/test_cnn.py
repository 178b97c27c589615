"""The built-in digits-cnn: a convolutional f-stage (the images) and a dense g-stage with dropout (the labels).

It learns (held-out accuracy >= 0.97 in one process), and two stage
processes end bitwise equal to the in-process reference, dropout masks
included, with one micro-batch and with two.
"""

from __future__ import annotations

import pytest

from distgrad.config.experiment import BUILTIN_DIR
from distgrad.config.parse import load_experiment
from distgrad.run.inprocess import train_in_process

from conftest import read_json, run_launcher

EXPERIMENT = "digits-cnn"
MIN_ACCURACY = 0.97
MICRO_BATCH_STEPS = 200      # enough steps to cross the wire with dropout on both stages, quickly


@pytest.fixture(scope="module")
def reference():
    """The in-process run of the built-in, as it ships (computed once for this module)."""
    return train_in_process(load_experiment(EXPERIMENT))


def test_digits_cnn_learns_in_process(reference):
    assert reference["test_accuracy"] >= MIN_ACCURACY, reference["test_accuracy"]


def test_digits_cnn_over_two_processes_is_bitwise_the_in_process_run(tmp_path, reference):
    summary_path = tmp_path / "run.json"
    result = run_launcher(["run", EXPERIMENT, "--summary", summary_path])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_json(summary_path)
    assert summary["mode"] == "two-process"
    # JSON floats hold float32 values exactly, so == is a bitwise comparison here.
    assert summary["params"] == reference["params"]
    assert summary["final_loss"] == reference["final_loss"]
    assert summary["test_accuracy"] == reference["test_accuracy"] >= MIN_ACCURACY


def test_two_micro_batches_with_dropout_on_both_stages_are_bitwise_the_in_process_run(tmp_path):
    """Dropout on the driving stage too, so both the driver's and the serving stage's micro-batch index count."""
    text = (BUILTIN_DIR / f"{EXPERIMENT}.toml").read_text()
    flatten = '  { type = "flatten" },\n'
    assert flatten in text
    path = tmp_path / "digits-cnn-dropout.toml"
    path.write_text(text.replace(flatten, flatten + '  { type = "dropout", rate = 0.1 },\n')
                    .replace("../datasets/digits.npz", str(BUILTIN_DIR.parent / "datasets" / "digits.npz")))
    exp = load_experiment(path)
    assert [layer["type"] for layer in exp.stages[0].model][-1] == "dropout"
    reference = train_in_process(exp, steps=MICRO_BATCH_STEPS, micro_batches=2)
    summary_path = tmp_path / "run.json"
    result = run_launcher(["run", path, "--steps", MICRO_BATCH_STEPS, "--micro-batches", 2, "--summary", summary_path])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_json(summary_path)
    assert summary["micro_batches"] == 2
    assert summary["params"] == reference["params"]
    assert summary["final_loss"] == reference["final_loss"]
