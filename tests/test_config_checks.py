"""Configuration errors are exit 2 with the reason, before anything starts, on every path.

Paths: ``distgrad run``, ``distgrad run --in-process``, ``distgrad-stage``
for each stage, and the Python API. The command lines run in this process
(``conftest.run_main``), as unit tests: the guard fails any of them that
starts a process or opens a socket, so "before anything starts" is checked
outright. That the exit code and message reach a real process is checked in
test_cli.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import logging
import re

import pytest

from distgrad.run.options import StageOptions
from distgrad.errors import ConfigError
from distgrad.config.experiment import BUILTIN_DIR, check_run_settings
from distgrad.config.parse import load_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.run.launcher import run_local

from conftest import run_main

TANH = (BUILTIN_DIR / "tanh-regression.toml").read_text()


def _variant(tmp_path: Path, old: str, new: str, name: str = "variant.toml") -> Path:
    assert old in TANH
    path = tmp_path / name
    path.write_text(TANH.replace(old, new))
    return path


def _paths(experiment: Path | str) -> list[list]:
    """The command lines of every path: run, run --in-process, and each stage by hand."""
    return [["run", experiment], ["run", experiment, "--in-process"],
            ["stage", "g", "--experiment", experiment, "--bind", "tcp://127.0.0.1:*"],
            ["stage", "f", "--experiment", experiment, "--connect", "tcp://127.0.0.1:9"]]


def _assert_usage_error(args: list, *needles: str) -> None:
    result = run_main([*args, "--peer-deadline", "1"])
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out
    assert "[g]" not in out and "[f]" not in out, f"a stage was started:\n{out}"
    for needle in needles:
        assert needle in out, out


# -- point 2: targets against the last stage's output

@pytest.mark.parametrize("old,new,output,targets", [
    ("in = 16, out = 1 }", "in = 16, out = 2 }", "(32, 2)", "(32, 1)"),      # broadcast silently before
    ("outputs = 1", "outputs = 2", "(32, 1)", "(32, 2)"),                    # numpy error at step 1 before
])
def test_targets_that_do_not_fit_the_last_output_exit_2_naming_both_shapes(tmp_path, old, new, output, targets):
    experiment = _variant(tmp_path, old, new)
    for args in _paths(experiment):
        _assert_usage_error(args, output, targets)
    with pytest.raises(ConfigError, match=r"outputs shape .* targets of shape"):
        load_experiment(experiment)


# -- point 8: tracebacks and late failures

@pytest.mark.parametrize("args", [["run", "tanh-regression", "--steps", "0", "--in-process"],
                                  ["run", "tanh-regression", "--steps", "0"],
                                  ["run", "seed-simple", "--steps", "0"],
                                  ["run", "tanh-regression", "--seed", "-1"]])
def test_bad_steps_or_seed_exit_2_with_the_reason_before_any_stage_starts(args):
    _assert_usage_error(args, "--steps" if "--steps" in args else "--seed")


def test_micro_batches_that_do_not_divide_the_batch_exit_2_before_g_starts():
    _assert_usage_error(["run", "mlp-classify", "--micro-batches", "5"], "do not split into 5")


def test_float_labels_with_softmax_cross_entropy_exit_2(tmp_path):
    (tmp_path / "d.csv").write_text("".join(f"{i % 3},{i * 0.1},{i % 2}\n" for i in range(40)))
    path = tmp_path / "float-labels.toml"
    path.write_text('''name = "float-labels"
[data]
kind = "csv"
path = "d.csv"
features = [0, 1]
labels = 2
label_dtype = "float32"
batch = 4
[[stages]]
name = "f"
model = [{ type = "dense", name = "f1", in = 2, out = 4 }]
[[stages]]
name = "g"
model = [{ type = "dense", name = "g1", in = 4, out = 2 }]
loss = "softmax_cross_entropy"
''')
    for args in _paths(path):
        _assert_usage_error(args, "softmax_cross_entropy needs int64 targets", "float32", "label_dtype")


def test_python_api_checks_the_run_settings_before_starting():
    exp = load_experiment("tanh-regression")
    for call in (lambda: train_in_process(exp, steps=0), lambda: run_local("tanh-regression", steps=0),
                 lambda: StageOptions(exp, "f", exp.seed, steps=0),
                 lambda: train_in_process(load_experiment("mlp-classify"), micro_batches=5),
                 lambda: StageOptions(exp, "f", exp.seed, checkpoint_every=10)):
        with pytest.raises(ConfigError):
            call()


# -- point 11: ignored flags, strings for numbers, unknown keys

def test_checkpoint_every_without_a_directory_exits_2_on_every_path():
    for args in _paths("tanh-regression"):
        _assert_usage_error([*args, "--checkpoint-every", "10"], "--checkpoint-every needs --checkpoint-dir")


@pytest.mark.parametrize("flag", ["--summary", "--trace", "--metrics"])
def test_an_output_file_that_cannot_be_written_exits_2_on_every_path_before_anything_runs(tmp_path, flag):
    """A directory given as the file, or a path under a file: refused naming the flag before any stage starts
    (it was a traceback after the whole run had trained, its output lost)."""
    (tmp_path / "a-file").write_text("")
    for target, needle in ((tmp_path, f"{flag} {tmp_path} is a folder; name a file"),
                           (tmp_path / "a-file" / "out.json", f"{tmp_path / 'a-file'} is a file, not a folder")):
        for args in _paths("tanh-regression"):
            if flag == "--metrics" and args[-1] == "--in-process":
                continue            # --in-process refuses --metrics whatever the path (writes none)
            _assert_usage_error([*args, flag, target], needle)


def test_in_process_refuses_checkpoint_flags_it_would_ignore(tmp_path):
    """Documented: --in-process keeps no checkpoints, so it refuses the flags rather than ignore them."""
    _assert_usage_error(["run", "tanh-regression", "--in-process", "--checkpoint-dir", tmp_path,
                         "--checkpoint-every", "10"], "--in-process keeps no checkpoints")


@pytest.mark.parametrize("old,new,needles", [
    ("lr = 0.01 }", 'lr = "0.01" }', ["'0.01' is not a number"]),
    ("lr = 0.01 }", "lr = true }", ["True is not a number"]),
    ("lr = 0.01 }", "learning_rate = 0.01 }", ["'learning_rate'", "valid options: type, lr, beta1, beta2, epsilon"]),
    ('type = "adam", lr = 0.01 }', 'type = "sgd", lr = 0.01, beta1 = 0.9 }', ["'beta1'", "valid options: type, lr"]),
    ('in = 4, out = 32 }', 'in = 4, out = 32, activation = "tanh" }', ["'activation'", "valid keys: type, name, in, out"]),
    ('{ type = "tanh" },', '{ type = "tanh", slope = 1 },', ["'slope'", "valid keys: type"]),
    ("noise = 0.01", 'noise = "0.01"', ["'noise' must be a real number"]),
    ("batch = 32", "batch = true", ["'batch' must be a whole number"]),
    ("batch = 32", "batch = 32\nbatch_size = 32", ["'batch_size'", "valid options: kind, seed, samples"]),
    ('loss = "mean_squared_error"', 'loss = { type = "mean_squared_error", reduction = "sum" }', ["only 'type'"]),
    ("steps = 300", "steps = true", ["'steps' must be a positive integer"]),
    ("seed = 0", 'seed = "0"', ["'seed' must be a non-negative integer"]),
    ("seed = 0", "seed = 0\nallow_nonfinite = \"false\"", ["'allow_nonfinite' must be true or false"]),
    ("seed = 0", "seed = 0\nlearning_rate = 0.1", ["'learning_rate'", "allowed:"]),
    ("seed = 0", "seed = 0\nmicro_batches = false", ["'micro_batches' must be a positive integer, got False"]),
    ("seed = 0", "seed = 0\neval_every = true", ["'eval_every' must be a non-negative integer, got True"]),
    ("seed = 0", "seed = 0\nstaleness = \"auto\"", ["'staleness' must be a non-negative integer, got 'auto'",
                                                   "--staleness auto"]),
    ("seed = 0", 'seed = 0\nreduction = "max"', ["'reduction' must be one of ['mean', 'sum'], got 'max'"]),
    ('name = "g"', 'name = "g"\nprivacy_meter = 1', ["stage 'g': 'privacy_meter' must be true or false, got 1"]),
    ('name = "g"', 'name = "g"\ndevice = "gpu"', ["'device' must be \"cpu\", \"cuda\" or \"cuda:N\", got 'gpu'"]),
    ('name = "g"', 'name = "g"\nlr = 0.1', ["'lr'", "allowed:"]),
    ('in = 4, out = 32 }', 'in = 4, out = 32, init = nan }', ["not a finite float32 number"]),
    ('in = 4, out = 32 }', 'in = 4, out = 32, init = inf }', ["not a finite float32 number"]),
])
def test_experiment_values_are_type_checked_and_unknown_keys_list_the_valid_ones(tmp_path, old, new, needles):
    experiment = _variant(tmp_path, old, new)
    with pytest.raises(ConfigError) as error:
        load_experiment(experiment)
    for needle in needles:
        assert needle in str(error.value)


@pytest.mark.parametrize("old,new,needle", [
    ("lr = 0.01 }", 'lr = "0.01" }', "is not a number"),
    ("lr = 0.01 }", "learning_rate = 0.01 }", "valid options"),
])
def test_bad_optimizer_options_exit_2_on_every_path(tmp_path, old, new, needle):
    for args in _paths(_variant(tmp_path, old, new)):
        _assert_usage_error(args, needle)


def test_every_builtin_still_loads():
    for path in BUILTIN_DIR.glob("*.toml"):
        assert load_experiment(path).name


@pytest.mark.parametrize("text", ["a = " + "[" * 500 + "]" * 500, "a = " + "[" * 100_000,
                                  "a = " + "{ b = " * 600 + "1" + " }" * 600,
                                  "a = " + "[" * 33 + "]" * 33])
def test_a_toml_file_nested_too_deeply_is_refused_with_exit_2(tmp_path: Path, text: str):
    """Arrays or tables nested deeper than tomlfile.MAX_DEPTH (32) levels are a configuration
    error, exit 2 naming the file, never a RecursionError traceback."""
    path = tmp_path / "deep.toml"
    path.write_text(text + "\n")
    for command in (["run", path], ["split", path, tmp_path / "parties"], ["stage", "f", "--experiment", path, "--bind", "tcp://127.0.0.1:*"]):
        result = run_main(command)
        assert result.returncode == 2, (command, result.stderr)
        assert f"cannot read experiment {path}" in result.stderr and "nest deeper than 32" in result.stderr
        assert "Traceback" not in result.stderr


def test_toml_nested_to_the_bound_is_read():
    from distgrad.config.tomlfile import nesting_depth, tomllib
    assert nesting_depth(tomllib.loads("a = " + "[" * 32 + "]" * 32)) == 33       # the document is a table
    assert nesting_depth({"a": 1, "b": [1, {"c": []}]}) == 4 and nesting_depth(1.5) == 0


# -- a setting accepted and doing nothing: an input_guard that would judge no step

def _guarded_variant(tmp_path: Path, builtin: str, stage: str, guard: str, name: str = "guarded.toml") -> Path:
    """Built-in ``builtin`` with ``guard`` in stage ``stage``'s table, its data path made absolute."""
    text = (BUILTIN_DIR / f"{builtin}.toml").read_text().replace('"../datasets/',
                                                                 f'"{BUILTIN_DIR.parent / "datasets"}/')
    assert f'name = "{stage}"\n' in text
    path = tmp_path / name
    path.write_text(text.replace(f'name = "{stage}"\n', f'name = "{stage}"\n{guard}\n', 1))
    return path


def _warned(caplog, check, *needles: str) -> None:
    """``check()`` passes, logging one WARNING of distgrad's that holds every needle."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="distgrad"):
        check()
    texts = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(all(re.search(n, text) for n in needles) for text in texts), texts


def _silent(caplog, check) -> None:
    """``check()`` passes and warns of nothing."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="distgrad"):
        check()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_an_input_guard_whose_after_reaches_the_last_step_is_said_on_every_path(tmp_path, caplog):
    """'after' (the steps the guard does not judge) at or past the run's last step, given or by default (50),
    in the file's steps or --steps: a WARNING names the key, its value and the steps before anything starts
    (a short trial of a file made for a longer run is ordinary use, so it is not refused)."""
    explicit = _guarded_variant(tmp_path, "digits", "f", "input_guard = { max_r2 = 0.75, after = 30 }")
    exp = load_experiment(explicit)
    _warned(caplog, lambda: check_run_settings(exp, steps=30), r"'input_guard' \{ max_r2 = 0.75, after = 30 \}",
            "judges only the steps after step 30", r"this run has 30 steps \(--steps 30\)", "judge none")
    by_default = load_experiment(_guarded_variant(tmp_path, "digits", "f", "input_guard = { max_r2 = 0.75 }",
                                                  "default.toml"))
    _warned(caplog, lambda: check_run_settings(by_default, steps=50), r"after = 50 \} \(50 when not given\)",
            "this run has 50 steps")
    _silent(caplog, lambda: check_run_settings(by_default, steps=51))             # step 51 is judged
    _warned(caplog, lambda: check_run_settings(replace(by_default, steps=40)),     # the file's steps
            r"after = 50 .*this run has 40 steps \(steps = 40\)")
    _warned(caplog, lambda: check_run_settings(replace(by_default, steps=20, epochs=2)),
            r"this run has 20 steps \(epochs = 2 of 10 steps\)")
    _warned(caplog, lambda: StageOptions(by_default, "f", by_default.seed, steps=50,      # a resumed run: the same
                                         checkpoint_dir=tmp_path / "ck", resume=True), "after = 50")
    _silent(caplog, lambda: StageOptions(replace(by_default, steps=40), "f", by_default.seed, trains=False))
    result = run_main(["run", explicit, "--steps", "30", "--in-process", "--seed", "0"])   # said, then it runs
    assert result.returncode == 0, result.stdout + result.stderr
    assert "judges only the steps after step 30" in result.stderr


def test_an_input_guard_that_can_never_hold_the_rows_it_scores_is_said(caplog):
    """The guard scores once it holds rows_needed rows; a run that sends fewer in all (steps x batch) never
    judges: a WARNING says how many steps it takes. Each data owner counts its own: a feature party of a
    vertical experiment, each client (its batch a step)."""
    from distgrad.privacy.guard import rows_needed
    digits = load_experiment("digits")
    f, g = digits.stages
    guarded = replace(digits, stages=[replace(f, input_guard=(0.75, 0)), g])
    assert rows_needed(64) == 260                                       # digits: 64 values a row, 32 rows a step
    _silent(caplog, lambda: check_run_settings(guarded, steps=9))       # 288 rows by step 9
    _warned(caplog, lambda: check_run_settings(guarded, steps=8),
            r"holds 260 of them .* sends 256 \(8 steps of 32 rows, --steps 8\).*Run at least 9 steps")
    vertical = load_experiment("vertical-classify")
    a, *others = vertical.stages
    party = replace(vertical, stages=[a, replace(others[0], input_guard=(0.5, 0)), *others[1:]])
    _silent(caplog, lambda: check_run_settings(party, steps=4))        # 8 values a row: 128 rows
    _warned(caplog, lambda: check_run_settings(party, steps=3),
            r"stage 'b': 'input_guard' .* sends 96 \(3 steps of 32 rows")
    clients = load_experiment("digits-splitfed")
    cf, cg = clients.stages
    _warned(caplog, lambda: check_run_settings(replace(clients, stages=[replace(cf, input_guard=(0.5, 40)), cg]),
                                               steps=40), r"stage 'f': 'input_guard' .*after = 40 .* 40 steps")


def test_splitfed_that_would_average_no_step_is_said_and_one_client_is_refused(tmp_path, caplog):
    """SplitFed averages after every average_every-th step: a run of fewer steps (the file's, --steps, epochs)
    averages none and its clients train apart, which a WARNING says naming average_every and the steps; one
    client has nothing to average with, which is refused."""
    splitfed = load_experiment("digits-splitfed")                      # average_every = 10
    _silent(caplog, lambda: check_run_settings(splitfed, steps=10))    # averaged once, after the last step
    _warned(caplog, lambda: check_run_settings(splitfed, steps=9),
            r"average_every = 10\), and this run has 9 steps \(--steps 9\): it will average none")
    _warned(caplog, lambda: check_run_settings(replace(splitfed, steps=6)), r"this run has 6 steps \(steps = 6\)")
    _warned(caplog, lambda: StageOptions(splitfed, "f", splitfed.seed, steps=5, client=0), "average_every = 10")
    text = (BUILTIN_DIR / "digits-splitfed.toml").read_text().replace("count = 3", "count = 1")
    (tmp_path / "one.toml").write_text(text)
    with pytest.raises(ConfigError, match=r"mode = 'splitfed' averages the first stages of several clients, and "
                                          r"count is 1"):
        load_experiment(tmp_path / "one.toml")


def test_csv_options_on_npz_or_npy_data_and_a_path_for_npy_are_refused(tmp_path):
    """header = true names a csv file's columns and npy data names its files by features and labels: given
    where they do nothing, they are refused saying so, rather than read and ignored."""
    import numpy as np
    from distgrad.config.data import build_data
    x, y = np.zeros((20, 3), np.float32), np.arange(20) % 2
    np.savez(tmp_path / "d.npz", x=x, y=y)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    npz = {"kind": "npz", "path": "d.npz", "features": "x", "labels": "y", "batch": 4}
    npy = {"kind": "npy", "features": "x.npy", "labels": "y.npy", "batch": 4}
    for table in (npz, npy):
        assert build_data({**table, "header": False}, 0, tmp_path).rows == 20       # the default, said
        with pytest.raises(ConfigError, match=f"header = true .*; {table['kind']} data has no lines"):
            build_data({**table, "header": True}, 0, tmp_path)
    with pytest.raises(ConfigError, match="npy data reads one .npy file .* so 'path' would do nothing"):
        build_data({**npy, "path": "d.npz"}, 0, tmp_path)


def test_verdicts_and_a_plateau_scheduler_that_could_not_act_before_the_last_step_are_said(tmp_path, caplog):
    """The last step is evaluated anyway and ends the run: keep_best needs an evaluation before it, early
    stopping patience + 1 of them (the first sets the best), ReduceLROnPlateau patience + 2. A shorter run
    gets a WARNING naming the setting, eval_every and the steps, and runs. A stage that follows the hello leaves it to the driving stage, which knows
    the run's eval_every."""
    digits = load_experiment("digits")
    f, g = digits.stages

    def last(**keys):
        return replace(digits, stages=[f, replace(g, **keys)])

    kept = last(keep_best="test_loss")
    _silent(caplog, lambda: check_run_settings(kept, steps=40, eval_every=39))
    _warned(caplog, lambda: check_run_settings(kept, steps=40, eval_every=40),
            r"keep_best = 'test_loss' .* eval_every = 40 and 40 steps \(--steps 40\) the run evaluates only after "
            r"its last step")
    _warned(caplog, lambda: check_run_settings(kept),                  # digits: eval_every 0
            r"keep_best .* eval_every = 0 and 800 steps \(steps = 800\)")
    stopping = last(early_stopping={"metric": "test_loss", "patience": 3})
    _silent(caplog, lambda: check_run_settings(stopping, steps=41, eval_every=10))    # evaluation 4 at step 40
    _warned(caplog, lambda: check_run_settings(stopping, steps=40, eval_every=10),
            r"early_stopping \(patience = 3\) can stop the run after its evaluation 4 at the earliest, .* "
            r"evaluates 3 time\(s\) before its last step")
    plateau = last(scheduler={"type": "ReduceLROnPlateau", "patience": 1})
    _silent(caplog, lambda: check_run_settings(plateau, steps=31, eval_every=10))
    _warned(caplog, lambda: check_run_settings(plateau, steps=30, eval_every=10),
            r"ReduceLROnPlateau \(patience = 1\) can lower its rate after its evaluation 3 .*eval_every = K of at "
            r"most 9")
    _warned(caplog, lambda: check_run_settings(last(scheduler={"type": "ReduceLROnPlateau"}), steps=100,
                                               eval_every=10), r"ReduceLROnPlateau \(patience = 10\)")   # torch's
    _silent(caplog, lambda: StageOptions(kept, "g", kept.seed, steps=40))   # the hello says eval_every
    _warned(caplog, lambda: StageOptions(kept, "f", kept.seed, steps=40, eval_every=40), "keep_best")
    result = run_main(["run", _guarded_variant(tmp_path, "digits", "g", 'keep_best = "test_loss"'), "--steps", "20",
                       "--eval-every", "0", "--in-process"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "keep_best = 'test_loss'" in result.stderr and "eval_every = 0 and 20 steps" in result.stderr
