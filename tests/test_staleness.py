"""Asynchronous pipelining by name (``staleness = S``): S steps of the first stage in flight.

The forward of step t uses the first stage's parameters after its update of
step t-1-S; its update of step t is applied once the forward of step t+S has
been sent; its backward of step t uses the activations and parameters of step
t's forward; the stages below are never stale. Runs over the wire equal the
in-process reference bit for bit, through kill -9 and restart of either stage.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

from conftest import StageGroup, read_json, read_lines, run_launcher, run_main
from distgrad.errors import ConfigError
from distgrad.config.experiment import BUILTIN_DIR, check_staleness
from distgrad.config.parse import load_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.stage.records import to_lists
from distgrad.stage.stage import Stage


def _reference(tmp_path: Path, experiment: str, *flags: str) -> dict:
    path = tmp_path / "reference.json"
    result = run_main(["run", experiment, "--in-process", "--summary", path, "--trace", tmp_path / "ref.jsonl",
                       *flags])
    assert result.returncode == 0, result.stderr
    return read_json(path)


def test_staleness_zero_is_lockstep_and_more_changes_the_trajectory():
    exp = load_experiment("tanh-regression")
    lockstep = train_in_process(exp, steps=30)
    assert train_in_process(exp, steps=30, staleness=0)["params"] == lockstep["params"]
    one, two = (train_in_process(exp, steps=30, staleness=s)["params"] for s in (1, 2))
    assert one != lockstep["params"] and two != one


def test_a_first_stage_stale_for_the_whole_run_feeds_its_initial_activations():
    """With S >= steps every forward uses the initial parameters, so g trains exactly as it would against a
    first stage that never learns (an independent run with f's learning rate 0)."""
    exp, steps = load_experiment("tanh-regression"), 20
    stale = train_in_process(exp, steps=steps, staleness=steps)
    f, g = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    features, targets = exp.build_data(stage="f"), exp.build_data(stage="g")
    for step in range(1, steps + 1):          # g alone learns, from the initial f's activations
        y, _ = f.forward(features.features(step))
        _, _, grads = g.loss_micro_batch(y, targets.targets(step))
        g.apply(grads)
    assert stale["params"]["g"] == to_lists(g.params)
    assert stale["params"]["f"] != to_lists(f.params)        # f did learn: its updates came after the forwards


@pytest.mark.parametrize("experiment,flags", [
    ("tanh-regression", ["--staleness", "1", "--micro-batches", "2", "--steps", "40"]),
    pytest.param("tanh-regression", ["--staleness", "1", "--steps", "40"],               # one micro-batch: the
                 marks=pytest.mark.slow),                                                # others cover its path
    ("tanh-regression", ["--staleness", "2", "--micro-batches", "4", "--steps", "40"]),   # no codec
    ("chain-regression", ["--staleness", "2", "--micro-batches", "2", "--steps", "30", "--transport", "ipc",
                          "--activation-codec", "int8", "--gradient-codec", "float16"]),
    ("digits", ["--staleness", "2", "--steps", "60", "--eval-every", "25", "--activation-codec", "bfloat16",
                "--gradient-codec", "topk:4"]),
])
def test_stale_runs_equal_the_in_process_reference(tmp_path, experiment, flags):
    path, trace = tmp_path / "run.json", tmp_path / "run.jsonl"
    result = run_launcher(["run", experiment, "--summary", path, "--trace", trace, *flags])
    assert result.returncode == 0, result.stdout + result.stderr
    in_process = [f for f in flags if f not in ("--transport", "ipc")]
    summary, reference = read_json(path), _reference(tmp_path, experiment, *in_process)
    assert summary["params"] == reference["params"]
    assert summary["final_loss"] == reference["final_loss"]
    assert summary.get("evaluations") == reference.get("evaluations")
    assert read_lines(trace) == read_lines(tmp_path / "ref.jsonl")     # each stage's parameters after its step
    # With steps in flight every micro-batch of a step leaves at once: the summary says so, not 1f1b's window.
    micro_batches = int(flags[flags.index("--micro-batches") + 1]) if "--micro-batches" in flags else 1
    assert summary["in_flight"] == micro_batches and summary["staleness"] == int(flags[1])


class StalePair(StageGroup):
    def __init__(self, tmp_path: Path, steps: int, endpoint: str) -> None:
        super().__init__(tmp_path)
        common = ["--experiment", "tanh-regression", "--steps", str(steps), "--checkpoint-dir", tmp_path / "ckpt",
                  "--checkpoint-every", "7", "--resume", "--timeout", "0.5", "--peer-deadline", "30",
                  "--activation-codec", "float16", "--gradient-codec", "topk:8"]
        self.args = {"g": ["g", "--bind", endpoint, "--summary", tmp_path / "g.json", *common],
                     "f": ["f", "--connect", endpoint, "--summary", tmp_path / "f.json", "--trace",
                           tmp_path / "f.jsonl", "--trace-params", "f1.b", "--staleness", "1", "--micro-batches",
                           "2", *common]}


def _kill_9_f_and_resume_it_once_with_another_staleness(pair: StalePair) -> None:
    """kill -9 of f, resumed first with staleness 2 from its checkpoints of staleness 1: exit 2 naming both
    (their steps in flight are those of S = 1; a larger S once failed mid-run wanting parameter versions never
    kept, a smaller one went on as no run's computation); then with its own command line."""
    original = pair.args["f"]
    at = original.index("--staleness") + 1
    pair.args["f"] = [*original[:at], "2", *original[at + 1:]]
    pair.kill_9_and_restart("f")
    assert pair.procs["f"].wait(30) == 2, pair.logs()
    assert "was written with staleness 1, and this run asks for 2" in pair.procs["f"].output
    pair.args["f"] = original
    pair.start("f")


def test_kill_9_of_either_stage_with_steps_in_flight_changes_nothing(tmp_path, stage_group):
    """kill -9 of f, then of g, mid-run with a step in flight and both directions coded; each restarted with
    its command line: both stages' parameters and the trace (no step lost or doubled) equal the
    uninterrupted in-process run."""
    steps = 600          # the second kill leaves 350 steps (about a second at 400 steps/s) before the run ends
    pair = stage_group(StalePair, tmp_path, steps, f"ipc://{tmp_path}/g.sock")
    pair.start("g")
    pair.start("f")
    for victim, at in (("f", 100), ("g", 250)):
        pair.wait_until(lambda: pair.lines("f.jsonl") >= at, f"f to reach step {at}")
        if victim == "f":
            _kill_9_f_and_resume_it_once_with_another_staleness(pair)
        else:
            pair.kill_9_and_restart(victim)
    pair.wait_all()
    reference = _reference(tmp_path, "tanh-regression", "--steps", str(steps), "--staleness", "1",
                           "--micro-batches", "2", "--activation-codec", "float16", "--gradient-codec",
                           "topk:8")["params"]
    assert read_json(tmp_path / "f.json")["params"]["f"] == reference["f"]
    assert read_json(tmp_path / "g.json")["params"]["g"] == reference["g"]
    assert [line["step"] for line in read_lines(tmp_path / "f.jsonl")] == list(range(1, steps + 1))


def test_where_staleness_is_not_supported_it_is_refused():
    with pytest.raises(ConfigError, match="two stages and chains"):
        check_staleness(load_experiment("digits-clients"), 1)
    with pytest.raises(ConfigError, match="two stages and chains"):
        check_staleness(load_experiment("digits-halves"), 1)
    with pytest.raises(ConfigError, match="from 0 to 64"):
        check_staleness(load_experiment("digits"), -1)
    result = run_main(["run", "digits", "--in-process", "--staleness", "1", "--gradient-codec", "topk:4+ef"])
    assert result.returncode == 2 and "error feedback" in result.stderr
    result = run_main(["run", "digits-clients", "--in-process", "--staleness", "1"])
    assert result.returncode == 2 and "two stages and chains" in result.stderr
    result = run_main(["stage", "g", "--experiment", "digits", "--bind", "tcp://127.0.0.1:*", "--staleness", "1"])
    assert result.returncode == 2 and "driving stage" in result.stderr


ONE_STAGE = """
name = "one"
steps = 4
[data]
kind = "synthetic_regression"
samples = 64
features = 4
outputs = 1
hidden = 8
batch = 16
[[stages]]
name = "g"
model = [{ type = "dense", name = "g1", in = 4, out = 1 }]
loss = "sum_squared_error"
"""


def test_staleness_of_a_one_stage_experiment_is_refused_with_the_reason(tmp_path):
    """One stage has no stage below to keep steps in flight for: the flag and the file's key are refused
    (exit 2, the reason), in one process as through the launcher, instead of failing mid-run."""
    experiment = tmp_path / "one.toml"
    experiment.write_text(ONE_STAGE)
    for flags in (["--in-process", "--staleness", "1"], ["--staleness", "2"], ["--staleness", "auto"]):
        result = run_main(["run", experiment, *flags])
        assert result.returncode == 2 and "has one stage" in result.stderr, (flags, result.stderr)
    keyed = tmp_path / "one-stale.toml"
    keyed.write_text(ONE_STAGE.replace("steps = 4\n", "steps = 4\nstaleness = 1\n"))
    result = run_main(["run", keyed, "--in-process"])
    assert result.returncode == 2 and "staleness 1" in result.stderr and "has one stage" in result.stderr
    assert run_main(["run", experiment, "--in-process", "--staleness", "0"]).returncode == 0


def test_a_first_stage_on_a_gpu_is_refused_before_any_cuda_is_touched(tmp_path, monkeypatch):
    """Staleness keeps the first stage's earlier parameters in host memory: a first stage with
    ``device = "cuda"`` is refused with that reason, as a flag and as the experiment's key, in one
    process and through the launcher (exit 2, no stage started), with no GPU and without asking
    torch about CUDA."""
    torch = importlib.import_module("torch") if importlib.util.find_spec("torch") is not None else None
    if torch is not None:
        def touched(*args: object) -> None:
            raise AssertionError("CUDA was asked about before the staleness setting was refused")
        for name in ("is_available", "device_count", "init"):
            monkeypatch.setattr(torch.cuda, name, touched)
    text = (BUILTIN_DIR / "tanh-regression.toml").read_text()
    text = text.replace('name = "f"\n', 'name = "f"\nframework = "torch"\ndevice = "cuda"\n')
    assert 'device = "cuda"' in text
    path = tmp_path / "gpu-first.toml"
    path.write_text(text)
    reason = ("the first stage 'f' computes on cuda; asynchronous pipelining keeps its earlier parameters in host "
              "memory")
    with pytest.raises(ConfigError, match=reason):
        check_staleness(load_experiment(path), 1)
    for args in (["--in-process"], []):
        result = run_main(["run", path, "--staleness", "1", "--steps", "5", *args])
        assert result.returncode == 2 and reason in result.stderr, result.stderr
    (tmp_path / "keyed.toml").write_text(text.replace("seed = 0\n", "seed = 0\nstaleness = 1\n"))
    with pytest.raises(ConfigError, match=reason):
        load_experiment(tmp_path / "keyed.toml")
