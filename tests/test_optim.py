"""Unit tests for distgrad.model.optim: the seed's Adam trajectory, a TF1 oracle, SGD, state, builders."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from distgrad.errors import ConfigError
from distgrad.model.losses import SumSquaredError
from distgrad.model.nn import Scale
from distgrad.model.optim import SGD, Adam, build_optimizer

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
                float64_constants=False, lrs=None):
    """Straight-line TF1 ApplyAdam in float32, independent of distgrad.

    With ``float64_constants`` the ``1 - beta`` constants are computed in
    double and rounded once (``float32(1 - 0.9)``) instead of
    ``float32(1) - float32(0.9)``: the variant TF1 does *not* use. ``lrs``:
    one float32 learning rate per step instead of ``lr``.
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
    for i, grads in enumerate(grad_steps):
        alpha = (lr if lrs is None else lrs[i]) * np.sqrt(one - b2p) / (one - b1p)
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
    assert opt.state_dict() == {"updates": 20}
    assert SGD().state_dict() == {"updates": 0}


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


def test_adam_rolled_back_in_place_continues_as_the_uninterrupted_run():
    """The optimiser a stage keeps, loaded with an earlier state (a rollback) after steps past it, continues
    from that state: the moments it steps with are the loaded ones, not those of the steps rolled back."""
    params0, grad_steps = random_problem(11, steps=8)
    straight = {k: v.copy() for k, v in params0.items()}
    reference = Adam(lr=0.05)
    for grads in grad_steps:
        reference.step(straight, grads)
    opt = Adam(lr=0.05)
    params = {k: v.copy() for k, v in params0.items()}
    for grads in grad_steps[:4]:
        opt.step(params, grads)
    saved, kept = opt.state_dict(), {k: v.copy() for k, v in params.items()}
    for grads in grad_steps[4:6]:           # steps that are then rolled back
        opt.step(params, grads)
    opt.load_state_dict(saved)
    for k, value in kept.items():
        params[k][...] = value
    for grads in grad_steps[4:]:
        opt.step(params, grads)
    for k in straight:
        assert np.array_equal(params[k], straight[k]), k


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
        "updates": float(state["updates"]),
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
    assert state["m"] == {} and state["v"] == {} and state["updates"] == 0
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


# -------------------------------------------------------------- schedules
# Each schedule's float32 rates against a float64 oracle written here from the formulas (TensorFlow 1's,
# with global_step = t - 1). The oracle gets the hyperparameters as the float32 values the schedule uses
# (F32(0.003), F32(0.5), ...), as the Adam oracle does, so a difference measures only the float32
# arithmetic. Tolerance: a float32 ulp is 2**-23 relative (at most; half an ulp per rounding).
# * warm-up, exponential, piecewise: relative, (2 + |ln(rate / lr)| / 2) ulps. A rate is at most ~4
#   roundings (half an ulp each) and one libm powf (< 1 ulp) away from exact, and exponential's exponent
#   p = (t-1)/decay_steps is itself rounded (half an ulp, relative), an error r**p multiplies by
#   |p ln r| = |ln(rate / lr)|; the decays below go down to about lr/1000, where that adds 3.5 ulps.
# * cosine: absolute, 2 ulps of lr. Near the end of the decay 1 + cos(pi c) cancels: the float32
#   cosine's own error (about an ulp of 1, with float32(pi)'s rounding) is a large relative error of a
#   tiny rate, but stays an ulp or two of lr.
# Largest errors seen below: exponential 2.8 ulps (of 5.5 allowed at lr/1000), cosine 0.95 ulps of lr.

from distgrad.model.schedules import (Constant, CosineDecay, ExponentialDecay, PiecewiseConstant,  # noqa: E402
                                Warmup, build_schedule)

ULP = 2.0 ** -23


def _assert_rates(schedule, oracle, steps: int, lr: float, absolute: bool = False) -> float:
    """``schedule(t)`` for t = 1..steps against ``oracle(t)`` (float64); returns the largest error in ulps."""
    worst = 0.0
    for t in range(1, steps + 1):
        got, want = schedule(t), oracle(t)
        assert type(got) is np.float32, f"update {t}: {type(got)}"
        if absolute:
            error, allowed = abs(float(got) - want) / (lr * ULP), 2.0
        else:
            error, allowed = abs(float(got) - want) / (want * ULP), 2 + abs(math.log(want / lr)) / 2
        assert error <= allowed, f"update {t}: {got!r} vs {want!r}: {error:.2f} ulps > {allowed:.2f}"
        worst = max(worst, error)
    return worst


def f64(value: float) -> float:
    """The float32 value the schedule uses, as a float64 for the oracle."""
    return float(F32(value))


def test_constant_schedule_is_lr_itself():
    schedule = Constant(0.003)
    assert all(schedule(t) == F32(0.003) and type(schedule(t)) is np.float32 for t in (1, 2, 1000, 2**30))


@pytest.mark.parametrize("rate, decay_steps, steps", [(0.5, 100, 1000), (0.96, 7, 1000), (0.1, 250, 750)])
@pytest.mark.parametrize("staircase", [False, True])
def test_exponential_decay_against_float64(rate, decay_steps, steps, staircase):
    lr, r = f64(0.003), f64(rate)

    def oracle(t):
        p = (t - 1) // decay_steps if staircase else (t - 1) / decay_steps
        return lr * r ** p

    _assert_rates(ExponentialDecay(0.003, rate, decay_steps, staircase), oracle, steps, lr)


def test_staircase_holds_each_rate_for_decay_steps_updates():
    smooth, stairs = ExponentialDecay(0.1, 0.5, 10), ExponentialDecay(0.1, 0.5, 10, staircase=True)
    assert stairs(1) == F32(0.1) and stairs(10) == F32(0.1) and stairs(11) == F32(0.1) * F32(0.5)
    for k in range(5):
        stair = {stairs(t) for t in range(10 * k + 1, 10 * k + 11)}
        assert stair == {smooth(10 * k + 1)}, f"stair {k}: {stair}"       # p is exactly k at t = 10k + 1
        assert all(smooth(t) < stairs(t) for t in range(10 * k + 2, 10 * k + 11))
    assert smooth(2) < smooth(1) and smooth(11) == stairs(11)


def test_piecewise_constant_against_float64():
    values = [0.1, 0.03, 0.007, 0.001]
    schedule = PiecewiseConstant([5, 12, 13], values)

    def oracle(t):
        return f64(values[0 if t <= 5 else 1 if t <= 12 else 2 if t <= 13 else 3])

    assert _assert_rates(schedule, oracle, 40, f64(0.1)) == 0.0          # no arithmetic: exact
    assert [schedule(t) for t in (5, 6, 12, 13, 14)] == [F32(0.1), F32(0.03), F32(0.03), F32(0.007), F32(0.001)]
    assert PiecewiseConstant([], [0.5])(7) == F32(0.5)


@pytest.mark.parametrize("decay_steps, alpha, steps", [(800, 0.0, 1000), (100, 0.1, 150), (7, 0.5, 20)])
def test_cosine_decay_against_float64(decay_steps, alpha, steps):
    lr, a = f64(0.003), f64(alpha)

    def oracle(t):
        c = min(t - 1, decay_steps) / decay_steps
        return lr * ((1 - a) * 0.5 * (1 + math.cos(math.pi * c)) + a)

    schedule = CosineDecay(0.003, decay_steps, alpha)
    _assert_rates(schedule, oracle, steps, lr, absolute=True)
    assert schedule(1) == F32(0.003)
    assert schedule(decay_steps + 1) == schedule(steps) == F32(0.003) * F32(alpha)   # cos(pi) is -1 in float32


def test_warmup_then_decay_against_float64():
    lr = f64(0.003)
    schedule = Warmup(CosineDecay(0.003, 800), 50)

    def oracle(t):
        if t <= 50:
            return lr * t / 50
        return lr * 0.5 * (1 + math.cos(math.pi * min(t - 51, 800) / 800))

    _assert_rates(schedule, oracle, 50, lr)
    _assert_rates(schedule, oracle, 900, lr, absolute=True)
    assert schedule(1) < schedule(2) < schedule(49) < schedule(50) == schedule(51) == F32(0.003) > schedule(52)
    cosine = CosineDecay(0.003, 800)
    assert all(schedule(50 + t) == cosine(t) for t in range(1, 900))      # the decay starts after the warm-up
    warm_steps = Warmup(PiecewiseConstant([10], [0.5, 0.25]), 4)
    assert [warm_steps(t) for t in (1, 4, 5, 14, 15)] == [F32(0.5) * F32(0.25), F32(0.5), F32(0.5), F32(0.5),
                                                          F32(0.25)]
    _assert_rates(Warmup(Constant(0.003), 37), lambda t: lr * min(t, 37) / 37, 60, lr)


# Schedules in optimisers: the rate of update t is the one its arithmetic uses.

SCHEDULES = {
    "exponential": {"type": "exponential", "decay_rate": 0.5, "decay_steps": 7},
    "staircase": {"type": "exponential", "decay_rate": 0.5, "decay_steps": 7, "staircase": True},
    "piecewise": {"type": "piecewise", "boundaries": [5, 12], "values": [0.2, 0.05, 0.01]},
    "cosine": {"type": "cosine", "decay_steps": 20, "alpha": 0.1},
    "warmup-cosine": {"type": "cosine", "decay_steps": 20, "warmup_steps": 6},
}


def _table(kind: str, schedule: dict, lr: float = 0.2) -> dict:
    return {"type": kind, "schedule": schedule, **({} if schedule["type"] == "piecewise" else {"lr": lr})}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_adam_applies_the_scheduled_rate(name):
    params0, grad_steps = random_problem(9, steps=30)
    opt = build_optimizer(_table("adam", SCHEDULES[name]))
    rates = [opt.schedule(t) for t in range(1, 31)]
    assert len(set(rates)) > 2, "the schedule should change the rate"
    expected = oracle_adam(params0, grad_steps, lrs=rates)
    params = {k: v.copy() for k, v in params0.items()}
    for step, grads in enumerate(grad_steps):
        assert opt.lr == rates[step] and opt.updates == step
        opt.step(params, grads)
        for k in params:
            assert np.array_equal(params[k], expected[step][k]), f"{k} differs at update {step + 1}"


def test_one_adam_update_by_hand_uses_the_rate_of_its_update():
    opt = Adam(lr=ExponentialDecay(0.1, 0.5, 1))          # rates 0.1, 0.05, 0.025, ...
    w, g = {"w": np.array([1.0], np.float32)}, np.array([0.5], np.float32)
    for _ in range(2):
        opt.step(w, {"w": g})
    before, m, v = w["w"].copy(), opt.m["w"].copy(), opt.v["w"].copy()
    b1p, b2p = opt.beta1_power, opt.beta2_power
    opt.step(w, {"w": g})
    one = F32(1)
    lr3 = F32(0.1) * F32(0.5) ** F32(2)
    assert lr3 == F32(0.025)
    alpha = lr3 * np.sqrt(one - b2p) / (one - b1p)
    m = m + (g - m) * (one - F32(0.9))
    v = v + (g * g - v) * (one - F32(0.999))
    np.testing.assert_array_equal(w["w"], before - (m * alpha) / (np.sqrt(v) + F32(1e-8)))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_sgd_applies_the_scheduled_rate_bitwise(name):
    params0, grad_steps = random_problem(10, steps=30)
    opt = build_optimizer(_table("sgd", SCHEDULES[name]))
    params = {k: v.copy() for k, v in params0.items()}
    expected = {k: v.copy() for k, v in params0.items()}
    for t, grads in enumerate(grad_steps, start=1):
        rate = opt.schedule(t)
        opt.step(params, grads)
        for k, g in grads.items():
            expected[k] = expected[k] - g * rate
            assert np.array_equal(params[k], expected[k]), f"{k} differs at update {t}"
    assert opt.updates == 30 and opt.state_dict()["updates"] == 30


@pytest.mark.parametrize("hyper", HYPERPARAMETERS[1:], ids=lambda h: ",".join(f"{k}={v}" for k, v in h.items()))
def test_constant_schedule_is_the_old_optimizer_bitwise(hyper):
    params0, grad_steps = random_problem(11, steps=40)
    expected = oracle_adam(params0, grad_steps, **hyper)
    constant = {"type": "adam", **hyper, "schedule": {"type": "constant"}}
    for opt in (build_optimizer(constant), Adam(**{**hyper, "lr": Constant(hyper["lr"])})):
        params = {k: v.copy() for k, v in params0.items()}
        for grads in grad_steps:
            opt.step(params, grads)
        for k in params:
            assert np.array_equal(params[k], expected[-1][k]), k
    plain, scheduled = SGD(lr=0.037), build_optimizer({"type": "sgd", "lr": 0.037, "schedule": {"type": "constant"}})
    a, b = ({k: v.copy() for k, v in params0.items()} for _ in range(2))
    for grads in grad_steps:
        plain.step(a, grads)
        scheduled.step(b, grads)
    assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_state_dict_round_trip_mid_schedule_is_bitwise(kind, name):
    params0, grad_steps = random_problem(12, steps=24)
    straight = build_optimizer(_table(kind, SCHEDULES[name]))
    straight_params = {k: v.copy() for k, v in params0.items()}
    for grads in grad_steps:
        straight.step(straight_params, grads)

    first = build_optimizer(_table(kind, SCHEDULES[name]))
    params = {k: v.copy() for k, v in params0.items()}
    for grads in grad_steps[:9]:                                     # mid-warm-up, mid-decay, past boundary 5
        first.step(params, grads)
    saved = copy.deepcopy(first.state_dict())
    assert saved["updates"] == 9 and saved["updates"].dtype == np.int64
    resumed = build_optimizer(_table(kind, SCHEDULES[name]))
    resumed.load_state_dict(saved)
    assert resumed.updates == 9 and resumed.lr == first.lr == first.schedule(10)
    for grads in grad_steps[9:]:
        resumed.step(params, grads)
    for k in params:
        assert np.array_equal(params[k], straight_params[k]), k
    fresh = build_optimizer(_table(kind, SCHEDULES[name]))          # without the count the rates would restart
    assert fresh.lr != resumed.schedule(10)


@pytest.mark.parametrize("bad", [-1, 2.5, math.nan, "3", True, [3]])
def test_load_state_dict_rejects_a_bad_update_count(bad):
    with pytest.raises(ValueError, match="update count"):
        SGD().load_state_dict({"updates": bad})
    with pytest.raises(KeyError, match="updates"):
        SGD().load_state_dict({})


def test_build_optimizer_with_a_schedule():
    opt = build_optimizer({"type": "adam", "lr": 0.003, "beta1": 0.8,
                           "schedule": {"type": "cosine", "decay_steps": 800, "alpha": 0.0, "warmup_steps": 50}})
    assert isinstance(opt, Adam) and opt.beta1 == F32(0.8)
    assert isinstance(opt.schedule, Warmup) and isinstance(opt.schedule.after, CosineDecay)
    assert opt.lr == F32(0.003) * (F32(1) / F32(50)) and opt.schedule(50) == F32(0.003)
    default_lr = build_optimizer({"type": "sgd", "schedule": {"type": "exponential", "decay_rate": 0.5,
                                                                "decay_steps": 10}})
    assert default_lr.lr == F32(0.01), "lr defaults to the optimizer's own default"
    assert build_optimizer({"type": "sgd", "schedule": {"type": "piecewise", "boundaries": [3],
                                                        "values": [1, 0.5]}}).schedule(4) == F32(0.5)
    assert type(build_optimizer({"type": "sgd", "lr": 0.1, "schedule": {"type": "constant"}}).schedule) is Constant
    spec = {"type": "adam", "schedule": {"type": "cosine", "decay_steps": 8, "warmup_steps": 2}}
    build_optimizer(spec)
    assert spec == {"type": "adam", "schedule": {"type": "cosine", "decay_steps": 8, "warmup_steps": 2}}


@pytest.mark.parametrize("schedule, match", [
    ("cosine", "'schedule' must be a table"),
    ({"decay_steps": 5}, "unknown schedule type None: use constant, exponential, piecewise, cosine"),
    ({"type": "linear"}, "unknown schedule type 'linear': use constant, exponential, piecewise, cosine"),
    ({"type": "cosine", "decay_steps": 5, "decay_rate": 0.5}, r"unknown option\(s\) \['decay_rate'\] for "
                                                             r"schedule 'cosine'; valid options: type, decay_steps"),
    ({"type": "cosine"}, "schedule 'cosine' needs 'decay_steps'"),
    ({"type": "exponential", "decay_steps": 5}, "needs 'decay_rate'"),
    ({"type": "piecewise", "values": [0.1]}, "needs 'boundaries'"),
    ({"type": "cosine", "decay_steps": 0}, "Invalid decay_steps: 0"),
    ({"type": "cosine", "decay_steps": -5}, "Invalid decay_steps: -5"),
    ({"type": "cosine", "decay_steps": 800.0}, "Invalid decay_steps: 800.0 .must be a whole number"),
    ({"type": "cosine", "decay_steps": True}, "Invalid decay_steps: True"),
    ({"type": "cosine", "decay_steps": "800"}, "Invalid decay_steps: '800'"),
    ({"type": "cosine", "decay_steps": 8, "alpha": 1.5}, "Invalid alpha: 1.5"),
    ({"type": "cosine", "decay_steps": 8, "alpha": -0.1}, "Invalid alpha: -0.1"),
    ({"type": "cosine", "decay_steps": 8, "alpha": "none"}, "'alpha' for schedule 'cosine': 'none' is not a number"),
    ({"type": "cosine", "decay_steps": 8, "warmup_steps": -1}, "Invalid warmup_steps: -1 .* >= 0"),
    ({"type": "constant", "warmup_steps": 2.5}, "Invalid warmup_steps: 2.5"),
    ({"type": "exponential", "decay_rate": 0, "decay_steps": 5}, "Invalid decay_rate: 0"),
    ({"type": "exponential", "decay_rate": 1.5, "decay_steps": 5}, "Invalid decay_rate: 1.5"),
    ({"type": "exponential", "decay_rate": math.nan, "decay_steps": 5}, "Invalid decay_rate: nan"),
    ({"type": "exponential", "decay_rate": True, "decay_steps": 5}, "'decay_rate' .* True is not a number"),
    ({"type": "exponential", "decay_rate": 0.5, "decay_steps": 5, "staircase": 1},
     "'staircase' .* 1 is not true or false"),
    ({"type": "piecewise", "boundaries": [10, 10], "values": [1, 2, 3]},
     r"Invalid boundaries: \[10, 10\] .*strictly increasing"),
    ({"type": "piecewise", "boundaries": [10, 5], "values": [1, 2, 3]}, r"Invalid boundaries: \[10, 5\]"),
    ({"type": "piecewise", "boundaries": [0], "values": [1, 2]}, r"Invalid boundaries\[0\]: 0"),
    ({"type": "piecewise", "boundaries": [-3], "values": [1, 2]}, r"Invalid boundaries\[0\]: -3"),
    ({"type": "piecewise", "boundaries": [2.5], "values": [1, 2]}, r"Invalid boundaries\[0\]: 2.5"),
    ({"type": "piecewise", "boundaries": [10, 20], "values": [1, 2]},
     r"Invalid values: \[1, 2\] has 2 entries; 2 boundaries need 3"),
    ({"type": "piecewise", "boundaries": [10], "values": [1, 2, 3]}, "has 3 entries; 1 boundaries need 2"),
    ({"type": "piecewise", "boundaries": [10], "values": [1, -2]}, r"Invalid values\[1\]: -2"),
    ({"type": "piecewise", "boundaries": [10], "values": [1, 1e-50]}, r"Invalid values\[1\]: 1e-50"),
    ({"type": "piecewise", "boundaries": [10], "values": [1, "x"]}, r"'values\[1\]' .* 'x' is not a number"),
    ({"type": "piecewise", "boundaries": 10, "values": [1, 2]}, "'boundaries' .* 10 is not a list"),
    ({"type": "piecewise", "boundaries": [10], "values": 1}, "'values' .* 1 is not a list"),
])
def test_build_optimizer_rejects_bad_schedules(schedule, match):
    spec = {"type": "sgd", "schedule": schedule}
    with pytest.raises(ConfigError, match=match):
        build_optimizer(spec)


def test_a_piecewise_schedule_takes_no_lr():
    with pytest.raises(ConfigError, match=r"piecewise schedule gives its rates in 'values'; remove 'lr' \(0.1\)"):
        build_optimizer({"type": "adam", "lr": 0.1,
                         "schedule": {"type": "piecewise", "boundaries": [3], "values": [0.1, 0.01]}})


def test_the_optimizer_lr_of_a_schedule_is_still_checked():
    with pytest.raises(ConfigError, match="Invalid learning rate: -0.1"):
        build_optimizer({"type": "adam", "lr": -0.1, "schedule": {"type": "cosine", "decay_steps": 5}})
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['warmup_steps'\] for optimizer 'adam'"):
        build_optimizer({"type": "adam", "warmup_steps": 5})


def test_build_schedule_alone():
    assert type(build_schedule(None, 0.1)) is Constant
    assert build_schedule({"type": "constant", "warmup_steps": 0}, 0.1)(1) == F32(0.1)
