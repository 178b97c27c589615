"""Unit tests for the image, sequence and regularisation layers of distgrad.model.nn.

conv2d, maxpool2d, flatten, reshape, dropout, embedding and layernorm:
gradients by central differences in float64 (the helper of test_nn.py and
its tolerances), forward passes against direct loops, the float32 path,
builders and shapes, and dropout's reproducible masks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from distgrad.model import nn
from distgrad.errors import ConfigError
from distgrad.model.nn import (Conv2D, Dense, Dropout, Embedding, Flatten, ForwardContext, LayerNorm, MaxPool2D, ReLU,
                               Reshape, Sequential, build_layer, build_model)

from test_nn import (FD_ATOL, FD_RTOL, as_float64, away_from_zero, check_inputs_untouched, check_layer_gradients,
                     numerical_grad)

RNG_SEED = 1414


def distinct(rng: np.random.Generator, shape, spacing: float = 0.01) -> np.ndarray:
    """Values at least ``spacing`` apart in random order: no ties for max pooling to break, even
    when central differences move one of them by 1e-6."""
    return (rng.permutation(math.prod(shape)) * spacing - 0.3).reshape(shape)


def with_random_params(layer: nn.Layer, rng: np.random.Generator) -> nn.Layer:
    """Every parameter replaced by normal samples (so a bias or a ``gamma`` of ones hides nothing)."""
    for value in layer.params.values():
        value[...] = rng.normal(size=value.shape)
    return layer


# --------------------------------------------------------- gradient checks

def test_conv2d_gradient_stride_2_padding_1():
    rng = np.random.default_rng(RNG_SEED)
    layer = Conv2D("c", 2, 3, 3, seed=1, stride=2, padding=1, bias_init={"kind": "truncated_normal", "stddev": 0.5})
    check_layer_gradients(layer, rng.normal(size=(2, 2, 5, 6)))


def test_conv2d_gradient_rectangular_kernel_stride_and_padding():
    rng = np.random.default_rng(RNG_SEED)
    layer = Conv2D("c", 3, 2, [2, 3], seed=2, stride=[1, 2], padding=[0, 1], bias_init=0.2)
    check_layer_gradients(layer, rng.normal(size=(2, 3, 4, 7)))


@pytest.mark.parametrize("kernel, stride, shape", [
    (2, None, (2, 3, 4, 6)),       # windows tile the image
    (2, None, (2, 2, 5, 5)),       # the last row and column belong to no window
    (3, 1, (1, 2, 5, 4)),          # overlapping windows: one pixel can be the maximum of several
    ([2, 3], [1, 2], (2, 1, 4, 7)),
], ids=["tiled", "remainder", "overlapping", "rectangular"])
def test_maxpool2d_gradient(kernel, stride, shape):
    check_layer_gradients(MaxPool2D(kernel, stride), distinct(np.random.default_rng(RNG_SEED), shape))


def test_layernorm_gradient():
    rng = np.random.default_rng(RNG_SEED)
    check_layer_gradients(with_random_params(LayerNorm("ln", 5), rng), rng.normal(size=(3, 4, 5)))


def test_dropout_gradient_with_a_fixed_context():
    rng = np.random.default_rng(RNG_SEED)
    ctx = ForwardContext(training=True, step=7, micro_batch=1)
    layer = Dropout(0.4, "drop", seed=3)
    assert 0 < (layer.mask((3, 4, 5), ctx) == 0).mean() < 1, "the check must see dropped and kept units"
    check_layer_gradients(layer, rng.normal(size=(3, 4, 5)), ctx=ctx)


def test_reshape_and_flatten_gradients():
    rng = np.random.default_rng(RNG_SEED)
    check_layer_gradients(Reshape([2, 3, 2]), rng.normal(size=(4, 12)))
    check_layer_gradients(Flatten(), rng.normal(size=(4, 2, 3, 2)))


def test_embedding_parameter_gradient_and_zero_dx():
    rng = np.random.default_rng(RNG_SEED)
    layer = as_float64(Embedding("e", 6, 3, "glorot_uniform", seed=4))
    ids = np.array([[0, 2, 2, 5], [5, 1, 2, 0]], np.float64)         # repeated ids add up
    r = rng.normal(size=(2, 4, 3))
    y, cache = layer.forward(ids)
    np.testing.assert_array_equal(y, layer.params["e.W"][ids.astype(int)])
    dx, grads = layer.backward(cache, r)

    def objective() -> float:
        return float(np.sum(layer.forward(ids)[0] * r))

    np.testing.assert_allclose(grads["e.W"], numerical_grad(objective, layer.params["e.W"]),
                               rtol=FD_RTOL, atol=FD_ATOL)
    assert not grads["e.W"][[3, 4]].any(), "rows no id looked up get no gradient"
    assert dx.shape == ids.shape and not dx.any()


def test_a_small_cnn_end_to_end_gradient():
    rng = np.random.default_rng(RNG_SEED)
    model = build_model([
        {"type": "reshape", "shape": [1, 6, 6]},
        {"type": "conv2d", "name": "c", "in": 1, "out": 2, "kernel": 3, "padding": 1, "bias_init": 0.1},
        {"type": "maxpool2d", "kernel": 2},
        {"type": "flatten"},
        {"type": "layernorm", "name": "ln", "size": 18},
        {"type": "dense", "name": "d", "in": 18, "out": 3},
    ], seed=5)
    check_layer_gradients(model, distinct(rng, (2, 36)))


# ------------------------------------------------------ forward vs. oracles

def conv2d_by_loops(x, w, b, stride, padding):
    """The definition, one output element at a time, in float64."""
    (sh, sw), (ph, pw) = stride, padding
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    n, _, h, wd = xp.shape
    out, _, kh, kw = w.shape
    ho, wo = (h - kh) // sh + 1, (wd - kw) // sw + 1
    y = np.zeros((n, out, ho, wo))
    for i in range(n):
        for o in range(out):
            for r in range(ho):
                for c in range(wo):
                    y[i, o, r, c] = np.sum(xp[i, :, r * sh:r * sh + kh, c * sw:c * sw + kw] * w[o]) + b[o]
    return y


@pytest.mark.parametrize("kernel, stride, padding", [(3, 1, 0), (3, 2, 1), ([2, 3], [2, 1], [1, 0]), (1, 1, 0)])
def test_conv2d_forward_is_the_definition(kernel, stride, padding):
    rng = np.random.default_rng(RNG_SEED)
    layer = with_random_params(as_float64(Conv2D("c", 3, 4, kernel, seed=0, stride=stride, padding=padding)), rng)
    x = rng.normal(size=(2, 3, 6, 5))
    y, _ = layer.forward(x)
    expected = conv2d_by_loops(x, layer.params["c.W"], layer.params["c.b"], layer.stride, layer.padding)
    assert y.shape == layer.output_shape(x.shape) == expected.shape
    assert y.flags.c_contiguous
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


def test_maxpool2d_forward_is_the_window_maximum_and_ties_go_to_the_first():
    x = np.array([[[[1, 3, 2, 2],
                    [3, 0, 2, 2],
                    [5, 4, 0, 1],
                    [4, 5, 1, 0]]]], np.float32)
    layer = MaxPool2D(2)
    y, cache = layer.forward(x)
    np.testing.assert_array_equal(y, [[[[3, 2], [5, 1]]]])
    dx, grads = layer.backward(cache, np.array([[[[10, 20], [30, 40]]]], np.float32))
    # Each window's gradient goes whole to its first maximum in row-major order.
    np.testing.assert_array_equal(dx, [[[[0, 10, 20, 0],
                                         [0, 0, 0, 0],
                                         [30, 0, 0, 40],
                                         [0, 0, 0, 0]]]])
    assert grads == {} and layer.backward(cache, y, need_dx=False) == (None, {})


def test_layernorm_forward_normalises_the_last_axis():
    rng = np.random.default_rng(RNG_SEED)
    x = rng.normal(3.0, 2.0, size=(4, 3, 16))
    layer = as_float64(LayerNorm("ln", 16, eps=1e-3))
    y, _ = layer.forward(x)
    expected = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + np.float32(1e-3))
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)
    layer.params["ln.gamma"][...], layer.params["ln.beta"][...] = 2.0, -1.0
    np.testing.assert_allclose(layer.forward(x)[0], 2.0 * expected - 1.0, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [6.0, -1.0, 2.5, np.nan, np.inf])
def test_embedding_refuses_ids_that_are_not_whole_numbers_in_range(bad):
    layer = Embedding("e", 6, 3, "glorot_uniform", seed=0)
    ids = np.array([[0, 1], [2, bad]], np.float32)
    with pytest.raises(ValueError, match=r"embedding layer 'e': id .* at \(1, 1\) .* \[0, 6\)"):
        layer.forward(ids)


# ------------------------------------------------------------ float32 path

def float32_layers():
    """(id, factory, input shape, input maker) for the float32 checks."""
    def values(rng, shape):
        return away_from_zero(rng, shape)

    def ids(rng, shape):
        return rng.integers(0, 7, size=shape).astype(np.float64)

    return [
        ("conv2d", lambda: Conv2D("c", 2, 3, 3, seed=0, stride=2, padding=1, bias_init=0.1), (2, 2, 5, 5), values),
        ("maxpool2d", lambda: MaxPool2D(2), (2, 3, 4, 4), distinct),
        ("flatten", Flatten, (2, 3, 2, 2), values),
        ("reshape", lambda: Reshape([1, 3, 4]), (2, 12), values),
        ("dropout", lambda: Dropout(0.5, "d", seed=0), (4, 6), values),
        ("layernorm", lambda: LayerNorm("ln", 6), (3, 2, 6), values),
        ("embedding", lambda: Embedding("e", 7, 4, "glorot_uniform", seed=0), (3, 5), ids),
        ("cnn", lambda: Sequential([Reshape([1, 4, 4]), Conv2D("c", 1, 2, 3, seed=0, padding=1), ReLU(),
                                    MaxPool2D(2), Flatten(), Dense("d", 8, 3, "glorot_uniform", seed=0)]),
         (3, 16), values),
    ]


FLOAT32_LAYERS = pytest.mark.parametrize("make, shape, inputs", [case[1:] for case in float32_layers()],
                                         ids=[case[0] for case in float32_layers()])


@FLOAT32_LAYERS
def test_float32_in_float32_out_and_close_to_float64(make, shape, inputs):
    rng = np.random.default_rng(7)
    x32 = inputs(rng, shape).astype(np.float32)
    dy32 = rng.normal(size=make().output_shape(shape)).astype(np.float32)
    layer32 = make()
    y32, cache32 = layer32.forward(x32)
    dx32, grads32 = layer32.backward(cache32, dy32)
    assert y32.dtype == dx32.dtype == np.float32 and y32.shape == layer32.output_shape(shape)
    assert all(g.dtype == np.float32 and g.shape == layer32.params[k].shape for k, g in grads32.items())

    layer64 = as_float64(make())
    y64, cache64 = layer64.forward(x32.astype(np.float64))
    dx64, grads64 = layer64.backward(cache64, dy32.astype(np.float64))
    np.testing.assert_allclose(y32, y64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx32, dx64, rtol=1e-5, atol=1e-6)
    assert set(grads32) == set(grads64) == set(layer32.params)
    for name in grads64:
        np.testing.assert_allclose(grads32[name], grads64[name], rtol=1e-5, atol=1e-6, err_msg=name)


@FLOAT32_LAYERS
def test_read_only_inputs_are_not_modified_and_caches_are_reusable(make, shape, inputs):
    rng = np.random.default_rng(8)
    layer = make()
    x = inputs(rng, shape).astype(np.float32)
    check_inputs_untouched(layer, x, rng.normal(size=layer.output_shape(shape)).astype(np.float32))


@FLOAT32_LAYERS
def test_deferred_and_dx_free_backward_give_the_same_bits(make, shape, inputs):
    """What a serving stage uses (dx now, parameter gradients later) and what a first stage uses (no dx)."""
    rng = np.random.default_rng(9)
    layer = make()
    x = inputs(rng, shape).astype(np.float32)
    dy = rng.normal(size=layer.output_shape(shape)).astype(np.float32)
    _, cache = layer.forward(x)
    dx, grads = layer.backward(cache, dy)
    dx_now, grads_later = layer.backward_deferred(cache, dy)
    no_dx, grads_only = layer.backward(cache, dy, need_dx=False)
    assert dx_now.tobytes() == dx.tobytes() and no_dx is None
    later = grads_later()
    assert list(later) == list(grads) == list(grads_only)
    assert all(later[k].tobytes() == grads[k].tobytes() == grads_only[k].tobytes() for k in grads)


# --------------------------------------------------------------- dropout

def test_dropout_mask_is_a_pure_function_of_seed_name_step_and_micro_batch():
    x = np.ones((64, 32), np.float32)
    ctx = ForwardContext(training=True, step=5, micro_batch=1)
    y, _ = Dropout(0.5, "d", seed=11).forward(x, ctx)
    again, _ = Dropout(0.5, "d", seed=11).forward(x, ctx)          # another build, as in another process
    assert y.tobytes() == again.tobytes()
    for other_layer, other_ctx in [
        (Dropout(0.5, "d", seed=11), ForwardContext(True, 6, 1)),
        (Dropout(0.5, "d", seed=11), ForwardContext(True, 5, 0)),
        (Dropout(0.5, "d", seed=12), ctx),
        (Dropout(0.5, "e", seed=11), ctx),
    ]:
        assert not np.array_equal(other_layer.forward(x, other_ctx)[0], y)


def test_dropout_is_the_identity_outside_training_and_at_rate_0():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for layer, ctx in [(Dropout(0.5, "d", seed=0), ForwardContext(training=False, step=3)),
                       (Dropout(0.0, "d", seed=0), ForwardContext(step=3))]:
        y, cache = layer.forward(x, ctx)
        assert y is x
        dx, grads = layer.backward(cache, x)
        assert dx is x and grads == {}


def test_dropout_is_inverted_dropout_in_float32():
    rate = 0.3
    x = np.random.default_rng(0).normal(size=(400, 250)).astype(np.float32)
    y, mask = Dropout(rate, "d", seed=0).forward(x, ForwardContext(step=1))
    kept = y != 0
    assert abs(1 - kept.mean() - rate) < 0.005                     # 100,000 draws: sd 0.0015
    scale = np.float32(1 / (1 - rate))
    assert y.dtype == np.float32 and mask.dtype == np.float32
    np.testing.assert_array_equal(y[kept], x[kept] * scale)
    assert set(np.unique(mask)) == {np.float32(0), scale}


def test_sequential_passes_the_context_to_every_layer():
    model = build_model([{"type": "dropout", "rate": 0.5}, {"type": "dense", "name": "h", "in": 8, "out": 8},
                         {"type": "dropout", "rate": 0.5}], seed=0)
    x = np.ones((16, 8), np.float32)
    evaluated, _ = model.forward(x, ForwardContext(training=False))
    np.testing.assert_array_equal(evaluated, model.layers[1].forward(x)[0])
    step1, _ = model.forward(x, ForwardContext(step=1))
    assert not np.array_equal(step1, model.forward(x, ForwardContext(step=2))[0])
    assert step1.tobytes() == model.forward(x, ForwardContext(step=1))[0].tobytes()
    assert model.forward(x)[0].tobytes() == model.forward(x, ForwardContext(True, 0, 0))[0].tobytes()


def test_unnamed_dropouts_are_named_by_position_and_draw_different_masks():
    model = build_model([{"type": "identity"}, {"type": "dropout", "rate": 0.5}, {"type": "dropout", "rate": 0.5}],
                        seed=0)
    assert [layer.name for layer in model.layers[1:]] == ["dropout1", "dropout2"]
    ctx = ForwardContext(step=1)
    assert not np.array_equal(model.layers[1].mask((8, 8), ctx), model.layers[2].mask((8, 8), ctx))
    with pytest.raises(ConfigError, match="'drop' is used twice"):
        build_model([{"type": "dropout", "rate": 0.1, "name": "drop"},
                     {"type": "dropout", "rate": 0.2, "name": "drop"}], seed=0)


@pytest.mark.parametrize("step, micro_batch", [(-1, 0), (0, -1)])
def test_forward_context_refuses_negative_positions(step, micro_batch):
    with pytest.raises(ValueError, match="must be >= 0"):
        ForwardContext(True, step, micro_batch)


# ------------------------------------------------------- builders, shapes

def test_build_layer_builds_each_new_type_with_its_defaults():
    conv = build_layer({"type": "conv2d", "name": "c", "in": 3, "out": 8, "kernel": 5}, seed=0)
    assert isinstance(conv, Conv2D) and (conv.kernel, conv.stride, conv.padding) == ((5, 5), (1, 1), (0, 0))
    assert conv.params["c.W"].shape == (8, 3, 5, 5) and conv.params["c.W"].dtype == np.float32
    assert conv.params["c.b"].shape == (8,) and not conv.params["c.b"].any()
    pool = build_layer({"type": "maxpool2d", "kernel": [2, 3]}, seed=0)
    assert isinstance(pool, MaxPool2D) and pool.kernel == pool.stride == (2, 3)
    assert build_layer({"type": "maxpool2d", "kernel": 3, "stride": 1, "padding": 0}, seed=0).stride == (1, 1)
    assert isinstance(build_layer({"type": "flatten"}, seed=0), Flatten)
    assert build_layer({"type": "reshape", "shape": [1, 8, 8]}, seed=0).shape == (1, 8, 8)
    drop = build_layer({"type": "dropout", "rate": 0.25}, seed=9, index=4)
    assert (drop.rate, drop.name, drop.seed) == (0.25, "dropout4", 9)
    assert build_layer({"type": "dropout", "rate": 0, "name": "keep"}, seed=0).name == "keep"
    emb = build_layer({"type": "embedding", "name": "e", "vocab": 50, "dim": 4}, seed=0)
    assert emb.params["e.W"].shape == (50, 4) and np.abs(emb.params["e.W"]).max() <= 0.2 * (1 + 1e-6)
    ln = build_layer({"type": "layernorm", "name": "ln", "size": 6}, seed=0)
    assert ln.eps == np.float32(1e-5)
    np.testing.assert_array_equal(ln.params["ln.gamma"], np.ones(6, np.float32))
    np.testing.assert_array_equal(ln.params["ln.beta"], np.zeros(6, np.float32))


def test_conv2d_default_init_is_glorot_on_the_receptive_field():
    w = build_layer({"type": "conv2d", "name": "c", "in": 16, "out": 32, "kernel": 3}, seed=0).params["c.W"]
    limit = np.sqrt(6.0 / (16 * 9 + 32 * 9))
    assert np.abs(w).max() <= limit * (1 + 1e-6) and np.abs(w).max() > 0.9 * limit


def test_conv2d_parameters_depend_on_seed_and_name_only():
    spec = {"type": "conv2d", "name": "c", "in": 2, "out": 3, "kernel": 3}
    a, b = build_layer(spec, seed=1), build_layer(spec, seed=1)
    assert a.params["c.W"].tobytes() == b.params["c.W"].tobytes()
    assert not np.array_equal(a.params["c.W"], build_layer(spec, seed=2).params["c.W"])


@pytest.mark.parametrize("spec, needle", [
    ({"type": "conv2d", "name": "c", "in": 1, "out": 4}, "needs the key 'kernel'"),
    ({"type": "conv2d", "name": "c", "in": 1, "out": 4, "kernel": 3, "kernal": 3}, "kernal"),
    ({"type": "conv2d", "name": "c", "in": 1, "out": 4, "kernel": 0}, "'kernel' must be a whole number >= 1"),
    ({"type": "conv2d", "name": "c", "in": 1, "out": 4, "kernel": [3]}, "'kernel'"),
    ({"type": "conv2d", "name": "c", "in": 1, "out": 4, "kernel": [3, 3, 3]}, "'kernel'"),
    ({"type": "conv2d", "name": "c", "in": 1, "out": 4, "kernel": 2.5}, "'kernel'"),
    ({"type": "conv2d", "name": "c", "in": 1, "out": 4, "kernel": True}, "'kernel'"),
    ({"type": "conv2d", "name": "c", "in": 1, "out": 4, "kernel": 3, "stride": 0}, "'stride'"),
    ({"type": "conv2d", "name": "c", "in": 1, "out": 4, "kernel": 3, "padding": -1}, "'padding'"),
    ({"type": "conv2d", "name": "c", "in": 0, "out": 4, "kernel": 3}, "channels must be >= 1"),
    ({"type": "conv2d", "name": "c", "in": "1", "out": 4, "kernel": 3}, "'in' must be a whole number"),
    ({"type": "conv2d", "in": 1, "out": 4, "kernel": 3}, "needs the key 'name'"),
    ({"type": "conv2d", "name": "c", "in": 1, "out": 4, "kernel": 3, "init": "bogus"}, "bogus"),
    ({"type": "maxpool2d"}, "needs the key 'kernel'"),
    ({"type": "maxpool2d", "kernel": 0}, "'kernel'"),
    ({"type": "maxpool2d", "kernel": 2, "stride": 0}, "'stride'"),
    ({"type": "maxpool2d", "kernel": 2, "padding": 1}, "padding' = 0 is supported"),
    ({"type": "maxpool2d", "kernel": 2, "name": "p"}, "unknown keys"),
    ({"type": "flatten", "start": 1}, "unknown keys"),
    ({"type": "reshape"}, "needs the key 'shape'"),
    ({"type": "reshape", "shape": []}, "'shape' must be a list"),
    ({"type": "reshape", "shape": [1, 0, 8]}, "'shape' must be a list"),
    ({"type": "reshape", "shape": 64}, "'shape' must be a list"),
    ({"type": "reshape", "shape": [8.0, 8]}, "'shape' must be a list"),
    ({"type": "dropout"}, "needs the key 'rate'"),
    ({"type": "dropout", "rate": 1.0}, r"in \[0, 1\)"),
    ({"type": "dropout", "rate": -0.1}, r"in \[0, 1\)"),
    ({"type": "dropout", "rate": "0.5"}, r"in \[0, 1\)"),
    ({"type": "dropout", "rate": True}, r"in \[0, 1\)"),
    ({"type": "dropout", "rate": float("nan")}, r"in \[0, 1\)"),
    ({"type": "dropout", "rate": 0.5, "name": ""}, "non-empty string"),
    ({"type": "dropout", "rate": 0.5, "seed": 3}, "unknown keys"),
    ({"type": "embedding", "name": "e", "vocab": 0, "dim": 4}, "vocab must be in"),
    ({"type": "embedding", "name": "e", "vocab": 2 ** 24 + 1, "dim": 4}, "vocab must be in"),
    ({"type": "embedding", "name": "e", "vocab": 10, "dim": 0}, "dim >= 1"),
    ({"type": "embedding", "name": "e", "vocab": 10}, "needs the key 'dim'"),
    ({"type": "layernorm", "name": "ln"}, "needs the key 'size'"),
    ({"type": "layernorm", "name": "ln", "size": 0}, "size must be >= 1"),
    ({"type": "layernorm", "name": "ln", "size": 4, "eps": 0}, "'eps' must be a positive"),
    ({"type": "layernorm", "name": "ln", "size": 4, "eps": -1e-5}, "'eps' must be a positive"),
    ({"type": "layernorm", "name": "ln", "size": 4, "eps": 1e-50}, "'eps' must be a positive"),   # 0 in float32
    ({"type": "layernorm", "name": "ln", "size": 4, "eps": "small"}, "'eps' must be a positive"),
    ({"type": "layernorm", "name": "ln", "size": 4, "eps": float("inf")}, "'eps' must be a positive"),
])
def test_build_layer_refuses_bad_specs_naming_the_problem(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        build_layer(spec, seed=0)


@pytest.mark.parametrize("layer, shape, expected", [
    (Conv2D("c", 1, 4, 3, seed=0, padding=1), (32, 1, 8, 8), (32, 4, 8, 8)),
    (Conv2D("c", 1, 4, 3, seed=0), (32, 1, 8, 8), (32, 4, 6, 6)),
    (Conv2D("c", 2, 4, 3, seed=0, stride=2, padding=1), (5, 2, 7, 8), (5, 4, 4, 4)),
    (Conv2D("c", 2, 4, [1, 3], seed=0, stride=[1, 2]), (5, 2, 3, 9), (5, 4, 3, 4)),
    (MaxPool2D(2), (32, 4, 8, 8), (32, 4, 4, 4)),
    (MaxPool2D(2), (32, 4, 7, 5), (32, 4, 3, 2)),
    (MaxPool2D(3, 1), (2, 1, 5, 4), (2, 1, 3, 2)),
    (Flatten(), (32, 4, 4, 4), (32, 64)),
    (Flatten(), (32, 7), (32, 7)),
    (Reshape([1, 8, 8]), (32, 64), (32, 1, 8, 8)),
    (Reshape([64]), (32, 4, 4, 4), (32, 64)),
    (Dropout(0.5, "d", seed=0), (3, 4, 5), (3, 4, 5)),
    (Embedding("e", 10, 4, "zeros", seed=0), (32, 7), (32, 7, 4)),
    (LayerNorm("ln", 5), (3, 5), (3, 5)),
    (LayerNorm("ln", 5), (3, 2, 5), (3, 2, 5)),
])
def test_output_shape(layer, shape, expected):
    assert layer.output_shape(shape) == expected


@pytest.mark.parametrize("layer, shape, needle", [
    (Conv2D("c", 1, 4, 3, seed=0), (32, 2, 8, 8), r"'c' takes \(batch, 1, height, width\)"),
    (Conv2D("c", 1, 4, 3, seed=0), (32, 64), "'c' takes"),
    (Conv2D("c", 1, 4, 5, seed=0, padding=0), (32, 1, 4, 8), "5x5 window does not fit a 4x8 image"),
    (MaxPool2D(2), (32, 64), r"takes \(batch, channels, height, width\)"),
    (MaxPool2D(3), (32, 1, 2, 8), "3x3 window does not fit"),
    (Flatten(), (32,), r"takes \(batch, ...\)"),
    (Reshape([1, 8, 8]), (32, 63), "64 values a row"),
    (Embedding("e", 10, 4, "zeros", seed=0), (32, 7, 1), r"'e' takes ids of shape \(batch, length\)"),
    (LayerNorm("ln", 5), (3, 4), r"'ln' takes \(batch, ..., 5\)"),
    (LayerNorm("ln", 5), (5,), "'ln' takes"),
])
def test_output_shape_refuses_what_the_layer_cannot_take(layer, shape, needle):
    with pytest.raises(ConfigError, match=needle):
        layer.output_shape(shape)


def test_builders_list_the_new_types():
    with pytest.raises(ConfigError) as info:
        build_layer({"type": "conv"}, seed=0)
    for kind in ("conv2d", "maxpool2d", "flatten", "reshape", "dropout", "embedding", "layernorm"):
        assert kind in str(info.value)
