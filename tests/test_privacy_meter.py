"""The live privacy meter: what it scores, where its figures go, and that it
changes nothing: a metered run is bitwise the unmetered one, over processes and in one process."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from distgrad.config.defended import meter_kind
from distgrad.config.experiment import BUILTIN_DIR
from distgrad.config.parse import load_experiment
from distgrad.errors import ConfigError
from distgrad.privacy import leaks
from distgrad.privacy.meter import INPUTS, LABELS, LeakMeter, window_steps
from distgrad.run.inprocess import train_in_process
from distgrad.run.options import StageOptions
from distgrad.run.progress import render_bar
from distgrad.wire.codecs import parse_codec
from distgrad.wire.wirecodec import GRADIENT, Senders, stream_micro_batch, stream_name

from conftest import read_json, read_lines, run_launcher, run_main

STEPS = 60


def test_a_window_scores_the_rows_of_its_steps_with_the_shared_measures():
    rng = np.random.default_rng(0)
    meter = LeakMeter(LABELS, window=3)
    rows, labels = [], []
    for step in range(1, 5):
        for mb in range(2):
            y, g = rng.integers(0, 2, 8), rng.normal(size=(8, 3)).astype(np.float32)
            meter.observe(step, mb, y, g)
            if step <= 3:
                rows.append(g)
                labels.append(y)
        figures = meter.close(step)
        assert (figures is None) == (step not in (3,)), step
        if step == 3:
            x, y = np.concatenate(rows), np.concatenate(labels)
            assert figures == {"label_recovery": leaks.label_recovery(x, y), "label_recovery_chance": 0.5,
                               "cosine_auc": leaks.cosine_auc(x, y), "cosine_auc_chance": 0.5,
                               "norm_auc": leaks.norm_auc(x, y), "norm_auc_chance": 0.5,
                               "direction_auc": leaks.direction_auc(x, y), "direction_auc_chance": 0.5}
    assert set(meter.close(4, last=True)) >= {"label_recovery", "norm_auc"}      # the last step closes one


def test_the_input_figure_is_each_whole_batchs_however_the_run_splits_it(tmp_path):
    """The data owner's distance correlation is of each batch's input and activation rows, its micro-batches
    together: in micro-batches of one row it was not scored at all (and of two rows it is always 1)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 5))
    z = np.tanh(x @ rng.normal(size=(5, 3)))
    meter = LeakMeter(INPUTS, window=1)
    for mb in range(8):
        meter.observe(1, mb, x[mb:mb + 1], z[mb:mb + 1])
    dcor, chance = leaks.distance_correlations(x, z)
    assert meter.close(1) == {"distance_correlation": dcor, "distance_correlation_chance": chance}
    path = tmp_path / "metered.toml"
    path.write_text((BUILTIN_DIR / "digits.toml").read_text().replace(
        '"../datasets/', f'"{BUILTIN_DIR.parent / "datasets"}/').replace(
        'optimizer = { type = "adam", lr = 0.003 }\n', 'optimizer = { type = "adam", lr = 0.003 }\nprivacy_meter = true\n', 1))
    whole, split = (train_in_process(load_experiment(path), steps=1, micro_batches=mbs)["input_leaks"][0]
                    for mbs in (1, 32))
    assert split["distance_correlation"] == pytest.approx(whole["distance_correlation"], rel=1e-5)


def test_a_micro_batch_sent_again_replaces_the_first_and_a_rollback_forgets_later_steps():
    meter = LeakMeter(INPUTS, window=10)
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    meter.observe(1, 0, x, np.zeros((4, 2), np.float32))     # constant activations: no correlation
    meter.observe(1, 0, x, x[:, :2] * 2)                       # sent again: this one counts
    meter.observe(2, 0, x, np.zeros((4, 2), np.float32))
    meter.rollback(1)
    figures = meter.close(1, last=True)
    assert figures["distance_correlation"] == pytest.approx(1.0)
    assert figures["distance_correlation_chance"] == leaks.distance_correlation_chance(x, x[:, :2] * 2)


def test_real_valued_targets_have_no_label_figures():
    meter = LeakMeter(LABELS, window=1)
    meter.observe(1, 0, np.array([[0.3], [1.7], [2.2]], np.float32), np.ones((3, 1), np.float32))
    assert meter.close(1) == {}
    assert window_steps(0) == 50 and window_steps(7) == 7


def test_the_senders_tap_reads_what_the_receiver_decodes_in_both_paths():
    x = np.random.default_rng(1).normal(size=(4, 6)).astype(np.float32)
    for how in ("encode", "roundtrip"):
        senders, seen = Senders({GRADIENT: parse_codec("int8")}), []
        senders.taps[GRADIENT].append(lambda value, stream, step: seen.append((value(), stream, step)))
        stream = stream_name(GRADIENT, 1, 3, "client0")
        out = getattr(senders, how)(GRADIENT, x, stream, 7)
        expected = out if how == "roundtrip" else parse_codec("int8").decode(out, x.shape)
        assert len(seen) == 1 and np.array_equal(seen[0][0], expected) and seen[0][1:] == (stream, 7)
        assert not np.array_equal(seen[0][0], x)            # after the codec, not before
    assert stream_micro_batch(stream_name(GRADIENT, 1, 3, "client0")) == (1, 3)


def test_the_bar_shows_a_window_beside_its_chance():
    bar = render_bar(5, 10, 0.5, None, {"label_recovery": 0.9, "label_recovery_chance": 0.1})
    assert "label_recovery 0.900/0.100" in bar


def test_the_bar_the_board_and_the_plot_show_the_strongest_attacks_beside_the_windows():
    """A window's figure alone understates what a determined party gets: the progress bar, TensorBoard and
    the plot show the whole-run attacks' figures (averaging, model completion, the ridge decoder) too."""
    window = {"distance_correlation": 0.9, "distance_correlation_chance": 0.7, "ridge_r2": 0.8,
              "ridge_r2_chance": 0.0, "ridge_r2_run": 0.85, "ridge_r2_run_chance": 0.0}
    bar = render_bar(5, 10, 0.5, None, window)
    assert "ridge_r2 0.800/0.000" in bar and "ridge_r2_run 0.850/0.000" in bar
    from distgrad.run.progress import TensorBoardWriter
    board, tags = TensorBoardWriter(None), []
    board._writer = type("Recorder", (), {"add_scalar": lambda self, tag, value, step: tags.append(tag)})()
    board.write({"step": 50, "averaged_recovery_1": 0.7, "averaged_recovery_1_chance": 0.1,
                 "model_completion": 0.9, "model_completion_chance": 0.1, **window})
    assert {"privacy/averaged_recovery_1", "privacy/model_completion_chance", "privacy/ridge_r2",
            "privacy/ridge_r2_run", "privacy/distance_correlation"} <= set(tags)
    pytest.importorskip("matplotlib")
    from distgrad.plot import draw_metrics
    records = [{"step": s, "loss": 1.0 / s, "wall_s": 0.01 * s, **window} for s in (50, 100)]
    figure = draw_metrics(records, "metered")
    labels = {text.get_text() for ax in figure.axes if ax.get_legend() for text in ax.get_legend().get_texts()}
    assert {"ridge_r2", "ridge_r2_run", "distance_correlation"} <= labels


def _toml(value):
    """``value`` as a TOML value (inline tables for dicts)."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{key} = {_toml(v)}" for key, v in value.items()) + " }"
    return json.dumps(value)


def _combined(tmp_path, **changes):
    """digits as a file, with ``changes`` to its stages' tables (``{stage index: {key: value}}``)."""
    text = (BUILTIN_DIR / "digits.toml").read_text().replace('"../datasets/', f'"{BUILTIN_DIR.parent}/datasets/')
    for index, table in changes.items():
        parts = text.split("[[stages]]")
        parts[int(index[1:]) + 1] += "".join(f"{key} = {_toml(value)}\n" for key, value in table.items())
        text = "[[stages]]".join(parts)
    path = tmp_path / "digits-metered.toml"
    path.write_text(text)
    return path


def test_bad_meter_settings_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="'privacy_meter' must be true or false"):
        load_experiment(_combined(tmp_path, s1={"privacy_meter": "yes"}))
    chain = load_experiment("chain4-classify")
    with pytest.raises(ConfigError, match="'privacy_meter'.*a middle stage holds neither"):
        meter_kind(chain, chain.stage_names[1])
    # Several data owners: each meters its own inputs, the label owner its labels (one meter per data owner).
    clients, vertical = load_experiment("digits-clients"), load_experiment("vertical-classify")
    assert (meter_kind(clients, "f"), meter_kind(clients, "g")) == (INPUTS, LABELS)
    assert [meter_kind(vertical, name) for name in vertical.stage_names] == [INPUTS, INPUTS, INPUTS, LABELS]
    # With secure aggregation no party's embedding reaches the label owner alone: nothing of a party's to meter.
    secure = replace(vertical, aggregate="sum", secure_aggregation=True)
    with pytest.raises(ConfigError, match="'privacy_meter'.*secure_aggregation.*masked sum"):
        meter_kind(secure, "a")
    assert meter_kind(secure, "g") == LABELS
    with pytest.raises(ConfigError, match="--privacy-meter.*middle stage"):
        StageOptions(chain, chain.stage_names[1], 0, privacy_meter=True)
    # A refused meter exits 2 before any stage starts.
    bad = _combined(tmp_path, s1={"privacy_meter": 1})
    result = run_launcher(["run", bad, "--steps", 2])
    assert result.returncode == 2 and "privacy_meter" in result.stderr


def test_a_label_owner_with_real_valued_targets_refuses_its_meter_rather_than_measuring_nothing(tmp_path):
    """The label meter scores class labels; a regression's label owner (real-valued targets) would run with
    'privacy_meter' on and report no figure. It is refused with the reason; --privacy-meter meters the data
    owner alone there."""
    text = (BUILTIN_DIR / "chain-regression.toml").read_text()
    path = tmp_path / "metered.toml"
    path.write_text(text.replace('name = "g"\n', 'name = "g"\nprivacy_meter = true\n'))
    with pytest.raises(ConfigError, match="'privacy_meter'.*real-valued"):
        load_experiment(path)
    tanh = load_experiment("tanh-regression")
    with pytest.raises(ConfigError, match="'privacy_meter'.*real-valued"):
        meter_kind(tanh, tanh.stage_names[-1])
    summary = train_in_process(tanh, steps=60, privacy_meter=True)
    assert summary["input_leaks"] and "label_leaks" not in summary
    assert meter_kind(load_experiment("digits"), "g") == LABELS


def test_a_metered_run_over_processes_is_bitwise_the_unmetered_and_meters_as_in_process(tmp_path):
    """Micro-batches and a gradient codec; both stages metered (the key on g, the flag on f)."""
    path = _combined(tmp_path, s1={"privacy_meter": True})
    args = [path, "--steps", STEPS, "--micro-batches", 2, "--gradient-codec", "int8", "--eval-every", 25]
    plain = run_main(["run", "digits", *args[1:], "--in-process", "--summary", tmp_path / "plain.json"])
    assert plain.returncode == 0, plain.stderr
    metered = run_launcher(["run", *args, "--privacy-meter", "--summary", tmp_path / "run.json",
                            "--metrics", tmp_path / "m.jsonl"])
    assert metered.returncode == 0, metered.stdout + metered.stderr
    local = run_main(["run", *args, "--privacy-meter", "--in-process", "--summary", tmp_path / "local.json"])
    assert local.returncode == 0, local.stderr
    plain, run, local = (read_json(tmp_path / f"{name}.json") for name in ("plain", "run", "local"))
    assert run["params"] == plain["params"] == local["params"]
    assert [w["step"] for w in run["label_leaks"]] == [25, 50, 60]          # windows of eval_every, and the last
    assert run["label_leaks"] == local["label_leaks"] and run["input_leaks"] == local["input_leaks"]
    assert run["label_leaks"][-1]["label_recovery"] > 0.9 > run["label_leaks"][-1]["label_recovery_chance"]
    # Each party's figures in its own metrics: the data owner's in PATH, the label owner's in PATH.g.
    lines = {line["step"]: line for line in read_lines(tmp_path / "m.jsonl")}
    assert lines[50]["distance_correlation"] == run["input_leaks"][1]["distance_correlation"]
    assert "label_recovery" not in lines[50]
    label_lines = {line["step"]: line for line in read_lines(tmp_path / "m.g.jsonl")}
    assert label_lines[50]["label_recovery"] == run["label_leaks"][1]["label_recovery"]
    assert label_lines[60]["cosine_auc_chance"] == 0.5 and "label_recovery" not in label_lines[49]
    assert "privacy meter, label owner's labels" in metered.stdout


def test_torch_stages_meter_alike_in_process(tmp_path):
    pytest.importorskip("torch")
    path = _combined(tmp_path, s0={"framework": "torch"}, s1={"framework": "torch", "privacy_meter": True})
    summary = train_in_process(load_experiment(path), steps=20)
    assert [w["step"] for w in summary["label_leaks"]] == [20]
    assert 0 <= summary["label_leaks"][0]["label_recovery"] <= 1


def test_a_long_window_scores_evenly_spaced_steps():
    meter = LeakMeter(INPUTS, window=50)
    assert [step for step in range(1, 101) if meter.wants(step)] == [*range(1, 50, 12), *range(51, 100, 12)]


@pytest.mark.slow
def test_a_metered_run_killed_and_resumed_is_bitwise_the_unmetered(tmp_path, stage_group):
    """kill -9 of either stage and --resume: the meter keeps no state, and the run still ends bitwise."""
    from test_faults import Pair
    from conftest import free_tcp_endpoint

    steps = "300"
    pair = stage_group(Pair, tmp_path, "digits", steps, free_tcp_endpoint())
    for name in ("f", "g"):
        pair.args[name] += ["--privacy-meter"]
    pair.args["f"] += ["--micro-batches", "2"]
    pair.start("g")
    pair.start("f")
    for victim, target in (("g", 90), ("f", 190)):
        pair.wait_for_step(target)
        pair.kill_9_and_restart(victim)
    f_summary, g_summary = pair.finish()
    reference = train_in_process(load_experiment("digits"), steps=int(steps), micro_batches=2)
    assert f_summary["params"]["f"] == reference["params"]["f"]
    assert g_summary["params"]["g"] == reference["params"]["g"]
    assert f_summary["input_leaks"][-1]["step"] == g_summary["label_leaks"][-1]["step"] == int(steps)


def test_the_python_api_meters_both_parties():
    from distgrad.api import drive_stage, serve_stage

    with serve_stage("digits", steps=30, privacy_meter=True) as g:
        f_summary = drive_stage("digits", g.endpoint, steps=30, privacy_meter=True)
        g_summary = g.wait()
    assert [w["step"] for w in f_summary["input_leaks"]] == [w["step"] for w in g_summary["label_leaks"]] == [30]
    reference = train_in_process(load_experiment("digits"), steps=30, privacy_meter=True)
    assert f_summary["input_leaks"] == reference["input_leaks"]
    assert g_summary["label_leaks"] == reference["label_leaks"]


def test_the_meter_reads_what_the_defenses_leave_and_scores_the_true_labels(tmp_path):
    """In one process (bitwise what the processes do): clip_noise on the gradient rows lowers what the meter
    recovers; with label_dp the meter still scores the label owner's true labels, not the randomized ones."""
    plain = train_in_process(load_experiment(_combined(tmp_path, s1={"privacy_meter": True})), steps=50)
    noisy = train_in_process(load_experiment(_combined(
        tmp_path, s1={"privacy_meter": True, "clip_noise": {"max_norm": 0.05, "sigma": 0.5}})), steps=50)
    assert noisy["label_leaks"][0]["label_recovery"] < plain["label_leaks"][0]["label_recovery"] - 0.3
    exp = load_experiment(_combined(tmp_path, s1={"label_dp": {"epsilon": 0.5}}))
    data = exp.build_data(stage="g")
    true = load_experiment("digits").build_data(stage="g")
    assert np.array_equal(data.true_targets(3), true.targets(3))
    assert not all(np.array_equal(data.targets(s), true.targets(s)) for s in range(1, 4))
