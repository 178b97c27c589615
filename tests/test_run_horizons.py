"""Settings a run is too short to let act are said at WARNING before anything starts, on every path.

A learning-rate schedule or scheduler whose every change of rate lies at or past the run's last update, and a
``--checkpoint-every`` that saves nothing before the last step, are accepted (a short trial of a file made for a
longer run is ordinary use) and said, naming the setting, the value that would act and the run's steps; where
the setting acts, nothing is said. Unit tests: every path is reached in this process (``run_main``'s guard
fails a test that starts a process or opens a socket).
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path

from distgrad.config.experiment import BUILTIN_DIR, check_run_settings
from distgrad.config.parse import load_experiment
from distgrad.run.options import StageOptions

from conftest import run_main
from test_config_checks import _silent, _warned

PIECEWISE = {"type": "piecewise", "boundaries": [100, 200], "values": [0.1, 0.01, 0.001]}


def _with(exp, stage: str, **keys):
    """``exp`` with stage ``stage``'s spec given ``keys``."""
    return replace(exp, stages=[replace(s, **keys) if s.name == stage else s for s in exp.stages])


def _scheduled(exp, stage: str, schedule: dict):
    """``exp`` with ``schedule`` in stage ``stage``'s optimizer table."""
    spec = next(s for s in exp.stages if s.name == stage)
    return _with(exp, stage, optimizer={**spec.optimizer, "schedule": schedule})


def test_a_numpy_schedule_whose_steps_lie_past_the_last_update_is_said(caplog):
    """piecewise: boundary b is the last update at the first rate, so a run of b updates or fewer never changes
    it; exponential with staircase likewise at decay_steps, counted after a warm-up. A schedule that changes
    the rate at every update, or a boundary within the run, is silent."""
    digits = load_experiment("digits")
    piecewise = _scheduled(digits, "f", PIECEWISE)
    _warned(caplog, lambda: check_run_settings(piecewise, steps=100),
            r"stage 'f': optimizer schedule 'piecewise' \(boundaries = \[100, 200\]\) first changes the rate for "
            r"update 101 \(its first boundary, 100\), and the stage makes 100 updates in this run \(--steps 100\): "
            r"its rate never changes in this run", "run at least 101 steps")
    _silent(caplog, lambda: check_run_settings(piecewise, steps=101))
    _warned(caplog, lambda: check_run_settings(replace(piecewise, steps=40)), r"40 updates .*\(steps = 40\)")
    staircase = {"type": "exponential", "decay_rate": 0.5, "decay_steps": 50, "staircase": True, "warmup_steps": 10}
    stepped = _scheduled(digits, "g", staircase)
    _warned(caplog, lambda: check_run_settings(stepped, steps=60),
            r"stage 'g': optimizer schedule 'exponential' \(staircase, decay_steps = 50, warmup_steps = 10\) first "
            r"changes the rate for update 61 \(decay_steps = 50 after the warm-up of 10 updates\)",
            "60 updates", "never changes after the warm-up")
    _silent(caplog, lambda: check_run_settings(stepped, steps=61))
    _silent(caplog, lambda: check_run_settings(_scheduled(digits, "g", {**staircase, "staircase": False}),
                                               steps=5))
    _silent(caplog, lambda: check_run_settings(_scheduled(digits, "g", {"type": "cosine", "decay_steps": 900}),
                                               steps=5))


def test_a_serving_stage_of_several_clients_counts_an_update_per_client(caplog):
    """The last stage of [clients] updates once per client a step: 3 clients x 10 steps are 30 updates."""
    clients = load_experiment("digits-splitfed")
    assert clients.clients.count == 3
    _warned(caplog, lambda: check_run_settings(_scheduled(clients, "g", {**PIECEWISE, "boundaries": [30]}),
                                               steps=10),
            r"stage 'g'.*30 updates in this run \(3 clients a step, --steps 10\)", "run at least 11 steps")
    _silent(caplog, lambda: check_run_settings(_scheduled(clients, "g", {**PIECEWISE, "boundaries": [29],
                                                                         "values": [0.1, 0.01]}), steps=10))
    _warned(caplog, lambda: check_run_settings(_scheduled(clients, "f", {**PIECEWISE, "boundaries": [10],
                                                                         "values": [0.1, 0.01]}), steps=10),
            r"stage 'f'.*10 updates in this run \(--steps 10\)")


def test_a_torch_scheduler_or_schedule_whose_steps_lie_past_the_last_update_is_said(caplog):
    """torch steps a scheduler once after each update: StepLR first changes the rate for update step_size + 1,
    MultiStepLR for its first milestone + 1, ConstantLR for total_iters + 1 (back to lr); a torch stage's
    optimizer schedule is the numpy one's. ExponentialLR changes it at every update."""
    torch_exp = load_experiment("digits-cnn-torch")
    step = _with(torch_exp, "f", scheduler={"type": "StepLR", "step_size": 50, "gamma": 0.5})
    _warned(caplog, lambda: check_run_settings(step, steps=50),
            r"stage 'f': scheduler StepLR \(step_size = 50\) first changes the rate for update 51 \(step_size = 50\), "
            r"and the stage makes 50 updates in this run \(--steps 50\)", "step_size below 50")
    _silent(caplog, lambda: check_run_settings(step, steps=51))
    multi = _with(torch_exp, "f", scheduler={"type": "MultiStepLR", "milestones": [60, 20]})
    _warned(caplog, lambda: check_run_settings(multi, steps=20),
            r"scheduler MultiStepLR \(milestones = \[60, 20\]\) .*\(its first milestone, 20\)")
    _silent(caplog, lambda: check_run_settings(multi, steps=21))
    constant = _with(torch_exp, "f", scheduler={"type": "ConstantLR", "factor": 0.5})     # 5 updates at lr / 2
    _warned(caplog, lambda: check_run_settings(constant, steps=5),
            r"scheduler ConstantLR \(total_iters = 5, torch's default\) first changes the rate for update 6")
    _silent(caplog, lambda: check_run_settings(constant, steps=6))
    _silent(caplog, lambda: check_run_settings(_with(torch_exp, "f", scheduler={"type": "ExponentialLR",
                                                                                "gamma": 0.9}), steps=2))
    _warned(caplog, lambda: check_run_settings(_scheduled(torch_exp, "f", PIECEWISE), steps=100),
            r"stage 'f': optimizer schedule 'piecewise'")


def _piecewise_file(tmp_path: Path) -> Path:
    """tanh-regression with a piecewise schedule on g whose first boundary is update 100."""
    text = (BUILTIN_DIR / "tanh-regression.toml").read_text()
    old = 'loss = "mean_squared_error"'
    path = tmp_path / "piecewise.toml"
    path.write_text(text.replace('optimizer = { type = "adam", lr = 0.01 }\n' + old,
                                 'optimizer = { type = "adam", schedule = { type = "piecewise", boundaries = [100], '
                                 'values = [0.01, 0.001] } }\n' + old))
    assert "boundaries = [100]" in path.read_text()
    return path


def test_every_path_says_a_schedule_that_would_never_step(tmp_path, caplog):
    """``distgrad run`` and ``distgrad-stage`` with --steps (the steps known only there), and the Python API's
    options, say it before anything starts; a stage serving predictions (no training run) does not."""
    path = _piecewise_file(tmp_path)
    clash = ["--summary", tmp_path / "out.json", "--trace", tmp_path / "out.json"]    # exit 2 after the check
    for args in (["run", path], ["stage", "g", "--experiment", path, "--bind", "tcp://127.0.0.1:*"]):
        result = run_main([*args, "--steps", "100", *clash])
        assert result.returncode == 2, result.stdout + result.stderr
        assert "stage 'g': optimizer schedule 'piecewise'" in result.stderr, result.stderr
        assert "100 updates in this run (--steps 100)" in result.stderr
        result = run_main([*args, "--steps", "101", *clash])
        assert result.returncode == 2 and "piecewise" not in result.stderr, result.stderr
    exp = load_experiment(path)
    _warned(caplog, lambda: StageOptions(exp, "f", exp.seed, steps=100), r"stage 'g'.*its first boundary, 100")
    _silent(caplog, lambda: StageOptions(exp, "g", exp.seed, steps=100, trains=False))


def test_checkpoint_every_at_or_past_the_last_step_is_said_with_what_is_saved(tmp_path, caplog):
    """Every K-th step is saved; a stage saves step 0 and the last step anyway, so K at or above the run's
    steps adds none: a WARNING names --checkpoint-every, the steps, and the checkpoints the run writes."""
    exp = load_experiment("tanh-regression")
    ck = tmp_path / "ck"
    _warned(caplog, lambda: check_run_settings(exp, steps=30, checkpoint_dir=ck, checkpoint_every=30),
            r"--checkpoint-every 30 saves a checkpoint every 30 steps, and this run has 30 steps \(--steps 30\): "
            r"it saves none before the last one", "step 0 when the run begins, step 30 at its end")
    _warned(caplog, lambda: check_run_settings(exp, checkpoint_dir=ck, checkpoint_every=500),
            r"this run has 300 steps \(steps = 300\)")
    _silent(caplog, lambda: check_run_settings(exp, steps=30, checkpoint_dir=ck, checkpoint_every=29))
    _silent(caplog, lambda: check_run_settings(exp, steps=30, checkpoint_dir=ck, checkpoint_every=0))
    _warned(caplog, lambda: StageOptions(exp, "g", exp.seed, steps=20, checkpoint_dir=ck, checkpoint_every=25,
                                         resume=True), "--checkpoint-every 25")
    _warned(caplog, lambda: StageOptions(exp, "f", exp.seed, steps=20, checkpoint_dir=ck, checkpoint_every=20),
            "--checkpoint-every 20")
    result = run_main(["run", BUILTIN_DIR / "tanh-regression.toml", "--steps", "10", "--checkpoint-dir", ck,
                       "--checkpoint-every", "10", "--summary", tmp_path / "s.json", "--trace", tmp_path / "s.json"])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--checkpoint-every 10 saves a checkpoint every 10 steps, and this run has 10 steps" in result.stderr


def test_one_command_says_each_warning_once(tmp_path, caplog):
    """A command checks the same run in several places (``distgrad run --in-process``: its front end, then the
    in-process run): each warning is said once, and a later command says it again."""
    from distgrad.config.horizons import each_warning_once
    path = _piecewise_file(tmp_path)
    for _ in range(2):
        result = run_main(["run", path, "--steps", "3", "--in-process"])
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stderr.count("stage 'g': optimizer schedule 'piecewise'") == 1, result.stderr
    exp = load_experiment(path)
    caplog.clear()
    with each_warning_once():
        for steps in (3, 3, 4):
            check_run_settings(exp, steps=steps)
    said = [r.getMessage() for r in caplog.records if "piecewise" in r.getMessage()]
    assert len(said) == 2 and "3 updates" in said[0] and "4 updates" in said[1], said


def test_one_commands_filter_hides_no_warning_of_another_thread(tmp_path, caplog):
    """While one command says each warning once, a run checked by another thread of the same process (its own
    ``run_local``, a ``serve_stage``) says its warnings, though their text is the same; the command's own
    thread still says each once."""
    import threading
    from distgrad.config.horizons import each_warning_once
    exp = load_experiment(_piecewise_file(tmp_path))
    caplog.clear()
    with caplog.at_level("WARNING", logger="distgrad"), each_warning_once():
        check_run_settings(exp, steps=3)
        other = threading.Thread(target=lambda: check_run_settings(exp, steps=3))
        other.start()
        other.join(10)
        check_run_settings(exp, steps=3)
    said = [r for r in caplog.records if "piecewise" in r.getMessage()]
    assert len(said) == 2 and said[0].thread != said[1].thread, [(r.thread, r.getMessage()) for r in said]


def test_a_stage_that_runs_its_drivers_steps_says_the_horizons_at_its_hello(tmp_path, caplog):
    """A stage serving one data owner, started without --steps, runs the steps the driving stage's hello says
    (its file's are only the driver's default): it says nothing of them when it starts, and at a hello says
    what a run of that many steps would not let act, once a run. With --steps it says it when it starts."""
    import time
    from distgrad.run import handshake
    from distgrad.run.serving import ServingStage
    from distgrad.stage.stage import Stage
    exp = replace(load_experiment(_piecewise_file(tmp_path)), steps=50)       # g's first boundary: update 100
    options = dict(checkpoint_dir=tmp_path / "ck", checkpoint_every=60)
    _silent(caplog, lambda: StageOptions(exp, "g", exp.seed, **options))
    _warned(caplog, lambda: StageOptions(exp, "g", exp.seed, steps=50, **options), "50 updates in this run")
    g, shape = ServingStage(StageOptions(exp, "g", exp.seed, **options)), Stage.from_experiment(exp, "f").output_shape
    now = time.monotonic()

    def hello(run: str, steps: int) -> None:
        g.handle([b"f"], handshake.hello(exp, "f", exp.seed, shape, run, [0], steps, 1), now)

    _silent(caplog, lambda: hello("run-1", 200))           # the run's 200 steps let both act
    now += 1000.0                                           # run-1's driver is gone: another run may begin
    _warned(caplog, lambda: hello("run-2", 60),
            r"stage 'g': optimizer schedule 'piecewise'.*60 updates in this run \(the driving stage's hello\)")
    now += 1000.0
    _warned(caplog, lambda: hello("run-3", 60), r"--checkpoint-every 60 .* this run has 60 steps \(the driving")
    _silent(caplog, lambda: hello("run-3", 60))             # the same run again: said once


# --- what the driving stage's evaluations let act, said where the setting is ---------------------------------

def _kept_stage_files(tmp_path: Path, keys: str, eval_every: int = 0) -> tuple:
    """digits (its file's eval_every: ``eval_every``) split into stage files (each party its own file, as
    ``distgrad split`` writes them) with ``keys`` in the label owner g's [stage]: the experiments of f's file
    and of g's file."""
    from distgrad.config.split import split_experiment
    from test_config_checks import _guarded_variant
    path = _guarded_variant(tmp_path, "digits", "g", keys)
    path.write_text(path.read_text().replace("steps = 800\n", f"steps = 800\neval_every = {eval_every}\n", 1))
    f_path, g_path = split_experiment(load_experiment(path), tmp_path / "split")
    return load_experiment(f_path), load_experiment(g_path)


def _hello(caplog, serving, exp, run: str, now: float, **fields) -> list[str]:
    """``serving`` welcomes a hello of run ``run`` from exp's driving stage with body ``fields``; the WARNINGs
    of the configuration checks (``distgrad.config``) said meanwhile."""
    from distgrad.wire import messages as wire
    from handshake import hello_message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="distgrad"):
        replies = serving.handle([b"peer"], hello_message(exp, run, **fields), now)
    assert [m.type for _, m in replies] == [wire.WELCOME], replies
    return [r.getMessage() for r in caplog.records if r.name == "distgrad.config" and r.levelno == logging.WARNING]


def test_a_label_owner_says_at_the_hello_what_the_driving_stages_evaluations_cannot_let_act(tmp_path, caplog):
    """In a run of stage files the label owner's keep_best acts on the evaluations the data owner asks for
    (its eval_every and steps, sent in its hello), which its own file cannot tell at start: the serving stage
    says the WARNING of ``check_evaluation_horizon`` when the hello arrives, naming the driving stage's
    eval_every as the reason and where to change it; once a run (a hello again of the same run says nothing
    more), again for a new run; silent where it acts."""
    from distgrad.run.serving import ServingStage
    f_exp, g_exp = _kept_stage_files(tmp_path, 'keep_best = "test_loss"')
    assert not f_exp.has_stage("g") and not g_exp.has_stage("f")     # each party knows its own settings only
    _silent(caplog, lambda: StageOptions(f_exp, "f", f_exp.seed, steps=40, eval_every=40))
    _silent(caplog, lambda: StageOptions(g_exp, "g", g_exp.seed))    # its evaluations are not known yet
    serving = ServingStage(StageOptions(g_exp, "g", g_exp.seed))
    said = _hello(caplog, serving, g_exp, "a" * 32, 0.0, steps=40, eval_every=40)
    assert len(said) == 1 and re.search(
        r"stage 'g': keep_best = 'test_loss' .* with eval_every = 40 and 40 steps \(as the driving stage 'f' asked in "
        r"its hello\) the run evaluates only after its last step: it keeps the last model, as without it. Set "
        r"eval_every to K below 40 on the data owner's side \(the driving stage 'f': eval_every in its stage file, "
        r"or its --eval-every K\)", said[0]), said
    assert _hello(caplog, serving, g_exp, "a" * 32, 1.0, steps=40, eval_every=40) == []     # the same run again
    for run, now in (("b" * 32, 100.0), ("c" * 32, 200.0)):                       # each new run, told again
        said = _hello(caplog, serving, g_exp, run, now, steps=40)
        assert len(said) == 1 and "keep_best" in said[0] and "eval_every = 0 and 40 steps" in said[0], said
    said = _hello(caplog, serving, g_exp, "c" * 32, 201.0, steps=40, eval_every=20)   # the same run, other values
    assert len(said) == 0, said                                                      # ... under which it acts
    said = _hello(caplog, serving, g_exp, "c" * 32, 202.0, steps=20, eval_every=20)
    assert len(said) == 1 and "eval_every = 20 and 20 steps" in said[0], said


def test_a_middle_stage_passes_the_evaluations_on_and_feature_parties_are_told_once(caplog):
    """A middle stage's own ReduceLROnPlateau is said at the driving stage's hello as the label owner's keys
    are, and its hello to the stage below asks for the same evaluations (the label owner behind it judges
    them); the label owner of feature parties says it once for the run, naming every party."""
    import zmq
    from distgrad.run import handshake
    from distgrad.run.serving import ServingStage
    ushaped = load_experiment("digits-ushaped")
    middle = replace(_with(ushaped, "body", scheduler={"type": "ReduceLROnPlateau", "patience": 1}), eval_every=10)
    serving = ServingStage(StageOptions(middle, "body", middle.seed), connect="tcp://127.0.0.1:9",
                           ctx=zmq.Context.instance())      # its link below is never used: the hello is answered
    below: list = []
    serving.link.handshake = lambda hello, client=None: below.append(hello) or 0    # the stage below welcomes it
    try:
        said = _hello(caplog, serving, middle, "a" * 32, 0.0, steps=30, eval_every=10)
    finally:
        serving.link.close(0)
    assert len(said) == 1 and re.search(
        r"stage 'body': scheduler ReduceLROnPlateau \(patience = 1\) can lower its rate after its evaluation 3 .* "
        r"eval_every = 10 and 30 steps \(as the driving stage 'f' asked in its hello\) .*Give eval_every = K of at "
        r"most 9 on the data owner's side \(the driving stage 'f'", said[0]), said
    assert below[0].body.get("eval_every") == 10 and below[0].body["steps"] == 30

    halves = load_experiment("digits-halves")
    kept = replace(_with(halves, "g", keep_best="test_loss"), eval_every=0)
    serving = ServingStage(StageOptions(kept, "g", kept.seed, steps=50))   # the parties' steps, as each says
    said = []
    for index, party in enumerate(kept.data_owners):
        hello = handshake.hello(kept, party, kept.seed, kept.cuts[index], str(index) * 32, [0], 50, 1, eval_every=50)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="distgrad"):
            serving.handle([party.encode()], hello, 0.0)
        said += [r.getMessage() for r in caplog.records if r.name == "distgrad.config"]
    assert len(said) == 1 and "as the driving stages 'left', 'right' asked in their hellos" in said[0], said


def test_early_stopping_that_a_hello_without_evaluations_leaves_idle_is_said(tmp_path, caplog):
    """The label owner's file asks for evaluations (eval_every 10, which early_stopping needs to be taken), but
    the driving stage's hello asks for none during the run (its --eval-every 0): early_stopping cannot stop the
    run, which the label owner says at the hello; a hello with evaluations enough says nothing."""
    from distgrad.run.serving import ServingStage
    _, g_exp = _kept_stage_files(tmp_path, 'early_stopping = { metric = "test_loss", patience = 2 }', 10)
    serving = ServingStage(StageOptions(g_exp, "g", g_exp.seed))
    said = _hello(caplog, serving, g_exp, "a" * 32, 0.0, steps=40)
    assert len(said) == 1 and re.search(
        r"stage 'g': early_stopping \(patience = 2\) can stop the run after its evaluation 3 at the earliest, and "
        r"with eval_every = 0 and 40 steps \(as the driving stage 'f' asked in its hello\) the run evaluates 0 "
        r"time\(s\) before its last step: it will not in this run. Give eval_every = K of at most 13 on the data "
        r"owner's side", said[0]), said
    assert _hello(caplog, serving, g_exp, "b" * 32, 100.0, steps=40, eval_every=13) == []


def test_evaluations_asked_of_a_data_owner_whose_data_holds_out_no_rows_are_said(caplog):
    """eval_every > 0 with no held-out rows evaluates nothing, during the run or after it: the data owner's
    process and the in-process run say so at WARNING before the first step (naming --eval-every when the flag
    gave it); with held-out rows, or eval_every 0, nothing is said."""
    import zmq
    from distgrad.run.driver import _Driver
    from distgrad.run.inprocess import train_in_process
    from distgrad.run.options import StopFlag
    tanh = load_experiment("tanh-regression")
    assert not len(tanh.build_data(stage="f").test_rows)

    def driver(exp, **options) -> None:
        _Driver(StageOptions(exp, "f", exp.seed, **options), "tcp://127.0.0.1:9", StopFlag(),
                zmq.Context.instance()).link.close(0)

    _warned(caplog, lambda: driver(tanh, eval_every=5),
            r"stage 'f': --eval-every 5 asks for an evaluation of the held-out rows every 5 step\(s\), and its "
            r"\[data\] holds out none: nothing is evaluated, during the run or after its last step",
            r"test_fraction")
    _warned(caplog, lambda: driver(replace(tanh, eval_every=7)), r"stage 'f': eval_every = 7 asks")
    _warned(caplog, lambda: train_in_process(tanh, steps=2, eval_every=3), r"stage 'f': eval_every = 3 asks")
    _silent(caplog, lambda: driver(tanh))
    _silent(caplog, lambda: train_in_process(tanh, steps=2))
    digits = load_experiment("digits")
    _silent(caplog, lambda: driver(digits, eval_every=5, steps=40))
