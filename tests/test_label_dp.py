"""Label DP that keeps accuracy (distgrad.privacy.labeldp): RR-with-prior in stages and the flip-rate-aware loss.

The mechanism and the loss are checked against their definitions (an exact epsilon, the answer probabilities
the loss assumes, the gradient against finite differences and torch); runs against the accuracy targets
(digits at epsilon 2 >= 0.90, a two-class task at epsilon 1 above the majority class); and a run whose
labels are released during training over real processes is bitwise the in-process run, in every topology
label_dp is accepted in, through kill -9 and resume.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from distgrad.config.data import ColumnView, RandomizedLabels, ReleasedLabels
from distgrad.config.parse import load_experiment, parse_experiment
from distgrad.privacy.defenses import parse_defenses
from distgrad.privacy.labeldp import (LabelDP, LabelRelease, corrected_loss, keep_rate, parse_label_dp, prior_sets,
                                      rr_with_prior, transition_weights)
from distgrad.run.inprocess import train_in_process
from distgrad.stage.stage import Stage

from conftest import run_main
from test_defenses import _defended, _digits, _equal_over_processes, _kill_9_of_either_stage_is_bitwise

STAGED = 'label_dp = { epsilon = 2.0, stages = 2, epochs_per_stage = 0.25 }'   # stage 2 from update 11 of digits


# --- the mechanism --------------------------------------------------------------------------------------

def test_prior_sets_keep_the_classes_that_make_a_true_answer_likeliest():
    """Against an exhaustive search over k: the top-k set maximises keep_rate(k) * p(top k); a uniform prior
    keeps every class (plain randomized response), a confident one fewer."""
    rng = np.random.default_rng(0)
    priors = rng.dirichlet(np.full(6, 0.3), size=200)
    for epsilon in (0.5, 2.0, 6.0):
        sets = prior_sets(priors, epsilon)
        for prior, chosen in zip(priors, sets):
            order = np.argsort(-prior, kind="stable")
            gains = [keep_rate(epsilon, k) * prior[order[:k]].sum() for k in range(1, 7)]
            k = int(np.argmax(gains)) + 1
            assert chosen.sum() == k and set(np.flatnonzero(chosen)) == set(order[:k].tolist())
    assert prior_sets(np.full((3, 10), 0.1), 2.0).all()
    assert prior_sets(np.array([[0.9, 0.05, 0.05]]), 2.0).tolist() == [[True, False, False]]


def test_rr_with_prior_answers_as_the_loss_assumes_and_is_epsilon_dp_exactly():
    """For each set size and each true label (inside and outside the set) the answers' frequencies match
    ``transition_weights``; the largest ratio of an answer's probability under two labels is e^eps."""
    epsilon, classes, draws = 1.5, 5, 200_000
    rng = np.random.default_rng(1)
    for members in ([0, 1, 2, 3, 4], [1, 3], [2]):
        sets = np.zeros((draws, classes), bool)
        sets[:, members] = True
        table = np.zeros((classes, classes))          # table[true, answer]
        for label in range(classes):
            answers = rr_with_prior(np.full(draws, label), sets, epsilon, rng.random((draws, 2)))
            assert np.isin(answers, members).all()
            table[label] = np.bincount(answers, minlength=classes) / draws
        expected = np.stack([transition_weights(np.full(1, answer), sets[:1], epsilon, classes, classes)[0]
                             for answer in range(classes)], axis=1)     # expected[true, answer]
        given = expected[:, members]          # an answer outside the set is never given
        np.testing.assert_allclose(table[:, members], given, atol=0.006)
        ratio = (given.max(axis=0) / given.min(axis=0)).max()
        assert ratio <= math.exp(epsilon) * (1 + 1e-6)
        if len(members) > 1:
            assert ratio == pytest.approx(math.exp(epsilon))


def test_corrected_loss_is_cross_entropy_on_the_released_labels_probability():
    """The value is -log sum_c w_c softmax(pred)_c, the gradient matches central differences, one-hot weights
    give plain cross-entropy, and rows not yet released count zero."""
    rng = np.random.default_rng(2)
    pred = rng.normal(size=(6, 4)).astype(np.float32)
    answers = np.array([0, 1, 2, 3, 1, 0])
    sets = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]], bool)
    weights = transition_weights(answers, sets, 1.0, 4, 4)
    active = np.array([True] * 5 + [False])
    loss, grad = corrected_loss(pred, weights, active)
    p = np.exp(pred.astype(np.float64))
    p /= p.sum(axis=1, keepdims=True)
    per_row = -np.log((weights * p).sum(axis=1))
    assert loss == pytest.approx(per_row[:5].sum() / 6, rel=1e-5)
    assert not grad[5].any()

    def value(x: np.ndarray) -> float:
        e = np.exp(x)
        return float(-np.log((weights[:5] * e[:5] / e[:5].sum(axis=1, keepdims=True)).sum(axis=1)).sum() / 6)
    step, numeric = 1e-6, np.zeros(pred.shape)
    for index in np.ndindex(pred.shape):
        up, down = pred.astype(np.float64), pred.astype(np.float64)
        up[index] += step
        down[index] -= step
        numeric[index] = (value(up) - value(down)) / (2 * step)
    np.testing.assert_allclose(grad, numeric, atol=1e-5)
    onehot = np.eye(4, dtype=np.float32)[answers]
    from distgrad.model.losses import SoftmaxCrossEntropy
    plain_loss, plain_grad = SoftmaxCrossEntropy().forward_backward(pred, answers)
    loss, grad = corrected_loss(pred, onehot, None)
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    np.testing.assert_allclose(grad, plain_grad, atol=1e-7)


@pytest.mark.usefixtures("fixed_noise_secret")     # both stages release the same labels
def test_a_torch_label_owner_trains_with_the_same_loss(tmp_path):
    """A torch stage's training loss under label_dp (one torch graph) has the numpy stage's value and input
    gradient, for the same parameters, activations and released labels."""
    pytest.importorskip("torch")
    numpy_exp = load_experiment(_digits(tmp_path, g_extra=STAGED, name="numpy.toml"))
    torch_exp = load_experiment(_digits(tmp_path, g_extra='framework = "torch"\n' + STAGED, name="torch.toml"))
    numpy_stage, torch_stage = Stage.from_experiment(numpy_exp, "g"), Stage.from_experiment(torch_exp, "g")
    assert torch_stage.label_dp is not None and torch_stage.label_dp.release is not None
    for name, value in numpy_stage.params.items():
        torch_stage.params[name][...] = value
    x = np.random.default_rng(3).normal(size=(32, 64)).astype(np.float32)
    rows = numpy_exp.build_data(stage="g").targets(1)
    loss, dx, _ = numpy_stage.loss_micro_batch(x, rows)
    torch_loss, torch_dx, _ = torch_stage.loss_micro_batch(x, rows)
    assert torch_loss == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(torch_dx, dx, atol=1e-6)
    np.testing.assert_array_equal(torch_stage.label_dp.release.answers, numpy_stage.label_dp.release.answers)


# --- labels in stages --------------------------------------------------------------------------------------

def test_label_release_draws_each_row_once_in_its_stage_and_resumes_from_its_state():
    labels = np.arange(40) % 4
    setting = LabelDP(2.0, stages=2, epochs_per_stage=1.0)
    release = LabelRelease(setting, labels, np.arange(32), 4, updates_per_stage=5, secret=0, stage="g")
    assert sorted(np.bincount(release.part[:32])[1:]) == [16, 16] and not release.part[32:].any()
    first = np.flatnonzero(release.part == 1)[:8]
    second = np.flatnonzero(release.part == 2)[:8]
    rows = np.concatenate([first, second])
    confident = np.full((16, 4), -10.0)
    confident[np.arange(16), labels[rows]] = 10.0           # a model sure of every true label
    batch = release.release(rows, confident, update=4)      # still stage 1: the second part waits
    assert batch.active.tolist() == [True] * 8 + [False] * 8
    assert release.sets[first].all()                        # stage 1: plain randomized response
    saved = release.state_arrays()
    batch = release.release(rows, confident, update=5)      # stage 2; the first part keeps its answers
    assert batch.active.all()
    np.testing.assert_array_equal(batch.answers[:8], saved["label_dp/answers"][first])
    # the prior from this forward, sure of one class: a set of that one class, answered truthfully
    np.testing.assert_array_equal(release.sets[second], np.eye(4, dtype=bool)[labels[second]])
    np.testing.assert_array_equal(batch.answers[8:], labels[second])
    again = release.release(rows, -confident, update=9)     # released once: later outputs change nothing
    np.testing.assert_array_equal(again.answers, batch.answers)
    resumed = LabelRelease(setting, labels, np.arange(32), 4, updates_per_stage=5, secret=0, stage="g")
    resumed.load_state_arrays(release.state_arrays())
    np.testing.assert_array_equal(resumed.release(rows, confident, 9).answers, batch.answers)
    np.testing.assert_array_equal(resumed.sets, release.sets)
    # Rolled back to the state before stage 2 in the same process: what was released since stays released, so
    # a step computed again on other activations (another prior) cannot draw a second answer for a label.
    release.load_state_arrays(saved)
    assert release.release(rows, -confident, update=4).active.tolist() == [True] * 8 + [False] * 8   # as before
    np.testing.assert_array_equal(release.release(rows, -confident, update=5).answers, batch.answers)
    fresh = LabelRelease(setting, labels, np.arange(32), 4, updates_per_stage=5, secret=0, stage="g")
    fresh.keep_released(release)                            # a rollback to step 0: the stage rebuilt
    np.testing.assert_array_equal(fresh.release(rows, -confident, update=5).answers, batch.answers)
    other = LabelRelease(setting, labels, np.arange(32), 4, updates_per_stage=5, secret=1, stage="g")
    assert not np.array_equal(other.part, release.part)


@pytest.mark.parametrize("label_dp", ["label_dp = { epsilon = 2.0 }", STAGED])
def test_randomized_labels_are_drawn_from_the_runs_secret_not_from_the_seed(tmp_path, label_dp):
    """A data owner knows the run's seed (it is in the interface): it cannot redraw the randomized labels from it.
    They follow the run's secret alone: the same secret (and only it) gives the same labels and parameters,
    whatever the seed; another secret, other labels; an experiment loaded anew (a party without the secret)
    draws its own."""
    path = _digits(tmp_path, g_extra=label_dp)

    def trained(secret: int, seed: int = 0) -> dict:
        return train_in_process(load_experiment(path), steps=20, seed=seed, noise_secret=secret)["params"]

    assert trained(1) == trained(1) and trained(1)["g"] != trained(2)["g"]

    def labels(exp, secret: int | None, seed: int = 0) -> np.ndarray:
        """The answers released by the label owner's stage for the first 3 steps (with stages: drawn as it
        trains on them, from its own outputs), or its data's randomized labels."""
        if secret is not None:
            exp.run_secret("g").value = secret
        data, stage = exp.build_data(seed, stage="g"), Stage.from_experiment(exp, "g", seed)
        if stage.label_dp is None or stage.label_dp.release is None:
            return data.noisy
        x = np.random.default_rng(3).normal(size=(32, 64)).astype(np.float32)
        for step in range(1, 4):
            stage.loss_micro_batch(x, data.targets(step))
        return stage.label_dp.release.answers

    run = labels(load_experiment(path), 1)
    np.testing.assert_array_equal(labels(load_experiment(path), 1), run)
    if "stages" not in label_dp:        # every row's label, whatever the seed (which also splits the rows)
        np.testing.assert_array_equal(labels(load_experiment(path), 1, seed=5), run)
    assert not np.array_equal(labels(load_experiment(path), 2), run)
    assert not np.array_equal(labels(load_experiment(path), None), run)       # a fresh secret: not the run's


def test_a_torch_label_owner_draws_its_labels_from_the_runs_secret(tmp_path):
    """The torch stage's released labels are the numpy stage's for the same secret, and other ones for another."""
    pytest.importorskip("torch")
    numpy_exp = load_experiment(_digits(tmp_path, g_extra=STAGED, name="numpy.toml"))
    torch_exp = load_experiment(_digits(tmp_path, g_extra='framework = "torch"\n' + STAGED, name="torch.toml"))
    x = np.random.default_rng(3).normal(size=(32, 64)).astype(np.float32)
    rows = numpy_exp.build_data(stage="g").targets(1)

    def answers(exp, secret: int) -> np.ndarray:
        exp.run_secret("g").value = secret
        stage = Stage.from_experiment(exp, "g")
        stage.loss_micro_batch(x, rows)
        return stage.label_dp.release.answers

    np.testing.assert_array_equal(answers(torch_exp, 1), answers(numpy_exp, 1))
    assert not np.array_equal(answers(torch_exp, 2), answers(torch_exp, 1))


def test_parse_label_dp_reads_back_its_table():
    for table in ({"epsilon": 1.0}, {"epsilon": 2.0, "loss": "plain"}, {"epsilon": 2.0, "prior": "stages"},
                  {"epsilon": 2.0, "stages": 3, "epochs_per_stage": 2.5, "loss": "corrected"}):
        setting = parse_label_dp(table, "g")
        assert parse_label_dp(setting.as_table(), "g") == setting
        assert parse_defenses({"label_dp": table}, "g").as_table() == {"label_dp": setting.as_table()}
    assert parse_label_dp({"epsilon": 2.0, "prior": "stages"}, "g") == parse_label_dp({"epsilon": 2.0, "stages": 2}, "g")


def test_without_epochs_per_stage_the_stages_split_the_experiments_steps(tmp_path):
    """The default stage length comes from the experiment file (its steps, with [clients] one update per client
    a step), which every party reads alike: not from a --steps given to one process."""
    exp = load_experiment(_digits(tmp_path, g_extra='label_dp = { epsilon = 2.0, prior = "stages", stages = 4 }'))
    assert Stage.from_experiment(exp, "g").label_dp.release.updates_per_stage == 800 // 4
    clients = load_experiment(_defended(tmp_path, "digits-clients", {1: 'label_dp = { epsilon = 2.0, stages = 2 }'},
                                        "clients.toml"))
    assert Stage.from_experiment(clients, "g").label_dp.release.updates_per_stage == clients.steps * 3 // 2


@pytest.mark.parametrize("g_extra, message", [
    ('label_dp = { epsilon = 2.0, prior = "model" }', 'prior must be "uniform"'),
    ('label_dp = { epsilon = 2.0, prior = "stages", stages = 1 }', "needs stages = K >= 2"),
    ('label_dp = { epsilon = 2.0, prior = "uniform", stages = 3 }', 'give prior = "stages"'),
    ('label_dp = { epsilon = 2.0, stages = 0, epochs_per_stage = 1 }', "stages must be an integer >= 1"),
    ('label_dp = { epsilon = 2.0, epochs_per_stage = 1 }', "it needs stages = K >= 2"),
    ('label_dp = { epsilon = 2.0, stages = 2, epochs_per_stage = 0 }', "epochs_per_stage must be a number > 0"),
    ('label_dp = { epsilon = 2.0, loss = "backward" }', 'loss must be "corrected"'),
    ('label_dp = { epsilon = 2.0, priors = "stages" }', "optionally with prior"),
])
def test_bad_label_dp_settings_exit_2_naming_the_key(tmp_path, g_extra, message):
    result = run_main(["run", _digits(tmp_path, g_extra=g_extra), "--in-process", "--steps", "1"])
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_settings_a_label_owner_cannot_train_with_are_refused_with_the_reason(tmp_path):
    """Marvell follows each row's training label, which the stages draw late; a loss other than a softmax
    cross-entropy cannot take the corrected loss (with the default loss it keeps training as before)."""
    two = np.load(Path(__file__).resolve().parent.parent / "distgrad" / "datasets" / "digits.npz")
    np.savez(tmp_path / "zero.npz", pixels=two["pixels"], digit=(two["digit"] == 0).astype(np.int64))
    path = _digits(tmp_path, g_extra=f"{STAGED}\nmarvell = {{ bound = 0.5 }}")
    path.write_text(path.read_text().replace("digits.npz", "zero.npz").replace(
        str(Path(__file__).resolve().parent.parent / "distgrad" / "datasets" / "zero.npz"),
        str(tmp_path / "zero.npz")).replace("out = 10", "out = 2"))
    result = run_main(["run", path, "--in-process", "--steps", "1"])
    assert result.returncode == 2 and "'marvell' shapes its noise by each row's training label" in result.stderr
    pytest.importorskip("torch")
    module = _torch_module_digits(tmp_path, 'loss = { type = "CrossEntropyLoss", label_smoothing = 0.1 }')
    for extra, refused in (("label_dp = { epsilon = 2.0 }", False),
                           ('label_dp = { epsilon = 2.0, loss = "corrected" }', True), (STAGED, True)):
        text = module.read_text().replace("#LABEL_DP", extra)
        (tmp_path / "m.toml").write_text(text)
        result = run_main(["run", tmp_path / "m.toml", "--in-process", "--steps", "2"])
        if refused:
            assert result.returncode == 2 and "must be softmax_cross_entropy or CrossEntropyLoss" in result.stderr
        else:
            assert result.returncode == 0, result.stderr


def _torch_module_digits(tmp_path: Path, loss_line: str) -> Path:
    """The digits experiment with a torch module label owner (a Dense 64->10 of its own) whose loss is
    ``loss_line``; ``#LABEL_DP`` marks where its label_dp goes."""
    (tmp_path / "g_module.py").write_text("import torch\n\n\ndef make_g():\n    return torch.nn.Linear(64, 10)\n")
    path = _digits(tmp_path, g_extra="#LABEL_DP", name="module.toml")
    text = path.read_text().replace('model = [{ type = "dense", name = "g1", in = 64, out = 10 }]\n'
                                    'optimizer = { type = "adam", lr = 0.003 }\nloss = "softmax_cross_entropy"',
                                    f'module = "g_module:make_g"\noptimizer = {{ type = "Adam", lr = 0.003 }}\n'
                                    f'{loss_line}')
    assert "g_module" in text
    path.write_text(text)
    return path


# --- runs: the accuracy targets -------------------------------------------------------------------------

def _recommended_label_dp_accuracy(seed: int, secret: int) -> float:
    """Held-out accuracy of the built-in digits-label-dp (the recommended epsilon-2 setting) at split ``seed``
    with its labels drawn from noise secret ``secret``; checks the summary states the epsilon of every label."""
    summary = train_in_process(load_experiment("digits-label-dp"), seed=seed, noise_secret=secret)
    assert summary["privacy"]["g"]["label_dp"] == {"epsilon": 2.0, "stages": 2}
    return float(summary["test_accuracy"])


def test_digits_at_epsilon_2_keeps_held_out_accuracy_at_0_90():
    """The recommended setting (built-in digits-label-dp: RR-with-prior in two stages, 11 epochs then 7, the
    corrected loss, f Dense 64->256 at Adam 0.0003, g at Adam 0.001; 800 steps): held-out accuracy >= 0.90 at
    epsilon 2, exactly, for each split seed 0-2 with a draw of its own (the secret is not the seed). The
    labels are drawn from the run's secret: the slow test below checks 8 secrets per seed."""
    for seed, secret in ((0, 100), (1, 101), (2, 102)):
        accuracy = _recommended_label_dp_accuracy(seed, secret)
        assert accuracy >= 0.90, (seed, secret, accuracy)


@pytest.mark.slow       # 24 runs; the default test above runs the same setting on one draw per seed
def test_digits_at_epsilon_2_keeps_held_out_accuracy_at_0_90_for_every_draw():
    """The recommended setting over split seeds 0-2 x 8 noise secrets each: every draw's held-out accuracy
    >= 0.90 (measured: 0.905-0.967; the former two stages of 9 epochs on the 64-wide digits model gave 0.833 at
    worst, 4 of 24 draws below 0.90)."""
    accuracies = {(seed, secret): _recommended_label_dp_accuracy(seed, secret)
                  for seed in range(3) for secret in range(100, 108)}
    below = {key: value for key, value in accuracies.items() if value < 0.90}
    assert not below, below
    assert sum(accuracies.values()) / len(accuracies) >= 0.93, accuracies


def test_the_corrected_loss_learns_more_from_the_same_randomized_labels():
    """Plain randomized response at epsilon 1 on digits: the flip-rate-aware loss (the default) against the
    same labels trained on as if true, seeds 0-2, 800 steps."""
    corrected, plain = [], []
    for seed in range(3):
        for keys, kept in (({"epsilon": 1.0}, corrected), ({"epsilon": 1.0, "loss": "plain"}, plain)):
            kept.append(train_in_process(parse_experiment(_digits_table(keys), "<digits>"), seed=seed,
                                         noise_secret=seed)["test_accuracy"])      # the same randomized labels
    assert np.mean(corrected) >= np.mean(plain) + 0.05, (corrected, plain)


def _digits_table(label_dp: dict) -> dict:
    from distgrad.config.tomlfile import read_toml
    from distgrad.config.experiment import BUILTIN_DIR
    raw = read_toml(BUILTIN_DIR / "digits.toml", "experiment")
    raw["data"]["path"] = str(BUILTIN_DIR.parent / "datasets" / "digits.npz")
    raw["stages"][-1]["label_dp"] = label_dp
    return raw


def _penguins(path: Path, seed: int = 0) -> float:
    """A two-class task like Palmer penguins' Adelie against the rest: four measurements (bill length and
    depth, flipper length, body mass) of three species drawn around the species' means, standardised; 152
    Adelie (label 1) and 192 others. Returns the majority class's share."""
    rng = np.random.default_rng(seed)
    species = [(152, [38.8, 18.3, 190, 3700], [2.7, 1.2, 6.5, 460]), (68, [48.8, 18.4, 196, 3733], [3.3, 1.1, 7, 384]),
               (124, [47.5, 15.0, 217, 5076], [3.1, 1.0, 6.5, 504])]
    x = np.concatenate([rng.normal(mean, sd, size=(n, 4)) for n, mean, sd in species])
    y = np.concatenate([np.full(n, int(i == 0)) for i, (n, _, _) in enumerate(species)])
    np.savez(path, x=((x - x.mean(axis=0)) / x.std(axis=0)).astype(np.float32), y=y.astype(np.int64))
    return max(y.mean(), 1 - y.mean())


def test_a_two_class_task_at_epsilon_1_beats_always_answering_the_majority_class(tmp_path):
    majority = _penguins(tmp_path / "penguins.npz")

    def raw(label_dp: dict) -> dict:
        return {"name": "penguins", "labels": "last", "seed": 0, "steps": 300,
                "data": {"kind": "npz", "path": str(tmp_path / "penguins.npz"), "features": "x", "labels": "y",
                         "batch": 16, "test_fraction": 0.2},
                "stages": [{"name": "f", "model": [{"type": "dense", "name": "f1", "in": 4, "out": 8},
                                                   {"type": "relu"}], "optimizer": {"type": "adam", "lr": 0.01}},
                           {"name": "g", "model": [{"type": "dense", "name": "g1", "in": 8, "out": 2}],
                            "optimizer": {"type": "adam", "lr": 0.01}, "loss": "softmax_cross_entropy",
                            "label_dp": label_dp}]}
    for label_dp in ({"epsilon": 1.0}, {"epsilon": 1.0, "stages": 2, "epochs_per_stage": 8}):
        accuracies = [train_in_process(parse_experiment(raw(label_dp), "<penguins>"), seed=seed,
                                       noise_secret=seed)["test_accuracy"] for seed in range(4)]
        assert min(accuracies) > majority, (label_dp, accuracies, majority)


# --- runs: exact over processes -------------------------------------------------------------------------

def test_with_stages_the_label_owners_data_hands_its_stage_the_rows_numbers(tmp_path):
    """With stages the label owner's data gives its stage the rows' numbers (the stage releases their labels);
    without, the randomized labels themselves; the held-out and the metered labels stay true."""
    staged = load_experiment(_digits(tmp_path, g_extra=STAGED))
    data = staged.build_data(stage="g")
    assert isinstance(data, ReleasedLabels)
    np.testing.assert_array_equal(data.targets(3), data._source._rows(3))
    np.testing.assert_array_equal(data.true_targets(3), load_experiment("digits").build_data(stage="g").targets(3))
    stage = Stage.from_experiment(staged, "g")
    assert stage.label_dp is not None and stage.label_dp.release is not None
    columns = ColumnView(data, [0, 1])               # a label owner's own feature columns (vertical parties)
    np.testing.assert_array_equal(columns.targets(3), data.targets(3))
    np.testing.assert_array_equal(columns.true_targets(3), data.true_targets(3))
    plain = load_experiment(_digits(tmp_path, g_extra="label_dp = { epsilon = 2.0 }", name="plain.toml"))
    assert isinstance(plain.build_data(stage="g"), RandomizedLabels)


@pytest.mark.usefixtures("fixed_noise_secret")     # the processes draw as the reference does
def test_rr_with_prior_over_processes_is_bitwise_the_in_process_run(tmp_path):
    """Stage 2 begins at update 11 of 20: labels released during training from the model's outputs, with two
    micro-batches and int8 on both directions, are exactly what one process releases and trains on."""
    summary = _equal_over_processes(tmp_path, _digits(tmp_path, g_extra=STAGED), "--micro-batches", "2",
                                    "--activation-codec", "int8", "--gradient-codec", "int8")
    assert summary["privacy"]["g"]["label_dp"] == {"epsilon": 2.0, "stages": 2}


@pytest.mark.usefixtures("fixed_noise_secret")     # the processes draw as the reference does
def test_rr_with_prior_with_clients_vertical_parties_and_sent_rows_is_bitwise_the_in_process_run(tmp_path):
    _equal_over_processes(tmp_path, _defended(tmp_path, "digits-clients", {1: STAGED}, "clients.toml"))
    _equal_over_processes(tmp_path, _defended(tmp_path, "vertical-classify", {3: STAGED}, "vertical.toml"))
    rows = _digits(tmp_path, g_extra=STAGED, name="rows.toml")
    rows.write_text(rows.read_text().replace('labels = "last"\n', 'labels = "last"\nsend_rows = true\n', 1))
    assert "send_rows = true" in rows.read_text()
    _equal_over_processes(tmp_path, rows, "--staleness", "1")


@pytest.mark.slow       # the same path as clients and a two-stage run, which the default suite runs
@pytest.mark.usefixtures("fixed_noise_secret")     # the processes draw as the reference does
def test_rr_with_prior_with_splitfed_and_a_u_shape_is_bitwise_the_in_process_run(tmp_path):
    _equal_over_processes(tmp_path, _defended(tmp_path, "digits-splitfed", {1: STAGED}, "splitfed.toml"))
    _equal_over_processes(tmp_path, _defended(tmp_path, "digits-ushaped", {2: STAGED}, "ushaped.toml"))


@pytest.mark.slow       # the numpy run above covers the release by default; torch adds only its loss (unit-tested)
@pytest.mark.usefixtures("fixed_noise_secret")     # the processes draw as the reference does
def test_rr_with_prior_on_torch_stages_over_processes_is_bitwise_the_in_process_run(tmp_path):
    pytest.importorskip("torch")
    torch_lines = 'framework = "torch"\n'
    _equal_over_processes(tmp_path, _digits(tmp_path, torch_lines, torch_lines + STAGED), "--micro-batches", "2")


@pytest.mark.slow
@pytest.mark.timeout(180)    # PyTorch in both stage processes and the reference: slower beside the slow set
@pytest.mark.usefixtures("fixed_noise_secret")     # the processes draw as the reference does
def test_rr_with_prior_on_a_torch_module_label_owner_is_bitwise_the_in_process_run(tmp_path):
    """A label owner that is the user's own module with torch's CrossEntropyLoss (reduction sum): the training
    loss keeps its reduction."""
    pytest.importorskip("torch")
    module = _torch_module_digits(tmp_path, 'loss = { type = "CrossEntropyLoss", reduction = "sum" }')
    module.write_text(module.read_text().replace("#LABEL_DP", STAGED))
    _equal_over_processes(tmp_path, module, "--micro-batches", "2")


# Slow (two kills and restarts of digits over 270 steps). By default
# test_noise_secret.py::test_after_kill_9_the_resumed_label_owner_draws_the_same_randomized_labels covers a staged
# label_dp label owner killed -9 and resumed bitwise, and test_faults.py the kill -9 of either stage.
@pytest.mark.slow
@pytest.mark.usefixtures("fixed_noise_secret")     # the processes draw as the reference does
def test_rr_with_prior_survives_kill_9_of_either_stage_bitwise(tmp_path, stage_group):
    """Three stages of 88 updates, checkpoints every 25 steps; the label owner is killed after step 90 (in
    stage 2: it resumes from a checkpoint of stage 1 or 2 and releases the labels after it again), the data
    owner after step 180 (stage 3): the run ends with the uninterrupted run's parameters."""
    _kill_9_of_either_stage_is_bitwise(tmp_path, stage_group, _digits(
        tmp_path, g_extra='label_dp = { epsilon = 2.0, stages = 3, epochs_per_stage = 2 }'))
