"""One stage's step: forward, backward, optimiser, and the shapes it expects.

A ``Stage`` is pure computation over numpy arrays; the daemons feed it from
the wire and the in-process path feeds it directly, so both run the very same
operations in the same order. That is what makes two-process training
bit-for-bit equal to one process.
"""

from __future__ import annotations

import importlib
import math
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping, Sequence

import numpy as np

from distgrad.wire.codecs import Codec, NoneCodec
from distgrad.errors import ConfigError, NonFiniteError, StageError
from distgrad.config.experiment import Experiment, build_stage_parts, check_targets, file_error
from distgrad.model.losses import Loss
from distgrad.model.metrics import score
from distgrad.model.nn import DTYPE, ForwardContext, Grads, Sequential, Shape
from distgrad.config.npzfile import check_values, read_npz, write_npz
from distgrad.model.optim import Optimizer
from distgrad.model.schedules import Plateau
from distgrad.privacy.defenses import nopeek_gradient
from distgrad.privacy.labeldp import TrainingLabels
from distgrad.stage.checkpoint import stage_token
from distgrad.stage.records import write_atomic
from distgrad.wire.messages import all_finite
from distgrad.wire.wirecodec import ACTIVATION, GRADIENT, Expected, WireTensor


def average_parameters(params: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The element-wise mean of several stages' parameters (SplitFed averaging), in float32.

    Summed in list order (client 0 first), then divided by the count: the
    one order every party uses, so the result is the same bit for bit.
    """
    count = np.float32(len(params))
    mean = {}
    for name in params[0]:
        total = params[0][name].copy()
        for other in params[1:]:
            total += other[name]
        mean[name] = total / count
    return mean


def micro_batch(array: np.ndarray, index: int, count: int) -> np.ndarray:
    """Rows ``[index*n, (index+1)*n)`` of a batch of ``count*n`` rows (a view)."""
    if count == 1:
        return array
    n = array.shape[0] // count
    return array[index * n:(index + 1) * n]


def asked_dx(stage: str, dx: np.ndarray | None) -> np.ndarray:
    """``dx`` of a backward with ``need_dx``; ``StageError`` naming ``stage`` if its model returned none."""
    if dx is None:
        raise StageError(f"stage {stage}: its model's backward returned no input gradient, asked for one")
    return dx


@contextlib.contextmanager
def as_of(stage: Any, params: Mapping[str, np.ndarray] | None, step: int) -> Iterator[None]:
    """The stage as it computed step ``step``'s forward with steps in flight: ``params`` (its parameters
    after an earlier update; None or the live ones: no swap) in place of the live ones, and its step
    counter at ``step - 1`` (dropout masks, messages); both restored after, whatever happens."""
    live_step, live = stage.step, stage.params
    swap = None if params is live else params
    saved = None if swap is None else {name: value.copy() for name, value in live.items()}
    try:
        if swap is not None:
            for name, value in live.items():
                value[...] = swap[name]
        stage.step = step - 1
        yield
    finally:
        stage.step = live_step
        if saved is not None:
            for name, value in live.items():
                value[...] = saved[name]


def micro_shape(shape: tuple[int, ...], count: int) -> tuple[int, ...]:
    """The shape of one of ``count`` micro-batches of a batch of ``shape``."""
    return shape if count == 1 else (shape[0] // count, *shape[1:])


TensorSpecs = dict[str, tuple[tuple[int, ...], np.dtype]]


def target_spec(exp: Experiment) -> tuple[tuple[int, ...], np.dtype] | None:
    """Shape and dtype of a whole batch's targets when they travel downstream (the interface's ``target``),
    else None."""
    if exp.target is None:
        return None
    return exp.target[0], np.dtype(exp.target[1])


ROWS_DTYPE = np.dtype(np.int64)     # a forward's ``rows`` (``send_rows``): the micro-batch's row numbers


def forward_specs(stage: "Stage", target: tuple[tuple[int, ...], np.dtype] | None, micro_batches: int,
                  input_shape: tuple[int, ...] | None = None, codec: Codec | None = None,
                  rows: bool = False) -> Expected:
    """What a forward of one micro-batch to ``stage`` must carry, in frame order: its ``activation`` coded
    with ``codec`` (default ``none``), when they travel the targets (``target``: see ``target_spec``), and
    with ``rows`` (the interface's ``send_rows``; training forwards only) the micro-batch's row numbers,
    int64 ``[rows]``; ``input_shape``: the whole batch's activation when it is not the stage's input (one
    feature party's embedding, in a vertical experiment)."""
    shape = micro_shape(stage.input_shape if input_shape is None else input_shape, micro_batches)
    others = {}
    if target is not None:
        others["target"] = (micro_shape(target[0], micro_batches), np.dtype(target[1]))
    if rows:
        others["rows"] = ((shape[0],), ROWS_DTYPE)
    return Expected(WireTensor(ACTIVATION, shape, codec or NoneCodec()), others)


def backward_specs(stage: "Stage", micro_batches: int, codec: Codec | None = None) -> Expected:
    """What a backward reply to ``stage``'s forward of one micro-batch must carry: its ``activation_grad``,
    coded with ``codec`` (default ``none``)."""
    return Expected(WireTensor(GRADIENT, micro_shape(stage.output_shape, micro_batches), codec or NoneCodec()))


# Stages computed by another framework, built by ``module:function(exp, name, seed, init)``; looked up by
# name, so this module does not import them (``torch_stage`` imports this one).
FRAMEWORK_BUILDERS = {"torch": "distgrad.stage.torch_stage:build_stage"}


def check_cut(exp: Experiment, stage: "Stage", seed: int) -> None:
    """Raise ``ConfigError`` unless a built stage produces what the interface says crosses its cut
    (on the last stage: what its loss needs of the label owner's targets)."""
    name = stage.name
    if name != exp.stage_names[-1]:
        expected = exp.output_shape(name, seed)
        if tuple(stage.output_shape) != tuple(expected):
            raise ConfigError(f"stage {name!r} outputs shape {tuple(stage.output_shape)}, but the interface says "
                              f"the activation it sends is {tuple(expected)}")
    elif exp.has_stage(exp.label_owner) and exp.spec(exp.label_owner).data != {}:
        check_targets(exp, exp.build_data(seed, stage=exp.label_owner), stage.output_shape)


_PLATEAU = "sched/plateau"      # the checkpoint array of a numpy stage's ReduceLROnPlateau state


def held_out_part(validation: int, final: bool) -> tuple[slice, str | None]:
    """Which of a party's held-out rows an evaluation forwards and scores, and its ``link.HELD_OUT`` name:
    with a validation split (the first ``validation`` held-out rows are validation rows) the validation rows
    during the run and the test rows in the ``final`` evaluation; without one, every held-out row (None)."""
    if not validation:
        return slice(None), None
    return (slice(validation, None), "test") if final else (slice(None, validation), "validation")


def evaluate_held_out(stage: "Stage", x: np.ndarray, target: np.ndarray, metrics: Sequence[str],
                      validation: int, final: bool = False) -> dict[str, Any]:
    """The last stage's scores (``Stage.evaluate_last``) of the held-out rows an evaluation carries, ``x``
    (``held_out_part``: the validation rows, or in the ``final`` evaluation the test rows, with a validation
    split of ``validation`` rows), against their part of ``target`` (every held-out row's); with a split the
    result names its rows (``held_out``)."""
    part, name = held_out_part(validation, final)
    result = stage.evaluate_last(x, target[part], metrics)
    return result if name is None else {**result, "held_out": name}


@contextlib.contextmanager
def kept_model(stage: Any, kept: Mapping[str, Mapping[str, np.ndarray]] | None) -> Iterator[None]:
    """The stage with the kept model (``kept``: ``{"params": ..., "state": ...}``, its parameters and forward
    state, ``Stage.forward_state``, as keep_best copied them; None: the live ones) in place of its live
    ones, both restored after, whatever happens."""
    if kept is None:
        yield
        return
    live, live_state = {name: value.copy() for name, value in stage.params.items()}, stage.forward_state()
    try:
        stage.set_params(kept["params"])        # on a GPU too (``params`` are host copies there)
        stage.restore_forward_state(kept["state"])
        yield
    finally:
        stage.set_params(live)
        stage.restore_forward_state(live_state)


def check_saved_parameters(stage: str, path: str | Path, saved: Mapping[str, Any],
                           shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ``ConfigError`` unless ``saved`` has exactly the parameter names and shapes of ``shapes``."""
    missing, extra = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
    if missing or extra:
        raise ConfigError(f"--load {path} does not fit stage {stage}: it lacks {missing} and has {extra} "
                          f"(the stage has {sorted(shapes)})")
    for name, shape in shapes.items():
        if tuple(saved[name].shape) != tuple(shape):
            raise ConfigError(f"--load {path} does not fit stage {stage}: {name} has shape "
                              f"{tuple(saved[name].shape)}, the stage's is {tuple(shape)}")


def make_save_dir(directory: str | Path | None) -> None:
    """Create ``distgrad run --save DIR`` when it is missing; ``ConfigError`` when it cannot be."""
    if directory is not None:
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--save {directory}: cannot create the folder: {e.strerror or e}") from e


def parameters_file(directory: str | Path, instance: str, exp: Experiment, stage: str) -> Path:
    """Where ``distgrad run --save DIR`` keeps a stage's parameters: ``DIR/INSTANCE.npz``, or ``.pt`` (a
    torch ``state_dict``) for a torch stage. ``INSTANCE`` as in file names (``checkpoint.stage_token``): a
    stage name with a slash or other characters stays inside ``DIR``."""
    return Path(directory) / f"{stage_token(instance)}{'.pt' if exp.spec(stage).framework == 'torch' else '.npz'}"


def read_parameters_npz(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of a numpy stage's ``--load`` file (what ``Stage.save_parameters`` writes), each float32
    and finite; ``ConfigError`` naming the file, and the member at fault, for anything else
    (``npzfile.read_npz``, ``npzfile.check_values``)."""
    arrays = read_npz(path, "--load")
    check_values("--load", path, arrays, np.dtype(DTYPE))
    return arrays


# Reads a ``--load`` file by its suffix, checking all that can be known without the stage (integrity,
# value types, finiteness); looked up by name, so this module does not import torch.
PARAMETER_READERS = {".pt": "distgrad.stage.torch_stage:read_state_dict"}


def check_parameter_files(save: Path | None, load: Path | None, init: bool) -> None:
    """Raise ``ConfigError`` before anything starts for a ``--load`` file that is not there or cannot be
    used (damaged, values not finite or of another type: read whole by ``read_parameters_npz`` or, for a
    ``.pt`` file, ``torch_stage.read_state_dict``), a ``--save`` path whose folder cannot be written, or
    ``--load`` with ``--init`` (both set the initial values)."""
    if load is not None:
        if not Path(load).is_file():
            raise ConfigError(f"--load {load}: no such file")
        if init:
            raise ConfigError("--load and --init both set initial values: give one of them")
        reader = PARAMETER_READERS.get(Path(load).suffix)
        if reader is None:
            read_parameters_npz(load)
        else:
            module, function = reader.split(":")
            try:
                read = getattr(importlib.import_module(module), function)
            except ModuleNotFoundError as e:
                raise ConfigError(f"--load {load}: reading a {Path(load).suffix} file needs {e.name} "
                                  f"(pip install 'distgrad[torch]')") from e
            read(load)
    if save is not None:
        folder = Path(save).parent
        if Path(save).is_dir():
            raise ConfigError(f"--save {save} is a directory; give a file name")
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ConfigError(f"--save {save}: the folder {folder} does not exist or is not writable")


@dataclass(frozen=True)
class _ObjectiveCache:
    """A forward's cache with its input and output rows, for a stage's own objective term."""

    inner: Any
    x: np.ndarray
    y: np.ndarray


_NOTHING_DRAWN = contextlib.nullcontext()      # stateless: one for every stage without labels to draw


@contextlib.contextmanager
def _labels_restored_on_error(release: Any) -> Iterator[None]:
    """``release``'s drawn labels (its answers and sets) as they were before the block, if the block raises."""
    answers, sets = release.answers.copy(), release.sets.copy()
    try:
        yield
    except BaseException:
        release.answers[...], release.sets[...] = answers, sets
        raise


def batch_mixing_of(stages: Iterable[Stage]) -> dict[str, str]:
    """What each of ``stages`` mixes the rows of a training batch with (``Stage.batch_mixing``), by stage name,
    for ``config.defended.privacy_budget``; stages that mix nothing are left out."""
    return {stage.name: mixing for stage in stages if (mixing := stage.batch_mixing()) is not None}


class Stage:
    """A model slice with its own optimiser; the last stage also owns the loss.

    ``input_shape`` / ``output_shape`` are the per-step array shapes (float32)
    this stage takes and produces; ``step`` counts applied updates.
    Unless ``allow_nonfinite`` (the experiment's flag), every caller checks
    the loss, the activation gradient and the parameter gradients with
    ``check_finite`` / ``check_grads`` before replying or applying anything.
    """

    allow_nonfinite = False
    seed = 0        # the run's seed (``from_experiment`` sets it); a torch stage seeds its RNG from it
    nopeek: float | None = None     # a data owner's NoPeek weight (its stage's 'nopeek'; ``with_objective``)
    label_dp: TrainingLabels | None = None   # a label owner's training loss under 'label_dp' (``training_loss``)
    # The label owner's DP-SGD (its 'dp_sgd', bound by ``config.defended.attach_dp_sgd``): the parameter
    # gradients of a micro-batch from its input, d(loss)/d(output) and index, replacing the exact ones.
    private_update: Callable[[np.ndarray, np.ndarray, int], Grads] | None = None

    def __init__(self, name: str, model: Sequential, optimizer: Optimizer, loss: Loss | None,
                 input_shape: Shape) -> None:
        self.model = model
        self._setup(name, optimizer, loss, input_shape, model.output_shape(input_shape))

    def _setup(self, name: str, optimizer: Any, loss: Loss | None, input_shape: Shape, output_shape: Shape) -> None:
        """What every stage holds, whatever computes it: names, shapes, step counter."""
        self.name, self.optimizer, self.loss = name, optimizer, loss
        self.input_shape, self.output_shape = tuple(input_shape), tuple(output_shape)
        self.target_shape = loss.target_shape(self.output_shape) if loss else None
        self.target_dtype = loss.target_dtype if loss else None
        self.step = 0

    @classmethod
    def from_experiment(cls, exp: Experiment, name: str, seed: int | None = None,
                        init: Mapping[str, float] | None = None) -> "Stage":
        """Build stage ``name`` of ``exp``; raises ``ConfigError`` on a bad name or override, and for what only
        building finds (a module stage's code, its output against the cut), naming the file of the stage.

        A stage whose ``framework`` is ``"torch"`` is a ``distgrad.stage.torch_stage.TorchStage``
        with the same interface.
        """
        seed = exp.seed if seed is None else seed
        spec = exp.spec(name)
        try:
            if spec.framework in FRAMEWORK_BUILDERS:
                module, function = FRAMEWORK_BUILDERS[spec.framework].split(":")
                # imported only when a stage asks for it (torch is an optional extra)
                stage: Stage = getattr(importlib.import_module(module), function)(exp, name, seed, init)
            else:
                model, optimizer, loss = build_stage_parts(exp, name, seed, init or {})
                stage = cls(name, model, optimizer, loss, exp.input_shape(name, seed))
            check_cut(exp, stage, seed)
        except ConfigError as e:
            # What only building finds (a module's import, factory, output; an optimizer torch refuses) names
            # the file that declared the stage, as the errors of loading it do.
            if not spec.source or str(e).startswith(f"experiment {spec.source}:"):
                raise
            raise file_error(spec.source, str(e)) from e
        stage.allow_nonfinite, stage.seed = exp.allow_nonfinite, seed
        stage.nopeek = exp.spec(name).defenses.nopeek
        stage.label_dp = exp.training_labels(name, seed)
        return stage

    @property
    def params(self) -> dict[str, np.ndarray]:
        return self.model.params

    def check_finite(self, tensor: str, value: Any, step: int | None = None) -> None:
        """Raise ``NonFiniteError`` naming this stage, ``step`` (default: the one in progress) and
        ``tensor`` if ``value`` holds a NaN or +-Inf; nothing unless the experiment forbids them."""
        if not self.allow_nonfinite and not (math.isfinite(value) if isinstance(value, (float, np.floating))
                                             else all_finite(value) if type(value) is np.ndarray
                                             else np.isfinite(value).all()):
            raise self._nonfinite(tensor, step)

    def check_grads(self, grads: Grads) -> None:
        """``check_finite`` on every parameter gradient of a step, before its update (each gradient's name is
        only put in words for the error)."""
        if self.allow_nonfinite:
            return
        for name, g in grads.items():
            if not (all_finite(g) if type(g) is np.ndarray else np.isfinite(g).all()):
                raise self._nonfinite(f"gradient of {name}")

    def _nonfinite(self, tensor: str, step: int | None = None) -> NonFiniteError:
        return NonFiniteError(f"stage {self.name}: non-finite {tensor} at step "
                              f"{self.step + 1 if step is None else step}; nothing of this step was applied")

    @property
    def is_last(self) -> bool:
        return self.loss is not None

    def forward(self, x: np.ndarray, mb: int = 0, training: bool = True) -> tuple[np.ndarray, Any]:
        """Activations for ``x`` and the cache ``backward`` needs.

        ``x`` is micro-batch ``mb`` of the step in progress (``step + 1``);
        ``training`` is False for an evaluation. Both reach the layers as a
        ``ForwardContext`` (dropout draws its mask from them).
        """
        try:
            y, cache = self.model.forward(x, ForwardContext(training, self.step + 1, mb, self.name))
        except (ValueError, ArithmeticError) as e:
            raise StageError(f"stage {self.name}: forward failed at step {self.step + 1}: {e}") from e
        return y, self.with_objective(x, y, cache, training)

    def with_objective(self, x: np.ndarray, y: np.ndarray, cache: Any, training: bool) -> Any:
        """The cache of a forward of ``x`` to ``y``, holding them too when this stage's objective has a term of
        its own (NoPeek's distance correlation, ``nopeek``) that ``own_objective`` adds in the backward."""
        return _ObjectiveCache(cache, x, y) if training and self.nopeek is not None else cache

    def own_objective(self, cache: Any, dy: np.ndarray) -> tuple[Any, np.ndarray]:
        """The model's cache and d(objective)/d(output): ``dy`` received, plus the gradient of this stage's own
        term (``nopeek`` * dCor(input, output), ``privacy.defenses.nopeek_gradient``) when it has one."""
        if not isinstance(cache, _ObjectiveCache):
            return cache, dy
        return cache.inner, nopeek_gradient(cache.x, cache.y, dy, self.nopeek)  # type: ignore[arg-type]

    def batch_mixing(self) -> str | None:
        """What in this stage mixes the rows of a training batch, so that one row's target reaches every
        row's gradient (None: nothing; no numpy layer does). A torch stage names its batch norms."""
        return None

    def set_params(self, values: Mapping[str, np.ndarray]) -> None:
        """Set every parameter, in place, to ``values[name]`` (float32, its shape: what ``params`` gave)."""
        for name, value in self.params.items():
            value[...] = values[name]

    def forward_state(self) -> dict[str, np.ndarray]:
        """Copies of what a training forward changes besides its output (a torch module's buffers: batch
        norm's running statistics); a numpy stage's forward changes nothing: empty."""
        return {}

    def restore_forward_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Set what ``forward_state`` returned; nothing to set for a numpy stage."""

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        """d(loss)/d(input) (None unless ``need_dx``) and the parameter gradients, from d(loss)/d(output)."""
        cache, dy = self.own_objective(cache, dy)
        try:
            return self.model.backward(cache, dy, need_dx)
        except (ValueError, ArithmeticError) as e:
            raise StageError(f"stage {self.name}: backward failed at step {self.step + 1}: {e}") from e

    def backward_deferred(self, cache: Any, dy: np.ndarray) -> tuple[np.ndarray, Callable[[], Grads]]:
        """d(loss)/d(input) now; the parameter gradients (the same as ``backward``'s) when the returned
        function is called, which a serving stage does after sending d(loss)/d(input) upstream."""
        cache, dy = self.own_objective(cache, dy)
        try:
            return self.model.backward_deferred(cache, dy)
        except (ValueError, ArithmeticError) as e:
            raise StageError(f"stage {self.name}: backward failed at step {self.step + 1}: {e}") from e

    def per_example_grads(self, x: np.ndarray, dy: np.ndarray, mb: int) -> list[Grads]:
        """Each row's contribution to the parameter gradients of micro-batch ``mb`` of input ``x`` given
        d(loss)/d(output) ``dy``: a forward and backward of that row alone (layers without batch statistics)."""
        context = ForwardContext(True, self.step + 1, mb, self.name)
        grads = []
        for i in range(len(x)):
            _, cache = self.model.forward(x[i:i + 1], context)
            grads.append(self.model.backward(cache, dy[i:i + 1], False)[1])
        return grads

    def loss_backward(self, y: np.ndarray, target: np.ndarray) -> tuple[np.float32, np.ndarray]:
        """Loss value and d(loss)/d(y); last stage only."""
        assert self.loss is not None, f"stage {self.name} has no loss"
        try:
            return self.loss.forward_backward(y, target)
        except (ValueError, ArithmeticError) as e:
            raise StageError(f"stage {self.name}: loss failed at step {self.step + 1}: {e}") from e

    def training_loss(self, y: np.ndarray, target: np.ndarray) -> tuple[np.float32, np.ndarray]:
        """A training micro-batch's loss value and d(loss)/d(y): ``loss_backward``, or under ``label_dp``
        its training loss (``privacy.labeldp.TrainingLabels.loss``: the flip-rate-aware loss, and with stages
        the labels released as it first sees each row, ``target`` then holding the rows' numbers)."""
        if self.label_dp is None:
            return self.loss_backward(y, target)
        assert self.loss is not None, f"stage {self.name} has no loss"
        try:
            return self.label_dp.loss(y, target, self.step, self.loss.reduction)
        except (ValueError, ArithmeticError) as e:
            raise StageError(f"stage {self.name}: loss failed at step {self.step + 1}: {e}") from e

    def label_state(self) -> dict[str, np.ndarray]:
        """The labels released so far under ``label_dp`` with stages (checkpoint arrays; else none)."""
        release = self.label_dp.release if self.label_dp is not None else None
        return release.state_arrays() if release is not None else {}

    def load_label_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore the released labels ``label_state`` returned (none in ``arrays``: none released), keeping
        those released since (``LabelRelease.load_state_arrays``: a label is never drawn twice in a run)."""
        release = self.label_dp.release if self.label_dp is not None else None
        if release is not None:
            release.load_state_arrays(arrays)

    def labels_drawn_if_sent(self) -> ContextManager[None]:
        """Around computing and sending one micro-batch's gradient: RR-with-prior (``label_dp`` in stages)
        draws a row's label in the forward that first trains on it, and the label is released only with that
        gradient. When the block raises (the step refused, e.g. computed again on other activations, or
        failed before its reply left) the labels drawn in it are forgotten, so the step computed again on its
        first activations draws them as the uninterrupted run did. Without ``label_dp`` in stages, a shared
        context that does nothing (this is on every step's path)."""
        release = self.label_dp.release if self.label_dp is not None else None
        return _NOTHING_DRAWN if release is None else _labels_restored_on_error(release)

    def keep_label_releases(self, before: "Stage") -> None:
        """This stage rebuilt at step 0 for a rollback of the run that ``before`` trained: keep the labels
        ``before`` released (``LabelRelease.keep_released``)."""
        mine = self.label_dp.release if self.label_dp is not None else None
        theirs = before.label_dp.release if before.label_dp is not None else None
        if mine is not None and theirs is not None:
            mine.keep_released(theirs)

    def apply(self, grads: Grads) -> None:
        """One optimiser update; counts the step."""
        self.optimizer.step(self.model.params, grads)
        self.step += 1

    def learning_rate(self) -> float:
        """The learning rate of the latest update (before any: of the first), as the optimiser used it."""
        return float(self.optimizer.schedule(max(self.optimizer.updates, 1)))

    def evaluated(self, loss: float) -> None:
        """An evaluation's ``loss`` (the validation rows' with a validation split) after this stage's latest
        update, before its next: a ``ReduceLROnPlateau`` scheduler steps on it; nothing else changes."""
        if isinstance(self.optimizer.schedule, Plateau):
            self.optimizer.schedule.report(loss)

    @property
    def plateau(self) -> bool:
        """Whether this stage's rate follows the loss of each evaluation (``ReduceLROnPlateau``)."""
        return isinstance(self.optimizer.schedule, Plateau)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Everything the next step depends on, as named arrays (for checkpoints).

        Data and dropout need no position of their own: batches are a pure
        function of the step, and dropout masks of the run's seed, the step and
        the micro-batch; no random number generator carries state across steps.
        The optimizer's update count, which places its learning-rate schedule,
        is ``opt/updates`` (int64).
        """
        arrays = {f"param/{name}": value for name, value in self.params.items()}
        for key, value in self.optimizer.state_dict().items():
            if isinstance(value, Mapping):
                arrays.update({f"opt/{key}/{name}": v for name, v in value.items()})
            else:
                arrays[f"opt/{key}"] = np.asarray(value)
        if isinstance(self.optimizer.schedule, Plateau):
            arrays[_PLATEAU] = self.optimizer.schedule.state()
        return {**arrays, **self.label_state()}

    def _saved_param_names(self, arrays: Mapping[str, np.ndarray]) -> set[str]:
        """The parameter names in checkpoint ``arrays``; ``ValueError`` unless they are this stage's."""
        names = {k.split("/", 1)[1] for k in arrays if k.startswith("param/")}
        if names != set(self.params):
            raise ValueError(f"stage {self.name}: checkpoint has parameters {sorted(names)}, "
                             f"the model has {sorted(self.params)}")
        return names

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray], step: int) -> None:
        """Restore what ``state_arrays`` returned, at ``step``; raises ``ValueError`` on a mismatch.

        A checkpoint without the optimizer's update count (``opt/updates``, written since
        learning-rate schedules) resumes with ``step`` as the count.
        """
        self._saved_param_names(arrays)
        if (_PLATEAU in arrays) != isinstance(self.optimizer.schedule, Plateau):
            raise ValueError(f"stage {self.name}: the checkpoint {'has' if _PLATEAU in arrays else 'has no'} "
                             f"ReduceLROnPlateau state, and the stage {'has' if self.plateau else 'has no'} such "
                             f"scheduler")
        if isinstance(self.optimizer.schedule, Plateau):
            self.optimizer.schedule.load_state(arrays[_PLATEAU])
        for name, value in self.params.items():
            saved = arrays[f"param/{name}"]
            if saved.shape != value.shape:
                raise ValueError(f"stage {self.name}: checkpoint {name} has shape {saved.shape}, model {value.shape}")
            value[...] = saved
        state: dict[str, Any] = {}
        for key, value in arrays.items():
            parts = key.split("/", 2)
            if parts[0] != "opt":
                continue
            if len(parts) == 3:
                state.setdefault(parts[1], {})[parts[2]] = value
            else:
                state[parts[1]] = value
        for nested in ("m", "v"):
            state.setdefault(nested, {})
        # Checkpoints written before learning-rate schedules have no update count. Their experiments had
        # none (a schedule changes the fingerprint, so such a file is never resumed with one), so the count
        # only has to be plausible: the step, which is this stage's update count unless it is the serving
        # stage of several clients (one update per client per round) or a client skipped ahead.
        state.setdefault("updates", step)
        try:
            self.optimizer.load_state_dict(state)
        except KeyError as e:
            raise ValueError(f"stage {self.name}: checkpoint lacks optimizer state {e.args[0]!r}") from e
        self.load_label_state(arrays)
        self.step = step

    parameters_suffix = ".npz"      # what ``save_parameters`` writes: a numpy archive, one array per parameter

    def save_parameters(self, path: str | Path) -> Path:
        """Write this stage's parameters to ``path`` atomically: an ``.npz`` archive with one float32 array
        per parameter name (``numpy.load`` reads it). Raises ``OSError`` when it cannot be written."""
        arrays = {name: np.asarray(value) for name, value in self.params.items()}
        return write_atomic(path, lambda f: write_npz(f, arrays))

    def load_parameters(self, path: str | Path) -> None:
        """Set every parameter from a file ``save_parameters`` wrote (the initial values of a later run).

        Raises ``ConfigError`` naming the file (and the member) when it cannot
        be read, when a value is not float32 or not finite (``read_parameters_npz``),
        or when its names or shapes are not exactly this stage's.
        """
        saved = read_parameters_npz(path)
        check_saved_parameters(self.name, path, saved, {n: v.shape for n, v in self.params.items()})
        for name, value in self.params.items():
            value[...] = saved[name]

    def evaluate_last(self, x: np.ndarray, target: np.ndarray, metrics: Sequence[str] = ()) -> dict[str, Any]:
        """Forward only, on held-out rows: ``{"loss", "correct" (None unless classifying), "count"}``, and
        ``"metrics"``: ``{name: value}`` of each of ``metrics`` (``distgrad.model.metrics``) when any."""
        assert self.loss is not None, f"stage {self.name} has no loss"
        y, _ = self.forward(x, training=False)
        loss, _ = self.loss_backward(y, target)
        return {"loss": float(loss), "correct": self.loss.correct(y, target), "count": int(len(x)),
                **({"metrics": score(metrics, y, target)} if metrics else {})}

    def loss_micro_batch(self, x: np.ndarray, target: np.ndarray, mb: int = 0) -> tuple[np.float32, np.ndarray, Grads]:
        """Forward, loss and backward of micro-batch ``mb`` on the last stage, without an update."""
        y, cache = self.forward(x, mb)
        loss, dy = self.training_loss(y, target)
        dx, grads = self.backward(cache, dy)
        if self.private_update is not None:
            grads = self.private_update(x, dy, mb)
        return loss, asked_dx(self.name, dx), grads

    def loss_micro_batch_deferred(self, x: np.ndarray, target: np.ndarray, mb: int = 0
                                  ) -> tuple[np.float32, np.ndarray, Callable[[], Grads]]:
        """``loss_micro_batch`` with the parameter gradients computed when the returned function is called."""
        y, cache = self.forward(x, mb)
        loss, dy = self.training_loss(y, target)
        dx, grads_later = self.backward_deferred(cache, dy)
        private = self.private_update
        if private is not None:
            return loss, dx, lambda: private(x, dy, mb)
        return loss, dx, grads_later
