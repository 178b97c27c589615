"""The checks on a driving stage's critical path, each in one function, kept lean: a backward reply
(``link.check_reply``: type, tensors, loss, finiteness) and a step's parameter gradients before its update
(``Stage.check_grads``). Their results and messages are what they were before they were made leaner."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from distgrad.config.parse import load_experiment
from distgrad.errors import NonFiniteError, ProtocolError
from distgrad.stage.stage import Stage, backward_specs
from distgrad.wire import messages as wire
from distgrad.wire.link import check_reply
from distgrad.wire.messages import ErrorCode, Message


def _stage(name: str = "f") -> Stage:
    return Stage.from_experiment(load_experiment("seed-reverse"), name, 0)


def _reply(loss, grad: np.ndarray, kind: str = wire.BACKWARD) -> Message:
    return Message(kind, "run", 3, 0, 1, body={"loss": loss}, tensors={"activation_grad": grad})


def test_check_reply_returns_the_float32_loss_and_the_gradient():
    stage = _stage()
    grad = np.full(stage.output_shape, 0.5, np.float32)
    loss, dy = check_reply(_reply(0.25, grad), 3, backward_specs(stage, 1), False, "g")
    assert isinstance(loss, np.float32) and loss == np.float32(0.25)
    assert np.array_equal(dy, grad)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("loss", [float("nan"), float("inf"), 1e39])
def test_check_reply_refuses_a_loss_that_is_not_a_finite_float32(loss):
    """1e39 is finite as a float but Inf as the float32 the step computes with."""
    stage = _stage()
    grad = np.zeros(stage.output_shape, np.float32)
    with pytest.raises(NonFiniteError, match="stage g: non-finite loss at step 3 in its reply"):
        check_reply(_reply(loss, grad), 3, backward_specs(stage, 1), False, "g")
    assert not np.isfinite(check_reply(_reply(loss, grad), 3, backward_specs(stage, 1), True, "g")[0])


def test_check_reply_names_the_stage_step_and_micro_batch_of_a_malformed_reply():
    stage = _stage()
    grad = np.zeros(stage.output_shape, np.float32)
    with pytest.raises(ProtocolError, match=r"stage g's reply to step 3 micro-batch 0/1: expected a backward reply "
                                            r"to step 3, got 'evaluation'") as told:
        check_reply(_reply(0.5, grad, wire.EVALUATION), 3, backward_specs(stage, 1), False, "g")
    assert told.value.code == ErrorCode.TYPE
    with pytest.raises(ProtocolError, match="has loss") as told:
        check_reply(_reply(True, grad), 3, backward_specs(stage, 1), False, "g")
    assert told.value.code == ErrorCode.MALFORMED
    with pytest.raises(NonFiniteError, match="stage g: non-finite activation_grad at step 3"):
        check_reply(_reply(0.5, np.full(stage.output_shape, np.nan, np.float32)), 3, backward_specs(stage, 1),
                    False, "g")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_check_grads_names_the_first_non_finite_gradient(bad):
    stage = Stage.from_experiment(load_experiment("digits-halves"), "left", 0)
    grads = {name: np.zeros_like(value) for name, value in stage.params.items()}
    names = list(grads)
    stage.check_grads(grads)                                    # all finite: nothing
    grads[names[-1]].reshape(-1)[-1] = bad
    with pytest.raises(NonFiniteError, match=f"stage left: non-finite gradient of {names[-1]} at step 1; "
                                             "nothing of this step was applied"):
        stage.check_grads(grads)
    stage.allow_nonfinite = True                                # the experiment allows them: nothing
    stage.check_grads(grads)


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_check_finite_takes_one_pass_without_a_mask_of_the_tensor_s_size_and_refuses_as_before():
    """A stage's check of its own activation gradient before it is sent reads the tensor once and allocates
    nothing of its size when it is finite; NaN, +-Inf and squares beyond float32 are judged as ``isfinite``
    judges them, transposed (non-contiguous) tensors included."""
    stage = _stage("g")
    big = np.full((1 << 20,), 0.5, np.float32)                 # 4 MiB
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        stage.check_finite("activation_grad", big, 3)
        assert tracemalloc.get_traced_memory()[1] - before < big.nbytes // 16
    finally:
        tracemalloc.stop()
    stage.check_finite("activation_grad", np.full(8, 3e38, np.float32), 3)       # finite, squares overflow
    stage.check_finite("activation_grad", np.ones((64, 32), np.float32).T, 3)
    for bad in (np.nan, np.inf, -np.inf):
        for value in (big.copy(), np.ones((64, 32), np.float32).T.copy(order="F")):
            value.reshape(-1, order="A")[-1] = bad
            with pytest.raises(NonFiniteError, match="stage g: non-finite activation_grad at step 3; nothing of "
                                                     "this step was applied"):
                stage.check_finite("activation_grad", value, 3)
