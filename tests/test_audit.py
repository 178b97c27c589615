"""``distgrad audit`` (issue 23, point 5): the attacks of the other party on a run's recorded view of the cut.

The view is what crossed, as the receiver decoded it (the trace's ``sent_activation_grad`` and
``sent_activation``); the audit scores it with the live meter's measures, so on the same rows the two
agree, and a defended run's view gives less away."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distgrad.config.experiment import BUILTIN_DIR
from distgrad.privacy import audit, leaks

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
            assert abs(report["labels"][name] - meter_labels[name]) <= 0.02, (name, window)
        assert abs(report["inputs"]["distance_correlation"] - meter_inputs["distance_correlation"]) <= 0.02
    assert report["labels"]["label_recovery"] == 1.0 and report["labels"]["clustering_accuracy"] > 0.8
    assert report["inputs"]["linear_reconstruction_mse"] < report["inputs"]["reconstruction_mse_chance"]
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
    assert abs(report["labels"]["label_recovery"] - meter["label_recovery"]) <= 0.02     # what crossed, defended
    assert abs(report["labels"]["cosine_auc"] - meter["cosine_auc"]) <= 0.02
    assert report["labels"]["label_recovery"] < 0.6 and report["labels"]["clustering_accuracy"] < 0.6


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
