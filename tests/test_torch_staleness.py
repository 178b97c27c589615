"""Steps in flight (``--staleness S``) with a PyTorch first stage.

A torch stage's training forward computes with its own copy of the
parameters, so its graph stays valid while the optimizer updates the live
ones in place before its backward; the forward state it changes (batch
norm's running statistics) is kept before each step in flight, so the steps
sent again after a rollback or restart count each forward once.

Oracles: the backward of a forward made before an update equals the backward
of the same forward made without it (bitwise); a first stage stale for the
whole run feeds g its initial activations; runs over processes equal the
in-process reference bit for bit (parameters, losses, evaluations, which
use the running statistics), through kill -9 and restart of either stage.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import StageGroup, read_json, run_launcher, run_main
from distgrad.config.parse import load_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.stage.records import to_lists
from distgrad.stage.stage import Stage

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'distgrad[torch]'); "
                                               "CI installs it and sets DISTGRAD_REQUIRE=torch")

DIGITS = Path(__file__).resolve().parents[1] / "distgrad" / "datasets" / "digits.npz"

# Batch norm (running statistics: forward state) and dropout (masks seeded by step and micro-batch).
MODEL = '''
from torch import nn


def make(hidden=16):
    return nn.Sequential(nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.2))
'''
EXPERIMENT = f"""
name = "stale-norm"
steps = 40
seed = 3
labels = "last"

[data]
kind = "npz"
path = "{DIGITS}"
features = "pixels"
labels = "digit"
feature_scale = 0.0625
batch = 16
test_fraction = 0.2

[[stages]]
name = "f"
module = "stalemodel:make"
output = [16]
optimizer = {{ type = "Adam", lr = 0.01 }}

[[stages]]
name = "g"
model = [{{ type = "dense", name = "g1", in = 16, out = 10 }}]
optimizer = {{ type = "adam", lr = 0.01 }}
loss = "softmax_cross_entropy"
"""


LAYERS = """framework = "torch"
model = [{ type = "dense", name = "f1", in = 64, out = 16 }, { type = "tanh" }]
optimizer = { type = "adam", lr = 0.01 }"""


def _experiment(directory: Path, layers: bool = False) -> Path:
    """The experiment with the module above as f; with ``layers``, f is a layer list built in torch instead."""
    (directory / "stalemodel.py").write_text(MODEL)
    path = directory / "stale-norm.toml"
    text = EXPERIMENT
    if layers:
        text = text.replace('module = "stalemodel:make"\noutput = [16]\noptimizer = { type = "Adam", lr = 0.01 }',
                            LAYERS)
        assert LAYERS in text
    path.write_text(text)
    return path


def _reference(tmp_path: Path, experiment: str | Path, *flags: str) -> dict:
    path = tmp_path / "reference.json"
    result = run_main(["run", experiment, "--in-process", "--summary", path, *flags])
    assert result.returncode == 0, result.stderr
    return read_json(path)


def test_a_backward_after_updates_gives_the_gradients_at_its_forwards_parameters(tmp_path):
    """The staleness contract of ``Stage.forward``: updates between a forward and its backward change
    nothing of that backward (before the fix, torch refused: a saved tensor was modified in place)."""
    exp = load_experiment(_experiment(tmp_path))
    data = exp.build_data(stage="f")
    x, dy = data.features(1), np.random.default_rng(0).normal(size=(16, 16)).astype(np.float32)
    stale, fresh = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "f")
    _, cache = stale.forward(x)
    for step in (2, 3):                       # two updates before the backward of the first forward
        stale.apply(stale.backward(stale.forward(data.features(step))[1], dy, need_dx=False)[1])
    stale.step = 0                            # as the driver's ``_as_of`` sets it for the backward
    _, expected = fresh.backward(fresh.forward(x)[1], dy, need_dx=False)
    _, grads = stale.backward(cache, dy, need_dx=False)
    assert grads.keys() == expected.keys()
    for name, g in expected.items():
        assert np.array_equal(grads[name], g), name


@pytest.mark.parametrize("layers", [False, True], ids=["module", "layer-list"])
def test_a_torch_first_stage_stale_for_the_whole_run_feeds_its_initial_activations(tmp_path, layers):
    exp, steps = load_experiment(_experiment(tmp_path, layers)), 12
    stale = train_in_process(exp, steps=steps, staleness=steps)
    f, g = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    features, targets = exp.build_data(stage="f"), exp.build_data(stage="g")
    for step in range(1, steps + 1):         # g alone learns, from the initial f's activations
        f.step = step - 1                     # the dropout masks of step ``step``
        y, _ = f.forward(features.features(step))
        _, _, grads = g.loss_micro_batch(y, targets.targets(step))
        g.apply(grads)
    assert stale["params"]["g"] == to_lists(g.params)
    assert stale["params"]["f"] != to_lists(f.params)        # f did learn: its updates came after the forwards


def test_the_builtin_torch_cnn_trains_with_steps_in_flight_in_process():
    """A torch CNN first stage with staleness 2 trains (it once exited 1 at step 2: a variable needed for the gradient modified in place)."""
    result = run_main(["run", "digits-cnn-torch", "--staleness", "2", "--steps", "30", "--in-process"])
    assert result.returncode == 0, result.stderr


# The built-in over processes is slow-marked (two more PyTorch processes, to keep the default suite inside its
# five minutes); the own module, with batch norm and dropout, runs in the default suite.
@pytest.mark.parametrize("own,flags", [
    (True, ["--staleness", "2", "--micro-batches", "2", "--steps", "40", "--eval-every", "10"]),
    pytest.param(False, ["--staleness", "2", "--steps", "30"], marks=pytest.mark.slow),    # digits-cnn-torch
])
def test_stale_torch_runs_over_processes_equal_the_in_process_reference(tmp_path, own, flags):
    experiment = _experiment(tmp_path) if own else "digits-cnn-torch"
    path = tmp_path / "run.json"
    result = run_launcher(["run", experiment, "--summary", path, "--progress", "off", *flags])
    assert result.returncode == 0, result.stdout + result.stderr
    summary, reference = read_json(path), _reference(tmp_path, experiment, *flags)
    assert summary["params"] == reference["params"]
    assert summary["final_loss"] == reference["final_loss"]
    assert summary["evaluations"] == reference["evaluations"]


class StaleTorchPair(StageGroup):
    def __init__(self, tmp_path: Path, steps: int, endpoint: str) -> None:
        super().__init__(tmp_path)
        experiment = _experiment(tmp_path)
        common = ["--experiment", experiment, "--steps", str(steps), "--checkpoint-dir", tmp_path / "ckpt",
                  "--checkpoint-every", "7", "--resume", "--timeout", "0.5", "--peer-deadline", "30"]
        self.args = {"g": ["g", "--bind", endpoint, "--summary", tmp_path / "g.json", *common],
                     "f": ["f", "--connect", endpoint, "--summary", tmp_path / "f.json", "--trace",
                           tmp_path / "f.jsonl", "--trace-params", "0.bias", "--staleness", "2",
                           "--micro-batches", "2", "--save", tmp_path / "f.pt", *common]}


@pytest.mark.slow       # about 8 s; test_staleness.py's numpy kill -9 with steps in flight runs by default
def test_kill_9_of_either_stage_with_torch_steps_in_flight_changes_nothing(tmp_path, stage_group):
    """kill -9 of f, then of g, mid-run with two steps in flight; each restarted with its command line:
    both stages' parameters, f's batch norm statistics and the final evaluation (which uses them) equal
    the uninterrupted in-process run."""
    steps = 400
    pair = stage_group(StaleTorchPair, tmp_path, steps, f"ipc://{tmp_path}/g.sock")
    pair.start("g")
    pair.start("f")
    for victim, at in (("f", 100), ("g", 200)):
        pair.wait_until(lambda: pair.lines("f.jsonl") >= at, f"f to reach step {at}")
        pair.kill_9_and_restart(victim)
    pair.wait_all()
    reference = _reference(tmp_path, tmp_path / "stale-norm.toml", "--steps", str(steps), "--staleness", "2",
                           "--micro-batches", "2", "--save", tmp_path / "ref")
    f = read_json(tmp_path / "f.json")
    assert f["params"]["f"] == reference["params"]["f"]
    assert read_json(tmp_path / "g.json")["params"]["g"] == reference["params"]["g"]
    assert f["test_loss"] == reference["test_loss"]
    saved, expected = (torch.load(p, weights_only=True) for p in (tmp_path / "f.pt", tmp_path / "ref" / "f.pt"))
    assert saved.keys() == expected.keys()
    for name, value in expected.items():       # the running statistics too: each forward counted once
        assert torch.equal(saved[name], value), name
