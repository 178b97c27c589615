"""What the driving stage holds (``DriverState``): its stage's state, data, link and step writers, built once
from its options; the handshake that places it at the step every stage holds (with secure aggregation's masks
bound to the run); and what its checkpoint keeps of the run beyond the stage's own state.

``driver._Driver`` (``drive_first_stage``'s loop) is written in four classes, each the base of the next, so
that each part reads only what is below it: ``DriverState`` (here), ``driver_records.DriverRecords`` (the
evaluations and each step's record, report and progress), ``driver_steps.DriverSteps`` (the step engines:
lockstep, a window of micro-batches, steps in flight, ``--staleness auto``'s probe, SplitFed's average) and
``driver._Driver`` (the run loop, its end and its failures).
"""


from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import zmq

from distgrad.config.experiment import MAX_STALENESS, check_held_out, client_stage_name
from distgrad.errors import ConfigError, PeerTimeout
from distgrad.run import handshake
from distgrad.run.autostaleness import LinkProbe
from distgrad.run.metering import Guarding, Metering, step_rows
from distgrad.run.options import StageOptions, StopFlag
from distgrad.run.progress import MetricsWriter, Progress, step_writers
from distgrad.run.protocol import evaluation_due
from distgrad.run.stage_state import StageState
from distgrad.stage.stage import backward_specs
from distgrad.wire import messages as wire
from distgrad.wire.link import DownstreamLink
from distgrad.wire.masking import SecureSumCodec
from distgrad.wire.messages import Message
from distgrad.wire.transport import Traffic
from distgrad.wire.wirecodec import ACTIVATION, GRADIENT, stream_name

MASK_RUNS_POLL_S = 0.05   # between pings asking the label owner for every feature party's run (secure aggregation)


class DriverState:
    """The driving stage's state, built once from its options (``__init__``), and the changes a handshake
    makes to it. Only the driver's classes change it."""

    # Set by the run loop (``driver._Driver._run``) before the first step, read by the step records
    # (``driver_records``): when the run started and how often the log reports the rate.
    started: float
    report_every: int
    last_report: float          # when the log last reported the rate (``_run`` starts it, ``_report`` moves it)
    last_step: int              # the step it reported then
    # Set by the run loop before each step: when it started, and the link's wait and the stage below's
    # compute time counted until then (the step's record holds the differences).
    step_started: float
    wait_before: float
    g_before: float

    def __init__(self, opts: StageOptions, connect: str, stop: StopFlag, ctx: zmq.Context) -> None:
        """The state of a run of ``opts.stage`` against the stage serving at ``connect`` (nothing is sent
        yet). Raises ``ConfigError`` when the experiment gives this stage no role that connects."""
        exp = opts.experiment
        exp.check_role(opts.stage, binds=False, connects=True)
        self.opts, self.exp, self.connect, self.stop = opts, exp, connect, stop
        self.steps = opts.total_steps
        self.state = StageState(opts)
        self.log = self.state.log
        self.data = exp.build_data(opts.seed, client=opts.client, stage=opts.stage)
        self.average_every = exp.clients.average_every if exp.clients.mode == "splitfed" else 0
        self.target_dtype = self.data.target_dtype
        self.reply_specs = backward_specs(self.state.stage, opts.micro_batches, exp.codecs[GRADIENT])
        self.below = exp.downstream(opts.stage)         # the stage replying, named in errors about its replies
        self.traffic = Traffic()
        # metrics file, TensorBoard; with --resume the metrics lines stay until _start knows which steps stand
        self.writers = step_writers(opts.metrics_path, opts.tensorboard_dir, append=opts.resume)
        self.progress = Progress(opts.progress, self.steps)
        self.eval_every = opts.evaluate_every
        self.holds_out = len(self.data.test_rows) > 0
        check_held_out(opts.instance, self.eval_every, len(self.data.test_rows),
                       "--eval-every" if opts.eval_every is not None else "")
        # With a validation split: the evaluations during the run forward the validation rows only; the test rows
        # cross once, after the last step, with the kept model (``evaluate(final=True)``).
        self.validation = self.data.validation_count
        self._watch_inputs()
        self.g_compute_s = 0.0
        params = self.state.stage.params
        self.link = DownstreamLink(opts.link, connect, stop.check, ctx, opts.security, self.reply_specs,
                                   self.traffic,
                                   {n: (v.shape, v.dtype) for n, v in params.items()} if self.average_every else None)
        self._hold_steps_in_flight()
        self.loss: float | None = None
        # The label owner's replies carry no training loss (it withholds it, ``wire.LOSS_WITHHELD``): the
        # records then hold null, and the log, the bar and the summary say why.
        self.loss_withheld = False
        self.evaluation: dict[str, Any] | None = None          # the latest evaluation's reply
        self.evaluations: list[dict[str, Any]] = []            # every one: ``records.evaluation_entry``
        # Checkpointed with the stage, so that a resumed run neither evaluates (and releases) a step again
        # nor loses the entries before the kill.
        self.state.extra_meta = lambda: {"evaluations": self.evaluations, **self._staleness_meta(),
                                         "micro_batches": self.opts.micro_batches, **self._loss_fields()}
        # Work done while a reply is awaited (``_while_waiting``): the next step's batch, fetched ahead
        # (step, batch), and the applied steps not yet reported (``_after_step`` queues them for ``_report``).
        self.next_batch: tuple[int, tuple[np.ndarray, np.ndarray | None, np.ndarray | None]] | None = None
        self.unreported: list[tuple[int, float | None, float, dict[str, Any] | None, dict[str, Any]]] = []
        self._fix_step_path()

    def _watch_inputs(self) -> None:
        """This data owner's privacy meter and input guard, when its options ask for them; both read what the
        stage sends and are checkpointed with it (they outlive a restart)."""
        opts, exp = self.opts, self.exp
        # The privacy meter reads what this stage sends; its latest window's figures join the step's record.
        self.leaks: dict[str, float] = {}
        self.metering = (Metering(opts.meter_kind, self.state.engine, self.data.features,
                                  self.eval_every if self.holds_out else 0, self.steps, self._leaked, self.log,
                                  step_rows(self.data))
                         if opts.meter_kind else None)
        max_r2 = exp.spec(opts.stage).input_guard if exp.has_stage(opts.stage) else None
        self.guarding = (Guarding(self.state.engine, self.data.features, max_r2,
                                  client_stage_name(opts.stage, opts.client), self.log,
                                  step_rows(self.data))
                         if max_r2 is not None else None)
        for name, kept in (("meter", self.metering), ("guard", self.guarding)):
            if kept is not None:
                self.state.keep(name, kept)       # checkpointed with the stage: they outlive a restart

    def _hold_steps_in_flight(self) -> None:
        """The staleness S (``--staleness``; with ``auto``, chosen after step 1) and the steps in flight."""
        opts = self.opts
        self.staleness = opts.steps_in_flight
        # --staleness auto: step 1 runs in lockstep and measures the link (``probe``), then S is chosen. The
        # history keeps the initial parameters meanwhile, which the forwards of steps 2..S+1 use.
        self.probe: LinkProbe | None = None
        if opts.auto_staleness:
            self.state.history.depth = MAX_STALENESS
        # Steps sent but not yet applied (staleness): step -> (parameter version of its forward, caches by
        # micro-batch), and its requests still unanswered.
        self.in_flight: dict[int, tuple[int, dict[int, Any]]] = {}
        self.pending: dict[int, dict[tuple[int, int], Message]] = {}

    def _fix_step_path(self) -> None:
        """Decisions fixed for the run, taken once rather than asked of the experiment and stage every step
        (the lockstep step's path is short: ``step_once``)."""
        opts, exp = self.opts, self.exp
        # Fixed for the run: the micro-batches kept in flight, each one's error-feedback stream.
        self.window = opts.window
        self.streams = [stream_name(ACTIVATION, i, opts.micro_batches) for i in range(opts.micro_batches)]
        # Whether the rate follows the evaluations depends on the stage file's schedule, which a rollback's
        # rebuilt stage keeps.
        self.labels_travel, self.send_rows, self.vertical = exp.labels_travel, exp.send_rows, exp.vertical
        self.plateau = self.state.stage.plateau
        self.may_owe = self.holds_out and (self.plateau or self.vertical)     # ``_owes_evaluation`` can be True
        self.micro_batches, self.auto_staleness = opts.micro_batches, opts.auto_staleness

    def _start(self) -> None:
        """A new run with a fresh id, or (``--resume``) the run of the latest checkpoint, with what it kept:
        its evaluations, whether the loss was withheld, where early stopping ended it. Raises
        ``ConfigError`` when that checkpoint was written with another staleness or micro-batch count."""
        state = self.state
        if not (self.opts.resume and state.resume_latest()):
            state.begin(uuid.uuid4().hex)
            self._keep_metrics(0)
            return
        self._check_resumed_staleness()
        self._check_resumed_micro_batches()
        state.open_trace(append=True)
        self._keep_metrics(state.stage.step)
        self.loss_withheld = state.resumed_meta.get("training_loss") == wire.LOSS_WITHHELD
        saved = state.resumed_meta.get("evaluations", [])
        self.evaluations = [dict(e) for e in saved if isinstance(e, dict) and isinstance(e.get("step"), int)
                            and e["step"] <= state.stage.step] if isinstance(saved, list) else []
        if state.verdicts.stopped_at:       # early stopping ended the run there before the kill
            self.steps = min(self.steps, state.verdicts.stopped_at)

    def _keep_metrics(self, step: int) -> None:
        """The metrics file (kept by ``--resume``) holds the lines of the steps up to ``step`` only: those the
        resumed checkpoint holds (0: a new run, an empty file)."""
        for writer in self.writers:
            if isinstance(writer, MetricsWriter):
                writer.rollback(step)

    def _leaked(self, step: int, figures: dict[str, float]) -> None:
        """A window of the privacy meter closed after ``step``: its figures go with that step's record."""
        self.leaks = figures

    def _evaluation_due(self, step: int) -> bool:
        """Evaluate after ``step``: every ``eval_every``-th step and the last, when rows are held out."""
        return self.holds_out and evaluation_due(step, self.steps, self.eval_every)

    def handshake(self) -> None:
        """Hello/welcome; afterwards every stage stands at the newest step they all hold."""
        stage = self.state.stage
        held = self.state.held()
        hello = handshake.hello(
            self.exp, self.opts.stage, self.opts.seed, stage.output_shape, self.state.run_id, held, self.steps,
            self.opts.micro_batches, self.opts.client, self.eval_every if self.holds_out else 0,
            staleness=self.staleness)
        masked = self.state.senders.codec(ACTIVATION)
        if isinstance(masked, SecureSumCodec) and masked.masks is not None:
            hello.body["mask_tags"] = masked.masks.tags()   # the label owner checks that every pair agrees
        common = self.link.handshake(hello, self.opts.client)
        if isinstance(masked, SecureSumCodec) and masked.masks is not None:
            self._bind_masks(masked)
        self.in_flight, self.pending = {}, {}      # steps in flight are sent again from the common step
        if common in held:
            self.state.rollback(common)
            self._keep_metrics(common)                      # as the trace: the lines of steps redone go
            self.state.history.rewind(self.state.stage)     # as before the first of them
        else:
            # Dropped by the serving stage of several clients: go on from here at its next step.
            self.log.warning("the serving stage goes on with this client at step %d; it has parameters of step "
                             "%d (steps %d to %d are skipped)", common + 1, self.state.stage.step,
                             self.state.stage.step + 1, common)
            self.state.stage.step = common
        self.state.engine.reset()
        # Evaluations of steps rolled back are taken again when those steps are. A feature party evaluates
        # a due step again after every handshake at it (``_owes_evaluation``): the label owner, resumed or
        # rolled back to that step, waits for every party's held-out embeddings of it.
        step = self.state.stage.step
        again = self.exp.vertical and 0 < step < self.steps and self._evaluation_due(step)
        self.evaluations = [e for e in self.evaluations if e["step"] < step or (e["step"] == step and not again)]
        self.state.verdicts.forget_after(step)
        self.log.info("run %s: at step %d of %d", self.state.run_id, self.state.stage.step, self.steps)

    def _bind_masks(self, masked: SecureSumCodec) -> None:
        """Secure aggregation: bind this party's masks to the run (``PairMasks.for_run``), every party's run
        id as the label owner names them (``mask_runs``, this party's own at its place), from the welcome or,
        until every party has said hello, from pongs asked every ``MASK_RUNS_POLL_S``. Raises ``PeerTimeout``
        after ``peer_deadline_s`` without them, ``ProtocolError`` for run ids that are not this run's."""
        runs, started = self.link.welcome.get("mask_runs"), time.monotonic()
        while runs is None:
            if time.monotonic() - started > self.opts.peer_deadline_s:
                raise PeerTimeout(f"stage {self.below} did not name every feature party's run within "
                                  f"{self.opts.peer_deadline_s:g} s (--peer-deadline): the masks of secure "
                                  f"aggregation need every party's hello first")
            self.stop.check()
            time.sleep(MASK_RUNS_POLL_S)
            runs = self.link.ping(self.state.run_id, self.opts.timeout_s).body.get("mask_runs")
        self.state.senders.use(ACTIVATION, masked.for_run(runs, self.state.run_id))
        self.log.info("run %s: masks bound to the feature parties' runs %s", self.state.run_id, runs)

    def _staleness_meta(self) -> dict[str, Any]:
        """The staleness S a checkpoint's steps in flight belong to (not yet known before ``--staleness auto``
        has chosen it)."""
        return {} if self.auto_staleness and self.probe is None else {"staleness": self.staleness}

    def _loss_fields(self) -> dict[str, Any]:
        """``training_loss``: ``wire.LOSS_WITHHELD`` once a reply came without a loss (the summary's
        ``final_loss`` is then null), else nothing."""
        return {"training_loss": wire.LOSS_WITHHELD} if self.loss_withheld else {}

    def _check_resumed_micro_batches(self) -> None:
        """Raise ``ConfigError`` when the checkpoint just resumed was written with another ``--micro-batches``:
        a step's gradient is summed over its micro-batches, so a run that changed M part way would equal no
        single run (checkpoints from before M was recorded are taken as they are)."""
        saved = self.state.resumed_meta.get("micro_batches")
        if isinstance(saved, int) and not isinstance(saved, bool) and saved != self.opts.micro_batches:
            raise ConfigError(f"stage {self.opts.instance}: the checkpoint of step {self.state.resumed_step} was "
                              f"written with --micro-batches {saved}, and this run asks for "
                              f"{self.opts.micro_batches}: the steps before and after it would be summed over "
                              f"different micro-batches, which no single run does. Resume with --micro-batches "
                              f"{saved}, or start a new run (without --resume)")

    def _check_resumed_staleness(self) -> None:
        """Raise ``ConfigError`` when the checkpoint just resumed was written with another staleness: its
        parameter versions and forwards are those of its steps in flight, and a run that changed S part way
        would be no run's computation (with a larger S the versions it needs are not even kept)."""
        saved = self.state.resumed_meta.get("staleness")
        if isinstance(saved, int) and not isinstance(saved, bool) and saved != self.staleness:
            raise ConfigError(f"stage {self.opts.instance}: the checkpoint of step {self.state.resumed_step} was "
                              f"written with staleness {saved}, and this run asks for {self.staleness}: its steps "
                              f"in flight are those of staleness {saved}. Resume with --staleness {saved}, or start "
                              f"a new run (without --resume)")
