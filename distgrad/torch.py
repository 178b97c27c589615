"""The cut as a library for PyTorch loops: ``Cut``, ``CutServer`` and ``batch_sampler``.

A thin layer over ``distgrad.cut`` (numpy): tensors cross as float32 numpy
arrays (a CPU tensor without a copy), and the gradient that comes back is
back-propagated with ``h.backward``. docs/cut.md is the contract, with a
plain ``torch.utils.data`` example on both sides.

    cut = distgrad.torch.Cut.connect(ENDPOINT, interface="f.toml")
    for x, rows in loader:
        h = encoder(x)
        loss = cut.step(h, rows)        # sends h, waits for dL/dh, calls h.backward(dL/dh)
        opt.step(); opt.zero_grad()

    with distgrad.torch.CutServer.bind(ENDPOINT, interface="g.toml") as server:
        for batch in server:            # batch.h: a leaf tensor that requires grad; batch.rows
            loss = criterion(head(batch.h), labels[batch.rows])
            opt.zero_grad(); loss.backward(); opt.step()
            batch.reply(loss)           # sends batch.h.grad up
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from distgrad import cut as numpy_cut
from distgrad.config.experiment import Experiment
from distgrad.errors import ConfigError, CutMisuse


def _to_numpy(state: Mapping[str, Any]) -> dict[str, Any]:
    """A torch-layer state dict (tensors) as the numpy layer's (arrays)."""
    def convert(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().cpu().numpy()
        if isinstance(value, Mapping):
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, list):
            return [convert(v) for v in value]
        return value
    return convert(state)


def _to_torch(state: Mapping[str, Any]) -> dict[str, Any]:
    """The numpy layer's state dict with tensors for arrays, so ``torch.load(weights_only=True)`` reads it."""
    def convert(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            return torch.from_numpy(np.array(value))
        if isinstance(value, Mapping):
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, list):
            return [convert(v) for v in value]
        return value
    return convert(state)


def _rows_array(rows: Any) -> np.ndarray | None:
    if rows is None:
        return None
    return rows.detach().cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)


def _float32_hint(h: Any) -> str:
    """What to do about an ``h`` that is not a float32 tensor."""
    if isinstance(h, torch.Tensor):
        return ": send h.float() (the gradient flows back through it), or build the encoder in float32"
    return ": pass the encoder's output tensor (distgrad.cut takes numpy arrays)"


def _check_h(h: Any) -> None:
    """``CutMisuse`` unless ``h`` is a float32 tensor that requires grad (part of the encoder's graph)."""
    if not isinstance(h, torch.Tensor) or h.dtype != torch.float32:
        raise CutMisuse(f"h must be a float32 torch tensor, got {type(h).__name__} {getattr(h, 'dtype', '')}"
                        f"{_float32_hint(h)}")
    if not h.requires_grad:
        raise CutMisuse("h does not require grad, so the gradient that comes back could not reach your model: "
                        "pass the encoder's output itself (not h.detach())")


class Cut:
    """The data owner's end of the cut for a PyTorch loop (``distgrad.cut.Cut`` underneath, as ``numpy``)."""

    def __init__(self, numpy: numpy_cut.Cut) -> None:
        self.numpy = numpy
        self._sent: list[weakref.ref[torch.Tensor]] = []   # the graph outputs of the last step, back-propagated

    @classmethod
    def connect(cls, endpoint: str, interface: str | Path | Mapping[str, Any] | None = None, *,
                state: Mapping[str, Any] | None = None, **options: Any) -> "Cut":
        """As ``distgrad.cut.Cut.connect`` (``step``, timeouts, CURVE key files, the interface's fields);
        ``state`` is a ``state_dict`` of this class (tensors)."""
        return cls(numpy_cut.Cut.connect(endpoint, interface, state=None if state is None else _to_numpy(state),
                                         **options))

    @property
    def applied(self) -> int:
        """The steps this loop has applied."""
        return self.numpy.applied

    @property
    def run_id(self) -> str:
        """The run's id, which names it on both sides: with ``applied``, what ``Cut.connect(..., step=, run=)``
        resumes from (``state_dict`` holds both)."""
        return self.numpy.run_id

    @property
    def exp(self) -> Experiment:
        """The interface (``config.experiment.Experiment``): ``exp.steps``, ``exp.batch``, ..."""
        return self.numpy.exp

    def rows(self, step: int | None = None) -> torch.Tensor:
        """The row numbers of ``step`` (default: the next) in the shared sample order, int64."""
        return torch.from_numpy(self.numpy.rows(step))

    @property
    def scale(self) -> float:
        """The factor on a step's summed micro-batch gradients (``distgrad.cut.Cut.scale``)."""
        return float(self.numpy.scale)

    def step(self, h: torch.Tensor | list[torch.Tensor], rows: Any = None, step: int | None = None) -> float | None:
        """Send ``h`` (float32, the interface's activation for a whole batch, part of the encoder's graph),
        wait for d(loss)/d(h), call ``h.backward`` with it and return the label owner's loss of the step (None
        when the label owner withholds it: ``distgrad.cut.Cut.step``).
        Step your optimiser after it. ``rows``: as ``distgrad.cut.Cut.step`` (sent with ``send_rows``, else
        optional and checked against the shared order).

        ``h`` may be a list of the step's M micro-batches' activations, each computed from its micro-batch
        alone (``encoder(x_i)`` for ``x_i`` in ``x.chunk(M)``): each gets its own gradient, unscaled, by its
        own ``backward``, in order, so your parameter gradients add up as a daemon's do; multiply them by
        ``cut.scale`` before ``opt.step()`` to train bit for bit as ``--micro-batches M``. The micro-batches
        may share one graph (the chunks of one ``encoder(x)``): it is kept until the last one's backward.

        ``CutMisuse`` (nothing sent) for an ``h`` that is not float32, does not require grad, or was sent and
        back-propagated by a step already (compute ``h`` for every step)."""
        parts = list(h) if isinstance(h, (list, tuple)) else [h]
        for part in parts:
            _check_h(part)
            self._check_not_sent(part)
        if isinstance(h, (list, tuple)):
            loss, grads = self.numpy.step_micro_batches(
                [part.detach().cpu().contiguous().numpy() for part in parts], _rows_array(rows), step)
        else:
            loss, dh = self.numpy.step(h.detach().cpu().contiguous().numpy(), _rows_array(rows), step)
            grads = [dh]
        self._sent = [weakref.ref(part) for part in parts if part.grad_fn is not None]
        for i, (part, grad) in enumerate(zip(parts, grads)):
            # The micro-batches may share one graph (the chunks of one encoder(x)): keep it for the later ones.
            part.backward(torch.from_numpy(grad).to(part.device), retain_graph=i < len(parts) - 1)
        return None if loss is None else float(loss)

    def _check_not_sent(self, h: torch.Tensor) -> None:
        """``CutMisuse`` for an ``h`` (not a leaf) that a step sent and back-propagated already: its graph is
        freed, so the next step's gradient could not reach the model (checked before anything is sent)."""
        if h.grad_fn is not None and any(ref() is h for ref in self._sent):
            raise CutMisuse(f"this h was sent and back-propagated by step {self.numpy.applied} already (its graph "
                            f"is freed, so step {self.numpy.applied + 1}'s gradient could not reach your model): "
                            f"compute h again from the step's batch (h = encoder(x)) for every step")

    @property
    def test_rows(self) -> torch.Tensor:
        """The held-out row numbers of this party's ``[data]``, in the order ``evaluate`` takes them."""
        return torch.from_numpy(self.numpy.test_rows)

    @property
    def evaluation_due(self) -> bool:
        """Whether ``eval_every`` asks for an evaluation after the steps applied (``distgrad.cut``)."""
        return self.numpy.evaluation_due

    @property
    def stopped(self) -> bool:
        """The label owner's last evaluation said stop (its early stopping): end the loop."""
        return self.numpy.stopped

    def evaluate(self, h: torch.Tensor) -> dict[str, Any]:
        """Score the held-out rows: ``h`` their activations (float32, in ``test_rows`` order; compute it under
        ``torch.no_grad()``); returns the label owner's ``loss``, ``correct``, ``count`` and, when it gives
        them, ``metrics``, ``best`` and ``stop`` (``distgrad.cut.Cut.evaluate``)."""
        if not isinstance(h, torch.Tensor) or h.dtype != torch.float32:
            raise CutMisuse(f"h must be a float32 torch tensor, got {type(h).__name__} {getattr(h, 'dtype', '')}"
                            f"{_float32_hint(h)}")
        return self.numpy.evaluate(h.detach().cpu().contiguous().numpy())

    def state_dict(self) -> dict[str, Any]:
        """As ``distgrad.cut.Cut.state_dict``, arrays as tensors: ``torch.save`` it with your model."""
        return _to_torch(self.numpy.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.numpy.load_state_dict(_to_numpy(state))

    def close(self, finished: bool | None = None) -> None:
        self.numpy.close(finished)

    def __enter__(self) -> "Cut":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.numpy.__exit__(*exc)


class Batch:
    """One micro-batch for the label owner's PyTorch loop: ``h`` a float32 leaf tensor that requires grad
    (its own memory), ``rows`` (int64 tensor; ``CutMisuse`` when nothing numbers the rows: no ``[data]`` and
    no ``send_rows``), ``step``, ``mb``, ``mbs``, ``last``; with several data owners ``client`` (whose batch,
    with ``[clients]``; else None) and ``parts`` (vertical: each party's own embedding, float32 tensors
    without grad, which ``h`` combines; else None)."""

    def __init__(self, batch: numpy_cut.Batch) -> None:
        self.numpy = batch
        self.step, self.mb, self.mbs, self.last = batch.step, batch.mb, batch.mbs, batch.last
        self.client = batch.client
        self.parts = None if batch.parts is None else [torch.tensor(part, dtype=torch.float32) for part in batch.parts]
        self.h = torch.tensor(batch.h, dtype=torch.float32).requires_grad_()

    @property
    def rows(self) -> torch.Tensor:
        return torch.from_numpy(self.numpy.rows)

    def reply(self, loss: Any) -> None:
        """Answer with this micro-batch's ``loss`` (a tensor or number) and ``h.grad``, which
        ``loss.backward()`` must have filled. ``CutMisuse`` without it, or on a second reply."""
        grad = self.h.grad
        if grad is None:
            raise CutMisuse(f"batch.h.grad of step {self.step} is missing: call loss.backward() before "
                            f"batch.reply(loss)")
        value = loss.detach().double().cpu().numpy() if isinstance(loss, torch.Tensor) else loss
        self.numpy.reply(value, grad.detach().cpu().contiguous().numpy())


class CutServer:
    """The label owner's end of the cut for a PyTorch loop (``distgrad.cut.CutServer`` underneath)."""

    def __init__(self, numpy: numpy_cut.CutServer) -> None:
        self.numpy = numpy

    @classmethod
    def bind(cls, endpoint: str, interface: str | Path | Mapping[str, Any] | None = None, *,
             state: Mapping[str, Any] | None = None,
             evaluate: Callable[[torch.Tensor, torch.Tensor], Any] | None = None, **options: Any) -> "CutServer":
        """As ``distgrad.cut.CutServer.bind``; ``state`` is a ``state_dict`` of this class (tensors);
        ``evaluate(h, rows) -> (loss, correct)`` gets the held-out activations and row numbers as tensors and
        runs without autograd."""
        return cls(numpy_cut.CutServer.bind(endpoint, interface, state=None if state is None else _to_numpy(state),
                                            evaluate=None if evaluate is None else _evaluate_tensors(evaluate),
                                            **options))

    @property
    def endpoint(self) -> str:
        return self.numpy.endpoint

    @property
    def exp(self) -> Experiment:
        """The interface (``config.experiment.Experiment``): ``exp.steps``, ``exp.batch``, ..."""
        return self.numpy.exp

    @property
    def step(self) -> int:
        """The steps applied (replied to in full)."""
        return self.numpy.step

    @property
    def scale(self) -> float:
        """The factor on a step's summed micro-batch gradients (``distgrad.cut.CutServer.scale``)."""
        return float(self.numpy.scale)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        """The next micro-batch (``distgrad.cut.CutServer.__next__``). The server is its own iterator, as the
        numpy one is: after an error the loop may handle (``CutMisuse`` for a batch left unanswered: reply, then
        ask again), the next ``next`` goes on serving rather than ending the loop as a finished generator would."""
        return Batch(next(self.numpy))

    def state_dict(self) -> dict[str, Any]:
        """As ``distgrad.cut.CutServer.state_dict``, arrays as tensors: ``torch.save`` it with your model."""
        return _to_torch(self.numpy.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.numpy.load_state_dict(_to_numpy(state))

    def close(self) -> None:
        self.numpy.close()

    def __enter__(self) -> "CutServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.numpy.__exit__(*exc)


def _evaluate_tensors(evaluate: Callable[[torch.Tensor, torch.Tensor], Any]
                      ) -> Callable[[np.ndarray, np.ndarray], Any]:
    """The numpy layer's ``evaluate`` calling a loop's torch one, without autograd."""
    def call(h: np.ndarray, rows: np.ndarray) -> Any:
        with torch.no_grad():
            result = evaluate(torch.tensor(h, dtype=torch.float32), torch.from_numpy(rows))
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            return result           # not (loss, correct): the numpy layer says so (CutMisuse)
        loss, correct = result
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().double().cpu().numpy()     # one number, or refused by the numpy layer
        if isinstance(correct, torch.Tensor) and correct.numel() == 1 and float(correct) == int(correct):
            correct = int(correct)                          # e.g. (pred == y).sum(), or its .float()
        return loss, correct
    return call


def batch_sampler(cut: Cut | numpy_cut.Cut, start: int | None = None) -> Iterable[list[int]]:
    """The row numbers of each step from ``start`` (default: the step after the cut's applied ones) to the
    interface's last, in the shared sample order: a ``batch_sampler`` for ``torch.utils.data.DataLoader``
    whose batches are exactly the steps the label owner expects. ``ConfigError`` at once for a ``start`` that
    is not a step (an integer from 1; the step after the last gives no batches)."""
    numpy = cut.numpy if isinstance(cut, Cut) else cut
    first = numpy.applied + 1 if start is None else start
    steps = numpy.exp.steps
    if isinstance(first, bool) or not isinstance(first, (int, np.integer)) or not 1 <= first <= steps + 1:
        raise ConfigError(f"batch_sampler's start={first!r} is not a step of this run: give an integer from 1 to "
                          f"{steps} (or {steps + 1}, after the last: no batches), or leave it out for the step "
                          f"after the cut's applied ones")
    return _StepRows(numpy, int(first))


class _StepRows:
    """``batch_sampler``'s sampler: iterable (once per DataLoader iteration) with a length."""

    def __init__(self, cut: numpy_cut.Cut, first: int) -> None:
        self.cut, self.first = cut, first

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.first, self.cut.exp.steps + 1):
            yield self.cut.rows(step).tolist()

    def __len__(self) -> int:
        return max(0, self.cut.exp.steps + 1 - self.first)
