"""Unit tests for distgrad.model.nn: gradients, shapes, initialisers, builders."""

from __future__ import annotations

import numpy as np
import pytest

from distgrad.model import nn
from distgrad.errors import ConfigError
from distgrad.model.nn import (Dense, ReLU, Scale, Sequential, Sigmoid, Tanh, build_layer, build_model,
                               make_initialiser, param_rng, truncated_normal)

# ------------------------------------------------------------ gradient check
#
# Why float64: the layers compute in whatever dtype they are given (their
# float32 constants promote to float64 against float64 arrays), so we cast the
# parameters and inputs to float64 and check the *same code* with central
# differences in float64. With h = 1e-6 the truncation error is O(h**2) ~ 1e-12
# and the rounding error O(1e-16 / h) ~ 1e-10, so a tight tolerance
# (rtol 1e-6, atol 1e-8) separates a right gradient from a wrong one by many
# orders of magnitude. Doing the differences in float32 would need h ~ 1e-2 and
# tolerances ~ 1e-2, loose enough to hide real mistakes. Float32 behaviour is
# covered separately (dtype preservation and agreement with the float64
# analytical gradient).

FD_STEP = 1e-6
FD_RTOL = 1e-6
FD_ATOL = 1e-8


def as_float64(layer: nn.Layer) -> nn.Layer:
    """Cast a layer's parameters to float64 (rebuilding a Sequential so it shares them)."""
    if isinstance(layer, Sequential):
        return Sequential([as_float64(sub) for sub in layer.layers])
    for name in list(layer.params):
        layer.params[name] = layer.params[name].astype(np.float64)
    return layer


def numerical_grad(f, array: np.ndarray, h: float = FD_STEP) -> np.ndarray:
    """Central differences of the scalar ``f()`` with respect to ``array`` (perturbed in place)."""
    grad = np.zeros_like(array)
    for idx in np.ndindex(array.shape):
        orig = array[idx]
        array[idx] = orig + h
        f_plus = f()
        array[idx] = orig - h
        f_minus = f()
        array[idx] = orig
        grad[idx] = (f_plus - f_minus) / (2 * h)
    return grad


def check_layer_gradients(layer: nn.Layer, x: np.ndarray, seed: int = 0, ctx: nn.ForwardContext | None = None) -> None:
    """Check ``dx`` and every parameter gradient of ``layer`` at ``x`` by finite differences.

    The scalar objective is ``sum(forward(x, ctx) * r)`` for a fixed random ``r``,
    so ``dy = r`` and every output element contributes with its own weight.
    """
    layer = as_float64(layer)
    x = np.array(x, dtype=np.float64)
    y, cache = layer.forward(x, ctx)
    assert y.dtype == np.float64, "the check must really run in float64"
    assert y.shape == layer.output_shape(x.shape)
    r = np.random.default_rng(seed).normal(size=y.shape)

    def objective() -> float:
        out, _ = layer.forward(x, ctx)
        return float(np.sum(out * r))

    dx, grads = layer.backward(cache, r.copy())
    assert dx.shape == x.shape
    assert set(grads) == set(layer.params), "a gradient for every parameter, and nothing else"

    np.testing.assert_allclose(dx, numerical_grad(objective, x), rtol=FD_RTOL, atol=FD_ATOL,
                               err_msg="dx")
    for name, param in layer.params.items():
        assert grads[name].shape == param.shape, name
        np.testing.assert_allclose(grads[name], numerical_grad(objective, param),
                                   rtol=FD_RTOL, atol=FD_ATOL, err_msg=name)


def away_from_zero(rng: np.random.Generator, shape, low: float = 0.1, high: float = 2.0) -> np.ndarray:
    """Values with |v| in [low, high] and random signs (keeps ReLU off its kink)."""
    return rng.uniform(low, high, size=shape) * rng.choice([-1.0, 1.0], size=shape)


RNG_SEED = 1234


def test_scale_gradient_unbatched():
    rng = np.random.default_rng(RNG_SEED)
    check_layer_gradients(Scale("s", 5, "truncated_normal", seed=1), rng.normal(size=(5,)))


def test_scale_gradient_batched():
    rng = np.random.default_rng(RNG_SEED)
    layer = Scale("s", 4, {"kind": "truncated_normal", "stddev": 1.0}, seed=2)
    check_layer_gradients(layer, rng.normal(size=(3, 4)))


def test_dense_gradient():
    rng = np.random.default_rng(RNG_SEED)
    # A non-zero bias so the bias really takes part in the forward pass.
    layer = Dense("d", 4, 3, "glorot_uniform", seed=3, bias_init={"kind": "truncated_normal", "stddev": 0.5})
    check_layer_gradients(layer, rng.normal(size=(5, 4)))


def test_relu_gradient():
    rng = np.random.default_rng(RNG_SEED)
    check_layer_gradients(ReLU(), away_from_zero(rng, (4, 6)))


def test_tanh_gradient():
    rng = np.random.default_rng(RNG_SEED)
    check_layer_gradients(Tanh(), rng.normal(scale=1.5, size=(4, 6)))


def test_sigmoid_gradient():
    rng = np.random.default_rng(RNG_SEED)
    check_layer_gradients(Sigmoid(), rng.normal(scale=3.0, size=(4, 6)))


def test_sequential_gradient_dense_tanh_dense():
    rng = np.random.default_rng(RNG_SEED)
    model = Sequential([
        Dense("h", 3, 5, "glorot_uniform", seed=4, bias_init={"kind": "truncated_normal", "stddev": 0.3}),
        Tanh(),
        Dense("o", 5, 2, "glorot_uniform", seed=4, bias_init=0.1),
    ])
    check_layer_gradients(model, rng.normal(size=(4, 3)))


def test_sequential_gradient_all_layer_kinds():
    rng = np.random.default_rng(RNG_SEED)
    # Large first-layer weights and a 0.5 bias keep ReLU inputs away from 0
    # for this seed; the assertion below makes sure of it.
    model = Sequential([
        Scale("s", 3, {"kind": "truncated_normal", "mean": 1.0, "stddev": 0.2}, seed=5),
        Dense("h", 3, 4, "glorot_uniform", seed=5, bias_init=0.5),
        ReLU(),
        Dense("o", 4, 2, "glorot_uniform", seed=5),
        Sigmoid(),
    ])
    x = rng.normal(size=(3, 3))
    model64 = as_float64(model)
    pre_relu = model64.layers[1].forward(model64.layers[0].forward(x)[0])[0]
    assert np.abs(pre_relu).min() > 10 * FD_STEP
    check_layer_gradients(model64, x)


def test_relu_gradient_at_zero_is_zero():
    x = np.array([[-1.0, 0.0, 2.0]], np.float32)
    y, cache = ReLU().forward(x)
    dx, grads = ReLU().backward(cache, np.ones_like(x))
    np.testing.assert_array_equal(y, [[0.0, 0.0, 2.0]])
    np.testing.assert_array_equal(dx, [[0.0, 0.0, 1.0]])
    assert grads == {}


def test_sigmoid_does_not_overflow():
    x = np.array([-1e4, -100.0, 0.0, 100.0, 1e4], np.float32)
    with np.errstate(all="raise"):
        y, _ = Sigmoid().forward(x)
    np.testing.assert_allclose(y, [0.0, 0.0, 0.5, 1.0, 1.0], atol=1e-30)


# ------------------------------------------------------------- float32 path

def float32_layers():
    return [
        ("scale", lambda: Scale("s", 4, 0.5, seed=0), (4,)),
        ("scale_batched", lambda: Scale("s", 4, "truncated_normal", seed=0), (3, 4)),
        ("dense", lambda: Dense("d", 4, 3, "glorot_uniform", seed=0, bias_init=0.2), (3, 4)),
        ("relu", ReLU, (3, 4)),
        ("tanh", Tanh, (3, 4)),
        ("sigmoid", Sigmoid, (3, 4)),
        ("sequential", lambda: Sequential([Dense("h", 4, 5, "glorot_uniform", seed=0), Tanh(),
                                           Dense("o", 5, 2, "glorot_uniform", seed=0)]), (3, 4)),
    ]


@pytest.mark.parametrize("make, shape", [(m, s) for _, m, s in float32_layers()],
                         ids=[i for i, _, _ in float32_layers()])
def test_float32_in_float32_out_and_close_to_float64(make, shape):
    rng = np.random.default_rng(7)
    x32 = away_from_zero(rng, shape).astype(np.float32)
    dy32 = rng.normal(size=make().output_shape(shape)).astype(np.float32)

    layer32 = make()
    assert all(p.dtype == np.float32 for p in layer32.params.values())
    y32, cache32 = layer32.forward(x32)
    dx32, grads32 = layer32.backward(cache32, dy32)
    assert y32.dtype == np.float32 and dx32.dtype == np.float32
    assert all(g.dtype == np.float32 for g in grads32.values())

    layer64 = as_float64(make())
    y64, cache64 = layer64.forward(x32.astype(np.float64))
    dx64, grads64 = layer64.backward(cache64, dy32.astype(np.float64))
    np.testing.assert_allclose(y32, y64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx32, dx64, rtol=1e-5, atol=1e-6)
    for name in grads64:
        np.testing.assert_allclose(grads32[name], grads64[name], rtol=1e-5, atol=1e-6, err_msg=name)


def check_inputs_untouched(layer: nn.Layer, x: np.ndarray, dy: np.ndarray) -> None:
    """Forward and backward of ``layer`` on read-only ``x`` and ``dy`` (as received frames) change neither,
    nor the parameters, nor the output; and a second backward from the same cache gives the same answer
    (several micro-batches may be in flight, so backward must not consume the cache)."""
    x_copy, dy_copy = x.copy(), dy.copy()
    params_copy = {k: v.copy() for k, v in layer.params.items()}
    x.setflags(write=False)
    dy.setflags(write=False)
    y, cache = layer.forward(x)
    y_copy = y.copy()
    dx, grads = layer.backward(cache, dy)
    dx2, grads2 = layer.backward(cache, dy)
    np.testing.assert_array_equal(x, x_copy)
    np.testing.assert_array_equal(dy, dy_copy)
    np.testing.assert_array_equal(y, y_copy)
    np.testing.assert_array_equal(dx, dx2)
    for name in grads:
        np.testing.assert_array_equal(grads[name], grads2[name])
    for name, value in params_copy.items():
        np.testing.assert_array_equal(layer.params[name], value)


@pytest.mark.parametrize("make, shape", [(m, s) for _, m, s in float32_layers()],
                         ids=[i for i, _, _ in float32_layers()])
def test_inputs_are_not_modified(make, shape):
    rng = np.random.default_rng(8)
    layer = make()
    x = away_from_zero(rng, shape).astype(np.float32)
    check_inputs_untouched(layer, x, rng.normal(size=layer.output_shape(shape)).astype(np.float32))


def test_interleaved_micro_batches():
    model = Sequential([Dense("h", 3, 4, "glorot_uniform", seed=0), Tanh(),
                        Dense("o", 4, 2, "glorot_uniform", seed=0)])
    rng = np.random.default_rng(9)
    xa, xb = (rng.normal(size=(2, 3)).astype(np.float32) for _ in range(2))
    dy = np.ones((2, 2), np.float32)
    alone = model.backward(model.forward(xa)[1], dy)
    _, cache_a = model.forward(xa)
    _, cache_b = model.forward(xb)
    model.backward(cache_b, dy)
    interleaved = model.backward(cache_a, dy)
    np.testing.assert_array_equal(alone[0], interleaved[0])
    for name in alone[1]:
        np.testing.assert_array_equal(alone[1][name], interleaved[1][name])


# ------------------------------------------------------------- output_shape

def test_scale_output_shape():
    layer = Scale("s", 3, 1.0, seed=0)
    assert layer.output_shape((3,)) == (3,)
    assert layer.output_shape((7, 3)) == (7, 3)
    for bad in [(4,), (2, 4), (3, 1), (2, 2, 3), ()]:
        with pytest.raises(ConfigError, match="'s'"):
            layer.output_shape(bad)


def test_dense_output_shape():
    layer = Dense("d", 3, 4, "glorot_uniform", seed=0)
    assert layer.output_shape((5, 3)) == (5, 4)
    for bad in [(3,), (5, 4), (3, 5), (1, 5, 3), ()]:
        with pytest.raises(ConfigError, match="'d'"):
            layer.output_shape(bad)


@pytest.mark.parametrize("layer", [ReLU(), Tanh(), Sigmoid()], ids=["relu", "tanh", "sigmoid"])
def test_activation_output_shape_is_identity(layer):
    assert layer.output_shape((2, 7)) == (2, 7)
    assert layer.output_shape((5,)) == (5,)


def test_sequential_output_shape():
    model = Sequential([Dense("h", 3, 4, "zeros", seed=0), Tanh(), Dense("o", 4, 2, "zeros", seed=0)])
    assert model.output_shape((6, 3)) == (6, 2)
    with pytest.raises(ConfigError):
        model.output_shape((6, 4))
    mismatched = Sequential([Dense("h", 3, 4, "zeros", seed=0), Dense("o", 5, 2, "zeros", seed=0)])
    with pytest.raises(ConfigError, match="'o'"):
        mismatched.output_shape((6, 3))


def test_output_shape_matches_forward():
    model = Sequential([Scale("s", 3, 1.0, seed=0), Dense("h", 3, 4, "glorot_uniform", seed=0), ReLU()])
    x = np.ones((2, 3), np.float32)
    assert model.forward(x)[0].shape == model.output_shape(x.shape)


@pytest.mark.parametrize("make", [
    lambda: Scale("s", 0, 1.0, seed=0),
    lambda: Dense("d", 0, 3, "zeros", seed=0),
    lambda: Dense("d", 3, 0, "zeros", seed=0),
], ids=["scale_size_0", "dense_in_0", "dense_out_0"])
def test_sizes_must_be_positive(make):
    with pytest.raises(ConfigError):
        make()


# ------------------------------------------------------------- initialisers

def test_param_rng_depends_on_seed_and_name_only():
    a = param_rng(3, "layer.W").normal(size=10)
    b = param_rng(3, "layer.W").normal(size=10)
    c = param_rng(3, "layer.b").normal(size=10)
    d = param_rng(4, "layer.W").normal(size=10)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, d)


@pytest.mark.parametrize("init", ["truncated_normal", "glorot_uniform",
                                  {"kind": "truncated_normal", "stddev": 0.5, "mean": 1.0}])
def test_initialisers_are_reproducible(init):
    a = Dense("h", 6, 5, init, seed=11, bias_init=init)
    b = Dense("h", 6, 5, init, seed=11, bias_init=init)
    other_name = Dense("g", 6, 5, init, seed=11, bias_init=init)
    other_seed = Dense("h", 6, 5, init, seed=12, bias_init=init)
    for suffix in (".W", ".b"):
        np.testing.assert_array_equal(a.params["h" + suffix], b.params["h" + suffix])
        assert not np.array_equal(a.params["h" + suffix], other_name.params["g" + suffix])
        assert not np.array_equal(a.params["h" + suffix], other_seed.params["h" + suffix])
    # W and b of one layer get different streams even with one initialiser.
    assert not np.array_equal(a.params["h.W"][0, :], a.params["h.b"])

    s1 = Scale("w1", 8, init, seed=11)
    s2 = Scale("w1", 8, init, seed=11)
    s3 = Scale("w2", 8, init, seed=11)
    np.testing.assert_array_equal(s1.params["w1"], s2.params["w1"])
    assert not np.array_equal(s1.params["w1"], s3.params["w2"])


def test_init_value_does_not_depend_on_other_layers():
    # A parameter's value depends only on (seed, name), not on what else is built.
    alone = Dense("o", 4, 2, "glorot_uniform", seed=5).params["o.W"]
    model = build_model([{"type": "dense", "name": "h", "in": 3, "out": 4}, {"type": "tanh"},
                         {"type": "dense", "name": "o", "in": 4, "out": 2}], seed=5)
    np.testing.assert_array_equal(model.params["o.W"], alone)


@pytest.mark.parametrize("stddev, mean", [(0.01, 0.0), (0.5, 1.0), (3.0, -2.0)])
def test_truncated_normal_never_exceeds_two_stddev(stddev, mean):
    rng = np.random.default_rng(0)
    n = 200_000
    # Sanity: untruncated, ~4.6% of the draws are beyond 2 stddev, so the
    # redraw loop is certainly exercised with this many samples.
    out = truncated_normal(rng, (n,), stddev, mean)
    assert out.dtype == np.float32 and out.shape == (n,)
    # The samples are cast to float32; allow one float32 rounding of slack.
    limit = 2 * stddev + 4 * np.finfo(np.float32).eps * (abs(mean) + 2 * stddev)
    assert np.abs(out.astype(np.float64) - mean).max() <= limit
    # Not degenerate: the spread of a normal truncated at 2 sigma is ~0.88 sigma
    # and the tails close to the bound are reached.
    assert 0.85 * stddev < out.std() < 0.91 * stddev
    assert np.abs(out.astype(np.float64) - mean).max() > 1.99 * stddev


def test_truncated_normal_through_make_initialiser():
    init = make_initialiser({"kind": "truncated_normal", "stddev": 0.1})
    out = init(np.random.default_rng(1), (300, 300))
    assert out.dtype == np.float32 and out.shape == (300, 300)
    assert np.abs(out).max() <= 0.2 * (1 + 1e-6)


def test_glorot_uniform_bounds():
    out = make_initialiser("glorot_uniform")(np.random.default_rng(2), (30, 20))
    limit = np.sqrt(6.0 / 50)
    assert out.dtype == np.float32
    assert np.abs(out).max() <= limit * (1 + 1e-6)
    assert np.abs(out).max() > 0.9 * limit


def test_constant_and_zeros_initialisers():
    rng = np.random.default_rng(0)
    const = make_initialiser(0.01723497)(rng, (3,))
    assert const.dtype == np.float32
    np.testing.assert_array_equal(const, np.full(3, np.float32(0.01723497)))
    np.testing.assert_array_equal(make_initialiser(2)(rng, (2, 2)), np.full((2, 2), 2, np.float32))
    zeros = make_initialiser("zeros")(rng, (2, 3))
    assert zeros.dtype == np.float32 and not zeros.any()
    scale = Scale("w1", 1, 0.01723497, seed=0)
    assert scale.params["w1"].dtype == np.float32
    assert scale.params["w1"][0] == np.float32(0.01723497)


@pytest.mark.parametrize("spec", [
    "nope",
    {"kind": "nope"},
    {"stddev": 0.1},
    {"kind": "truncated_normal", "stdev": 0.1},
    {"kind": "zeros", "value": 1},
    {"kind": "truncated_normal", "stddev": 0.0},
    {"kind": "truncated_normal", "stddev": -1.0},
    {"kind": "truncated_normal", "stddev": float("nan")},
    {"kind": "truncated_normal", "stddev": float("inf")},
    {"kind": "truncated_normal", "mean": float("nan")},
    True,
    None,
    [0.1],
])
def test_invalid_initialisers_raise_config_error(spec):
    with pytest.raises(ConfigError):
        make_initialiser(spec)


# ----------------------------------------------------------------- builders

def test_build_layer_builds_each_type():
    scale = build_layer({"type": "scale", "name": "w1", "size": 2, "init": 0.5}, seed=0)
    assert isinstance(scale, Scale)
    np.testing.assert_array_equal(scale.params["w1"], [0.5, 0.5])
    dense = build_layer({"type": "dense", "name": "h", "in": 4, "out": 8}, seed=0)
    assert isinstance(dense, Dense)
    assert dense.params["h.W"].shape == (4, 8) and dense.params["h.b"].shape == (8,)
    assert not dense.params["h.b"].any(), "bias defaults to zeros"
    assert isinstance(build_layer({"type": "relu"}, seed=0), ReLU)
    assert isinstance(build_layer({"type": "tanh"}, seed=0), Tanh)
    assert isinstance(build_layer({"type": "sigmoid"}, seed=0), Sigmoid)


def test_build_layer_does_not_modify_its_spec():
    spec = {"type": "dense", "name": "h", "in": 4, "out": 8}
    build_layer(spec, seed=0)
    assert spec == {"type": "dense", "name": "h", "in": 4, "out": 8}


@pytest.mark.parametrize("spec", [
    {"type": "conv"},
    {"name": "h"},
    {"type": None},
    {"type": "dense", "name": "h", "in": 4, "out": 8, "activation": "relu"},
    {"type": "relu", "name": "r"},
    {"type": "scale", "name": "w", "size": 1, "inti": 0.1},
    {"type": "dense", "name": "h", "in": 4},
    {"type": "dense", "in": 4, "out": 8},
    {"type": "scale", "size": 2},
    {"type": "dense", "name": "h", "in": "four", "out": 8},
    {"type": "scale", "name": "w", "size": None},
    {"type": "scale", "name": "w", "size": 0},
    {"type": "scale", "name": "w", "init": "bogus"},
    {"type": "scale", "name": "w", "init": {"kind": "truncated_normal", "stddev": "wide"}},
])
def test_build_layer_rejects_bad_specs(spec):
    with pytest.raises(ConfigError):
        build_layer(spec, seed=0)


def test_build_layer_error_names_the_unknown_key():
    with pytest.raises(ConfigError, match="activation"):
        build_layer({"type": "dense", "name": "h", "in": 4, "out": 8, "activation": "relu"}, seed=0)
    with pytest.raises(ConfigError, match="conv"):
        build_layer({"type": "conv"}, seed=0)


def test_build_model():
    model = build_model([{"type": "dense", "name": "h", "in": 3, "out": 4}, {"type": "relu"},
                         {"type": "dense", "name": "o", "in": 4, "out": 1}], seed=0)
    assert isinstance(model, Sequential)
    assert list(model.params) == ["h.W", "h.b", "o.W", "o.b"]
    assert model.output_shape((2, 3)) == (2, 1)


def test_build_model_rejects_empty_and_bad_layers():
    with pytest.raises(ConfigError):
        build_model([], seed=0)
    with pytest.raises(ConfigError):
        build_model([{"type": "relu"}, {"type": "pool"}], seed=0)
    with pytest.raises(ConfigError, match="used twice"):
        build_model([{"type": "scale", "name": "w"}, {"type": "scale", "name": "w"}], seed=0)


# --------------------------------------------------------------- Sequential

def test_sequential_rejects_duplicate_parameter_names():
    with pytest.raises(ConfigError, match="'w'"):
        Sequential([Scale("w", 2, 1.0, seed=0), Scale("w", 2, 1.0, seed=0)])
    with pytest.raises(ConfigError, match="'a.W'"):
        Sequential([Dense("a", 2, 2, "zeros", seed=0), Scale("a.W", 2, 1.0, seed=0)])
    with pytest.raises(ConfigError):
        Sequential([Dense("h", 2, 2, "zeros", seed=0), Tanh(), Dense("h", 2, 2, "zeros", seed=0)])


def test_sequential_shares_parameter_arrays_with_its_layers():
    # Optimisers update Sequential.params in place; the layers must see it.
    inner = Dense("h", 2, 3, "glorot_uniform", seed=0)
    model = Sequential([inner, Tanh()])
    assert model.params["h.W"] is inner.params["h.W"]
    model.params["h.W"] -= np.float32(1)
    x = np.ones((1, 2), np.float32)
    np.testing.assert_array_equal(model.forward(x)[0], np.tanh(inner.forward(x)[0]))


def test_nested_sequential():
    model = Sequential([Sequential([Dense("a", 2, 3, "glorot_uniform", seed=0), Tanh()]),
                        Dense("b", 3, 1, "glorot_uniform", seed=0)])
    assert set(model.params) == {"a.W", "a.b", "b.W", "b.b"}
    check_layer_gradients(model, np.random.default_rng(3).normal(size=(2, 2)))


def test_layers_without_parameters_have_empty_params():
    for layer in (ReLU(), Tanh(), Sigmoid(), Sequential([ReLU(), Tanh()])):
        assert layer.params == {}


def test_identity_passes_arrays_through_without_copy_or_parameters():
    layer = nn.build_layer({"type": "identity"}, seed=0)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    x.flags.writeable = False                    # as a received frame
    y, cache = layer.forward(x)
    dx, grads = layer.backward(cache, y)
    assert y is x and dx is x and grads == {} and layer.params == {}
    assert layer.backward(cache, y, need_dx=False) == (None, {})
    assert layer.output_shape((2, 3)) == (2, 3)


def test_deferred_backward_gives_the_same_bits_later():
    """What a serving stage uses: dx first, parameter gradients afterwards, bitwise equal to backward."""
    from distgrad.model.nn import Identity

    rng = np.random.default_rng(RNG_SEED)
    model = Sequential([Scale("s", 6, 1.5, seed=1), Dense("h", 6, 8, "glorot_uniform", seed=1), ReLU(), Tanh(),
                        Dense("o", 8, 3, "glorot_uniform", seed=1), Identity(), Sigmoid()])
    x = rng.normal(size=(5, 6)).astype(np.float32)
    dy = rng.normal(size=(5, 3)).astype(np.float32)
    y, cache = model.forward(x)
    dx, grads = model.backward(cache, dy)
    dx_now, grads_later = model.backward_deferred(cache, dy)
    assert dx_now.tobytes() == dx.tobytes()
    later = grads_later()
    assert list(later) == list(grads)
    assert all(later[name].tobytes() == grads[name].tobytes() for name in grads)
