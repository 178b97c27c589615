"""Unit tests for distgrad.model.losses: gradients, known values, stability, builders."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from distgrad.errors import ConfigError
from distgrad.model.losses import Loss, MeanSquaredError, SoftmaxCrossEntropy, SumSquaredError, build_loss

# ------------------------------------------------------------ gradient check
#
# The losses return their value as a float32 scalar whatever the input dtype,
# so the finite differences of the library's own loss carry a float32 rounding
# error of about 6e-8 * |loss| / h. We run the math on float64 inputs (so only
# the final loss value is rounded) with h = 1e-2: the central difference is
# exact for the quadratic losses and has an O(h**2) ~ 1e-5 truncation error
# for softmax cross-entropy, and the rounding error stays below ~1e-4. A
# tolerance of 1e-3 (absolute, gradients are O(0.1..1)) is therefore robust and
# still orders of magnitude below the error of any wrong formula (a missing
# factor 2 or 1/n, a sign). The gradient is additionally checked tightly
# against a float64 analytical reference written here.

FD_STEP = 1e-2
FD_TOL = 1e-3


def numerical_grad_of_loss(loss: Loss, pred: np.ndarray, target: np.ndarray) -> np.ndarray:
    pred = pred.astype(np.float64)
    grad = np.zeros_like(pred)
    for idx in np.ndindex(pred.shape):
        orig = pred[idx]
        pred[idx] = orig + FD_STEP
        plus = float(loss.forward_backward(pred, target)[0])
        pred[idx] = orig - FD_STEP
        minus = float(loss.forward_backward(pred, target)[0])
        pred[idx] = orig
        grad[idx] = (plus - minus) / (2 * FD_STEP)
    return grad


def check_loss_gradient(loss: Loss, pred: np.ndarray, target: np.ndarray) -> None:
    _, dpred = loss.forward_backward(pred.astype(np.float64), target)
    assert dpred.shape == pred.shape
    np.testing.assert_allclose(dpred, numerical_grad_of_loss(loss, pred, target), rtol=FD_TOL, atol=FD_TOL)


def softmax64(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_sum_squared_error_gradient():
    rng = np.random.default_rng(0)
    pred, target = rng.normal(size=(4, 3)), rng.normal(size=(4, 3)).astype(np.float32)
    check_loss_gradient(SumSquaredError(), pred, target)
    loss, dpred = SumSquaredError().forward_backward(pred.astype(np.float32), target)
    np.testing.assert_allclose(loss, np.sum((pred - target) ** 2), rtol=1e-6)
    np.testing.assert_allclose(dpred, 2 * (pred - target), rtol=1e-6, atol=1e-6)


def test_mean_squared_error_gradient():
    rng = np.random.default_rng(1)
    pred, target = rng.normal(size=(5, 3)), rng.normal(size=(5, 3)).astype(np.float32)
    check_loss_gradient(MeanSquaredError(), pred, target)
    loss, dpred = MeanSquaredError().forward_backward(pred.astype(np.float32), target)
    np.testing.assert_allclose(loss, np.mean((pred - target) ** 2), rtol=1e-6)
    np.testing.assert_allclose(dpred, 2 * (pred - target) / pred.size, rtol=1e-6, atol=1e-7)


def test_softmax_cross_entropy_gradient():
    rng = np.random.default_rng(2)
    logits = rng.normal(scale=2.0, size=(6, 4))
    labels = rng.integers(0, 4, size=6).astype(np.int64)
    check_loss_gradient(SoftmaxCrossEntropy(), logits, labels)
    loss, dpred = SoftmaxCrossEntropy().forward_backward(logits.astype(np.float32), labels)
    p = softmax64(logits)
    np.testing.assert_allclose(loss, -np.mean(np.log(p[np.arange(6), labels])), rtol=1e-5)
    expected = (p - np.eye(4)[labels]) / 6
    np.testing.assert_allclose(dpred, expected, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------- known values

def test_sum_squared_error_known_value():
    loss, dpred = SumSquaredError().forward_backward(np.array([3.0], np.float32), np.array([1.0], np.float32))
    assert loss == 4.0
    np.testing.assert_array_equal(dpred, [4.0])


def test_sum_squared_error_is_tf_square_gradient_bitwise():
    # The seed's gradient is (output - y) * 2 in float32, exactly.
    rng = np.random.default_rng(3)
    pred = rng.normal(size=(7,)).astype(np.float32)
    target = rng.normal(size=(7,)).astype(np.float32)
    loss, dpred = SumSquaredError().forward_backward(pred, target)
    np.testing.assert_array_equal(dpred, (pred - target) * np.float32(2))
    assert loss == np.sum((pred - target) * (pred - target), dtype=np.float32)


def test_mean_squared_error_known_value():
    pred = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    loss, dpred = MeanSquaredError().forward_backward(pred, np.zeros_like(pred))
    assert loss == np.float32(7.5)
    np.testing.assert_array_equal(dpred, pred / np.float32(2))


def test_softmax_cross_entropy_known_values():
    loss, dpred = SoftmaxCrossEntropy().forward_backward(np.zeros((2, 4), np.float32),
                                                         np.array([0, 3], np.int64))
    np.testing.assert_allclose(loss, np.log(4.0), rtol=1e-6)
    expected = np.full((2, 4), 0.25) - np.eye(4)[[0, 3]]
    np.testing.assert_allclose(dpred, expected / 2, rtol=1e-6, atol=1e-7)
    # softmax([0, ln 3]) = [1/4, 3/4]
    loss, dpred = SoftmaxCrossEntropy().forward_backward(np.array([[0.0, np.log(3.0)]], np.float32),
                                                         np.array([1], np.int64))
    np.testing.assert_allclose(loss, -np.log(0.75), rtol=1e-6)
    np.testing.assert_allclose(dpred, [[0.25, -0.25]], rtol=1e-6, atol=1e-7)


def softmax_cross_entropy_plainly(pred: np.ndarray, target: np.ndarray) -> tuple[np.float32, np.ndarray]:
    """The float32 formula as numpy writes it plainly (what the loss computed before it was cut to fewer
    numpy calls): the cut must keep every bit of it."""
    shifted = pred - pred.max(axis=1, keepdims=True)
    log_prob = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(pred))
    loss = np.float32(-log_prob[rows, target].mean(dtype=np.float32))
    dpred = np.exp(log_prob)
    dpred[rows, target] -= np.float32(1)
    return loss, dpred / np.float32(len(pred))


@pytest.mark.parametrize("layout", ["C", "F", "reversed columns"])
def test_softmax_cross_entropy_is_the_plain_formula_bitwise(layout):
    """The loss in fewer numpy calls gives the plain formula's bits for every batch and class
    count (numpy's row sums add 8 at a time from 8 classes on), logit scale and memory layout, and calls
    of several shapes on one loss object (its flat row offsets are kept between calls)."""
    rng = np.random.default_rng(25)
    loss_fn = SoftmaxCrossEntropy()
    for batch, classes in [(1, 2), (32, 10), (7, 3), (32, 10), (64, 16), (5, 131), (32, 10)]:
        for scale in (0.01, 3.0, 1e4):
            pred = (rng.normal(size=(batch, classes)) * scale).astype(np.float32)
            pred = {"C": pred, "F": np.asfortranarray(pred), "reversed columns": pred[:, ::-1]}[layout]
            target = rng.integers(0, classes, size=batch)
            loss, dpred = loss_fn.forward_backward(pred, target)
            want_loss, want_dpred = softmax_cross_entropy_plainly(pred, target)
            assert isinstance(loss, np.float32) and loss.tobytes() == want_loss.tobytes()
            assert dpred.dtype == np.float32 and dpred.shape == pred.shape
            assert dpred.tobytes() == want_dpred.tobytes()


def test_zero_loss_when_prediction_is_the_target():
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    for loss_fn in (SumSquaredError(), MeanSquaredError()):
        loss, dpred = loss_fn.forward_backward(x, x.copy())
        assert loss == 0 and not dpred.any()


@pytest.mark.parametrize("loss_fn, target", [
    (SumSquaredError(), np.ones((3, 2), np.float32)),
    (MeanSquaredError(), np.ones((3, 2), np.float32)),
    (SoftmaxCrossEntropy(), np.array([0, 1, 1], np.int64)),
], ids=["sse", "mse", "softmax_ce"])
def test_float32_types_and_inputs_untouched(loss_fn, target):
    pred = np.arange(6, dtype=np.float32).reshape(3, 2) / np.float32(4)
    pred_copy, target_copy = pred.copy(), target.copy()
    pred.setflags(write=False)
    target.setflags(write=False)
    loss, dpred = loss_fn.forward_backward(pred, target)
    assert isinstance(loss, np.float32)
    assert dpred.dtype == np.float32 and dpred.shape == pred.shape
    np.testing.assert_array_equal(pred, pred_copy)
    np.testing.assert_array_equal(target, target_copy)
    assert target.dtype == loss_fn.target_dtype


# ---------------------------------------------------------- softmax specifics

def test_softmax_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[1e4, 0.0, -1e4],
                       [-1e4, 1e4, 1e4],
                       [-1e4, -1e4, -1e4]], np.float32)
    labels = np.array([0, 1, 2], np.int64)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        loss, dpred = SoftmaxCrossEntropy().forward_backward(logits, labels)
    assert np.isfinite(loss) and np.isfinite(dpred).all()
    # Row losses: 0, ln 2, ln 3.
    np.testing.assert_allclose(loss, (np.log(2.0) + np.log(3.0)) / 3, rtol=1e-6)
    expected = np.array([[0.0, 0.0, 0.0],
                         [0.0, -0.5, 0.5],
                         [1 / 3, 1 / 3, -2 / 3]]) / 3
    np.testing.assert_allclose(dpred, expected, atol=1e-7)

    loss, _ = SoftmaxCrossEntropy().forward_backward(np.array([[1e4, -1e4]], np.float32),
                                                     np.array([1], np.int64))
    np.testing.assert_allclose(loss, 2e4, rtol=1e-6)


def test_softmax_cross_entropy_gradient_rows_sum_to_zero():
    rng = np.random.default_rng(4)
    logits = rng.normal(scale=5.0, size=(8, 5)).astype(np.float32)
    _, dpred = SoftmaxCrossEntropy().forward_backward(logits, rng.integers(0, 5, size=8))
    np.testing.assert_allclose(dpred.sum(axis=1), 0.0, atol=1e-7)


@pytest.mark.parametrize("labels", [[0, -1], [0, 3], [7, 0]])
def test_softmax_cross_entropy_rejects_out_of_range_labels(labels):
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        SoftmaxCrossEntropy().forward_backward(np.zeros((2, 3), np.float32), np.array(labels, np.int64))


@pytest.mark.parametrize("labels", [[0.0, 1.0], [-0.5, 1.0], [True, False], [float("nan"), 0.0]])
def test_softmax_cross_entropy_rejects_class_ids_that_are_no_integers(labels):
    """Float or bool class ids are refused by name (the range check casts to uint64, which would cut -0.5 to 0,
    read bools as 0/1 and leave 1.0 to fail as an index), with no warning from the cast."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="class ids must be integers"):
            SoftmaxCrossEntropy().forward_backward(np.zeros((2, 3), np.float32), np.array(labels))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint64, np.int32])
def test_softmax_cross_entropy_takes_any_integer_class_ids(dtype):
    """Unsigned and narrower ids give the bits of int64 ones (uint64 plus the int64 row offsets would be float)."""
    rng = np.random.default_rng(7)
    pred, labels = rng.normal(size=(6, 4)).astype(np.float32), rng.integers(0, 4, size=6)
    want_loss, want_dpred = SoftmaxCrossEntropy().forward_backward(pred, labels)
    loss, dpred = SoftmaxCrossEntropy().forward_backward(pred, labels.astype(dtype))
    assert loss.tobytes() == want_loss.tobytes() and dpred.tobytes() == want_dpred.tobytes()


def test_softmax_cross_entropy_accepts_edge_labels():
    loss, _ = SoftmaxCrossEntropy().forward_backward(np.zeros((2, 3), np.float32), np.array([0, 2], np.int64))
    np.testing.assert_allclose(loss, np.log(3.0), rtol=1e-6)


def test_target_shapes():
    assert SumSquaredError().target_shape((4, 2)) == (4, 2)
    assert MeanSquaredError().target_shape((3,)) == (3,)
    assert SoftmaxCrossEntropy().target_shape((5, 10)) == (5,)
    for bad in [(10,), (2, 3, 4)]:
        with pytest.raises(ConfigError):
            SoftmaxCrossEntropy().target_shape(bad)
    assert SumSquaredError().target_dtype == np.float32
    assert SoftmaxCrossEntropy().target_dtype == np.int64


# ------------------------------------------------------------------ builder

@pytest.mark.parametrize("spec, cls", [
    ("sum_squared_error", SumSquaredError),
    ("mean_squared_error", MeanSquaredError),
    ("softmax_cross_entropy", SoftmaxCrossEntropy),
    ({"type": "softmax_cross_entropy"}, SoftmaxCrossEntropy),
])
def test_build_loss(spec, cls):
    assert type(build_loss(spec)) is cls


@pytest.mark.parametrize("spec", ["mse", "cross_entropy", "", None, 3, {"name": "sum_squared_error"},
                                  {"type": "hinge"}])
def test_build_loss_rejects_unknown_names(spec):
    with pytest.raises(ConfigError, match="unknown loss"):
        build_loss(spec)
