"""Command-line behaviour: usage errors are exit 2 with a message a user can act on.

The command lines run in this process (``conftest.run_main``); one test runs
them as real processes, through both entry points, to show the code and
message reach the shell.
"""

from __future__ import annotations

import subprocess

import pytest

from distgrad.cli import build_parser, build_stage_parser
from distgrad.errors import ConfigError
from distgrad.run.launcher import pinned_env
from distgrad.config.experiment import builtin_names
from distgrad.config.parse import load_experiment, parse_experiment, parse_init_overrides

from conftest import BIN, run_cli, run_main


@pytest.mark.parametrize("args,needle", [
    (["stage", "g", "--experiment", "seed-reverse"], "is the serving stage of 'seed-reverse' (stages ['f', 'g']): give --bind"),
    (["stage", "g", "--experiment", "seed-reverse", "--bind", "tcp://127.0.0.1:1", "--connect", "tcp://127.0.0.1:1"],
     "is the serving stage"),
    (["stage", "f", "--experiment", "seed-reverse", "--bind", "tcp://127.0.0.1:*"], "is the driving stage"),
    (["stage", "g", "--experiment", "seed-reverse", "--connect", "tcp://127.0.0.1:5"], "give --bind ENDPOINT"),
    (["stage", "f", "--experiment", "seed-reverse", "--connect", "tcp://127.0.0.1:*"], "port wildcard"),
    (["stage", "f", "--experiment", "seed-reverse", "--connect", "http://example"], "invalid endpoint"),
    (["stage", "h", "--experiment", "seed-reverse", "--connect", "tcp://127.0.0.1:5"], "has no stage 'h'"),
    (["stage", "g", "--experiment", "no-such-thing", "--bind", "tcp://127.0.0.1:*"], "no experiment file"),
    (["stage", "g", "--experiment", "seed-reverse", "--bind", "tcp://127.0.0.1:*", "--init", "gW"], "NAME=VALUE"),
    (["stage", "g", "--experiment", "seed-reverse", "--bind", "tcp://127.0.0.1:*", "--init", "gW=abc"], "not a number"),
    (["stage", "f", "--experiment", "seed-reverse", "--connect", "tcp://127.0.0.1:5", "--steps", "0"], "--steps"),
    (["stage", "f", "--experiment", "seed-reverse", "--connect", "tcp://127.0.0.1:5", "--timeout", "-1"], "--timeout"),
    (["run", "seed-reverse", "--init", "xx=1"], "unknown parameters"),
])
def test_usage_errors_exit_2_with_a_message(args, needle):
    result = run_main(args)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr


@pytest.mark.parametrize("command,args,needle", [
    ("distgrad", ["run", "seed-reverse", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),   # argparse's
    ("distgrad-stage", ["f", "--experiment", "seed-reverse", "--bind", "tcp://127.0.0.1:*"], "is the driving stage"),
])
def test_a_usage_error_exits_2_from_a_real_process_without_a_traceback(command, args, needle):
    if command == "distgrad":
        result = run_cli(args, timeout=30)
    else:
        result = subprocess.run([str(BIN / command), *args], capture_output=True, text=True, timeout=30,
                                env=pinned_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr


def test_experiments_lists_the_builtins():
    result = run_main(["experiments"])
    assert result.returncode == 0
    for name in ("seed-simple", "seed-reverse", "tanh-regression"):
        assert name in result.stdout


def test_help_documents_the_exit_codes():
    text = build_stage_parser().format_help()
    assert "3 peer timeout" in text and "--keep-serving" in text
    assert "demo" in build_parser().format_help()


def test_every_builtin_loads_and_has_a_fingerprint():
    for name in builtin_names():
        exp = load_experiment(name)
        assert len(exp.fingerprint) == 64


def test_fingerprint_changes_with_the_experiment():
    exp = load_experiment("seed-reverse")
    raw = dict(exp.raw, steps=901)
    assert parse_experiment(raw).fingerprint != exp.fingerprint


@pytest.mark.parametrize("change,needle", [
    ({"colour": "red"}, "unknown top-level keys"),
    ({"steps": 0}, "'steps' must be a positive integer"),
    ({"labels": "middle"}, "'labels' must be"),
    ({"stages": []}, "at least one [[stages]]"),
    ({"data": {"kind": "nope"}}, "unknown data kind"),
])
def test_invalid_experiments_are_refused_naming_the_problem(change, needle):
    raw = dict(load_experiment("seed-reverse").raw, **change)
    with pytest.raises(ConfigError, match=None) as info:
        parse_experiment(raw, "test.toml")
    assert needle in str(info.value) and "test.toml" in str(info.value)


def test_stage_shapes_must_chain():
    raw = load_experiment("tanh-regression").raw
    stages = [dict(raw["stages"][0]), dict(raw["stages"][1])]
    stages[1]["model"] = [{"type": "dense", "name": "g1", "in": 31, "out": 1}]
    with pytest.raises(ConfigError, match="takes \\(batch, 31\\)"):
        parse_experiment(dict(raw, stages=stages))


def test_init_overrides_parse():
    assert parse_init_overrides("fW=1,gW=-0.5") == {"fW": 1.0, "gW": -0.5}
    assert parse_init_overrides(None) == {}
    with pytest.raises(ConfigError):
        parse_init_overrides("fW=nan")


def test_the_plan_of_a_local_run_wires_every_process_without_starting_one(tmp_path):
    from distgrad.run.launcher import plan_processes

    exp = load_experiment("chain-regression")
    plan = plan_processes(exp, "chain-regression", tmp_path, common_flags=["--steps", "3"],
                          driver_flags=["--micro-batches", "2"], progress_bar=True,
                          metrics_path=tmp_path / "m.jsonl")
    assert [(p.label, p.driving) for p in plan.processes] == [("f", True), ("m", False), ("g", False)]
    f, m, g = plan.processes
    # The serving stages start from the last one up: g connects nowhere, m to g's endpoint, f to m's.
    assert "--connect" not in g.argv(None) and g.argv(None)[-len(g.flags):] == g.flags
    assert m.argv("tcp://127.0.0.1:7001")[7:11] == ["--bind", "tcp://127.0.0.1:*", "--connect", "tcp://127.0.0.1:7001"]
    assert f.argv("tcp://127.0.0.1:7002")[7:9] == ["--connect", "tcp://127.0.0.1:7002"]
    assert f.flags[:6] == ["--steps", "3", "--micro-batches", "2", "--progress", "lines"] and f.shows_bar
    assert "--micro-batches" not in m.flags and "--progress" not in g.flags
    assert plan.metrics == {"f": tmp_path / "m.jsonl", "m": tmp_path / "m.m.jsonl", "g": tmp_path / "m.g.jsonl"}
    assert not any(path.exists() for path in tmp_path.iterdir())      # nothing started, nothing written


def test_the_plan_of_several_clients_runs_the_data_owner_once_per_client(tmp_path):
    from distgrad.run.launcher import plan_processes

    exp = load_experiment("digits-clients")
    plan = plan_processes(exp, "digits-clients", tmp_path, progress_bar=True, trace=True,
                          tensorboard_dir=tmp_path / "tb")
    drivers = [p for p in plan.processes if p.driving]
    assert [(p.label, p.stage, p.client) for p in drivers] == [(f"f@{k}", "f", k) for k in range(len(drivers))]
    assert len(drivers) == exp.clients.count >= 2
    assert [p.shows_bar for p in drivers] == [True] + [False] * (len(drivers) - 1)   # one bar, the first client's
    for p in drivers:
        assert p.flags[:2] == ["--client", str(p.client)]
        assert ["--trace", str(p.trace)] == p.flags[p.flags.index("--trace"):p.flags.index("--trace") + 2]
        assert p.flags[p.flags.index("--tensorboard") + 1] == str(tmp_path / "tb" / p.label)
    assert [p.label for p in plan.processes if not p.driving] == ["g"]


def test_every_subcommand_has_a_handler_and_every_handler_a_subcommand():
    import argparse

    from distgrad.cli import COMMANDS

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) - {"stage"} == set(COMMANDS)      # 'stage' is parsed by build_stage_parser


@pytest.mark.slow
def test_the_modules_mypy_checks_are_clean():
    """``mypy`` with no arguments checks the modules pyproject.toml's [tool.mypy] lists; they must stay clean."""
    import sys
    from pathlib import Path

    pytest.importorskip("mypy", reason="mypy is installed by the lint extra: pip install 'distgrad[lint]'")
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=root, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout


def test_link_flags_given_to_a_run_in_one_process_are_said_to_do_nothing():
    """--in-process has no sockets between its stages: --transport ipc, --secure and the wait flags are
    accepted (one command line runs either way) and a WARNING names each as doing nothing there."""
    result = run_main(["run", "seed-simple", "--in-process", "--steps", "2", "--transport", "ipc", "--secure",
                       "--timeout", "3", "--peer-deadline", "4"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--transport ipc, --secure, --timeout, --peer-deadline: a run in one process has no sockets" in result.stderr
    quiet = run_main(["run", "seed-simple", "--in-process", "--steps", "2"])
    assert quiet.returncode == 0 and "no sockets" not in quiet.stderr
