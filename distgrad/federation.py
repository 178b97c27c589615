"""One serving stage, several data owners: ``serve_clients`` (see docs/topologies.md).

Each client runs the first stage on its own shard of the data and sends its
forwards as in a two-stage run. The serving stage takes them in a fixed
order, whatever order they arrive in: every step, client 0, then 1, ... each
for all its micro-batches, one update per client. A request that arrives
before its turn waits here, unanswered, and is answered when its turn
comes, so the run is reproducible and equal, bit for bit, to
``train_in_process``. With ``mode = "splitfed"``, after every
``average_every`` steps each client sends its parameters and gets back the
mean of all of them.

A client this stage is waiting for that stays silent for ``liveness_s`` is
dropped; the others go on without it. It can say hello again (with
``--resume``, or without: its parameters are what it has) and takes part
again from the next step that starts, skipping the steps it missed.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import zmq

from . import wire
from .errors import ConfigError, NonFiniteError, PeerTimeout, ProtocolError, StageError
from .experiment import build_stage_parts
from .inprocess import evaluation_fields
from .stage import average_parameters, client_stage_name, combine_losses, micro_batch
from .transport import POLL_TICK_S, Server
from .wire import ErrorCode, Message

from .daemon import StageOptions, StageState, StopFlag, common_step, frame_limit, target_spec, tensor_specs
from .server import announce, check_hello, decode_and_handle

Envelope = list[bytes]
Reply = tuple[Envelope, Message]


@dataclass
class _Client:
    """What the serving stage knows of one data owner."""

    index: int
    run: str = ""
    owner: str = ""                   # CURVE key it said hello with ("" in plaintext)
    active: bool = False              # takes part in the steps
    joining: bool = False             # said hello mid-run: takes part from the next step that starts
    finished: bool = False            # said bye
    step: int = 0                     # steps this client has completed here
    mbs: int = 1
    specs: dict = field(default_factory=dict)
    last_seen: float = -math.inf      # last message from it, or last reply to it
    envelope: Envelope = field(default_factory=list)
    waiting: dict[tuple[int, int], Message] = field(default_factory=dict)   # forwards before their turn
    cached: dict[tuple[int, int], Message] = field(default_factory=dict)    # replies of its last two steps
    average: Message | None = None    # its parameters for the averaging in progress
    averaged: Message | None = None   # the reply to its last averaging
    evaluate: Message | None = None   # its evaluation request, answered once every step is done
    losses: list[np.float32] = field(default_factory=list)
    loss: float | None = None
    evaluation: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return f"client {self.index}"


class ClientsServer:
    """Protocol logic of a last stage serving ``experiment.clients.count`` first stages.

    ``handle(envelope, msg, now, peer_key)`` returns the replies to send now
    (to this client or, when its message completed a turn, to others) and
    raises ``ProtocolError`` for a message that must be refused; a refused
    message changes nothing. ``tick(now)`` drops a silent client the stage
    is waiting for and returns the replies that unblocks.
    """

    def __init__(self, opts: StageOptions) -> None:
        self.opts, self.exp = opts, opts.experiment
        if not self.exp.federated or self.exp.stage_index(opts.stage) != 1:
            raise ConfigError(f"stage {opts.stage!r} of {self.exp.name!r} does not serve several clients")
        self.count, self.steps = self.exp.clients.count, self.exp.steps if opts.steps is None else opts.steps
        self.upstream = self.exp.stage_names[0]
        self.state = StageState(opts)
        self.state.run_id = uuid.uuid4().hex      # this stage's name for the run; each client has its own
        self.log = self.state.log
        self.data = [self.exp.build_data(opts.seed, client=c) for c in range(self.count)]   # targets only
        self.target = target_spec(self.exp, opts.seed)
        rows = len(self.data[0].test_rows)
        single = tensor_specs(self.stage, self.target, 1)
        self.eval_specs = {name: ((rows, *shape[1:]), dtype) for name, (shape, dtype) in single.items()}
        first_model, _, _ = build_stage_parts(self.exp, self.upstream, opts.seed, opts.init)
        self.param_specs = {name: (value.shape, value.dtype) for name, value in first_model.params.items()}
        self.max_frame_bytes, self.max_tensor_bytes = (max(a, b, c) for a, b, c in zip(
            frame_limit(single), frame_limit(self.eval_specs), frame_limit(self.param_specs)))
        self.clients = [_Client(c) for c in range(self.count)]
        self.by_run: dict[str, _Client] = {}
        self.phase = "joining"            # joining -> steps (<-> averaging) -> done
        self.round = 0                    # the step in progress
        self.order: list[int] = []        # the clients taking part in it, in turn order
        self.turn = 0                     # index into ``order``
        self.first_hello: float | None = None
        self.lost_since: float | None = None
        self.started = time.perf_counter()
        self.loss: float | None = None
        self.finished: dict[str, Any] | None = None

    @property
    def stage(self):
        return self.state.stage

    # -- messages
    def handle(self, envelope: Envelope, msg: Message, now: float, peer_key: str = "") -> list[Reply]:
        if msg.type == wire.PING:
            return [(envelope, Message(wire.PONG, msg.run, msg.step, body={
                "stage": self.opts.stage, "experiment": self.exp.name, "step": self.round, "phase": self.phase,
                "clients_active": sum(c.active for c in self.clients)}))]
        if msg.type == wire.HELLO:
            return [(envelope, self._hello(envelope, msg, now, peer_key))] + self._advance(now)
        client = self.by_run.get(msg.run)
        if client is None:
            raise ProtocolError(ErrorCode.RUN, f"{msg.type} for run {msg.run!r}, which no client opened: a hello first")
        if client.owner and peer_key != client.owner:
            raise ProtocolError(ErrorCode.RUN, "this run belongs to another client key")
        if msg.type == wire.FORWARD:
            replies = self._forward(client, envelope, msg)
        elif msg.type == wire.AVERAGE:
            replies = self._average(client, envelope, msg)
        elif msg.type == wire.EVALUATE:
            replies = self._evaluate(client, envelope, msg)
        elif msg.type == wire.BYE:
            replies = self._bye(client, envelope, msg)
        else:
            raise ProtocolError(ErrorCode.TYPE, f"a serving stage does not accept {msg.type!r} messages")
        client.last_seen, client.envelope = now, envelope
        return replies + self._advance(now)

    def _hello(self, envelope: Envelope, msg: Message, now: float, peer_key: str) -> Message:
        body = msg.body
        mbs = check_hello(body, self.upstream, self.exp, self.opts.seed, self.stage.input_shape,
                          self.opts.stage)
        index = body.get("client")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.count:
            raise ProtocolError(ErrorCode.MISMATCH, f"hello has client={wire.show(index)}; this stage serves "
                                                    f"clients 0 to {self.count - 1} (give --client)")
        held = body.get("held")
        common_step([0], held)                          # validates the list
        client = self.clients[index]
        if client.owner and peer_key != client.owner:
            raise ProtocolError(ErrorCode.RUN, f"client {index} said hello with another key before")
        if self.phase == "done":
            raise ProtocolError(ErrorCode.RUN, f"every step of this run is done; client {index} cannot join now")
        if client.active and client.run != msg.run and now - client.last_seen <= self.opts.liveness_s:
            raise ProtocolError(ErrorCode.RUN, f"busy: client {index} is live in run {client.run}; "
                                               f"cannot start run {msg.run!r}")
        if client.run and client.run != msg.run:
            self.by_run.pop(client.run, None)
        rejoin = client.active and client.run == msg.run
        client.run, client.owner, client.mbs = msg.run, client.owner or peer_key, mbs
        client.specs = tensor_specs(self.stage, self.target, mbs)
        client.waiting, client.average, client.evaluate = {}, None, None
        self.by_run[msg.run] = client
        if self.first_hello is None:
            self.first_hello = now
        if rejoin:
            # Still taking part: it continues where this stage has it. A step of its in progress
            # here starts again from its first micro-batch.
            if self._current() is client:
                self.stage.accumulator.reset()
                client.losses = []
            client.cached = {k: v for k, v in client.cached.items() if k[0] <= client.step}
            next_step = client.step + 1
        elif self.phase == "joining":
            client.active, client.step = True, 0
            next_step = 1
        else:
            client.active, client.joining, client.cached = False, True, {}
            client.step = self.round                   # it takes part from the next step that starts
            next_step = self.round + 1
            self.log.warning("client %d rejoins (run %s); it takes part again from step %d", index, msg.run, next_step)
        self.log.info("client %d said hello (run %s, %d micro-batches): next step %d", index, msg.run, mbs, next_step)
        client.last_seen, client.envelope = now, envelope
        return Message(wire.WELCOME, msg.run, msg.step, body={"stage": self.opts.stage, "next_step": next_step})

    def _forward(self, client: _Client, envelope: Envelope, msg: Message) -> list[Reply]:
        key = (msg.step, msg.mb)
        cached = client.cached.get(key)
        if cached is not None:
            return [(envelope, cached)]                 # a repeated request: same reply, no second update
        if msg.step != client.step + 1 or msg.mbs != client.mbs:
            raise ProtocolError(ErrorCode.STEP, f"forward for step {msg.step} micro-batch {msg.mb}/{msg.mbs}; "
                                                f"client {client.index} is at step {client.step + 1} "
                                                f"with {client.mbs} micro-batches")
        if not (client.active or client.joining):
            raise ProtocolError(ErrorCode.RUN, f"client {client.index} was dropped (silent for more than "
                                               f"{self.opts.liveness_s:g} s when its turn came); say hello again")
        wire.expect_tensors(msg, client.specs, self.exp.allow_nonfinite)
        client.waiting[key] = msg                      # answered in its turn (see _advance)
        return []

    def _average(self, client: _Client, envelope: Envelope, msg: Message) -> list[Reply]:
        if client.averaged is not None and client.averaged.step == msg.step:
            return [(envelope, client.averaged)]
        if not client.active:
            raise ProtocolError(ErrorCode.RUN, f"client {client.index} does not take part in this average "
                                               f"(it was dropped or is rejoining); say hello again")
        if self.exp.clients.mode != "splitfed" or msg.step != client.step or msg.step % self.exp.clients.average_every:
            raise ProtocolError(ErrorCode.STEP, f"average at step {msg.step}: client {client.index} is at step "
                                                f"{client.step}; this run averages every "
                                                f"{self.exp.clients.average_every or 'never'} steps")
        wire.expect_tensors(msg, self.param_specs, self.exp.allow_nonfinite)
        client.average = msg
        return []

    def _evaluate(self, client: _Client, envelope: Envelope, msg: Message) -> list[Reply]:
        if not len(self.data[client.index].test_rows):
            raise ProtocolError(ErrorCode.TYPE, f"experiment {self.exp.name!r} holds out no rows to evaluate")
        wire.expect_tensors(msg, self.eval_specs, self.exp.allow_nonfinite)
        if client.evaluation is not None:
            return [(envelope, Message(wire.EVALUATION, msg.run, msg.step, body=client.evaluation))]
        client.evaluate = msg                          # answered once every step is done
        return []

    def _bye(self, client: _Client, envelope: Envelope, msg: Message) -> list[Reply]:
        steps = msg.body.get("steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps != client.step:
            raise ProtocolError(ErrorCode.STEP, f"bye after {wire.show(steps)} steps, but client {client.index} "
                                                f"has {client.step} here")
        if not client.finished:
            self.log.info("client %d finished after %d steps", client.index, client.step)
        client.finished, client.active = True, False
        return [(envelope, Message(wire.BYE, msg.run, msg.step, body={"steps": client.step}))]

    # -- the turn order
    def _current(self) -> _Client | None:
        if self.phase != "steps" or self.turn >= len(self.order):
            return None
        return self.clients[self.order[self.turn]]

    def _advance(self, now: float) -> list[Reply]:
        """Do every piece of work whose inputs have arrived, in the fixed order; return the replies."""
        replies: list[Reply] = []
        while True:
            if self.phase == "joining":
                present = [c for c in self.clients if c.active]
                waited = self.first_hello is not None and now - self.first_hello > self.opts.peer_deadline_s
                if len(present) < self.count and not (present and waited):
                    return replies
                if len(present) < self.count:
                    self.log.warning("starting with clients %s: the others did not say hello within %g s",
                                     [c.index for c in present], self.opts.peer_deadline_s)
                self._next_round()
            elif self.phase == "steps":
                client = self._current()
                if client is None:
                    if not any(c.active or c.joining for c in self.clients):
                        # Nobody takes part: the next step waits for a hello (``tick`` bounds the wait)
                        # rather than running the remaining steps with no one.
                        return replies
                    if self.exp.clients.mode == "splitfed" and self.round % self.exp.clients.average_every == 0:
                        self.phase = "averaging"
                    else:
                        self._next_round()
                    continue
                if not client.active:
                    self.turn += 1
                    continue
                msg = client.waiting.pop((self.round, self.stage.accumulator.count), None)
                if msg is None:
                    return replies
                replies.append(self._compute(client, msg, now))
            elif self.phase == "averaging":
                taking_part = [self.clients[i] for i in self.order if self.clients[i].active]
                if any(c.average is None for c in taking_part):
                    return replies
                if taking_part:
                    mean = average_parameters([c.average.tensors for c in taking_part])
                    for c in taking_part:
                        c.averaged = Message(wire.AVERAGE, c.run, self.round, tensors=mean)
                        c.average, c.last_seen = None, now
                        replies.append((c.envelope, c.averaged))
                self._next_round()
            else:   # done
                for c in self.clients:
                    if c.evaluate is not None:
                        replies.append((c.envelope, self._evaluation(c)))
                return replies

    def _next_round(self) -> None:
        self.round += 1
        if self.round > self.steps:
            self.phase = "done"
            self.log.info("every step is done; answering evaluations and byes")
            return
        for c in self.clients:
            if c.joining:
                c.joining, c.active = False, True
        self.order = [c.index for c in self.clients if c.active]
        self.turn, self.phase = 0, "steps"

    def _compute(self, client: _Client, msg: Message, now: float) -> Reply:
        """One micro-batch of ``client``'s turn; the update after its last one."""
        stage = self.stage
        target = msg.tensors.get("target")
        if target is None:
            target = micro_batch(self.data[client.index].targets(msg.step), msg.mb, msg.mbs)
        started = time.perf_counter()
        try:
            mb_loss, dx, grads = stage.loss_micro_batch(msg.tensors["activation"], target)
            stage.check_finite("loss", mb_loss, msg.step)
            stage.check_finite("activation_grad", dx, msg.step)
            applied = None
            if msg.mb == msg.mbs - 1:
                assert stage.loss is not None
                scale = stage.loss.micro_batch_scale(msg.mbs)
                stage.accumulator.add(grads, msg.mb, msg.mbs)
                applied = stage.accumulator.take(scale)
                stage.check_grads(applied)
        except StageError as e:
            # The stage's own computation failed (or gave a NaN/Inf): nothing was applied; the
            # client hears why and is dropped, so the others go on (it may say hello again).
            self.stage.accumulator.reset()
            client.losses, client.active = [], False
            self.turn += 1
            code = ErrorCode.NONFINITE_STEP if isinstance(e, NonFiniteError) else ErrorCode.STAGE
            if code == ErrorCode.NONFINITE_STEP:
                self.log.error("client %d dropped: %s", client.index, e)
            else:
                self.log.warning("client %d dropped: %s", client.index, e)
            return client.envelope, wire.error_message(msg.run, msg.step, code, str(e), msg.mb, msg.mbs)
        if msg.mb == 0:
            client.cached = {k: v for k, v in client.cached.items() if k[0] == msg.step - 1}
        if applied is None:
            stage.accumulator.add(grads, msg.mb, msg.mbs)
        client.losses.append(mb_loss)
        body = {"loss": float(mb_loss)}
        reply = Message(wire.BACKWARD, msg.run, msg.step, msg.mb, msg.mbs, body=body, tensors={"activation_grad": dx})
        client.cached[(msg.step, msg.mb)] = reply
        if applied is not None:
            stage.apply(applied)
            client.loss = self.loss = float(combine_losses(client.losses, scale))
            client.losses, client.step = [], msg.step
            self.turn += 1
        body["compute_s"] = time.perf_counter() - started
        client.last_seen = now
        return client.envelope, reply

    def _evaluation(self, client: _Client) -> Message:
        msg = client.evaluate
        assert msg is not None
        client.evaluate = None
        target = msg.tensors.get("target")
        data = self.data[client.index]
        try:
            client.evaluation = self.stage.evaluate_last(msg.tensors["activation"],
                                                         data.test_targets() if target is None else target)
        except StageError as e:
            return wire.error_message(msg.run, msg.step, ErrorCode.STAGE, str(e))
        return Message(wire.EVALUATION, msg.run, msg.step, body=client.evaluation)

    # -- liveness and the end of the run
    def tick(self, now: float) -> list[Reply]:
        """Drop a client this stage waits for that has been silent for ``liveness_s``."""
        if self.phase == "joining":
            return self._advance(now)         # the first step may start without a late client
        waiting_for = []
        current = self._current()
        if current is not None and current.active:
            waiting_for.append(current)
        if self.phase == "averaging":
            waiting_for += [self.clients[i] for i in self.order
                            if self.clients[i].active and self.clients[i].average is None]
        if self.phase == "done":
            waiting_for += [c for c in self.clients if c.active and not c.finished]   # its evaluation and bye
        dropped = False
        for client in waiting_for:
            if now - client.last_seen <= self.opts.liveness_s:
                continue
            if self.phase == "done":
                self.log.warning("client %d silent for more than %g s after the last step, without a bye; "
                                 "dropped (the run ends without it)", client.index, self.opts.liveness_s)
            else:
                self.log.warning("client %d silent for more than %g s at step %d; dropped (the others go on; "
                                 "it may say hello again)", client.index, self.opts.liveness_s, self.round)
            client.active = False
            if current is client:
                self.stage.accumulator.reset()
                client.losses = []
            dropped = True
        if self.lost():
            self.lost_since = self.lost_since or now
        else:
            self.lost_since = None
        return self._advance(now) if dropped else []

    def lost(self) -> bool:
        """Every client is lost: none takes part in the steps, or after the last one none said bye
        and none is left to say it."""
        if self.phase == "joining":
            return False
        if self.phase == "done":
            return not any(c.finished or c.active for c in self.clients)
        return not any(c.active or c.joining for c in self.clients)

    def complete(self) -> bool:
        """Every step is done and every client still taking part has said bye (one at least)."""
        return self.phase == "done" and all(c.finished or not c.active for c in self.clients) and any(
            c.finished for c in self.clients)

    def summary(self, status: str) -> dict[str, Any]:
        per_client = [{"client": c.index, "run_id": c.run, "steps": c.step, "final_loss": c.loss,
                       "status": "completed" if c.finished else "dropped", **evaluation_fields(c.evaluation)}
                      for c in self.clients]
        summary = self.state.summary(status, self.started, self.loss, clients=per_client, rounds=min(
            self.round, self.steps))
        self.state.close()
        return summary


def serve_clients(opts: StageOptions, bind: str, stop: StopFlag, keep_serving: bool = False,
                  ready_file: Path | None = None, ctx: zmq.Context | None = None,
                  on_ready: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Serve the clients of one run on ``bind`` until every step is done and they said bye.

    Returns the summary (with a ``clients`` list) once every step is done and
    each client has said bye or been dropped (silent for ``opts.liveness_s``
    when this stage waited for it), one bye at least. Raises ``PeerTimeout``
    (summary status ``lost``) when every client has been lost for
    ``opts.peer_deadline_s``, before or after the last step, and
    ``Interrupted`` on a signal. ``keep_serving`` is not supported: one
    process serves one run of several clients.
    """
    if keep_serving:
        raise ConfigError("--keep-serving is not supported for a serving stage with several clients")
    logic = ClientsServer(opts)
    log = logic.log
    ctx = ctx or zmq.Context.instance()
    server = Server(ctx, bind, logic.max_frame_bytes, opts.liveness_s, opts.security, opts.spin_s)
    status = "interrupted"
    try:
        announce(server, opts, ready_file, on_ready)
        while True:
            stop.check()
            request = server.receive(POLL_TICK_S)
            now = time.monotonic()
            replies = logic.tick(now)
            if logic.lost_since is not None and now - logic.lost_since > opts.peer_deadline_s:
                status = "lost"
                when = "after the last step, none having said bye" if logic.phase == "done" else f"at step {logic.round}"
                raise PeerTimeout(f"every client lost for more than {opts.peer_deadline_s:g} s {when}; giving up")
            if request is not None:
                envelope, frames, peer_key = request
                _, answer, refused = decode_and_handle(frames, logic.max_tensor_bytes,
                                                       lambda m: logic.handle(envelope, m, now, peer_key), log)
                replies += [(envelope, answer)] if refused else answer
            for envelope, reply in replies:
                server.reply(envelope, reply)
            if logic.complete():
                status = "completed"
                first = opts.experiment.stage_names[0]
                log.info("run completed: %d steps, clients %s said bye, clients %s were dropped", logic.steps,
                         [client_stage_name(first, c.index) for c in logic.clients if c.finished],
                         [client_stage_name(first, c.index) for c in logic.clients if not c.finished])
                return logic.summary(status)
    finally:
        if status != "completed":
            logic.summary(status)
        server.close()
