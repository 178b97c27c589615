"""Learning-rate schedules on torch stages: the optimizer's ``schedule`` and torch's ``scheduler``.

Oracles: plain torch on a copy of the same module, fed the same gradients,
with the rate set by hand from ``distgrad.model.schedules`` (``schedule``) or
stepped by the same ``torch.optim.lr_scheduler`` after each update
(``scheduler``): parameters and param groups bitwise equal. A stage resumed
from a checkpoint file equals the uninterrupted one bitwise (parameters,
rate, momentum). Settings that would do nothing are refused, with the reason,
before any stage starts (exit 2).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import read_json, run_launcher, run_main
from distgrad.stage.checkpoint import load as load_checkpoint, save as save_checkpoint
from distgrad.errors import ConfigError
from distgrad.config.parse import load_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.model.schedules import build_schedule

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'distgrad[torch]'); "
                                               "CI installs it and sets DISTGRAD_REQUIRE=torch")

from distgrad.stage.torch_stage import TorchStage  # noqa: E402  (imports torch)

MODEL = '''
from torch import nn


def make():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh())
'''
EXPERIMENT = """
name = "scheduled"
steps = 12
seed = 5

[data]
kind = "synthetic_classification"
samples = 128
features = 4
classes = 3
batch = 16

[[stages]]
name = "f"
{f_stage}
{extra}

[[stages]]
name = "g"
model = [{{ type = "dense", name = "g1", in = 8, out = 3 }}]
optimizer = {{ type = "adam", lr = 0.01 }}
loss = "softmax_cross_entropy"
"""
MODULE = 'module = "schedmodel:make"\noutput = [8]'
EXPONENTIAL = '{ type = "exponential", decay_rate = 0.5, decay_steps = 2 }'


def _experiment(directory: Path, optimizer: str, extra: str = "", f_stage: str = MODULE) -> Path:
    (directory / "schedmodel.py").write_text(MODEL)
    path = directory / "scheduled.toml"
    path.write_text(EXPERIMENT.format(f_stage=f"{f_stage}\noptimizer = {optimizer}", extra=extra))
    return path


def _grads(stage: TorchStage, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {name: rng.normal(size=value.shape).astype(np.float32) for name, value in stage.params.items()}


def _reference(stage: TorchStage) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A copy of the stage's module and a plain torch optimizer of the same class and settings over it."""
    module = copy.deepcopy(stage.module)
    return module, type(stage.optimizer)(module.parameters(), **stage.optimizer.defaults)


def _reference_step(stage: TorchStage, module: torch.nn.Module, grads: dict[str, np.ndarray]) -> None:
    """Give ``module``'s parameters the gradients ``grads`` (keyed by the stage's names) in torch's layout."""
    by_tensor = {id(p.tensor): p for p in stage._params}
    for ours, theirs in zip(stage.module.parameters(), module.parameters()):
        param = by_tensor[id(ours)]
        theirs.grad = param.from_numpy(grads[param.name]).clone()


@pytest.mark.parametrize("optimizer", [
    f'{{ type = "adam", lr = 0.1, schedule = {EXPONENTIAL} }}',         # distgrad's table, mapped to torch's Adam
    f'{{ type = "Adam", lr = 0.1, schedule = {EXPONENTIAL} }}',         # a torch.optim class
    f'{{ type = "SGD", lr = 0.1, momentum = 0.9, schedule = {EXPONENTIAL} }}',
])
def test_a_schedule_on_a_module_stage_sets_each_updates_float32_rate(tmp_path, optimizer):
    """A schedule on a module stage sets each update's rate, with "adam" (once accepted and ignored) and with a
    torch class (once refused by torch's constructor)."""
    exp = load_experiment(_experiment(tmp_path, optimizer))
    stage = TorchStage.from_spec(exp, "f")
    module, reference = _reference(stage)
    schedule = build_schedule({"type": "exponential", "decay_rate": 0.5, "decay_steps": 2}, 0.1)
    assert schedule(6) < schedule(1)
    for t in range(1, 7):
        grads = _grads(stage, t)
        stage.apply(grads)
        _reference_step(stage, module, grads)
        for group in reference.param_groups:
            group["lr"] = float(schedule(t))
        reference.step()
        assert stage.optimizer.param_groups[0]["lr"] == float(schedule(t))
    for (name, ours), theirs in zip(stage.module.named_parameters(), module.parameters()):
        assert torch.equal(ours, theirs), name


def test_a_schedule_changes_a_module_stages_training(tmp_path):
    constant = train_in_process(load_experiment(_experiment(tmp_path, '{ type = "adam", lr = 0.1 }')))
    decayed = train_in_process(load_experiment(_experiment(
        tmp_path, f'{{ type = "adam", lr = 0.1, schedule = {EXPONENTIAL} }}')))
    assert constant["params"]["f"] != decayed["params"]["f"]


@pytest.mark.parametrize("f_stage,optimizer", [
    (MODULE, '{ type = "SGD", lr = 0.1, momentum = 0.9 }'),
    (MODULE, '{ type = "adam", lr = 0.1 }'),
    ('framework = "torch"\nmodel = [{ type = "dense", name = "f1", in = 4, out = 8 }, { type = "tanh" }]',
     '{ type = "sgd", lr = 0.1 }'),
])
def test_a_scheduler_is_stepped_once_after_each_update_as_in_torch(tmp_path, f_stage, optimizer):
    extra = "scheduler = { type = \"StepLR\", step_size = 2, gamma = 0.5 }"
    exp = load_experiment(_experiment(tmp_path, optimizer, extra, f_stage))
    stage = TorchStage.from_spec(exp, "f") if f_stage == MODULE else TorchStage.from_experiment(exp, "f")
    module, reference = _reference(stage)
    scheduler = torch.optim.lr_scheduler.StepLR(reference, step_size=2, gamma=0.5)
    for t in range(1, 8):
        grads = _grads(stage, t)
        stage.apply(grads)
        _reference_step(stage, module, grads)
        reference.step()
        scheduler.step()
        assert stage.optimizer.param_groups[0]["lr"] == reference.param_groups[0]["lr"]
    group = stage.optimizer.param_groups[0]
    assert group["lr"] == group["initial_lr"] * 0.5 ** 3         # halved after updates 2, 4 and 6
    for (name, ours), theirs in zip(stage.module.named_parameters(), module.parameters()):
        assert torch.equal(ours, theirs), name


def test_a_schedulers_state_is_checkpointed_as_json_and_resumes_exactly(tmp_path):
    """OneCycleLR changes the rate and Adam's betas (momentum) every update: both resume."""
    extra = "scheduler = { type = \"OneCycleLR\", max_lr = 0.1, total_steps = 20 }"
    exp = load_experiment(_experiment(tmp_path, '{ type = "Adam", lr = 0.01 }', extra))
    trained, resumed = TorchStage.from_spec(exp, "f"), TorchStage.from_spec(exp, "f")
    for t in range(1, 6):
        trained.apply(_grads(trained, t))
    path = save_checkpoint(tmp_path / "ck", "f", "run", 5, exp.fingerprint, trained.state_arrays())
    arrays = load_checkpoint(path).arrays
    state = json.loads(arrays["opt/scheduler"].tobytes())        # JSON text, never a pickle
    assert arrays["opt/scheduler"].dtype == np.uint8 and state["scheduler"]["last_epoch"] == 5
    resumed.load_state_arrays(arrays, 5)
    assert resumed.optimizer.param_groups[0]["betas"] == trained.optimizer.param_groups[0]["betas"] != (0.9, 0.999)
    for t in range(6, 12):
        trained.apply(_grads(trained, t))
        resumed.apply(_grads(resumed, t))
    assert resumed.optimizer.state_dict()["param_groups"] == trained.optimizer.state_dict()["param_groups"]
    for name, value in trained.params.items():
        assert np.array_equal(resumed.params[name], value), name
    without = {k: v for k, v in arrays.items() if k != "opt/scheduler"}
    with pytest.raises(ValueError, match="the checkpoint has no learning-rate scheduler state, the stage has"):
        TorchStage.from_spec(exp, "f").load_state_arrays(without, 5)


@pytest.mark.slow     # four PyTorch processes; the checkpoint round trip is in the default suite (above)
def test_a_scheduled_run_over_processes_resumes_as_one_run_in_process(tmp_path):
    """Two processes with checkpoints, stopped after 8 steps and resumed to 16, equal 16 steps in process."""
    experiment = _experiment(tmp_path, '{ type = "SGD", lr = 0.1, momentum = 0.9 }',
                             "scheduler = { type = \"StepLR\", step_size = 3, gamma = 0.5 }")
    common = ["run", experiment, "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", "4", "--progress",
              "off"]
    first = run_launcher([*common, "--steps", "8", "--summary", tmp_path / "first.json"])
    assert first.returncode == 0, first.stdout + first.stderr
    result = run_launcher([*common, "--steps", "16", "--resume", "--summary", tmp_path / "run.json"])
    assert result.returncode == 0, result.stdout + result.stderr
    reference = run_main(["run", experiment, "--in-process", "--steps", "16", "--summary", tmp_path / "ref.json"])
    assert reference.returncode == 0, reference.stderr
    assert read_json(tmp_path / "run.json")["params"] == read_json(tmp_path / "ref.json")["params"]
    assert read_json(tmp_path / "first.json")["params"] != read_json(tmp_path / "ref.json")["params"]


@pytest.mark.parametrize("f_stage,optimizer,extra,needle", [
    ('model = [{ type = "dense", name = "f1", in = 4, out = 8 }]', '{ type = "adam" }',
     'scheduler = { type = "StepLR", step_size = 2 }', "'scheduler' is a torch.optim.lr_scheduler class, for a torch"),
    (MODULE, f'{{ type = "Adam", lr = 0.1, schedule = {EXPONENTIAL} }}',
     'scheduler = { type = "StepLR", step_size = 2 }', "give the optimizer's 'schedule'"),
    (MODULE, '{ type = "Adam" }', 'scheduler = { type = "LambdaLR" }', "takes a Python function"),
    (MODULE, '{ type = "Adam" }', 'scheduler = { type = "SequentialLR" }', "takes other schedulers"),
    (MODULE, '{ type = "Adam" }', 'scheduler = { type = "StepSize" }', "name a torch.optim.lr_scheduler class: "),
    (MODULE, '{ type = "Adam" }', 'scheduler = { type = "StepLR" }', "StepLR rejects {}"),
    (MODULE, '{ type = "Adam" }', 'scheduler = "StepLR"', "'scheduler' must be a table"),
    (MODULE, '{ type = "Adam", schedule = { type = "piecewise", boundaries = [2], values = [0.1, 0.01] }, lr = 0.1 }',
     "", "a piecewise schedule gives its rates in 'values'"),
    (MODULE, '{ type = "Adam", lr = 0.1, schedule = { type = "cosine" } }', "", "needs 'decay_steps'"),
])
def test_a_schedule_or_scheduler_that_would_do_nothing_is_refused_before_any_stage_starts(
        tmp_path, f_stage, optimizer, extra, needle):
    path = _experiment(tmp_path, optimizer, extra, f_stage)
    result = run_main(["run", path, "--steps", "2"])
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr
    with pytest.raises(ConfigError, match="stage 'f'"):
        exp = load_experiment(path)
        TorchStage.from_spec(exp, "f")


def test_a_one_cycle_scheduler_shorter_than_the_run_is_refused_before_any_stage_starts(tmp_path):
    """torch refuses to step OneCycleLR past its total_steps: a run longer than that would stop at that update."""
    path = _experiment(tmp_path, '{ type = "Adam" }', 'scheduler = { type = "OneCycleLR", max_lr = 0.1, total_steps = 5 }')
    result = run_main(["run", path, "--in-process"])
    assert result.returncode == 2, result.stderr
    assert "stage 'f': scheduler OneCycleLR has 5 steps and the stage makes 12 updates in this run" in result.stderr
    assert run_main(["run", path, "--in-process", "--steps", "5"]).returncode == 0
    by_epochs = _experiment(tmp_path, '{ type = "Adam" }',
                            'scheduler = { type = "OneCycleLR", max_lr = 0.1, epochs = 2, steps_per_epoch = 3 }')
    assert "has 6 steps and the stage makes 12 updates" in run_main(["run", by_epochs, "--in-process"]).stderr


def test_an_update_that_torch_refuses_is_the_stage_s_error(tmp_path):
    """What torch's optimizer or scheduler raises in an update is a StageError naming the stage and update."""
    from distgrad.errors import StageError
    exp = load_experiment(_experiment(tmp_path, '{ type = "Adam" }',
                                      'scheduler = { type = "OneCycleLR", max_lr = 0.1, total_steps = 3 }'))
    stage = TorchStage.from_spec(exp, "f")
    for t in range(1, 4):
        stage.apply(_grads(stage, t))
    with pytest.raises(StageError, match="stage f: update 4 failed: ValueError: Tried to step 4 times"):
        stage.apply(_grads(stage, 4))
