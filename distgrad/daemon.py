"""Stage daemons: the serving loop of the last stage and the driving loop of the first.

``serve_last_stage`` binds and answers: a ``hello`` opens a run, each
``forward`` runs the loss, backward and update once and returns the gradient
with respect to the activations, ``bye`` closes the run and writes the
summary. ``drive_first_stage`` owns the data and the step counter: it
connects, shakes hands, and for every step sends the activations and applies
the gradient that comes back.

Invalid input never changes state: a message is fully validated before the
stage computes anything, and a failed step is answered with an error reply.
Signal handlers only set a flag (``StopFlag``); the loops check it at least
every ``transport.POLL_TICK_S``.
"""

from __future__ import annotations

import logging
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import zmq

from . import wire
from .errors import ConfigError, Interrupted, PeerTimeout, ProtocolError, StageError
from .experiment import Experiment
from .losses import build_loss
from .records import TraceWriter, to_lists, write_json
from .stage import Stage
from .transport import DEFAULT_TIMEOUT_S, POLL_TICK_S, Client, Server
from .wire import ErrorCode, Message

PROGRESS_UPDATES = 10          # progress lines per run on the driving stage


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


def _tensor_specs(stage: Stage, exp: Experiment) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The tensors a forward to ``stage`` must carry."""
    specs = {"activation": (stage.input_shape, np.dtype(np.float32))}
    if exp.labels_travel and stage.is_last:
        specs["target"] = (stage.target_shape, stage.target_dtype)
    return specs


def _frame_limit(specs: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> tuple[int, int]:
    """(largest frame ZeroMQ may accept, total tensor bytes) for these tensors."""
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs.values()]
    return max([wire.HEADER_MAX_BYTES, *sizes]), sum(sizes)


# ------------------------------------------------------------------ the server

@dataclass
class _Run:
    run_id: str
    stage: Stage
    trace: TraceWriter
    started: float
    last_seen: float
    loss: float | None = None
    cached: tuple[int, int, Message] | None = None   # (step, mb, reply) of the last applied forward


class LastStageServer:
    """Protocol logic of the serving (last) stage, free of sockets so tests can call it.

    ``handle(msg)`` returns the reply and raises ``ProtocolError`` for a
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
        self.stage = self._new_stage()       # built now so a bad configuration fails at start
        self.specs = _tensor_specs(self.stage, self.exp)
        self.max_frame_bytes, self.max_tensor_bytes = _frame_limit(self.specs)
        self.data = self.exp.build_data(opts.seed)   # this stage reads only the targets
        self.run: _Run | None = None
        self.finished: dict[str, Any] | None = None   # summary of the last finished run

    def _new_stage(self) -> Stage:
        return Stage.from_experiment(self.exp, self.opts.stage, self.opts.seed, self.opts.init)

    def handle(self, msg: Message, now: float) -> Message:
        if msg.type == wire.HELLO:
            return self._hello(msg, now)
        run = self.run
        if run is None or msg.run != run.run_id:
            expected = f"run {run.run_id}" if run else "a hello first"
            raise ProtocolError(ErrorCode.RUN, f"{msg.type} for run {msg.run!r}, expected {expected}")
        run.last_seen = now
        if msg.type == wire.FORWARD:
            return self._forward(run, msg)
        if msg.type == wire.BYE:
            self.finished = self._close_run("completed")
            return Message(wire.BYE, msg.run, msg.step, body={"steps": self.finished["steps"]})
        raise ProtocolError(ErrorCode.TYPE, f"a serving stage does not accept {msg.type!r} messages")

    def _hello(self, msg: Message, now: float) -> Message:
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
            if body.get(key) != value:
                raise ProtocolError(ErrorCode.MISMATCH, f"hello has {key}={body.get(key)!r}, this stage expects {value!r}"
                                    + (" (both stages must load the same experiment file)" if key == "fingerprint" else ""))
        if self.run is not None:
            if self.run.run_id != msg.run:
                raise ProtocolError(ErrorCode.RUN, f"busy with run {self.run.run_id}; cannot start run {msg.run!r}")
            self.run.last_seen = now
        else:
            if self.finished is not None:       # --keep-serving: every run starts from the initial state
                self.stage = self._new_stage()
                self.finished = None
            self.run = _Run(msg.run, self.stage, TraceWriter(self.opts.trace_path), now, now)
        return Message(wire.WELCOME, msg.run, msg.step,
                       body={"stage": self.opts.stage, "next_step": self.run.stage.step + 1})

    def _forward(self, run: _Run, msg: Message) -> Message:
        stage = run.stage
        if run.cached is not None and (msg.step, msg.mb) == run.cached[:2]:
            return run.cached[2]                  # a repeated request: same reply, no second update
        if msg.step != stage.step + 1 or msg.mbs != 1 or msg.mb != 0:
            raise ProtocolError(ErrorCode.STEP, f"forward for step {msg.step} micro-batch {msg.mb}/{msg.mbs}; "
                                                f"expected step {stage.step + 1} micro-batch 0/1")
        wire.expect_tensors(msg, self.specs, self.exp.allow_nonfinite)
        x = msg.tensors["activation"]
        target = msg.tensors["target"] if "target" in msg.tensors else self._targets(msg.step)
        try:
            loss, dx, grads = stage.train_last(x, target)
        except StageError as e:
            raise ProtocolError(ErrorCode.STAGE, str(e)) from e
        run.loss = float(loss)
        if run.trace.enabled:
            run.trace.write(msg.step, loss, dict(grads, activation_grad=dx), stage.params)
        reply = Message(wire.BACKWARD, msg.run, msg.step, msg.mb, msg.mbs, body={"loss": run.loss},
                        tensors={"activation_grad": dx})
        run.cached = (msg.step, msg.mb, reply)
        return reply

    def _targets(self, step: int) -> np.ndarray:
        return self.data.targets(step)

    def check_silence(self, now: float) -> dict[str, Any] | None:
        """Abandon the current run if its client has been silent longer than the timeout.

        Returns the abandoned run's summary, or None.
        """
        if self.run is not None and now - self.run.last_seen > self.opts.timeout_s:
            return self._close_run("abandoned")
        return None

    def _close_run(self, status: str) -> dict[str, Any]:
        run = self.run
        assert run is not None
        run.trace.close()
        self.run = None
        summary = {
            "experiment": self.exp.name,
            "stage": self.opts.stage,
            "run_id": run.run_id,
            "status": status,
            "steps": run.stage.step,
            "seed": self.opts.seed,
            "final_loss": run.loss,
            "elapsed_s": time.monotonic() - run.started,
            "params": {self.opts.stage: to_lists(run.stage.params)},
        }
        if self.opts.summary_path is not None:
            write_json(self.opts.summary_path, summary)
        return summary


def _refusal(msg: Message | None, error: ProtocolError) -> Message:
    """The error reply to a refused message, echoing its ids when it could be decoded."""
    if msg is None:
        return wire.error_message("", 0, error.code, str(error.args[0]))
    return wire.error_message(msg.run, msg.step, error.code, str(error.args[0]), msg.mb, msg.mbs)


def serve_last_stage(opts: StageOptions, bind: str, stop: StopFlag, keep_serving: bool = False,
                     ready_file: Path | None = None, ctx: zmq.Context | None = None) -> dict[str, Any]:
    """Serve runs on ``bind`` until one completes (or, with ``keep_serving``, until stopped).

    Writes the bound endpoint to ``ready_file`` once listening (for launchers).
    Returns the last run's summary. Raises ``PeerTimeout`` when a run's client
    falls silent (unless ``keep_serving``) and ``Interrupted`` on a signal.
    """
    log = logging.getLogger(f"distgrad.{opts.stage}")
    logic = LastStageServer(opts)
    ctx = ctx or zmq.Context.instance()
    server = Server(ctx, bind, logic.max_frame_bytes)
    try:
        log.info("stage %s of %s serving on %s", opts.stage, opts.experiment.name, server.endpoint)
        if ready_file is not None:
            tmp = ready_file.with_name(ready_file.name + ".tmp")
            tmp.write_text(server.endpoint)
            tmp.replace(ready_file)
        while True:
            stop.check()
            request = server.receive(POLL_TICK_S)
            now = time.monotonic()
            abandoned = logic.check_silence(now)
            if abandoned is not None:
                message = (f"client of run {abandoned['run_id']} silent for more than {opts.timeout_s:g} s "
                           f"after step {abandoned['steps']}; run abandoned")
                if not keep_serving:
                    raise PeerTimeout(message)
                log.warning("%s; waiting for the next run", message)
            if request is None:
                continue
            envelope, frames = request
            msg: Message | None = None
            try:
                msg = wire.decode(frames, logic.max_tensor_bytes)
                reply = logic.handle(msg, now)
            except ProtocolError as e:
                log.warning("refused %s: %s", msg.describe() if msg else "an undecodable message", e)
                server.reply(envelope, _refusal(msg, e))
                continue
            server.reply(envelope, reply)
            if msg.type == wire.HELLO:
                log.info("run %s started by %s", msg.run, msg.body.get("role"))
            elif msg.type == wire.BYE and logic.finished is not None:
                log.info("run %s completed: %d steps, final loss %s", msg.run, logic.finished["steps"],
                         logic.finished["final_loss"])
                if not keep_serving:
                    return logic.finished
    finally:
        if logic.run is not None:
            logic._close_run("interrupted")
        server.close()


# ------------------------------------------------------------------ the driver

def drive_first_stage(opts: StageOptions, connect: str, stop: StopFlag,
                      ctx: zmq.Context | None = None) -> dict[str, Any]:
    """Train ``opts.steps`` steps against the serving stage at ``connect``; return the summary.

    Raises ``PeerTimeout`` naming the endpoint when a reply does not come
    within ``opts.timeout_s``, ``PeerRejected`` when the server refuses a
    message, ``Interrupted`` on a signal.
    """
    exp = opts.experiment
    log = logging.getLogger(f"distgrad.{opts.stage}")
    if exp.stage_index(opts.stage) != 0 or len(exp.stages) != 2:
        raise ConfigError(f"the driving stage is {exp.stage_names[0]!r} of a two-stage experiment; "
                          f"{exp.name!r} has stages {exp.stage_names}")
    steps = exp.steps if opts.steps is None else opts.steps
    stage = Stage.from_experiment(exp, opts.stage, opts.seed, opts.init)
    data = exp.build_data(opts.seed)
    target_dtype = build_loss(exp.stages[-1].loss).target_dtype
    reply_specs = {"activation_grad": (stage.output_shape, np.dtype(np.float32))}
    max_frame, max_tensor = _frame_limit(reply_specs)
    run_id = uuid.uuid4().hex
    ctx = ctx or zmq.Context.instance()
    client = Client(ctx, connect, max_frame, max_tensor)
    trace = TraceWriter(opts.trace_path)
    loss: float | None = None
    try:
        hello = Message(wire.HELLO, run_id, 0, body={
            "role": opts.stage, "experiment": exp.name, "fingerprint": exp.fingerprint, "seed": opts.seed,
            "activation": {"shape": list(stage.output_shape), "dtype": "float32"},
            "labels_travel": exp.labels_travel, "steps": steps})
        welcome = client.request(hello, opts.timeout_s, stop.check)
        if welcome.type != wire.WELCOME or welcome.body.get("next_step") != 1:
            raise ProtocolError(ErrorCode.RUN, f"expected a welcome at step 1, got {welcome.describe()} {welcome.body}")
        log.info("run %s: connected to stage %s at %s; %d steps", run_id, welcome.body.get("stage"), connect, steps)
        every = max(1, steps // PROGRESS_UPDATES)
        started = last_report = time.perf_counter()
        for step in range(1, steps + 1):
            y, cache = stage.forward(data.features(step))
            tensors = {"activation": y}
            if exp.labels_travel:
                tensors["target"] = np.asarray(data.targets(step), target_dtype)
            reply = client.request(Message(wire.FORWARD, run_id, step, tensors=tensors), opts.timeout_s, stop.check)
            if reply.type != wire.BACKWARD:
                raise ProtocolError(ErrorCode.TYPE, f"expected a backward reply to step {step}, got {reply.type!r}")
            wire.expect_tensors(reply, reply_specs, exp.allow_nonfinite)
            loss = float(reply.body.get("loss", float("nan")))
            dx, grads = stage.backward(cache, reply.tensors["activation_grad"])
            stage.apply(grads)
            if trace.enabled:
                trace.write(step, loss, grads, stage.params)
            if step % every == 0 or step == steps:
                now = time.perf_counter()
                rate = every / (now - last_report) if step % every == 0 else float("nan")
                last_report = now
                log.info("step %d/%d loss %.6g (%.0f steps/s)", step, steps, loss, rate)
        elapsed = time.perf_counter() - started
        client.request(Message(wire.BYE, run_id, steps + 1, body={"steps": steps}), opts.timeout_s, stop.check)
    finally:
        trace.close()
        client.close()
    summary = {
        "experiment": exp.name,
        "stage": opts.stage,
        "run_id": run_id,
        "status": "completed",
        "steps": steps,
        "seed": opts.seed,
        "final_loss": loss,
        "elapsed_s": elapsed,
        "endpoint": connect,
        "params": {opts.stage: to_lists(stage.params)},
    }
    if opts.summary_path is not None:
        write_json(opts.summary_path, summary)
    return summary
