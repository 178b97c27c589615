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
