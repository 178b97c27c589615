"""Local launcher: every stage of an experiment as its own OS process on this machine.

The last stage starts first, binds a free tcp port on 127.0.0.1 (or an ipc
path) and reports the endpoint it got through a ready file; each middle
stage, from the bottom up, binds its own and connects to the one below;
then the driving stage connects to the top. Output of every stage is
streamed with a ``[name]`` prefix. If one stage fails the others are
stopped; on Ctrl-C all are; every child is reaped with a deadline and
nothing is left behind.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

from distgrad.errors import ConfigError, DistgradError, InputGuardStop, StageError
from distgrad.config.defended import check_meter_flag, metered
from distgrad.config.experiment import check_run_settings, client_stage_name
from distgrad.config.horizons import each_warning_once
from distgrad.config.parse import load_experiment, parse_init_overrides
from distgrad.wire.keys import keygen
from distgrad.run.progress import PROGRESS_PREFIX, render_bar
from distgrad.threads import pin_blas_threads
from distgrad.stage.records import (ended_summary, is_special, merge_client_summaries, merge_metrics, merge_summaries, merge_traces, read_json,
                                    write_json)

log = logging.getLogger("distgrad")

READY_TIMEOUT_S = 30.0      # how long the serving stage may take to bind
GUARD_EXIT = 5              # a stage's exit code when its input_guard stopped it (distgrad.cli)
ABORTED_EXIT = 4            # a stage's exit code when its peer refused it or stopped and said why
ABORT_GRACE_S = 2.0         # how long the others then get to exit with their own reason (a guard's stop)
STOP_GRACE_S = 5.0          # after SIGTERM, how long a stage may take to exit before SIGKILL
FINISH_GRACE_S = 30.0       # once one stage has finished, how long the others may take to follow: writing the
                            # summary and parameters and a torch interpreter's exit take seconds on a loaded machine
WAIT_TICK_S = 0.05
FATAL_MARK = " ERROR distgrad: "   # how a stage's log line of the error that ends it reads (cli._guarded, LOG_FORMAT)



def pinned_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with every BLAS pool pinned to one thread.

    Two stages on two cores must not fight over them, and a fixed thread
    count keeps every process's float32 results identical.
    """
    env = dict(os.environ if base is None else base)
    pin_blas_threads(env, override=True)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def stop_process(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> bool:
    """SIGTERM, then SIGKILL after ``grace_s``, then reap (bounded); tolerates a process already gone.

    Returns True if the process had to be signalled (it was still running).
    """
    if proc.poll() is not None:
        return False
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
    except ProcessLookupError:
        pass
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:       # SIGKILLed and still not reaped: nothing more to do
        pass
    return True


class _BarLine:
    """The driving stage's ``progress`` lines drawn as one bar at the bottom of a terminal."""

    def __init__(self, out: IO[str]) -> None:
        self.out, self.text = out, ""
        self.test: dict[str, Any] = {}      # the latest evaluation a line carried, drawn until the next

    def draw(self, payload: str) -> None:
        try:
            p = json.loads(payload)
            rate = p.get("rate")
            if p.get("test_loss") is not None or p.get("validation_loss") is not None:
                self.test = {key: None if value is None else float(value) for key, value in p.items()
                             if key.startswith(("test_", "validation_"))}
            loss = p.get("loss")                  # a non-finite loss arrives as "inf" or "nan" (jsontext)
            self.text = render_bar(int(p["step"]), int(p["steps"]), None if loss is None else float(loss),
                                   None if rate is None else float(rate), self.test)
        except (ValueError, KeyError, TypeError):
            return
        self.redraw()

    def redraw(self) -> None:
        if self.text:
            self.out.write("\r" + self.text + "\x1b[K")
            self.out.flush()

    def clear(self) -> None:
        if self.text:
            self.out.write("\r\x1b[K")

    def close(self) -> None:
        if self.text:
            self.out.write("\n")
            self.out.flush()


class _Child:
    """One stage process whose output is streamed with a prefix."""

    def __init__(self, name: str, argv: Sequence[str], out: IO[str], lock: threading.Lock,
                 bar: "_BarLine | None" = None) -> None:
        self.name, self.bar = name, bar
        self.reason = ""       # the stage's own error, as its last words logged it (``cli``: "ERROR distgrad: ...")
        from distgrad.run.options import PARENT_PID_ENV

        # The stage stops (checkpoint, exit 143) if this launcher dies, even by SIGKILL (``stop_with_parent``).
        env = dict(pinned_env(), **{PARENT_PID_ENV: str(os.getpid())})
        self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, text=True, bufsize=1)
        self._thread = threading.Thread(target=self._pump, args=(out, lock), daemon=True)
        self._thread.start()

    def _pump(self, out: IO[str], lock: threading.Lock) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if FATAL_MARK in line:
                self.reason = line.split(FATAL_MARK, 1)[1].strip()
            with lock:
                if self.bar is not None and line.startswith(PROGRESS_PREFIX):
                    self.bar.draw(line[len(PROGRESS_PREFIX):])
                    continue
                if self.bar is not None:
                    self.bar.clear()
                out.write(f"[{self.name}] {line}")
                if self.bar is not None:
                    self.bar.redraw()
                out.flush()

    def stop(self) -> None:
        stop_process(self.proc)
        self._thread.join(STOP_GRACE_S)


def _stage_source(exp: Any, name: str, experiment: str | Path | Sequence[str | Path]) -> str:
    """The file (or built-in name) stage ``name``'s process reads: its own stage file, else the experiment."""
    if isinstance(experiment, (str, Path)):
        return str(experiment)
    return exp.spec(name).source


def _stage_argv(name: str, experiment: str, flags: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "distgrad.cli", "stage", name, "--experiment", experiment, *flags]


@dataclass(frozen=True)
class PlannedProcess:
    """One stage process of a local run, everything decided but the endpoint of the stage below it.

    ``label`` names the process (``f``, ``g``, ``f@1`` for client 1); ``flags`` are every flag it gets after
    where it binds and connects; ``summary`` and ``trace`` are the files it writes, merged when the run ends.
    A serving process binds ``bind`` and reports the endpoint it got in ``ready``; a driving one has neither.
    """

    label: str
    stage: str
    source: str
    client: int | None
    flags: list[str]
    summary: Path
    trace: Path
    bind: str | None = None
    ready: Path | None = None
    shows_bar: bool = False

    @property
    def driving(self) -> bool:
        return self.bind is None

    def argv(self, below: str | None) -> list[str]:
        """The command line of this process, connecting to ``below`` (None: the last stage, which connects
        nowhere)."""
        if self.driving:
            assert below is not None, "a driving process connects to the stage below it"
            where = ["--connect", below]
        else:
            where = ["--bind", str(self.bind), *(["--connect", below] if below is not None else []),
                     "--ready-file", str(self.ready)]
        return _stage_argv(self.stage, self.source, [*where, *self.flags])


@dataclass(frozen=True)
class LaunchPlan:
    """Every process of a local run, the driving ones (data owners, once per client) first, then the serving
    stages from the top of the chain down; and where each file to merge when the run ends comes from."""

    exp: Any
    processes: list[PlannedProcess]
    metrics: dict[str, Path]        # process label -> the metrics file it writes
    boards: dict[str, Path] = field(default_factory=dict)   # process label -> its TensorBoard folder

    @property
    def drivers(self) -> list[PlannedProcess]:
        return [p for p in self.processes if p.driving]

    @property
    def serving(self) -> list[PlannedProcess]:
        return [p for p in self.processes if not p.driving]


def run_local(experiment: str | Path | Sequence[str | Path], *, steps: int | None = None, seed: int | None = None,
              init: str | None = None, summary_path: str | Path | None = None, trace_path: str | Path | None = None,
              metrics_path: str | Path | None = None, tensorboard_dir: str | Path | None = None,
              transport: str = "tcp", timeout_s: float | None = None, log_level: str = "INFO",
              out: IO[str] | None = None, check_stop: Callable[[], None] = lambda: None, stage_flags: Sequence[str] = (),
              secure: bool = False, driver_flags: Sequence[str] = (), progress_bar: bool = False,
              save_dir: str | Path | None = None, load_dir: str | Path | None = None, activation_codec: str | None = None,
              gradient_codec: str | None = None, privacy_meter: bool = False) -> dict[str, Any]:
    """Run an experiment (a name or file, or several parties' stage files) as one local process per stage;
    return the merged summary. Each stage process reads only its own file.

    ``init`` is the ``--init`` text (``NAME=VALUE,...``). The summary's
    ``params`` holds every stage; ``summary_path`` / ``trace_path`` receive the
    merged files, ``metrics_path`` the driving stage's metrics (with several
    clients: every client's, merged when the run ends, each line with its
    ``client``) and every other process's own beside it (``stage_metrics_path``),
    ``tensorboard_dir`` the driving stage's TensorBoard event files (with
    several clients, client K's in ``tensorboard_dir/f@K``: a run each in TensorBoard) and every
    other process's in ``tensorboard_dir/NAME``. With several clients the summary's top level holds only what
    is true of the whole run and each client's results are in ``clients``
    (``records.merge_client_summaries``). Raises ``ConfigError`` for a bad experiment and
    ``StageError`` naming the stage and its exit code when a stage fails.
    ``check_stop`` is called while waiting; whatever it raises stops both stages.
    ``stage_flags`` are passed to every stage as they are (e.g. ``--checkpoint-every 10``),
    ``driver_flags`` to the driving stage only (e.g. ``--micro-batches 4``; not ``--metrics``).
    With ``progress_bar``, the driving stage's progress is drawn as a bar on ``out``.
    ``save_dir`` receives each stage's final parameters and ``load_dir`` gives
    their initial values (``stage.parameters_file``: ``DIR/f.npz``, ``DIR/g.pt``, ...).
    With ``secure``, fresh CURVE key pairs are made for this run and each
    serving stage accepts only the key of the stage above it. ``activation_codec`` / ``gradient_codec``
    override the experiment's wire codecs (``--activation-codec``, ``--gradient-codec`` of every stage).
    ``privacy_meter`` gives ``--privacy-meter`` to every stage that can meter (``Experiment.metered``).
    """
    exp = load_experiment(experiment).with_codecs(activation_codec, gradient_codec)
    stage_flags = _with_codec_flags(stage_flags, activation_codec, gradient_codec)
    parameter_flags, done = _checked(exp, steps, seed, init, privacy_meter, transport, save_dir, load_dir, stage_flags)
    if done is not None:
        (out or sys.stdout).write(_nothing_to_do(exp, done))
        return done
    with tempfile.TemporaryDirectory(prefix="distgrad-") as tmp_name:
        common = _common_flags(log_level, stage_flags, steps, seed, init, timeout_s)
        plan = plan_processes(exp, experiment, Path(tmp_name), common_flags=common, driver_flags=driver_flags,
                              parameter_flags=parameter_flags, transport=transport, secure=secure,
                              trace=trace_path is not None, privacy_meter=privacy_meter,
                              metrics_path=None if metrics_path is None else Path(metrics_path),
                              tensorboard_dir=None if tensorboard_dir is None else Path(tensorboard_dir),
                              progress_bar=progress_bar)
        return _launch(plan, out or sys.stdout, check_stop, progress_bar, transport, summary_path, trace_path,
                       metrics_path)


def _checked(exp: Any, steps: int | None, seed: int | None, init: str | None, privacy_meter: bool, transport: str,
             save_dir: str | Path | None, load_dir: str | Path | None,
             stage_flags: Sequence[str]) -> tuple[dict[str, list[str]], dict[str, Any] | None]:
    """The launch's checks (``_preflight``): each stage's parameter flags, and the summary of the run when it
    is found finished already (``_finished``), else None. The launch and each stage's options check the run:
    each warning is said once."""
    with each_warning_once():
        clients, parameter_flags = _preflight(exp, steps, seed, init, privacy_meter, transport, save_dir, load_dir)
        return parameter_flags, _finished(exp, clients, steps, seed, init, stage_flags, load_dir)


def _preflight(exp: Any, steps: int | None, seed: int | None, init: str | None, privacy_meter: bool,
               transport: str, save_dir: str | Path | None,
               load_dir: str | Path | None) -> tuple[list[int | None], dict[str, list[str]]]:
    """What ``run_local`` checks and builds before any process starts, in this order: the launch
    (``_check_launch``), the parameter files (``_parameter_flags``), the stages (``_build_stages``) and the
    data (``check_data``); each raises ``ConfigError`` for what it finds wrong. Returns the clients
    (``_clients``) and every stage process's ``--save`` / ``--load`` flags."""
    _check_launch(exp, steps, seed, init, privacy_meter, transport)
    clients = _clients(exp)
    parameter_flags = _parameter_flags(exp, clients, save_dir, load_dir)
    _build_stages(exp, seed, parse_init_overrides(init), clients, load_dir)
    check_data(exp, seed, clients)
    return clients, parameter_flags


def _nothing_to_do(exp: Any, done: dict[str, Any]) -> str:
    """The line ``run_local`` writes when ``--resume`` finds the run ``done`` (``_finished``) already finished."""
    runs = [entry["run_id"] for entry in done["clients"]] if exp.federated else [done["run_id"]]
    return (f"run {', '.join(runs)} finished at step {done['steps']}; nothing to do "
            f"(start without --resume for a new run)\n")


def _with_codec_flags(stage_flags: Sequence[str], activation_codec: str | None,
                      gradient_codec: str | None) -> list[str]:
    """``stage_flags`` and, for each codec given, ``--activation-codec`` / ``--gradient-codec``: every stage
    codes what crosses as the run asks."""
    return [*stage_flags, *(["--activation-codec", activation_codec] if activation_codec is not None else []),
            *(["--gradient-codec", gradient_codec] if gradient_codec is not None else [])]


def _common_flags(log_level: str, stage_flags: Sequence[str], steps: int | None, seed: int | None,
                  init: str | None, timeout_s: float | None) -> list[str]:
    """The flags every stage process gets: ``--log-level``, ``stage_flags``, then ``--steps``, ``--seed``,
    ``--init`` and ``--timeout`` for each of these settings that is not None."""
    common = ["--log-level", log_level, *stage_flags]
    for option, value in (("--steps", steps), ("--seed", seed), ("--init", init), ("--timeout", timeout_s)):
        if value is not None:
            common += [option, str(value)]
    return common


def _launch(plan: LaunchPlan, out: IO[str], check_stop: Callable[[], None], progress_bar: bool, transport: str,
            summary_path: str | Path | None, trace_path: str | Path | None,
            metrics_path: str | Path | None) -> dict[str, Any]:
    """Run ``plan``: its output files checked (``_check_outputs``), its processes started and watched to their
    end (``_start_and_watch``), and the merged summary returned (``_collect``)."""
    _check_outputs(plan, summary_path, trace_path, metrics_path)
    try:
        _start_and_watch(plan, out, check_stop, progress_bar)
    except BaseException as e:      # a stage failed, a peer was lost, a signal: the files still say so
        _collect_ended(plan, transport, summary_path, trace_path, metrics_path, e)
        raise
    return _collect(plan, transport, summary_path, trace_path, metrics_path)


def _check_outputs(plan: LaunchPlan, summary_path: str | Path | None, trace_path: str | Path | None,
                   metrics_path: str | Path | None) -> None:
    """``ConfigError`` when two files the run writes are one: ``--summary``, ``--trace``, ``--metrics`` and the
    metrics each other process writes beside it (``stage_metrics_path``: ``--metrics m.jsonl --summary
    m.g.jsonl`` would lose one of them)."""
    from distgrad.run.options import check_outputs

    beside = [(f"--metrics of process {label} ({path.name}, beside --metrics)", path)
              for label, path in plan.metrics.items() if metrics_path is None or path != Path(metrics_path)]
    outputs = [("--summary", summary_path), ("--trace", trace_path), ("--metrics", metrics_path), *beside]
    check_outputs(outputs)
    _check_boards(plan.boards, outputs)


def _check_boards(boards: Mapping[str, Path], outputs: Sequence[tuple[str, str | Path | None]]) -> None:
    """``ConfigError`` when a process's ``--tensorboard`` folder (``boards``) could not be made: it, or a folder
    above it, is a file (``--tensorboard FILE``), or it is one of the files of ``outputs`` (``--tensorboard tb
    --summary tb/g``): the run would end with that stage's failure, or with its summary lost."""
    for label, folder in boards.items():
        above = folder
        while not above.exists() and above != above.parent:
            above = above.parent
        if not above.is_dir():
            raise ConfigError(f"--tensorboard {folder.parent if above != folder else folder}: "
                              f"{above} is a file, not a folder (process {label} writes its event files in {folder})")
        for what, path in outputs:
            if path is not None and Path(path).resolve() == folder.resolve():
                raise ConfigError(f"{what} {path} is the folder --tensorboard gives process {label}'s event files; "
                                  f"name another file")


def _check_launch(exp: Any, steps: int | None, seed: int | None, init: str | None, privacy_meter: bool,
                  transport: str) -> None:
    """``ConfigError`` for what no process of the run could do: one stage, a bad setting, an unknown
    transport, a privacy meter no stage can run."""
    if len(exp.stage_names) < 2:
        raise ConfigError(f"'distgrad run' launches one process per stage; {exp.name!r} has one stage: "
                          f"use --in-process")
    # The driving stage's flags (--eval-every) are its own: it checks what its evaluations decide.
    check_run_settings(exp, steps=steps, seed=seed, init=parse_init_overrides(init), evaluations_known=False)
    if privacy_meter:
        check_meter_flag(exp)                  # never accepted and ignored
    if transport not in ("tcp", "ipc"):
        raise ConfigError(f"unknown transport {transport!r}: use tcp or ipc")


def _clients(exp: Any) -> list[int | None]:
    """The clients each data owner runs once for: 0, 1, ... with ``[clients]``, else one (None)."""
    return list(range(exp.clients.count)) if exp.federated else [None]


def plan_processes(exp: Any, experiment: str | Path | Sequence[str | Path], tmp: Path, *,
                   common_flags: Sequence[str] = (), driver_flags: Sequence[str] = (),
                   parameter_flags: Mapping[str, list[str]] | None = None, transport: str = "tcp",
                   secure: bool = False, trace: bool = False, privacy_meter: bool = False,
                   metrics_path: Path | None = None, tensorboard_dir: Path | None = None,
                   progress_bar: bool = False) -> LaunchPlan:
    """Decide every process of a local run of ``exp`` without starting one: its stage, the file it reads,
    its flags, the files it writes in ``tmp`` (its summary, trace, ready file, ipc socket, CURVE keys with
    ``secure``). Pure but for the key files; ``run_local`` starts the plan.

    ``common_flags`` go to every process, ``driver_flags`` to the driving ones after them,
    ``parameter_flags`` (process -> ``--save``/``--load``) to each its own. With several clients each writes
    its own metrics in ``tmp`` (merged when the run ends: several writers of one file would tear its lines)
    and its own TensorBoard folder ``tensorboard_dir/f@K``; every process but the first driving one writes
    its metrics beside ``metrics_path`` (``stage_metrics_path``) and its events in ``tensorboard_dir/NAME``.
    """
    files_of = parameter_flags or {}
    processes = stage_processes(exp)                  # (label, stage, client, driving): the drivers first
    labels = [label for label, _, _, driving in processes if driving]
    metrics = ({name: tmp / f"{name}.metrics.jsonl" for name in labels} if exp.federated
               else {labels[0]: metrics_path}) if metrics_path is not None else {}
    boards = ({name: tensorboard_dir / name for name in labels} if exp.federated
              else {labels[0]: tensorboard_dir}) if tensorboard_dir is not None else {}
    for name, _, _, _ in processes:
        if metrics_path is not None and name not in metrics:
            metrics[name] = stage_metrics_path(metrics_path, name)
        if tensorboard_dir is not None and name not in boards:
            boards[name] = tensorboard_dir / name
    # Secure aggregation masks with the parties' CURVE key pairs: it always runs with CURVE.
    curve = (_curve_flags(tmp / "keys", exp, [(label, stage) for label, stage, _, _ in processes])
             if secure or exp.secure_aggregation else {label: [] for label, _, _, _ in processes})
    planned = []
    for label, stage, client, driving in processes:
        summary, trace_file = tmp / f"{label}.summary.json", tmp / f"{label}.trace.jsonl"
        shown = driving and progress_bar and label == labels[0]   # the first data owner draws the bar
        role = ([*([] if client is None else ["--client", str(client)]), *common_flags, *driver_flags,
                 "--progress", "lines" if shown else "off"] if driving else list(common_flags))
        flags = [*role, *curve[label], "--summary", str(summary), *(["--trace", str(trace_file)] if trace else []),
                 *(["--privacy-meter"] if privacy_meter and metered(exp, stage, True) else []),
                 *files_of.get(label, []), *(["--metrics", str(metrics[label])] if label in metrics else []),
                 *(["--tensorboard", str(boards[label])] if label in boards else [])]
        bind = None if driving else ("tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{tmp}/{label}.sock")
        planned.append(PlannedProcess(label, stage, _stage_source(exp, stage, experiment), client, flags, summary,
                                      trace_file, bind, None if driving else tmp / f"{label}.ready", shown))
    return LaunchPlan(exp, planned, metrics, boards)


def _start_and_watch(plan: LaunchPlan, out: IO[str], check_stop: Callable[[], None], progress_bar: bool) -> None:
    """Start the serving stages from the last one up, each connecting to the one below, then every driving
    process; wait until all exit 0. Raises ``StageError`` (or what ``check_stop`` raises) after stopping and
    reaping every process started."""
    lock = threading.Lock()
    children: list[_Child] = []
    try:
        below: str | None = None
        for process in reversed(plan.serving):
            assert process.ready is not None and process.bind is not None, "a serving process binds"
            child = _Child(process.label, process.argv(below), out, lock)
            children.append(child)
            below = _wait_ready(child, process.ready, process.bind, check_stop)
        bar = _BarLine(out) if progress_bar else None
        for process in plan.drivers:
            children.append(_Child(process.label, process.argv(below), out, lock,
                                   bar if process.shows_bar else None))
        _wait_all(children, check_stop)
    finally:
        for child in reversed(children):
            child.stop()
        for child in children:
            if child.bar is not None:
                child.bar.close()


def _collect(plan: LaunchPlan, transport: str, summary_path: str | Path | None, trace_path: str | Path | None,
             metrics_path: str | Path | None) -> dict[str, Any]:
    """The run's summary, merged from every process's (several clients: each client's results in
    ``clients``), written to ``summary_path``; the processes' traces merged into ``trace_path`` and, with
    several clients, their metrics into ``metrics_path``."""
    exp, processes = plan.exp, plan.processes
    summaries = [read_json(p.summary) for p in processes]
    mode = "two-process" if len(processes) == 2 else f"{len(processes)}-process"
    if exp.federated:
        summary = merge_client_summaries(summaries[:-1], summaries[-1], mode=mode, transport=transport)
    else:
        summary = merge_summaries(summaries)
        summary.update(mode=mode, transport=transport)
    if summary_path is not None:
        write_json(summary_path, summary)
    if trace_path is not None:
        merge_traces([p.trace for p in processes], trace_path, [p.client for p in processes])
    if exp.federated and metrics_path is not None:
        merge_metrics([plan.metrics[p.label] for p in plan.drivers], metrics_path, list(range(exp.clients.count)))
    return summary


def _collect_ended(plan: LaunchPlan, transport: str, summary_path: str | Path | None,
                   trace_path: str | Path | None, metrics_path: str | Path | None, error: BaseException) -> None:
    """After a run ended on ``error`` (every process stopped): ``summary_path`` gets a summary saying how it
    ended (``records.ended_summary``: ``status``, ``error``, and the figures of the processes that wrote a
    summary), and ``trace_path`` and, with several clients, ``metrics_path`` the lines the processes wrote
    (those that wrote a file). Best effort: a file that cannot be written is logged, and ``error`` is what
    the command ends with."""
    exp, processes = plan.exp, plan.processes
    mode = "two-process" if len(processes) == 2 else f"{len(processes)}-process"
    parts, clients = [], {}
    for process in processes:
        try:
            parts.append(read_json(process.summary))
        except (OSError, ValueError):       # none written (the process was killed, or failed before it)
            continue
        if exp.federated and process.client is not None:
            clients[process.client] = parts[-1]
    written = [p for p in processes if p.trace.is_file()]
    metrics = [(plan.metrics[p.label], k) for k, p in enumerate(plan.drivers)
               if p.label in plan.metrics and Path(plan.metrics[p.label]).is_file()]
    try:
        if summary_path is not None:
            write_json(summary_path, ended_summary(parts, exp.name, error, clients if exp.federated else None,
                                                      mode=mode, transport=transport))
        if trace_path is not None and written:
            merge_traces([p.trace for p in written], trace_path, [p.client for p in written], cut_short=True)
        if exp.federated and metrics_path is not None and metrics:
            merge_metrics([path for path, _ in metrics], metrics_path, [k for _, k in metrics], cut_short=True)
    except (DistgradError, OSError) as e:
        log.error("the files of the run that ended could not all be written: %s", e)


def stage_metrics_path(metrics_path: Path, name: str) -> Path:
    """Where ``distgrad run --metrics PATH`` puts the metrics of process ``name`` that is not the (first)
    driving stage: ``metrics.jsonl`` -> ``metrics.g.jsonl``; a device such as ``/dev/null`` takes them all
    (``records.is_special``: no file is made beside it)."""
    if is_special(metrics_path):
        return metrics_path
    return metrics_path.with_name(f"{metrics_path.stem}.{name}{metrics_path.suffix}")


def _build_stages(exp: Any, seed: int | None, init: Mapping[str, float], clients: Sequence[int | None],
                  load_dir: str | Path | None) -> None:
    """Build here, before any stage starts, every torch stage (import its module, make it, its optimizer,
    scheduler and loss, check its output against the cut with a forward of zeros) and every stage given a
    ``--load`` file, loading that file into it (its names, shapes and dtypes must be the stage's own). A bad
    one is a ``ConfigError`` (exit 2) naming it, not a stage process that exits after the others started.
    The numpy stages were built when the file was loaded."""
    from distgrad.stage.stage import Stage, parameters_file

    instances: dict[str, list[str]] = {stage: [] for stage in exp.stage_names}
    for instance, stage, _ in _driving_processes(exp, clients):
        instances[stage].append(instance)
    for name in exp.stage_names:
        instances[name] = instances[name] or [name]
    for spec in exp.stages:
        loads = [parameters_file(load_dir, instance, exp, spec.name) for instance in instances[spec.name]
                 ] if load_dir is not None else []
        if spec.framework == "torch" or loads:
            built = Stage.from_experiment(exp, spec.name, seed, init)
            for path in loads:
                built.load_parameters(path)


def check_data(exp: Any, seed: int | None, clients: Sequence[int | None] = (None,),
               stages: Sequence[str] | None = None) -> None:
    """Read here, before any stage starts, the whole data of every stage these files define that holds data
    (each data owner once per client, with its share of the rows; the label owner; a vertical experiment's
    every party), or of ``stages`` only: every feature, label and ID the run will use. A bad file, a field
    that is no finite number (a word among the labels, say) or a label that is no class id is a
    ``ConfigError`` (exit 2) naming the file, line and column, not a stage that fails after the others
    started."""
    holders = [*exp.data_owners, exp.label_owner, exp.stage_names[-1] if exp.own_bottom else exp.label_owner]
    for name in dict.fromkeys(holders):
        if not exp.has_stage(name) or (stages is not None and name not in stages):
            continue                    # another party's stage file: it checks its own data
        for client in (clients if name in exp.data_owners else [None]):
            exp.build_data(seed, client, stage=name).check_readable()


def stage_processes(exp: Any) -> list[tuple[str, str, int | None, bool]]:
    """``(process, stage, client, driving)`` of every process ``run_local`` starts for ``exp``: the data
    owners (once per client) driving, then the serving stages."""
    clients = _clients(exp)
    return ([(label, stage, client, True) for label, stage, client in _driving_processes(exp, clients)]
            + [(name, name, None, False) for name in exp.stage_names if name not in exp.data_owners])


def _driving_processes(exp: Any, clients: Sequence[int | None]) -> list[tuple[str, str, int | None]]:
    """``(process, stage, client)`` of every driving process: each data owner once per client."""
    return [(client_stage_name(owner, c), owner, c) for owner in exp.data_owners for c in clients]


def _parameter_flags(exp: Any, clients: Sequence[int | None], save_dir: str | Path | None,
                     load_dir: str | Path | None) -> dict[str, list[str]]:
    """``--save FILE`` / ``--load FILE`` for every stage process (``stage.parameters_file``); ``ConfigError``
    before anything starts when a file to load is missing or the folder to save in cannot be written."""
    from distgrad.stage.stage import check_parameter_files, make_save_dir, parameters_file

    processes = [(label, stage) for label, stage, _ in _driving_processes(exp, clients)]
    processes += [(name, name) for name in exp.stage_names if name not in exp.data_owners]
    flags: dict[str, list[str]] = {}
    make_save_dir(save_dir)
    for instance, stage in processes:
        save = parameters_file(save_dir, instance, exp, stage) if save_dir is not None else None
        load = parameters_file(load_dir, instance, exp, stage) if load_dir is not None else None
        check_parameter_files(save, load, False)
        flags[instance] = [*(["--save", str(save)] if save else []), *(["--load", str(load)] if load else [])]
    return flags


def _finished(exp: Any, clients: Sequence[int | None], steps: int | None, seed: int | None, init: str | None,
              stage_flags: Sequence[str], load_dir: str | Path | None = None) -> dict[str, Any] | None:
    """With ``--resume --checkpoint-dir DIR`` in ``stage_flags``: when every stage that keeps
    checkpoints would resume a finished run, the merged summary of its final checkpoints; else None."""
    from distgrad.run.options import StageOptions
    from distgrad.stage.stage import parameters_file
    from distgrad.run.stage_state import is_finished, nothing_to_do, resumed_checkpoint

    flags = list(stage_flags)
    if "--resume" not in flags or "--checkpoint-dir" not in flags[:-1]:
        return None
    directory = Path(flags[flags.index("--checkpoint-dir") + 1])
    overrides = parse_init_overrides(init)
    summaries = []
    stages = [(stage, client) for _, stage, client in _driving_processes(exp, clients)]
    if not exp.federated:               # the serving stage of several clients keeps no checkpoints
        stages += [(name, None) for name in exp.stage_names if name not in exp.data_owners]
    finished = []
    for name, client in stages:         # every stage's checkpoints are read (a pickled one refused) before any starts
        instance = client_stage_name(name, client)
        opts = StageOptions(exp, name, exp.seed if seed is None else seed, overrides, steps, checkpoint_dir=directory,
                            resume=True, client=client,
                            load_path=parameters_file(load_dir, instance, exp, name) if load_dir else None)
        ckpt = resumed_checkpoint(opts)
        finished.append((opts, ckpt if ckpt is not None and is_finished(ckpt, opts) else None, ckpt))
    _check_ended_alike(finished)
    for opts, ckpt, _ in finished:
        if ckpt is None:
            return None
        summaries.append(nothing_to_do(opts, ckpt))
    if exp.federated:
        return merge_client_summaries(summaries, None, mode="finished earlier")
    summary = merge_summaries(summaries)
    losses = [s["final_loss"] for s in summaries if isinstance(s.get("final_loss"), float)]
    # A data owner whose label owner withheld the training loss reports none (``training_loss`` says so), as the
    # completed run's merged summary did, rather than the label owner's own loss.
    summary.update(mode="finished earlier", final_loss=None if "training_loss" in summary
                   else losses[0] if losses else float("nan"))
    return summary


def _check_ended_alike(stages: Sequence[tuple[Any, Any, Any]]) -> None:
    """``ConfigError`` when a run that ``--resume`` would take up is finished on some stages and not on others
    (``stages``: each one's options, its finished checkpoint or None, the checkpoint it would resume or None):
    a stage stopped after the run's last reply and before its final checkpoint. The finished ones would do
    nothing and the others wait out ``--peer-deadline`` for them, so it is said at once."""
    done = {opts.instance: ckpt for opts, ckpt, _ in stages if ckpt is not None}
    open_ = {opts.instance: ckpt for opts, finished, ckpt in stages if finished is None and ckpt is not None
             and any(ckpt.run == other.run for other in done.values())}
    if done and open_:
        run = next(iter(open_.values())).run
        raise ConfigError(
            f"--resume: run {run} is finished on {', '.join(sorted(done))} but not on {', '.join(sorted(open_))} "
            f"(newest checkpoint of the run: " + ", ".join(f"{name} step {c.step}" for name, c in sorted(open_.items()))
            + "): a stage was stopped after the run's last reply and before its final checkpoint, so the run "
            "cannot end again from these checkpoints. Start without --resume for a new run (the run's files stay "
            "in --checkpoint-dir)")


def _curve_flags(directory: Path, exp: Any, processes: Sequence[tuple[str, str]]) -> dict[str, list[str]]:
    """Fresh CURVE key pairs: each serving stage accepts only the keys of the processes above it.

    ``processes`` are ``(process, stage)``: the data owners' processes (one per
    client, or every feature party), then the serving stages (named as their
    stage); every process gets its own key pair.
    """
    last = exp.stage_names[-1]
    keys: dict[str, tuple[Path, Path]] = {}
    for process, stage in processes:
        # A process's pair is made in the allow directory of the stage below it (the last one's anywhere).
        where = directory / f"allowed-by-{exp.downstream(stage)}" if stage != last else directory
        keys[process] = keygen(where, process.replace("@", ".client"))   # a client's "f@0": key "f.client0"
    flags = {}
    for process, stage in processes:
        flags[process] = ["--curve-secret", str(keys[process][1])]
        if stage not in exp.data_owners:
            flags[process] += ["--allow", str(directory / f"allowed-by-{process}")]
        if stage != last:
            flags[process] += ["--server-key", str(keys[exp.downstream(stage)][0])]
        if exp.secure_aggregation and stage in exp.data_owners:     # the other parties' public keys
            flags[process] += ["--party-keys", str(directory / f"allowed-by-{last}")]
    return flags


def _wait_ready(child: _Child, ready: Path, bind: str, check_stop: Callable[[], None]) -> str:
    """The endpoint a serving stage reports in its ready file; raises ``StageError`` if it exits or is late."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.exists():
        check_stop()
        if child.proc.poll() is not None:
            raise StageError(f"stage {child.name} exited with code {child.proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise StageError(f"stage {child.name} did not bind {bind} within {READY_TIMEOUT_S:g} s")
        time.sleep(WAIT_TICK_S)
    return ready.read_text().strip()


def _wait_all(children: list[_Child], check_stop: Callable[[], None]) -> None:
    """Wait until every child exits 0; raise ``StageError`` as soon as one fails.

    Once one stage has finished, the others get ``FINISH_GRACE_S`` to follow
    (the server exits after the driver's bye; the driver writes its summary
    and parameters after the last reply), then ``StageError`` names them.
    """
    first_done: float | None = None
    aborted_at: float | None = None       # when a stage exited because its peer stopped and told it why
    while True:
        check_stop()
        codes = [child.proc.poll() for child in children]
        for child, code in zip(children, codes):     # a guard's stop first: the other stage fails because of it
            if code == GUARD_EXIT:
                raise InputGuardStop(f"stage {child.name} stopped the run: its input_guard found its activations "
                                     f"invertible beyond its max_r2 (its log says the step and the R^2)")
        for child, code in zip(children, codes):
            if code not in (None, 0):
                if code == ABORTED_EXIT and aborted_at is None and None in codes:
                    aborted_at = time.monotonic()    # told by a peer that stopped: let that peer say why
                if aborted_at is not None and time.monotonic() - aborted_at < ABORT_GRACE_S and None in codes:
                    break
                # Its own words: the reason a stage below gave, naming the stage that stopped, reaches the user.
                raise StageError(f"stage {child.name} failed with exit code {code}"
                                 + (f": {child.reason}" if child.reason else ""))
        if all(code == 0 for code in codes):
            return
        if any(code == 0 for code in codes):
            first_done = first_done or time.monotonic()
            if time.monotonic() - first_done > FINISH_GRACE_S:
                late = [c.name for c, code in zip(children, codes) if code is None]
                raise StageError(f"stage(s) {late} still running long after the others finished")
        time.sleep(WAIT_TICK_S)
