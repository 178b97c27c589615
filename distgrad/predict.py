"""``distgrad predict``: forward only, through live stages, on new rows.

The data owner (the first stage) reads the rows, computes its activations in
evaluation mode and sends them down in chunks of at most one batch; a middle
stage passes its own activations on; the label owner (the last stage)
computes the predictions and keeps them. When every chunk has arrived it
writes them on its own side (CSV or ``.npy``). Nothing travels back up but an
acknowledgement of each chunk (its row count), so the data owner never sees a
prediction and the label owner never sees a row.

Messages (docs/protocol.md): a ``hello`` with ``purpose = "predict"``, the
interface check of training, and the number of rows; ``predict`` messages
(``step`` = chunk number from 1, tensor ``activation`` of 1 to ``batch``
rows), each answered by ``predicted`` (``body.rows``); a ``bye`` with the
chunk and row counts, answered once the file is written. A chunk sent again
(a retry) replaces itself, so a retry never duplicates rows.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from . import aggregate, handshake, wire
from .errors import ConfigError, PeerTimeout, ProtocolError
from .link import DownstreamLink
from .options import StageOptions, StopFlag
from .records import write_atomic
from .serving import announce, decode_and_handle
from .stage_state import StageState
from .threads import one_compute_thread
from .transport import POLL_TICK_S, Server
from .wire import ErrorCode, Message

MAX_CHUNKS = 1 << 20        # chunks one prediction may send (a bound on the label owner's memory)
OUTPUT_SUFFIXES = (".csv", ".npy")


@dataclass
class _Session:
    run: str
    chunks: dict[int, np.ndarray]
    last_seen: float
    rows: int                     # the rows its hello announced: at most ``ceil(rows / batch)`` chunks
    most_chunks: int
    done: bool = False
    bye: tuple[Any, Message] | None = None   # a feature party's bye, answered once every party's rows are in


def read_rows(path: Path, exp: Any, stage: str) -> np.ndarray:
    """New rows from ``path`` (``.npy``: an array of rows; ``.csv``: numbers, one row a line, no header), as
    float32 ``(rows, *features)`` scaled like the stage's training data (its ``feature_scale``)."""
    spec = exp.spec(stage)
    table = exp.data if spec.data is None else spec.data
    scale = np.float32(table.get("feature_scale", 1.0))
    try:
        raw = np.load(path, allow_pickle=False) if path.suffix == ".npy" else np.loadtxt(
            path, delimiter=",", ndmin=2, dtype=np.float64)
        if not isinstance(raw, np.ndarray) or raw.ndim < 1 or raw.dtype.kind not in "biuf" or not len(raw):
            raise ValueError("expected a non-empty numeric array of rows")
        rows = raw.reshape(len(raw), -1).astype(np.float32) * scale
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"--input {path}: cannot read rows: {e}") from e
    width = exp.input_shape(stage)[1:] if exp.batch is not None else exp.input_shape(stage)
    if tuple(rows.shape[1:]) != tuple(width) or not len(rows):
        raise ConfigError(f"--input {path} has rows of shape {tuple(rows.shape[1:])} ({len(rows)} rows); stage "
                          f"{stage} takes rows of shape {tuple(width)}")
    return rows


@one_compute_thread()
def send_predictions(opts: StageOptions, connect: str, rows: np.ndarray, stop: StopFlag,
                     ctx: zmq.Context | None = None) -> int:
    """The data owner's side: forward ``rows`` in chunks through the stages below ``connect``; returns the
    number of rows the label owner acknowledged. Raises ``PeerTimeout``, ``PeerRejected``, ``ProtocolError``."""
    exp = opts.experiment
    exp.check_role(opts.stage, binds=False, connects=True)
    state = StageState(opts)
    stage, log = state.stage, state.log
    link = DownstreamLink(opts.link, connect, stop.check, ctx or zmq.Context.instance(), opts.security, None)
    run = uuid.uuid4().hex
    chunk_rows = exp.batch or 1
    chunks = [rows[i:i + chunk_rows] for i in range(0, len(rows), chunk_rows)]
    try:
        hello = handshake.hello(exp, opts.stage, opts.seed, stage.output_shape, run, [0], 0, 1)
        hello.body.update(purpose="predict", rows=len(rows))
        link.handshake(hello)
        acknowledged = 0
        for number, chunk in enumerate(chunks, start=1):
            y, _ = stage.forward(chunk if exp.batch else chunk[0], training=False)
            reply = link.exchange(Message(wire.PREDICT, run, number, tensors={"activation": y}))
            acknowledged += _acknowledged(reply, number, len(chunk))
        reply = link.exchange(Message(wire.BYE, run, len(chunks) + 1, body={"chunks": len(chunks),
                                                                               "rows": len(rows)}))
        if reply.type != wire.BYE or reply.body.get("rows") != len(rows):
            raise ProtocolError(ErrorCode.TYPE, f"expected the bye of {len(rows)} rows, got {reply.describe()}")
        log.info("sent %d rows in %d chunks; the label owner wrote their predictions", acknowledged, len(chunks))
        return acknowledged
    finally:
        link.close()
        state.close()


def _acknowledged(reply: Message, number: int, rows: int) -> int:
    if reply.type != wire.PREDICTED or reply.step != number or reply.body.get("rows") != rows or reply.tensors:
        raise ProtocolError(ErrorCode.TYPE, f"expected the acknowledgement of chunk {number} ({rows} rows), got "
                                            f"{reply.describe()} {wire.show(reply.body)}")
    return rows


class PredictionServer:
    """A serving stage of ``distgrad predict``: the label owner (writes ``output``) or a middle stage
    (passes its activations on through ``link``). ``handle`` answers one message (None: later, through
    ``take_ready``) or raises ``ProtocolError``; a refused message changes nothing.

    The label owner of a vertical experiment takes one prediction session per feature party (each its
    own run id, all announcing the same rows): chunk n's predictions are made once every party's
    embedding of it has arrived (``aggregate.combine``), and a party's bye is answered once every party's
    rows are in and the file is written."""

    def __init__(self, opts: StageOptions, output: Path | None, link: DownstreamLink | None) -> None:
        self.opts, self.exp, self.output, self.link = opts, opts.experiment, output, link
        self.state = StageState(opts)
        self.stage, self.log = self.state.stage, self.state.log
        self.parties = self.exp.upstream(opts.stage)        # the stages that send here
        self.upstream = self.parties[0]
        self.vertical = self.exp.vertical and len(self.parties) > 1
        shapes = ({name: self.exp.cuts[self.exp.stage_index(name)] for name in self.parties} if self.vertical
                  else {self.upstream: self.stage.input_shape})
        self.row_shapes = {name: tuple(shape[1:] if self.exp.batch else shape) for name, shape in shapes.items()}
        self.sessions: dict[str, _Session] = {}              # by sending stage
        self.predictions: dict[int, np.ndarray] = {}         # vertical: chunk -> its predictions
        self.ready: list[tuple[Any, Message]] = []           # deferred replies (held byes) to send now
        self.written = 0

    @property
    def session(self) -> _Session | None:
        """The prediction in progress (a vertical one's first party's)."""
        return self.sessions.get(self.upstream)

    def finished(self) -> bool:
        """Every sender's prediction is complete (written, or passed on)."""
        return bool(self.sessions) and len(self.sessions) == len(self.row_shapes) and all(
            session.done for session in self.sessions.values())

    def take_ready(self) -> list[tuple[Any, Message]]:
        ready, self.ready = self.ready, []
        return ready

    def handle(self, msg: Message, now: float, envelope: Any = None) -> Message | None:
        if msg.type == wire.PING:
            return Message(wire.PONG, msg.run, msg.step, body={"stage": self.opts.stage, "purpose": "predict",
                                                               "experiment": self.exp.name})
        if msg.type == wire.HELLO:
            return self._hello(msg, now)
        session = next((s for s in self.sessions.values() if s.run == msg.run), None)
        if session is None:
            raise ProtocolError(ErrorCode.RUN, f"{msg.type} for run {msg.run!r}: say hello first")
        session.last_seen = now
        if msg.type == wire.PREDICT:
            return self._predict(session, msg)
        if msg.type == wire.BYE:
            return self._bye(session, msg, envelope)
        raise ProtocolError(ErrorCode.TYPE, f"a prediction stage does not accept {msg.type!r} messages")

    def _hello(self, msg: Message, now: float) -> Message:
        body = msg.body
        sender = body.get("role") if self.vertical else self.upstream
        if sender not in self.row_shapes:
            raise ProtocolError(ErrorCode.MISMATCH, f"hello from stage {wire.show(sender)}; this stage serves the "
                                                    f"feature parties {self.parties}")
        shape = self.exp.cuts[self.exp.stage_index(sender)] if self.vertical else self.stage.input_shape
        handshake.check_hello(body, sender, self.exp, self.opts.seed, shape, self.opts.stage)
        if body.get("purpose") != "predict":
            raise ProtocolError(ErrorCode.MISMATCH, "this stage serves predictions (distgrad predict), not a "
                                                    "training run")
        rows = body.get("rows")
        if type(rows) is not int or not 1 <= rows <= MAX_CHUNKS * (self.exp.batch or 1):
            raise ProtocolError(ErrorCode.MALFORMED, f"hello has rows={wire.show(rows)}")
        session = self.sessions.get(sender)
        if session is not None and session.run != msg.run and not session.done and \
                now - session.last_seen <= self.opts.liveness_s:
            raise ProtocolError(ErrorCode.RUN, f"busy with prediction {session.run} (its sender is live)")
        for other, theirs in self.sessions.items():
            if other != sender and theirs.rows != rows:
                raise ProtocolError(ErrorCode.MISMATCH, f"party {sender} announces {rows} rows, party {other} "
                                                        f"{theirs.rows}: every party predicts the same rows")
        if session is None or session.run != msg.run:
            batch = self.exp.batch or 1
            self.sessions[sender] = _Session(msg.run, {}, now, rows, -(-rows // batch))
            if self.link is not None:
                own = handshake.hello(self.exp, self.opts.stage, self.opts.seed, self.stage.output_shape, msg.run,
                                      [0], 0, 1, relayed=body.get("parts"))
                own.body.update(purpose="predict", rows=rows)
                self.link.handshake(own)
            self.log.info("prediction %s: %d rows from %s", msg.run, rows, body.get("role"))
        return Message(wire.WELCOME, msg.run, msg.step, body={"stage": self.opts.stage, "next_step": 1})

    def _predict(self, session: _Session, msg: Message) -> Message:
        if session.done:
            raise ProtocolError(ErrorCode.STEP, f"prediction {session.run} is complete")
        if not 1 <= msg.step <= session.most_chunks or msg.mb != 0 or msg.mbs != 1:
            raise ProtocolError(ErrorCode.STEP, f"chunk {msg.step} is out of range 1..{session.most_chunks} (the "
                                                f"{session.rows} rows the hello announced)")
        sender = next(name for name, s in self.sessions.items() if s is session)
        row_shape = self.row_shapes[sender]
        activation = msg.tensors.get("activation")
        batched = self.exp.batch is not None
        rows = len(activation) if activation is not None and batched and activation.ndim else 1
        expected = (rows, *row_shape) if batched else row_shape
        if (set(msg.tensors) != {"activation"} or activation.dtype != np.float32 or tuple(activation.shape) != expected
                or not 1 <= rows <= (self.exp.batch or 1)):
            raise ProtocolError(ErrorCode.TENSOR, f"chunk {msg.step} must carry one float32 'activation' of 1 to "
                                                  f"{self.exp.batch or 1} rows of shape {row_shape}")
        if not self.exp.allow_nonfinite and not np.isfinite(activation).all():
            raise ProtocolError(ErrorCode.NONFINITE, f"chunk {msg.step} holds NaN or Inf")
        if self.vertical:
            if msg.step not in self.predictions:          # a chunk sent again after it was combined: done
                session.chunks[msg.step] = np.array(activation, copy=True)
                self._combine(msg.step)
            return Message(wire.PREDICTED, msg.run, msg.step, body={"rows": rows})
        y, _ = self.stage.forward(activation, training=False)
        if self.link is not None:
            reply = self.link.exchange(Message(wire.PREDICT, msg.run, msg.step, tensors={"activation": y}))
            _acknowledged(reply, msg.step, rows)
        else:
            assert self.stage.loss is not None            # the last stage: it owns the loss
            predictions = self.stage.loss.predict(y if batched else y[None])
            session.chunks[msg.step] = np.array(predictions, copy=True)
        return Message(wire.PREDICTED, msg.run, msg.step, body={"rows": rows})

    def _combine(self, number: int) -> None:
        """Vertical: chunk ``number``'s predictions, once every party's embedding of it has arrived."""
        parts = [self.sessions[name].chunks.get(number) if name in self.sessions else None for name in self.parties]
        if any(part is None for part in parts) or number in self.predictions:
            return
        if len({len(part) for part in parts}) != 1:
            raise ProtocolError(ErrorCode.TENSOR, f"chunk {number}: the parties sent {[len(p) for p in parts]} "
                                                  f"rows; every party sends the same rows")
        assert self.stage.loss is not None
        y, _ = self.stage.forward(aggregate.combine(self.exp.aggregate, parts), training=False)
        self.predictions[number] = np.array(self.stage.loss.predict(y), copy=True)
        for name in self.parties:
            del self.sessions[name].chunks[number]

    def _bye(self, session: _Session, msg: Message, envelope: Any = None) -> Message | None:
        chunks, rows = msg.body.get("chunks"), msg.body.get("rows")
        if type(chunks) is not int or type(rows) is not int or not 1 <= chunks <= session.most_chunks \
                or rows != session.rows:
            raise ProtocolError(ErrorCode.MALFORMED, f"bye has chunks={wire.show(chunks)}, rows={wire.show(rows)}; "
                                                     f"the hello announced {session.rows} rows in at most "
                                                     f"{session.most_chunks} chunks")
        if self.vertical:
            return self._bye_party(session, msg, envelope, chunks, rows)
        if self.link is not None:
            reply = self.link.exchange(Message(wire.BYE, msg.run, msg.step, body={"chunks": chunks, "rows": rows}))
            if reply.type != wire.BYE or reply.body.get("rows") != rows:
                raise ProtocolError(ErrorCode.STAGE, f"the stage below answered the bye with {reply.describe()}")
        elif not session.done:
            missing = [n for n in range(1, chunks + 1) if n not in session.chunks][:5]
            extra = [n for n in session.chunks if n > chunks][:5]
            have = sum(len(c) if c.ndim else 1 for c in session.chunks.values())
            if missing or extra or have != rows:
                raise ProtocolError(ErrorCode.STEP, f"bye of {chunks} chunks and {rows} rows, but this stage holds "
                                                    f"{have} rows (missing chunks {missing}, extra {extra})")
            self.written = self._write(np.concatenate([np.atleast_1d(session.chunks[n])
                                                       for n in range(1, chunks + 1)]))
        session.done = True
        return Message(wire.BYE, msg.run, msg.step, body={"rows": rows})

    def _bye_party(self, session: _Session, msg: Message, envelope: Any, chunks: int, rows: int) -> Message | None:
        """A feature party's bye: kept (its latest envelope) until every party's is in and every chunk
        combined; then the file is written and every party's bye answered (``take_ready``)."""
        reply = Message(wire.BYE, msg.run, msg.step, body={"rows": rows})
        if session.done:
            return reply                               # a bye sent again after the file was written
        missing = [n for n in range(1, chunks + 1) if n not in session.chunks and n not in self.predictions][:5]
        if missing or any(n > chunks for n in session.chunks):
            raise ProtocolError(ErrorCode.STEP, f"bye of {chunks} chunks, but chunks {missing} of this party are "
                                                f"missing (or it sent more)")
        session.bye = (envelope, msg)
        senders = [self.sessions.get(name) for name in self.parties]
        if any(s is None or s.bye is None for s in senders):
            return None                                # answered when the last party's bye comes
        if any(s.bye[1].body.get("chunks") != chunks for s in senders) or len(self.predictions) != chunks:
            raise ProtocolError(ErrorCode.STEP, f"the parties' byes disagree on the chunks, or chunks are missing "
                                                f"({len(self.predictions)} of {chunks} combined)")
        self.written = self._write(np.concatenate([np.atleast_1d(self.predictions[n]) for n in range(1, chunks + 1)]))
        for s in senders:
            s.done = True
            bye_envelope, bye = s.bye
            if bye_envelope is not None and s is not session:
                self.ready.append((bye_envelope, Message(wire.BYE, bye.run, bye.step, body={"rows": rows})))
        return reply

    def _write(self, predictions: np.ndarray) -> int:
        """Write the predictions to ``output`` (``.npy``, or ``.csv`` with a ``row`` column); returns rows."""
        assert self.output is not None
        if self.output.suffix == ".npy":
            write_atomic(self.output, lambda f: np.save(f, predictions, allow_pickle=False))
        else:
            table = predictions.reshape(len(predictions), -1)
            columns = ["prediction"] if table.shape[1] == 1 else [f"prediction_{i}" for i in range(table.shape[1])]
            fmt = "%d" if predictions.dtype.kind == "i" else "%.9g"
            lines = ["row," + ",".join(columns)] + [f"{i}," + ",".join(fmt % v for v in row)
                                                     for i, row in enumerate(table)]
            text = ("\n".join(lines) + "\n").encode()
            write_atomic(self.output, lambda f: f.write(text))
        self.log.info("wrote %d predictions to %s", len(predictions), self.output)
        return len(predictions)


@one_compute_thread()
def serve_predictions(opts: StageOptions, bind: str, output: Path | None, stop: StopFlag,
                      connect: str | None = None, ready_file: Path | None = None,
                      ctx: zmq.Context | None = None) -> int:
    """The label owner's (or a middle stage's) side: serve one prediction on ``bind`` and return its row count
    once written (passed on). Raises ``PeerTimeout`` when no sender comes, or it falls silent, for
    ``opts.peer_deadline_s``; ``Interrupted`` on a signal."""
    exp = opts.experiment
    exp.check_role(opts.stage, binds=True, connects=connect is not None)
    last = connect is None
    if last and (output is None or output.suffix not in OUTPUT_SUFFIXES):
        raise ConfigError(f"the label owner writes the predictions: give --output FILE.csv or FILE.npy"
                          f"{f', not {output}' if output is not None else ''}")
    if not last and output is not None:
        raise ConfigError("--output is for the label owner (the last stage), which alone sees the predictions")
    if output is not None and not output.parent.is_dir():
        raise ConfigError(f"--output {output}: the folder {output.parent} does not exist")
    ctx = ctx or zmq.Context.instance()
    link = DownstreamLink(opts.link, connect, stop.check, ctx, opts.downstream_security, None) if connect else None
    logic = PredictionServer(opts, output, link)
    max_frame = 4 * max(int(np.prod((exp.batch or 1, *shape))) for shape in logic.row_shapes.values()) \
        + wire.HEADER_MAX_BYTES
    server = Server(ctx, bind, max_frame, opts.liveness_s, opts.security, opts.spin_s)
    started = time.monotonic()
    try:
        announce(server, opts, ready_file, None)
        while True:
            stop.check()
            request = server.receive(POLL_TICK_S)
            now = time.monotonic()
            if request is not None:
                envelope, frames, _ = request
                msg, answer, _ = decode_and_handle(frames, max_frame, lambda m: logic.handle(m, now, envelope),
                                                   logic.log)
                if answer is not None:
                    server.reply(envelope, answer)
                for held, reply in logic.take_ready():
                    server.reply(held, reply)
                if logic.finished():
                    return logic.written if last else int(msg.body.get("rows", 0)) if msg else 0
            seen = max((s.last_seen for s in logic.sessions.values()), default=started)
            if now - seen > opts.peer_deadline_s:
                raise PeerTimeout(f"no prediction {'came' if logic.session is None else 'message came'} for "
                                  f"{opts.peer_deadline_s:g} s; giving up")
    finally:
        server.close()
        if link is not None:
            link.close(linger_ms=0)
        logic.state.close()
