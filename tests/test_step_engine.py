"""The step engine's one rule: a step's micro-batch gradients added in micro-batch order, then one update
(``StepEngine.apply_step``), checked against the same step added and updated by hand."""

from __future__ import annotations

import numpy as np
import pytest

from distgrad.config.parse import load_experiment
from distgrad.stage.engine import GradAccumulator, StepEngine
from distgrad.stage.stage import Stage, micro_batch


def _last_stage():
    exp = load_experiment("tanh-regression")
    return exp, Stage.from_experiment(exp, exp.stage_names[-1])


def _micro_batches(exp, stage, count: int):
    data = exp.build_data()
    x = Stage.from_experiment(exp, exp.stage_names[0]).forward(data.features(1))[0]
    targets = data.targets(1)
    return [stage.loss_micro_batch(micro_batch(x, i, count), micro_batch(targets, i, count), i)
            for i in range(count)]


def test_apply_step_adds_in_order_then_updates_bitwise_as_by_hand():
    exp, by_hand = _last_stage()
    _, applied = _last_stage()
    scale = lambda count: np.float32(1.0 / count)      # noqa: E731 - the mean reduction's scale
    parts = _micro_batches(exp, by_hand, 4)
    engine = StepEngine(by_hand, scale)
    for i, (loss, _, grads) in enumerate(parts):
        engine.add(i, 4, grads, loss)
    expected_loss = engine.update(1, 4)
    parts = _micro_batches(exp, applied, 4)
    loss = StepEngine(applied, scale).apply_step(1, 4, ((grads, loss) for loss, _, grads in parts))
    assert loss == expected_loss
    for name, value in by_hand.params.items():
        assert np.array_equal(applied.params[name], value), name


def test_apply_step_refuses_a_step_with_micro_batches_missing_and_applies_nothing():
    exp, stage = _last_stage()
    before = {name: value.copy() for name, value in stage.params.items()}
    engine = StepEngine(stage, lambda count: np.float32(1))
    parts = _micro_batches(exp, stage, 4)[:3]
    with pytest.raises(ValueError, match="3 micro-batches were added, expected 4"):
        engine.apply_step(1, 4, ((grads, loss) for loss, _, grads in parts))
    assert engine.done == 0
    for name, value in before.items():
        assert np.array_equal(stage.params[name], value), name


def test_a_parameter_without_a_gradient_in_a_micro_batched_step_is_left_alone():
    # A torch module whose graph depends on the data gives some parameters no gradient in some micro-batches
    # (torch: grad None). Such a parameter sums the micro-batches that gave one; with none in the step it is
    # not updated at all, whatever the previous step left in the accumulator's buffers.
    exp, stage = _last_stage()
    engine = StepEngine(stage, lambda count: np.float32(1.0 / count))
    parts = _micro_batches(exp, stage, 2)
    engine.apply_step(1, 2, ((grads, loss) for loss, _, grads in parts))
    kept, *trained = sorted(stage.params)
    before = stage.params[kept].copy()
    parts = _micro_batches(exp, stage, 2)
    only = [({name: g for name, g in grads.items() if name != kept}, loss) for loss, _, grads in parts]
    engine.apply_step(2, 2, iter(only))
    assert np.array_equal(stage.params[kept], before)


def test_a_parameter_with_a_gradient_in_some_micro_batches_sums_only_those():
    acc = GradAccumulator()
    one, two = np.float32(1.5), np.float32(0.25)
    acc.add({"a": np.full(3, one), "b": np.full(2, one)}, 0, 2)
    acc.add({"a": np.full(3, one), "b": np.full(2, one)}, 1, 2)
    acc.take(np.float32(1))
    acc.add({"a": np.full(3, two)}, 0, 2)
    acc.add({"a": np.full(3, two), "b": np.full(2, two)}, 1, 2)
    grads = acc.take(np.float32(0.5))
    assert sorted(grads) == ["a", "b"]
    assert np.array_equal(grads["a"], np.full(3, (two + two) * np.float32(0.5)))
    assert np.array_equal(grads["b"], np.full(2, two * np.float32(0.5)))
    acc.add({"b": np.full(2, one)}, 0, 2)
    acc.add({"b": np.full(2, one)}, 1, 2)
    assert sorted(acc.take(np.float32(1))) == ["b"]
