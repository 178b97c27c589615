"""``--tensorboard DIR``: TensorBoard event files from the driving stage, read back record by record; without
the optional tensorboardX the flag is a usage error that names the extra to install."""

from __future__ import annotations

import logging
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from distgrad import cli
from distgrad.errors import ConfigError
from distgrad.config.parse import load_experiment
from distgrad.run.options import StageOptions

from conftest import read_json, run_launcher

INSTALL_HINT = "pip install 'distgrad[tensorboard]'"


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from every event file in ``directory``: the TFRecord framing
    (length, its masked CRC-32C, the record, its masked CRC-32C) checked and each record an ``Event``."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    scalars: dict[str, list[tuple[int, float]]] = {}
    files = sorted(directory.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    data, at = files[0].read_bytes(), 0
    while at < len(data):
        header = data[at:at + 8]
        (length,), (header_crc,) = struct.unpack("<Q", header), struct.unpack("<I", data[at + 8:at + 12])
        record = data[at + 12:at + 12 + length]
        (record_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
        assert header_crc == masked_crc32c(header) and record_crc == masked_crc32c(record)
        at += 16 + length
        event = Event()
        event.ParseFromString(record)
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_the_event_file_has_every_scalar_at_its_steps(tmp_path):
    pytest.importorskip("tensorboardX", reason="tensorboardX is not installed (pip install 'distgrad[tensorboard]')")
    board, summary = tmp_path / "board", tmp_path / "s.json"
    result = run_launcher(["run", "digits", "--steps", "6", "--eval-every", "3", "--tensorboard", board,
                           "--summary", summary])
    assert result.returncode == 0, result.stdout + result.stderr
    scalars = _scalars(board)
    assert sorted(scalars) == ["speed/bytes_per_step", "speed/steps_per_s", "test/accuracy", "test/loss",
                               "train/loss", "train/lr"]
    for tag in ("train/loss", "speed/steps_per_s", "speed/bytes_per_step"):
        assert [step for step, _ in scalars[tag]] == [1, 2, 3, 4, 5, 6], tag
        assert all(value > 0 for _, value in scalars[tag]), tag
    evaluations = read_json(summary)["evaluations"]
    for tag, key in (("test/loss", "test_loss"), ("test/accuracy", "test_accuracy")):
        assert scalars[tag] == [(e["step"], np.float32(e[key])) for e in evaluations]     # float32 in the file
    assert [step for step, _ in scalars["test/loss"]] == [3, 6]
    assert scalars["train/loss"][-1][1] == np.float32(read_json(summary)["final_loss"])


def test_without_tensorboardx_the_flag_is_a_usage_error_naming_the_extra(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)           # import tensorboardX raises ImportError
    args = cli.build_parser().parse_args(["run", "digits", "--steps", "2", "--tensorboard", str(tmp_path / "b")])
    with caplog.at_level(logging.ERROR, logger="distgrad"):
        assert cli._guarded(cli._run_experiment, args) == cli.EXIT_USAGE
    assert INSTALL_HINT in caplog.text and not (tmp_path / "b").exists()
    exp = load_experiment("digits")
    with pytest.raises(ConfigError, match=r"pip install 'distgrad\[tensorboard\]'"):
        StageOptions(exp, "f", exp.seed, tensorboard_dir=tmp_path / "b")


@pytest.mark.parametrize("flag", ["--tensorboard", "--metrics"])
def test_tensorboard_and_metrics_are_for_a_run_in_processes(tmp_path, flag):
    """Every stage of a run in processes may write its own (test_watch.py: a serving stage's lr); --in-process
    writes neither, so it refuses both rather than accept a flag that does nothing."""
    args = cli.build_parser().parse_args(["run", "digits", "--in-process", flag, str(tmp_path / "out")])
    with pytest.raises(ConfigError, match="--in-process writes none"):
        cli._run_experiment(args)
    assert not (tmp_path / "out").exists()
