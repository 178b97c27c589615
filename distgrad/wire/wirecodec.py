"""Where the wire codecs (``distgrad.wire.codecs``) meet the messages: the one place every runner encodes and decodes.

Each experiment names a codec per direction: ``activation_codec`` for the
activations going down, ``gradient_codec`` for the activation gradients coming
back up (``Experiment.codecs``). This module turns a codec into what the
runners need:

* ``WireTensor``: one logical float32 tensor of a message (its name, its
  shape, its codec), with the message tensors that carry it (``specs``, for
  ``wire.expect_tensors``), how to put encoded parts in a message (``pack``)
  and how to take them out again, validated, as the float32 tensor the
  receiver computes with (``unpack``). A tensor coded with ``none`` is the
  tensor itself under its own name, exactly as before codecs existed; any
  other codec sends its parts as ``NAME.PART`` (``activation.q``,
  ``activation.scale``).
* ``Senders``: the one pipeline of what leaves a stage, in every runner (the
  in-process reference, the driver, the serving and middle stages, vertical
  parties, predictions): the stage's output, then what is done to what is sent
  (the stage's defenses, ``distgrad.privacy.defenses``: on its training rows, and a
  data owner's on its evaluation and prediction rows too; then the codec), then the message tensors; and the
  training loss a backward reply carries, which a label owner whose guarantee is end to end withholds
  (``reply_body``). It holds the
  error-feedback residuals of ``topk:K+ef``. A residual belongs to a tensor
  *stream* (one direction, one peer, one micro-batch index); a step's new
  residuals are pending until the step is applied (``commit``, called by the
  step engine) and forgotten when the step is dropped (``discard``), so a
  micro-batch sent again after a rollback is encoded from the same residual.
  A *tap* (``Senders.taps``, a list per direction) reads what the receiver gets of each tensor sent
  in a direction (the privacy meter, the trace's ``sent_*``): it sees, and changes, nothing else.

The sender computes with its own unrounded values; only what crosses is
coded. The in-process reference calls ``Senders.roundtrip`` at exactly the
points where a tensor would cross, which makes it bitwise equal to a run over
the wire. Evaluations and predictions (held-out or new rows) cross with the
activation codec too (``evaluation_tensors``, ``evaluation_roundtrip``), but
without error feedback: they change no state. Outside ``distgrad/wire`` nothing
calls a codec directly (``tests/test_layers.py`` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Mapping

import numpy as np

from distgrad.wire.codecs import Codec, ErrorFeedback, NoneCodec, Parts
from distgrad.privacy.defenses import SentRows
from distgrad.errors import ConfigError, ProtocolError
from distgrad.wire.messages import LOSS_WITHHELD_KEY, ErrorCode, FrameLayout, Message, all_finite, expect_tensors

_F32 = np.dtype("<f4")

ACTIVATION, GRADIENT = "activation", "activation_grad"     # the two coded tensors, by direction
DIRECTIONS = (ACTIVATION, GRADIENT)
EVALUATION, PREDICT = "evaluation", "predict"      # why held-out or new rows' activations are sent
TEST = "test"        # and, with a validation split, the test rows' in the final evaluation (once, the kept model)
WIRE_TENSORS_KEPT = 16      # (direction, shape) pairs a Senders keeps its WireTensor of (a step's, an evaluation's)
STATE_PREFIX = "codec/"     # checkpoint array names of error-feedback residuals: codec/DIRECTION/STREAM

Shape = tuple[int, ...]
TensorSpecs = dict[str, tuple[Shape, np.dtype]]


@dataclass(frozen=True)
class WireTensor:
    """One float32 tensor named ``name`` of ``shape`` as it crosses with ``codec``."""

    name: str
    shape: Shape
    codec: Codec

    def part_name(self, part: str) -> str:
        """The message tensor carrying ``part``: the tensor's own name for ``none``, else ``NAME.PART``."""
        return self.name if self.codec.name == "none" else f"{self.name}.{part}"

    @property
    def specs(self) -> TensorSpecs:
        """``{message tensor: (shape, dtype)}`` in frame order (for ``wire.expect_tensors``)."""
        return {self.part_name(part): spec for part, spec in self.codec.wire_specs(self.shape).items()}

    @cached_property
    def _part_names(self) -> dict[str, str]:
        """``part_name`` of every part the codec sends, computed once."""
        return {part: self.part_name(part) for part in self.codec.wire_specs(self.shape)}

    def pack(self, parts: Parts) -> dict[str, np.ndarray]:
        """The message tensors of encoded ``parts`` (``Codec.encode`` or ``Senders.encode``)."""
        names = self._part_names
        return {names[part]: array for part, array in parts.items()}

    def unpack(self, msg: Message, allow_nonfinite: bool) -> np.ndarray:
        """The decoded float32 tensor, put in ``msg.tensors`` under ``name`` in place of its parts (first;
        the codec's ``kept_parts`` stay, after it, under their part names).

        ``msg`` must already have passed ``wire.expect_tensors`` against
        ``specs``. Raises ``ProtocolError``: ``tensor`` for parts no encoder
        produces (indices out of range, a code of -128, ...), ``nonfinite``
        for a decoded NaN or Inf (a bfloat16 bit pattern) unless allowed.
        Changes ``msg`` only when it returns.
        """
        if self.codec.name == "none":
            return msg.tensors[self.name]
        names = self._part_names
        value = self.codec.decode({part: msg.tensors[name] for part, name in names.items()}, self.shape)
        if not allow_nonfinite and not all_finite(value):
            raise ProtocolError(ErrorCode.NONFINITE, f"tensor {self.name!r} ({self.codec.name}) holds NaN or Inf, "
                                                     f"which this experiment forbids")
        kept = {names[part]: msg.tensors[names[part]] for part in self.codec.kept_parts}
        rest = {k: v for k, v in msg.tensors.items() if k not in names.values()}
        msg.tensors = {self.name: value, **kept, **rest}
        return value


@dataclass(frozen=True)
class Expected:
    """What one message must carry: a coded tensor (``coded``) and plain ones (``others``, e.g. the
    targets that travel with the activations), in frame order."""

    coded: WireTensor
    others: TensorSpecs = field(default_factory=dict)

    @property
    def specs(self) -> TensorSpecs:
        """Every message tensor with its shape and dtype (for ``wire.expect_tensors`` and frame limits)."""
        return {**self.coded.specs, **self.others}

    @cached_property
    def layout(self) -> FrameLayout:
        """``specs`` with each frame's byte length, built once: what a binary-header message is read against."""
        return FrameLayout(self.specs)

    def receive(self, msg: Message, allow_nonfinite: bool) -> np.ndarray:
        """Check ``msg``'s tensors (``wire.expect_tensors``; a binary-header message's frames are read against
        ``layout``), then decode the coded one in place (``WireTensor.unpack``) and return it. Raises
        ``ProtocolError``; ``msg`` is unchanged then."""
        if msg.frames is not None:          # a binary header's frames: ``expect_tensors`` without its dispatch
            msg.tensors, msg.frames = self.layout.read(msg, allow_nonfinite), None
        else:
            expect_tensors(msg, self.layout, allow_nonfinite)
        coded = self.coded
        return msg.tensors[coded.name] if coded.codec.name == "none" else coded.unpack(msg, allow_nonfinite)

    def with_rows(self, rows: int) -> "Expected":
        """The same tensors with ``rows`` rows (the held-out rows of an evaluation). Raises ``ProtocolError``
        (``tensor``) when the codec cannot carry that shape (``topk:K`` of an unbatched tensor shorter
        than ``K``)."""
        coded = WireTensor(self.coded.name, (rows, *self.coded.shape[1:]), self.coded.codec)
        try:
            coded.codec.check_shape(coded.shape)
        except ConfigError as e:
            raise ProtocolError(ErrorCode.TENSOR, f"an evaluation of {rows} rows: {e}") from e
        return Expected(coded, {name: ((rows, *shape[1:]), dtype) for name, (shape, dtype) in self.others.items()})


def stream_name(direction: str, micro_batch: int, micro_batches: int, peer: str = "") -> str:
    """The error-feedback stream of one tensor a stage sends every step: its direction, the peer it goes to
    (a client or feature party of a stage serving several; "" otherwise) and its micro-batch of how many."""
    return f"{direction}/{peer + '/' if peer else ''}mb{micro_batch}of{micro_batches}"


def stream_peer(stream: str) -> str:
    """The peer part of a ``stream_name`` (``activation_grad/a/mb0of1`` -> ``a``; "" for one peer)."""
    return "/".join(stream.split("/")[1:-1])


def stream_micro_batch(stream: str) -> tuple[int, int]:
    """The micro-batch and the micro-batch count of a ``stream_name``."""
    mb, mbs = stream.rsplit("/", 1)[-1].removeprefix("mb").split("of")
    return int(mb), int(mbs)


# A tap is called with a function returning the tensor as the receiver decodes it (computed only when the tap
# asks: a tap may skip most sends), the tensor's stream and its step.
Tap = Callable[[Callable[[], np.ndarray], str, int], None]


def _once(compute: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    """``compute`` called at most once, however many taps ask."""
    value: list[np.ndarray] = []

    def get() -> np.ndarray:
        if not value:
            value.append(compute())
        return value[0]
    return get


def _coded_as(purpose: str) -> str:
    """The tensor name held-out activations sent for ``purpose`` are coded under: the final evaluation's test
    rows under one of their own, since they share the step of the last evaluation, so that no codec keyed by
    the tensor's name and step (a mask, a stochastic rounding) draws for them what it drew for that one."""
    return f"{TEST}/{ACTIVATION}" if purpose == TEST else ACTIVATION


class Senders:
    """What one stage encodes its outgoing activations and activation gradients with.

    ``codecs`` maps each direction (``ACTIVATION``, ``GRADIENT``) to its
    codec (a missing one: ``none``). Only ``topk:K+ef`` keeps state: a float32 residual per stream
    (``stream_name``), zeros at first. ``encode`` and ``roundtrip`` use the
    committed residual of the stream and keep its new value pending until
    ``commit`` (the step was applied) or ``discard`` (the step was dropped).
    The committed residuals are stage state: ``state_arrays`` /
    ``load_state_arrays`` for checkpoints, ``reset`` for a fresh start.

    ``defense``: what the stage does to the training rows it sends before they are coded (its ``clip_noise``,
    ``max_norm`` or ``marvell``; None: nothing), a pure function of the run's noise secret, the stream, the
    step, the values and (Marvell) the labels of the stream's micro-batch; its ledger records each release
    (and refuses a step computed again on other values, or past the budget: nothing is sent then).
    A data owner's defense acts on its evaluations and predictions too (``evaluation_tensors``), with
    noise of its own stream, counted apart in the ledger.
    """

    def __init__(self, codecs: Mapping[str, Codec], defense: SentRows | None = None) -> None:
        unknown = set(codecs) - set(DIRECTIONS)
        if unknown:
            raise ValueError(f"unknown codec directions {sorted(unknown)}; use {list(DIRECTIONS)}")
        self.codecs = {direction: codecs.get(direction, NoneCodec()) for direction in DIRECTIONS}
        # The directions sent as the float32 tensor itself (``none``): ``message_tensors`` takes a short way.
        self._plain = frozenset(d for d, codec in self.codecs.items() if type(codec) is NoneCodec)
        self.defense = defense
        self._committed: dict[str, np.ndarray] = {}
        self._pending: dict[str, np.ndarray] = {}
        # direction -> what reads each tensor sent, as the receiver decodes it, in order
        self.taps: dict[str, list[Tap]] = {direction: [] for direction in DIRECTIONS}
        self._wire_tensors: dict[tuple[str, Shape], WireTensor] = {}     # built once per direction and shape

    def codec(self, direction: str) -> Codec:
        return self.codecs[direction]

    def use(self, direction: str, codec: Codec) -> None:
        """Send ``direction`` with ``codec`` from now on: the same kind of codec, differently keyed (secure
        aggregation's masks bound to a run, ``SecureSumCodec.for_run``). Raises ``ValueError`` for another."""
        if codec.name != self.codecs[direction].name or codec.error_feedback != self.codecs[direction].error_feedback:
            raise ValueError(f"{direction} is sent with {self.codecs[direction].name}, not {codec.name}")
        self.codecs[direction] = codec

    @property
    def stateful(self) -> bool:
        """Whether any direction keeps error-feedback residuals."""
        return any(codec.error_feedback for codec in self.codecs.values())

    def encode(self, direction: str, x: np.ndarray, stream: str, step: int) -> Parts:
        """The parts of float32 ``x`` sent on ``stream`` at ``step``. Raises ``CodecRangeError`` (nothing
        changes then) for a value the codec cannot carry."""
        return self._send(direction, x, stream, step, "encode")

    def roundtrip(self, direction: str, x: np.ndarray, stream: str, step: int,
                  rows: np.ndarray | None = None) -> np.ndarray:
        """What the receiver computes with for ``x`` sent on ``stream`` (the in-process twin of ``encode``,
        with the same residuals); ``rows`` as ``message_tensors``."""
        return self._send(direction, x, stream, step, "roundtrip", rows)

    def _send(self, direction: str, x: np.ndarray, stream: str, step: int, how: str,
              rows: np.ndarray | None = None) -> Any:
        """``encode`` or ``roundtrip`` (``how``) of the direction's codec, through the stream's error feedback
        when it keeps one (its new residual pending until the step's update), of ``x`` as the stage's
        defense leaves it."""
        if self.defense is not None:
            x = self.defense.apply(direction, x, stream, step, stream_micro_batch(stream)[0], rows)
        codec = self.codecs[direction]
        if not codec.error_feedback:
            sent = getattr(codec, how)(x, stream, step)
        else:
            feedback = self._feedback(codec, stream)
            sent = getattr(feedback, how)(x, stream, step)
            self._pending[stream] = feedback.state_arrays()[stream]
        taps = self.taps[direction]
        if taps:
            received = (lambda: sent) if how == "roundtrip" else _once(lambda: codec.decode(sent, x.shape))
            for tap in taps:
                tap(received, stream, step)
        return sent

    def message_tensors(self, direction: str, x: np.ndarray, stream: str, step: int,
                        rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """``encode`` as the message tensors that carry ``x`` (named for the direction, ``WireTensor``);
        ``rows``: the row numbers ``x`` holds when the peer chose them (``send_rows``; None: the stage's own
        order), for the defense's per-row count."""
        if (direction in self._plain and self.defense is None and not self.taps[direction] and type(x) is np.ndarray
                and x.dtype == _F32 and x.ndim and x.flags.c_contiguous):
            return {direction: x}       # what ``none`` encodes and names so, with nothing to defend or tap
        key = (direction, x.shape)
        wire_tensor = self._wire_tensors.get(key)
        if wire_tensor is None:
            if len(self._wire_tensors) >= WIRE_TENSORS_KEPT:
                self._wire_tensors.clear()
            wire_tensor = self._wire_tensors[key] = WireTensor(direction, x.shape, self.codecs[direction])
        return wire_tensor.pack(self._send(direction, x, stream, step, "encode", rows))

    def evaluation_tensors(self, x: np.ndarray, step: int, purpose: str = EVALUATION) -> dict[str, np.ndarray]:
        """The message tensors of held-out activations ``x`` (``purpose`` ``EVALUATION``, after step
        ``step - 1``; ``TEST``, the final evaluation's test rows) or of new rows' (``PREDICT``, chunk ``step``):
        a data owner's defense
        (``SentRows.held_out``: its ``clip_noise``, counted in its ledger), then the activation codec without
        error feedback (an evaluation changes no state)."""
        x = self._held_out(x, step, purpose)
        codec = self.codecs[ACTIVATION]
        return WireTensor(ACTIVATION, x.shape, codec).pack(codec.encode(x, _coded_as(purpose), step))

    def evaluation_roundtrip(self, x: np.ndarray, step: int, purpose: str = EVALUATION) -> np.ndarray:
        """What the receiver computes with for held-out activations ``x`` (twin of ``evaluation_tensors``)."""
        return self.codecs[ACTIVATION].roundtrip(self._held_out(x, step, purpose), _coded_as(purpose), step)

    def _held_out(self, x: np.ndarray, step: int, purpose: str) -> np.ndarray:
        if purpose not in (EVALUATION, TEST, PREDICT):
            raise ValueError(f"held-out rows are sent for {EVALUATION!r}, {TEST!r} or {PREDICT!r}, not {purpose!r}")
        return x if self.defense is None else self.defense.held_out(x, purpose, step)

    @property
    def withholds_loss(self) -> bool:
        """Whether this stage's backward replies leave out the training loss: it is the label owner sending
        gradients with a guarantee that covers everything it sends (``Defenses.withholds_loss``)."""
        defense = self.defense
        return defense is not None and defense.direction == GRADIENT and defense.defenses.withholds_loss

    def reply_body(self, loss: float | np.floating | None) -> dict[str, Any]:
        """A backward reply's body for a micro-batch of training ``loss``: ``{"loss": loss}`` as a float, or
        ``{"loss_withheld": True}`` when the loss does not leave this stage: it withholds it
        (``withholds_loss``) or has none to pass up (the stage below withheld it). ``wire.encode`` sends the
        latter with a self-describing header (the binary one always has a loss); ``LOSS_WITHHELD_KEY``."""
        if loss is None or self.withholds_loss:
            return {LOSS_WITHHELD_KEY: True}
        return {"loss": float(loss)}

    def sent_loss(self, loss: float | np.floating | None) -> float | None:
        """The training loss as it leaves this stage (``reply_body``'s), None when it does not: what the
        in-process reference asks of the label owner's loss."""
        return self.reply_body(loss).get("loss")

    def _feedback(self, codec: Codec, stream: str) -> ErrorFeedback:
        """An ``ErrorFeedback`` holding ``stream``'s committed residual (none yet: zeros)."""
        feedback = ErrorFeedback(codec)
        residual = self._committed.get(stream)
        if residual is not None:
            feedback.load_state_arrays({stream: residual})
        return feedback

    def commit(self) -> None:
        """The step whose tensors were sent is applied: their new residuals become the stage's."""
        if self._pending:
            self._committed.update(self._pending)
            self._pending = {}

    def discard(self) -> None:
        """The step in progress is dropped: forget the residuals it computed."""
        self._pending = {}

    def reset(self) -> None:
        """Zero every residual (a new run, or a rollback to step 0)."""
        self._committed, self._pending = {}, {}

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The committed residuals, named ``codec/STREAM`` (sorted), for a checkpoint."""
        return {STATE_PREFIX + name: self._committed[name].copy() for name in sorted(self._committed)}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Take the residuals among checkpoint ``arrays`` (names starting ``codec/``; others are ignored);
        every other residual is zero. Raises ``ValueError`` for one that is not float32."""
        loaded = {}
        for name, array in arrays.items():
            if name.startswith(STATE_PREFIX):
                if not isinstance(array, np.ndarray) or array.dtype != np.float32:
                    raise ValueError(f"checkpoint residual {name!r} must be a float32 array")
                loaded[name[len(STATE_PREFIX):]] = np.array(array, np.float32)
        self._committed, self._pending = loaded, {}


def without_codec_state(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checkpoint ``arrays`` without the residuals (what ``Stage.load_state_arrays`` takes)."""
    return {name: value for name, value in arrays.items() if not name.startswith(STATE_PREFIX)}
