"""The meters of the strongest attacks (per-row averaging of the gradients received, model completion, the best
ridge decoder of the inputs) agree with independent attackers (benchmarks/attackers.py) on what crossed the
wire; the data owner's input_guard stops a hijacking label owner before it reconstructs the inputs and never
stops an honest run."""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from distgrad.config.defended import check_defenses
from distgrad.config.experiment import BUILTIN_DIR
from distgrad.config.parse import load_experiment
from distgrad.errors import ConfigError, InputGuardStop
from distgrad.privacy import leaks
from distgrad.privacy.guard import InputGuard
from distgrad.privacy.meter import AttackMeter, INPUTS, LABELS, extremes
from distgrad.run.inprocess import train_in_process

from conftest import read_json, run_launcher
from hijacking import hijack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import attackers  # noqa: E402

TOLERANCE = 0.05


def _digits(tmp_path: Path, f_extra: str = "", g_extra: str = "") -> Path:
    """The built-in digits experiment with ``f_extra`` in the data owner's table and ``g_extra`` in the label
    owner's."""
    text = (BUILTIN_DIR / "digits.toml").read_text().replace('"../datasets/', f'"{BUILTIN_DIR.parent / "datasets"}/')
    text = text.replace('name = "f"\n', f'name = "f"\n{f_extra}\n', 1)
    path = tmp_path / "digits.toml"
    path.write_text(f"{text.rstrip()}\n{g_extra}\n")
    return path


def _guarded(max_r2: float | None, after: int = 50, nopeek: float = 7.0):
    """Digits with the data owner's NoPeek ``nopeek`` and ``input_guard = { max_r2, after }`` (None: unguarded)."""
    exp = load_experiment("digits")
    f = exp.stages[0]
    f = replace(f, defenses=replace(f.defenses, nopeek=nopeek),
                input_guard=None if max_r2 is None else (max_r2, after))
    return replace(exp, stages=[f, *exp.stages[1:]])


def test_anchored_recovery_and_the_ridge_r2_score_what_they_say():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(3), 20)
    rows = np.eye(3)[labels] + 0.1 * rng.normal(size=(60, 3))
    assert leaks.anchored_recovery(rows, labels, 1) == 1.0
    assert leaks.anchored_recovery(rng.normal(size=(60, 3)), labels, 1) < 0.7
    assert leaks.few_shot_accuracy(rows, labels, 5) == 1.0
    x = rng.normal(size=(400, 5))
    public, private = leaks.RidgeStats(), leaks.RidgeStats()
    public.add(x[:100] @ rng.normal(size=(5, 8)), x[:100])
    z = x @ rng.normal(size=(5, 8))
    public, private = leaks.RidgeStats(), leaks.RidgeStats()
    public.add(z[:100], x[:100])
    private.add(z[100:], x[100:])
    assert leaks.ridge_r2(public, private) == pytest.approx(1.0, abs=1e-6)       # an invertible linear map
    noise = leaks.RidgeStats()
    noise.add(rng.normal(size=(100, 8)), x[:100])
    assert leaks.ridge_r2(noise, private) < 0.1


def test_the_attack_meter_averages_every_step_and_reports_worst_and_whole_run():
    rng = np.random.default_rng(1)
    meter = AttackMeter(LABELS, window=2)
    labels = np.arange(40) % 4
    directions = rng.normal(size=(4, 6))
    for step in range(1, 5):
        rows = rng.permutation(40)[:20]
        sent = directions[labels[rows]] + 3.0 * rng.normal(size=(20, 6))    # one step alone says little
        meter.observe(step, 0, labels[rows], sent, rows)
        figures = meter.close(step)
        if step % 2:
            assert figures is None
    assert 0 <= figures["averaged_recovery_1"] <= 1 and figures["averaged_recovery_1_chance"] == 0.25
    windows = [{"step": 2, "ridge_r2": 0.5, "ridge_r2_run": 0.4, "ridge_r2_chance": 0.0},
               {"step": 4, "ridge_r2": 0.9, "ridge_r2_run": 0.7, "ridge_r2_chance": 0.0},
               {"step": 6, "ridge_r2": 0.6, "ridge_r2_run": 0.65, "ridge_r2_chance": 0.0}]
    assert extremes(windows)["ridge_r2"] == {"worst": 0.9, "worst_step": 4, "mean": pytest.approx(2 / 3),
                                             "last": 0.6, "chance": 0.0, "run": 0.65}
    inputs = AttackMeter(INPUTS, window=1)
    x = rng.normal(size=(50, 4))
    inputs.observe(1, 0, x, x @ rng.normal(size=(4, 6)), np.arange(50))
    assert inputs.close(1)["ridge_r2"] == pytest.approx(1.0, abs=1e-6)


def test_the_guard_scores_invertible_rows_high_and_noise_low_and_judges_after_its_start():
    rng = np.random.default_rng(2)
    guard, blind = InputGuard(0.75, after=3), InputGuard(0.75)
    mix = rng.normal(size=(8, 16))
    for step in range(1, 30):
        x = rng.normal(size=(32, 8))
        guard.observe(step, 0, x, x @ mix)
        blind.observe(step, 0, x, rng.normal(size=(32, 16)))
    assert guard.score() > 0.99 and blind.score() < 0.2
    assert not guard.judges(3) and guard.judges(4)


def test_a_guard_stop_in_a_later_micro_batch_says_which_of_the_step_crossed_and_nothing_after_does():
    """Micro-batches: the guard judges each one before it leaves. When the second of a step passes max_r2 the
    first has crossed already; the stop says so instead of claiming nothing of the step was sent."""
    from types import SimpleNamespace
    from distgrad.run.metering import Guarding
    from distgrad.wire.wirecodec import ACTIVATION, stream_name
    rng = np.random.default_rng(3)
    engine = SimpleNamespace(senders=SimpleNamespace(taps={ACTIVATION: []}), observers=[])
    inputs = {step: rng.normal(size=(128, 8)) for step in range(1, 8)}
    Guarding(engine, inputs.__getitem__, (0.3, 3), "f")
    tap, mix, sent = engine.senders.taps[ACTIVATION][0], rng.normal(size=(8, 16)), []
    with pytest.raises(InputGuardStop) as stop:
        for step in range(1, 8):
            for mb in range(2):
                x = inputs[step][mb * 64:(mb + 1) * 64]
                z = x @ mix if (step, mb) == (5, 1) else rng.normal(size=(64, 16))    # invertible, then stop
                tap(lambda z=z: z, stream_name(ACTIVATION, mb, 2), step)
                sent.append((step, mb))
            for observe in engine.observers:
                observe(SimpleNamespace(step=step))
    assert sent[-1] == (5, 0)
    assert "micro-batches 2 to 2 of step 5 were not sent (micro-batches 1 to 1 had crossed" in str(stop.value)
    assert "nothing of the step was applied or checkpointed" in str(stop.value)


def test_input_guard_is_a_setting_of_each_data_owner(tmp_path):
    for table, extra, message in ((0, 'input_guard = { max_r2 = 1.5 }', "max_r2 = R"),
                                  (0, 'input_guard = { max_r2 = 0.5, before = 2 }', "max_r2 = R"),
                                  (1, 'input_guard = { max_r2 = 0.5 }', "data owner")):
        path = _digits(tmp_path, extra if table == 0 else "", extra if table == 1 else "")
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_experiment(path)
    clients = (BUILTIN_DIR / "digits-clients.toml").read_text().replace(
        '"../datasets/', f'"{BUILTIN_DIR.parent / "datasets"}/').replace(
        'name = "f"\n', 'name = "f"\ninput_guard = { max_r2 = 0.5 }\n', 1)
    (tmp_path / "clients.toml").write_text(clients)
    assert load_experiment(tmp_path / "clients.toml").spec("f").input_guard == (0.5, 50)   # each client's own
    vertical = load_experiment("vertical-classify")
    party, *others, label_owner = vertical.stages
    check_defenses(replace(vertical, stages=[replace(party, input_guard=(0.5, 0)), *vertical.stages[1:]]))
    with pytest.raises(ConfigError, match=r"input_guard.*a feature party"):
        check_defenses(replace(vertical, stages=[party, *others, replace(label_owner, input_guard=(0.5, 0))]))
    with pytest.raises(ConfigError, match=r"input_guard.*secure_aggregation.*masked sum"):
        check_defenses(replace(vertical, aggregate="sum", secure_aggregation=True,
                               stages=[replace(party, input_guard=(0.5, 0)), *vertical.stages[1:]]))


def test_the_guard_stops_a_hijacking_label_owner_before_it_reconstructs_and_never_an_honest_run(monkeypatch):
    """Digits, the data owner's NoPeek weight 7 and max_r2 0.75: a label owner that returns its decoder's error
    gradient is stopped before the private rows' reconstruction R^2 reaches 0.8; the honest run (800 steps) is
    never stopped, and trains bitwise as the unguarded run."""
    honest = train_in_process(_guarded(0.75))
    assert honest["input_guard"]["peak_r2"] <= 0.75
    plain = train_in_process(_guarded(None))
    assert honest["params"] == plain["params"]
    exp = _guarded(0.75)
    attacker = hijack(monkeypatch, exp.build_data(0, stage="g"), 64)
    with pytest.raises(InputGuardStop, match=r"input_guard stopped the run before sending step (\d+)") as stop:
        train_in_process(exp)
    stopped = int(re.search(r"step (\d+)", str(stop.value)).group(1))
    assert stopped < 200
    reached = [max(r2) for step, r2 in attacker.reconstruction.items() if step < stopped]
    assert max(reached) < 0.8
    unguarded = _guarded(None)
    monkeypatch.undo()
    attacker = hijack(monkeypatch, unguarded.build_data(0, stage="g"), 64)
    train_in_process(unguarded, steps=400)
    assert max(max(r2) for r2 in attacker.reconstruction.values()) > 0.85     # unstopped, it gets there


def test_a_guard_stop_over_processes_exits_5_and_writes_no_newer_checkpoint(tmp_path):
    path = _digits(tmp_path, 'input_guard = { max_r2 = 0.2, after = 5 }')
    checkpoints = tmp_path / "ck"
    result = run_launcher(["run", path, "--steps", "40", "--checkpoint-dir", checkpoints, "--checkpoint-every", "1"])
    assert result.returncode == 5, result.stdout + result.stderr
    assert "input_guard" in result.stderr and "max_r2" in result.stderr
    stopped = int(re.search(r"before sending step (\d+)", result.stdout + result.stderr).group(1))
    assert stopped > 5       # judged after its first 5 steps, once it holds enough rows
    saved = sorted(int(m.group(1)) for p in checkpoints.glob("f-*.ckpt")
                   if (m := re.search(r"-(\d+)\.ckpt$", p.name)))
    assert saved and max(saved) == stopped - 1        # the last checkpoint before the breach, nothing newer


@pytest.mark.slow
def test_the_strong_meters_agree_with_independent_attackers_on_what_crossed(tmp_path):
    """A defended run over processes, traced: each whole-run figure of the meters is within 0.05 of an
    independent attacker of the same kind reading the tensors the trace recorded as they crossed."""
    path = _digits(tmp_path, "", "clip_noise = { max_norm = 0.05, sigma = 0.5 }")
    trace, summary = tmp_path / "run.jsonl", tmp_path / "run.json"
    result = run_launcher(["run", path, "--steps", "180", "--eval-every", "45", "--privacy-meter", "--trace", trace,
                           "--trace-params", "sent_activation_grad,sent_activation", "--summary", summary])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_json(summary)
    exp = load_experiment(path)
    data, features = exp.build_data(0, stage="g"), exp.build_data(0, stage="f")
    labels = data.all_targets()
    grads = attackers.trace_tensors(trace, "sent_activation_grad")
    acts = attackers.trace_tensors(trace, "sent_activation")
    assert len(grads) == len(acts) == 180
    meter = summary["label_attacks"][-1]
    rows, means = attackers.row_means(grads, data.step_rows)
    for known, seeds in ((1, 100), (10, 20)):        # one known row: the figure swings with which one
        independent = np.mean([attackers.averaging_attack(rows, means, labels, known, seed) for seed in range(seeds)])
        assert abs(meter[f"averaged_recovery_{known}"] - independent) <= TOLERANCE, (known, meter, independent)
    completion = np.mean([attackers.completion_attack(acts, data.step_rows, labels, 10, seed) for seed in range(20)])
    assert abs(meter["model_completion"] - completion) <= TOLERANCE, (meter["model_completion"], completion)
    steps = sorted(acts)
    z = np.concatenate([acts[s] for s in steps])
    x = np.concatenate([features.features(s) for s in steps])
    run_r2 = np.mean([attackers.ridge_attack(z, x, seed) for seed in range(3)])
    inputs = summary["input_attacks"][-1]
    assert abs(inputs["ridge_r2_run"] - run_r2) <= TOLERANCE, (inputs, run_r2)
    window = [s for s in steps if s > 135]
    window_r2 = np.mean([attackers.ridge_attack(np.concatenate([acts[s] for s in window]),
                                                np.concatenate([features.features(s) for s in window]), seed)
                         for seed in range(3)])
    assert abs(inputs["ridge_r2"] - window_r2) <= TOLERANCE, (inputs, window_r2)
    assert summary["label_leak_extremes"]["averaged_recovery_1"]["run"] == meter["averaged_recovery_1"]
    assert "worst" in summary["input_leak_extremes"]["ridge_r2"]
    print({"meter": {**meter, **inputs}, "independent": {"averaged": "see asserts", "completion": completion,
                                                         "ridge_run": run_r2, "ridge_window": window_r2}})


@pytest.mark.parametrize("framework", ["numpy", pytest.param("torch", marks=pytest.mark.slow)])
def test_the_strong_meters_and_the_guard_meter_over_processes_as_in_one_and_change_nothing(tmp_path, framework):
    """Micro-batches and an activation codec, numpy or PyTorch stages: the strong attacks' windows, each
    figure's extremes and the guard's peak are the same over processes as in one, and the metered, guarded
    run's parameters are bitwise the plain run's."""
    if framework == "torch":
        pytest.importorskip("torch")
    torch = f'framework = "{framework}"'
    path = _digits(tmp_path, f"{torch}\ninput_guard = {{ max_r2 = 1.0, after = 0 }}", torch)
    plain_path = tmp_path / "plain.toml"
    plain_path.write_text(path.read_text().replace("input_guard = { max_r2 = 1.0, after = 0 }", ""))
    common = ["--steps", "40", "--micro-batches", "2", "--activation-codec", "int8", "--eval-every", "20"]
    plain = run_launcher(["run", plain_path, *common, "--summary", tmp_path / "plain.json"])
    assert plain.returncode == 0, plain.stdout + plain.stderr
    metered = run_launcher(["run", path, *common, "--privacy-meter", "--summary", tmp_path / "run.json"])
    assert metered.returncode == 0, metered.stdout + metered.stderr
    local = run_launcher(["run", path, *common, "--privacy-meter", "--in-process", "--summary", tmp_path / "local.json"])
    assert local.returncode == 0, local.stdout + local.stderr
    plain, run, local = (read_json(tmp_path / f"{name}.json") for name in ("plain", "run", "local"))
    assert run["params"] == plain["params"] == local["params"]
    for key in ("label_attacks", "input_attacks", "label_leak_extremes", "input_leak_extremes", "input_guard"):
        assert run[key] == local[key], key
    assert [w["step"] for w in run["label_attacks"]] == [20, 40]
    assert set(run["label_attacks"][-1]) >= {"averaged_recovery_1", "averaged_recovery_10", "model_completion"}
    assert set(run["input_attacks"][-1]) >= {"ridge_r2", "ridge_r2_run", "ridge_r2_chance"}
    assert 0 < run["input_guard"]["peak_r2"] <= 1
    assert "worst" in metered.stdout and "ridge_r2" in metered.stdout


@pytest.mark.parametrize("end,party", [("first", "b"), ("last", "g")])
def test_the_cut_library_refuses_a_combined_experiments_meter_and_guard_rather_than_ignoring_them(tmp_path, end,
                                                                                                  party):
    """A ``Cut`` driving a feature party (or a ``CutServer``) given a combined experiment whose stage meters or
    guards is refused naming the key: the library's loop would send unmetered and unguarded."""
    from distgrad.run.cut_interface import cut_side
    text = (BUILTIN_DIR / "vertical-classify.toml").read_text()
    setting = "input_guard = { max_r2 = 0.5 }" if party == "b" else "privacy_meter = true"
    path = tmp_path / "v.toml"
    path.write_text(text.replace(f'name = "{party}"\n', f'name = "{party}"\n{setting}\n'))
    with pytest.raises(ConfigError, match=f"stage '{party}' has .*{setting.split()[0]}.* meters and guards nothing"):
        cut_side(end, path, {}, party=party if end == "first" else None)
    assert cut_side("first", path, {}, party="a").stage == "a"        # another party's own setting is its own
