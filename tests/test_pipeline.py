"""Micro-batch pipelining: every schedule ends bitwise equal to the in-process accumulation."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from distgrad.config.parse import load_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.stage.engine import GradAccumulator

from conftest import free_tcp_endpoint, read_json, read_lines, run_launcher, run_main
from test_faults import Pair


def _run(tmp_path, name, *args):
    """``distgrad run ARGS``: a launcher and its stage processes, or with --in-process the reference, here."""
    path = tmp_path / f"{name}.json"
    run = run_main if "--in-process" in args else run_launcher
    result = run(["run", *map(str, args), "--summary", path])
    assert result.returncode == 0, result.stdout + result.stderr
    return read_json(path)


# With two micro-batches both schedules keep both in flight (gpipe: all of them, 1f1b: two): the same
# messages in the same order, so one of them stands for both.
SCHEDULES = {2: ("1f1b",), 4: ("gpipe", "1f1b")}


@pytest.mark.parametrize("experiment,steps", [
    ("tanh-regression", 120),
    # The wide classifier repeats the same schedules on another model: in the slow set (-m slow), which
    # keeps the default suite inside its five minutes; test_two_process checks the classifier unsplit.
    pytest.param("mlp-classify", 25, marks=pytest.mark.slow),
])
@pytest.mark.parametrize("micro_batches", sorted(SCHEDULES))
def test_every_schedule_equals_the_in_process_accumulation(tmp_path, experiment, steps, micro_batches):
    reference = _run(tmp_path, "inproc", experiment, "--in-process", "--steps", steps,
                     "--micro-batches", micro_batches)
    for schedule in SCHEDULES[micro_batches]:
        summary = _run(tmp_path, schedule, experiment, "--steps", steps, "--micro-batches", micro_batches,
                       "--schedule", schedule)
        assert summary["params"] == reference["params"], schedule
        assert summary["final_loss"] == reference["final_loss"]
        assert summary["micro_batches"] == micro_batches and summary["schedule"] == schedule
    unsplit = _run(tmp_path, "unsplit", experiment, "--in-process", "--steps", steps)
    assert unsplit["params"] != reference["params"]        # splitting is a different (documented) sum order


def test_pipelined_trace_matches_in_process(tmp_path):
    args = ["tanh-regression", "--steps", "30", "--micro-batches", "4"]
    run_main(["run", *args, "--in-process", "--trace", tmp_path / "a.jsonl"])
    result = run_launcher(["run", *args, "--schedule", "gpipe", "--trace", tmp_path / "b.jsonl"])
    assert result.returncode == 0, result.stderr
    a, b = read_lines(tmp_path / "a.jsonl"), read_lines(tmp_path / "b.jsonl")
    assert a == b and len(a) == 30
    assert np.array(a[0]["grads"]["activation_grad"]).shape == (32, 32)    # all micro-batches, in order


def test_labels_travel_per_micro_batch(tmp_path):
    from test_two_process import LABELS_AT_F

    exp = tmp_path / "labels.toml"
    exp.write_text(LABELS_AT_F)
    reference = _run(tmp_path, "inproc", exp, "--in-process", "--micro-batches", 4)
    assert _run(tmp_path, "piped", exp, "--micro-batches", 4, "--schedule", "gpipe")["params"] == reference["params"]


def test_in_flight_three_of_four_equals_the_in_process_accumulation(tmp_path):
    """--in-flight N changes only how many micro-batches wait on the wire, not the sum's order."""
    args = ["tanh-regression", "--steps", 40, "--micro-batches", 4]
    reference = _run(tmp_path, "inproc", *args, "--in-process", "--in-flight", 3)
    summary = _run(tmp_path, "n3", *args, "--in-flight", 3)
    assert summary["params"] == reference["params"] and summary["final_loss"] == reference["final_loss"]
    assert summary["schedule"] == "1f1b" and summary["in_flight"] == 3


@pytest.mark.parametrize("args, message", [
    (["--micro-batches", "4", "--in-flight", "0"], "--in-flight must be an integer >= 1, got 0"),
    (["--micro-batches", "4", "--in-flight", "5"], "--in-flight 5 is more than the 4 micro-batch(es)"),
    (["--in-flight", "2"], "--in-flight 2 is more than the 1 micro-batch(es)"),
    (["--micro-batches", "4", "--schedule", "gpipe", "--in-flight", "2"], "--in-flight is for the 1f1b schedule"),
    # Steps in flight send every micro-batch of a step at once: a window would be accepted and not applied.
    (["--micro-batches", "4", "--in-flight", "2", "--staleness", "1"], "--in-flight is for lockstep runs"),
])
def test_in_flight_is_checked_before_anything_starts(args, message):
    for extra in ([], ["--in-process"]):
        result = run_main(["run", "tanh-regression", *args, *extra])
        assert result.returncode == 2 and message in result.stderr, result.stderr
    result = run_main(["stage", "f", "--experiment", "tanh-regression", "--connect", "tcp://127.0.0.1:9", *args])
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_in_flight_is_for_the_driving_stage():
    result = run_main(["stage", "g", "--experiment", "tanh-regression", "--bind", "tcp://127.0.0.1:*",
                       "--in-flight", "2"])
    assert result.returncode == 2 and "--in-flight" in result.stderr and "driving stage" in result.stderr


def test_in_flight_is_refused_with_steps_in_flight_from_the_file_or_auto():
    """The experiment's own ``staleness`` and ``--staleness auto`` (which may choose S > 0) refuse a window too."""
    import dataclasses

    from distgrad.errors import ConfigError
    from distgrad.run.options import StageOptions

    exp = load_experiment("tanh-regression")
    stale = dataclasses.replace(exp, staleness=2)
    for experiment, staleness in ((stale, None), (exp, "auto"), (exp, 1)):
        with pytest.raises(ConfigError, match="--in-flight is for lockstep runs"):
            StageOptions(experiment, "f", 0, micro_batches=4, in_flight=2, staleness=staleness)
    assert StageOptions(stale, "f", 0, micro_batches=4, in_flight=2, staleness=0).window == 2


def test_in_flight_sets_the_window():
    from distgrad.run.options import StageOptions

    exp = load_experiment("tanh-regression")
    window = {(schedule, m, n): StageOptions(exp, "f", 0, micro_batches=m, schedule=schedule, in_flight=n).window
              for schedule, m, n in [("1f1b", 1, None), ("1f1b", 4, None), ("1f1b", 4, 1), ("1f1b", 4, 4),
                                     ("gpipe", 4, None)]}
    assert window == {("1f1b", 1, None): 1, ("1f1b", 4, None): 2, ("1f1b", 4, 1): 1, ("1f1b", 4, 4): 4,
                      ("gpipe", 4, None): 4}


def test_micro_batches_must_divide_the_batch(tmp_path):
    for args in (["seed-reverse", "--micro-batches", "2"], ["tanh-regression", "--micro-batches", "5"],
                 ["tanh-regression", "--micro-batches", "0"]):
        result = run_main(["run", *args, "--in-process"])
        assert result.returncode == 2 and "micro-batch" in result.stderr, result.stderr


def test_server_killed_mid_pipeline_resumes_bitwise(tmp_path):
    steps = "600"
    pair = Pair(tmp_path, "tanh-regression", steps, free_tcp_endpoint())
    for name in ("f",):
        pair.args[name] += ["--micro-batches", "4", "--schedule", "gpipe"]
    try:
        pair.start("g")
        pair.start("f")
        for target in (150, 400):
            pair.wait_for_step(target)
            pair.procs["g"].signal(signal.SIGKILL)
            assert pair.procs["g"].wait(10) == -signal.SIGKILL, "the run ended before the kill"
            pair.start("g")
        f_summary, g_summary = pair.finish()
    finally:
        pair.stop()
    reference = train_in_process(load_experiment("tanh-regression"), steps=int(steps), micro_batches=4)
    assert f_summary["params"]["f"] == reference["params"]["f"]
    assert g_summary["params"]["g"] == reference["params"]["g"]


def test_accumulator_sums_in_order_and_passes_a_single_batch_through():
    acc = GradAccumulator()
    one = {"w": np.ones(3, np.float32)}
    acc.add(one, 0, 1)
    assert acc.take(np.float32(1)) is one
    parts = [{"w": np.full(3, v, np.float32)} for v in (0.1, 0.2, 0.3)]
    for i, part in enumerate(parts):
        acc.add(part, i, 3)
    expected = ((parts[0]["w"] + parts[1]["w"]) + parts[2]["w"]) * np.float32(0.5)
    np.testing.assert_array_equal(acc.take(np.float32(0.5))["w"], expected)
    with pytest.raises(ValueError, match="out of order"):
        acc.add(parts[1], 1, 3)


def test_a_resume_with_another_micro_batch_count_is_refused_and_changes_no_file(tmp_path):
    """A step's gradient is summed over its micro-batches: a run resumed with another --micro-batches would
    equal no single run, so the driving stage refuses it (as another staleness), naming both counts."""
    from distgrad.api import drive_stage, serve_stage
    from distgrad.errors import ConfigError

    ck = tmp_path / "ckpt"
    with serve_stage("tanh-regression", checkpoint_dir=ck, steps=20) as g:
        drive_stage("tanh-regression", g.endpoint, checkpoint_dir=ck, steps=20, micro_batches=2)
        g.wait(30)
    files = {p.name: p.read_bytes() for p in ck.iterdir()}
    with pytest.raises(ConfigError, match="written with --micro-batches 2, and this run asks for 4"):
        drive_stage("tanh-regression", free_tcp_endpoint(), checkpoint_dir=ck, steps=40, micro_batches=4,
                    resume=True, peer_deadline_s=1.0)
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == files
