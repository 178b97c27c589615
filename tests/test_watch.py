"""Watching a run: a bar in a terminal, log lines elsewhere, metrics that plot to PNG."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time

import pytest

from distgrad.launcher import pinned_env

from conftest import CLI, read_lines, run_cli


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
