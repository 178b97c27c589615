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
(``step`` = chunk number n from 1, tensor ``activation`` of
``min(batch, rows - (n - 1) * batch)`` rows, coded as an evaluation's activations are:
``Senders.evaluation_tensors``, with the data owner's ``clip_noise`` drawn from a noise secret fresh
for each prediction), each answered by ``predicted`` (``body.rows``); a ``bye`` with the
chunk and row counts, answered once the file is written. A chunk sent again
(a retry) replaces itself, so a retry never duplicates rows.

Rows with IDs (an ID column in the ``--input`` CSV, or the held-out rows of
``[data]`` with an ``id_column``) send their IDs along: the hello names the
column (``id_column``), each ``predict`` carries its rows' ``ids``, and the
label owner writes them as the first column of its CSV, as text that no
spreadsheet evaluates and no terminal obeys (``text_cell``).

With ``--output-scores`` the label owner also writes each row's scores
(``Loss.scores``: class probabilities for a classifying loss, the raw output
otherwise) beside its prediction: CSV columns ``score_0`` .. ``score_{K-1}`` (``score_NAME``
with the class names of a [data]'s ``class_names``, whose predictions are those names;
with ``labels = "first"`` the data owner holds them, and its hello carries them to the last stage as
``class_names``, passed on by every middle stage) after ``prediction``; for ``.npy`` output a second file beside it,
``NAME.scores.npy`` (float32, one row of K per prediction). Nothing of this
crosses the wire: the scores are computed where the predictions are. A data owner that
fails before it is done (bad input, a damaged ``--load`` file) sends the
stage below an ``error`` with code ``aborted`` (naming its run once its hello was accepted), so the label
owner stops at once instead of waiting out its deadline.

The label owner writes its files whole (``write_atomic``) and never over a file already there unless told
to (``--force``: ``check_output`` at its start, ``_place_new`` when it writes).

Here: both ends' messages, the data owner's side (``send_predictions``) and the serving side
(``PredictionServer``, ``serve_predictions``). The rows a prediction takes are read in ``predict_rows``
(``read_rows``, ``held_out_rows``, ``OwnRows``), and the label owner's files written in ``predict_output``
(``PredictionFile``, ``check_output``, ``text_cell``); their names are importable from here too.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Sequence

import numpy as np
import zmq

from distgrad.model import aggregate

from distgrad.run import handshake

from distgrad.wire import messages as wire
from distgrad.config.defended import budget_text, held_out_budget
from distgrad.privacy.releases import fresh_secret
from distgrad.config.experiment import Experiment
from distgrad.errors import (ConfigError, DistgradError, Interrupted, PeerRejected, PeerTimeout,
                             ProtocolError)
from distgrad.wire.link import DownstreamLink, LinkSettings
from distgrad.run.options import StageOptions, StopFlag
from distgrad.run.protocol import (abort_reason, check_owner, decode_and_handle, hello_peer, is_abort_notice,
                                   not_accepted, pong, tell_why_stopped, unknown_run)
from distgrad.run.predict_output import (FORMULA_STARTS, PredictionFile, _place_new, check_output,  # noqa: F401
                                         scores_path, text_cell)
from distgrad.run.predict_rows import (NewRows, OwnRows, feature_names, held_out_rows, read_rows,  # noqa: F401
                                       saved_preparation)
from distgrad.run.serving import announce
from distgrad.run.stage_state import StageState
from distgrad.threads import one_compute_thread
from distgrad.wire.transport import NOTICE_LINGER_MS, POLL_TICK_S, Server
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.wirecodec import ACTIVATION, PREDICT, Expected, WireTensor

MAX_CHUNKS = 1 << 20        # chunks one prediction may send (a bound on the label owner's memory)
OUTPUT_SUFFIXES = (".csv", ".npy")
ABORTED = ErrorCode.ABORTED    # the error code of a data owner's notice that it stopped (wire.abort_notice)
ID_NAME_MAX = 128           # characters of the ID column's name
IDS_MAX_BYTES = 48 * 1024   # the IDs of one chunk, UTF-8 and msgpack framing: they travel in its header
IDS_MAX_COUNT = 4096        # IDs in one chunk (a header's arrays are at most that long)
CLASS_NAMES_MAX_COUNT = 4096    # class names a prediction's hello carries (labels = "first")
CLASS_NAMES_MAX_BYTES = 32 * 1024   # their UTF-8 and msgpack framing: they travel in the hello's header


class PredictionAborted(DistgradError, RuntimeError):
    """The stage above stopped before its prediction was done and said so: this stage stops (exit 1)."""


@dataclass
class _Session:
    run: str
    chunks: dict[int, np.ndarray]
    last_seen: float
    rows: int                     # the rows its hello announced, in ``ceil(rows / batch)`` chunks of ``batch`` (the last: the rest)
    most_chunks: int
    done: bool = False
    bye: tuple[Any, Message] | None = None   # a feature party's bye, answered once every party's rows are in
    id_name: str | None = None               # the rows' ID column (its hello's ``id_column``), None: no IDs
    ids: dict[int, list[str]] = field(default_factory=dict)   # chunk -> its rows' IDs
    scores: dict[int, np.ndarray] = field(default_factory=dict)   # chunk -> its rows' scores (--output-scores)
    since: float = field(default_factory=time.time)                # when it started (seconds since the epoch)
    owner: str = ""                          # with CURVE: the key that said its hello ("" in plaintext)
    classes: list[str] | None = None         # labels = "first": the data owner's class names (its hello's)


def travelling_class_names(exp: Experiment, stage: str, seed: int, load: Path | None) -> list[str] | None:
    """The class names a data owner's prediction hello carries (``class_names``), or None: with
    ``labels = "first"`` the data owner holds the labels and their names (saved beside its ``load`` file;
    learnt from its [data] without one), while the last stage writes the predictions, so the names travel
    to it. ``ConfigError`` when they are too many or too long for a hello's header."""
    if not exp.labels_travel or stage != exp.label_owner:
        return None
    prep = saved_preparation(exp, stage, load) if load is not None else exp.preparation(seed, stage=stage)
    classes = prep.classes if prep is not None else None
    if classes is None:
        return None
    size = sum(len(name.encode("utf-8")) + 5 for name in classes)
    if len(classes) > CLASS_NAMES_MAX_COUNT or size > CLASS_NAMES_MAX_BYTES:
        raise ConfigError(f"the {len(classes)} class names take {size} bytes; with labels = \"first\" they travel "
                          f"to the last stage in the prediction's hello, at most {CLASS_NAMES_MAX_COUNT} names and "
                          f"{CLASS_NAMES_MAX_BYTES} bytes: shorten the names in the label column")
    return classes


def check_class_names(names: Any, labels_travel: bool, outputs: tuple[int, ...] | None) -> list[str]:
    """A prediction hello's ``class_names``, checked: refused (``ProtocolError``) unless the labels travel
    (``labels = "first"``: else the label owner names its own classes), unless a list of at most
    ``CLASS_NAMES_MAX_COUNT`` distinct non-empty strings, and (``outputs``: the shape of the last stage's
    output row, None for a middle stage) unless that row holds one score per name."""
    if not labels_travel:
        raise ProtocolError(ErrorCode.MISMATCH, "the hello carries class_names, but the labels stay at the last "
                                                "stage (labels = \"last\"), whose own [data] names its classes")
    if (type(names) is not list or not 0 < len(names) <= CLASS_NAMES_MAX_COUNT
            or not all(type(name) is str and name for name in names) or len(set(names)) != len(names)
            or sum(len(name.encode("utf-8")) + 5 for name in names) > CLASS_NAMES_MAX_BYTES):
        raise ProtocolError(ErrorCode.MALFORMED, f"hello has class_names={wire.show(names)}; expected 1 to "
                                                 f"{CLASS_NAMES_MAX_COUNT} distinct non-empty strings of at most "
                                                 f"{CLASS_NAMES_MAX_BYTES} bytes in all")
    if outputs is not None and outputs != (len(names),):
        raise ProtocolError(ErrorCode.MISMATCH, f"the data owner's labels name {len(names)} classes "
                                                f"{wire.show(names[:12])}, and the last stage outputs rows of shape "
                                                f"{outputs}: one score per class is needed to write the class names")
    return names


def _id_chunks(rows: NewRows, chunk_rows: int) -> Sequence[list[str] | None]:
    """Each chunk's IDs (None without IDs); ``ConfigError`` when a chunk's IDs cannot travel in its header."""
    if rows.ids is None:
        return [None] * -(-len(rows.features) // chunk_rows)
    if not 0 < len(rows.id_name) <= ID_NAME_MAX or not rows.id_name.isprintable():
        raise ConfigError(f"the ID column's name must be 1 to {ID_NAME_MAX} printable characters, got "
                          f"{rows.id_name!r}")
    chunks = [rows.ids[i:i + chunk_rows] for i in range(0, len(rows.ids), chunk_rows)]
    for index, chunk in enumerate(chunks, start=1):
        size = sum(len(key.encode("utf-8")) + 5 for key in chunk)
        if size > IDS_MAX_BYTES or len(chunk) > IDS_MAX_COUNT:
            first = (index - 1) * chunk_rows + 1
            raise ConfigError(f"the IDs of rows {first} to {first + len(chunk) - 1} (chunk {index}) take {size} "
                              f"bytes; a chunk's IDs travel in its header, at most {IDS_MAX_COUNT} IDs and "
                              f"{IDS_MAX_BYTES} bytes: shorten the IDs")
    return chunks


def check_predicts(exp: Experiment) -> None:
    """Raise ``ConfigError`` for predictions an experiment cannot make: with ``secure_aggregation``, a party's
    prediction chunks would cross under masks that repeat (every prediction numbers its chunks from 1, as
    an evaluation numbers its step), so the label owner could subtract two of them."""
    if exp.secure_aggregation:
        raise ConfigError("predictions of an experiment with secure_aggregation are not supported: their masks "
                          "would repeat between predictions, showing the label owner the difference of a "
                          "party's embeddings. Score held-out rows with the run's evaluations instead, or predict "
                          "with a copy of the stage files without secure_aggregation if the label owner may see "
                          "each embedding")


def send_abort_notice(opts: StageOptions, connect: str, reason: str, ctx: zmq.Context | None = None,
                      run: str = "") -> None:
    """Tell the stage below ``connect`` that this data owner stopped (``reason``), so that it stops at once
    (``tell_below`` with ``opts``' link, security and stage name). ``run``: its prediction's run id once its
    hello was accepted ("" before: the stage below takes a notice naming no run only while no other data
    owner's prediction is live there)."""
    tell_below(opts.link, opts.security, opts.stage, connect, reason, ctx, run)


def tell_below(link: LinkSettings, security: Any, stage: str, connect: str, reason: str,
               ctx: zmq.Context | None = None, run: str = "") -> None:
    """One ``error`` with code ``aborted`` from ``stage`` (``reason``, ``run``) to the stage below ``connect``,
    best effort: waiting at most ``NOTICE_LINGER_MS`` for it to leave. Also for a data owner whose options
    could not be built (``StageOptions`` refused them), hence the parts rather than the options."""
    below = DownstreamLink(link, connect, lambda: None, ctx or zmq.Context.instance(), security, None)
    try:
        below.send(wire.abort_notice(run, stage, reason))
    finally:
        below.close(linger_ms=NOTICE_LINGER_MS)


@one_compute_thread()
def send_predictions(opts: StageOptions, connect: str, new_rows: NewRows, stop: StopFlag,
                     ctx: zmq.Context | None = None) -> int:
    """The data owner's side: forward ``new_rows`` in chunks through the stages below ``connect``, their
    IDs along; returns the number of rows the label owner acknowledged. Raises ``PeerTimeout``,
    ``PeerRejected``, ``ProtocolError``, ``ConfigError`` (IDs too long to travel); on any error but a refusal
    or a timeout of the stage below (a damaged ``--load``, a signal, ...) it tells that stage first
    (``send_abort_notice``, naming its run once its hello was accepted), so that it stops at once."""
    ctx = ctx or zmq.Context.instance()
    opened: list[str] = []              # the run, once the stage below accepted its hello
    try:
        return _send_rows(opts, connect, new_rows, stop, ctx, opened)
    except (PeerRejected, PeerTimeout):
        raise                           # the stage below refused us (it knows) or cannot be reached
    except DistgradError as e:
        send_abort_notice(opts, connect, str(e), ctx, opened[0] if opened else "")
        raise


def _send_rows(opts: StageOptions, connect: str, new_rows: NewRows, stop: StopFlag, ctx: zmq.Context,
               opened: list[str]) -> int:
    """``send_predictions``' work; the run id is appended to ``opened`` once its hello is accepted."""
    exp = opts.experiment
    exp.check_role(opts.stage, binds=False, connects=True)
    check_predicts(exp)
    rows = new_rows.features
    chunk_rows = exp.batch or 1
    if len(rows) > MAX_CHUNKS * chunk_rows:
        raise ConfigError(f"{len(rows)} rows make more than {MAX_CHUNKS} chunks of {chunk_rows} (the batch), the "
                          f"most one prediction sends: predict them in parts")
    id_chunks = _id_chunks(new_rows, chunk_rows)
    classes = travelling_class_names(exp, opts.stage, opts.seed, opts.load_path)
    state = StageState(opts)
    stage, log = state.stage, state.log
    if state.ledger is not None:            # each prediction is a run of its own: its noise is never a training run's
        state.ledger.new_run(fresh_secret())
    link = DownstreamLink(opts.link, connect, stop.check, ctx, opts.security, None)
    run = uuid.uuid4().hex
    chunks = [rows[i:i + chunk_rows] for i in range(0, len(rows), chunk_rows)]
    try:
        hello = handshake.hello(exp, opts.stage, opts.seed, stage.output_shape, run, [0], 0, 1)
        hello.body.update(purpose="predict", rows=len(rows))
        if new_rows.ids is not None:
            hello.body["id_column"] = new_rows.id_name
        if classes is not None:
            hello.body["class_names"] = classes
        link.handshake(hello)
        opened.append(run)
        acknowledged = 0
        for number, (chunk, ids) in enumerate(zip(chunks, id_chunks), start=1):
            y, _ = stage.forward(chunk if exp.batch else chunk[0], training=False)
            reply = link.exchange(Message(wire.PREDICT, run, number, body={} if ids is None else {"ids": ids},
                                          tensors=state.senders.evaluation_tensors(y, number, PREDICT)))
            acknowledged += _acknowledged(reply, number, len(chunk))
        reply = link.exchange(Message(wire.BYE, run, len(chunks) + 1, body={"chunks": len(chunks),
                                                                               "rows": len(rows)}))
        if reply.type != wire.BYE or reply.body.get("rows") != len(rows):
            raise ProtocolError(ErrorCode.TYPE, f"expected the bye of {len(rows)} rows, got {reply.describe()}")
        log.info("sent %d rows in %d chunks; the label owner wrote their predictions", acknowledged, len(chunks))
        if state.ledger is not None:
            log.info("privacy: %s", budget_text({opts.stage: held_out_budget(state.ledger, PREDICT)}))
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

    def __init__(self, opts: StageOptions, output: Path | None, link: DownstreamLink | None,
                 output_scores: bool = False, own_rows: NewRows | None = None, overwrite: bool = False) -> None:
        """``output_scores``: the label owner writes each row's scores beside its prediction (module doc);
        ``own_rows``: an active label owner's own feature columns of the rows to predict (``OwnRows``);
        ``overwrite``: the output files may replace existing ones (``--force``), else a file found there
        when they are written is left as it is and the prediction fails (``OutputWriteError``)."""
        self.opts, self.exp, self.output, self.link = opts, opts.experiment, output, link
        self.output_scores = output_scores
        self.own = OwnRows(own_rows, self.exp.batch or 1) if own_rows is not None else None
        check_predicts(self.exp)
        self.state = StageState(opts)
        self.stage, self.log = self.state.stage, self.state.log
        # The label owner's class names by id (its [data]'s class_names, saved beside its parameters).
        prep = saved_preparation(self.exp, opts.stage, opts.load_path) if output is not None else None
        self.classes = prep.classes if prep is not None else None
        if self.classes is not None and tuple(self.stage.output_shape[1:]) != (len(self.classes),):
            raise ConfigError(f"stage {opts.stage!r} outputs rows of shape {tuple(self.stage.output_shape[1:])}, "
                              f"and its labels name {len(self.classes)} classes {self.classes[:12]}: one score per "
                              f"class is needed to write the class names")
        self.file = PredictionFile(output, overwrite, self.classes, self.log)    # the label owner's output
        self.parties = self.exp.upstream(opts.stage)        # the stages that send here
        self.upstream = self.parties[0]
        # Vertical: several parties, or one and the label owner's own bottom, whose embeddings combine.
        self.vertical = self.exp.vertical and (len(self.parties) > 1 or self.exp.own_bottom)
        shapes = ({name: self.exp.cuts[self.exp.stage_index(name)] for name in self.parties} if self.vertical
                  else {self.upstream: self.stage.input_shape})
        self.row_shapes = {name: tuple(shape[1:] if self.exp.batch else shape) for name, shape in shapes.items()}
        self.sessions: dict[str, _Session] = {}              # by sending stage
        self.predictions: dict[int, np.ndarray] = {}         # vertical: chunk -> its predictions
        self.scores: dict[int, np.ndarray] = {}              # vertical: chunk -> its scores (--output-scores)
        self.ready: list[tuple[Any, Message]] = []           # deferred replies (held byes) to send now
        self.prediction_ids: dict[int, list[str]] = {}      # vertical: chunk -> its rows' IDs
        self.written = 0
        self.aborted = False                                 # a notice was passed on below (close with linger)
        self.unaligned: str | None = None       # vertical: why the parties' rows differ (``finished`` ends it)

    @property
    def session(self) -> _Session | None:
        """The prediction in progress (a vertical one's first party's)."""
        return self.sessions.get(self.upstream)

    def finished(self) -> bool:
        """Every sender's prediction is complete (written, or passed on). Raises ``ProtocolError`` (``mismatch``,
        ``unaligned``) once vertical parties' rows were found not to be the same rows: it never will be."""
        if self.unaligned is not None:      # the refused sender has its refusal; ending tells every other party
            raise ProtocolError(ErrorCode.MISMATCH, self.unaligned)
        return bool(self.sessions) and len(self.sessions) == len(self.row_shapes) and all(
            session.done for session in self.sessions.values())

    def take_ready(self) -> list[tuple[Any, Message]]:
        ready, self.ready = self.ready, []
        return ready

    def silent(self, now: float, started: float) -> str | None:
        """Why this stage gives up waiting at ``now`` (it began at ``started``), or None. One sender: when it
        has sent nothing for ``peer_deadline_s``. Vertical: when any party whose rows are not all in has sent
        nothing that long (its predictions need every party's rows): that party is named."""
        deadline = self.opts.peer_deadline_s
        if not self.vertical:
            seen = max((s.last_seen for s in self.sessions.values()), default=started)
            if now - seen <= deadline:
                return None
            return f"no prediction {'came' if self.session is None else 'message came'} for {deadline:g} s; giving up"
        for name in self.parties:
            session = self.sessions.get(name)
            if session is not None and (session.done or session.bye is not None):
                continue                    # its rows are all in (a held bye is answered at the end)
            if now - (started if session is None else session.last_seen) > deadline:
                what = "has not joined (no hello accepted)" if session is None else "has sent nothing more"
                return (f"party {name} {what} for {deadline:g} s; giving up (a prediction needs every feature "
                        f"party's rows)")
        return None

    def abandon(self, why: str, now: float) -> tuple[list[tuple[Any, Message]], set[str]]:
        """What to tell the senders when this stage gives up (``why``), rather than leave them to wait out
        their own deadlines: an ``aborted`` error naming why for each feature party whose bye is held, and
        the runs of the predictions still live (heard within ``liveness_s`` and ``peer_deadline_s``), whose
        next request (a bye or chunk sent again) gets that error too (``notice``)."""
        held = [(s.bye[0], self.notice(s.run, s.bye[1].step, why))
                for s in self.sessions.values() if s.bye is not None and s.bye[0] is not None and not s.done]
        recent = min(self.opts.liveness_s, self.opts.peer_deadline_s)      # a sender silent longer is gone
        live = {s.run for s in self.sessions.values() if not s.done and now - s.last_seen <= recent}
        return held, live

    def notice(self, run: str, step: int, why: str) -> Message:
        """The ``aborted`` error that tells the sender of ``run`` this stage gave up its prediction (``why``)."""
        return wire.error_message(run, step, ABORTED, f"stage {self.opts.stage} gave up this prediction: {why}")

    def handle(self, msg: Message, now: float, envelope: Any = None, peer_key: str = "") -> Message | None:
        """The reply to ``msg`` (from ``envelope``, authenticated as ``peer_key``, "" in plaintext), None for
        none yet; raises ``ProtocolError`` to refuse it. A prediction belongs to the key that said its hello."""
        if msg.type == wire.PING:
            return pong(msg, self.opts.stage, self.exp.name, purpose="predict")
        if msg.type == wire.HELLO:
            return self._hello(msg, now, peer_key)
        if is_abort_notice(msg):
            self._check_notice(msg, peer_key, now)
            return self._aborted(msg)
        session = next((s for s in self.sessions.values() if s.run == msg.run), None)
        if session is None:
            raise unknown_run(msg, self._expected_run())
        check_owner(session.owner, peer_key, msg)
        if msg.type == wire.PREDICT:
            reply: Message | None = self._predict(session, msg)
        elif msg.type == wire.BYE:
            reply = self._bye(session, msg, envelope)
        else:
            raise not_accepted(msg, "a prediction stage")
        session.last_seen = now         # heard: what is accepted, as at every end (not what is refused)
        return reply

    def _expected_run(self) -> str:
        runs = [s.run for s in self.sessions.values()]
        return f"run {' or '.join(runs)}" if runs else "a hello first"

    def _check_notice(self, msg: Message, peer_key: str, now: float) -> None:
        """A data owner's notice names one of the predictions here, and once one is open it comes from a key
        that opened one; or it names no run (it stopped before its hello: ``send_abort_notice``). In
        plaintext, where no key says who sent it, one naming no run is accepted only while a sender's place
        here holds no live prediction (none, or one silent for ``liveness_s``): a data owner that never said
        hello cannot stop another's prediction. Else it is refused as any message of another run or key is."""
        if msg.run and all(s.run != msg.run for s in self.sessions.values()):
            raise unknown_run(msg, self._expected_run())
        owners = [s.owner for s in self.sessions.values() if not msg.run or s.run == msg.run]
        if owners and peer_key not in owners:
            check_owner(owners[0], peer_key, msg)
        if not msg.run and not peer_key:
            live = [self.sessions.get(name) for name in self.row_shapes]
            live = [s for s in live if s is not None and not s.done and now - s.last_seen <= self.opts.liveness_s]
            if len(live) == len(self.row_shapes):
                raise ProtocolError(ErrorCode.RUN, f"an aborted notice that names no run, while "
                                                   f"{self._expected_run()} is live here: it stops a prediction "
                                                   f"only from its own data owner, naming its run")

    def _aborted(self, msg: Message) -> NoReturn:
        """A data owner's notice that it stopped: passed on below (a middle stage), then ``PredictionAborted``."""
        text = abort_reason(msg)
        for session in self.sessions.values():
            session.done = session.done or session.run == msg.run      # it stopped: nothing more to tell it
        if self.link is not None:       # the stage below knows the prediction by the same run id
            self.link.send(wire.error_message(msg.run, 0, ABORTED, text))
            self.aborted = True
        raise PredictionAborted(f"the stage above gave up, so no prediction will come: {text}")

    def _hello(self, msg: Message, now: float, peer_key: str = "") -> Message:
        body = msg.body
        # Which party: its role (``protocol.hello_peer``, the rule of every serving end).
        sender = self.parties[hello_peer(body, self.exp.name, parties=self.parties)] if self.vertical else self.upstream
        shape = self.exp.cuts[self.exp.stage_index(sender)] if self.vertical else self.stage.input_shape
        handshake.check_hello(body, sender, self.exp, self.opts.seed, shape, self.opts.stage)
        rows, id_name = self._announced(body)
        session = self.sessions.get(sender)
        if session is not None and session.run == msg.run:
            check_owner(session.owner, peer_key)
        if session is not None and session.run != msg.run and not session.done and \
                now - session.last_seen <= self.opts.liveness_s:
            raise ProtocolError(ErrorCode.RUN, wire.busy_text("prediction", session.run, session.since, "its sender",
                                                         now - session.last_seen, self.opts.liveness_s))
        self._check_parties_agree(sender, rows, id_name)
        names = body.get("class_names")
        classes = None if names is None else check_class_names(
            names, self.exp.labels_travel, tuple(self.stage.output_shape[1:]) if self.link is None else None)
        if session is None or session.run != msg.run:
            if self.link is not None:
                self._pass_hello_on(msg, rows, id_name, classes)
            batch = self.exp.batch or 1
            self.sessions[sender] = _Session(msg.run, {}, now, rows, -(-rows // batch), id_name=id_name,
                                             owner=peer_key, classes=classes)
            self.log.info("prediction %s: %d rows from %s", msg.run, rows, body.get("role"))
        return Message(wire.WELCOME, msg.run, msg.step, body={"stage": self.opts.stage, "next_step": 1})

    def _announced(self, body: dict[str, Any]) -> tuple[int, str | None]:
        """A prediction hello's row count and ID column (None: no IDs), checked: ``ProtocolError`` for a hello
        of another purpose, a row count beyond ``MAX_CHUNKS`` chunks, a bad column name, or IDs that the label
        owner's ``.npy`` output cannot keep."""
        if body.get("purpose") != "predict":
            raise ProtocolError(ErrorCode.MISMATCH, "this stage serves predictions (distgrad predict), not a "
                                                    "training run")
        rows = body.get("rows")
        if type(rows) is not int or not 1 <= rows <= MAX_CHUNKS * (self.exp.batch or 1):
            raise ProtocolError(ErrorCode.MALFORMED, f"hello has rows={wire.show(rows)}; expected 1 to "
                                                     f"{MAX_CHUNKS * (self.exp.batch or 1)} ({MAX_CHUNKS} chunks "
                                                     f"of the batch at most)")
        id_name = body.get("id_column")
        if id_name is not None and (type(id_name) is not str or not 0 < len(id_name) <= ID_NAME_MAX
                                    or not id_name.isprintable()):
            raise ProtocolError(ErrorCode.MALFORMED, f"hello has id_column={wire.show(id_name)}; expected a name of "
                                                     f"1 to {ID_NAME_MAX} printable characters")
        if id_name is not None and self.link is None and self.output is not None and self.output.suffix == ".npy":
            raise ProtocolError(ErrorCode.MISMATCH, f"the rows carry IDs (column {id_name!r}), but the label owner "
                                                    f"writes {self.output.name}, an .npy file, which cannot keep "
                                                    f"them: give it --output FILE.csv")
        return rows, id_name

    def _pass_hello_on(self, msg: Message, rows: int, id_name: str | None, classes: list[str] | None) -> None:
        """A middle stage: say this prediction's hello (run ``msg.run``, its ``rows``, ID column and class
        names) to the stage below; its refusal is this hello's, saying why (``ProtocolError``)."""
        assert self.link is not None
        own = handshake.hello(self.exp, self.opts.stage, self.opts.seed, self.stage.output_shape, msg.run,
                              [0], 0, 1, relayed=msg.body.get("parts"))
        own.body.update(purpose="predict", rows=rows, **({"id_column": id_name} if id_name else {}),
                        **({"class_names": classes} if classes is not None else {}))
        try:
            self.link.handshake(own)
        except PeerRejected as e:   # refused below (its IDs, its class names, ...): refused here, saying why
            raise ProtocolError(e.code, f"the stage below refused this prediction: {e.peer_message}") from e

    def _check_parties_agree(self, sender: str, rows: int, id_name: str | None) -> None:
        """Refuse (``mismatch``) a hello of party ``sender`` whose ``rows`` or ID column differ from another party's,
        or do not fit the label owner's own rows, naming the sender's own only; vertical: ``unaligned`` then ends
        the prediction, so no party tries one guess of another's --input after another (the log has both)."""
        try:
            for other, theirs in self.sessions.items():
                if other != sender and theirs.rows != rows:
                    self.log.warning("party %s announces %d rows, party %s %d", sender, rows, other, theirs.rows)
                    raise ProtocolError(ErrorCode.MISMATCH, f"party {sender} announces {rows} rows, not as many as "
                                                            f"party {other}: every party predicts the same rows "
                                                            f"(its --input files aligned, distgrad align)")
                if other != sender and theirs.id_name != id_name:
                    self.log.warning("party %s sends the IDs of column %s, party %s of column %s", sender,
                                     wire.show(id_name), other, wire.show(theirs.id_name))
                    raise ProtocolError(ErrorCode.MISMATCH, f"party {sender} sends the IDs of column "
                                                            f"{wire.show(id_name)}, party {other} not of that "
                                                            f"column: every party keeps the ID column, or none")
            if self.own is not None:
                self.own.check(rows, id_name)
        except ProtocolError:
            if self.vertical and self.unaligned is None:
                self.unaligned = (f"party {sender}'s hello announces other rows than the other parties' (another "
                                  f"row count or ID column, or rows the label owner's own do not fit): the parties' "
                                  f"--input files are not aligned (the same IDs in the same order: distgrad "
                                  f"align); a prediction needs every party's rows, so it ends here")
            raise

    def _predict(self, session: _Session, msg: Message) -> Message:
        if session.done:
            raise ProtocolError(ErrorCode.STEP, f"prediction {session.run} is complete")
        if not 1 <= msg.step <= session.most_chunks or msg.mb != 0 or msg.mbs != 1:
            raise ProtocolError(ErrorCode.STEP, f"chunk {msg.step} is out of range 1..{session.most_chunks} (the "
                                                f"{session.rows} rows the hello announced)")
        sender = next(name for name, s in self.sessions.items() if s is session)
        batch = self.exp.batch
        batched = batch is not None
        rows = min(batch, session.rows - (msg.step - 1) * batch) if batch is not None else 1
        row_shape = self.row_shapes[sender]
        coded = WireTensor(ACTIVATION, (rows, *row_shape) if batched else row_shape, self.exp.codecs[ACTIVATION])
        try:
            activation = Expected(coded).receive(msg, self.exp.allow_nonfinite)
        except ProtocolError as e:
            raise ProtocolError(e.code, f"chunk {msg.step} of {rows} rows of shape {row_shape}: {e.args[0]}") from e
        ids = self._ids_of(session, msg, rows)
        if self.vertical:
            if msg.step not in self.predictions:          # a chunk sent again after it was combined: done
                session.chunks[msg.step] = np.array(activation, copy=True)
                if ids is not None:
                    session.ids[msg.step] = ids
                try:
                    self._combine(msg.step, sender)
                except ProtocolError as e:                # refused: this chunk is not kept
                    session.chunks.pop(msg.step, None)
                    session.ids.pop(msg.step, None)
                    if e.code == ErrorCode.MISMATCH and self.unaligned is None:
                        self.unaligned = unaligned_text(msg.step, sender)
                    raise
            return Message(wire.PREDICTED, msg.run, msg.step, body={"rows": rows})
        y, _ = self.stage.forward(activation, training=False)
        if self.link is not None:
            body = {} if ids is None else {"ids": ids}
            reply = self.link.exchange(Message(wire.PREDICT, msg.run, msg.step, body=body,
                                               tensors=self.state.senders.evaluation_tensors(y, msg.step, PREDICT)))
            _acknowledged(reply, msg.step, rows)
        else:
            session.chunks[msg.step], scores = self._outputs(y if batched else y[None])
            if scores is not None:
                session.scores[msg.step] = scores
            if ids is not None:
                session.ids[msg.step] = ids
        return Message(wire.PREDICTED, msg.run, msg.step, body={"rows": rows})

    def _outputs(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The label owner's predictions of a chunk's outputs ``y`` and, with ``output_scores``, their scores
        (``(rows, K)`` float32), both copies the stage will not overwrite."""
        assert self.stage.loss is not None            # the last stage: it owns the loss
        predictions = np.array(self.stage.loss.predict(y), copy=True)
        if not self.output_scores:
            return predictions, None
        scores = np.array(self.stage.loss.scores(y), copy=True)
        return predictions, scores.reshape(len(scores), -1)

    @staticmethod
    def _ids_of(session: _Session, msg: Message, rows: int) -> list[str] | None:
        """A chunk's IDs: ``rows`` strings when its hello named an ID column, else none."""
        ids = msg.body.get("ids")
        if session.id_name is None:
            if ids is not None:
                raise ProtocolError(ErrorCode.MALFORMED, f"chunk {msg.step} carries ids, but its hello named no "
                                                         f"id_column")
            return None
        if type(ids) is not list or len(ids) != rows or not all(type(key) is str for key in ids):
            raise ProtocolError(ErrorCode.MALFORMED, f"chunk {msg.step} must carry 'ids', the {rows} IDs of its "
                                                     f"rows (column {session.id_name!r}), as strings")
        return ids

    def _combine(self, number: int, sender: str) -> None:
        """Vertical: chunk ``number``'s predictions, once every party's embedding of it has arrived (the
        last from party ``sender``). A refusal goes to ``sender`` and names only its own rows' IDs: a
        party learns no ID of another party's --input."""
        arrived = [self.sessions[name].chunks.get(number) if name in self.sessions else None for name in self.parties]
        parts = [part for part in arrived if part is not None]
        if len(parts) < len(arrived) or number in self.predictions:
            return
        if len({len(part) for part in parts}) != 1:
            self.log.warning("chunk %d: the parties sent %s rows", number, [len(p) for p in parts])
            raise ProtocolError(ErrorCode.TENSOR, f"chunk {number}: party {sender} sent "
                                                  f"{len(parts[self.parties.index(sender)])} rows, not as many "
                                                  f"as every other party; every party sends the same rows")
        ids = [self.sessions[name].ids.get(number) for name in self.parties]
        mine = ids[self.parties.index(sender)]
        differ = next((i for i, other in enumerate(ids) if other != mine), None)
        if differ is not None:
            theirs = ids[differ]
            if mine is None or theirs is None:    # their hellos named the same ID column, or none
                raise ProtocolError(ErrorCode.MISMATCH, f"chunk {number}: party {self.parties[differ]} and party "
                                                        f"{sender} do not both send their rows' IDs")
            row = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), 0)
            raise ProtocolError(ErrorCode.MISMATCH, f"chunk {number}: party {sender}'s row {row + 1} of the chunk "
                                                    f"(ID {wire.show(mine[row])}) is not party "
                                                    f"{self.parties[differ]}'s row there: the parties' --input "
                                                    f"files are not aligned (hold the same IDs in the same order)")
        own = self.own.chunk(number, ids[0], len(parts[0])) if self.own is not None else None
        y, _ = self.stage.forward(aggregate.join_input(parts, own, self.exp.aggregate_kind), training=False)
        self.predictions[number], scores = self._outputs(y)
        if scores is not None:
            self.scores[number] = scores
        if ids[0] is not None:
            self.prediction_ids[number] = ids[0]
        for name in self.parties:
            del self.sessions[name].chunks[number]
            self.sessions[name].ids.pop(number, None)

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
            self.written = self.file.write_chunks(chunks, session.chunks, session.ids, session.scores,
                                                  session.id_name, session.classes)
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
        byes = [(s, s.bye) for s in map(self.sessions.get, self.parties) if s is not None and s.bye is not None]
        if len(byes) < len(self.parties):
            return None                                # answered when the last party's bye comes
        if any(bye.body.get("chunks") != chunks for _, (_, bye) in byes) or len(self.predictions) != chunks:
            raise ProtocolError(ErrorCode.STEP, f"the parties' byes disagree on the chunks, or chunks are missing "
                                                f"({len(self.predictions)} of {chunks} combined)")
        self.written = self.file.write_chunks(chunks, self.predictions, self.prediction_ids, self.scores,
                                              session.id_name)
        for s, (bye_envelope, bye) in byes:
            s.done = True
            if bye_envelope is not None and s is not session:
                self.ready.append((bye_envelope, Message(wire.BYE, bye.run, bye.step, body={"rows": rows})))
        return reply


def unaligned_text(number: int, sender: str) -> str:
    """Why a vertical prediction ends when party ``sender``'s chunk ``number`` was refused because its rows are
    not the other parties' (or the label owner's own rows lack one of them). It goes to every party, so it
    names no row ID: the refused party's own refusal names its own ID, the label owner's log both sides'."""
    return (f"chunk {number}: party {sender}'s rows are not the rows the other parties sent there (or not among "
            f"the label owner's own rows): the parties' --input files are not aligned (the same IDs in the same "
            f"order: distgrad align); a prediction needs every party's rows of each chunk, so it ends here")


@one_compute_thread()
def _tell_the_senders(server: Server, logic: PredictionServer, why: str, max_frame: int, wait: bool) -> bool:
    """This stage gave up (``why``): answer the held byes with the notice, then (``wait``) for at most
    ``liveness_s`` every request of a live prediction with it, until each has had one in reply to a request
    it sent (a held bye's reply may miss a sender that has just reconnected to send it again). Returns
    whether any notice was sent."""
    now = time.monotonic()
    held, live = logic.abandon(why, now)
    for envelope, notice in held:
        server.reply(envelope, notice)
    told = wait and tell_why_stopped(server, max_frame, live, now + logic.opts.liveness_s,
                                     lambda msg: logic.notice(msg.run, msg.step, why))
    return bool(held) or told


def _check_serving(opts: StageOptions, output: Path | None, last: bool, output_scores: bool, own_rows: bool,
                   overwrite: bool) -> None:
    """Refuse (``ConfigError``) what ``serve_predictions`` is asked for, before anything is served, when this
    stage cannot do it: not its role; an ``output`` or ``output_scores`` on a middle stage (not ``last``); no
    ``.csv`` or ``.npy`` output on the last; one that cannot be written (``check_output``); ``own_rows``
    given, or missing, when the label owner does not have, or has, its own bottom."""
    exp = opts.experiment
    exp.check_role(opts.stage, binds=True, connects=not last)
    if output_scores and not last:
        raise ConfigError("--output-scores is for the label owner (the last stage), which alone computes the "
                          "predictions and their scores")
    if last and (output is None or output.suffix not in OUTPUT_SUFFIXES):
        raise ConfigError(f"the label owner writes the predictions: give --output FILE.csv or FILE.npy"
                          f"{f', not {output}' if output is not None else ''}")
    if not last and output is not None:
        raise ConfigError("--output is for the label owner (the last stage), which alone sees the predictions")
    if output is not None:
        check_output(output, output_scores, overwrite)
    if own_rows != (last and exp.own_bottom):
        raise ConfigError(f"stage {opts.stage!r}: own rows are for a label owner with its own 'bottom', which "
                          f"needs them" if own_rows else
                          f"stage {opts.stage!r} has its own 'bottom': give it its own columns of the rows")


def serve_predictions(opts: StageOptions, bind: str, output: Path | None, stop: StopFlag,
                      connect: str | None = None, ready_file: Path | None = None,
                      ctx: zmq.Context | None = None, output_scores: bool = False,
                      own_rows: NewRows | None = None, overwrite: bool = False) -> int:
    """The label owner's (or a middle stage's) side: serve one prediction on ``bind`` and return its row count
    once written (passed on); ``output_scores``: the label owner writes the rows' scores too. Raises
    ``PeerTimeout`` when no sender comes, or it falls silent, for ``opts.peer_deadline_s``; ``ProtocolError``
    at once when vertical parties' rows differ (``finished``); ``Interrupted`` on a signal; ``ConfigError`` for
    ``output_scores`` on a middle stage, or for an ``output`` (or its scores file) already there unless
    ``overwrite`` (``check_output``). ``own_rows``: a label owner with its own ``bottom`` takes its own
    columns of the predicted rows from them (``OwnRows``; required then)."""
    exp = opts.experiment
    last = connect is None
    _check_serving(opts, output, last, output_scores, own_rows is not None, overwrite)
    ctx = ctx or zmq.Context.instance()
    link = DownstreamLink(opts.link, connect, stop.check, ctx, opts.downstream_security, None) if connect else None
    logic = PredictionServer(opts, output, link, output_scores, own_rows, overwrite)
    max_frame = 4 * max(int(np.prod((exp.batch or 1, *shape))) for shape in logic.row_shapes.values()) \
        + wire.HEADER_MAX_BYTES
    server = Server(ctx, bind, max_frame, opts.liveness_s, opts.security, opts.spin_s)
    started = time.monotonic()
    linger: int | None = None           # a notice to the feature parties waiting for their bye: time to leave
    try:
        announce(server, opts, ready_file, None)
        while True:
            stop.check()
            request = server.receive(POLL_TICK_S)
            now = time.monotonic()
            if request is not None:
                envelope, frames, peer_key = request
                msg, answer, _ = decode_and_handle(frames, max_frame,
                                                   lambda m: logic.handle(m, now, envelope, peer_key), logic.log)
                if answer is not None:
                    server.reply(envelope, answer)
                for held, reply in logic.take_ready():
                    server.reply(held, reply)
                if logic.finished():
                    return logic.written if last else int(msg.body.get("rows", 0)) if msg else 0
            why = logic.silent(now, started)
            if why is not None:
                raise PeerTimeout(why)
    except DistgradError as e:
        if _tell_the_senders(server, logic, str(e), max_frame, wait=not isinstance(e, Interrupted)):
            linger = NOTICE_LINGER_MS
        raise
    finally:
        server.close(*(() if linger is None else (linger,)))
        if link is not None:
            link.close(linger_ms=NOTICE_LINGER_MS if logic.aborted else 0)
        logic.state.close()
