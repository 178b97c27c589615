"""Held-out evaluations during the run (``eval_every``, ``--eval-every``): the same steps and the same scores
in one process and over the wire, never changing a parameter; in the metrics, the progress line and the plot."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from distgrad.cli import _run_stage, build_stage_parser
from distgrad.errors import ConfigError
from distgrad.config.parse import load_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.run.progress import PROGRESS_PREFIX, Progress, render_bar

from conftest import DIGITS_NPZ, digits_data_table, read_json, read_lines, run_launcher, splitfed_every


# Three stages on the digits: the held-out rows go through a middle stage too.
CHAIN_DIGITS = f"""
name = "chain-digits"
steps = 9
seed = 0
eval_every = 4
{digits_data_table()}[[stages]]
name = "f"
model = [{{ type = "dense", name = "f1", in = 64, out = 32 }}, {{ type = "relu" }}]
[[stages]]
name = "m"
model = [{{ type = "dense", name = "m1", in = 32, out = 32 }}, {{ type = "tanh" }}]
[[stages]]
name = "g"
model = [{{ type = "dense", name = "g1", in = 32, out = 10 }}]
loss = "softmax_cross_entropy"
"""


def _both(tmp_path: Path, experiment: str, *flags: str, **settings) -> tuple[dict, dict]:
    """(``train_in_process(experiment, **settings)``, the summary of ``distgrad run experiment *flags``),
    the flags saying what the settings say."""
    reference = json.loads(json.dumps(train_in_process(load_experiment(experiment), **settings)))
    run = tmp_path / "run.json"
    result = run_launcher(["run", experiment, "--summary", run, *flags])
    assert result.returncode == 0, result.stdout + result.stderr
    return reference, read_json(run)


def test_two_processes_evaluate_at_the_same_steps_as_one_and_end_bitwise_equal(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    reference, summary = _both(tmp_path, "digits", "--steps", "10", "--eval-every", "4", "--micro-batches", "2",
                               "--metrics", metrics, steps=10, eval_every=4, micro_batches=2)
    assert [e["step"] for e in reference["evaluations"]] == [4, 8, 10]           # every 4th, and the last
    assert summary["evaluations"] == reference["evaluations"]                     # bitwise: JSON floats
    assert summary["params"] == reference["params"]                               # evaluating changed nothing
    assert summary["test_loss"] == reference["evaluations"][-1]["test_loss"] == reference["test_loss"]
    lines = read_lines(metrics)
    scored = {line["step"]: line for line in lines if "test_loss" in line}
    assert sorted(scored) == [4, 8, 10] and [line["step"] for line in lines] == list(range(1, 11))
    for entry in reference["evaluations"]:
        assert scored[entry["step"]]["test_loss"] == entry["test_loss"]
        assert scored[entry["step"]]["test_accuracy"] == entry["test_accuracy"]


def test_through_a_middle_stage_with_the_experiments_eval_every(tmp_path):
    experiment = tmp_path / "chain-digits.toml"
    experiment.write_text(CHAIN_DIGITS)
    reference, summary = _both(tmp_path, str(experiment), "--micro-batches", "2", micro_batches=2)
    assert summary["mode"] == "3-process"
    assert [e["step"] for e in reference["evaluations"]] == [4, 8, 9]
    assert summary["evaluations"] == reference["evaluations"] and summary["params"] == reference["params"]


def test_several_clients_are_each_scored_with_the_serving_stage_of_the_same_step(tmp_path):
    reference, summary = _both(tmp_path, str(splitfed_every(tmp_path, 3)), "--steps", "6", "--eval-every", "3",
                               "--micro-batches", "2", steps=6, eval_every=3, micro_batches=2)
    for ours, theirs in zip(summary["clients"], reference["clients"], strict=True):
        assert [e["step"] for e in theirs["evaluations"]] == [3, 6]
        assert ours["evaluations"] == theirs["evaluations"]
    assert summary["params"] == reference["params"]


def test_eval_every_zero_evaluates_only_after_the_last_step_and_bad_values_are_refused():
    exp = load_experiment("digits")
    assert [e["step"] for e in train_in_process(exp, steps=3, eval_every=0)["evaluations"]] == [3]
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="--eval-every must be an integer >= 0"):
            train_in_process(exp, steps=3, eval_every=bad)
    args = build_stage_parser().parse_args(["g", "--experiment", "digits", "--bind", "tcp://127.0.0.1:*",
                                            "--eval-every", "2"])
    with pytest.raises(ConfigError, match="--eval-every are for the driving stage"):
        _run_stage(args)


def test_the_driving_stage_writes_the_scores_on_its_progress_lines(capsys):
    from distgrad.api import drive_stage, serve_stage

    with serve_stage("digits", steps=6) as g:
        summary = drive_stage("digits", g.endpoint, steps=6, eval_every=2, progress="lines")
    lines = [json.loads(line[len(PROGRESS_PREFIX):]) for line in capsys.readouterr().err.splitlines()
             if line.startswith(PROGRESS_PREFIX)]
    scored = [line for line in lines if "test_loss" in line]
    assert [line["step"] for line in scored] == [2, 4, 6]          # never skipped for being too soon
    assert [{k: line[k] for k in ("test_loss", "test_accuracy")} for line in scored] == [
        {k: e[k] for k in ("test_loss", "test_accuracy")} for e in summary["evaluations"]]


def test_the_bar_shows_the_latest_scores_until_the_next():
    stream = io.StringIO()
    progress = Progress("bar", 10, stream)
    progress.update(1, 2.0, force=True)
    assert " test " not in stream.getvalue()
    progress.update(2, 1.5, test={"test_loss": 1.25, "test_accuracy": 0.5})
    progress.update(3, 1.4, force=True)
    assert stream.getvalue().rsplit("\r", 1)[-1].count("test 1.25 acc 0.500") == 1
    assert "loss 0.5 test 0.25 - steps/s" in render_bar(1, 10, 0.5, None, {"test_loss": 0.25})


def test_plot_draws_the_held_out_loss_and_accuracy_per_client(tmp_path):
    pytest.importorskip("matplotlib")
    from distgrad.plot import draw_metrics, plot_metrics

    records = [{"step": s, "loss": 2.0 / s, "wall_s": 0.01 * s, "client": c,
                **({"test_loss": 1.0 / s, "test_accuracy": s / 10} if s % 2 == 0 else {})}
               for s in range(1, 7) for c in (0, 1)]
    fig = draw_metrics(records, "t")
    loss_axes, accuracy_axes, _ = fig.axes
    labels = [line.get_label() for line in loss_axes.get_lines()]
    assert labels == ["client 0", "client 0 held-out", "client 1", "client 1 held-out"]
    held = loss_axes.get_lines()[1]
    assert list(held.get_xdata()) == [2, 4, 6] and list(held.get_ydata()) == [0.5, 0.25, 1 / 6]
    assert accuracy_axes.get_ylabel() == "held-out accuracy" and len(accuracy_axes.get_lines()) == 2
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "client"}) + "\n"
                               for r in records if r["client"] == 0))
    png = plot_metrics(metrics, tmp_path / "plot.png")
    assert png.read_bytes().startswith(b"\x89PNG")


def test_several_clients_holding_out_no_rows_never_wait_for_an_evaluation(tmp_path):
    """``eval_every`` with no held-out rows: nothing to evaluate, so no client announces evaluations and the
    serving stage of several clients does not wait for them (the run ends bitwise as in one process)."""
    source = Path(load_experiment("digits-clients").source).read_text()
    path = tmp_path / "clients.toml"
    path.write_text(source.replace("test_fraction = 0.2", "test_fraction = 0.0").replace(
        'path = "../datasets/digits.npz"', f'path = "{DIGITS_NPZ}"').replace("steps = 300", "steps = 12\neval_every = 5"))
    reference, summary = _both(tmp_path, str(path), "--liveness", "3")
    assert summary["params"] == reference["params"]
    assert all(c["status"] == "completed" and "evaluations" not in c for c in summary["clients"])
