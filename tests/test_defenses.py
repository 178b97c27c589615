"""Defenses on what crosses the cut (distgrad.privacy.defenses) and the label-DP budget (distgrad.privacy.budget).

The math is checked directly; the settings are checked where a user meets them (exit 2 naming the key and the
reason); a defended run over real processes is bitwise the in-process run, with micro-batches and a codec, and
through kill -9 of either stage and resume.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest

from distgrad.config.data import RandomizedLabels
from distgrad.config.defended import budget_text
from distgrad.config.experiment import BUILTIN_DIR
from distgrad.config.parse import load_experiment
from distgrad.errors import ConfigError
from distgrad.privacy.defenses import (clip_noise, clip_rows, defense_rng, distance_correlation_and_gradient,
                                       keep_probability, marvell_covariances, marvell_noise, marvell_sum_kl,
                                       max_norm_noise, nopeek_gradient, parse_defenses, randomized_response,
                                       row_norms)
from distgrad.run.inprocess import train_in_process

from conftest import read_json, run_launcher, run_main
from test_faults import run_killing_each_stage

F_DEFENSE = 'clip_noise = { max_norm = 4.0, sigma = 0.05 }\nnopeek = { weight = 0.5 }'
G_DEFENSE = 'clip_noise = { max_norm = 0.05, sigma = 0.5 }\nmax_norm = true\nlabel_dp = { epsilon = 2.0 }'


def _defended(tmp_path: Path, builtin: str, extras: dict[int, str], name: str = "defended.toml") -> Path:
    """Built-in experiment ``builtin`` with the lines ``extras[i]`` added to its stage ``i``'s table."""
    text = (BUILTIN_DIR / f"{builtin}.toml").read_text().replace('"../datasets/',
                                                                  f'"{BUILTIN_DIR.parent / "datasets"}/')
    head, *stages = text.split("[[stages]]")
    stages = [f"{stage.rstrip()}\n{extras.get(i, '')}\n\n" for i, stage in enumerate(stages)]
    path = tmp_path / name
    path.write_text("[[stages]]".join([head, *stages]))
    return path


def _digits(tmp_path: Path, f_extra: str = "", g_extra: str = "", name: str = "defended.toml") -> Path:
    """The built-in digits experiment with ``f_extra`` / ``g_extra`` lines in its stages' tables."""
    return _defended(tmp_path, "digits", {0: f_extra, 1: g_extra}, name)


def _zero_vs_rest(tmp_path: Path, f_extra: str = "", g_extra: str = "", name: str = "two.toml") -> Path:
    """The digits experiment made a two-class task: digit 0 against the rest (labels 1 and 0), two outputs."""
    digits = np.load(BUILTIN_DIR.parent / "datasets" / "digits.npz")
    np.savez(tmp_path / "zero.npz", pixels=digits["pixels"], digit=(digits["digit"] == 0).astype(np.int64))
    path = _digits(tmp_path, f_extra, g_extra, name)
    path.write_text(path.read_text().replace(str(BUILTIN_DIR.parent / "datasets" / "digits.npz"),
                                             str(tmp_path / "zero.npz")).replace("out = 10", "out = 2"))
    return path


def _equal_over_processes(tmp_path: Path, path: Path, *extra: str, processes: tuple = ()) -> dict:
    """``distgrad run PATH`` over stage processes (with the flags ``processes`` too, e.g. ``--metrics``) and
    ``--in-process`` (its summary in ``ref.json``): the same parameters, test loss and privacy entries;
    returns the processes' summary."""
    args = ["run", path, "--steps", "20", *extra]
    assert run_main([*args, "--in-process", "--summary", tmp_path / "ref.json"]).returncode == 0
    result = run_launcher([*args, *processes, "--summary", tmp_path / "run.json"])
    assert result.returncode == 0, result.stdout + result.stderr
    reference, summary = read_json(tmp_path / "ref.json"), read_json(tmp_path / "run.json")
    assert summary["params"] == reference["params"]
    assert summary.get("test_loss") == reference.get("test_loss")
    assert summary["privacy"] == reference["privacy"]
    return summary


# --- the math ---------------------------------------------------------------------------------------------

def test_clip_rows_bounds_each_row_and_keeps_short_rows():
    x = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # a zero row (a dead ReLU layer's) warned of an overflow
        clipped = clip_rows(x, 1.0)
    assert clipped.dtype == np.float32
    np.testing.assert_allclose(row_norms(clipped), [1.0, 0.5, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(clipped[1:], x[1:])


def test_clip_noise_adds_noise_of_sigma_times_the_bound():
    x = np.random.default_rng(0).normal(size=(200, 500)).astype(np.float32)
    sent = clip_noise(x, 2.0, 0.5, np.random.default_rng(1))
    noise = sent - clip_rows(x, 2.0)
    assert abs(noise.std() - 1.0) < 0.01 and abs(noise.mean()) < 0.01
    np.testing.assert_array_equal(clip_noise(x, 2.0, 0.0, np.random.default_rng(1)), clip_rows(x, 2.0))


def test_max_norm_noise_brings_every_row_to_the_largest_norm_in_expectation():
    x = np.zeros((3, 4000), np.float32)
    x[0, 0], x[1, 0], x[2, 0] = 10.0, 1.0, 5.0
    sent = max_norm_noise(x, np.random.default_rng(0))
    np.testing.assert_array_equal(sent[0], x[0])                 # the largest row gets none
    np.testing.assert_allclose(row_norms(sent)[1:], 10.0, rtol=0.05)


def test_randomized_response_keeps_each_label_with_its_probability():
    labels = np.random.default_rng(0).integers(0, 10, 100_000)
    noisy = randomized_response(labels, 10, 2.0, np.random.default_rng(1))
    assert noisy.dtype == labels.dtype and noisy.min() >= 0 and noisy.max() <= 9
    expected = math.exp(2) / (math.exp(2) + 9)
    assert keep_probability(10, 2.0) == pytest.approx(expected)
    assert abs((noisy == labels).mean() - expected) < 0.01
    flipped = noisy[noisy != labels] - labels[noisy != labels]
    assert abs(np.bincount(flipped % 10, minlength=10)[1:].std() / (len(flipped) / 9)) < 0.05   # uniform


def test_distance_correlation_and_its_gradient():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 5))
    z = rng.normal(size=(12, 3)) + x[:, :3]
    dcor = distance_correlation_and_gradient
    value, grad = dcor(x, z)
    assert 0 < value < 1 and grad.dtype == np.float32 and grad.shape == z.shape
    numeric = np.zeros_like(z)
    for index in np.ndindex(*z.shape):
        step = np.zeros_like(z)
        step[index] = 1e-6
        numeric[index] = (dcor(x, z + step)[0] - dcor(x, z - step)[0]) / 2e-6
    np.testing.assert_allclose(grad, numeric, atol=1e-7)
    assert dcor(x, 2 * x + 1)[0] == pytest.approx(1.0)
    assert dcor(x, np.ones((12, 3)))[0] == 0.0
    dy = np.ones((12, 3), np.float32)
    np.testing.assert_allclose(nopeek_gradient(x, z, dy, 0.5), dy + 0.5 * grad, rtol=1e-6)


def test_marvell_covariances_meet_the_kl_bound_with_less_power_than_other_choices():
    u, v, gap, dims, p = 0.01, 0.02, 1.0, 64, 0.3
    power = lambda l0, m0, l1, m1: p * (l1 + (dims - 1) * m1) + (1 - p) * (l0 + (dims - 1) * m0)   # noqa: E731
    for bound in (0.1, 1.0, 4.0):
        l0, m0, l1, m1 = marvell_covariances(u, v, gap, dims, p, bound)
        assert min(l0, m0, l1, m1) >= 0
        kl = marvell_sum_kl(u + l0, v + l1, u + m0, v + m1, gap, dims)
        assert kl == pytest.approx(bound, rel=1e-6)
        # Other choices that meet the bound cost more: equal noise on both classes along the difference.
        for along in np.linspace(0.0, 50.0, 2001):
            if marvell_sum_kl(u + along, v + along, u + 0.01, v, gap, dims) <= bound:
                assert power(along, 0.01, along, 0.0) >= power(l0, m0, l1, m1)
                break
    assert marvell_covariances(u, u, 0.0, dims, p, 1.0) == (0.0, 0.0, 0.0, 0.0)       # already within the bound
    assert marvell_covariances(u, v, gap, dims, p, 0.5) != marvell_covariances(u, v, gap, dims, p, 0.1)


def test_marvell_noise_is_class_dependent_and_leaves_one_class_batches_alone():
    rng = np.random.default_rng(0)
    labels = (np.arange(4000) % 4 == 0).astype(np.int64)
    x = np.where(labels[:, None] == 1, -1.0, 0.1) * np.ones((4000, 8)) + 0.05 * rng.standard_normal((4000, 8))
    x = x.astype(np.float32)
    sent = marvell_noise(x, labels, 0.5, np.random.default_rng(1))
    assert sent.dtype == np.float32 and sent.shape == x.shape
    positive = labels == 1
    # The norm no longer tells the classes apart as it did.
    from distgrad.privacy.leaks import norm_auc
    assert norm_auc(x, labels) == 0.0 or norm_auc(x, labels) == 1.0
    assert abs(norm_auc(sent, labels) - 0.5) < 0.15
    noise = (sent - x).astype(np.float64)
    assert noise[positive].var() > 0 and noise[~positive].var() > 0
    np.testing.assert_array_equal(marvell_noise(x[:5], np.zeros(5, np.int64), 0.5, np.random.default_rng(1)), x[:5])
    with pytest.raises(ValueError, match="two classes"):
        marvell_noise(x[:4], np.array([0, 1, 2, 0]), 0.5, np.random.default_rng(1))


def test_every_draw_is_a_pure_function_of_seed_stage_stream_and_step():
    draw = lambda *key: defense_rng(*key).normal(size=4)                      # noqa: E731
    np.testing.assert_array_equal(draw(0, "g", "activation_grad/mb0of1", 3), draw(0, "g", "activation_grad/mb0of1", 3))
    for other in [(1, "g", "activation_grad/mb0of1", 3), (0, "f", "activation_grad/mb0of1", 3),
                  (0, "g", "activation_grad/mb1of2", 3), (0, "g", "activation_grad/mb0of1", 4)]:
        assert not np.array_equal(draw(0, "g", "activation_grad/mb0of1", 3), draw(*other))


def test_label_dp_randomizes_training_labels_once_and_keeps_held_out_labels(tmp_path):
    exp = load_experiment(_digits(tmp_path, g_extra='label_dp = { epsilon = 2.0 }'))
    plain = load_experiment("digits").build_data(stage="g")
    noisy = exp.build_data(stage="g")
    assert isinstance(noisy, RandomizedLabels)
    np.testing.assert_array_equal(noisy.test_targets(), plain.test_targets())
    batches = noisy.batches_per_epoch
    kept = np.mean([np.mean(noisy.targets(s) == plain.targets(s)) for s in range(1, batches + 1)])
    assert abs(kept - keep_probability(10, 2.0)) < 0.05
    # Once: the same row has the same label in the next epoch.
    row_labels = {}
    for step in range(1, 2 * batches + 1):
        for row, label in zip(noisy._source._rows(step), noisy.targets(step)):
            assert row_labels.setdefault(int(row), int(label)) == int(label)


def test_the_budget_composes_the_gaussian_mechanism():
    dp = pytest.importorskip("dp_accounting")
    from distgrad.privacy.budget import gaussian_label_dp
    accountant = dp.rdp.RdpAccountant()
    accountant.compose(dp.GaussianDpEvent(1.0), 5)       # sigma 2 in units of C: noise multiplier 2C / 2C
    assert gaussian_label_dp(2.0, 5, 1e-5) == accountant.get_epsilon(1e-5)
    assert gaussian_label_dp(2.0, 10, 1e-5) > gaussian_label_dp(2.0, 5, 1e-5) > gaussian_label_dp(4.0, 5, 1e-5)
    assert gaussian_label_dp(0.0, 1, 1e-5) == math.inf


# --- the settings -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("f_extra, g_extra, message", [
    ("", "clip_noise = { max_norm = 1.0, sigma = -0.5 }", "'clip_noise' sigma must be a number >= 0"),
    ("", "clip_noise = { max_norm = 0, sigma = 0.5 }", "'clip_noise' max_norm must be a number > 0"),
    ("", "clip_noise = { max_norm = 1.0 }", "'clip_noise' must be { max_norm = C, sigma = s }"),
    ("", "label_dp = { epsilon = 0 }", "'label_dp' epsilon must be a number > 0"),
    ("", "label_dp = { epsilon = -1.0 }", "'label_dp' epsilon must be a number > 0"),
    ("", "max_norm = 1", "'max_norm' must be true or false"),
    ("label_dp = { epsilon = 2.0 }", "", "'label_dp' is a setting of the label owner"),
    ("max_norm = true", "", "'max_norm' is a setting of the label owner"),
    ("", "marvell = { }", "'marvell' must be { bound = P }"),
    ("", "marvell = { bound = 0 }", "'marvell' bound must be a number > 0"),
    ("marvell = { bound = 1.0 }", "", "'marvell' is a setting of the label owner"),
    ("", "marvell = { bound = 1.0 }", "'marvell' is defined for a two-class task, labels 0 and 1"),
    ("", "nopeek = { weight = 0.1 }", "'nopeek' is a setting of a data owner"),
    ("nopeek = { weight = 0 }", "", "'nopeek' weight must be a number > 0"),
    ("nopeek = 0.1", "", "'nopeek' must be { weight = w }"),
])
def test_bad_settings_exit_2_naming_the_key_and_the_reason(tmp_path, f_extra, g_extra, message):
    result = run_main(["run", _digits(tmp_path, f_extra, g_extra), "--in-process", "--steps", "1"])
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr


def test_label_owner_defenses_are_refused_when_the_labels_travel(tmp_path):
    path = _digits(tmp_path, g_extra="max_norm = true")
    path.write_text(path.read_text().replace('labels = "last"', 'labels = "first"'))
    result = run_main(["run", path, "--in-process", "--steps", "1"])
    assert result.returncode == 2 and "labels cross the wire with the activations" in result.stderr


def test_clip_noise_on_a_last_stage_that_is_sent_the_labels_is_refused_for_that_reason(tmp_path):
    """With labels = "first" the last stage is no middle stage: its clip_noise is refused because the labels
    already cross with the activations."""
    path = _defended(tmp_path, "chain4-classify", {3: "clip_noise = { max_norm = 1.0, sigma = 0.1 }"}, "last.toml")
    with pytest.raises(ConfigError, match="'clip_noise' on the last stage .* the labels cross the wire with the "
                                          "activations") as refused:
        load_experiment(path)
    assert "middle stage" not in str(refused.value)


def test_clip_noise_on_a_middle_stage_is_refused(tmp_path):
    text = (BUILTIN_DIR / "chain4-classify.toml").read_text()
    head, *stages = text.split("[[stages]]")
    stages[1] = stages[1].rstrip() + "\nclip_noise = { max_norm = 1.0, sigma = 0.1 }\n\n"
    path = tmp_path / "chain.toml"
    path.write_text("[[stages]]".join([head, *stages]))
    result = run_main(["run", path, "--in-process", "--steps", "1"])
    assert result.returncode == 2 and "'clip_noise' is a setting of the label owner" in result.stderr
    assert "middle stage" in result.stderr


def test_regression_labels_refuse_label_dp(tmp_path):
    text = (BUILTIN_DIR / "tanh-regression.toml").read_text()
    path = tmp_path / "reg.toml"
    head, *stages = text.split("[[stages]]")
    stages[-1] = stages[-1].rstrip() + "\nlabel_dp = { epsilon = 1.0 }\n"
    path.write_text("[[stages]]".join([head, *stages]))
    result = run_main(["run", path, "--in-process", "--steps", "1"])
    assert result.returncode == 2 and "'label_dp' randomizes class ids" in result.stderr


def test_marvell_is_refused_for_real_valued_targets_and_clients(tmp_path):
    for builtin, message in (("tanh-regression", "'marvell' is defined for a two-class loss of class ids"),
                             ("digits-clients", "'marvell' is not supported with [clients]")):
        path = _defended(tmp_path, builtin, {len((BUILTIN_DIR / f"{builtin}.toml").read_text()
                                                 .split("[[stages]]")) - 2: "marvell = { bound = 1.0 }"},
                         f"{builtin}.toml")
        result = run_main(["run", path, "--in-process", "--steps", "1"])
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_clip_noise_states_no_budget_where_marvell_shapes_every_rows_noise(tmp_path):
    """The clip_noise label-DP budget rests on one label reaching only its own gradient row (sensitivity 2C).
    Marvell's noise after it is shaped by the batch's classes, so one label changes every row's noise: the
    summary states no guarantee and why (no epsilon), and the settings that promise one, the target form and
    dp_sgd's end-to-end budget, are refused naming the reason."""
    both = "clip_noise = { max_norm = 0.05, sigma = 4.0 }\nmarvell = { bound = 0.5 }"
    privacy = train_in_process(load_experiment(_zero_vs_rest(tmp_path, "", both)), steps=2)["privacy"]
    clip = privacy["g"]["clip_noise"]
    assert "epsilon" not in clip and clip["releases"] == 1 and clip["sigma"] == 4.0
    assert clip["guarantee"].startswith("no differential-privacy guarantee: 'marvell' adds noise shaped by")
    assert budget_text(privacy) == (f"g: clip_noise: {clip['guarantee']}, marvell: no differential-privacy "
                                    f"guarantee")
    for i, (extra, message) in enumerate([
            ("clip_noise = { max_norm = 0.05, epsilon = 8.0 }\nmarvell = { bound = 0.5 }",
             "'clip_noise' with a target epsilon is a label-DP budget.*'marvell' adds noise"),
            (f"{both}\ndp_sgd = {{ max_norm = 1.0 }}", "'dp_sgd' makes the run end-to-end label-DP, and 'marvell'")]):
        with pytest.raises(ConfigError, match=message):
            load_experiment(_zero_vs_rest(tmp_path, "", extra, f"refused{i}.toml"))


BINARY_HEAD = "from torch import nn\n\n\ndef make(out=1):\n    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), " \
              "nn.Linear(16, out))\n"


def _binary_cross_entropy(tmp_path: Path, g_extra: str, name: str, out: int = 1) -> Path:
    """Digit 0 against the rest with a torch label owner (``bhead:make``) trained by BCEWithLogitsLoss on
    float 0/1 targets: Li et al.'s own two-class setting."""
    (tmp_path / "bhead.py").write_text(BINARY_HEAD)
    path = _zero_vs_rest(tmp_path, "", g_extra, name)
    text = path.read_text().replace('model = [{ type = "dense", name = "g1", in = 64, out = 2 }]',
                                    f'module = "bhead:make"\nmodule_args = {{ out = {out} }}')
    path.write_text(text.replace('loss = "softmax_cross_entropy"', 'loss = { type = "BCEWithLogitsLoss" }')
                    .replace("batch = 32", 'batch = 32\nlabel_dtype = "float32"'))
    return path


def test_marvell_defends_a_binary_cross_entropy_label_owner(tmp_path):
    """A two-class loss is also a binary cross-entropy of one 0/1 target per row: Marvell defends it as it
    defends class ids 0 and 1 (it was refused, as if its targets were real-valued)."""
    pytest.importorskip("torch")
    plain = train_in_process(load_experiment(_binary_cross_entropy(tmp_path, "", "plain.toml")), steps=3,
                             noise_secret=3)
    defended = train_in_process(load_experiment(_binary_cross_entropy(tmp_path, "marvell = { bound = 0.5 }",
                                                                      "marvell.toml")), steps=3, noise_secret=3)
    assert defended["privacy"] == {"g": {"marvell": "no differential-privacy guarantee"}}
    assert defended["params"]["f"] != plain["params"]["f"]      # f trained on other (noised) gradients


def test_max_norm_marvell_and_nopeek_in_micro_batches_too_small_to_act_are_refused_not_idle(tmp_path):
    """max_norm brings each row to the largest norm of its micro-batch and Marvell shapes its noise by the two
    classes of it: in micro-batches of one row both add nothing (the run was the undefended one, bitwise).
    Refused naming the key and the reason, where the run is set up and at the label owner's handshake (the
    data owner chooses the micro-batches); two rows a micro-batch are defended. NoPeek's gradient is zero in
    micro-batches of one or two rows: refused there, acting in four."""
    from distgrad.errors import ProtocolError
    from distgrad.run.handshake import check_hello, hello
    max_norm = load_experiment(_digits(tmp_path, "", "max_norm = true"))
    marvell = load_experiment(_zero_vs_rest(tmp_path, "", "marvell = { bound = 0.5 }"))
    for exp, key in ((max_norm, "max_norm"), (marvell, "marvell")):
        with pytest.raises(ConfigError, match=f"stage 'g': '{key}' .* a micro-batch of 1 row"):
            train_in_process(exp, steps=1, micro_batches=32, noise_secret=1)
        body = hello(exp, "f", exp.seed, (32, 64), "run", [0], 1, 32).body
        with pytest.raises(ProtocolError, match=f"hello asks for 32 micro-batches of 1 row; stage g: '{key}'"):
            check_hello(body, "f", exp, exp.seed, (32, 64), "g")
        assert check_hello(hello(exp, "f", exp.seed, (32, 64), "run", [0], 1, 16).body, "f", exp, exp.seed,
                           (32, 64), "g") == 16
    plain = train_in_process(load_experiment("digits"), steps=1, micro_batches=16)
    assert train_in_process(max_norm, steps=1, micro_batches=16, noise_secret=1)["params"] != plain["params"]
    nopeek = load_experiment(_digits(tmp_path, "nopeek = { weight = 0.5 }", "", "nopeek.toml"))
    for mbs in (16, 32):        # NoPeek's term: dCor of two rows is 1, of one 0, whatever the activations
        with pytest.raises(ConfigError, match=f"stage 'f': 'nopeek' .* a micro-batch of {32 // mbs} row"):
            train_in_process(nopeek, steps=1, micro_batches=mbs)
    assert train_in_process(nopeek, steps=1, micro_batches=8)["params"] != train_in_process(
        load_experiment("digits"), steps=1, micro_batches=8)["params"]


def test_parse_defenses_reads_back_what_split_writes():
    table = {"clip_noise": {"max_norm": 2.0, "sigma": 0.5, "delta": 1e-6}, "max_norm": True,
             "label_dp": {"epsilon": 1.5}, "marvell": {"bound": 0.5}}
    defenses = parse_defenses(table, "g")
    assert parse_defenses(defenses.as_table(), "g") == defenses
    with pytest.raises(ConfigError, match="delta must be a number in"):
        parse_defenses({"clip_noise": {"max_norm": 2.0, "sigma": 0.5, "delta": 1.0}}, "g")


# --- runs -------------------------------------------------------------------------------------------------

def test_each_defense_changes_what_is_trained_and_is_reported(tmp_path):
    """Not a no-op: each defense alone gives other parameters than the undefended run; the summary states
    the budget or that there is none."""
    plain = train_in_process(load_experiment("digits"), steps=20)
    for i, (f_extra, g_extra) in enumerate([(F_DEFENSE, ""), ("nopeek = { weight = 0.5 }", ""),
                                            ("", "clip_noise = { max_norm = 0.05, sigma = 0.5 }"),
                                            ("", "max_norm = true"), ("", "label_dp = { epsilon = 2.0 }")]):
        defended = train_in_process(load_experiment(_digits(tmp_path, f_extra, g_extra, f"d{i}.toml")), steps=20)
        assert defended["params"]["f"] != plain["params"]["f"], (f_extra, g_extra)
        assert "privacy" in defended
    summary = train_in_process(load_experiment(_digits(tmp_path, F_DEFENSE, G_DEFENSE)), steps=100)
    privacy = summary["privacy"]
    assert privacy["g"]["label_dp"] == {"epsilon": 2.0}
    assert privacy["g"]["max_norm"] == privacy["f"]["clip_noise"].split(" is stated")[0] == \
        privacy["f"]["nopeek"] == "no differential-privacy guarantee"
    clip = privacy["g"]["clip_noise"]
    assert clip["delta"] == 1e-5 and clip["noise_multiplier"] == 0.25
    assert clip["releases"] == 3           # 100 steps of 44 batches an epoch: each row is sent in 3 epochs at most
    if "error" not in clip:
        assert 0 < clip["epsilon"] < math.inf


@pytest.mark.usefixtures("fixed_noise_secret")
def test_defended_run_over_processes_is_bitwise_the_in_process_run(tmp_path):
    """Both parties defended, two micro-batches, int8 on both directions: the stage processes train exactly
    what one process does, and the merged summary holds both parties' privacy entries."""
    path = _digits(tmp_path, F_DEFENSE, G_DEFENSE)
    args = ["run", path, "--steps", "30", "--micro-batches", "2", "--activation-codec", "int8",
            "--gradient-codec", "int8"]
    assert run_main([*args, "--in-process", "--summary", tmp_path / "ref.json"]).returncode == 0
    result = run_launcher([*args, "--summary", tmp_path / "run.json"])
    assert result.returncode == 0, result.stdout + result.stderr
    reference, summary = read_json(tmp_path / "ref.json"), read_json(tmp_path / "run.json")
    assert summary["params"] == reference["params"]
    assert summary["test_loss"] == reference["test_loss"]
    assert summary["privacy"] == reference["privacy"]
    assert "privacy: f: clip_noise" in result.stdout


@pytest.mark.usefixtures("fixed_noise_secret")
def test_marvell_over_processes_is_bitwise_the_in_process_run(tmp_path):
    """Marvell reads each micro-batch's labels where its gradient rows are sent: over processes, with two
    micro-batches and int8 on the gradients, the stages train exactly what one process does; not a no-op."""
    path = _zero_vs_rest(tmp_path, g_extra="marvell = { bound = 0.5 }")
    summary = _equal_over_processes(tmp_path, path, "--micro-batches", "2", "--gradient-codec", "int8")
    assert summary["privacy"]["g"]["marvell"] == "no differential-privacy guarantee"
    plain = train_in_process(load_experiment(_zero_vs_rest(tmp_path, name="plain.toml")), steps=20,
                             micro_batches=2)
    assert plain["params"]["f"] != summary["params"]["f"]


@pytest.mark.slow
@pytest.mark.usefixtures("fixed_noise_secret")
def test_marvell_run_survives_kill_9_of_either_stage_bitwise(tmp_path, stage_group):
    _kill_9_of_either_stage_is_bitwise(tmp_path, stage_group, _zero_vs_rest(
        tmp_path, F_DEFENSE, "marvell = { bound = 0.5 }\nlabel_dp = { epsilon = 2.0 }"))


@pytest.mark.slow       # about 10 s; the undefended kill -9 runs by default, and the defenses are stateless per step
@pytest.mark.usefixtures("fixed_noise_secret")
def test_defended_run_survives_kill_9_of_either_stage_bitwise(tmp_path, stage_group):
    _kill_9_of_either_stage_is_bitwise(tmp_path, stage_group, _digits(tmp_path, F_DEFENSE, G_DEFENSE))


def _kill_9_of_either_stage_is_bitwise(tmp_path: Path, stage_group, path: Path) -> None:
    steps = "300"
    reference = train_in_process(load_experiment(path), steps=int(steps))["params"]
    f_summary, g_summary, pair = run_killing_each_stage(stage_group, tmp_path, path, int(steps))
    assert f_summary["params"]["f"] == reference["f"]
    assert g_summary["params"]["g"] == reference["g"]
    assert pair.starts["g"] == pair.starts["f"] == 2


@pytest.mark.usefixtures("fixed_noise_secret")
def test_stage_files_keep_each_partys_defenses_and_draw_from_the_runs_secret_not_the_seed(tmp_path):
    """``distgrad split`` writes each party's defenses into its own stage file; the label owner's randomized
    labels follow the run's secret, not its seed (its own ``seed`` changes none of them, and nothing says
    a defense draws from a seed), and the stage processes still train what one process does."""
    assert run_main(["split", _digits(tmp_path, F_DEFENSE, G_DEFENSE), tmp_path / "parts"]).returncode == 0
    f_file, g_file = tmp_path / "parts" / "f" / "f.toml", tmp_path / "parts" / "g" / "g.toml"
    assert "clip_noise" in f_file.read_text() and "label_dp" in g_file.read_text()
    shared = train_in_process(load_experiment([f_file, g_file]), steps=10)
    assert "noise_seed" not in shared["privacy"]["g"] and "drawn_by" not in shared["privacy"]["g"]
    shared_labels = load_experiment([f_file, g_file]).build_data(stage="g").noisy
    g_file.write_text(g_file.read_text().replace('[stage]\nname = "g"\n', '[stage]\nname = "g"\nseed = 7\n'))
    args = ["run", f_file, g_file, "--steps", "20", "--micro-batches", "2"]
    assert run_main([*args, "--in-process", "--summary", tmp_path / "ref.json"]).returncode == 0
    result = run_launcher([*args, "--summary", tmp_path / "run.json"])
    assert result.returncode == 0, result.stdout + result.stderr
    reference, summary = read_json(tmp_path / "ref.json"), read_json(tmp_path / "run.json")
    assert summary["params"] == reference["params"]
    assert "noise_seed" not in summary["privacy"]["g"] and "run's seed" not in result.stdout
    own_seed = load_experiment([f_file, g_file])
    np.testing.assert_array_equal(own_seed.build_data(stage="g").noisy, shared_labels)    # the same secret
    own_seed.run_secret("g").value += 1                                                    # another run's
    assert not np.array_equal(own_seed.build_data(stage="g").noisy, shared_labels)


@pytest.mark.usefixtures("fixed_noise_secret")
def test_defended_vertical_parties_and_clients_over_processes_are_bitwise_the_in_process_run(tmp_path):
    """Every topology gets the defenses through the one pipeline: feature parties clip and noise their
    embeddings (or decorrelate them, NoPeek), the label owner each party's gradient (streams per peer); each
    client its activations."""
    clip = "clip_noise = { max_norm = 1.0, sigma = 0.1 }"
    vertical = _defended(tmp_path, "vertical-classify", {0: clip, 1: "nopeek = { weight = 0.5 }", 2: clip,
                                                         3: G_DEFENSE}, "vertical.toml")
    summary = _equal_over_processes(tmp_path, vertical)
    assert set(summary["privacy"]) == {"a", "b", "c", "g"}
    clients = _defended(tmp_path, "digits-clients", {0: F_DEFENSE, 1: G_DEFENSE}, "clients.toml")
    _equal_over_processes(tmp_path, clients)
    plain = train_in_process(load_experiment("vertical-classify"), steps=20)
    assert train_in_process(load_experiment(vertical), steps=20)["params"]["b"] != plain["params"]["b"]


def test_defended_torch_stages_change_what_is_trained(tmp_path):
    """The defenses act on what crosses, whatever computes the stage: defended torch stages train other
    parameters than undefended ones (over processes, bitwise the same: the slow test below)."""
    pytest.importorskip("torch")
    torch_lines = 'framework = "torch"\n'
    path = _digits(tmp_path, torch_lines + F_DEFENSE, torch_lines + G_DEFENSE, "torch.toml")
    plain = _digits(tmp_path, torch_lines, torch_lines, "plain-torch.toml")
    defended = train_in_process(load_experiment(path), steps=10)
    assert defended["params"] != train_in_process(load_experiment(plain), steps=10)["params"]
    assert defended["privacy"]["g"]["label_dp"] == {"epsilon": 2.0}


@pytest.mark.slow
@pytest.mark.usefixtures("fixed_noise_secret")
def test_defended_torch_stages_over_processes_are_bitwise_the_in_process_run(tmp_path):
    pytest.importorskip("torch")
    torch_lines = 'framework = "torch"\n'
    _equal_over_processes(tmp_path, _digits(tmp_path, torch_lines + F_DEFENSE, torch_lines + G_DEFENSE),
                          "--micro-batches", "2")


@pytest.mark.slow
@pytest.mark.usefixtures("fixed_noise_secret")
def test_marvell_on_torch_stages_over_processes_is_bitwise_the_in_process_run(tmp_path):
    pytest.importorskip("torch")
    torch_lines = 'framework = "torch"\n'
    summary = _equal_over_processes(tmp_path, _zero_vs_rest(tmp_path, torch_lines, torch_lines + "marvell = { bound = "
                                                            "0.5 }"), "--micro-batches", "2")
    assert summary["privacy"]["g"]["marvell"] == "no differential-privacy guarantee"


@pytest.mark.slow       # the same pipeline as the two-stage runs above; kept out of the default suite's time
@pytest.mark.usefixtures("fixed_noise_secret")
def test_defended_chain_and_steps_in_flight_over_processes_are_bitwise_the_in_process_run(tmp_path):
    """A chain of three (the middle stage relays, undefended) with both ends defended, and the data owner's
    steps in flight (--staleness 1): draws keyed by the step stay exact when forwards run ahead."""
    chain = _defended(tmp_path, "chain-regression", {0: "clip_noise = { max_norm = 1.0, sigma = 0.1 }\n"
                                                        "nopeek = { weight = 0.3 }",
                                                     2: "clip_noise = { max_norm = 0.1, sigma = 0.3 }\n"
                                                        "max_norm = true"},
                      "chain.toml")
    assert set(_equal_over_processes(tmp_path, chain)["privacy"]) == {"f", "g"}
    _equal_over_processes(tmp_path, _digits(tmp_path, F_DEFENSE, G_DEFENSE), "--staleness", "1")


@pytest.mark.usefixtures("fixed_noise_secret")
def test_defended_stages_through_the_python_api_train_the_in_process_parameters(tmp_path):
    """``distgrad.serve_stage`` / ``drive_stage`` (the stages as threads of this process, over tcp) take the
    defenses from the same file and report them in each stage's summary."""
    import distgrad

    path = _digits(tmp_path, F_DEFENSE, G_DEFENSE)
    reference = train_in_process(load_experiment(path), steps=15)
    with distgrad.serve_stage(path, steps=15) as g:
        f_summary = distgrad.drive_stage(path, g.endpoint, steps=15)
        g_summary = g.wait()
    assert f_summary["params"]["f"] == reference["params"]["f"]
    assert g_summary["params"]["g"] == reference["params"]["g"]
    assert g_summary["privacy"]["g"] == reference["privacy"]["g"]
    assert f_summary["privacy"]["f"] == reference["privacy"]["f"]
