"""Watching a run: a bar in a terminal, log lines elsewhere, metrics that plot to PNG."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import time
from pathlib import Path

import pytest

from distgrad.run.launcher import pinned_env

from conftest import CLI, read_lines, run_cli, run_main


def _run_on_a_terminal(args: list[str], timeout: float = 60.0) -> tuple[int, str]:
    """Run ``distgrad ARGS`` with stdout and stderr on a pseudo-terminal; return (exit code, output)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([*CLI, *args], stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                            env=pinned_env())
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:           # the terminal closes when the process exits
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        return proc.wait(10), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_demo_on_a_terminal_draws_a_progress_bar():
    code, out = _run_on_a_terminal(["demo", "--steps", "3000"])
    assert code == 0, out
    assert "\r[" in out and "steps/s ETA" in out and "3000/3000" in out
    assert "progress {" not in out                       # the launcher turned the lines into the bar
    assert "both weights reached" in out


def test_stage_on_a_terminal_draws_a_bar_and_in_a_pipe_writes_log_lines(start_server, tmp_path):
    _, endpoint = start_server("seed-reverse", "--keep-serving")
    code, out = _run_on_a_terminal(["stage", "f", "--experiment", "seed-reverse", "--connect", endpoint])
    assert code == 0, out
    assert "\r[" in out and "900/900" in out and "step 90/900" not in out
    piped = run_cli(["stage", "f", "--experiment", "seed-reverse", "--connect", endpoint])
    assert piped.returncode == 0
    assert "step 90/900" in piped.stderr and "\r[" not in piped.stderr


def test_metrics_have_one_line_per_step_and_plot_to_png(tmp_path):
    metrics, png = tmp_path / "m.jsonl", tmp_path / "loss.png"
    result = run_cli(["run", "tanh-regression", "--steps", "120", "--metrics", metrics])
    assert result.returncode == 0, result.stderr
    lines = read_lines(metrics)
    assert [line["step"] for line in lines] == list(range(1, 121))
    for key in ("loss", "wall_s", "bytes_sent", "bytes_received", "f_compute_s", "f_wait_s", "g_compute_s"):
        assert key in lines[-1]
    assert lines[-1]["bytes_sent"] > lines[0]["bytes_sent"] > 0 and lines[-1]["g_compute_s"] > 0
    pytest.importorskip("matplotlib")
    result = run_cli(["plot", metrics, "--out", png])
    assert result.returncode == 0, result.stderr
    assert png.read_bytes().startswith(b"\x89PNG")
    assert run_cli(["plot", tmp_path / "missing.jsonl"]).returncode == 2


def test_log_level_controls_the_output():
    quiet = run_cli(["run", "seed-reverse", "--steps", "50", "--log-level", "WARNING"])
    assert quiet.returncode == 0 and "INFO" not in quiet.stdout + quiet.stderr
    chatty = run_cli(["run", "seed-reverse", "--steps", "50", "--log-level", "DEBUG"])
    assert chatty.returncode == 0 and "INFO" in chatty.stdout


# --- A trace a user can afford, output a user can read ---------------------------------------------

@pytest.mark.parametrize("mode", [["--in-process"], []], ids=["in-process", "two-process"])
def test_trace_params_and_every_keep_the_named_values_of_every_kth_step(tmp_path, mode):
    full, narrow = tmp_path / "full.jsonl", tmp_path / "narrow.jsonl"
    args = ["run", "tanh-regression", "--steps", "10", *mode]
    run = run_main if "--in-process" in mode else run_cli        # no stage process to start in-process
    assert run([*args, "--trace", full]).returncode == 0
    result = run([*args, "--trace", narrow, "--trace-params", "f1.b,g2.W,activation_grad", "--trace-every", "4"])
    assert result.returncode == 0, result.stderr
    lines, reference = read_lines(narrow), {line["step"]: line for line in read_lines(full)}
    assert [line["step"] for line in lines] == [4, 8, 10]                  # every 4th, and the last
    for line in lines:
        wanted = {"f1.b", "g2.W"}
        assert set(line["params"]) == wanted
        assert set(line["grads"]) == wanted | {"activation_grad"}
        for kind in ("params", "grads"):
            for name, value in line[kind].items():
                assert value == reference[line["step"]][kind][name]      # bitwise the full trace's values
        assert line["loss"] == reference[line["step"]]["loss"]


@pytest.mark.parametrize("flags, message", [
    (["--trace-params", "nope"], "unknown name(s) nope"),
    (["--trace-every", "0"], "--trace-every must be an integer >= 1"),
])
@pytest.mark.parametrize("mode", [["--in-process"], []], ids=["in-process", "two-process"])
def test_bad_trace_filters_exit_2_before_anything_runs(tmp_path, flags, message, mode):
    result = run_main(["run", "tanh-regression", "--steps", "5", "--trace", tmp_path / "t.jsonl", *flags, *mode])
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    no_trace = run_main(["run", "tanh-regression", "--steps", "5", "--trace-every", "3", *mode])
    assert no_trace.returncode == 2 and "need --trace PATH" in no_trace.stderr


def test_a_large_trace_warns_once_and_the_help_says_what_it_costs(tmp_path):
    result = run_main(["run", "mlp-classify", "--steps", "2", "--in-process", "--trace", tmp_path / "t.jsonl"])
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("MB a step") == 1 and "--trace-params" in result.stderr
    small = run_main(["run", "mlp-classify", "--steps", "2", "--in-process", "--trace", tmp_path / "s.jsonl",
                      "--trace-params", "g1.b"])
    assert small.returncode == 0 and "MB a step" not in small.stderr
    help_text = " ".join(run_cli(["stage", "--help"]).stdout.split())
    assert "8.7 MB a step" in help_text and "--trace-every" in help_text


def test_the_first_progress_frame_has_no_nan_and_lines_mode_writes_only_progress_lines(start_server):
    from distgrad.run.progress import render_bar

    assert "nan" not in render_bar(1, 10, None, None) and "- steps/s ETA -" in render_bar(1, 10, 0.5, None)
    _, endpoint = start_server("seed-reverse", "--keep-serving")
    result = run_cli(["stage", "f", "--experiment", "seed-reverse", "--connect", endpoint, "--progress", "lines"])
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    assert "progress {" in out and "nan" not in out.lower()
    assert "step 90/900" not in out                     # one kind of line per step, not both


def test_experiments_lists_every_description_whole():
    from distgrad.config.experiment import builtin_names
    from distgrad.config.parse import load_experiment

    result = run_main(["experiments"])
    assert result.returncode == 0
    listed = result.stdout.split()
    for name in builtin_names():
        words = str(load_experiment(name).raw.get("description", "")).split()
        start = listed.index(f"{name}:")
        assert listed[start + 5:start + 5 + len(words)] == words, name     # after "NAME: K stage(s), N steps"


@pytest.mark.parametrize("command, flags, needle", [
    (["run", "tanh-regression"], ["--summary", "x.json", "--metrics", "x.json"],
     "--summary and --metrics both name"),
    (["run", "tanh-regression", "--in-process"], ["--summary", "x.json", "--trace", "./x.json"],
     "--summary and --trace both name"),
    (["run", "tanh-regression"], ["--metrics", "m.jsonl", "--trace", "m.g.jsonl"],
     "--trace and --metrics of process g (m.g.jsonl, beside --metrics) both name"),
    (["run", "tanh-regression"], ["--metrics", "m.jsonl", "--summary", "m.g.jsonl"],
     "--summary and --metrics of process g (m.g.jsonl, beside --metrics) both name"),
    (["stage", "f", "--experiment", "tanh-regression", "--connect", "tcp://127.0.0.1:9"],
     ["--trace", "x.jsonl", "--metrics", "x.jsonl"], "--trace and --metrics both name"),
])
def test_two_outputs_of_one_file_exit_2_before_anything_runs(tmp_path, monkeypatch, command, flags, needle):
    """A run whose summary, trace or metrics (or a stage's metrics that ``distgrad run`` puts beside them) would
    be one file is refused naming both: one would overwrite the other, and an output would be lost."""
    monkeypatch.chdir(tmp_path)
    result = run_main([*command, *flags])
    assert result.returncode == 2, result.stdout + result.stderr
    assert needle in result.stderr and "each output needs a file of its own" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["run", "tanh-regression"], ["run", "tanh-regression", "--in-process"],
                                     ["stage", "g", "--experiment", "tanh-regression", "--bind", "tcp://127.0.0.1:9"]])
@pytest.mark.parametrize("flag", ["--summary", "--trace", "--metrics"])
def test_an_output_that_cannot_be_written_exits_2_before_anything_runs(tmp_path, monkeypatch, command, flag):
    """An output under a file (a folder that cannot be made) or naming a folder is refused with the reason before
    training, not once the run has ended (which lost the run to a traceback)."""
    if flag == "--metrics" and "--in-process" in command:
        return                                   # --in-process writes no metrics (refused with its own reason)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    for path, needle in (("afile/sub/out.json", f"cannot write {flag} afile/sub/out.json: afile is a file, not a "
                                                "folder"), ("adir", f"{flag} adir is a folder; name a file")):
        result = run_main([*command, flag, path])
        assert result.returncode == 2 and needle in result.stderr, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"] and not any((tmp_path / "adir").iterdir())


def test_plot_to_a_format_or_a_place_it_cannot_write_exits_2_naming_it(tmp_path):
    """``distgrad plot --out`` whose suffix is no image format, or whose folder cannot be made, exits 2 with the
    reason (never a traceback); no suffix draws a PNG."""
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(f'{{"step": {k}, "loss": {1 / k}, "wall_s": {k / 100}}}\n' for k in range(1, 30)))
    result = run_main(["plot", metrics, "--out", tmp_path / "loss.txt"])
    assert result.returncode == 2 and "'txt' is no image format matplotlib writes; use .png" in result.stderr
    assert not (tmp_path / "loss.txt").exists()
    (tmp_path / "a-file").write_text("")
    result = run_main(["plot", metrics, "--out", tmp_path / "a-file" / "loss.png"])
    assert result.returncode == 2 and "cannot write --out" in result.stderr, result.stderr
    assert run_main(["plot", metrics, "--out", tmp_path / "loss"]).returncode == 0
    assert (tmp_path / "loss").read_bytes().startswith(b"\x89PNG")


GOOD_METRICS_LINE = '{"step": 1, "loss": 0.5, "wall_s": 0.01}\n'
DAMAGED_METRICS = [      # (name, the file's text, or "DIR" / a device's path, a part of the message)
    ("JSON nested 100,000 deep", GOOD_METRICS_LINE + "[" * 100_000 + "]" * 100_000 + "\n",
     "line 2 is JSON nested too deeply"),
    ("a line that is a list naming the keys", '["step", "wall_s"]\n', "line 1 is no distgrad metrics line"),
    ("a line that is not JSON", GOOD_METRICS_LINE + "{step: 2}\n", "line 2 is not JSON"),
    ("a string step", '{"step": "2", "loss": 0.5, "wall_s": 0.01}\n', "'step' must be a whole number"),
    ("a boolean client", '{"step": 1, "loss": 0.5, "wall_s": 0.01, "client": true}\n', "'client' must be"),
    ("an infinite wall time", '{"step": 1, "loss": 0.5, "wall_s": 1e999}\n', "'wall_s' must be a finite number"),
    ("an object for the loss", '{"step": 1, "loss": {"a": 1}, "wall_s": 0.01}\n', "'loss' must be a number"),
    ("a string score", GOOD_METRICS_LINE + '{"step": 2, "loss": 0.4, "wall_s": 0.02, "test_accuracy": "high"}\n',
     "line 2: 'test_accuracy' must be a number"),
    ("bytes that are not UTF-8", GOOD_METRICS_LINE.replace("0.5", '"\udcff"'), "line 1 is not UTF-8 text"),
    ("a directory", "DIR", "is not a regular file"),
    ("/dev/zero", "/dev/zero", "is not a regular file"),
]


@pytest.mark.parametrize("text, message", [case[1:] for case in DAMAGED_METRICS],
                         ids=[case[0] for case in DAMAGED_METRICS])
def test_plot_of_a_damaged_or_hostile_metrics_file_exits_2_naming_the_problem(tmp_path, text, message):
    """A metrics file is read as the audit reads a trace: a regular file only (never /dev/zero without bound),
    line by line, each line a metrics record of numbers; anything else exits 2 naming the file, the line and
    the problem, never a traceback (``RecursionError``, ``AttributeError``, ``ValueError``)."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "m.jsonl"
    if text == "DIR":
        path.mkdir()
    elif text.startswith("/dev/"):
        path = Path(text)
    else:
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
    result = run_main(["plot", path, "--out", tmp_path / "loss.png"])
    assert result.returncode == 2 and message in result.stderr, result.stdout + result.stderr
    assert not (tmp_path / "loss.png").exists()


def test_plot_draws_non_finite_figures_written_as_text_and_a_meter_figure_without_its_chance(tmp_path):
    """What distgrad writes for a diverged loss (``"nan"``, ``"inf"``) is drawn as such, in any order of steps."""
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 2, "loss": "nan", "wall_s": 0.02, "label_recovery": 0.5}\n'
                       '{"step": 1, "loss": 0.5, "wall_s": 0.01, "label_recovery": "inf"}\n'
                       '{"step": 2, "loss": 0.4, "wall_s": 0.03, "label_recovery": 0.25}\n')
    assert run_main(["plot", metrics, "--out", tmp_path / "loss.png"]).returncode == 0
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_metrics_and_trace_lines_reach_the_file_as_each_is_written(tmp_path):
    """A stage killed (SIGKILL) leaves in its metrics and trace files the line of every step it recorded, each
    whole: each line is handed to the system as it is written, none held in a buffer until close."""
    import numpy as np

    from distgrad.run.progress import MetricsWriter
    from distgrad.stage.records import TraceWriter

    metrics, trace = MetricsWriter(tmp_path / "m.jsonl"), TraceWriter(tmp_path / "t.jsonl")
    try:
        for step in (1, 2, 3):
            metrics.write({"step": step, "loss": 0.5, "wall_s": 0.01 * step})
            trace.write(step, 0.5, {"w": np.zeros(2, np.float32)}, {"w": np.ones(2, np.float32)})
        for path in (tmp_path / "m.jsonl", tmp_path / "t.jsonl"):     # read as a killed writer leaves them
            lines = path.read_text().splitlines()
            assert [json.loads(line)["step"] for line in lines] == [1, 2, 3], path
    finally:
        metrics.close()
        trace.close()


def test_plot_draws_a_metrics_file_whose_last_line_a_killed_stage_cut_short(tmp_path):
    """The last line cut short (no line end, not JSON) is left out with a warning; the steps before it are
    drawn. A whole line that is not JSON is still refused (test above)."""
    pytest.importorskip("matplotlib")
    from distgrad.plot import read_metrics

    path = tmp_path / "m.jsonl"
    path.write_text(GOOD_METRICS_LINE + '{"step": 2, "loss": 0.4, "wall_s": 0.02}\n{"step": 3, "lo')
    assert [record["step"] for record in read_metrics(path)] == [1, 2]
    result = run_main(["plot", path, "--out", tmp_path / "loss.png"])
    assert result.returncode == 0 and "line 3 is cut short" in result.stderr, result.stderr
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
    path.write_text(GOOD_METRICS_LINE.rstrip("\n"))          # one whole line without its line end is read
    assert [record["step"] for record in read_metrics(path)] == [1]


def test_plot_writes_its_image_whole_or_not_at_all_and_never_over_the_metrics(tmp_path, monkeypatch):
    """A failure while drawing (here: the disk full mid-write) keeps the image that was there, with no
    temporary file left; --out naming the metrics file itself is refused, the metrics kept."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from distgrad.errors import ConfigError
    from distgrad.plot import plot_metrics

    metrics, out = tmp_path / "m", tmp_path / "loss.png"
    metrics.write_text(GOOD_METRICS_LINE)
    out.write_bytes(b"the image of another run")

    def full(self, target, **options):
        if isinstance(target, Path):                 # drawn straight into the file named
            with open(target, "wb") as f:
                f.write(b"\x89PNG half")
        else:
            target.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    with pytest.raises(ConfigError, match="No space left on device"):
        plot_metrics(metrics, out)
    monkeypatch.undo()
    assert out.read_bytes() == b"the image of another run" and sorted(p.name for p in tmp_path.iterdir()) == [
        "loss.png", "m"]
    with pytest.raises(ConfigError, match="is the metrics file this command reads"):
        plot_metrics(metrics, metrics)
    assert metrics.read_text() == GOOD_METRICS_LINE


def test_a_resumed_stage_keeps_the_metrics_lines_of_the_steps_its_checkpoint_holds(tmp_path):
    """``--resume`` opened the metrics file anew, losing the lines of every step before the restart: it now keeps
    them, up to the step it resumes (a line cut short by the kill and the lines of steps rolled back go)."""
    from distgrad.run.progress import MetricsWriter

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 0.5, "wall_s": 0.1}) + "\n" for s in (1, 2, 3, 4))
                    + '{"step": 5, "lo')
    writer = MetricsWriter(path, append=True)
    writer.rollback(3)
    writer.write({"step": 4, "loss": 0.25, "wall_s": 0.2})
    writer.close()
    assert [(line["step"], line["loss"]) for line in map(json.loads, path.read_text().splitlines())] == [
        (1, 0.5), (2, 0.5), (3, 0.5), (4, 0.25)]
    writer = MetricsWriter(path, append=True)     # --resume that finds no checkpoint: a new run, an empty file
    writer.rollback(0)
    writer.close()
    assert path.read_text() == ""
