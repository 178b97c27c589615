"""``distgrad audit``: the attacks of the other party on a run's recorded view of the cut.

The view is what crossed, as the receiver decoded it (the trace's ``sent_activation_grad`` and
``sent_activation``); the audit scores it with the live meter's functions, so on the same rows the two
agree exactly, and a defended run's view gives less away. A trace is untrusted input: whatever is wrong
with it exits 2 naming the problem, never a traceback and never a figure of rows that are not the run's."""

from __future__ import annotations

from pathlib import Path

import json
import os

import numpy as np
import pytest

from distgrad.config.experiment import BUILTIN_DIR
from distgrad.privacy import audit, leaks
from distgrad.privacy.meter import FIGURES

from conftest import read_json, read_lines, run_launcher, run_main

CLIP = "clip_noise = { max_norm = 0.05, sigma = 0.5 }"


# --- the attacks on arrays --------------------------------------------------------------------------------

def test_clustering_finds_separated_classes_whatever_their_names():
    rng = np.random.default_rng(0)
    labels = np.repeat([2, 0, 1], 20)
    centres = np.eye(3)[labels] * 10
    rows = centres + rng.normal(scale=0.1, size=centres.shape)
    assert audit.clustering_accuracy(rows, labels, seed=1) == 1.0
    assert np.array_equal(audit.kmeans(rows, 3, seed=5), audit.kmeans(rows, 3, seed=5))   # seeded
    noise = rng.normal(size=(60, 3))
    assert audit.clustering_accuracy(noise, labels, seed=1) < 0.7


def test_the_label_attacks_are_the_meters_measures_plus_clustering():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, 64)
    rows = rng.normal(size=(64, 5)) + labels[:, None]
    figures = audit.label_attacks(rows, labels)
    assert figures["label_recovery"] == leaks.label_recovery(rows, labels)
    assert figures["cosine_auc"] == leaks.cosine_auc(rows, labels)
    assert figures["norm_auc"] == leaks.norm_auc(rows, labels)
    assert figures["direction_auc"] == leaks.direction_auc(rows, labels)
    assert 0.5 <= figures["clustering_accuracy"] <= 1.0
    assert figures["label_recovery_chance"] == 0.5 and figures["norm_auc_chance"] == 0.5
    with pytest.raises(ValueError, match="class id"):
        audit.label_attacks(rows, rng.normal(size=64))
    with pytest.raises(ValueError, match="class ids are whole numbers from 0, got -1"):
        audit.label_attacks(rows, labels - 1)
    with pytest.raises(ValueError, match="63 labels for 64 gradient rows"):
        audit.label_attacks(rows, labels[:63])


def test_the_audits_cosine_auc_scores_every_row_of_its_range():
    """Rows whose first 96 point by class and the rest noise: the audit's figure is that of every pair of
    the range (an independent count), not the 1.0 of its first 96 rows."""
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 3, 192)
    rows = np.eye(3)[labels] + rng.normal(scale=0.01, size=(192, 3))
    rows[96:] = rng.normal(size=(96, 3))
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    i, j = np.triu_indices(192, k=1)
    scores, same = np.sum(unit[i] * unit[j], axis=1), labels[i] == labels[j]
    pos, neg = scores[same], scores[~same]
    expected = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (
        len(pos) * len(neg))
    figure = audit.label_attacks(rows, labels)["cosine_auc"]
    assert figure == pytest.approx(expected, abs=1e-12) and figure < 0.9


def test_a_linear_map_of_the_inputs_is_decoded_and_noise_is_not():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(200, 6))
    figures = audit.input_attacks(x @ rng.normal(size=(6, 8)), x, mlp=True, batches=[100, 100])
    assert figures["linear_reconstruction_mse"] < 1e-6 < figures["reconstruction_mse_chance"]
    assert figures["mlp_reconstruction_mse"] < figures["reconstruction_mse_chance"]
    assert figures["distance_correlation"] > figures["distance_correlation_chance"]
    noise = audit.input_attacks(rng.normal(size=(200, 8)), x)
    assert noise["linear_reconstruction_mse"] > 0.9 * noise["reconstruction_mse_chance"]


# --- over processes ---------------------------------------------------------------------------------------

def _digits(tmp_path: Path, g_extra: str = "") -> Path:
    """The built-in digits experiment with ``g_extra`` in the label owner's table."""
    text = (BUILTIN_DIR / "digits.toml").read_text().replace('"../datasets/', f'"{BUILTIN_DIR.parent / "datasets"}/')
    path = tmp_path / "audited.toml"
    path.write_text(f"{text.rstrip()}\n{g_extra}\n")      # g is the last table of the file
    return path


def _metered_run(tmp_path: Path, experiment: Path, name: str) -> tuple[Path, dict]:
    """Two stage processes, metered, windows of 6 steps (short enough that the meter scores every step),
    the crossed tensors traced; returns the trace and the summary."""
    trace, summary = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
    result = run_launcher(["run", experiment, "--steps", "12", "--eval-every", "6", "--privacy-meter",
                           "--trace", trace, "--trace-params", "sent_activation_grad,sent_activation",
                           "--summary", summary])
    assert result.returncode == 0, result.stdout + result.stderr
    return trace, read_json(summary)


def _audit(experiment: Path, trace: Path, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "audit.json"
    result = run_main(["audit", experiment, trace, "--json", out, *extra])
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_json(out)
    assert result.stdout.count("(chance") == sum(len(figures) for figures in report.values()) // 2
    return report


def test_the_audit_agrees_with_the_live_meter_and_a_defense_lowers_recovery(tmp_path):
    plain = _digits(tmp_path)
    trace, summary = _metered_run(tmp_path, plain, "plain")
    line = read_lines(trace)[0]
    assert np.array(line["grads"]["sent_activation_grad"]).shape == (32, 64)      # what f received
    assert np.array(line["grads"]["sent_activation"]).shape == (32, 64)           # what g received
    for window in (0, 1):
        meter_labels, meter_inputs = summary["label_leaks"][window], summary["input_leaks"][window]
        steps = f"{6 * window + 1}:{6 * window + 6}"
        report = _audit(plain, trace, tmp_path, "--steps", steps)
        for name in ("label_recovery", "cosine_auc"):
            assert report["labels"][name] == pytest.approx(meter_labels[name], abs=1e-12), (name, window)
        assert report["inputs"]["distance_correlation"] == pytest.approx(meter_inputs["distance_correlation"],
                                                                         abs=1e-12)
    assert report["labels"]["label_recovery"] == 1.0 and report["labels"]["clustering_accuracy"] > 0.8
    assert report["inputs"]["linear_reconstruction_mse"] < report["inputs"]["reconstruction_mse_chance"]
    # The strongest attack too: each row's gradients averaged over every audited step, as the meter's whole run.
    whole = _audit(plain, trace, tmp_path)["labels"]
    for name in ("averaged_recovery_1", "averaged_recovery_10"):
        assert whole[name] == pytest.approx(summary["label_attacks"][-1][name], abs=1e-12), name
        assert whole[name + "_chance"] == pytest.approx(0.1)
    # Each party audits with its own stage file, which holds only its own secret.
    assert run_main(["split", plain, tmp_path / "parties"]).returncode == 0
    for stage, view in (("g", "labels"), ("f", "inputs")):
        own = _audit(tmp_path / "parties" / stage / f"{stage}.toml", trace, tmp_path, "--steps", "7:12")
        assert own == {view: report[view]}

    defended = tmp_path / "defended"
    defended.mkdir()
    clipped = _digits(defended, CLIP)
    trace, summary = _metered_run(defended, clipped, "clipped")
    report = _audit(clipped, trace, defended, "--steps", "1:6")
    meter = summary["label_leaks"][0]
    assert report["labels"]["label_recovery"] == pytest.approx(meter["label_recovery"], abs=1e-12)   # defended
    assert report["labels"]["cosine_auc"] == pytest.approx(meter["cosine_auc"], abs=1e-12)
    assert report["labels"]["label_recovery"] < 0.6 and report["labels"]["clustering_accuracy"] < 0.6
    whole = _audit(clipped, trace, defended)["labels"]
    assert whole["averaged_recovery_1"] == pytest.approx(summary["label_attacks"][-1]["averaged_recovery_1"],
                                                         abs=1e-12)


@pytest.mark.parametrize("window", [6, 20])
def test_the_audit_and_the_live_meter_agree_on_every_figure_they_share(tmp_path, window):
    """Same run (two micro-batches a step, the label owner's max_norm): each window the meter closed,
    audited with --steps of that window and the run's --micro-batches, gives every figure the meter
    reported (and its chance), to float tolerance: windows of 6 steps (the meter scores every step) and of 20
    (it scores a sample, which the audit picks by the same rule); and the audit of the whole run with
    --window gives the figures of the meter's steps of every window together."""
    path = _digits(tmp_path, "max_norm = true")
    trace, summary = tmp_path / "run.jsonl", tmp_path / "run.json"
    result = run_launcher(["run", path, "--steps", str(2 * window), "--eval-every", str(window), "--privacy-meter",
                           "--micro-batches", "2", "--trace", trace, "--trace-params",
                           "sent_activation_grad,sent_activation", "--summary", summary])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_json(summary)
    for index in (0, 1):
        steps = f"{window * index + 1}:{window * index + window}"
        report = _audit(path, trace, tmp_path, "--steps", steps, "--micro-batches", "2")
        for view, key in (("labels", "label_leaks"), ("inputs", "input_leaks")):
            meter = summary[key][index]
            assert meter["step"] == window * index + window
            shared = {name for name in meter if name != "step"}
            assert shared and shared <= set(report[view]), (view, shared - set(report[view]))
            assert {name for name in report[view] if name in FIGURES or name[:-len("_chance")] in FIGURES} == shared
            for name in shared:
                assert report[view][name] == pytest.approx(meter[name], rel=1e-12, abs=1e-12), (view, name, index)
    whole = _audit(path, trace, tmp_path, "--window", str(window), "--micro-batches", "2")
    by_steps = _audit(path, trace, tmp_path, "--steps", f"1:{2 * window}", "--window", str(window),
                      "--micro-batches", "2")
    assert whole == by_steps
    if window > 7:       # a sampled window: scoring every step instead would give other figures
        every = _audit(path, trace, tmp_path, "--window", "1", "--micro-batches", "2")
        assert every["labels"]["cosine_auc"] != whole["labels"]["cosine_auc"]


def test_bad_audit_inputs_exit_2_naming_the_problem(tmp_path):
    plain = _digits(tmp_path)
    cases = {"no trace file": tmp_path / "missing.jsonl", "is not a trace": tmp_path / "garbage.jsonl",
             "holds no sent_activation_grad": tmp_path / "empty.jsonl",
             "is the trace of this experiment": tmp_path / "other.jsonl"}
    (tmp_path / "garbage.jsonl").write_text("this is not json\n")
    (tmp_path / "empty.jsonl").write_text('{"step": 1, "grads": {}, "params": {}}\n')
    (tmp_path / "other.jsonl").write_text('{"step": 1, "grads": {"sent_activation_grad": [[1.0, 2.0]]}}\n')
    for message, trace in cases.items():
        result = run_main(["audit", plain, trace])
        assert result.returncode == 2 and message in result.stderr, (message, result.stderr)
    result = run_main(["audit", plain, tmp_path / "empty.jsonl", "--steps", "a:b"])
    assert result.returncode == 2 and "--steps" in result.stderr


@pytest.mark.usefixtures("fixed_noise_secret")
def test_the_trace_records_what_crossed_after_defense_and_codec_alike_in_every_runner(tmp_path):
    """With micro-batches, a gradient codec and the label owner's clip_noise: ``sent_activation_grad`` is what
    f decoded (not the label owner's ``activation_grad``), bitwise the same over processes and in process."""
    clipped = _digits(tmp_path, CLIP)
    args = ["run", clipped, "--steps", "3", "--micro-batches", "2", "--gradient-codec", "int8",
            "--trace-params", "sent_activation_grad,sent_activation,activation_grad"]
    assert run_main([*args, "--in-process", "--trace", tmp_path / "ref.jsonl"]).returncode == 0
    result = run_launcher([*args, "--trace", tmp_path / "run.jsonl"])
    assert result.returncode == 0, result.stdout + result.stderr
    lines, reference = read_lines(tmp_path / "run.jsonl"), read_lines(tmp_path / "ref.jsonl")
    assert lines == reference
    for line in lines:
        sent, computed = (np.array(line["grads"][name]) for name in ("sent_activation_grad", "activation_grad"))
        assert sent.shape == computed.shape == (32, 64) and not np.array_equal(sent, computed)


# --- a trace is untrusted input ---------------------------------------------------------------------------

BASE_STEPS = 4


@pytest.fixture(scope="module")
def base_trace(tmp_path_factory) -> Path:
    """A well-formed trace of both views: digits, 4 steps, in one process."""
    path = tmp_path_factory.mktemp("base") / "base.jsonl"
    result = run_main(["run", "digits", "--steps", str(BASE_STEPS), "--in-process", "--trace", path,
                       "--trace-params", "sent_activation_grad,sent_activation"])
    assert result.returncode == 0, result.stderr
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def _text(lines: list[dict]) -> str:
    return "".join(json.dumps(line) + "\n" for line in lines)


def _grad(lines: list[dict], value, step: int = 2, name: str = "sent_activation_grad") -> str:
    lines[step - 1]["grads"][name] = value(lines[step - 1]["grads"][name]) if callable(value) else value
    return _text(lines)


def _a_value(value):
    """A change to one value (not the first) of a step's rows."""
    def change(rows):
        rows[1][2] = value
        return rows
    return change


# (name, the trace's text from the base's lines, a part of the message that names the problem)
MALFORMED = [
    ("rows 74 wide for a 64-wide cut", lambda ls: _grad(ls, lambda r: [row + [0.0] * 10 for row in r]),
     "has shape (32, 74), but the cut carries (32, 64)"),
    ("rows shaped (32, 1, 64)", lambda ls: _grad(ls, lambda r: [[row] for row in r]),
     "has shape (32, 1, 64), but the cut carries (32, 64)"),
    ("fewer rows than the batch", lambda ls: _grad(ls, lambda r: r[:31]), "has shape (31, 64)"),
    ("no rows", lambda ls: _grad(ls, []), "has shape (0,)"),
    ("a number for the rows", lambda ls: _grad(ls, 1.5), "has shape ()"),
    ("rows of unequal lengths", lambda ls: _grad(ls, lambda r: r[:-1] + [r[-1][:10]]), "not a regular array"),
    ("the input view misshapen", lambda ls: _grad(ls, lambda r: [row[:32] for row in r], name="sent_activation"),
     "sent_activation has shape (32, 32)"),
    ("a string among the rows", lambda ls: _grad(ls, _a_value("0.5")), "every value must be a number"),
    ("a boolean among the rows", lambda ls: _grad(ls, _a_value(True)), "every value must be a number"),
    ("a null among the rows", lambda ls: _grad(ls, _a_value(None)), "every value must be a number"),
    ("a list in place of a number", lambda ls: _grad(ls, _a_value([1.0])), "every value must be a number"),
    ("an array nested 500 deep among the rows",
     lambda ls: _grad(ls, _a_value(123456.75)).replace("123456.75", "[" * 500 + "1.0" + "]" * 500),
     "holds an array: every value must be a number"),
    ("NaN among the rows", lambda ls: _grad(ls, _a_value(float("nan"))), "NaN or infinite"),
    ("an overflowing literal", lambda ls: _grad(ls, _a_value(123456.75)).replace("123456.75", "1e999"),
     "NaN or infinite"),
    ("a value beyond float32", lambda ls: _grad(ls, _a_value(1e39)), "too large for float32"),
    ("an integer beyond float64", lambda ls: _grad(ls, _a_value(10 ** 400)), "too large for float32"),
    ("every step written twice", lambda ls: _text([line for line in ls for _ in (0, 1)]), "step 1 is written twice"),
    ("one step written twice apart", lambda ls: _text(ls + ls[1:2]), "step 2 comes after step 4"),
    ("steps out of order", lambda ls: _text([ls[1], ls[0], *ls[2:]]), "step 1 comes after step 2"),
    ("a step past the end of the run", lambda ls: _text(ls[:-1] + [{**ls[-1], "step": 801}]),
     "step 801, outside the run's steps 1 to 800"),
    ("step 0", lambda ls: _text([{**ls[0], "step": 0}, *ls[1:]]), "step 0, outside the run's steps"),
    ("a negative step", lambda ls: _text([{**ls[0], "step": -3}, *ls[1:]]), "step -3, outside"),
    ("a fractional step", lambda ls: _text([{**ls[0], "step": 1.5}, *ls[1:]]), "no whole-number 'step'"),
    ("a boolean step", lambda ls: _text([{**ls[0], "step": True}, *ls[1:]]), "no whole-number 'step'"),
    ("a string step", lambda ls: _text([{**ls[0], "step": "1"}, *ls[1:]]), "no whole-number 'step'"),
    ("a step nested 500 deep", lambda ls: _text([{**ls[0], "step": json.loads("[" * 500 + "1" + "]" * 500)},
                                                 *ls[1:]]), "no whole-number 'step' (got an array)"),
    ("no step", lambda ls: _text([{k: v for k, v in ls[0].items() if k != "step"}, *ls[1:]]),
     "no whole-number 'step'"),
    ("a step of 5000 digits", lambda ls: _text(ls).replace('"step": 1,', '"step": ' + "9" * 5000 + ",", 1),
     "is not a trace line"),
    ("a key given twice", lambda ls: _text(ls).replace('"step": 1,', '"step": 1, "step": 3,', 1), "appears twice"),
    ("grads not an object", lambda ls: _text([{**ls[0], "grads": [1.0]}, *ls[1:]]),
     "'grads' must be an object"),
    ("params a string", lambda ls: _text([{**ls[0], "params": "w"}, *ls[1:]]), "'params' must be an object"),
    ("a gradient that is a string", lambda ls: _text([{**ls[0], "grads": {**ls[0]["grads"], "w": "x"}}, *ls[1:]]),
     "grads.w must be an array of numbers"),
    ("a string loss", lambda ls: _text([{**ls[0], "loss": "low"}, *ls[1:]]), "'loss' must be a number"),
    ("a client's line", lambda ls: _text([{**ls[0], "client": 1}, *ls[1:]]), "a run with [clients]"),
    ("a line that is a list", lambda ls: _text(ls[:1]) + "[1, 2]\n", "is a JSON list, not an object"),
    ("a line that is not JSON", lambda ls: _text(ls[:1]) + "{step: 2}\n", "line 2 is not a trace line"),
    ("a torn last line", lambda ls: _text(ls)[:-200], "line 4 is not a trace line"),
    ("JSON nested 100,000 deep", lambda ls: _text(ls[:1]) + "[" * 100_000 + "]" * 100_000 + "\n",
     "nested too deeply"),
    ("bytes that are not UTF-8", lambda ls: _text(ls[:1]) + '{"step": 2, "x": "\udcff"}\n', "not UTF-8 text"),
]


@pytest.mark.parametrize("make, message", [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_a_malformed_trace_exits_2_naming_the_problem(tmp_path, base_trace, make, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(make(_lines(base_trace)).encode("utf-8", "surrogateescape"))
    result = run_main(["audit", "digits", path])
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "(chance" not in result.stdout


def test_the_well_formed_trace_is_audited(base_trace):
    result = run_main(["audit", "digits", base_trace])
    assert result.returncode == 0 and "label_recovery 1.000" in result.stdout, result.stderr


def _special(kind: str, tmp_path: Path, base: Path) -> Path:
    if kind == "directory":
        return tmp_path
    if kind == "device":
        return Path("/dev/zero")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    return fifo


@pytest.mark.parametrize("kind, message", [("directory", "is a directory, not a regular file"),
                                           ("device", "/dev/zero is a device, pipe or socket, not a regular file"),
                                           ("pipe", "is a device, pipe or socket, not a regular file")])
def test_what_is_not_a_regular_file_is_refused_unread(tmp_path, base_trace, kind, message):
    """A directory, an endless device and a pipe (which no one writes: opening it would wait) are refused
    before anything is read."""
    result = run_main(["audit", "digits", _special(kind, tmp_path, base_trace)])
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_trace_over_the_size_limit_is_refused_and_the_limit_is_settable(base_trace):
    size = base_trace.stat().st_size
    result = run_main(["audit", "digits", base_trace, "--max-trace-bytes", str(size - 1)])
    assert result.returncode == 2 and f"is {size} bytes, over the audit's limit of {size - 1} bytes" in result.stderr
    assert "--max-trace-bytes" in result.stderr
    assert run_main(["audit", "digits", base_trace, "--max-trace-bytes", str(size)]).returncode == 0


@pytest.mark.parametrize("args, message", [
    (["--steps", "0:3"], "--steps must be FIRST:LAST with 1 <= FIRST <= LAST"),
    (["--steps", "3:2"], "--steps must be FIRST:LAST with 1 <= FIRST <= LAST"),
    (["--steps", "1:2:3"], "--steps must be FIRST:LAST"),
    (["--seed", "-1"], "--seed must be an integer >= 0"),
    (["--public-fraction", "1.5"], "--public-fraction must be a fraction in (0, 1)"),
    (["--public-fraction", "nan"], "--public-fraction must be a fraction in (0, 1)"),
    (["--micro-batches", "5"], "--micro-batches must be an integer >= 1 that divides the batch of 32"),
    (["--micro-batches", "0"], "--micro-batches must be an integer >= 1"),
    (["--run-steps", "0"], "--run-steps must be an integer >= 1"),
    (["--run-steps", "3"], "step 4, outside the run's steps 1 to 3"),
    (["--max-trace-bytes", "0"], "--max-trace-bytes must be an integer >= 1"),
])
def test_bad_audit_settings_exit_2_naming_them(base_trace, args, message):
    result = run_main(["audit", "digits", base_trace, *args])
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_json_path_that_cannot_be_written_exits_2(tmp_path, base_trace):
    result = run_main(["audit", "digits", base_trace, "--json", tmp_path])
    assert result.returncode == 2 and "is a directory" in result.stderr, result.stderr
    (tmp_path / "file").write_text("")
    result = run_main(["audit", "digits", base_trace, "--json", tmp_path / "file" / "out.json"])
    assert result.returncode == 2 and "cannot be written" in result.stderr, result.stderr


def test_a_run_given_more_steps_than_the_experiment_is_audited_with_run_steps(tmp_path, base_trace):
    lines = _lines(base_trace)
    shifted = tmp_path / "long.jsonl"
    shifted.write_text(_text([*lines[:-1], {**lines[-1], "step": 900}]))
    assert run_main(["audit", "digits", shifted]).returncode == 2
    result = run_main(["audit", "digits", shifted, "--run-steps", "900", "--steps", "1:3"])
    assert result.returncode == 0, result.stderr


def test_an_output_naming_a_file_the_command_reads_is_refused_and_the_file_kept(tmp_path):
    """``audit --json TRACE`` would write the report over the trace it attacks, ``run --summary EXP.toml``
    the summary over the experiment: each exits 2 naming the file before anything runs, the file unchanged."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"step": 1}\n')
    result = run_main(["audit", "seed-reverse", trace, "--json", trace])
    assert result.returncode == 2 and f"--json {trace} is the trace this command reads" in result.stderr, result.stderr
    assert trace.read_text() == '{"step": 1}\n'
    experiment = tmp_path / "exp.toml"
    experiment.write_text((BUILTIN_DIR / "seed-reverse.toml").read_text())
    before = experiment.read_text()
    for flag in ("--summary", "--trace"):
        result = run_main(["run", experiment, "--in-process", "--steps", "2", flag, experiment])
        assert result.returncode == 2 and f"{flag} {experiment} is an experiment or stage file" in result.stderr, \
            result.stderr
        assert experiment.read_text() == before
