"""Unit tests for distgrad.optim: the seed's Adam trajectory, a TF1 oracle, SGD, state, builders."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from distgrad.errors import ConfigError
from distgrad.losses import SumSquaredError
from distgrad.nn import Scale
from distgrad.optim import SGD, Adam, build_optimizer

F32 = np.float32

# The seed's printed (gradient, weight after the update) for its 40 steps:
# w1 starts at 0.01723497, Adam(lr=0.1), x = y = float32(1.0 - 0.1 * i),
# loss = square(x * w1 - y).
SEED_TRAJECTORY = """
-1.96553004 0.11723495
-1.43007934 0.21520177
-1.00454175 0.30959633
-0.67659557 0.39896959
-0.43274194 0.48216373
-0.25891814 0.55845356
-0.14129487 0.62758404
-0.06703488 0.68971366
-0.02482291 0.74530613
-0.00509388 0.79501069
0. 0.83955526
-0.00320889 0.87966293
-0.00962697 0.91598856
-0.01512206 0.94907117
-0.01629722 0.97929788
-0.01035106 1.00687504
0.00495 1.03180671
0.03117061 1.05388248
0.06896954 1.07267869
0.11773942 1.0875833
0.17516661 1.09785533
0.23680991 1.10272753
0.29585525 1.10155463
0.34325477 1.09398866
0.36843565 1.08014917
0.36067128 1.0607568
0.31107482 1.03721702
0.21511427 1.01165771
0.07554216 0.9868952
-0.09461667 0.96622533
-0.27019739 0.95288545
-0.41555056 0.94919068
-0.49183381 0.95571381
-0.46854743 0.97095138
-0.33464015 0.99147183
-0.10660172 1.01231492
0.16649704 1.02784395
0.40596458 1.03349435
0.52519089 1.0277853
0.46734878 1.01306129
"""


def seed_trajectory() -> list[tuple[float, float]]:
    rows = [tuple(float(v) for v in line.split()) for line in SEED_TRAJECTORY.strip().splitlines()]
    assert len(rows) == 40 and all(len(r) == 2 for r in rows)
    return rows


def test_seed_simple_case_matches_printed_values():
    """The key test: the real layer, loss and optimiser reproduce the seed's 40 steps."""
    layer = Scale("w1", 1, 0.01723497, seed=0)
    loss = SumSquaredError()
    opt = Adam(lr=0.1)
    assert layer.params["w1"].dtype == np.float32 and layer.params["w1"].shape == (1,)
    assert layer.params["w1"][0] == F32(0.01723497)

    for i, (expected_grad, expected_w) in enumerate(seed_trajectory()):
        x = np.array([F32(1.0 - 0.1 * i)], np.float32)  # computed in double, then cast
        y = x.copy()
        output, cache = layer.forward(x)
        _, doutput = loss.forward_backward(output, y)
        _, grads = layer.backward(cache, doutput)
        opt.step(layer.params, grads)

        g, w = grads["w1"], layer.params["w1"]
        assert g.dtype == np.float32 and w.dtype == np.float32
        assert abs(float(g[0]) - expected_grad) <= 1e-6, f"gradient at step {i}: {g[0]!r} != {expected_grad}"
        assert abs(float(w[0]) - expected_w) <= 1e-6, f"weight at step {i}: {w[0]!r} != {expected_w}"


def test_seed_simple_case_by_hand_formula_is_bitwise_the_layer_path():
    # The gradient the seed computes, x * ((x*w - y) * 2), equals the one
    # through Scale + SumSquaredError bit for bit.
    layer = Scale("w1", 1, 0.01723497, seed=0)
    opt_layer, opt_hand = Adam(lr=0.1), Adam(lr=0.1)
    w_hand = {"w1": np.array([0.01723497], np.float32)}
    for i in range(40):
        x = np.array([F32(1.0 - 0.1 * i)], np.float32)
        out, cache = layer.forward(x)
        _, grads = layer.backward(cache, SumSquaredError().forward_backward(out, x)[1])
        g_hand = x * ((x * w_hand["w1"] - x) * F32(2))
        np.testing.assert_array_equal(grads["w1"], g_hand)
        opt_layer.step(layer.params, grads)
        opt_hand.step(w_hand, {"w1": g_hand})
        np.testing.assert_array_equal(layer.params["w1"], w_hand["w1"])


# --------------------------------------------------------------- TF1 oracle

def oracle_adam(params0, grad_steps, lr=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8,
                float64_constants=False):
    """Straight-line TF1 ApplyAdam in float32, independent of distgrad.

    With ``float64_constants`` the ``1 - beta`` constants are computed in
    double and rounded once (``float32(1 - 0.9)``) instead of
    ``float32(1) - float32(0.9)``: the variant TF1 does *not* use.
    """
    if float64_constants:
        one_minus_b1, one_minus_b2 = F32(1.0 - beta1), F32(1.0 - beta2)
    else:
        one_minus_b1, one_minus_b2 = F32(1) - F32(beta1), F32(1) - F32(beta2)
    lr, beta1, beta2, epsilon, one = F32(lr), F32(beta1), F32(beta2), F32(epsilon), F32(1)
    w = {k: np.array(v, np.float32) for k, v in params0.items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v = {k: np.zeros_like(x) for k, x in w.items()}
    b1p, b2p = beta1, beta2
    history = []
    for grads in grad_steps:
        alpha = lr * np.sqrt(one - b2p) / (one - b1p)
        for k, g in grads.items():
            m[k] = m[k] + (g - m[k]) * one_minus_b1
            v[k] = v[k] + (g * g - v[k]) * one_minus_b2
            w[k] = w[k] - (m[k] * alpha) / (np.sqrt(v[k]) + epsilon)
        b1p = b1p * beta1
        b2p = b2p * beta2
        history.append({k: x.copy() for k, x in w.items()})
    return history


def random_problem(seed: int, steps: int):
    rng = np.random.default_rng(seed)
    shapes = {"a": (3,), "b": (4, 2), "c": (1,), "d": (2, 3, 2)}
    params0 = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    grad_steps = []
    for _ in range(steps):
        grads = {}
        for k, s in shapes.items():
            scale = 10.0 ** rng.uniform(-4, 2)
            g = (rng.normal(size=s) * scale).astype(np.float32)
            g[rng.random(size=s) < 0.1] = 0  # exact zero gradients happen (ReLU)
            grads[k] = g
        grad_steps.append(grads)
    return params0, grad_steps


HYPERPARAMETERS = [
    {},
    {"lr": 0.1},
    {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6},
    {"lr": 0.3, "beta1": 0.0, "beta2": 0.5, "epsilon": 1e-3},
]


@pytest.mark.parametrize("hyper", HYPERPARAMETERS, ids=lambda h: ",".join(f"{k}={v}" for k, v in h.items()) or "defaults")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adam_matches_tf1_oracle_bitwise(hyper, seed):
    params0, grad_steps = random_problem(seed, steps=60)
    expected = oracle_adam(params0, grad_steps, **hyper)
    params = {k: v.copy() for k, v in params0.items()}
    opt = Adam(**hyper)
    for step, grads in enumerate(grad_steps):
        opt.step(params, grads)
        for k in params:
            assert params[k].dtype == np.float32
            assert np.array_equal(params[k], expected[step][k]), f"{k} differs at step {step}"


def test_adam_matches_oracle_when_some_parameters_have_no_gradient():
    # TF1: the beta powers advance every step; a variable with no gradient is
    # not updated, and its moments start from zero when it first gets one.
    params0, grad_steps = random_problem(3, steps=30)
    for i, grads in enumerate(grad_steps):
        if i < 10:
            del grads["b"]
        if i % 3 == 0:
            del grads["c"]
    expected = oracle_adam(params0, grad_steps, lr=0.05)
    params = {k: v.copy() for k, v in params0.items()}
    opt = Adam(lr=0.05)
    for step, grads in enumerate(grad_steps):
        opt.step(params, grads)
        for k in params:
            assert np.array_equal(params[k], expected[step][k]), f"{k} differs at step {step}"
    np.testing.assert_array_equal(params["b"] != params0["b"], np.ones_like(params["b"], bool))


def test_float32_constants_are_used():
    assert F32(1) - F32(0.9) != F32(1 - 0.9)
    params0, grad_steps = random_problem(4, steps=40)
    good = oracle_adam(params0, grad_steps, lr=0.1)
    bad = oracle_adam(params0, grad_steps, lr=0.1, float64_constants=True)
    params = {k: v.copy() for k, v in params0.items()}
    opt = Adam(lr=0.1)
    diverged = False
    for step, grads in enumerate(grad_steps):
        opt.step(params, grads)
        for k in params:
            assert np.array_equal(params[k], good[step][k])
            diverged |= not np.array_equal(params[k], bad[step][k])
    assert diverged, "the float64-constant variant should differ somewhere; the test would be vacuous"


def test_adam_keeps_everything_float32():
    params0, grad_steps = random_problem(5, steps=5)
    params = {k: v.copy() for k, v in params0.items()}
    opt = Adam(lr=0.1)
    for name in ("lr", "beta1", "beta2", "epsilon", "beta1_power", "beta2_power"):
        assert type(getattr(opt, name)) is np.float32, name
    for grads in grad_steps:
        opt.step(params, grads)
    for k in params:
        assert params[k].dtype == np.float32
        assert opt.m[k].dtype == np.float32 and opt.v[k].dtype == np.float32
    assert type(opt.beta1_power) is np.float32 and type(opt.beta2_power) is np.float32
    state = opt.state_dict()
    assert state["beta1_power"].dtype == np.float32 and state["beta2_power"].dtype == np.float32
    assert all(a.dtype == np.float32 for part in ("m", "v") for a in state[part].values())


def test_adam_beta_powers_are_float32_products():
    opt = Adam(beta1=0.9, beta2=0.999)
    w = {"w": np.zeros(1, np.float32)}
    b1p, b2p = F32(0.9), F32(0.999)
    for _ in range(20):
        assert opt.beta1_power == b1p and opt.beta2_power == b2p
        opt.step(w, {"w": np.ones(1, np.float32)})
        b1p, b2p = b1p * F32(0.9), b2p * F32(0.999)


def test_adam_updates_in_place_and_does_not_touch_gradients():
    params = {"w": np.ones((2, 2), np.float32)}
    original = params["w"]
    g = np.full((2, 2), 0.5, np.float32)
    g.setflags(write=False)
    opt = Adam(lr=0.1)
    opt.step(params, {"w": g})
    assert params["w"] is original
    np.testing.assert_array_equal(g, np.full((2, 2), 0.5, np.float32))
    # First Adam step moves each weight by about lr against the gradient sign.
    np.testing.assert_allclose(params["w"], 1 - 0.1, rtol=1e-5)


# ---------------------------------------------------------------------- SGD

def test_sgd_is_w_minus_g_times_lr_bitwise():
    params0, grad_steps = random_problem(6, steps=20)
    params = {k: v.copy() for k, v in params0.items()}
    expected = {k: v.copy() for k, v in params0.items()}
    opt = SGD(lr=0.037)
    assert type(opt.lr) is np.float32
    for grads in grad_steps:
        opt.step(params, grads)
        for k, g in grads.items():
            expected[k] = expected[k] - g * F32(0.037)
            assert params[k].dtype == np.float32
            assert np.array_equal(params[k], expected[k])
    assert SGD().state_dict() == {}
    SGD().load_state_dict({})


def test_sgd_updates_in_place():
    params = {"w": np.zeros(3, np.float32)}
    original = params["w"]
    SGD(lr=0.5).step(params, {"w": np.array([1.0, -2.0, 0.0], np.float32)})
    assert params["w"] is original
    np.testing.assert_array_equal(params["w"], [-0.5, 1.0, 0.0])


# --------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs, bad", [
    ({"lr": 0.0}, "0.0"),
    ({"lr": -0.1}, "-0.1"),
    ({"lr": math.nan}, "nan"),
    ({"lr": math.inf}, "inf"),
    ({"lr": 1e-50}, "1e-50"),     # positive, but 0 in float32
    ({"lr": 1e40}, "1e+40"),      # finite, but inf in float32
    ({"epsilon": 0.0}, "0.0"),
    ({"epsilon": -1e-8}, "-1e-08"),
    ({"epsilon": math.nan}, "nan"),
    ({"epsilon": 1e-50}, "1e-50"),
    ({"beta1": 1.0}, "1.0"),
    ({"beta1": 1}, "1"),
    ({"beta1": -0.1}, "-0.1"),
    ({"beta1": 1.5}, "1.5"),
    ({"beta1": math.nan}, "nan"),
    ({"beta1": 0.99999999}, "0.99999999"),  # < 1, but 1 in float32
    ({"beta2": 1.0}, "1.0"),
    ({"beta2": 0.99999999}, "0.99999999"),
    ({"beta2": -1e-3}, "-0.001"),
])
def test_adam_rejects_bad_hyperparameters(kwargs, bad):
    with pytest.raises(ConfigError) as excinfo:
        Adam(**kwargs)
    assert bad in str(excinfo.value)
    assert next(iter(kwargs)).replace("lr", "learning rate") in str(excinfo.value)


@pytest.mark.parametrize("lr", [0.0, -1.0, math.nan, math.inf])
def test_sgd_rejects_bad_learning_rate(lr):
    with pytest.raises(ConfigError, match="learning rate") as excinfo:
        SGD(lr=lr)
    assert str(lr) in str(excinfo.value)


def test_adam_accepts_edge_hyperparameters():
    Adam(beta1=0.0, beta2=0.0)
    Adam(lr=1e-30, epsilon=1e-30)
    Adam(beta1=0.9999, beta2=0.99999)


# --------------------------------------------------------------- state dict

def test_adam_state_dict_round_trip_is_bitwise():
    params0, grad_steps = random_problem(7, steps=10)
    # Uninterrupted: 10 steps.
    straight = {k: v.copy() for k, v in params0.items()}
    opt = Adam(lr=0.05, beta1=0.85, beta2=0.995, epsilon=1e-7)
    for grads in grad_steps:
        opt.step(straight, grads)

    # Interrupted: 5 steps, save, restore into a fresh optimiser, 5 more.
    first = Adam(lr=0.05, beta1=0.85, beta2=0.995, epsilon=1e-7)
    resumed = {k: v.copy() for k, v in params0.items()}
    for grads in grad_steps[:5]:
        first.step(resumed, grads)
    saved = first.state_dict()
    saved_copy = copy.deepcopy(saved)
    params_saved = {k: v.copy() for k, v in resumed.items()}

    # The saved state is a snapshot: later steps of `first` must not change it.
    for grads in grad_steps[5:]:
        first.step(resumed, grads)
    for part in ("m", "v"):
        for k in saved[part]:
            np.testing.assert_array_equal(saved[part][k], saved_copy[part][k])
    assert saved["beta1_power"] == saved_copy["beta1_power"]

    # Restore twice: loading must copy, so two restorations run identically.
    for _ in range(2):
        second = Adam(lr=0.05, beta1=0.85, beta2=0.995, epsilon=1e-7)
        second.load_state_dict(saved)
        restored = {k: v.copy() for k, v in params_saved.items()}
        for grads in grad_steps[5:]:
            second.step(restored, grads)
        for k in straight:
            assert np.array_equal(restored[k], straight[k]), k
            assert np.array_equal(resumed[k], straight[k]), k
        assert second.beta1_power == opt.beta1_power and second.beta2_power == opt.beta2_power
        assert type(second.beta1_power) is np.float32


def test_adam_state_dict_survives_plain_conversion():
    # A checkpoint may come back as float64 arrays / Python floats / lists;
    # load_state_dict casts to float32, and as all values are float32-exact the
    # trajectory is unchanged.
    params0, grad_steps = random_problem(8, steps=6)
    a = Adam(lr=0.1)
    pa = {k: v.copy() for k, v in params0.items()}
    for grads in grad_steps[:3]:
        a.step(pa, grads)
    state = a.state_dict()
    plain = {
        "beta1_power": float(state["beta1_power"]),
        "beta2_power": float(state["beta2_power"]),
        "m": {k: v.astype(np.float64).tolist() for k, v in state["m"].items()},
        "v": {k: v.astype(np.float64).tolist() for k, v in state["v"].items()},
    }
    b = Adam(lr=0.1)
    b.load_state_dict(plain)
    pb = {k: v.copy() for k, v in pa.items()}
    for grads in grad_steps[3:]:
        a.step(pa, grads)
        b.step(pb, grads)
    for k in pa:
        assert np.array_equal(pa[k], pb[k])
        assert b.m[k].dtype == np.float32


def test_fresh_adam_state_dict():
    state = Adam().state_dict()
    assert state["m"] == {} and state["v"] == {}
    assert state["beta1_power"] == F32(0.9) and state["beta2_power"] == F32(0.999)


# ------------------------------------------------------------------ builder

def test_build_optimizer():
    adam = build_optimizer({"type": "adam", "lr": 0.1})
    assert isinstance(adam, Adam) and adam.lr == F32(0.1) and adam.beta1 == F32(0.9)
    assert isinstance(build_optimizer({}), Adam), "adam is the default"
    full = build_optimizer({"type": "adam", "lr": 0.01, "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6})
    assert (full.beta1, full.beta2, full.epsilon) == (F32(0.8), F32(0.99), F32(1e-6))
    sgd = build_optimizer({"type": "sgd", "lr": 1})
    assert isinstance(sgd, SGD) and sgd.lr == F32(1)


def test_build_optimizer_does_not_modify_its_spec():
    spec = {"type": "adam", "lr": 0.1}
    build_optimizer(spec)
    assert spec == {"type": "adam", "lr": 0.1}


@pytest.mark.parametrize("spec, match", [
    ({"type": "rmsprop"}, "rmsprop"),
    ({"type": None}, "None"),
    ({"type": "adam", "momentum": 0.9}, "momentum"),
    ({"type": "sgd", "beta1": 0.9}, "beta1"),
    ({"type": "adam", "learning_rate": 0.1}, "learning_rate"),
    ({"type": "adam", "lr": "fast"}, "lr"),
    ({"type": "adam", "lr": None}, "lr"),
    ({"type": "adam", "lr": -1}, "-1"),
    ({"type": "adam", "beta2": 1}, "beta2"),
])
def test_build_optimizer_rejects_bad_specs(spec, match):
    with pytest.raises(ConfigError, match=match):
        build_optimizer(spec)
