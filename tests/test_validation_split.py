"""A validation split (``validation_fraction`` in [data]): the evaluations during training score the
validation rows, keep_best and early_stopping choose on them, and the test rows' figures are reported for
the kept model only (summary ``test_*`` and ``test_step``, the last printed line), over processes as in
process; they equal a fresh evaluation of the kept parameters on the test rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distgrad.config.parse import load_experiment
from distgrad.errors import ConfigError, ProtocolError
from distgrad.stage.stage import Stage

from conftest import digits_data_table, read_json, run_launcher, run_main
from test_metrics import _digits

JUDGED = """keep_best = "test_accuracy"
early_stopping = { metric = "test_accuracy", patience = 3 }
metrics = ["f1"]
"""


def _validated(tmp_path: Path, judged: str = JUDGED) -> Path:
    path = _digits(tmp_path, judged)
    path.write_text(path.read_text().replace(digits_data_table(), digits_data_table() + "validation_fraction = 0.2\n"))
    return path


def _fresh_test_figures(path: Path, saved: Path) -> dict:
    """The kept (saved) parameters scored on the test rows alone, in this process."""
    exp = load_experiment(path)
    f, g = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    f.load_parameters(saved / "f.npz")
    g.load_parameters(saved / "g.npz")
    data = exp.build_data(stage="g")
    count = data.validation_count
    x, target = data.test_features()[count:], data.test_targets()[count:]
    return g.evaluate_last(f.forward(x, training=False)[0], target, ["f1"])


def test_the_split_keeps_test_validation_and_training_rows_apart(tmp_path: Path):
    data = load_experiment(_validated(tmp_path)).build_data()
    without = load_experiment(_digits(tmp_path)).build_data()
    validation, test = data.test_rows[:data.validation_count], data.test_rows[data.validation_count:]
    assert np.array_equal(test, without.test_rows)               # the test rows are test_fraction's, as before
    assert len(validation) == round(data.row_count * 0.2)
    assert not set(validation) & set(test) and not set(data.train_rows) & set(data.test_rows)
    assert len(data.train_rows) + len(data.test_rows) == data.row_count


def test_selection_is_on_validation_rows_and_the_kept_models_test_figures_are_reported(tmp_path: Path):
    path = _validated(tmp_path)
    reference = run_main(["run", path, "--in-process", "--summary", tmp_path / "ref.json", "--save", tmp_path / "ref"])
    assert reference.returncode == 0, reference.stderr
    result = run_launcher(["run", path, "--summary", tmp_path / "run.json", "--save", tmp_path / "saved",
                           "--progress", "off"])
    assert result.returncode == 0, result.stdout + result.stderr
    ref, run = read_json(tmp_path / "ref.json"), read_json(tmp_path / "run.json")
    assert run["params"] == ref["params"]
    for summary, stdout, saved in ((ref, reference.stdout, tmp_path / "ref"), (run, result.stdout, tmp_path / "saved")):
        evaluations = summary["evaluations"]
        assert all(not any(key.startswith("test_") for key in e) for e in evaluations)    # never a test figure
        accuracies = [e["validation_accuracy"] for e in evaluations]
        best = evaluations[accuracies.index(max(accuracies))]["step"]          # the first best, on validation
        assert summary["best_step"] == best and summary["test_step"] == best
        assert summary["stopped_early"] == summary["steps"] < 200
        assert summary["best_evaluation"]["step"] == best
        fresh = _fresh_test_figures(path, saved)
        assert summary["test_count"] == fresh["count"]
        assert summary["test_accuracy"] == fresh["correct"] / fresh["count"]
        assert summary["test_loss"] == pytest.approx(fresh["loss"], rel=1e-5)
        assert summary["test_f1"] == pytest.approx(fresh["metrics"]["f1"], rel=1e-9)
        last = stdout.strip().splitlines()[-1]
        assert last.startswith(f"kept model, after step {best} (chosen on {summary['validation_count']} validation "
                               f"rows): test accuracy {summary['test_accuracy']:.4f}"), last
        assert f"on {summary['test_count']} test rows" in last, last
    for key in ("test_loss", "test_accuracy", "test_f1", "test_step", "validation_loss"):
        assert run[key] == ref[key]


def test_without_keep_best_the_last_models_test_figures_are_reported(tmp_path: Path):
    path = _validated(tmp_path, 'metrics = ["f1"]\n')
    path.write_text(path.read_text().replace("steps = 200", "steps = 40"))
    assert run_main(["run", path, "--in-process", "--summary", tmp_path / "ref.json", "--save", tmp_path / "ref"]
                    ).returncode == 0
    summary = read_json(tmp_path / "ref.json")
    fresh = _fresh_test_figures(path, tmp_path / "ref")
    assert summary["test_step"] == 40 and "best_step" not in summary
    assert summary["test_accuracy"] == fresh["correct"] / fresh["count"]


def test_the_validation_line_holds_validation_figures_only(tmp_path: Path):
    """Without keep_best the printed validation line names the validation rows' figures alone (before, the
    test rows' followed on it, as if measured on the validation rows); the kept model's line gives the test ones."""
    path = _validated(tmp_path, 'metrics = ["f1"]\n')
    path.write_text(path.read_text().replace("steps = 200", "steps = 8"))
    result = run_main(["run", path, "--in-process"])
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("validation loss "))
    assert "validation f1 " in line and "test" not in line, line
    assert "test f1 " in result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("table, needle", [
    ("validation_fraction = 0.9\n", "validation_fraction must be in"),
    ("validation_fraction = 0.2\ntest_fraction = 0\n", "needs test_fraction > 0"),
])
def test_bad_validation_settings_are_refused(tmp_path: Path, table: str, needle: str):
    path = _digits(tmp_path)
    path.write_text(path.read_text().replace("test_fraction = 0.2\n", "").replace(
        "feature_scale = 0.0625\n", "feature_scale = 0.0625\n" + table + ("test_fraction = 0.2\n" if "test_fraction"
                                                                          not in table else "")))
    with pytest.raises(ConfigError, match=needle):
        load_experiment(path).build_data()


def test_validation_with_travelling_labels_is_refused_with_the_reason(tmp_path: Path):
    path = _validated(tmp_path, "")
    path.write_text(path.read_text().replace("seed = 0\n", 'seed = 0\nlabels = "first"\n', 1))
    result = run_main(["run", path, "--in-process"])
    assert result.returncode == 2 and "labels = \"first\" it holds none" in result.stderr, result.stderr


# --- ReduceLROnPlateau: stepped once after each evaluation with its (validation) loss -------------------------

@pytest.mark.parametrize("options", [{}, {"patience": 0, "factor": 0.5}, {"mode": "max", "threshold": 0.1},
                                     {"threshold_mode": "abs", "threshold": 0.05, "cooldown": 2, "patience": 1},
                                     {"patience": 0, "min_lr": 0.03, "factor": 0.5}])
def test_the_numpy_plateau_rule_is_torchs(options: dict):
    torch = pytest.importorskip("torch")
    from distgrad.model.schedules import Plateau

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=float(np.float32(0.1)))
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, **options)
    ours = Plateau(0.1, **options)
    losses = [1.0, 0.9, 0.95, 0.95, 0.91, 0.5, 0.6, 0.6, 0.6, 0.7, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]
    for loss in losses:
        reference.step(loss)
        ours.report(loss)
        assert ours.rate == optimizer.param_groups[0]["lr"]
        assert ours(1) == np.float32(ours.rate)


@pytest.mark.parametrize("options, needle", [({"factor": "x"}, "factor must be a number in \\(0, 1\\), got 'x'"),
                                             ({"factor": 1.5}, "factor must be a number in \\(0, 1\\)"),
                                             ({"patience": -1}, "patience must be a non-negative integer")])
def test_a_bad_plateau_option_is_refused_naming_it(options: dict, needle: str):
    from distgrad.model.schedules import Plateau

    with pytest.raises(ConfigError, match=needle):
        Plateau(0.1, **options)


PLATEAU = 'scheduler = { type = "ReduceLROnPlateau", patience = 0, factor = 0.5, threshold = 0.5 }\n'


def _plateau_penguins(tmp_path: Path, f_extra: str = "", steps: int = 60) -> Path:
    from test_data_prep import write_combined

    path = write_combined(tmp_path, "mean", steps=steps, extra=f_extra + PLATEAU)
    path.write_text(path.read_text().replace("test_fraction = 0.2\n", "test_fraction = 0.2\nvalidation_fraction = 0.2\n")
                    .replace('loss = "softmax_cross_entropy"', 'loss = "softmax_cross_entropy"\n' + PLATEAU.strip())
                    .replace("eval_every = 10", "eval_every = 5"))
    return path


# torch is slow (a PyTorch process); by default the numpy case covers the path over processes and
# test_the_kept_model_stands_in_for_the_live_one_and_is_put_back[torch] a torch stage's kept model.
@pytest.mark.parametrize("framework", ["numpy", pytest.param("torch", marks=pytest.mark.slow)])
def test_plateau_takes_the_validation_loss_bitwise_over_processes(tmp_path: Path, framework: str):
    """f and g each with ReduceLROnPlateau (f computed by torch in one case): over processes the parameters equal
    the in-process run's, and the scheduler changed them (the run without it differs)."""
    if framework == "torch":
        pytest.importorskip("torch")
    path = _plateau_penguins(tmp_path, 'framework = "torch"\n' if framework == "torch" else "")
    # keep_best too: the final evaluation scores the test rows with every stage's kept parameters (f's torch ones)
    path.write_text(path.read_text().replace('loss = "softmax_cross_entropy"', 'loss = "softmax_cross_entropy"\n'
                                                                          'keep_best = "test_accuracy"'))
    ref, run = _in_process_and_over_processes(tmp_path, ["run", path])
    assert run["params"] == ref["params"]
    assert 0 < ref["test_step"] == ref["best_step"] < 60      # the kept model is not the last one
    for key in ("test_loss", "test_accuracy", "test_count", "test_step", "evaluations"):
        assert run[key] == ref[key], key
    assert all(not any(key.startswith("test_") for key in e) for e in ref["evaluations"])
    plain = tmp_path / "plain.toml"
    plain.write_text(path.read_text().replace(PLATEAU, "").replace(PLATEAU.strip(), ""))
    assert run_main(["run", plain, "--in-process", "--summary", tmp_path / "plain.json"]).returncode == 0
    assert read_json(tmp_path / "plain.json")["params"] != ref["params"]


def test_plateau_survives_kill_9_of_either_stage_bitwise(tmp_path: Path, stage_group):
    from test_faults import run_killing_each_stage

    steps = "150"
    path = _plateau_penguins(tmp_path, steps=int(steps))
    assert run_main(["run", path, "--in-process", "--summary", tmp_path / "ref.json"]).returncode == 0
    reference = read_json(tmp_path / "ref.json")
    f_summary, g_summary, _ = run_killing_each_stage(stage_group, tmp_path, path, int(steps))
    assert f_summary["params"]["f"] == reference["params"]["f"]
    assert g_summary["params"]["g"] == reference["params"]["g"]
    assert g_summary["test_accuracy"] == reference["test_accuracy"] and g_summary["test_step"] == reference["test_step"]


@pytest.mark.parametrize("change, to, needle", [
    ("eval_every = 5", "eval_every = 0", "eval_every is 0"),
    ("seed = 3", "seed = 3\nstaleness = 1", "with staleness 1"),
    # no held-out rows: no evaluation, so the rate would never change (it was accepted and ignored)
    ("test_fraction = 0.2\nvalidation_fraction = 0.2\n", "test_fraction = 0.0\n",
     "scheduler ReduceLROnPlateau is stepped with the loss of each evaluation of the held-out rows, and the data "
     "holds out none"),
], ids=["no-evaluations", "staleness", "no-held-out-rows"])
def test_plateau_is_refused_where_no_evaluation_loss_reaches_it_alike(tmp_path: Path, change: str, to: str,
                                                                       needle: str):
    path = _plateau_penguins(tmp_path)
    assert change in path.read_text()
    path.write_text(path.read_text().replace(change, to))
    result = run_main(["run", path, "--in-process"])
    assert result.returncode == 2 and needle in result.stderr, result.stderr


def test_the_progress_line_shows_the_validation_figures():
    from distgrad.run.progress import render_bar

    line = render_bar(5, 10, 0.5, None, {"validation_loss": 0.25, "validation_accuracy": 0.875,
                                         "validation_f1": 0.5, "validation_count": 30})
    assert " validation 0.25 acc 0.875 f1 0.500 " in line, line
    assert "count" not in line


def test_keep_best_may_name_the_validation_figure(tmp_path: Path):
    summaries = []
    for name in ("test_accuracy", "validation_accuracy"):
        path = _validated(tmp_path, f'keep_best = "{name}"\nearly_stopping = {{ metric = "{name}", patience = 3 }}\n')
        assert run_main(["run", path, "--in-process", "--summary", tmp_path / f"{name}.json"]).returncode == 0
        summaries.append(read_json(tmp_path / f"{name}.json"))
    assert summaries[0]["best_step"] == summaries[1]["best_step"] and summaries[0]["params"] == summaries[1]["params"]
    assert summaries[0]["stopped_early"] == summaries[1]["stopped_early"]


# --- the test rows cross once, after the last step, with the kept model ------------------------------------

F_CLIP = "clip_noise = { max_norm = 4.0, sigma = 0.5 }\n"      # f's held-out releases are counted in its budget


def _clipped(path: Path) -> Path:
    """``path`` with f's clip_noise, so its budget counts what it released of the validation and test rows."""
    path.write_text(path.read_text().replace('name = "f"\n', 'name = "f"\n' + F_CLIP, 1))
    return path


def _assert_test_rows_released_once(summary: dict, stage: str = "f") -> None:
    """The data owner ``stage`` released the validation rows at each evaluation and the test rows once."""
    budget = summary["privacy"][stage]
    evaluations, validation = len(summary["evaluations"]), summary["validation_count"]
    assert budget["evaluation_releases"] == {"releases": evaluations, "rows": evaluations * validation,
                                             "per_row": evaluations}
    assert budget["test_releases"] == {"releases": 1, "rows": summary["test_count"], "per_row": 1}


def test_a_kill_9_after_the_final_evaluation_scores_the_test_rows_once(tmp_path: Path, stage_group,
                                                                        fixed_noise_secret):
    """A run that stops early: g is killed -9 once it has scored the final evaluation (checkpointed, before its
    reply left), then f once it has recorded the reply (before its bye), each restarted with --resume: the
    restarted g answers from its checkpoint, the restarted f neither evaluates again nor goes on past the early
    stop; f released the test rows once, and every figure and parameter equals the uninterrupted in-process
    run's."""
    from test_clients import GATED_STAGE
    from test_faults import Pair

    path = _clipped(_validated(tmp_path))          # keep_best and early_stopping: the run stops before step 200
    assert run_main(["run", path, "--in-process", "--summary", tmp_path / "ref.json"]).returncode == 0
    reference = read_json(tmp_path / "ref.json")
    assert 0 < reference["test_step"] == reference["best_step"] < reference["stopped_early"] < 200
    _assert_test_rows_released_once(reference)
    pair = stage_group(Pair, tmp_path, str(path), "200", f"ipc://{tmp_path}/g.sock")
    held = {name: tmp_path / f"{name}-tested.gate" for name in ("g", "f")}
    for name, gate in held.items():
        pair.commands[name] = [*GATED_STAGE, "--hold-after-test", gate, "--"]
    pair.start("g")
    pair.start("f")
    for name, gate in held.items():
        pair.wait_until(gate.exists, f"{name} to record the final evaluation", timeout=60)
        pair.commands.pop(name)
        pair.kill_9_and_restart(name)
    f_summary, g_summary = pair.finish()
    for name in ("g", "f"):
        before, after = ((tmp_path / f"{name}.{start}.log").read_text() for start in (1, 2))
        assert "the kept model, after step" in before and "resumed run" in after
        assert "the kept model, after step" not in after, after        # not scored (g) nor sent (f) again
    for summary, stage in ((f_summary, "f"), (g_summary, "g")):
        assert summary["params"][stage] == reference["params"][stage]
        for key in ("test_loss", "test_accuracy", "test_f1", "test_count", "test_step", "best_step", "stopped_early",
                    "steps"):
            assert summary[key] == reference[key], key
    assert f_summary["privacy"]["f"] == reference["privacy"]["f"]
    assert f_summary["evaluations"] == reference["evaluations"]
    _assert_test_rows_released_once({**f_summary, "validation_count": reference["validation_count"]})


def _in_process_and_over_processes(tmp_path: Path, args: list) -> tuple[dict, dict]:
    """``distgrad run ARGS`` in one process, then as stage processes: the two summaries."""
    from conftest import run_launcher

    assert run_main([*args, "--in-process", "--summary", tmp_path / "ref.json"]).returncode == 0
    result = run_launcher([*args, "--summary", tmp_path / "run.json"])
    assert result.returncode == 0, result.stdout + result.stderr
    return read_json(tmp_path / "ref.json"), read_json(tmp_path / "run.json")


def test_vertical_parties_send_their_test_rows_once_bitwise_over_processes(tmp_path: Path, fixed_noise_secret):
    """Two feature parties (digits-halves), keep_best on the validation rows: over processes as in process, the
    evaluations during the run carry the validation rows' figures only, each party released the test rows once
    (left's clip_noise counts it), and the test figures are the kept model's, equal to the in-process run's."""
    from test_defenses import _defended

    path = _defended(tmp_path, "digits-halves", {0: F_CLIP, 2: 'keep_best = "test_accuracy"\nmetrics = ["f1"]'})
    path.write_text(path.read_text().replace("test_fraction = 0.2\n", "test_fraction = 0.2\nvalidation_fraction = 0.2\n")
                    .replace("lr = 0.003", "lr = 0.03"))       # the validation accuracy is best at step 100
    args = ["run", path, "--steps", "120", "--eval-every", "20"]
    ref, run = _in_process_and_over_processes(tmp_path, args)
    assert run["params"] == ref["params"]
    assert 0 < ref["test_step"] == ref["best_step"] < 120
    for key in ("test_loss", "test_accuracy", "test_f1", "test_count", "test_step", "evaluations", "privacy"):
        assert run[key] == ref[key], key
    assert all(not any(key.startswith("test_") for key in e) for e in ref["evaluations"])
    _assert_test_rows_released_once(ref, "left")


def test_each_clients_kept_model_test_figures_are_the_last_printed_lines(tmp_path: Path):
    """Several data owners with a validation split: the summary gives each client's test figures and step, and
    the printed output ends with one line per client saying them (in process; the lines come from the summary)."""
    builtin = Path(__file__).resolve().parent.parent / "distgrad" / "experiments" / "digits-clients.toml"
    path = tmp_path / "clients.toml"
    path.write_text(builtin.read_text().replace('"../datasets/digits.npz"', f'"{builtin.parent.parent}/datasets/'
                                                                           f'digits.npz"')
                    .replace("test_fraction = 0.2\n", "test_fraction = 0.2\nvalidation_fraction = 0.2\n"))
    result = run_main(["run", path, "--in-process", "--steps", "20", "--eval-every", "10", "--summary",
                       tmp_path / "s.json"])
    assert result.returncode == 0, result.stderr
    clients = read_json(tmp_path / "s.json")["clients"]
    last = result.stdout.strip().splitlines()[-len(clients):]
    for line, client in zip(last, clients):
        assert client["test_step"] == 20
        assert line == (f"kept model of client {client['client']}, after step 20 (chosen on "
                        f"{client['validation_count']} validation rows): test accuracy {client['test_accuracy']:.4f}, "
                        f"test loss {client['test_loss']:.6g} on {client['test_count']} test rows"), line


# Slow (five processes): by default, test_vertical_parties_send_their_test_rows_once_bitwise_over_processes covers
# several data owners' final evaluation, and the two-stage tests the one peer's (Turns.score) that a client's uses.
@pytest.mark.slow
def test_each_client_sends_its_test_rows_once_after_the_last_step_bitwise_over_processes(tmp_path: Path,
                                                                                         fixed_noise_secret):
    """SplitFed clients (several data owners, each its own held-out rows) with a validation split: each client's
    evaluations during the run score its validation rows, and after the last round its test rows cross once, scored
    with the final model; over processes as in process."""
    from test_defenses import _defended

    path = _defended(tmp_path, "digits-splitfed", {0: F_CLIP})
    path.write_text(path.read_text().replace("test_fraction = 0.2\n", "test_fraction = 0.2\nvalidation_fraction = 0.2\n"))
    args = ["run", path, "--steps", "20", "--eval-every", "10"]
    ref, run = _in_process_and_over_processes(tmp_path, args)
    assert run["params"] == ref["params"]
    assert run["clients"] == [{**entry, "run_id": client["run_id"]} for entry, client in zip(ref["clients"],
                                                                                            run["clients"])]
    for client in ref["clients"]:
        assert client["test_step"] == 20 and [e["step"] for e in client["evaluations"]] == [10, 20]
        assert all(not any(key.startswith("test_") for key in e) for e in client["evaluations"])
    assert run["privacy"] == ref["privacy"]
    _assert_test_rows_released_once({**ref, **ref["clients"][0]})


def test_a_middle_stage_passes_the_final_evaluation_on_with_its_kept_model(tmp_path: Path, fixed_noise_secret):
    """A chain f -> m -> g with keep_best and early stopping on the validation rows: m forwards the test rows with
    its own kept parameters and passes the final evaluation on to g; over processes as in process, f having
    released its test rows once."""
    path = _clipped(_digits(tmp_path, JUDGED, middle=True))
    path.write_text(path.read_text().replace(digits_data_table(), digits_data_table() + "validation_fraction = 0.2\n"))
    ref, run = _in_process_and_over_processes(tmp_path, ["run", path])
    assert run["params"] == ref["params"] and set(ref["params"]) == {"f", "m", "g"}
    assert 0 < ref["test_step"] == ref["best_step"] < ref["stopped_early"] < 200
    for key in ("test_loss", "test_accuracy", "test_f1", "test_count", "test_step", "evaluations", "privacy"):
        assert run[key] == ref[key], key
    _assert_test_rows_released_once(ref)


@pytest.mark.parametrize("end", ["first", "last"])
def test_the_cut_library_refuses_a_validation_split_with_the_reason(tmp_path: Path, end: str):
    """A loop of one's own decides when it evaluates and which parameters it keeps: the cut library refuses
    validation_fraction at once (either end), saying so, rather than accepting it and leaving it unused."""
    from distgrad.run.cut_interface import FIRST, LAST, cut_side

    def unscaled(path: Path) -> Path:       # a loop of one's own scales its own features: feature_scale is refused
        path.write_text(path.read_text().replace("feature_scale = 0.0625\n", ""))
        return path

    with pytest.raises(ConfigError, match="validation_fraction is the daemons' rule: .* the test rows cross once"):
        cut_side(FIRST if end == "first" else LAST, unscaled(_validated(tmp_path, "")), {})
    assert cut_side(FIRST if end == "first" else LAST, unscaled(_digits(tmp_path, "")), {}).data is not None


@pytest.mark.parametrize("judged", [JUDGED, 'keep_best = "test_loss"\n', 'metrics = ["f1"]\n',
                                    'early_stopping = { metric = "test_accuracy", patience = 2 }\n'])
def test_a_cut_server_refuses_the_label_owners_model_selection_it_cannot_apply(tmp_path: Path, judged: str):
    """A CutServer's loop scores the held-out rows itself (evaluate=) and keeps and stops as it decides: a combined
    experiment whose label owner sets keep_best, early_stopping or metrics (the daemon's rules) is refused with the
    reason, not accepted and left unused; a Cut (the data owner's end, whose daemon label owner applies them)
    takes it."""
    from distgrad.run.cut_interface import FIRST, LAST, cut_side

    path = _digits(tmp_path, judged)
    path.write_text(path.read_text().replace("feature_scale = 0.0625\n", ""))
    with pytest.raises(ConfigError, match="a CutServer's loop scores the held-out rows itself .* would do nothing"):
        cut_side(LAST, path, {})
    assert cut_side(FIRST, path, {}).data is not None


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_the_kept_model_stands_in_for_the_live_one_and_is_put_back(tmp_path: Path, framework: str):
    """``stage.kept_model``: inside it the stage computes with the kept parameters and forward state (a torch
    module's batch-norm statistics too), set through the stage (on a GPU too), and afterwards with its own."""
    from distgrad.stage.stage import kept_model

    x = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    if framework == "numpy":
        exp = load_experiment(_digits(tmp_path))

        def build() -> Stage:
            return Stage.from_experiment(exp, "f")
    else:
        torch = pytest.importorskip("torch")
        from distgrad.stage.torch_stage import TorchStage

        def build() -> Stage:
            torch.manual_seed(1)
            module = torch.nn.Sequential(torch.nn.Linear(64, 3), torch.nn.BatchNorm1d(3))
            return TorchStage.from_module("f", module, torch.optim.SGD(module.parameters(), lr=0.1), (6, 64))
    stage, kept_stage = build(), build()
    for _ in range(2):                  # the kept one trains on: other parameters (and batch-norm statistics)
        y, cache = kept_stage.forward(x * 3)
        for name, grad in kept_stage.backward(cache, np.ones_like(y))[1].items():
            kept_stage.params[name][...] -= np.float32(0.5) * grad
    kept = {"params": {n: v.copy() for n, v in kept_stage.params.items()}, "state": kept_stage.forward_state()}
    live = {n: v.copy() for n, v in stage.params.items()}
    before = stage.forward(x, training=False)[0]
    with kept_model(stage, kept):
        inside = stage.forward(x, training=False)[0]
    assert np.array_equal(inside, kept_stage.forward(x, training=False)[0])
    assert not np.array_equal(inside, before)
    assert all(np.array_equal(stage.params[n], v) for n, v in live.items())
    assert np.array_equal(stage.forward(x, training=False)[0], before)


def test_the_label_owner_scores_the_test_rows_once_after_the_last_step_only(tmp_path: Path):
    """The serving stage's rules for the final evaluation (``held_out`` "test"): an evaluation during the run
    carries and scores the validation rows; a final one before the last step, or of the validation rows' count,
    is refused and changes nothing; after the last step it scores the test rows, with no verdict, and the same
    request again gets the same reply; without a validation split a final evaluation is refused."""
    from handshake import hello_message, only_reply

    from distgrad.run.options import StageOptions
    from distgrad.run.serving import ServingStage
    from distgrad.wire import messages as wire
    from distgrad.wire.link import final_body
    from distgrad.wire.messages import Message

    path = _validated(tmp_path)
    path.write_text(path.read_text().replace("steps = 200", "steps = 2").replace("validation_fraction = 0.2",
                                                                                  "validation_fraction = 0.1"))
    exp = load_experiment(path)
    server = ServingStage(StageOptions(exp, "g", exp.seed))
    server.handle([b"f"], hello_message(exp, "r"), 0.0)
    f, data = Stage.from_experiment(exp, "f"), exp.build_data(stage="f")
    held_out = f.forward(data.test_features(), training=False)[0]
    validation, test = held_out[:data.validation_count], held_out[data.validation_count:]

    def evaluate(step: int, x: np.ndarray, final: bool) -> wire.Message:
        return Message(wire.EVALUATE, "r", step, body=final_body(final), tensors={"activation": x})

    for step in (1, 2):
        server.handle([b"f"], Message(wire.FORWARD, "r", step, tensors={"activation": f.forward(data.features(step))[0]}),
                      0.0)
        server.settle()
        if step == 1:
            reply = only_reply(server.handle([b"f"], evaluate(2, validation, False), 0.0))
            assert reply.body["held_out"] == "validation" and reply.body["count"] == data.validation_count
            with pytest.raises(ProtocolError, match="after the run's last step, 2; got one after step 1"):
                server.handle([b"f"], evaluate(2, test, True), 0.0)
    with pytest.raises(ProtocolError, match=rf"expected float32\({len(test)}, 32\), got float32\({len(validation)}, "):
        server.handle([b"f"], evaluate(3, validation, True), 0.0)      # the validation rows' count: not the test's
    assert server.state.final_test is None
    reply = only_reply(server.handle([b"f"], evaluate(3, test, True), 0.0))
    expected = Stage.from_experiment(exp, "g")          # the kept model: step 1's, the one evaluation judged
    expected.load_state_arrays({**server.stage.state_arrays(), **{f"param/{name}": value for name, value
                                                                   in server.state.best_copy["params"].items()}}, 1)
    scores = expected.evaluate_last(test, data.test_targets()[data.validation_count:])
    assert reply.body["held_out"] == "test" and "best" not in reply.body and "stop" not in reply.body
    assert (reply.body["loss"], reply.body["correct"], reply.body["count"]) == (
        scores["loss"], scores["correct"], len(test))
    assert server.state.final_test["step"] == server.state.verdicts.best_step == 1
    assert not np.array_equal(server.state.best_copy["params"]["g1.W"], server.stage.params["g1.W"])
    assert only_reply(server.handle([b"f"], evaluate(3, test, True), 0.0)) is reply

    plain = load_experiment(_digits(tmp_path))
    server = ServingStage(StageOptions(plain, "g", plain.seed))
    server.handle([b"f"], hello_message(plain, "r"), 0.0)
    with pytest.raises(ProtocolError, match="needs a validation split"):
        server.handle([b"f"], evaluate(1, f.forward(plain.build_data().test_features(), training=False)[0], True), 0.0)


def test_a_checkpoint_saved_after_the_evaluations_that_follow_its_step_counts_them_once():
    """The last evaluation and the final one (releases of step k + 1) made before the checkpoint of step k was
    saved: it counts them, names them (``HELD_OUT_AHEAD``), and a ledger restored from it with the file of
    releases, which holds them too, counts each once, and once more sent after the resume, still once."""
    from distgrad.privacy.releases import HELD_OUT, HELD_OUT_AHEAD, NoiseLedger

    written: list = []
    ledger = NoiseLedger(7, on_release=written.append)
    ledger.release_held_out(11, "evaluation", "ab" * 32, 72)       # the last evaluation, after step 10
    ledger.release_held_out(11, "test", "cd" * 32, 90)             # then the final one
    arrays = ledger.arrays(10)
    assert arrays[HELD_OUT].tolist() == [1, 72, 1, 90]
    restored = NoiseLedger(0)
    restored.restore(7, None, written, 10, arrays[HELD_OUT], arrays[HELD_OUT_AHEAD])
    assert restored.held_out == {"evaluation": 1, "test": 1} and restored.held_out_rows == {"evaluation": 72,
                                                                                           "test": 90}
    restored.release_held_out(11, "test", "cd" * 32, 90)           # sent again after the resume: the same
    assert restored.held_out == {"evaluation": 1, "test": 1}
    assert restored.arrays(10)[HELD_OUT_AHEAD].tobytes() == arrays[HELD_OUT_AHEAD].tobytes()
