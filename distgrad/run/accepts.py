"""What a serving stage accepts from the stages above it: ``Accepts``.

Each peer's forwards (its activation, coded) and evaluations (its held-out
rows), a SplitFed average's parameters, and from these the largest message
the stage's socket takes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from distgrad.errors import ProtocolError
from distgrad.config.experiment import build_stage_parts
from distgrad.stage.stage import TensorSpecs, forward_specs, held_out_part, target_spec
from distgrad.run.stage_state import StageState
from distgrad.wire.link import is_final
from distgrad.wire.messages import ErrorCode, Message, frame_limit
from distgrad.wire.wirecodec import ACTIVATION, Expected

MAX_EVAL_ROWS = 1 << 16    # held-out rows a middle stage without data passes on in one evaluation,
MAX_EVAL_BYTES = 1 << 27   # and at most this many bytes of them (128 MiB)
# A SplitFed average's parameters at most, when this stage's file does not define the first stage's model
# (a label owner's own stage file): their names and shapes are then the first average's of the run.
MAX_AVERAGE_BYTES = 1 << 27


class Accepts:
    """The tensors a serving stage accepts, per peer (``input_shapes``: what each peer's forwards carry).

    ``data``: the stage's data per peer ([] when its stage file holds none);
    ``middle``: a stage that passes what it gets on to a stage below (a
    middle stage without data cannot tell how many rows are held out: it
    takes up to ``MAX_EVAL_ROWS`` and the stage below, which holds the
    labels, checks the count); ``upstream``: the first stage, whose
    parameters a SplitFed average carries.
    """

    def __init__(self, state: StageState, exp: Any, input_shapes: list[tuple[int, ...]], data: list[Any],
                 middle: bool, upstream: str, seed: int, init: Any) -> None:
        self.state, self.exp, self.input_shapes, self.data = state, exp, input_shapes, data
        self.target = target_spec(exp)
        # A peer's step rows so far (``send_rows``): (step, micro-batch) -> its rows, by peer.
        self.step_rows: list[dict[tuple[int, int], np.ndarray]] = [{} for _ in input_shapes]
        singles = [self._specs(1, index, rows=False) for index in range(len(input_shapes))]   # evaluations'
        limits = [frame_limit(self.forward(1, index).specs) for index in range(len(input_shapes))]
        row_bytes = 4 * int(np.prod(state.stage.input_shape[1:] or (1,)))
        self.rows_max = min(MAX_EVAL_ROWS, max(1, MAX_EVAL_BYTES // row_bytes))
        self.passed_on = not data and middle        # evaluations go below without a row count here
        rows = len(data[0].test_rows) if data else self.rows_max if middle else 0
        self.evaluations = [single.with_rows(rows) if rows else None for single in singles]    # per peer
        limits += [frame_limit(specs.specs) for specs in self.evaluations if specs]
        # What a SplitFed average carries: the first stage's parameters; None when this stage's file does not
        # define that stage (``average_specs``).
        self.params: TensorSpecs | None = {}
        if exp.clients.mode == "splitfed" and exp.has_stage(upstream):
            first_model, _, _ = build_stage_parts(exp, upstream, seed, init)
            self.params = {name: (value.shape, value.dtype) for name, value in first_model.params.items()}
            limits.append(frame_limit(self.params))
        elif exp.clients.mode == "splitfed":
            self.params = None
            limits.append((MAX_AVERAGE_BYTES, MAX_AVERAGE_BYTES))
        # The largest message this stage accepts: a whole batch, the held-out rows, or SplitFed parameters.
        self.max_frame_bytes = max(limit[0] for limit in limits)
        self.max_tensor_bytes = max(limit[1] for limit in limits)

    def average_specs(self, msg: Message, others: list[Message]) -> TensorSpecs:
        """The parameters a SplitFed average ``msg`` must carry: the first stage's, when this stage's file
        defines its model; else those of ``others`` (the run's averages and mean so far: every client's alike),
        or, for the run's first, its own, float32, at least one."""
        if self.params is not None:
            return self.params
        for other in others:
            return {name: (value.shape, np.dtype(np.float32)) for name, value in other.tensors.items()}
        if not msg.tensors:
            raise ProtocolError(ErrorCode.TENSOR, "an average must carry the first stage's parameters; got none")
        return {name: (value.shape, np.dtype(np.float32)) for name, value in msg.tensors.items()}

    def forward(self, mbs: int, index: int) -> Expected:
        """What a forward of peer ``index`` carries with ``mbs`` micro-batches: its activation, coded (and
        its rows with ``send_rows``)."""
        return self._specs(mbs, index, self.exp.send_rows)

    def _specs(self, mbs: int, index: int, rows: bool) -> Expected:
        return forward_specs(self.state.stage, self.target, mbs, self.input_shapes[index],
                             self.exp.codecs[ACTIVATION], rows)

    def receive(self, peer: Any, msg: Message) -> None:
        """Check a forward of ``peer`` against what it carries (``peer.specs``) and decode its coded tensors
        (``Expected.receive``), then, with ``send_rows``, its rows (``check_rows``). Raises ``ProtocolError``;
        nothing changes then."""
        peer.specs.receive(msg, self.exp.allow_nonfinite)
        if self.exp.send_rows:
            self.check_rows(peer.index, msg)

    def check_rows(self, index: int, msg: Message) -> None:
        """With ``send_rows``, on the stage holding the labels: refuse a forward of peer ``index`` whose
        ``rows`` it may not train on (``refuse_rows``); else remember them for the step's later
        micro-batches. A middle stage without data passes the rows on unchecked. Changes nothing when it
        refuses."""
        if not self.data:
            return
        rows = msg.tensors["rows"]
        earlier = {key: value for key, value in self.step_rows[index].items()
                   if key[0] == msg.step and key[1] < msg.mb}
        refuse_rows(self.data[index], msg, list(earlier.values()))
        self.step_rows[index] = {**earlier, (msg.step, msg.mb): rows}

    def evaluation(self, index: int, msg: Message) -> Expected:
        """What an evaluation of peer ``index`` carries (with a validation split, its validation rows, or in the
        final evaluation its test rows: ``held_out_part``); ``ProtocolError`` when this stage evaluates nothing,
        for a final evaluation without a validation split, or when a passed-on evaluation carries too many rows
        or none."""
        if self.passed_on:
            single = self._specs(1, index, rows=False)
            # The rows are the first axis of the coded activation's first part (the values, codes or bits).
            activation = msg.tensors.get(next(iter(single.coded.specs)))
            rows = len(activation) if activation is not None and activation.ndim else 0
            if not 1 <= rows <= self.rows_max:
                raise ProtocolError(ErrorCode.TENSOR, f"an evaluation carries 1 to {self.rows_max} rows, got "
                                                      f"{rows}")
            return single.with_rows(rows)
        specs = self.evaluations[index]
        if specs is None or not self.data or not len(self.data[index].test_rows):
            raise ProtocolError(ErrorCode.TYPE, f"experiment {self.exp.name!r} holds out no rows to evaluate")
        validation = self.data[index].validation_count
        if is_final(msg) and not validation:
            raise ProtocolError(ErrorCode.TYPE, f"a final evaluation (of the test rows) needs a validation split; "
                                                f"experiment {self.exp.name!r} has no validation_fraction")
        part, _ = held_out_part(validation, is_final(msg))
        return specs.with_rows(len(self.data[index].test_rows[part]))


def refuse_rows(data: Any | None, msg: Message, earlier: list[np.ndarray]) -> None:
    """The label owner's check of a training forward's ``rows`` (``send_rows``): raise ``ProtocolError``
    (``tensor``, naming the row and the reason; nothing was applied) for a row ``data`` may not train on
    (``refused_row``: out of range, held out, another data owner's; with ``data`` None, a negative row) or
    one the step already has (in this micro-batch or in ``earlier``, the step's earlier micro-batches')."""
    rows = msg.tensors["rows"]
    where = f"forward of step {msg.step} micro-batch {msg.mb}"
    if rows.ndim != 1 or rows.dtype.kind not in "iu":      # the receiver's layout has checked this already
        raise ProtocolError(ErrorCode.TENSOR, f"{where}: 'rows' must be one integer per row of the micro-batch, "
                                              f"shape (n,), got {rows.dtype}{rows.shape}; nothing was applied")
    if data is not None:
        refused = data.refused_row(rows)
    else:
        refused = (int(rows[np.argmax(rows < 0)]), "out of range (row numbers are >= 0)") if (rows < 0).any() else None
    if refused is not None:
        raise ProtocolError(ErrorCode.TENSOR, f"{where}: row {refused[0]} {refused[1]}; nothing was applied")
    unique, counts = np.unique(np.concatenate([rows, *earlier]), return_counts=True)
    if (counts > 1).any():
        raise ProtocolError(ErrorCode.TENSOR, f"{where}: row {int(unique[np.argmax(counts > 1)])} appears twice "
                                              f"in the step; nothing was applied")
