"""Stage daemons: the serving loop of the last stage and the driving loop of the first.

``serve_last_stage`` binds and answers: a ``hello`` opens (or resumes) a run,
each ``forward`` runs the loss, backward and update exactly once and returns
the gradient with respect to the activations, ``bye`` closes the run and
writes the summary. ``drive_first_stage`` owns the data and the step counter:
it connects, shakes hands, and for every step sends the activations and
applies the gradient that comes back.

Reliability (docs/reliability.md): a repeated forward gets the cached reply
and no second update; the driver retries a timed-out request on a fresh
socket until ``peer_deadline_s``; on every (re)connect both stages roll back
to the newest step they both hold (a checkpoint, their live state, or the
initial state at step 0), so a run interrupted anywhere ends with the
parameters of an uninterrupted one. Invalid input never changes state: a
message is fully validated before the stage computes anything. Signal
handlers only set a flag (``StopFlag``); the loops check it at least every
``transport.POLL_TICK_S``.
"""

from __future__ import annotations

import logging
import math
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import zmq

from . import wire
from .checkpoint import CheckpointStore
from .errors import ConfigError, Interrupted, PeerRejected, PeerTimeout, ProtocolError, StageError
from .experiment import Experiment
from .inprocess import evaluation_fields
from .losses import build_loss
from .records import TraceWriter, to_lists, write_json
from .stage import Stage, check_micro_batches, combine_losses, micro_batch
from .progress import MetricsWriter, Progress
from .transport import DEFAULT_TIMEOUT_S, POLL_TICK_S, Client, Server, SocketSecurity, Traffic
from .wire import ErrorCode, Message

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
    timeout_s: float = DEFAULT_TIMEOUT_S
    liveness_s: float = DEFAULT_LIVENESS_S
    peer_deadline_s: float = DEFAULT_PEER_DEADLINE_S
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0          # 0: only on SIGTERM/SIGINT (when a directory is given)
    resume: bool = False
    security: SocketSecurity | None = None
    micro_batches: int = 1             # driving stage: micro-batches per step
    schedule: str = "1f1b"             # driving stage: "gpipe" or "1f1b"
    metrics_path: Path | None = None   # driving stage: one JSON line of timings per step
    progress: str = "off"              # driving stage: "bar", "lines" (for a launcher) or "off"

    def __post_init__(self) -> None:
        if self.resume and self.checkpoint_dir is None:
            raise ConfigError("--resume needs --checkpoint-dir")
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ConfigError("--checkpoint-every needs --checkpoint-dir")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        for name in ("timeout_s", "liveness_s", "peer_deadline_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name[:-2].replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")


def _micro_shape(shape: tuple[int, ...], count: int) -> tuple[int, ...]:
    return shape if count == 1 else (shape[0] // count, *shape[1:])


def _tensor_specs(stage: Stage, exp: Experiment, micro_batches: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The tensors a forward of one micro-batch to ``stage`` must carry."""
    specs = {"activation": (_micro_shape(stage.input_shape, micro_batches), np.dtype(np.float32))}
    if exp.labels_travel and stage.is_last:
        specs["target"] = (_micro_shape(stage.target_shape, micro_batches), stage.target_dtype)
    return specs


def _frame_limit(specs: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> tuple[int, int]:
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
        # A checkpoint is only valid for the same starting point: seed and --init overrides.
        self.meta = {"seed": opts.seed, "init": dict(sorted(opts.init.items()))}
        self.store = (CheckpointStore(opts.checkpoint_dir, opts.stage, opts.experiment.fingerprint, self.meta)
                      if opts.checkpoint_dir is not None else None)
        self.trace: TraceWriter | None = None
        self.log = logging.getLogger(f"distgrad.{opts.stage}")

    def _fresh(self) -> Stage:
        return Stage.from_experiment(self.opts.experiment, self.opts.stage, self.opts.seed, self.opts.init)

    def resume_latest(self) -> bool:
        """Load the newest valid checkpoint; False (fresh start) when there is none."""
        ckpt = self.store.latest() if self.store is not None else None
        if ckpt is None:
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
        """Start ``run_id`` from the initial state; its checkpoints replace any other run's."""
        if self.stage.step != 0:
            self.stage = self._fresh()
        self.run_id, self.owner = run_id, owner
        if self.store is not None:
            self.store.discard_other_runs(run_id)
            self.save()
        self.open_trace(append=False)

    def open_trace(self, append: bool) -> None:
        if self.trace is not None:
            self.trace.close()
        self.trace = TraceWriter(self.opts.trace_path, append=append and self.opts.trace_path is not None
                                 and self.opts.trace_path.exists())
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

    def save(self) -> None:
        if self.store is not None and self.run_id:
            if self.trace is not None:
                self.trace.flush()          # the trace then holds every step the checkpoint has
            self.store.save(self.run_id, self.stage.step, self.stage.state_arrays(), dict(self.meta, owner=self.owner))

    def summary(self, status: str, started: float, loss: float | None, **extra: Any) -> dict[str, Any]:
        summary = {
            "experiment": self.opts.experiment.name,
            "stage": self.opts.stage,
            "run_id": self.run_id,
            "status": status,
            "steps": self.stage.step,
            "seed": self.opts.seed,
            "final_loss": loss,
            "elapsed_s": time.perf_counter() - started,
            **extra,
            "params": {self.opts.stage: to_lists(self.stage.params)},
        }
        if self.opts.summary_path is not None:
            write_json(self.opts.summary_path, summary)
        return summary

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()


def _same(a: Any, b: Any) -> bool:
    """Equal in value and in type at every level (so ``False`` is not ``0`` and ``1.0`` is not ``1``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def common_step(ours: list[int], theirs: Any) -> int:
    """The newest step both sides hold; raises ``ProtocolError`` for a malformed list."""
    if not isinstance(theirs, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in theirs):
        raise ProtocolError(ErrorCode.MALFORMED, f"hello 'held' must be a list of steps, got {wire.show(theirs)}")
    both = set(ours) & set(theirs)
    return max(both) if both else 0


# ------------------------------------------------------------------ the server

class LastStageServer:
    """Protocol logic of the serving (last) stage, free of sockets so tests can call it.

    ``handle(msg, now)`` returns the reply and raises ``ProtocolError`` for a
    message that must be refused; a refused message changes nothing.
    """

    def __init__(self, opts: StageOptions) -> None:
        self.opts, self.exp = opts, opts.experiment
        if self.exp.stage_index(opts.stage) != len(self.exp.stages) - 1:
            raise ConfigError(f"stage {opts.stage!r} is not the last stage of {self.exp.name!r}; "
                              f"serve {self.exp.stage_names[-1]!r} instead")
        if len(self.exp.stages) != 2:
            raise ConfigError(f"experiment {self.exp.name!r} has {len(self.exp.stages)} stages; "
                              f"the stage daemons run two-stage experiments (run one-stage ones with 'distgrad run')")
        self.upstream = self.exp.stage_names[-2]
        self.state = StageState(opts)
        self.log = self.state.log
        self.data = self.exp.build_data(opts.seed)   # this stage reads only the targets
        self.specs = _tensor_specs(self.state.stage, self.exp, 1)
        rows = len(self.data.test_rows)
        self.eval_specs = {name: ((rows, *shape[1:]), dtype) for name, (shape, dtype) in self.specs.items()}
        # The largest message this stage accepts: a whole batch, or the held-out rows to evaluate.
        self.max_frame_bytes, self.max_tensor_bytes = (max(a, b) for a, b in zip(
            _frame_limit(self.specs), _frame_limit(self.eval_specs)))
        self.mbs = 1                        # micro-batches per step, as the run's hello said
        self.active = False                 # a run is open (possibly resumed from a checkpoint)
        self.last_seen = -math.inf          # when the open run's client last spoke
        self.lost_since: float | None = None
        self.started = time.perf_counter()
        self.loss: float | None = None
        # Replies by (step, mb) for the step in progress and the last applied one: a repeated
        # forward gets its reply again and causes no second update.
        self.cached: dict[tuple[int, int], Message] = {}
        self.mb_losses: list[np.float32] = []
        self.sent_back: list[np.ndarray] = []      # the step's activation gradients, for the trace
        self.finished: dict[str, Any] | None = None       # summary of the last completed run
        self.bye_reply: Message | None = None
        self.evaluation: dict[str, Any] | None = None
        if opts.resume and self.state.resume_latest():
            self.active = True
            self.last_seen = time.monotonic()      # its client gets a full liveness window to come back
            self.state.open_trace(append=True)

    @property
    def stage(self) -> Stage:
        return self.state.stage

    def live(self, now: float) -> bool:
        return self.active and now - self.last_seen <= self.opts.liveness_s

    def handle(self, msg: Message, now: float, peer_key: str = "") -> Message:
        """The reply to ``msg`` from the peer authenticated as ``peer_key`` ("" in plaintext).

        With CURVE, a run belongs to the key that opened it: other keys may
        not drive, rewind or end it.
        """
        if msg.type == wire.PING:
            return Message(wire.PONG, msg.run, msg.step, body={
                "stage": self.opts.stage, "experiment": self.exp.name, "run": self.state.run_id if self.active else "",
                "step": self.stage.step, "client_live": self.live(now)})
        if msg.type == wire.BYE and self.finished is not None and msg.run == self.finished["run_id"]:
            return self.bye_reply                 # a repeated bye for the run that just completed
        if msg.type == wire.HELLO:
            return self._hello(msg, now, peer_key)
        if not self.active or msg.run != self.state.run_id:
            expected = f"run {self.state.run_id}" if self.active else "a hello first"
            raise ProtocolError(ErrorCode.RUN, f"{msg.type} for run {msg.run!r}, expected {expected}")
        self._check_owner(peer_key)
        if msg.type == wire.FORWARD:
            reply = self._forward(msg)
        elif msg.type == wire.EVALUATE:
            reply = self._evaluate(msg)
        elif msg.type == wire.BYE:
            reply = self._bye(msg)
        else:
            raise ProtocolError(ErrorCode.TYPE, f"a serving stage does not accept {msg.type!r} messages")
        self._seen(now)
        return reply

    def _check_owner(self, peer_key: str) -> None:
        if self.state.owner and peer_key != self.state.owner:
            raise ProtocolError(ErrorCode.RUN, "this run belongs to another client key")

    def _seen(self, now: float) -> None:
        if self.lost_since is not None:
            self.log.info("client of run %s is back", self.state.run_id)
        self.last_seen, self.lost_since = now, None

    def _hello(self, msg: Message, now: float, peer_key: str) -> Message:
        body = msg.body
        expected = {
            "role": self.upstream,
            "experiment": self.exp.name,
            "fingerprint": self.exp.fingerprint,
            "seed": self.opts.seed,
            "activation": {"shape": list(self.stage.input_shape), "dtype": "float32"},
            "labels_travel": self.exp.labels_travel,
        }
        for key, value in expected.items():
            if not _same(body.get(key), value):
                raise ProtocolError(ErrorCode.MISMATCH, f"hello has {key}={wire.show(body.get(key))}, "
                                                        f"this stage expects {value!r}"
                                    + (" (both stages must load the same experiment file)" if key == "fingerprint" else ""))
        mbs = body.get("micro_batches", 1)
        shape = self.stage.input_shape
        if not isinstance(mbs, int) or isinstance(mbs, bool) or mbs < 1 or (mbs > 1 and (
                len(shape) < 2 or shape[0] % mbs)):
            raise ProtocolError(ErrorCode.MISMATCH, f"hello asks for {wire.show(mbs)} micro-batches; batches of "
                                                    f"shape {shape} do not split into that many equal parts")
        if self.active and msg.run == self.state.run_id:
            self._check_owner(peer_key)
            common = common_step(self.state.held(), body.get("held"))
            before = self.stage.step
            self.state.rollback(common)
            self.cached = {} if common != before else {k: v for k, v in self.cached.items() if k[0] <= common}
        elif self.live(now):
            raise ProtocolError(ErrorCode.RUN, f"busy with run {self.state.run_id} (its client is live); "
                                               f"cannot start run {msg.run!r}")
        else:
            common_step([0], body.get("held"))           # validates the list
            if self.active:
                self.log.warning("run %s replaces run %s, whose client is gone", msg.run, self.state.run_id)
            self.state.begin(msg.run, owner=peer_key)
            self.active, self.finished, self.cached, self.loss, self.evaluation = True, None, {}, None, None
            self.started = time.perf_counter()
            self.log.info("run %s started by %s", msg.run, body.get("role"))
        self.mbs = mbs
        self.specs = _tensor_specs(self.stage, self.exp, mbs)
        self.stage.accumulator.reset()          # a step in progress starts again from its first micro-batch
        self.mb_losses, self.sent_back = [], []
        self._seen(now)
        return Message(wire.WELCOME, msg.run, msg.step,
                       body={"stage": self.opts.stage, "next_step": self.stage.step + 1})

    def _forward(self, msg: Message) -> Message:
        stage = self.stage
        key = (msg.step, msg.mb)
        cached = self.cached.get(key)
        if cached is not None:
            return cached                      # a repeated request: same reply, no second update
        done = stage.accumulator.count
        if msg.step != stage.step + 1 or msg.mbs != self.mbs or msg.mb != done:
            raise ProtocolError(ErrorCode.STEP, f"forward for step {msg.step} micro-batch {msg.mb}/{msg.mbs}; "
                                                f"expected step {stage.step + 1} micro-batch {done}/{self.mbs}")
        wire.expect_tensors(msg, self.specs, self.exp.allow_nonfinite)
        x = msg.tensors["activation"]
        target = msg.tensors.get("target")
        if target is None:
            target = micro_batch(self.data.targets(msg.step), msg.mb, msg.mbs)
        started = time.perf_counter()
        try:
            mb_loss, dx, grads = stage.loss_micro_batch(x, target)
        except StageError as e:
            raise ProtocolError(ErrorCode.STAGE, str(e)) from e
        if msg.mb == 0:
            self.cached = {}                   # the previous step is complete on both sides
        stage.accumulator.add(grads, msg.mb, msg.mbs)
        self.mb_losses.append(mb_loss)
        trace = self.state.trace
        tracing = trace is not None and trace.enabled
        if tracing:
            self.sent_back.append(dx)
        body = {"loss": float(mb_loss)}
        reply = Message(wire.BACKWARD, msg.run, msg.step, msg.mb, msg.mbs, body=body,
                        tensors={"activation_grad": dx})
        self.cached[key] = reply
        if msg.mb == msg.mbs - 1:
            assert stage.loss is not None
            scale = stage.loss.micro_batch_scale(msg.mbs)
            applied = stage.accumulator.take(scale)
            if tracing:
                traced = {k: v.copy() for k, v in applied.items()}
            stage.apply(applied)
            loss = combine_losses(self.mb_losses, scale)
            self.loss, self.mb_losses = float(loss), []
            if tracing:
                traced["activation_grad"] = np.concatenate(self.sent_back) if msg.mbs > 1 else dx
                trace.write(msg.step, loss, traced, stage.params)
                self.sent_back = []
            self.state.after_step()
        body["compute_s"] = time.perf_counter() - started     # for the driver's metrics
        return reply

    def _evaluate(self, msg: Message) -> Message:
        """Forward only on the held-out rows; changes no state."""
        if not len(self.data.test_rows):
            raise ProtocolError(ErrorCode.TYPE, f"experiment {self.exp.name!r} holds out no rows to evaluate")
        wire.expect_tensors(msg, self.eval_specs, self.exp.allow_nonfinite)
        target = msg.tensors.get("target")
        try:
            result = self.stage.evaluate_last(msg.tensors["activation"],
                                              self.data.test_targets() if target is None else target)
        except StageError as e:
            raise ProtocolError(ErrorCode.STAGE, str(e)) from e
        self.evaluation = result
        return Message(wire.EVALUATION, msg.run, msg.step, body=result)

    def _bye(self, msg: Message) -> Message:
        steps = msg.body.get("steps")
        if not _same(steps, self.stage.step):
            raise ProtocolError(ErrorCode.STEP, f"bye after {wire.show(steps)} steps, but this stage has applied {self.stage.step}")
        self.state.save()
        self.finished = self.close_run("completed")
        self.bye_reply = Message(wire.BYE, msg.run, msg.step, body={"steps": self.finished["steps"]})
        return self.bye_reply

    def check_liveness(self, now: float) -> float | None:
        """Note a lost client; return for how long it has been lost (None while it is live)."""
        if not self.active or self.live(now):
            return None
        if self.lost_since is None:
            self.lost_since = now
            self.log.warning("client of run %s silent for more than %g s; keeping its state at step %d and "
                             "waiting for it (or a new run)", self.state.run_id, self.opts.liveness_s, self.stage.step)
        return now - self.lost_since

    def close_run(self, status: str) -> dict[str, Any]:
        summary = self.state.summary(status, self.started, self.loss, **evaluation_fields(self.evaluation))
        self.state.close()
        self.active, self.cached = False, {}
        return summary


def _refusal(msg: Message | None, error: ProtocolError) -> Message:
    """The error reply to a refused message, echoing its ids when it could be decoded."""
    if msg is None:
        return wire.error_message("", 0, error.code, str(error.args[0]))
    return wire.error_message(msg.run, msg.step, error.code, str(error.args[0]), msg.mb, msg.mbs)


def serve_last_stage(opts: StageOptions, bind: str, stop: StopFlag, keep_serving: bool = False,
                     ready_file: Path | None = None, ctx: zmq.Context | None = None,
                     on_ready: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Serve runs on ``bind`` until one completes (or, with ``keep_serving``, until stopped).

    Writes the bound endpoint to ``ready_file`` once listening (for launchers)
    and passes it to ``on_ready`` (for callers in this process).
    Returns the last run's summary. Raises ``PeerTimeout`` when a run's client
    stays lost for ``opts.peer_deadline_s`` (unless ``keep_serving``) and
    ``Interrupted`` on a signal, after saving a checkpoint.
    """
    logic = LastStageServer(opts)
    log = logic.log
    ctx = ctx or zmq.Context.instance()
    server = Server(ctx, bind, logic.max_frame_bytes, opts.liveness_s, opts.security)
    try:
        log.info("stage %s of %s serving on %s", opts.stage, opts.experiment.name, server.endpoint)
        if ready_file is not None:
            tmp = ready_file.with_name(ready_file.name + ".tmp")
            tmp.write_text(server.endpoint)
            tmp.replace(ready_file)
        if on_ready is not None:
            on_ready(server.endpoint)
        while True:
            stop.check()
            request = server.receive(POLL_TICK_S)
            now = time.monotonic()
            lost_for = logic.check_liveness(now)
            if lost_for is not None and lost_for > opts.peer_deadline_s and not keep_serving:
                raise PeerTimeout(f"client of run {logic.state.run_id} lost for more than "
                                  f"{opts.liveness_s + opts.peer_deadline_s:g} s at step {logic.stage.step}; giving up")
            if request is None:
                continue
            envelope, frames, peer_key = request
            msg: Message | None = None
            try:
                msg = wire.decode(frames, logic.max_tensor_bytes)
                reply = logic.handle(msg, now, peer_key)
            except ProtocolError as e:
                log.warning("refused %s: %.*s", msg.describe() if msg else "an undecodable message",
                            wire.ERROR_TEXT_MAX, e)
                server.reply(envelope, _refusal(msg, e))
                continue
            server.reply(envelope, reply)
            if msg.type == wire.BYE and logic.finished is not None:
                log.info("run %s completed: %d steps, final loss %s", msg.run, logic.finished["steps"],
                         logic.finished["final_loss"])
                if not keep_serving:
                    return logic.finished
    finally:
        if logic.active:
            logic.state.save()
            logic.close_run("interrupted")
        server.close()


# ------------------------------------------------------------------ the driver

class _Driver:
    """The first stage's loop: handshake, steps, bye, with retries and rollbacks."""

    def __init__(self, opts: StageOptions, connect: str, stop: StopFlag, ctx: zmq.Context) -> None:
        exp = opts.experiment
        if exp.stage_index(opts.stage) != 0 or len(exp.stages) != 2:
            raise ConfigError(f"the driving stage is {exp.stage_names[0]!r} of a two-stage experiment; "
                              f"{exp.name!r} has stages {exp.stage_names}")
        self.opts, self.exp, self.connect, self.stop, self.ctx = opts, exp, connect, stop, ctx
        self.steps = exp.steps if opts.steps is None else opts.steps
        self.state = StageState(opts)
        self.log = self.state.log
        self.data = exp.build_data(opts.seed)
        loss = build_loss(exp.stages[-1].loss)
        self.target_dtype = loss.target_dtype
        check_micro_batches(exp, opts.micro_batches, self.data.feature_shape)
        self.scale = loss.micro_batch_scale(opts.micro_batches)
        self.reply_specs = {"activation_grad": (_micro_shape(self.state.stage.output_shape, opts.micro_batches),
                                                np.dtype(np.float32))}
        self.max_frame, self.max_tensor = _frame_limit(self.reply_specs)
        self.traffic = Traffic()
        self.metrics = MetricsWriter(opts.metrics_path)
        self.progress = Progress(opts.progress, self.steps)
        self.g_compute_s = 0.0
        self.client = self._new_client()
        self.arrived: dict[tuple[int, int], Message] = {}
        self.loss: float | None = None
        self.evaluation: dict[str, Any] | None = None

    def _new_client(self) -> Client:
        return Client(self.ctx, self.connect, self.max_frame, self.max_tensor, self.opts.liveness_s,
                      self.opts.security, self.traffic)

    def exchange(self, msg: Message) -> Message:
        """Send ``msg`` and return its reply, with the retries of ``_await``.

        A hello refused because the server is busy with another live run is
        retried too, until ``peer_deadline_s``.
        """
        deadline = time.monotonic() + self.opts.peer_deadline_s
        pause = RETRY_BACKOFF_S[0]
        while True:
            key = (msg.step, msg.mb)
            self.client.send(msg)
            try:
                return self._await({key: msg}, key)
            except PeerRejected as e:
                if e.code != ErrorCode.RUN or "busy" not in e.peer_message or time.monotonic() + pause > deadline:
                    raise
                self.log.warning("%s; retrying", e.peer_message)
            self._reconnect(pause)
            pause = min(pause * 2, RETRY_BACKOFF_S[1])

    def _await(self, pending: Mapping[tuple[int, int], Message], key: tuple[int, int]) -> Message:
        """The reply to ``pending[key]``; replies to other pending requests are kept for later.

        After each ``timeout_s`` without it, reconnect on a fresh socket and
        resend every pending request in order (the Lazy Pirate pattern), until
        ``peer_deadline_s``. Requests are idempotent on the server (a repeated
        forward gets its cached reply), so resending is always safe.
        """
        deadline = time.monotonic() + self.opts.peer_deadline_s
        pause = RETRY_BACKOFF_S[0]
        while True:
            reply = self.arrived.pop(key, None)
            if reply is not None:
                return reply
            try:
                reply = self.client.wait(self.state.run_id, pending.keys(), self.opts.timeout_s, self.stop.check,
                                         pending[key].describe)
            except PeerTimeout as e:
                if time.monotonic() + pause > deadline:
                    raise PeerTimeout(f"{e}; gave up after retrying for {self.opts.peer_deadline_s:g} s") from e
                self.log.warning("no reply from %s within %g s; reconnecting and retrying for up to %.0f s more",
                                 self.connect, self.opts.timeout_s, deadline - time.monotonic())
                self._reconnect(pause)
                pause = min(pause * 2, RETRY_BACKOFF_S[1])
                for request_key in sorted(pending):
                    self.client.send(pending[request_key])
                continue
            self.arrived[(reply.step, reply.mb)] = reply

    def _reconnect(self, pause: float) -> None:
        self.client.close(linger_ms=0)
        self._sleep(pause)
        self.client = self._new_client()

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.stop.check()
            time.sleep(min(POLL_TICK_S, max(0.0, end - time.monotonic())))

    def handshake(self) -> None:
        """Hello/welcome; afterwards both stages stand at the newest step they both hold."""
        stage = self.state.stage
        hello = Message(wire.HELLO, self.state.run_id, 0, body={
            "role": self.opts.stage, "experiment": self.exp.name, "fingerprint": self.exp.fingerprint,
            "seed": self.opts.seed, "activation": {"shape": list(stage.output_shape), "dtype": "float32"},
            "labels_travel": self.exp.labels_travel, "steps": self.steps, "step": stage.step,
            "held": self.state.held(), "micro_batches": self.opts.micro_batches})
        welcome = self.exchange(hello)
        next_step = welcome.body.get("next_step")
        if (welcome.type != wire.WELCOME or not isinstance(next_step, int) or isinstance(next_step, bool)
                or next_step - 1 not in self.state.held()):
            raise ProtocolError(ErrorCode.RUN, f"expected a welcome at a step this stage holds {self.state.held()}, "
                                               f"got {welcome.describe()} {welcome.body}")
        self.state.rollback(next_step - 1)
        self.state.stage.accumulator.reset()
        self.log.info("run %s: connected to stage %s at %s; at step %d of %d", self.state.run_id,
                      welcome.body.get("stage"), self.connect, self.state.stage.step, self.steps)

    def step_once(self) -> None:
        """One step: every micro-batch's forward and backward, then one update.

        Up to ``window`` micro-batches are in flight (all of them for gpipe,
        two for 1f1b), so this stage computes micro-batch i+1 while the server
        works on i. Gradients are summed in micro-batch order whatever the
        schedule, which is the order the in-process path uses.
        """
        stage, count = self.state.stage, self.opts.micro_batches
        step = stage.step + 1
        features = self.data.features(step)
        targets = np.asarray(self.data.targets(step), self.target_dtype) if self.exp.labels_travel else None
        window = count if self.opts.schedule == "gpipe" else min(count, 2)
        pending: dict[tuple[int, int], Message] = {}
        caches: dict[int, Any] = {}
        losses: list[np.float32] = []
        self.arrived.clear()

        def send(i: int) -> None:
            y, caches[i] = stage.forward(micro_batch(features, i, count))
            tensors = {"activation": y}
            if targets is not None:
                tensors["target"] = micro_batch(targets, i, count)
            msg = Message(wire.FORWARD, self.state.run_id, step, i, count, tensors=tensors)
            pending[(step, i)] = msg
            self.client.send(msg)

        for i in range(window):
            send(i)
        for i in range(count):
            reply = self._await(pending, (step, i))
            del pending[(step, i)]
            if reply.type != wire.BACKWARD:
                raise ProtocolError(ErrorCode.TYPE, f"expected a backward reply to step {step}, got {reply.type!r}")
            wire.expect_tensors(reply, self.reply_specs, self.exp.allow_nonfinite)
            loss = reply.body.get("loss")
            if not isinstance(loss, (int, float)) or isinstance(loss, bool):
                raise ProtocolError(ErrorCode.MALFORMED, f"backward reply to step {step} has loss {wire.show(loss)}")
            losses.append(np.float32(loss))
            compute = reply.body.get("compute_s")
            if isinstance(compute, float):
                self.g_compute_s += compute
            _, grads = stage.backward(caches.pop(i), reply.tensors["activation_grad"], need_dx=False)
            stage.accumulator.add(grads, i, count)
            if i + window < count:
                send(i + window)
        grads = stage.accumulator.take(self.scale)
        trace = self.state.trace
        if trace is not None and trace.enabled:
            grads_seen = {k: v.copy() for k, v in grads.items()}
        stage.apply(grads)
        self.loss = float(combine_losses(losses, self.scale))
        if trace is not None and trace.enabled:
            trace.write(step, self.loss, grads_seen, stage.params)
        self.state.after_step()

    def evaluate(self) -> None:
        """Held-out rows forward through both stages; the label owner scores them."""
        y, _ = self.state.stage.forward(self.data.test_features())
        tensors = {"activation": y}
        if self.exp.labels_travel:
            tensors["target"] = np.asarray(self.data.test_targets(), self.target_dtype)
        reply = self.exchange(Message(wire.EVALUATE, self.state.run_id, self.state.stage.step + 1, tensors=tensors))
        body = reply.body
        if reply.type != wire.EVALUATION or not isinstance(body.get("loss"), float) or not isinstance(body.get("count"), int):
            raise ProtocolError(ErrorCode.MALFORMED, f"expected an evaluation reply, got {reply.describe()}")
        self.evaluation = body
        fields = evaluation_fields(body)
        self.log.info("test loss %.6g%s", body["loss"],
                      f", test accuracy {fields['test_accuracy']:.4f}" if "test_accuracy" in fields else "")

    def _record(self, step: int, started: float, step_started: float, wait_before: float,
                g_before: float) -> None:
        now = time.perf_counter()
        wait = self.traffic.wait_s - wait_before
        self.metrics.write({
            "step": step, "loss": self.loss, "wall_s": now - started, "step_s": now - step_started,
            "bytes_sent": self.traffic.sent, "bytes_received": self.traffic.received,
            "f_compute_s": now - step_started - wait, "f_wait_s": wait, "g_compute_s": self.g_compute_s - g_before})

    def run(self) -> dict[str, Any]:
        state = self.state
        if not (self.opts.resume and state.resume_latest()):
            state.begin(uuid.uuid4().hex)
        else:
            state.open_trace(append=True)
        started = time.perf_counter()
        try:
            self._run()
        except (Interrupted, PeerTimeout):
            state.save()            # between steps the state is consistent: a restart continues here
            raise
        finally:
            state.close()
            self.client.close()
            self.metrics.close()
            self.progress.close()
        return state.summary("completed", started, self.loss, endpoint=self.connect,
                             micro_batches=self.opts.micro_batches, schedule=self.opts.schedule,
                             **evaluation_fields(self.evaluation))

    def _run(self) -> None:
        self.handshake()
        every = max(1, self.steps // PROGRESS_UPDATES)
        started = last_report = time.perf_counter()
        last_step = self.state.stage.step
        while True:
            stage = self.state.stage
            step_started, wait_before, g_before = time.perf_counter(), self.traffic.wait_s, self.g_compute_s
            try:
                if stage.step >= self.steps:
                    self.state.save()
                    if len(self.data.test_rows):
                        self.evaluate()
                    self.exchange(Message(wire.BYE, self.state.run_id, stage.step + 1, body={"steps": stage.step}))
                    return
                self.step_once()
            except PeerRejected as e:
                if e.code not in (ErrorCode.RUN, ErrorCode.STEP):
                    raise
                # The server restarted or lost our run: agree on a step again.
                self.log.warning("%s; shaking hands again", e.peer_message)
                self.handshake()
                continue
            step = self.state.stage.step
            if self.metrics.enabled:
                self._record(step, started, step_started, wait_before, g_before)
            self.progress.update(step, self.loss, force=step == self.steps)
            if self.opts.progress != "bar" and (step % every == 0 or step == self.steps):
                now = time.perf_counter()
                rate = (step - last_step) / (now - last_report) if now > last_report else float("nan")
                last_report, last_step = now, step
                self.log.info("step %d/%d loss %.6g (%.0f steps/s)", step, self.steps, self.loss, rate)


def drive_first_stage(opts: StageOptions, connect: str, stop: StopFlag,
                      ctx: zmq.Context | None = None) -> dict[str, Any]:
    """Train ``opts.steps`` steps against the serving stage at ``connect``; return the summary.

    Retries an unanswered request on a fresh socket until ``opts.peer_deadline_s``
    and then raises ``PeerTimeout`` naming the endpoint; raises
    ``PeerRejected`` when the server refuses a message for good (e.g. another
    experiment), ``Interrupted`` on a signal, after saving a checkpoint.
    """
    return _Driver(opts, connect, stop, ctx or zmq.Context.instance()).run()
