"""One checkpoint directory, several runs and processes: nothing is lost, shared or left behind.

Real stage processes: another run's checkpoints are never deleted;
a second process of a running stage is refused; an unwritable or full
directory is a clear error; a finished run is not run again.
"""

from __future__ import annotations

import os
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import StageProcess, read_json, run_launcher, run_main
from distgrad.errors import OutputWriteError
from distgrad.run.progress import MetricsWriter

from test_faults import Pair


def _ckpts(directory: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir() if p.name.endswith(".ckpt")}


def test_a_second_run_keeps_the_first_runs_checkpoints_and_resumes_its_own(tmp_path, stage_group):
    ck = tmp_path / "ckpt"
    first = run_launcher(["run", "tanh-regression", "--seed", "7", "--steps", "400", "--checkpoint-dir", ck,
                          "--checkpoint-every", "50"])
    assert first.returncode == 0, first.stderr
    first_files = _ckpts(ck)
    assert len(first_files) == 6                   # f and g: the newest three each
    pair = stage_group(Pair, tmp_path, "tanh-regression", "600", f"ipc://{tmp_path}/g.sock")
    pair.start("g")
    pair.start("f")
    pair.wait_for_step(300)
    pair.procs["f"].proc.kill()
    assert pair.procs["f"].wait() == -signal.SIGKILL, "the run ended before the kill"
    pair.start("f")
    pair.wait_all()
    for name, mtime in first_files.items():        # neither deleted nor overwritten
        assert _ckpts(ck).get(name) == mtime, name
    restarted = pair.procs["f"].output
    assert "resumed run" in restarted and "no resume" not in restarted, restarted
    reference = read_json(tmp_path / "f.json")
    assert reference["steps"] == 600
    ours = [n for n in _ckpts(ck) if n.startswith(f"f-{reference['run_id']}-")]
    assert len(ours) == 3, sorted(_ckpts(ck))      # the run keeps its own newest


def test_a_second_driver_of_a_running_stage_is_refused(tmp_path, stage_group):
    pair = stage_group(Pair, tmp_path, "tanh-regression", "3000", f"ipc://{tmp_path}/g.sock")
    pair.start("g")
    pair.start("f")
    pair.wait_for_step(50)
    for name in ("f", "g"):
        with StageProcess(pair.args[name], tmp_path / f"second-{name}.log") as second:
            assert second.wait(30) == 2, second.output
            holder = pair.procs[name].proc.pid
            assert f"{tmp_path / 'ckpt'}" in second.output and f"stage {name} is already running" in second.output
            assert f"pid {holder}" in second.output and "Traceback" not in second.output
    pair.wait_for_step(100)             # the first pair trains on, undisturbed (the group stops it at the end)
    assert all(p.proc.poll() in (None, 0) for p in pair.procs.values())
    assert "rolled back" not in pair.procs["g"].output


@contextmanager
def _tmpfs(path: Path, options: str):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (read-only or small) needs root")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.parametrize("stage", ["f", "g"])
def test_a_read_only_checkpoint_directory_is_a_configuration_error_at_start(tmp_path, stage):
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        flag = ["--connect", "tcp://127.0.0.1:9"] if stage == "f" else ["--bind", "tcp://127.0.0.1:*"]
        with StageProcess([stage, "--experiment", "seed-reverse", *flag, "--checkpoint-dir", ro, "--resume",
                           "--peer-deadline", "2"], tmp_path / "stage.log") as proc:
            assert proc.wait(30) == 2, proc.output
            assert f"--checkpoint-dir {ro} is not writable: Read-only file system" in proc.output
            assert "Traceback" not in proc.output


@pytest.mark.parametrize("victim", ["f", "g"])
def test_a_full_disk_mid_run_is_one_clear_error_and_leaves_no_partial_file(tmp_path, victim):
    # mlp-classify's f and g checkpoints are 2.4 and 0.03 MiB: the first fits, a second one does not.
    size = "4m" if victim == "f" else "96k"
    with _tmpfs(tmp_path / "small", f"size={size}") as small:
        dirs = {"f": tmp_path / "ck", "g": tmp_path / "ck"}
        dirs[victim] = small
        ready = tmp_path / "g.ready"
        common = ["--experiment", "mlp-classify", "--steps", "200", "--checkpoint-every", "1", "--peer-deadline", "3",
                  "--liveness", "1", "--timeout", "1"]
        g = StageProcess(["g", "--bind", f"ipc://{tmp_path}/g.sock", "--ready-file", ready, "--checkpoint-dir",
                          dirs["g"], *common], tmp_path / "g.log")
        f = StageProcess(["f", "--connect", f"ipc://{tmp_path}/g.sock", "--checkpoint-dir", dirs["f"], *common],
                         tmp_path / "f.log")
        try:
            proc = {"f": f, "g": g}[victim]
            assert proc.wait(60) == 1, proc.output
            assert proc.output.count("cannot write checkpoint") == 1, proc.output
            assert f"in --checkpoint-dir {small}: No space left on device" in proc.output
            assert "Traceback" not in proc.output
            assert not [p.name for p in small.iterdir() if p.name.endswith(".tmp")]
        finally:
            f.stop()
            g.stop()


@pytest.mark.parametrize("output", ["--trace", "--summary"])
def test_a_full_disk_under_an_output_file_is_one_clear_error_naming_it(tmp_path, output):
    # seed-reverse's trace takes about 100 bytes a step: 900 steps overflow 8 KiB mid-run. The summary is
    # written at the end, onto a disk already full.
    with _tmpfs(tmp_path / "small", "size=8k") as small:
        if output == "--summary":
            (small / "filler").write_bytes(bytes(8192))
        path = small / "out.json"
        result = run_main(["run", "seed-reverse", "--in-process", output, path])
        assert result.returncode == 1, result.stderr
        what = {"--trace": "the trace ", "--summary": ""}[output]
        assert f"cannot write {what}{path}: No space left on device" in result.stderr
        assert "Traceback" not in result.stderr
        assert not [p.name for p in small.iterdir() if p.name.endswith(".tmp")]


SERVING_G = ["stage", "g", "--experiment", "seed-reverse", "--bind", "tcp://127.0.0.1:9"]


@pytest.mark.parametrize("command, flag", [(["run", "seed-reverse"], "--summary"),
                                           (["run", "seed-reverse", "--in-process"], "--summary"),
                                           (SERVING_G, "--summary"), (SERVING_G, "--ready-file")])
def test_an_output_in_a_read_only_folder_is_refused_at_start(tmp_path, command, flag):
    # The summary is written after the last step: found unwritable then, the whole run was spent for nothing;
    # the ready file once the stage is bound.
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        result = run_main([*command, flag, ro / "sub" / "s.json"])
        assert result.returncode == 2, result.stderr
        assert f"cannot write {flag} {ro / 'sub' / 's.json'}: the folder {ro} is not writable: Read-only file system" \
            in result.stderr
        assert "Traceback" not in result.stderr


def test_a_full_disk_under_the_metrics_is_an_output_write_error_naming_them(tmp_path):
    # What a stage process's --metrics meets; its command then ends on this one line (exit 1), as above.
    with _tmpfs(tmp_path / "small", "size=8k") as small:
        writer = MetricsWriter(small / "m.jsonl")
        with pytest.raises(OutputWriteError, match=f"cannot write the metrics {small / 'm.jsonl'}: No space left"):
            for step in range(1, 1000):
                writer.write({"step": step, "loss": 0.5, "wall_s": 0.001})
            writer.close()
        writer.close()          # closed once, whatever failed


def _outputs(tmp_path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in tmp_path.glob("out.*")}


def test_rerunning_a_finished_run_with_resume_does_nothing_and_touches_nothing(tmp_path):
    ck = tmp_path / "ckpt"
    args = ["run", "seed-reverse", "--steps", "100", "--checkpoint-dir", ck, "--checkpoint-every", "50", "--resume",
            "--summary", tmp_path / "out.summary.json", "--trace", tmp_path / "out.trace.jsonl",
            "--metrics", tmp_path / "out.metrics.jsonl"]
    first = run_launcher(args)
    assert first.returncode == 0, first.stderr
    before, files = _outputs(tmp_path), _ckpts(ck)
    assert sorted(before) == ["out.metrics.g.jsonl", "out.metrics.jsonl", "out.summary.json", "out.trace.jsonl"]
    again = run_launcher(args)
    assert again.returncode == 0, again.stderr
    assert "finished at step 100; nothing to do (start without --resume for a new run)" in again.stdout + again.stderr
    assert _outputs(tmp_path) == before and _ckpts(ck) == files
    old_run = read_json(tmp_path / "out.summary.json")["run_id"]
    fresh = run_launcher([a for a in args if a != "--resume"])     # told to: a new run
    assert fresh.returncode == 0, fresh.stderr
    assert read_json(tmp_path / "out.summary.json")["run_id"] != old_run


def test_each_stage_alone_says_a_finished_run_is_finished_without_connecting_or_binding(tmp_path, stage_group):
    pair = stage_group(Pair, tmp_path, "seed-reverse", "200", f"ipc://{tmp_path}/g.sock")
    pair.start("g")
    pair.start("f")
    pair.wait_all()
    summaries = {name: (tmp_path / f"{name}.json").read_bytes() for name in ("f", "g")}
    (tmp_path / "g.sock").unlink(missing_ok=True)
    for name in ("f", "g"):
        with StageProcess(pair.args[name], tmp_path / f"again-{name}.log") as again:
            # Exit 0 within 30 s, half the 60 s default --peer-deadline: it did not wait for a peer.
            assert again.wait(30) == 0, again.output
            assert "finished at step 200; nothing to do" in again.output
        assert not (tmp_path / "g.sock").exists()          # g did not bind
    assert {name: (tmp_path / f"{name}.json").read_bytes() for name in ("f", "g")} == summaries


def test_the_python_api_returns_a_finished_runs_summary(tmp_path):
    from distgrad.api import drive_stage, serve_stage

    ck = tmp_path / "ckpt"
    with serve_stage("seed-reverse", checkpoint_dir=ck, steps=60) as g:
        first = drive_stage("seed-reverse", g.endpoint, checkpoint_dir=ck, steps=60)
        g.wait(30)
    again = drive_stage("seed-reverse", "tcp://127.0.0.1:9", checkpoint_dir=ck, steps=60, resume=True)
    assert again["status"] == "finished" and again["steps"] == 60
    assert again["params"] == first["params"] and again["final_loss"] == first["final_loss"]


def test_a_finished_run_resumed_with_more_steps_continues_bitwise(tmp_path):
    ck = tmp_path / "ckpt"
    common = ["run", "seed-reverse", "--checkpoint-dir", ck, "--checkpoint-every", "25", "--resume"]
    assert run_launcher([*common, "--steps", "60"]).returncode == 0
    more = run_launcher([*common, "--steps", "120", "--summary", tmp_path / "more.json"])
    assert more.returncode == 0, more.stderr
    reference = run_main(["run", "seed-reverse", "--in-process", "--steps", "120", "--summary", tmp_path / "ref.json"])
    assert reference.returncode == 0, reference.stderr
    assert read_json(tmp_path / "more.json")["params"] == read_json(tmp_path / "ref.json")["params"]
    assert read_json(tmp_path / "more.json")["steps"] == 120



class _KilledAfterTheFinishedCheckpoint(BaseException):
    """What a kill -9 right after a stage's checkpoint marked finished leaves: that file, and nothing later."""


@pytest.mark.parametrize("victim", ["f", "g"])
def test_a_stage_killed_right_after_its_finished_checkpoint_has_written_its_save_file(tmp_path, monkeypatch, victim):
    """A rerun with --resume finds such a run finished and writes nothing: --save must already be on disk."""
    import threading

    import numpy as np
    import zmq

    from conftest import free_tcp_endpoint
    from distgrad.api import _options
    from distgrad.run.driver import drive_first_stage
    from distgrad.run.options import StopFlag
    from distgrad.run.serving import serve
    from distgrad.run.stage_state import StageState

    save = StageState.save

    def save_then_die(self, *args, finished=False, **kwargs):
        save(self, *args, finished=finished, **kwargs)
        if finished and self.opts.stage == victim:
            self.write_failed = True        # killed: no exit save follows
            raise _KilledAfterTheFinishedCheckpoint

    def start(name, **more):
        opts = _options("seed-reverse", name, name == "f", checkpoint_dir=tmp_path / "ckpt", steps=40,
                        save_path=tmp_path / f"{name}.npz", peer_deadline_s=10.0, **more)
        ctx = zmq.Context()
        try:
            return (drive_first_stage(opts, endpoint, StopFlag(), ctx) if name == "f"
                    else serve(opts, endpoint, StopFlag(), ctx=ctx))
        finally:
            ctx.destroy(linger=0)

    endpoint = free_tcp_endpoint()
    monkeypatch.setattr(StageState, "save", save_then_die)
    survivor = threading.Thread(target=start, args=("g" if victim == "f" else "f",), daemon=True)
    survivor.start()
    with pytest.raises(_KilledAfterTheFinishedCheckpoint):
        start(victim)
    survivor.join(30)
    assert not survivor.is_alive()
    monkeypatch.setattr(StageState, "save", save)
    again = start(victim, resume=True)
    assert again["status"] == "finished" and again["steps"] == 40
    with np.load(tmp_path / f"{victim}.npz") as npz:
        assert {name: npz[name].tolist() for name in npz.files} == again["params"][victim]


def test_a_stop_flag_told_to_stop_with_its_parent_is_set_once_the_parent_is_gone(monkeypatch):
    """``distgrad run``'s stages watch their launcher (``StopFlag.stop_with_parent``): when it dies, even by
    SIGKILL, the orphan's parent changes and the stage stops as on SIGTERM (checkpoint, exit 143)."""
    import threading

    from distgrad.errors import Interrupted
    from distgrad.run import options
    from distgrad.run.options import StopFlag

    parent = [os.getppid()]
    monkeypatch.setattr(options.os, "getppid", lambda: parent[0])
    monkeypatch.setattr(options, "PARENT_POLL_S", 0.001)
    stop = StopFlag().stop_with_parent(parent[0])
    stop.check()                                # the parent lives: no stop
    parent[0] = 1                               # the launcher died: the orphan went to init
    watcher = next(t for t in threading.enumerate() if t.name == "distgrad-parent-watch")
    watcher.join(10)
    assert not watcher.is_alive() and stop.signum == signal.SIGTERM
    with pytest.raises(Interrupted):
        stop.check()


def _live(pid: int) -> bool:
    """Whether ``pid`` is a process that has not yet exited (a zombie has: its stat state is Z)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.slow       # the watch itself: test_a_stop_flag_told_to_stop_with_its_parent_is_set_once_the_parent_is_gone
def test_distgrad_run_killed_9_stops_its_stages_and_a_rerun_with_resume_ends_bitwise(tmp_path):
    """A launcher killed -9 takes its stages down with it (each saving a checkpoint), so the same command with
    --resume at once holds their checkpoint directory and continues the run bitwise."""
    import time

    ck = tmp_path / "ckpt"
    args = ["run", "tanh-regression", "--steps", "6000", "--checkpoint-dir", ck, "--checkpoint-every", "100",
            "--resume", "--summary", tmp_path / "run.json"]
    with StageProcess(args, tmp_path / "launcher.log", distgrad=True) as launcher:
        deadline = time.monotonic() + 60
        while not list(ck.glob("f-*-000000200.ckpt")) and time.monotonic() < deadline:
            time.sleep(0.01)
        pids = [int((ck / f".{name}.lock").read_text()) for name in ("f", "g")]
        launcher.signal(signal.SIGKILL)
        assert launcher.wait(10) == -signal.SIGKILL, "the run ended before the kill"
    deadline = time.monotonic() + 20
    while any(_live(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_live(pid) for pid in pids), "a stage outlived its launcher"
    again = run_launcher(args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed run" in again.stdout + again.stderr
    reference = run_main(["run", "tanh-regression", "--in-process", "--steps", "6000", "--summary",
                          tmp_path / "ref.json"])
    assert reference.returncode == 0, reference.stderr
    assert read_json(tmp_path / "run.json")["params"] == read_json(tmp_path / "ref.json")["params"]


def test_a_run_finished_on_one_stage_only_is_refused_by_resume_at_once(tmp_path):
    """g stopped after the run's last reply and before its final checkpoint (its checkpoint of the last step
    is missing): f's side of the run is finished and g's is not. ``distgrad run --resume`` says so before
    starting anything, instead of f doing nothing while g waits out its --peer-deadline for it."""
    from distgrad.api import drive_stage, serve_stage

    ck = tmp_path / "ckpt"
    with serve_stage("seed-reverse", checkpoint_dir=ck, steps=30, checkpoint_every=10) as g:
        run = drive_stage("seed-reverse", g.endpoint, checkpoint_dir=ck, steps=30, checkpoint_every=10)["run_id"]
        g.wait(30)
    (ck / f"g-{run}-000000030.ckpt").unlink()
    files = _ckpts(ck)
    again = run_main(["run", "seed-reverse", "--steps", "30", "--checkpoint-dir", ck, "--checkpoint-every", "10",
                      "--resume", "--peer-deadline", "2"])
    assert again.returncode == 2, again.stdout + again.stderr
    assert f"run {run} is finished on f but not on g (newest checkpoint of the run: g step 20)" in again.stderr
    assert "Start without --resume for a new run" in again.stderr and _ckpts(ck) == files
