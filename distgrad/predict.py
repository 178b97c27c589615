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

from . import handshake, wire
from .errors import ConfigError, PeerTimeout, ProtocolError
from .link import DownstreamLink
from .options import StageOptions, StopFlag
from .records import write_atomic
from .serving import announce, decode_and_handle
from .stage_state import StageState
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


def send_predictions(opts: StageOptions, connect: str, rows: np.ndarray, stop: StopFlag,
                     ctx: zmq.Context | None = None) -> int:
    """The data owner's side: forward ``rows`` in chunks through the stages below ``connect``; returns the
    number of rows the label owner acknowledged. Raises ``PeerTimeout``, ``PeerRejected``, ``ProtocolError``."""
    exp = opts.experiment
    exp.check_role(opts.stage, binds=False, connects=True)
    _check_not_vertical(exp)
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


def _check_not_vertical(exp: Any) -> None:
    """``distgrad predict`` sends one data owner's rows; a vertical experiment's label owner would need every
    feature party's embedding of the same rows."""
    if exp.vertical:
        raise ConfigError(f"'distgrad predict' does not serve vertical experiments ({exp.name!r} combines "
                          f"{len(exp.data_owners)} feature parties' embeddings) yet; score held-out rows with "
                          f"eval_every / --eval-every during training instead")


def _acknowledged(reply: Message, number: int, rows: int) -> int:
    if reply.type != wire.PREDICTED or reply.step != number or reply.body.get("rows") != rows or reply.tensors:
        raise ProtocolError(ErrorCode.TYPE, f"expected the acknowledgement of chunk {number} ({rows} rows), got "
                                            f"{reply.describe()} {wire.show(reply.body)}")
    return rows


class PredictionServer:
    """A serving stage of ``distgrad predict``: the label owner (writes ``output``) or a middle stage
    (passes its activations on through ``link``). ``handle`` answers one message or raises
    ``ProtocolError``; a refused message changes nothing."""

    def __init__(self, opts: StageOptions, output: Path | None, link: DownstreamLink | None) -> None:
        self.opts, self.exp, self.output, self.link = opts, opts.experiment, output, link
        self.state = StageState(opts)
        self.stage, self.log = self.state.stage, self.state.log
        index = self.exp.stage_index(opts.stage)
        self.upstream = self.exp.stage_names[index - 1]
        self.row_shape = tuple(self.stage.input_shape[1:] if self.exp.batch else self.stage.input_shape)
        self.session: _Session | None = None
        self.written = 0

    def handle(self, msg: Message, now: float) -> Message:
        if msg.type == wire.PING:
            return Message(wire.PONG, msg.run, msg.step, body={"stage": self.opts.stage, "purpose": "predict",
                                                               "experiment": self.exp.name})
        if msg.type == wire.HELLO:
            return self._hello(msg, now)
        session = self.session
        if session is None or msg.run != session.run:
            raise ProtocolError(ErrorCode.RUN, f"{msg.type} for run {msg.run!r}: say hello first")
        session.last_seen = now
        if msg.type == wire.PREDICT:
            return self._predict(session, msg)
        if msg.type == wire.BYE:
            return self._bye(session, msg)
        raise ProtocolError(ErrorCode.TYPE, f"a prediction stage does not accept {msg.type!r} messages")

    def _hello(self, msg: Message, now: float) -> Message:
        body = msg.body
        handshake.check_hello(body, self.upstream, self.exp, self.opts.seed, self.stage.input_shape, self.opts.stage)
        if body.get("purpose") != "predict":
            raise ProtocolError(ErrorCode.MISMATCH, "this stage serves predictions (distgrad predict), not a "
                                                    "training run")
        rows = body.get("rows")
        if type(rows) is not int or not 1 <= rows <= MAX_CHUNKS * (self.exp.batch or 1):
            raise ProtocolError(ErrorCode.MALFORMED, f"hello has rows={wire.show(rows)}")
        if self.session is not None and self.session.run != msg.run and not self.session.done and \
                now - self.session.last_seen <= self.opts.liveness_s:
            raise ProtocolError(ErrorCode.RUN, f"busy with prediction {self.session.run} (its sender is live)")
        if self.session is None or self.session.run != msg.run:
            batch = self.exp.batch or 1
            self.session = _Session(msg.run, {}, now, rows, -(-rows // batch))
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
        activation = msg.tensors.get("activation")
        batched = self.exp.batch is not None
        rows = len(activation) if activation is not None and batched and activation.ndim else 1
        expected = (rows, *self.row_shape) if batched else self.row_shape
        if (set(msg.tensors) != {"activation"} or activation.dtype != np.float32 or tuple(activation.shape) != expected
                or not 1 <= rows <= (self.exp.batch or 1)):
            raise ProtocolError(ErrorCode.TENSOR, f"chunk {msg.step} must carry one float32 'activation' of 1 to "
                                                  f"{self.exp.batch or 1} rows of shape {self.row_shape}")
        if not self.exp.allow_nonfinite and not np.isfinite(activation).all():
            raise ProtocolError(ErrorCode.NONFINITE, f"chunk {msg.step} holds NaN or Inf")
        y, _ = self.stage.forward(activation, training=False)
        if self.link is not None:
            reply = self.link.exchange(Message(wire.PREDICT, msg.run, msg.step, tensors={"activation": y}))
            _acknowledged(reply, msg.step, rows)
        else:
            assert self.stage.loss is not None            # the last stage: it owns the loss
            predictions = self.stage.loss.predict(y if batched else y[None])
            session.chunks[msg.step] = np.array(predictions, copy=True)
        return Message(wire.PREDICTED, msg.run, msg.step, body={"rows": rows})

    def _bye(self, session: _Session, msg: Message) -> Message:
        chunks, rows = msg.body.get("chunks"), msg.body.get("rows")
        if type(chunks) is not int or type(rows) is not int or not 1 <= chunks <= session.most_chunks \
                or rows != session.rows:
            raise ProtocolError(ErrorCode.MALFORMED, f"bye has chunks={wire.show(chunks)}, rows={wire.show(rows)}; "
                                                     f"the hello announced {session.rows} rows in at most "
                                                     f"{session.most_chunks} chunks")
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


def serve_predictions(opts: StageOptions, bind: str, output: Path | None, stop: StopFlag,
                      connect: str | None = None, ready_file: Path | None = None,
                      ctx: zmq.Context | None = None) -> int:
    """The label owner's (or a middle stage's) side: serve one prediction on ``bind`` and return its row count
    once written (passed on). Raises ``PeerTimeout`` when no sender comes, or it falls silent, for
    ``opts.peer_deadline_s``; ``Interrupted`` on a signal."""
    exp = opts.experiment
    exp.check_role(opts.stage, binds=True, connects=connect is not None)
    _check_not_vertical(exp)
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
    max_frame = 4 * int(np.prod(logic.stage.input_shape)) + wire.HEADER_MAX_BYTES
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
                msg, answer, _ = decode_and_handle(frames, max_frame, lambda m: logic.handle(m, now), logic.log)
                server.reply(envelope, answer)
                if logic.session is not None and logic.session.done:
                    return logic.written if last else int(msg.body.get("rows", 0)) if msg else 0
            seen = logic.session.last_seen if logic.session is not None else started
            if now - seen > opts.peer_deadline_s:
                raise PeerTimeout(f"no prediction {'came' if logic.session is None else 'message came'} for "
                                  f"{opts.peer_deadline_s:g} s; giving up")
    finally:
        server.close()
        if link is not None:
            link.close(linger_ms=0)
        logic.state.close()
