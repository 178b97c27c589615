"""What both stage daemons share: options, stop flag, a stage's rollback-able state.

The serving loop is in ``server.py``, the driving loop in ``driver.py``.
Reliability (docs/reliability.md): a repeated forward gets the cached reply
and no second update; the driver retries a timed-out request on a fresh
socket until ``peer_deadline_s``; on every (re)connect both stages roll back
to the newest step they both hold (a checkpoint, their live state, or the
initial state at step 0), so a run interrupted anywhere ends with the
parameters of an uninterrupted one. Signal handlers only set a flag
(``StopFlag``); the loops check it at least every ``transport.POLL_TICK_S``.
"""


from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Any, Callable, Mapping

import numpy as np

from . import wire
from .checkpoint import Checkpoint, CheckpointStore, StageLock, lock_stage
from .errors import CheckpointWriteError, ConfigError, Interrupted, ProtocolError, StageError
from .experiment import Experiment, check_run_settings
from .losses import build_loss
from .records import TraceWriter, check_trace_filter, to_lists, write_json
from .stage import Stage, client_stage_name
from .transport import DEFAULT_TIMEOUT_S, SocketSecurity, check_spin
from .wire import ErrorCode

PROGRESS_UPDATES = 10              # progress lines per run on the driving stage
DEFAULT_LIVENESS_S = 10.0          # a client silent this long is reported lost (its state is kept)
DEFAULT_PEER_DEADLINE_S = 60.0     # how long a stage waits for a lost peer to come back
RETRY_BACKOFF_S = (0.1, 2.0)       # first and largest pause between reconnection attempts
SCHEDULES = ("gpipe", "1f1b")      # gpipe: every micro-batch in flight; 1f1b: two


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
    metrics_path: Path | None = None   # driving stage: one JSON line of timings per step
    progress: str = "off"              # driving stage: "bar", "lines" (for a launcher) or "off"
    client: int | None = None          # driving stage of an experiment with [clients]: which data owner
    spin_s: float = 0.0                # spin this long for a message before blocking (transport.poll_frames)
    # Builds this stage (again on a rollback to step 0) instead of the experiment's table,
    # e.g. ``lambda: TorchStage.from_module(...)`` for a hand-written module (Python API only).
    stage_factory: Callable[[], Stage] | None = None

    @property
    def instance(self) -> str:
        """This process's name in logs, checkpoints and summaries: the stage, or ``f@2`` for client 2."""
        return client_stage_name(self.stage, self.client)

    def __post_init__(self) -> None:
        check_run_settings(self.experiment, steps=self.steps, seed=self.seed, micro_batches=self.micro_batches,
                           init=self.init, checkpoint_dir=self.checkpoint_dir,
                           checkpoint_every=self.checkpoint_every, resume=self.resume)
        if self.resume and self.checkpoint_dir is None:
            raise ConfigError("--resume needs --checkpoint-dir")
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ConfigError("--checkpoint-every needs --checkpoint-dir")
        check_spin(self.spin_s)
        if self.trace_params is not None or self.trace_every != 1:
            # A stage built in code (stage_factory) may name its parameters as it likes.
            known = (self.trace_params if self.stage_factory is not None
                     else self.experiment.all_param_names(self.seed))
            check_trace_filter(self.trace_params, self.trace_every, known or set(), self.trace_path is not None)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        exp = self.experiment
        if exp.federated and exp.stage_index(self.stage) == 0:
            if self.client is None or not 0 <= self.client < exp.clients.count:
                raise ConfigError(f"experiment {exp.name!r} has {exp.clients.count} clients: give --client 0 to "
                                  f"{exp.clients.count - 1} (which data owner this is)")
        elif self.client is not None:
            raise ConfigError(f"--client is for the first stage of an experiment with [clients]; "
                              f"{exp.name!r} stage {self.stage!r} is not one")
        if exp.federated and exp.stage_index(self.stage) > 0 and (self.checkpoint_dir is not None or self.resume):
            raise ConfigError("a serving stage with several clients keeps no checkpoints (yet): drop "
                              "--checkpoint-dir/--resume there; the clients can still use them")
        for name in ("timeout_s", "liveness_s", "peer_deadline_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name[:-2].replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")


def micro_shape(shape: tuple[int, ...], count: int) -> tuple[int, ...]:
    return shape if count == 1 else (shape[0] // count, *shape[1:])


def target_spec(exp: Experiment, seed: int) -> tuple[tuple[int, ...], np.dtype] | None:
    """Shape and dtype of a whole batch's targets when they travel downstream, else None."""
    if not exp.labels_travel:
        return None
    loss = build_loss(exp.stages[-1].loss)
    return loss.target_shape(exp.input_shapes(exp.build_data(seed), seed)[-1]), loss.target_dtype


def tensor_specs(stage: Stage, target: tuple[tuple[int, ...], np.dtype] | None,
                 micro_batches: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The tensors a forward of one micro-batch to ``stage`` must carry (``target``: see ``target_spec``)."""
    specs = {"activation": (micro_shape(stage.input_shape, micro_batches), np.dtype(np.float32))}
    if target is not None:
        specs["target"] = (micro_shape(target[0], micro_batches), np.dtype(target[1]))
    return specs


def frame_limit(specs: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> tuple[int, int]:
    """(largest frame ZeroMQ may accept, total tensor bytes) for these tensors."""
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs.values()]
    return max([wire.HEADER_MAX_BYTES, *sizes]), sum(sizes)


class StageState:
    """A stage with its run id, checkpoints and trace: what rolls back together.

    Step 0 (the initial state) is always held: it is rebuilt from the seed and
    the ``--init`` overrides, which a restart repeats.
    """

    def __init__(self, opts: StageOptions) -> None:
        self.opts = opts
        self.stage = self._fresh()
        self.run_id = ""
        self.owner = ""          # CURVE key of the client that opened the run ("" in plaintext)
        self.cpu_started = time.process_time()   # CPU time of this process when the run began here
        # A checkpoint is only valid for the same starting point: seed and --init overrides.
        self.meta = {"seed": opts.seed, "init": dict(sorted(opts.init.items()))}
        self.store = (CheckpointStore(opts.checkpoint_dir, opts.instance, opts.experiment.fingerprint, self.meta)
                      if opts.checkpoint_dir is not None else None)
        self.trace: TraceWriter | None = None
        self.write_failed = False       # a checkpoint could not be written: no more attempts
        self.log = logging.getLogger(f"distgrad.{opts.instance}")

    def _fresh(self) -> Stage:
        if self.opts.stage_factory is not None:
            stage = self.opts.stage_factory()
            stage.allow_nonfinite = self.opts.experiment.allow_nonfinite
            return stage
        return Stage.from_experiment(self.opts.experiment, self.opts.stage, self.opts.seed, self.opts.init)

    def resume_latest(self) -> bool:
        """Load the newest valid checkpoint of the run saved last; False (fresh start) when there is
        none, or when that run is finished (a serving stage then waits for a new run)."""
        ckpt = self.store.latest() if self.store is not None else None
        if ckpt is None:
            return False
        if is_finished(ckpt, self.opts):
            self.log.info("run %s finished at step %d; not resuming it", ckpt.run, ckpt.step)
            return False
        self._load(ckpt)
        self.run_id, self.owner = ckpt.run, ckpt.meta.get("owner", "")
        self.log.info("resumed run %s at step %d from %s", ckpt.run, ckpt.step, ckpt.path)
        return True

    def _load(self, ckpt: Any) -> None:
        try:
            self.stage.load_state_arrays(ckpt.arrays, ckpt.step)
        except ValueError as e:
            raise ConfigError(f"checkpoint {ckpt.path} does not fit this stage's model: {e}") from e

    def begin(self, run_id: str, owner: str = "") -> None:
        """Start ``run_id`` from the initial state (other runs' checkpoints stay where they are)."""
        if self.stage.step != 0:
            self.stage = self._fresh()
        self.run_id, self.owner = run_id, owner
        self.cpu_started = time.process_time()
        if self.store is not None:
            self.save()
        self.open_trace(append=False)

    def open_trace(self, append: bool) -> None:
        if self.trace is not None:
            self.trace.close()
        opts = self.opts
        self.trace = TraceWriter(opts.trace_path, append=append and opts.trace_path is not None
                                 and opts.trace_path.exists(), params=opts.trace_params, every=opts.trace_every,
                                 last_step=opts.experiment.steps if opts.steps is None else opts.steps)
        if append:
            self.trace.rollback(self.stage.step)

    def held(self) -> list[int]:
        """Steps this stage can return to: 0, its checkpoints of this run, its live step."""
        steps = {0, self.stage.step}
        if self.store is not None and self.run_id:
            steps.update(self.store.steps(self.run_id))
        return sorted(steps)

    def rollback(self, step: int) -> None:
        """Return to the state after ``step`` (one of ``held()``)."""
        if step == self.stage.step:
            return
        if step == 0:
            self.stage = self._fresh()
        else:
            ckpt = self.store.at(self.run_id, step) if self.store is not None else None
            if ckpt is None:
                raise StageError(f"stage {self.opts.stage}: cannot roll back to step {step}: no checkpoint of it")
            self._load(ckpt)
        self.log.warning("rolled back to step %d", step)
        if self.trace is not None:
            self.trace.rollback(step)

    def after_step(self) -> None:
        every = self.opts.checkpoint_every
        if every and self.stage.step % every == 0:
            self.save()

    def save(self, final_loss: float | None = None, finished: bool = False) -> None:
        """Checkpoint the live state; ``finished`` marks the completed run's last one (``--resume``
        then has nothing to do). Raises ``CheckpointWriteError`` (and every later save is skipped)."""
        if self.store is not None and self.run_id and not self.write_failed:
            if self.trace is not None:
                self.trace.flush()          # the trace then holds every step the checkpoint has
            meta = dict(self.meta, owner=self.owner)
            if finished:
                meta.update(finished=True, final_loss=final_loss)
            try:
                self.store.save(self.run_id, self.stage.step, self.stage.state_arrays(), meta)
            except CheckpointWriteError:
                self.write_failed = True    # the exit save must not report it a second time
                raise

    def summary(self, status: str, started: float, loss: float | None, **extra: Any) -> dict[str, Any]:
        summary = {
            "experiment": self.opts.experiment.name,
            "stage": self.opts.instance,
            "run_id": self.run_id,
            "status": status,
            "steps": self.stage.step,
            "seed": self.opts.seed,
            "final_loss": loss,
            "elapsed_s": time.perf_counter() - started,
            "cpu_s": time.process_time() - self.cpu_started,    # every thread of this process, ZeroMQ's too
            **extra,
            "params": {self.opts.instance: to_lists(self.stage.params)},
        }
        if self.opts.summary_path is not None:
            write_json(self.opts.summary_path, summary)
        return summary

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()


def lock_checkpoint_dir(opts: StageOptions) -> StageLock | None:
    """Hold ``DIR/.INSTANCE.lock`` for this stage process (None without ``--checkpoint-dir``);
    raises ``ConfigError`` when the directory is unwritable or another process runs the stage there."""
    return lock_stage(opts.checkpoint_dir, opts.instance) if opts.checkpoint_dir is not None else None


def is_finished(ckpt: Checkpoint, opts: StageOptions) -> bool:
    """The final checkpoint of a completed run with at least the steps asked for (``--steps``, else the
    experiment's): a larger ``--steps`` continues the run instead."""
    steps = opts.experiment.steps if opts.steps is None else opts.steps
    return ckpt.meta.get("finished") is True and ckpt.step >= steps


def finished_run(opts: StageOptions) -> Checkpoint | None:
    """With ``--resume``: the final checkpoint of the run this stage would resume, if that run is finished."""
    if not opts.resume or opts.checkpoint_dir is None:
        return None
    meta = {"seed": opts.seed, "init": dict(sorted(opts.init.items()))}
    ckpt = CheckpointStore(opts.checkpoint_dir, opts.instance, opts.experiment.fingerprint, meta).latest()
    return ckpt if ckpt is not None and is_finished(ckpt, opts) else None


def nothing_to_do(opts: StageOptions, ckpt: Checkpoint) -> dict[str, Any]:
    """Log that the run is finished; return its summary from its final checkpoint (no file is written)."""
    logging.getLogger(f"distgrad.{opts.instance}").info(
        "run %s finished at step %d; nothing to do (start without --resume for a new run)", ckpt.run, ckpt.step)
    params = {name[len("param/"):]: value for name, value in ckpt.arrays.items() if name.startswith("param/")}
    return {"experiment": opts.experiment.name, "stage": opts.instance, "run_id": ckpt.run, "status": "finished",
            "steps": ckpt.step, "seed": opts.seed, "final_loss": ckpt.meta.get("final_loss"), "elapsed_s": 0.0,
            "params": {opts.instance: to_lists(params)}}


def same_exactly(a: Any, b: Any) -> bool:
    """Equal in value and in type at every level (so ``False`` is not ``0`` and ``1.0`` is not ``1``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_exactly(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_exactly(x, y) for x, y in zip(a, b))
    return a == b


def common_step(ours: list[int], theirs: Any) -> int:
    """The newest step both sides hold; raises ``ProtocolError`` for a malformed list."""
    if not isinstance(theirs, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in theirs):
        raise ProtocolError(ErrorCode.MALFORMED, f"hello 'held' must be a list of steps, got {wire.show(theirs)}")
    both = set(ours) & set(theirs)
    return max(both) if both else 0


