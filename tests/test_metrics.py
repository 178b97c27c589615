"""Held-out metrics beyond accuracy, keep_best and early stopping.

The metrics follow scikit-learn's definitions (hand-computed values here, and scikit-learn itself when it is
installed); the label owner's verdicts reach every party in the evaluation reply, so over processes (two
stages, stage files, a chain, vertical parties, the Python API) every party keeps and stops at the step
``--in-process`` does, with the same scores and parameters.
"""

from __future__ import annotations

import json
import signal
import tomllib
from pathlib import Path

import numpy as np
import pytest

import distgrad
from distgrad.config.parse import load_experiment
from distgrad.errors import ConfigError
from distgrad.model.metrics import score
from distgrad.plot import draw_metrics
from distgrad.run.inprocess import train_in_process
from distgrad.run.progress import render_bar
from distgrad.stage.selection import Selection

from conftest import DIGITS_NPZ, StageGroup, digits_data_table, read_json, read_lines, run_launcher, run_main
from test_tensorboard import _scalars

JUDGED = """metrics = ["auc", "f1", "precision", "recall"]
keep_best = "test_accuracy"
early_stopping = { metric = "test_accuracy", patience = 2 }
"""
BEST, STOPPED = 52, 60      # what JUDGED gives on _digits: the steps every run must keep and stop at


def _digits(tmp_path: Path, judged: str = JUDGED, steps: int = 200, middle: bool = False) -> Path:
    """The digits split (a middle stage too with ``middle``), evaluated every 4 steps, its label owner with
    ``judged``: the accuracy stops improving twice in a row after step 60 (``STOPPED``), the best at step 52."""
    stages = [("f", 64, 32, "relu")] + ([("m", 32, 32, "tanh")] if middle else [])
    text = f"""name = "digits-judged"
steps = {steps}
seed = 0
eval_every = 4
{digits_data_table()}""" + "".join(f"""[[stages]]
name = "{name}"
model = [{{ type = "dense", name = "{name}1", in = {n_in}, out = {n_out} }}, {{ type = "{act}" }}]
optimizer = {{ type = "adam", lr = 0.003 }}
""" for name, n_in, n_out, act in stages) + f"""[[stages]]
name = "g"
model = [{{ type = "dense", name = "g1", in = 32, out = 10 }}]
optimizer = {{ type = "adam", lr = 0.003 }}
loss = "softmax_cross_entropy"
{judged}"""
    path = tmp_path / "digits-judged.toml"
    path.write_text(text)
    return path


def _saved(directory: Path) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for path in sorted(directory.glob("*.npz")):
        with np.load(path, allow_pickle=False) as z:
            out[path.stem] = {name: z[name] for name in z.files}
    return out


def _same_arrays(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].keys() == b[k].keys() and all(
        np.array_equal(a[k][n], b[k][n]) for n in a[k]) for k in a)


# -- the metrics


def test_binary_scores_equal_the_hand_computed_values():
    """Two classes: class 1 is the positive one; the ROC area counts a tie between a positive and a
    negative as half (the positive scored 2 against the negative scored 2)."""
    a = np.array([2, -1, 2, -2, 3, 1], np.float32)
    logits = np.stack([np.zeros_like(a), a], axis=1)     # the probability of class 1 rises with a
    truth = np.array([1, 1, 0, 0, 1, 0])
    got = score(["accuracy", "auc", "f1", "precision", "recall"], logits, truth)
    # predicted [1, 0, 1, 0, 1, 1]: TP 2 (rows 0, 4), FP 2 (rows 2, 5), FN 1 (row 1), right 3 of 6
    assert got["accuracy"] == 0.5 and got["precision"] == 0.5 and got["recall"] == 2 / 3
    assert got["f1"] == pytest.approx(4 / 7, abs=1e-15)
    assert got["auc"] == pytest.approx(6.5 / 9, abs=1e-15)      # positive-over-negative pairs: 2.5 + 1 + 3


def test_multiclass_scores_are_macro_means_and_regression_scores_element_means():
    logits = np.eye(3, dtype=np.float32)[[0, 2, 2, 1, 0]]      # predicted 0, 2, 2, 1, 0
    truth = np.array([0, 1, 2, 2, 0])
    got = score(["precision", "recall", "f1"], logits, truth)
    # class 0: P 1, R 1, F 1; class 1: 0, 0, 0; class 2: P 1/2, R 1/2, F 1/2
    assert got == {"precision": 0.5, "recall": 0.5, "f1": 0.5}
    assert score(["auc"], logits, np.zeros(5, np.int64)) == {"auc": None}     # one class: undefined
    out = np.array([[1.0, 2.0], [3.0, -1.0]], np.float32)
    target = np.array([[0.0, 2.0], [1.0, 1.0]], np.float32)
    assert score(["mse", "mae"], out, target) == {"mse": (1 + 0 + 4 + 4) / 4, "mae": (1 + 0 + 2 + 2) / 4}


def test_the_scores_are_scikit_learn_s():
    metrics = pytest.importorskip("sklearn.metrics", reason="scikit-learn is not installed")
    rng = np.random.default_rng(3)
    for classes in (2, 3, 5):
        for case in range(10):
            truth = np.r_[np.arange(classes), rng.integers(0, classes, 40)]     # every class occurs
            logits = rng.normal(size=(len(truth), classes)).astype(np.float32)
            if case % 2:
                logits = np.round(logits)                                       # ties
            wide = logits.astype(np.float64)                 # the softmax in float64, as distgrad computes it
            prob = np.exp(wide - wide.max(1, keepdims=True))
            prob = prob / prob.sum(1, keepdims=True)
            predicted, average = logits.argmax(1), "binary" if classes == 2 else "macro"
            want = {"accuracy": metrics.accuracy_score(truth, predicted),
                    "precision": metrics.precision_score(truth, predicted, average=average, zero_division=0),
                    "recall": metrics.recall_score(truth, predicted, average=average, zero_division=0),
                    "f1": metrics.f1_score(truth, predicted, average=average, zero_division=0),
                    "auc": metrics.roc_auc_score(truth, prob[:, 1]) if classes == 2 else metrics.roc_auc_score(
                        truth, prob, multi_class="ovr", average="macro")}
            got = score(list(want), logits, truth)
            assert got == pytest.approx(want, abs=1e-12), (classes, case)
    out, target = rng.normal(size=(30, 3)).astype(np.float32), rng.normal(size=(30, 3)).astype(np.float32)
    assert score(["mse", "mae"], out, target) == pytest.approx(
        {"mse": metrics.mean_squared_error(target, out), "mae": metrics.mean_absolute_error(target, out)}, rel=1e-6)


# -- the verdicts


def test_the_best_is_the_first_of_the_extreme_and_patience_counts_evaluations_without_improvement():
    judge = Selection("test_accuracy", {"metric": "test_loss", "patience": 2})
    seen = [judge.judge(step, {"test_accuracy": acc, "test_loss": loss}, last=step == 6)
            for step, acc, loss in [(1, 0.5, 2.0), (2, 0.7, 1.0), (3, 0.7, 1.0), (4, None, 1.5), (5, 0.8, 0.9),
                                    (6, 0.6, 3.0)]]
    assert [v["best"] for v in seen] == [True, True, False, False, True, False]   # a tie or None: no
    assert [v["stop"] for v in seen] == [False, False, False, True, False, False]  # never after the last
    again = judge.judge(2, {"test_accuracy": 0.1, "test_loss": 5.0}, last=False)   # step 2 taken again
    assert again == {"best": False, "stop": False} and [s for s, _ in judge.history] == [1, 2]
    lower = Selection("test_mae", None)
    assert [lower.judge(s, {"test_mae": v}, False)["best"] for s, v in [(1, 3.0), (2, 4.0), (3, 1.0)]] == [
        True, False, True]


@pytest.mark.parametrize("judged,message", [
    ('metrics = ["auc"]\n', None),
    ('metrics = ["mse"]\n', "do not fit a loss of class ids"),
    ('metrics = ["roc"]\n', "unknown metrics ['roc']"),
    ('metrics = ["f1", "f1"]\n', "names a metric twice"),
    ('keep_best = "test_auc"\n', "keep_best 'test_auc' is not a score this stage reports"),
    ('early_stopping = { metric = "test_loss", patience = 0 }\n', "patience = K } with K >= 1"),
    ('early_stopping = { metric = "test_f1", patience = 1 }\n', "early_stopping's metric 'test_f1'"),
])
def test_the_keys_are_checked_against_the_loss(tmp_path, judged, message):
    path = _digits(tmp_path, judged)
    if message is None:
        load_experiment(path)
        return
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_experiment(path)


def test_only_the_label_owner_judges_and_unusable_verdicts_exit_2(tmp_path):
    path = _digits(tmp_path)
    text = path.read_text()
    first_stage = text.replace('optimizer = { type = "adam", lr = 0.003 }\n[[stages]]\nname = "g"',
                               'optimizer = { type = "adam", lr = 0.003 }\nmetrics = ["auc"]\n[[stages]]\nname = "g"')
    (tmp_path / "first.toml").write_text(first_stage)
    with pytest.raises(ConfigError, match="belong to the last stage"):
        load_experiment(tmp_path / "first.toml")
    for flags, message in ((["--eval-every", "0"], "early_stopping judges the evaluations during the run"),
                           (["--staleness", "1"], "with staleness 1")):
        result = run_main(["run", path, "--in-process", *flags])
        assert result.returncode == 2 and message in result.stderr, result.stderr
    (tmp_path / "none.toml").write_text(text.replace("test_fraction = 0.2", "test_fraction = 0.0"))
    with pytest.raises(ConfigError, match="the data holds out none"):
        load_experiment(tmp_path / "none.toml")
    clients = text.replace("eval_every = 4\n", "eval_every = 4\n[clients]\ncount = 2\n")
    (tmp_path / "clients.toml").write_text(clients)
    result = run_main(["run", tmp_path / "clients.toml", "--in-process"])
    assert result.returncode == 2 and "with [clients] each data owner is scored" in result.stderr, result.stderr


def test_the_bar_and_the_plot_show_every_score():
    bar = render_bar(4, 8, 0.5, 10.0, {"test_loss": 0.3, "test_accuracy": 0.9, "test_auc": 0.97, "test_f1": None})
    assert " test 0.3 acc 0.900 auc 0.970 " in bar and "f1" not in bar
    records = [{"step": s, "loss": 1.0 / s, "wall_s": 0.1 * s, "test_loss": 1.0 / s, "test_accuracy": 0.5,
                "test_auc": 0.6} for s in (1, 2, 3)]
    fig = draw_metrics(records, "x")
    labels = [line.get_label() for line in fig.axes[1].get_lines()]
    assert len(fig.axes) == 3 and labels == ["accuracy", "auc"]


# -- over processes, equal to --in-process


def test_two_processes_keep_and_stop_at_the_steps_of_one_process(tmp_path):
    """The label owner's verdicts reach the data owner: both save step 52's parameters, both stop after
    step 60 of 200; the scores, the saved files and the parameters equal --in-process's; the metrics file,
    the progress lines and TensorBoard carry every score."""
    pytest.importorskip("tensorboardX", reason="tensorboardX is not installed")
    path = _digits(tmp_path)
    reference = json.loads(json.dumps(train_in_process(load_experiment(path), save_dir=tmp_path / "ref")))
    assert (reference["steps"], reference["best_step"], reference["stopped_early"]) == (STOPPED, BEST, STOPPED)
    summary, metrics, board = tmp_path / "s.json", tmp_path / "m.jsonl", tmp_path / "board"
    result = run_launcher(["run", path, "--summary", summary, "--save", tmp_path / "saved", "--metrics", metrics,
                           "--tensorboard", board, "--progress", "lines"])
    assert result.returncode == 0, result.stdout + result.stderr
    run = read_json(summary)
    for key in ("steps", "best_step", "stopped_early", "evaluations", "params", "test_auc", "test_f1"):
        assert run[key] == reference[key], key
    assert _same_arrays(_saved(tmp_path / "saved"), _saved(tmp_path / "ref"))
    assert not _same_arrays(_saved(tmp_path / "saved"), {"f": {}, "g": {}})
    assert f"keep_best: the best evaluation was after step {BEST}" in result.stdout
    assert f"early stopping: the run ended after step {STOPPED}" in result.stdout
    lines = [line for line in read_lines(metrics) if "test_loss" in line]
    assert [line["step"] for line in lines] == list(range(4, STOPPED + 1, 4))
    assert all({"test_auc", "test_f1", "test_precision", "test_recall"} <= set(line) for line in lines)
    assert [(s, v) for s, v in _scalars(board)["test/auc"]] == [(e["step"], np.float32(e["test_auc"]))
                                                                 for e in reference["evaluations"]]


def test_stage_files_and_a_middle_stage_pass_the_verdicts_on(tmp_path):
    """`distgrad split` keeps the label owner's keys in its own file only; run from the files, and through a
    middle stage, every party keeps the best step of the in-process run (with its middle stage)."""
    combined = _digits(tmp_path)
    assert run_main(["split", combined, tmp_path / "files"]).returncode == 0
    files = [tmp_path / "files" / name / f"{name}.toml" for name in ("f", "g")]
    g_stage = tomllib.loads(files[1].read_text())["stage"]
    assert g_stage["keep_best"] == "test_accuracy" and "keep_best" not in files[0].read_text()
    result = run_launcher(["run", *files, "--summary", tmp_path / "s.json", "--save", tmp_path / "saved"])
    assert result.returncode == 0, result.stdout + result.stderr
    reference = json.loads(json.dumps(train_in_process(load_experiment(combined), save_dir=tmp_path / "ref")))
    assert read_json(tmp_path / "s.json")["params"] == reference["params"]
    assert _same_arrays(_saved(tmp_path / "saved"), _saved(tmp_path / "ref"))

    chain = _digits(tmp_path / "files", 'keep_best = "test_loss"\n', steps=24, middle=True)
    result = run_launcher(["run", chain, "--summary", tmp_path / "c.json", "--save", tmp_path / "chain"])
    assert result.returncode == 0, result.stdout + result.stderr
    reference = json.loads(json.dumps(train_in_process(load_experiment(chain), save_dir=tmp_path / "chain-ref")))
    assert read_json(tmp_path / "c.json")["best_step"] == reference["best_step"] == 24
    assert _same_arrays(_saved(tmp_path / "chain"), _saved(tmp_path / "chain-ref"))
    assert sorted(_saved(tmp_path / "chain")) == ["f", "g", "m"]


def test_feature_parties_stop_at_the_label_owner_s_step(tmp_path):
    """Vertical (two parties, each half of every image): the label owner ends its rounds where it stops,
    every party says bye there and keeps its parameters of the best step, as in one process."""
    builtin = Path(load_experiment("digits-halves").source)
    text = builtin.read_text().replace('"../datasets/digits.npz"', f'"{DIGITS_NPZ}"')
    text = text.replace("steps = 800", "steps = 400").replace("eval_every = 200", "eval_every = 4")
    path = tmp_path / "halves.toml"
    path.write_text(text + 'metrics = ["f1"]\nkeep_best = "test_f1"\n'
                           'early_stopping = { metric = "test_accuracy", patience = 2 }\n')
    reference = json.loads(json.dumps(train_in_process(load_experiment(path), save_dir=tmp_path / "ref")))
    assert reference["stopped_early"] < 400
    result = run_launcher(["run", path, "--summary", tmp_path / "s.json", "--save", tmp_path / "saved"])
    assert result.returncode == 0, result.stdout + result.stderr
    run = read_json(tmp_path / "s.json")
    for key in ("steps", "best_step", "stopped_early", "evaluations", "params"):
        assert run[key] == reference[key], key
    assert _same_arrays(_saved(tmp_path / "saved"), _saved(tmp_path / "ref"))
    assert sorted(_saved(tmp_path / "saved")) == ["g", "left", "right"]


@pytest.mark.slow
def test_a_torch_label_owner_judges_as_a_numpy_one_does(tmp_path):
    """The label owner computed by PyTorch (framework = "torch") scores and judges alike: over processes
    equal to --in-process."""
    path = _digits(tmp_path, JUDGED + 'framework = "torch"\n', steps=24)
    reference = json.loads(json.dumps(train_in_process(load_experiment(path))))
    assert {"test_auc", "test_f1", "test_precision", "test_recall"} <= set(reference["evaluations"][-1])
    result = run_launcher(["run", path, "--summary", tmp_path / "s.json"])
    assert result.returncode == 0, result.stdout + result.stderr
    run = read_json(tmp_path / "s.json")
    for key in ("steps", "best_step", "evaluations", "params"):
        assert run[key] == reference[key], key


def test_regression_scores_mse_and_mae(tmp_path):
    """A loss of values: mse is the float32 mean_squared_error loss computed in float64; keep_best on the
    lowest mae."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    np.savez(tmp_path / "rows.npz", x=x, y=np.tanh(x @ rng.normal(size=(4, 1))).astype(np.float32))
    path = tmp_path / "regress.toml"
    path.write_text("""name = "regress"
steps = 30
eval_every = 5
[data]
kind = "npz"
path = "rows.npz"
features = "x"
labels = "y"
label_dtype = "float32"
batch = 16
test_fraction = 0.25
[[stages]]
name = "f"
model = [{ type = "dense", name = "f1", in = 4, out = 8 }, { type = "tanh" }]
[[stages]]
name = "g"
model = [{ type = "dense", name = "g1", in = 8, out = 1 }]
loss = "mean_squared_error"
metrics = ["mse", "mae"]
keep_best = "test_mae"
""")
    summary = train_in_process(load_experiment(path))
    maes = [e["test_mae"] for e in summary["evaluations"]]
    assert summary["best_step"] == 5 * (1 + maes.index(min(maes)))
    for e in summary["evaluations"]:
        assert e["test_mse"] == pytest.approx(e["test_loss"], rel=1e-5) and "test_accuracy" not in e


def test_each_client_is_scored_on_its_own_rows(tmp_path):
    """With [clients] the metrics are each client's, beside its accuracy (keep_best is refused there)."""
    builtin = Path(load_experiment("digits-clients").source)
    text = builtin.read_text().replace('"../datasets/digits.npz"', f'"{DIGITS_NPZ}"')
    path = tmp_path / "clients.toml"
    path.write_text(text.replace('loss = "softmax_cross_entropy"', 'loss = "softmax_cross_entropy"\nmetrics = ["f1"]'))
    summary = train_in_process(load_experiment(path), steps=8)
    assert all(0 < client["test_f1"] < 1 and client["evaluations"][-1]["test_f1"] == client["test_f1"]
               for client in summary["clients"])
    assert len({client["test_f1"] for client in summary["clients"]}) == 3


def test_the_python_api_stops_both_stages_where_in_process_does(tmp_path):
    exp = load_experiment(_digits(tmp_path))
    with distgrad.serve_stage(exp) as g:
        summary = distgrad.drive_stage(exp, g.endpoint)
        served = g.wait()
    reference = train_in_process(exp)
    assert summary["stopped_early"] == served["stopped_early"] == reference["stopped_early"] == STOPPED
    assert summary["best_step"] == served["best_step"] == BEST
    assert summary["params"]["f"] == json.loads(json.dumps(reference["params"]["f"]))


class _TwoStages(StageGroup):
    """f and g of ``experiment`` as two processes, checkpointing every step, each resumed when restarted."""

    def __init__(self, tmp_path: Path, experiment: Path, endpoint: str) -> None:
        super().__init__(tmp_path)
        (tmp_path / "saved").mkdir()
        common = ["--experiment", str(experiment), "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every",
                  "1", "--resume", "--timeout", "0.5", "--liveness", "0.5", "--peer-deadline", "30"]
        self.args = {name: [name, f"--{role}", endpoint, "--summary", tmp_path / f"{name}.json", "--save",
                            tmp_path / "saved" / f"{name}.npz", "--trace", tmp_path / f"{name}.jsonl", *common]
                     for name, role in (("g", "bind"), ("f", "connect"))}
        self.args["f"] += ["--metrics", tmp_path / "f.metrics.jsonl"]


@pytest.mark.parametrize("killed", ["g", pytest.param("f", marks=pytest.mark.slow)])
def test_kill_9_of_either_stage_keeps_the_verdicts(tmp_path, stage_group, killed):
    """kill -9 after the best evaluation, restarted with the same command line (--resume): the checkpoints
    hold the label owner's judged evaluations and each party's verdicts, so the run keeps and stops at the
    uninterrupted run's steps, with its saved parameters (without them the label owner would judge the next
    evaluation the best, and the data owner would forget which step --save holds)."""
    path = _digits(tmp_path)
    run = stage_group(_TwoStages, tmp_path, path, f"ipc://{tmp_path}/g.sock")
    run.start("g")
    run.start("f")
    run.wait_until(lambda: run.lines("f.jsonl") >= BEST + 1, f"f to pass step {BEST}")     # before the next one
    run.procs[killed].signal(signal.SIGKILL)
    assert run.procs[killed].wait(10) == -signal.SIGKILL, f"{killed} ended before the kill"
    run.start(killed)
    run.wait_all()
    assert "resumed run" in run.logs()
    reference = json.loads(json.dumps(train_in_process(load_experiment(path), save_dir=tmp_path / "ref")))
    for name in ("f", "g"):
        summary = read_json(tmp_path / f"{name}.json")
        assert (summary["steps"], summary["best_step"], summary["stopped_early"]) == (STOPPED, BEST, STOPPED), name
        assert summary["params"][name] == reference["params"][name], name
    assert _same_arrays(_saved(tmp_path / "saved"), _saved(tmp_path / "ref"))
    # the data owner's metrics: each step's line once, the steps before the kill kept by the resumed stage and
    # the lines of the steps redone after a rollback replaced (as its trace's)
    assert [line["step"] for line in read_lines(tmp_path / "f.metrics.jsonl")] == list(range(1, STOPPED + 1))
