"""A data owner's defenses act on its evaluation and prediction activations too, and the label owner's
evaluation replies carry only the scores.

A data owner's ``clip_noise`` is applied to the held-out rows' activations of each evaluation and to the new
rows' of each ``distgrad predict`` chunk, with noise from the run's secret (a fresh one for each prediction)
keyed by a stream of their own, the step or chunk and the values; the releases are counted in the data owner's
budget entry. The label owner answers an evaluation with its aggregate scores only, never a tensor or a
per-row figure.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distgrad.config.defended import row_defense
from distgrad.config.parse import load_experiment
from distgrad.privacy.defenses import clip_noise, clip_rows, defense_rng
from distgrad.privacy.releases import HELD_OUT, NOISE_SECRET_VARIABLE, NoiseLedger, digest
from distgrad.stage.stage import Stage
from distgrad.wire import messages as wire
from distgrad.wire.link import check_evaluation, evaluation_reply
from distgrad.wire.wirecodec import PREDICT, Senders

from conftest import StageProcess, read_json, run_cli, run_launcher, run_main, wait_for_file
from test_defenses import _digits

MAX_NORM, SIGMA = 4.0, 0.5
F_CLIP = f"clip_noise = {{ max_norm = {MAX_NORM}, sigma = {SIGMA} }}"
STEPS = 20


def _noised(x: np.ndarray, secret: int, purpose: str, step: int) -> np.ndarray:
    """What stage f's clip_noise makes of held-out activations ``x`` sent for ``purpose`` at ``step``."""
    rng = defense_rng(secret, "f", f"{purpose}/activation", step, digest(x))
    return clip_noise(x, MAX_NORM, SIGMA, rng)


# --- one stage's pipeline ---------------------------------------------------------------------------------

def test_a_data_owners_evaluation_and_prediction_activations_cross_with_its_clip_noise(tmp_path):
    exp = load_experiment(_digits(tmp_path, F_CLIP))
    defense = row_defense(exp, "f", exp.seed, secret=0x5eed)
    senders = Senders(exp.codecs, defense)
    x = np.random.default_rng(0).standard_normal((40, 32)).astype(np.float32) * np.float32(3)
    sent = senders.evaluation_tensors(x, 5)["activation"]
    assert np.array_equal(sent, _noised(x, 0x5eed, "evaluation", 5))
    assert np.array_equal(senders.evaluation_roundtrip(x, 5), sent)     # the in-process twin
    noise = sent - clip_rows(x, MAX_NORM)
    assert abs(float(noise.std()) - SIGMA * MAX_NORM) < 0.1 and abs(float(noise.mean())) < 0.05
    later = senders.evaluation_tensors(x, 6)["activation"]
    predicted = senders.evaluation_tensors(x, 5, PREDICT)["activation"]
    assert not np.array_equal(later, sent) and not np.array_equal(predicted, sent)
    # never a training stream's draw
    training = defense_rng(0x5eed, "f", "activation/mb0of1", 5, digest(x)).standard_normal(4)
    assert not np.array_equal(defense_rng(0x5eed, "f", "evaluation/activation", 5, digest(x)).standard_normal(4),
                              training)
    assert defense.ledger.held_out == {"evaluation": 2, "predict": 1}      # the roundtrip of step 5 is step 5's
    assert defense.ledger.held_out_rows == {"evaluation": 80, "predict": 40}


def test_held_out_releases_outlive_a_kill_9_through_the_file_of_releases():
    """An evaluation after the last checkpoint is in the file of releases (``on_release``) and counted again
    by the restored ledger; one counted in the checkpoint and the same values again are not counted twice."""
    written = []
    ledger = NoiseLedger(7, on_release=written.append)
    ledger.release_held_out(11, "evaluation", "ab" * 32, 359)
    ledger.release_held_out(11, "evaluation", "ab" * 32, 359)        # resent: the same release
    checkpoint = ledger.arrays(10)[HELD_OUT]
    assert checkpoint.tolist() == [1, 359] and len(written) == 1
    ledger.release_held_out(21, "evaluation", "cd" * 32, 359)       # after the checkpoint of step 20
    restored = NoiseLedger(0)
    restored.restore(7, None, [r for r in written if r.step > 20], 20, checkpoint)
    assert restored.held_out == {"evaluation": 2} and restored.held_out_rows == {"evaluation": 718}
    assert not restored.pending         # a held-out release is no training step's


def test_a_label_owners_defenses_leave_the_held_out_rows_alone(tmp_path):
    """The label owner's clip_noise acts on the gradients of training rows; an evaluation sends it none."""
    exp = load_experiment(_digits(tmp_path, "", "clip_noise = { max_norm = 0.05, sigma = 0.5 }"))
    senders = Senders(exp.codecs, row_defense(exp, "g", exp.seed, secret=1))
    x = np.ones((3, 10), np.float32)
    assert np.array_equal(senders.evaluation_roundtrip(x, 1), x)


def test_an_evaluation_reply_carries_only_the_aggregate_scores():
    result = {"loss": np.float32(0.5), "correct": np.int64(7), "count": 9, "metrics": {"auc": 0.75},
              "best": True, "outputs": np.zeros((9, 10), np.float32), "per_row_loss": [0.1] * 9, "targets": [1] * 9}
    reply = evaluation_reply("run", 3, result)
    assert reply.type == wire.EVALUATION and not reply.tensors
    assert reply.body == {"loss": 0.5, "correct": 7, "count": 9, "metrics": {"auc": 0.75}, "best": True}
    assert check_evaluation(reply) == reply.body
    with pytest.raises(ValueError, match="nothing per row"):
        evaluation_reply("run", 3, {"loss": 0.5, "count": 9, "metrics": {"per_row": np.zeros(9)}})


# --- over processes -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("framework", ["numpy", pytest.param("torch", marks=pytest.mark.slow)])
def test_the_label_owner_scores_clip_noise_of_the_held_out_activations_over_processes(tmp_path, fixed_noise_secret,
                                                                                        framework):
    """Stage processes: the label owner's last evaluation scores exactly clip_noise of the data owner's clean
    held-out activations (recomputed here from the saved halves), bitwise as --in-process; the data owner's
    budget entry counts the evaluations; a ridge reconstruction of the held-out rows from them drops."""
    if framework == "torch":
        pytest.importorskip("torch")
    lines = f'framework = "{framework}"\n' if framework == "torch" else ""
    path = _digits(tmp_path, lines + F_CLIP, lines)
    args = ["run", path, "--steps", str(STEPS), "--eval-every", "10"]
    result = run_launcher([*args, "--save", tmp_path / "halves", "--summary", tmp_path / "run.json"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert run_main([*args, "--in-process", "--summary", tmp_path / "ref.json"]).returncode == 0
    summary, reference = read_json(tmp_path / "run.json"), read_json(tmp_path / "ref.json")
    assert summary["test_loss"] == reference["test_loss"] and summary["params"] == reference["params"]
    assert summary["privacy"] == reference["privacy"]
    releases = summary["privacy"]["f"]["evaluation_releases"]
    exp = load_experiment(path)
    data = exp.build_data(exp.seed, stage="f")
    assert releases == {"releases": 2, "rows": 2 * len(data.test_rows), "per_row": 2}
    assert "held-out rows in evaluations" in result.stdout + result.stderr
    f, g = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    for stage in (f, g):
        stage.load_parameters(next((tmp_path / "halves").glob(f"{stage.name}.*")))
    clean, _ = f.forward(data.test_features(), training=False)
    received = _noised(clean, int(fixed_noise_secret, 16), "evaluation", STEPS + 1)
    targets = exp.build_data(exp.seed, stage="g").test_targets()
    assert summary["test_loss"] == g.evaluate_last(received, targets)["loss"]
    assert summary["test_loss"] != g.evaluate_last(clean, targets)["loss"]
    # the label owner's linear reconstruction of the held-out rows from what it received drops
    x = data.test_features()
    public = np.random.default_rng(0).random(len(x)) < 0.2
    assert _ridge_r2(received, x, public) < _ridge_r2(clean, x, public) - 0.2


def _ridge_r2(h: np.ndarray, x: np.ndarray, public: np.ndarray) -> float:
    """The best R^2 over a few penalties of a ridge decoder from ``h`` to ``x`` fitted on the ``public`` rows,
    on the others (1 - squared error / squared distance to the public rows' mean)."""
    h = np.hstack([h.astype(np.float64), np.ones((len(h), 1))])
    x = x.astype(np.float64)
    gram = h[public].T @ h[public]
    figures = []
    for ridge in (1e-3, 1e-2, 1e-1, 1.0):
        weights = np.linalg.solve(gram + ridge * np.trace(gram) / len(gram) * np.eye(len(gram)),
                                  h[public].T @ x[public])
        error = np.sum((h[~public] @ weights - x[~public]) ** 2)
        figures.append(1.0 - error / np.sum((x[~public] - x[public].mean(axis=0)) ** 2))
    return float(max(figures))


@pytest.fixture(scope="module")
def defended_halves(tmp_path_factory) -> Path:
    """Digits with the data owner's clip_noise, split into the parties' files and trained; halves saved."""
    root = tmp_path_factory.mktemp("held-out")
    assert run_main(["split", _digits(root, F_CLIP), root / "parties"]).returncode == 0
    assert "clip_noise" in (root / "parties" / "f" / "f.toml").read_text()
    result = run_launcher(["run", root / "parties" / "f" / "f.toml", root / "parties" / "g" / "g.toml",
                           "--steps", "40", "--save", root / "halves"])
    assert result.returncode == 0, result.stderr
    return root


def _predict_scores(root: Path, tmp_path: Path, name: str) -> tuple[np.ndarray, str]:
    """``distgrad predict`` of the held-out rows with ``--output-scores``: the label owner's scores and f's
    output."""
    ready, output = tmp_path / f"{name}.ready", tmp_path / f"{name}.npy"
    with StageProcess(["predict", root / "parties" / "g" / "g.toml", "--load", root / "halves" / "g.npz",
                       "--output", output, "--output-scores", "--bind", "tcp://127.0.0.1:*", "--ready-file", ready],
                      tmp_path / f"{name}.log", distgrad=True) as g:
        endpoint = wait_for_file(ready, g)
        f = run_cli(["predict", root / "parties" / "f" / "f.toml", "--load", root / "halves" / "f.npz",
                     "--connect", endpoint])
        assert f.returncode == 0, f.stderr
        assert g.wait() == 0, g.output
    return np.load(tmp_path / f"{name}.scores.npy"), f.stdout + f.stderr


def _clean_and_noised_scores(root: Path, secret: int | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The scores of the held-out rows computed here from the halves: undefended, and (given the secret)
    with f's clip_noise on each chunk as ``distgrad predict`` sends it."""
    exp = load_experiment([root / "parties" / "f" / "f.toml", root / "parties" / "g" / "g.toml"])
    f, g = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    f.load_parameters(root / "halves" / "f.npz")
    g.load_parameters(root / "halves" / "g.npz")
    rows = exp.build_data(exp.seed, stage="f").test_features()
    clean, noised = [], []
    for number, start in enumerate(range(0, len(rows), exp.batch), start=1):
        y = f.forward(rows[start:start + exp.batch], training=False)[0]
        clean.append(exp.final_loss.scores(g.forward(y, training=False)[0]))
        if secret is not None:
            noised.append(exp.final_loss.scores(g.forward(_noised(y, secret, "predict", number),
                                                          training=False)[0]))
    return np.concatenate(clean), np.concatenate(noised) if secret is not None else None


def test_predictions_carry_the_data_owners_clip_noise_and_never_repeat_it(defended_halves, tmp_path, monkeypatch):
    monkeypatch.delenv(NOISE_SECRET_VARIABLE, raising=False)        # each prediction draws its own secret
    first, f_output = _predict_scores(defended_halves, tmp_path, "first")
    second, _ = _predict_scores(defended_halves, tmp_path, "second")
    clean, _ = _clean_and_noised_scores(defended_halves, None)
    assert first.shape == second.shape == clean.shape
    assert not np.array_equal(first, clean) and not np.array_equal(first, second)
    assert not np.any(np.all(first == second, axis=1)), "no row may get the same noise in two predictions"
    assert "new rows in predictions" in f_output


@pytest.mark.usefixtures("fixed_noise_secret")
def test_a_prediction_sends_exactly_clip_noise_of_each_chunk(defended_halves, tmp_path, fixed_noise_secret):
    scores, _ = _predict_scores(defended_halves, tmp_path, "fixed")
    _, expected = _clean_and_noised_scores(defended_halves, int(fixed_noise_secret, 16))
    assert np.array_equal(scores, expected)


@pytest.mark.parametrize("end", ["first", "last"])
def test_the_cut_library_refuses_a_combined_experiments_defenses_rather_than_ignoring_them(tmp_path, end):
    """A ``Cut`` (or ``CutServer``) given a combined experiment whose stage has defenses is refused naming them:
    the library's loop sends what it computes, so its steps and evaluations would cross undefended."""
    from distgrad.errors import ConfigError
    from distgrad.run.cut_interface import cut_side
    path = _digits(tmp_path, F_CLIP, "clip_noise = { max_norm = 0.05, sigma = 0.5 }")
    with pytest.raises(ConfigError, match="applies no stage's defenses") as info:
        cut_side(end, path, {})
    assert "clip_noise" in str(info.value)
    plain = _digits(tmp_path, name="plain.toml")       # without defenses (nor feature_scale, refused by a Cut)
    plain.write_text("".join(line for line in plain.read_text().splitlines(keepends=True)
                             if not line.startswith("feature_scale")))
    assert cut_side(end, plain, {}).stage == ("f" if end == "first" else "g")


@pytest.mark.slow       # about 20 s: two kill -9 of a run evaluating every 20 steps
@pytest.mark.usefixtures("fixed_noise_secret")
def test_evaluation_releases_are_counted_through_kill_9_of_either_stage(tmp_path, stage_group):
    from distgrad.run.inprocess import train_in_process
    from test_faults import run_killing_each_stage
    path = _digits(tmp_path, F_CLIP)
    path.write_text(path.read_text().replace("seed = 0\n", "seed = 0\neval_every = 20\n", 1))
    steps = "300"
    reference = train_in_process(load_experiment(path), steps=int(steps))
    f_summary, _, _ = run_killing_each_stage(stage_group, tmp_path, path, int(steps))
    assert f_summary["params"]["f"] == reference["params"]["f"]
    assert reference["privacy"]["f"]["evaluation_releases"]["per_row"] == 15
    assert f_summary["privacy"]["f"]["evaluation_releases"] == reference["privacy"]["f"]["evaluation_releases"]


@pytest.mark.integration(reason="stage processes through test_defenses._equal_over_processes")
@pytest.mark.usefixtures("fixed_noise_secret")
def test_feature_parties_and_clients_count_their_defended_evaluations_as_in_process(tmp_path):
    """Vertical feature parties and clients send their held-out rows through their own clip_noise: each
    defended party's budget entry counts its evaluations, over processes as in one process; a party
    without clip_noise (NoPeek only) sends its held-out rows as they are and counts none."""
    from test_defenses import _defended, _equal_over_processes
    clip = "clip_noise = { max_norm = 1.0, sigma = 0.1 }"
    vertical = _defended(tmp_path, "digits-halves", {0: clip, 1: "nopeek = { weight = 0.5 }"}, "vertical.toml")
    privacy = _equal_over_processes(tmp_path, vertical)["privacy"]
    assert privacy["left"]["evaluation_releases"]["per_row"] == 1        # 20 steps: the last step's evaluation
    assert "evaluation_releases" not in privacy["right"]
    clients = _defended(tmp_path, "digits-clients", {0: F_CLIP}, "clients.toml")
    assert _equal_over_processes(tmp_path, clients)["privacy"]["f"]["evaluation_releases"]["per_row"] >= 1
