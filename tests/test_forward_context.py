"""The forward context from a stage to its layers: which step and micro-batch a forward belongs to,
and whether it trains. Dropout masks follow it, so a run resumed from a stage's state draws the masks
of the run it continues; a torch stage seeds torch's RNG from it and evaluates in eval mode."""

from __future__ import annotations

import numpy as np
import pytest

from distgrad.stage.engine import StepEngine
from distgrad.config.parse import load_experiment, parse_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.model.nn import ForwardContext
from distgrad.stage.records import to_lists
from distgrad.stage.stage import Stage, micro_batch

@pytest.fixture(scope="module")
def exp():
    """tanh-regression with dropout on both stages."""
    raw = dict(load_experiment("tanh-regression").raw)
    f, g = (dict(stage) for stage in raw["stages"])
    f["model"] = [*f["model"], {"type": "dropout", "rate": 0.25}]
    g["model"] = [*g["model"][:2], {"type": "dropout", "rate": 0.5}, *g["model"][2:]]
    raw["stages"] = [f, g]
    return parse_experiment(raw)


def _batch(exp, step: int = 1):
    data = exp.build_data()
    return data.features(step), data.targets(step)


def test_stage_forward_gives_its_layers_the_step_in_progress_and_the_micro_batch(exp):
    f, g = (Stage.from_experiment(exp, name) for name in exp.stage_names)
    features, targets = _batch(exp)
    x, _ = f.forward(features)
    g.step = 4
    y, _ = g.forward(x, 1)
    assert y.tobytes() == g.model.forward(x, ForwardContext(True, 5, 1, "g"))[0].tobytes()
    assert not np.array_equal(y, g.forward(x, 0)[0])
    loss, dx, grads = g.loss_micro_batch(x, targets, 1)
    expected = g.loss_backward(y, targets)[0]
    assert loss == expected
    deferred_loss, deferred_dx, later = g.loss_micro_batch_deferred(x, targets, 1)
    assert deferred_loss == loss and deferred_dx.tobytes() == dx.tobytes()
    assert all(later()[k].tobytes() == v.tobytes() for k, v in grads.items())


def test_evaluation_runs_without_dropout(exp):
    f, g = (Stage.from_experiment(exp, name) for name in exp.stage_names)
    features, targets = _batch(exp)
    x, _ = f.forward(features, training=False)
    evaluated = g.evaluate_last(x, targets)
    y, _ = g.model.forward(x, ForwardContext(training=False))
    assert evaluated["loss"] == float(g.loss_backward(y, targets)[0])
    assert g.forward(x, training=False)[0].tobytes() == y.tobytes()


def _train(exp, stages, first: int, last: int, micro_batches: int) -> None:
    """Steps ``first..last`` of a two-stage experiment, in the in-process order, through step engines."""
    f, g = stages
    data = exp.build_data()
    scale = exp.final_loss.micro_batch_scale
    f_engine, g_engine = StepEngine(f, scale), StepEngine(g, scale)
    for step in range(first, last + 1):
        features, targets = data.features(step), data.targets(step)
        for i in range(micro_batches):
            x, cache = f.forward(micro_batch(features, i, micro_batches), i)
            loss, dx, grads = g.loss_micro_batch(x, micro_batch(targets, i, micro_batches), i)
            g_engine.add(i, micro_batches, grads, loss)
            f_engine.add(i, micro_batches, f.backward(cache, dx, need_dx=False)[1])
        g_engine.update(step, micro_batches)
        f_engine.update(step, micro_batches)


def test_a_run_resumed_from_its_state_draws_the_same_masks(exp):
    """Stages rebuilt from the state of step 3 (a checkpoint, a restarted process) go on exactly as
    the uninterrupted reference: the masks hold no state of their own."""
    steps, micro_batches = 6, 2
    reference = train_in_process(exp, steps=steps, micro_batches=micro_batches)["params"]
    stages = [Stage.from_experiment(exp, name) for name in exp.stage_names]
    _train(exp, stages, 1, 3, micro_batches)

    def resume(at_step: int) -> dict:
        resumed = [Stage.from_experiment(exp, name) for name in exp.stage_names]
        for old, new in zip(stages, resumed):
            new.load_state_arrays({k: v.copy() for k, v in old.state_arrays().items()}, at_step)
        _train(exp, resumed, 4, steps, micro_batches)
        return {s.name: to_lists(s.params) for s in resumed}

    assert resume(3) == reference
    # The same state told another step (Adam keeps its own powers): only the masks differ, and so does the run.
    assert resume(0) != reference


# ------------------------------------------------------------------ torch stages

@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _torch_stage(torch, seed: int = 5):
    from distgrad.stage.torch_stage import TorchStage

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5))
    stage = TorchStage.from_module("t", module, torch.optim.SGD(module.parameters(), lr=0.1), input_shape=(4, 8))
    stage.seed = seed
    return stage


def test_torch_dropout_is_seeded_by_seed_step_and_micro_batch(torch):
    x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    stage = _torch_stage(torch)
    first = stage.forward(x, 0)[0]
    assert (first == 0).any(), "dropout must be active in training"
    assert stage.forward(x, 0)[0].tobytes() == first.tobytes()
    assert _torch_stage(torch).forward(x, 0)[0].tobytes() == first.tobytes(), "another process draws the same mask"
    assert not np.array_equal(stage.forward(x, 1)[0], first)
    assert not np.array_equal(_torch_stage(torch, seed=6).forward(x, 0)[0], first)
    stage.step = 1
    assert not np.array_equal(stage.forward(x, 0)[0], first)


def test_torch_stage_evaluates_in_eval_mode_and_restores_the_mode(torch):
    x = np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32)
    stage = _torch_stage(torch)
    with torch.no_grad():
        expected = stage.module[0](torch.tensor(x)).numpy()
    np.testing.assert_array_equal(stage.forward(x, training=False)[0], expected)
    assert stage.module.training, "the module's own mode is restored"
    stage.module.eval()
    stage.forward(x, training=False)
    assert not stage.module.training


def test_torch_stage_from_an_experiment_knows_the_run_seed(torch):
    raw = dict(load_experiment("tanh-regression").raw)
    raw["stages"] = [dict(raw["stages"][0], framework="torch"), raw["stages"][1]]
    exp = parse_experiment(raw)
    assert Stage.from_experiment(exp, exp.stage_names[0], seed=42).seed == 42


def test_two_stages_dropouts_of_one_name_draw_different_masks():
    from distgrad.model.nn import Dropout
    layer = Dropout(0.5, "dropout1", seed=0)
    shape = (8, 16)
    f_mask = layer.mask(shape, ForwardContext(True, 3, 0, "f"))
    g_mask = layer.mask(shape, ForwardContext(True, 3, 0, "g"))
    assert not np.array_equal(f_mask, g_mask)
    assert np.array_equal(f_mask, layer.mask(shape, ForwardContext(True, 3, 0, "f")))
