"""What a stage process is told: ``StageOptions`` (the command line, validated) and ``StopFlag``.

Signal handlers only set a flag (``StopFlag``); the loops check it at least
every ``transport.POLL_TICK_S``.
"""

from __future__ import annotations

import errno
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Any, Callable, Mapping, Sequence

from distgrad.errors import ConfigError, Interrupted
from distgrad.config.defended import meter_kind, metered
from distgrad.config.experiment import AUTO_STALENESS, Experiment, check_run_settings, client_stage_name
from distgrad.wire.link import LinkSettings
from distgrad.run.progress import check_tensorboard
from distgrad.stage.records import check_trace_filter
from distgrad.stage.stage import Stage, check_parameter_files
from distgrad.wire.transport import DEFAULT_TIMEOUT_S, MAX_LIVENESS_S, SocketSecurity, check_spin

PROGRESS_UPDATES = 10              # progress lines per run on the driving stage
DEFAULT_LIVENESS_S = 10.0          # a client silent this long is reported lost (its state is kept)
DEFAULT_PEER_DEADLINE_S = 60.0     # how long a stage waits for a lost peer to come back
SCHEDULES = ("gpipe", "1f1b")      # gpipe: every micro-batch in flight; 1f1b: --in-flight of them
DEFAULT_IN_FLIGHT = 2              # 1f1b: micro-batches in flight unless --in-flight says otherwise
PARENT_PID_ENV = "DISTGRAD_PARENT_PID"   # set by ``distgrad run`` for its stage processes: the launcher's pid
PARENT_POLL_S = 0.2                # how often a stage of ``distgrad run`` checks that its launcher is alive


def check_wait(name: str, value: Any) -> float:
    """A bound on a wait (a timeout, a liveness window, a peer deadline), one rule for the daemons' flags and
    the cut library's arguments: a number of seconds > 0 and finite, since every wait is bounded (an infinite
    one would hang on a dead peer), and for a liveness (``name`` says so) at most ``MAX_LIVENESS_S``, which
    the ZeroMQ heartbeat can carry. ``ConfigError`` naming ``name`` and the value otherwise."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ConfigError(f"{name} must be > 0 seconds and finite (every wait is bounded), got {value!r}")
    if "liveness" in name and value > MAX_LIVENESS_S:      # the heartbeat's time-to-live on the wire
        raise ConfigError(f"{name} must be at most {MAX_LIVENESS_S:g} seconds (the longest ZeroMQ heartbeat), "
                          f"got {value!r}")
    return value


def check_outputs(outputs: Sequence[tuple[str, str | Path | None]],
                  inputs: Sequence[tuple[str, str | Path]] = ()) -> None:
    """``ConfigError``, before anything runs, for ``outputs`` (what writes it, e.g. ``--summary``, and its path;
    None: not written) that could not all be written: two of them one file (each would overwrite the other, one
    would be lost), one of them a file the command reads (``inputs``: what it is, e.g. ``the trace``, and its
    path; writing it would destroy it), a path that is a folder, or one whose folder cannot be made or written
    (a file in its way)."""
    check_not_read(outputs, inputs)
    seen: dict[Path, str] = {}
    for what, path in outputs:
        if path is None:
            continue
        where = Path(path).resolve()
        if where.exists() and not where.is_file():
            continue                  # a device such as /dev/null takes every output; a folder is refused below
        if where in seen:
            raise ConfigError(f"{seen[where]} and {what} both name {path}: each output needs a file of its own "
                              f"(one would overwrite the other)")
        seen[where] = what
    for what, path in outputs:
        if path is not None:
            _check_writable(what, Path(path))


def check_not_read(outputs: Sequence[tuple[str, str | Path | None]], inputs: Sequence[tuple[str, str | Path]]) -> None:
    """``ConfigError`` when one of ``outputs`` (``check_outputs``) is one of the files the command reads
    (``inputs``: what it is, e.g. ``the trace``, and its path): writing it would destroy it."""
    for what, path in outputs:
        for read, source in inputs:
            if path is not None and Path(path).is_file() and Path(source).is_file() \
                    and os.path.samefile(path, source):
                raise ConfigError(f"{what} {path} is {read} this command reads: writing it would destroy it; "
                                  f"name another file")


def _check_writable(what: str, path: Path) -> None:
    """``ConfigError`` unless ``path`` can be written: not a folder, and its nearest existing ancestor (the
    folders between are made when it is written) a folder this process may write in, on a mount that is not
    read-only (as root, ``os.access`` says yes to a read-only mount)."""
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a folder; name a file")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"cannot write {what} {path}: {folder} is a file, not a folder")
    read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    if read_only or not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        reason = os.strerror(errno.EROFS if read_only else errno.EACCES)
        raise ConfigError(f"cannot write {what} {path}: the folder {folder} is not writable: {reason}")


def check_in_flight(in_flight: Any, micro_batches: int, schedule: str, staleness: Any = 0) -> None:
    """``--in-flight N`` (None: the default) for ``schedule`` with ``micro_batches`` M: an integer from 1 to M,
    and only with 1f1b (gpipe keeps all M in flight) in lockstep (``staleness`` 0: with steps in flight every
    micro-batch of a step is sent at once). Raises ``ConfigError`` naming the bad value."""
    if in_flight is None:
        return
    if staleness:
        raise ConfigError(f"--in-flight is for lockstep runs: with staleness {staleness} every micro-batch of a step "
                          f"is sent at once, so a window of {in_flight!r} would not apply (drop --in-flight, or "
                          f"use staleness 0)")
    if schedule != "1f1b":
        raise ConfigError(f"--in-flight is for the 1f1b schedule; {schedule} keeps all {micro_batches} "
                          f"micro-batches in flight (drop --in-flight or use --schedule 1f1b)")
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
        raise ConfigError(f"--in-flight must be an integer >= 1, got {in_flight!r}")
    if in_flight > micro_batches:
        raise ConfigError(f"--in-flight {in_flight} is more than the {micro_batches} micro-batch(es) of a step: "
                          f"give at most --micro-batches (or more micro-batches)")


class StopFlag:
    """Set by SIGINT/SIGTERM; ``check()`` raises ``Interrupted`` once set."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> "StopFlag":
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def check(self) -> None:
        if self.signum is not None:
            raise Interrupted(self.signum)

    def stop_with_parent(self, parent_pid: int) -> "StopFlag":
        """Be set as by SIGTERM once process ``parent_pid`` is no longer this process's parent: it died (even
        by SIGKILL) and this orphan was handed to another. A daemon thread checks every ``PARENT_POLL_S``;
        the stage then stops as on SIGTERM (a checkpoint, exit 143) instead of running on unseen, holding
        its checkpoint directory's lock against the launcher's rerun."""
        def watch() -> None:
            while self.signum is None:
                if os.getppid() != parent_pid:
                    self.signum = signal.SIGTERM
                    return
                time.sleep(PARENT_POLL_S)

        threading.Thread(target=watch, name="distgrad-parent-watch", daemon=True).start()
        return self


@dataclass
class StageOptions:
    """What both daemons take from the command line (see ``distgrad-stage --help``)."""

    experiment: Experiment
    stage: str
    seed: int
    init: Mapping[str, float] = field(default_factory=dict)
    steps: int | None = None
    summary_path: Path | None = None
    trace_path: Path | None = None
    trace_params: AbstractSet[str] | None = None   # names kept in the trace (None: all)
    trace_every: int = 1               # trace the steps that are multiples of this, and the last
    timeout_s: float = DEFAULT_TIMEOUT_S
    liveness_s: float = DEFAULT_LIVENESS_S
    peer_deadline_s: float = DEFAULT_PEER_DEADLINE_S
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0          # 0: only on SIGTERM/SIGINT (when a directory is given)
    resume: bool = False
    security: SocketSecurity | None = None
    downstream_security: SocketSecurity | None = None   # middle stage: for its connection to the stage below
    micro_batches: int = 1             # driving stage: micro-batches per step
    schedule: str = "1f1b"             # driving stage: "gpipe" or "1f1b"
    in_flight: int | None = None       # driving stage, 1f1b: micro-batches in flight (None: DEFAULT_IN_FLIGHT)
    staleness: int | str | None = None   # driving stage: steps in flight (None: the experiment's; 0: lockstep;
                                         # AUTO_STALENESS: chosen from the link, run/autostaleness.py)
    metrics_path: Path | None = None   # one JSON line per step (a serving stage: its own, progress.StageRecords)
    tensorboard_dir: Path | None = None   # the same as TensorBoard scalars (tensorboardX)
    eval_every: int | None = None      # driving stage: evaluate every K steps (None: the experiment's; 0: at the end)
    progress: str = "off"              # driving stage: "bar", "lines" (for a launcher) or "off"
    client: int | None = None          # driving stage of an experiment with [clients]: which data owner
    spin_s: float = 0.0                # spin this long for a message before blocking (transport.poll_frames)
    save_path: Path | None = None      # write the final parameters here (--save)
    load_path: Path | None = None      # start from the parameters in this file (--load)
    privacy_meter: bool = False        # --privacy-meter: meter what this stage sends (see Experiment.metered)
    party_keys: Path | None = None     # a feature party of secure aggregation: the other parties' NAME.key files
    # Builds this stage (again on a rollback to step 0) instead of the experiment's table,
    # e.g. ``lambda: TorchStage.from_module(...)`` for a hand-written module (Python API only).
    stage_factory: Callable[[], Stage] | None = None
    trains: bool = True                # False: the stage serves predictions (no training run to check)

    @property
    def role(self) -> str:
        """``"driving"``, ``"serving"`` or ``"middle"`` (``Experiment.role``)."""
        return self.experiment.role(self.stage)

    @property
    def total_steps(self) -> int:
        """The steps of the run: ``--steps``, else the experiment's."""
        return self.experiment.steps if self.steps is None else self.steps

    @property
    def auto_staleness(self) -> bool:
        """``--staleness auto``: the driving stage chooses S after its first step (run/autostaleness.py)."""
        return self.staleness == AUTO_STALENESS

    @property
    def follows_steps(self) -> bool:
        """Whether the run's steps are the ones the driving stage's hello says, not this stage's own: a stage
        serving one data owner, or a middle stage, started without ``--steps`` (its file's steps are then only
        the driver's default; a stage serving several clients or parties counts the steps itself)."""
        exp = self.experiment
        return (self.steps is None and self.stage in exp.stage_names and exp.role(self.stage) != "driving"
                and not (exp.federated or exp.vertical))

    @property
    def steps_in_flight(self) -> int:
        """The driving stage's staleness S: ``--staleness``, else the experiment's (0: lockstep); with
        ``--staleness auto`` 0, that of the first step, after which the driver chooses S."""
        if self.auto_staleness:
            return 0
        return self.experiment.staleness if self.staleness is None else int(self.staleness)

    @property
    def evaluate_every(self) -> int:
        """Evaluate the held-out rows after every K-th step: ``--eval-every``, else the experiment's (0: only
        after the last step)."""
        return self.experiment.eval_every if self.eval_every is None else self.eval_every

    @property
    def meter_kind(self) -> str | None:
        """What this stage's privacy meter guards (``"labels"``, ``"inputs"``), or None without a meter."""
        exp = self.experiment
        return meter_kind(exp, self.stage) if metered(exp, self.stage, self.privacy_meter) else None

    @property
    def window(self) -> int:
        """Micro-batches the driving stage keeps in flight: all for gpipe, else ``--in-flight`` (default two),
        never more than a step has. Its forward caches are held for at most this many at a time."""
        if self.schedule == "gpipe":
            return self.micro_batches
        return min(self.micro_batches, DEFAULT_IN_FLIGHT if self.in_flight is None else self.in_flight)

    @property
    def link(self) -> LinkSettings:
        """The bounds of this stage's connection to the stage below."""
        return LinkSettings(self.instance, self.timeout_s, self.liveness_s, self.peer_deadline_s, self.spin_s,
                            relays=self.experiment.relays_below(self.stage))

    @property
    def instance(self) -> str:
        """This process's name in logs, checkpoints and summaries: the stage, or ``f@2`` for client 2."""
        return client_stage_name(self.stage, self.client)

    def _check_follows_the_hello(self) -> None:
        """Raise ``ConfigError`` naming the pipeline settings given to a stage that is not the driving one: it
        takes micro-batches, staleness and evaluations from the driving stage's hello, so they would be
        accepted and not applied (``micro_batches`` may be 1, the default, or the experiment's)."""
        given = [name for name, value, default in (("staleness", self.staleness, None),
                                                   ("in_flight", self.in_flight, None),
                                                   ("schedule", self.schedule, "1f1b"),
                                                   ("eval_every", self.eval_every, None)) if value != default]
        if self.micro_batches not in (1, self.experiment.micro_batches):
            given.insert(0, "micro_batches")
        if given:
            raise ConfigError(f"{', '.join(given)}: stage {self.stage!r} is the {self.role} stage, which follows the "
                              f"driving stage's hello; give the pipeline settings to the driving stage only")

    def __post_init__(self) -> None:
        exp = self.experiment
        driving = self.stage in exp.stage_names and exp.role(self.stage) == "driving"
        check_run_settings(exp, steps=self.steps, seed=self.seed, micro_batches=self.micro_batches,
                           init=self.init, checkpoint_dir=self.checkpoint_dir,
                           checkpoint_every=self.checkpoint_every, resume=self.resume, eval_every=self.eval_every,
                           staleness=self.staleness, evaluations_known=driving,   # else the hello's
                           steps_known=not self.follows_steps, trains=self.trains)
        if self.resume and self.checkpoint_dir is None:
            raise ConfigError("--resume needs --checkpoint-dir")
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ConfigError("--checkpoint-every needs --checkpoint-dir")
        check_spin(self.spin_s)
        check_parameter_files(self.save_path, self.load_path, bool(self.init))
        check_outputs([("--summary", self.summary_path), ("--trace", self.trace_path),
                       ("--metrics", self.metrics_path), ("--save", self.save_path)])
        if self.tensorboard_dir is not None:
            check_tensorboard()                    # ConfigError naming the extra to install
        if self.trace_params is not None or self.trace_every != 1:
            # A stage built in code (stage_factory) may name its parameters as it likes.
            known = (self.trace_params if self.stage_factory is not None
                     else self.experiment.known_param_names(self.trace_params, self.seed))
            check_trace_filter(self.trace_params, self.trace_every, known or set(), self.trace_path is not None)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        check_in_flight(self.in_flight, self.micro_batches, self.schedule,
                        self.experiment.staleness if self.staleness is None else self.staleness)
        exp = self.experiment
        if exp.role(self.stage) != "driving":      # an unknown stage name fails here, naming the stages
            self._check_follows_the_hello()
        if self.privacy_meter:
            meter_kind(exp, self.stage)            # a stage that cannot meter is refused, with the reason
        if exp.federated and exp.stage_index(self.stage) == 0:
            if self.client is None or not 0 <= self.client < exp.clients.count:
                raise ConfigError(f"experiment {exp.name!r} has {exp.clients.count} clients: give --client 0 to "
                                  f"{exp.clients.count - 1} (which data owner this is)")
        elif self.client is not None:
            raise ConfigError(f"--client is for the first stage of an experiment with [clients]; "
                              f"{exp.name!r} stage {self.stage!r} is not one")
        for name in ("timeout_s", "liveness_s", "peer_deadline_s"):
            check_wait(f"--{name[:-2].replace('_', '-')}", getattr(self, name))
