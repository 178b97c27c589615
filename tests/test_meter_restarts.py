"""The privacy meters and the data owner's input guard survive a restart: taken back from the state a checkpoint
holds (``state``/``load_state``, ``Metering``/``Guarding.checkpoint_state``), they score what the uninterrupted run
scores, bit for bit, after a resume from a checkpoint and after a rollback to an older one."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from distgrad.config.npzfile import write_npz
from distgrad.config.parse import load_experiment
from distgrad.privacy.guard import InputGuard
from distgrad.privacy.meter import INPUTS, LABELS, AttackMeter, LeakMeter
from distgrad.run.inprocess import train_in_process
from distgrad.run.options import StageOptions
from distgrad.run.stage_state import finished_run, nothing_to_do

from conftest import read_json
from test_strong_meters import _digits


# A meter fed as a data owner with one step in flight feeds it: step t+1 is sent before step t is applied.
FED_STEPS, FED_WINDOW = 30, 8
_MIX, _DIRECTIONS = np.random.default_rng(3).normal(size=(4, 6)), np.random.default_rng(4).normal(size=(3, 6))


def _fresh_meters() -> dict:
    return {"labels": LeakMeter(LABELS, FED_WINDOW), "inputs": LeakMeter(INPUTS, FED_WINDOW),
            "averaging": AttackMeter(LABELS, FED_WINDOW), "ridge": AttackMeter(INPUTS, FED_WINDOW),
            "guard": InputGuard(1.0)}


def _send(meters: dict, step: int, seen: dict) -> None:
    """Step ``step``'s two micro-batches of 12 of 60 numbered rows (3 classes), to every meter; the guard's
    score after each goes to ``seen``."""
    for mb in range(2):
        rng = np.random.default_rng([step, mb])
        rows = rng.permutation(60)[:12]
        labels, x = rows % 3, rng.normal(size=(12, 4)).astype(np.float32)
        z = (x @ _MIX + 0.3 * rng.normal(size=(12, 6))).astype(np.float32)
        g = (_DIRECTIONS[labels] + 2.0 * rng.normal(size=(12, 6))).astype(np.float32)
        meters["labels"].observe(step, mb, labels, g)
        meters["inputs"].observe(step, mb, x, z)
        meters["averaging"].observe(step, mb, labels, g, rows)
        meters["averaging"].observe_activations(rows, z)
        meters["ridge"].observe(step, mb, x, z, rows)
        meters["guard"].observe(step, mb, x, z, rows)
        seen[("score", step, mb)] = meters["guard"].score()


def _run_steps(meters: dict, first: int, until: int, seen: dict) -> None:
    """Steps ``first`` to ``until``, each applied (every meter closed, the guard told) after the next is sent."""
    _send(meters, first, seen)
    for step in range(first, until + 1):
        if step < FED_STEPS:
            _send(meters, step + 1, seen)
        for name in ("labels", "inputs", "averaging", "ridge"):
            seen[(name, step)] = meters[name].close(step, step == FED_STEPS)
        meters["guard"].applied(step)


def _states(meters: dict, step: int) -> dict:
    """Each meter's ``state`` after ``step``, through an npz file as a checkpoint holds it."""
    states = {}
    for name, meter in meters.items():
        buffer = io.BytesIO()
        write_npz(buffer, meter.state(step))
        with np.load(io.BytesIO(buffer.getvalue()), allow_pickle=False) as npz:
            states[name] = {key: npz[key] for key in npz.files}
    return states


def _load(meters: dict, states: dict, step: int) -> dict:
    for name, meter in meters.items():
        meter.load_state(states[name], step) if name == "guard" else meter.load_state(states[name])
    return meters


def test_meters_and_a_guard_taken_back_from_their_state_score_bitwise_as_the_uninterrupted_ones():
    """The state after step 13 (step 14 in flight, not kept) loaded into new meters, or into the meters that ran on
    to step 19 (a rollback to an older checkpoint): every window and guard score after step 13 is bitwise the
    uninterrupted run's."""
    uninterrupted: dict = {}
    _run_steps(_fresh_meters(), 1, FED_STEPS, uninterrupted)
    later = {key: value for key, value in uninterrupted.items() if key[1] > 13}
    assert any(later[("averaging", step)] for step in (16, 24)) and later[("ridge", 16)]["ridge_r2_run"] > 0.5
    assert later[("labels", 16)] and later[("inputs", 16)] and later[("score", 20, 1)] is not None
    meters, before = _fresh_meters(), {}
    _run_steps(meters, 1, 13, before)
    states = _states(meters, 13)
    resumed: dict = {}
    _run_steps(_load(_fresh_meters(), states, 13), 14, FED_STEPS, resumed)
    assert resumed == later
    _run_steps(meters, 14, 19, {})
    rolled_back: dict = {}
    _run_steps(_load(meters, states, 13), 14, FED_STEPS, rolled_back)
    assert rolled_back == later
    assert sum(a.nbytes for a in states["averaging"].values()) <= 2 * 60 * 6 * 8 + 60 * 18 + 16   # rows x width


METER_FIELDS = ("label_leaks", "input_leaks", "label_attacks", "input_attacks", "label_leak_extremes",
                "input_leak_extremes", "input_guard")


def _metered_and_guarded(tmp_path: Path, settings: str = "", framework: str = "") -> Path:
    """Digits metered at both stages, windows of 20 steps, the data owner guarded by an input_guard that never
    stops (max_r2 1.0, judged from step 1); ``settings`` more top-level settings, ``framework`` a stage key."""
    path = _digits(tmp_path, f"privacy_meter = true\ninput_guard = {{ max_r2 = 1.0, after = 0 }}\n{framework}",
                   f"privacy_meter = true\n{framework}")
    path.write_text(path.read_text().replace("seed = 0\n", f"seed = 0\neval_every = 20\n{settings}\n", 1))
    return path


# The variants: steps in flight and micro-batches (the meters then hold steps sent but not applied when a
# checkpoint is written, which a restart sends again), and PyTorch stages. The default one covers the same
# checkpoint and rollback paths of the meters and the guard.
@pytest.mark.parametrize("settings, framework", [
    ("", ""),
    pytest.param("staleness = 1\nmicro_batches = 2", "", marks=pytest.mark.slow),
    pytest.param("", 'framework = "torch"', marks=[pytest.mark.slow, pytest.mark.timeout(240)])])   # 4 torch starts
def test_the_meters_and_the_guard_survive_kill_9_of_either_stage_bitwise(tmp_path, stage_group, settings, framework):
    """g killed -9 at step 36 and resumed from its checkpoint of step 25 (f rolls back to it), then f killed at
    72 and resumed from 50: every meter figure and the guard's peak are bitwise the uninterrupted run's (whose
    figures the in-process run gives), on both parties: a resumed meter is the attacker that kept what it
    received, not one that forgot every step before the kill."""
    from test_faults import run_killing_each_stage

    if framework:
        pytest.importorskip("torch")
    path = _metered_and_guarded(tmp_path, settings, framework)
    exp = load_experiment(path)
    reference = train_in_process(exp, steps=120, micro_batches=exp.micro_batches)
    f_summary, g_summary, pair = run_killing_each_stage(stage_group, tmp_path, path, 120)
    assert pair.starts["g"] == pair.starts["f"] == 2 and "resumed run" in pair.logs()
    assert f_summary["params"]["f"] == reference["params"]["f"] and g_summary["params"]["g"] == reference["params"]["g"]
    assert [w["step"] for w in g_summary["label_attacks"]] == [20, 40, 60, 80, 100, 120]
    assert "ridge_r2_run" in f_summary["input_attacks"][0] and f_summary["input_guard"]["peak_step"] >= 1
    for key in METER_FIELDS:
        summary = g_summary if key.startswith("label") else f_summary
        assert summary[key] == reference[key], key
    for name, summary in (("f", f_summary), ("g", g_summary)):    # resumed once finished: nothing to do
        opts = StageOptions(exp, name, exp.seed, steps=120, checkpoint_dir=tmp_path / "ckpt", resume=True,
                            privacy_meter=True)
        again = nothing_to_do(opts, finished_run(opts))
        assert again["status"] == "finished" and [again[key] == summary[key] for key in METER_FIELDS
                                                  if key in summary] == [True] * (4 if name == "f" else 3)


def _without_cost(fields: dict) -> dict:
    """A peer's meter fields without the meter's own time (which counts from a restart)."""
    return {key: value for key, value in fields.items() if not key.endswith("_meter_s")}


@pytest.mark.slow       # five processes; the default kill -9 test above covers the same kept meter and guard
def test_each_clients_meters_and_guard_survive_a_kill_9_of_the_label_owner(tmp_path, stage_group):
    """Three metered, guarded clients: the label owner killed -9 at round 25 resumes from round 20 and the clients
    roll back to it; the label owner's meter of each client and each client's own meter and guard end bitwise
    as in the uninterrupted run."""
    from distgrad.config.experiment import BUILTIN_DIR
    from test_clients import CLIENTS, GUARD, Clients, _reference

    experiment = tmp_path / "guarded.toml"
    experiment.write_text((BUILTIN_DIR / "digits-clients.toml").read_text().replace(
        '"../datasets/', f'"{BUILTIN_DIR.parent / "datasets"}/').replace('name = "f"\n', f'name = "f"\n{GUARD}\n'))
    run = stage_group(Clients, tmp_path, str(experiment), 60, f"ipc://{tmp_path}/g.sock", "--timeout", "0.5",
                      "--peer-deadline", "30", "--privacy-meter")
    run.args["g"] += ["--checkpoint-dir", tmp_path / "g-ckpt", "--checkpoint-every", "10", "--resume"]
    run.start_all_then_kill("g", when="f@0", at_step=25)
    run.start("g")
    run.wait_all()
    assert "resumed run" in run.logs()
    reference = _reference(tmp_path, str(experiment), "--steps", "60", "--privacy-meter")
    g = read_json(tmp_path / "g.json")
    for client in CLIENTS:
        assert _without_cost(g["label_meters"][client]) == _without_cost(reference["label_meters"][client]), client
        own = read_json(tmp_path / f"{client}.json")["input_meters"][client]
        assert _without_cost(own) == _without_cost(reference["input_meters"][client]), client
        assert own["input_guard"]["peak_r2"] > 0 and "ridge_r2_run" in own["input_attacks"][-1]
