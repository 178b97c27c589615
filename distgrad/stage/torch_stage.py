"""A stage computed by PyTorch: a ``torch.nn.Module`` with a torch optimizer (``pip install 'distgrad[torch]'``).

``TorchStage`` has the interface of ``distgrad.stage.stage.Stage``, so the daemons,
the in-process path, micro-batches, checkpoints and traces use it unchanged,
and it speaks the same wire protocol: a torch f-stage trains against a numpy
g-stage and the reverse. Arrays crossing its boundary are numpy float32 (the
wire's type; class ids int64) in host memory; inside, tensors are torch
float32 on the stage's device and autograd computes the gradients.

Three ways to get one:

* ``framework = "torch"`` on an experiment stage (``Stage.from_experiment``
  then calls ``TorchStage.from_experiment``): the same layer list built in
  torch (``dense`` is ``nn.Linear`` holding ``W`` transposed, ``scale`` a
  one-parameter module, ``relu``/``tanh``/``sigmoid`` torch's own) with the
  initial values of the numpy build for that seed and ``--init``, the
  optimizer table mapped to ``torch.optim.Adam(lr, betas, eps)`` or
  ``torch.optim.SGD(lr)`` (with the float32 values the numpy optimizer
  uses: ``lr = 0.01`` is ``float32(0.01)``, as in every numpy stage; with a
  ``schedule``, each update's float32 rate from ``distgrad.model.schedules`` is
  set on every param group before its ``step()``), and
  on the last stage the loss in torch with
  losses.py's definitions and reductions. Parameters keep their numpy names
  and layout (``NAME.W`` is ``(n_in, n_out)``), so summaries and traces of
  either framework compare key by key.
* ``module = "package.module:factory"`` on an experiment or stage-file stage
  (``build_stage``): your own module, made by calling
  ``factory(**module_args)`` after ``torch.manual_seed(stage seed)`` (so every
  process, and the in-process reference, starts from the same values). The
  import path is looked up in the folder of the file that names it first
  (``mymodel.py`` or ``pkg/mod.py`` next to the stage file), then on
  ``sys.path``. ``optimizer = { type = "Adam", lr = 0.001, ... }`` names a
  ``torch.optim`` class and its keyword arguments (``"adam"``/``"sgd"``: the
  distgrad tables, mapped as above); on the last stage ``loss`` is a
  distgrad loss or a ``torch.nn`` loss class with its keyword arguments
  (``losses.TorchLoss``: ``{ type = "CrossEntropyLoss" }`` takes int64
  class ids, ``{ type = "MSELoss" }`` float32 targets shaped like the
  output; reduction "mean" or "sum"). ``--init NAME=VALUE`` and parameter
  names are the module's ``named_parameters``.
* ``TorchStage.from_module(name, module, optimizer, input_shape, loss=None)``
  for a module built in your own code; parameter names and layouts are
  those of ``module.named_parameters()``.

Devices. ``device = "cuda"`` (or ``"cuda:N"``) puts the module and the
optimizer state on that GPU; a stage asking for CUDA where none is visible
fails with a ``ConfigError``. Inputs arrive as numpy in host memory and are
copied into pinned memory and moved with ``non_blocking=True``; outputs and
gradients come back with ``.cpu().numpy()``; ``params`` are host copies on
a GPU (live numpy views on the CPU). A GPU run equals a CPU run to float32
tolerance, not bit for bit (other kernels); a GPU run in one process or two
is bitwise only as far as the CUDA kernels are deterministic
(``torch.use_deterministic_algorithms``).

What is and is not bitwise. The numpy stages reproduce TensorFlow 1's Adam
kernel bit for bit; ``torch.optim.Adam`` is another formula: it adds epsilon
to the bias-corrected ``sqrt(v) / sqrt(1 - beta2**t)`` where TF1 adds it to
``sqrt(v)`` (TF's "epsilon hat"), and orders its arithmetic differently.
Torch's matmuls, reductions and ``tanh``/``sigmoid`` are not numpy's either
(other kernels, other summation orders). So a torch stage equals its numpy
twin to float32 tolerance, not bit for bit. tests/test_torch.py checks:

* one step's gradients (the activation gradient that crosses the wire and
  every parameter's) against torch autograd on the composed model and
  against the numpy stages, ``rtol=1e-5``: a few float32 roundings (unit
  roundoff 6e-8) through a handful of layers and sums over a batch;
* mixed torch/numpy runs against an all-torch run with SGD, ``rtol=1e-5,
  atol=1e-6`` after 30 steps (largest difference seen: 6e-8); SGD carries
  rounding differences along without amplifying them;
* not Adam across frameworks: epsilon's placement is a difference of
  formula, largest for the tiny gradients Adam scales up to steps of size
  ``lr`` (after 50 steps of tanh-regression a weight differs by up to 8e-4
  at lr 0.01; on mlp-classify's first step, numpy's and torch's updates of
  the input weights differ by up to 0.7 lr). The Adam mapping is checked
  against ``torch.optim.Adam`` on the composed model instead, ``rtol=1e-5,
  atol=1e-6``.

Bitwise: a run with the same frameworks in one process or in two (inputs are
copied into memory torch allocated, so kernels see the same alignment either
way), and a run resumed from checkpoints, with or without steps in flight
(``--staleness``: a training forward computes with its own copy of the
parameters, so its graph stays valid through the updates before its
backward).

Threads: a torch stage computes on one thread, whatever ``OMP_NUM_THREADS``
or ``MKL_NUM_THREADS`` say, as every stage does (``distgrad.threads``): a
thread count changes how torch splits a reduction, hence its rounding. On
import this module sets ``torch.set_num_threads(1)``; a run's computation
sets it again for its duration (``one_compute_thread``).

A label owner's DP-SGD (its ``dp_sgd``): ``per_example_grads`` computes each row's parameter gradient with
``torch.func`` (``vmap`` of ``grad`` through ``functional_call``, each row forwarded alone); the clipping, sum
and noise are then the numpy stage's (``privacy.defenses.dp_sgd_gradients``), so such a run is bitwise in
one process or two and after a resume. Modules with batch norm or dropout are refused when built
(``per_example_refusal``).

Modules train in whatever mode they are in (``train()`` by default) and
are evaluated in ``eval()`` mode (their mode restored after). Before each
training forward, torch's RNG is seeded from (the run's seed, the stage's
name, the step, the micro-batch), so dropout draws the same masks in one
process or two and after a resume. Buffers (batch norm's running
statistics) are part of a stage's state: its checkpoints hold them
(``buffer/NAME``), so a resume is exact.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import json
import sys
import threading
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from distgrad.jsontext import finite_or_text, json_text
from distgrad.errors import ConfigError, StageError
from distgrad.config.experiment import Experiment, StageSpec, build_stage_parts, check_init_overrides, stage_loss
from distgrad.config.defended import label_owner_sends_gradients
from distgrad.model.losses import Loss, MeanSquaredError, SoftmaxCrossEntropy, SumSquaredError, TorchLoss, build_loss
from distgrad.model.metrics import score
from distgrad.model.aggregate import OwnBottom
from distgrad.model.nn import DTYPE, Dense, Grads, Layer, ReLU, Scale, Shape, Sigmoid, Tanh, build_model
from distgrad.model.optim import OPTIMIZERS, SGD, Adam, Optimizer, build_optimizer
from distgrad.stage.records import write_atomic
from distgrad.config.npzfile import member_error
from distgrad.model.schedules import PLATEAU, Schedule, optimizer_schedule
from distgrad.stage.stage import Stage, check_cut, check_saved_parameters
from distgrad.threads import one_torch_thread

try:
    import torch
    from torch import nn
except ImportError as e:
    raise ConfigError("a stage with framework 'torch' needs PyTorch: pip install 'distgrad[torch]'") from e

one_torch_thread(torch)     # imported inside a run's one_compute_thread, torch loaded after it began

_UPDATES = "opt/updates"     # the checkpoint array of the update count (as a numpy stage's optimizer writes it)

# What torch raises for bad shapes, dtypes and values; reported as the stage's StageError.
_COMPUTE_ERRORS = (ValueError, ArithmeticError, RuntimeError, IndexError)


CPU = torch.device("cpu")


def _tensor(array: np.ndarray, dtype: np.dtype | type = np.float32, device: torch.device = CPU) -> torch.Tensor:
    """A copy of ``array`` as a tensor of ``dtype`` on ``device``, in memory torch allocated.

    Copied so that a matmul kernel sees the same alignment whether the array
    is a received frame or one of this process's arrays (MKL's results can
    depend on it), and so that read-only frames can be used. For a GPU the
    copy goes to pinned host memory, from which the transfer runs without
    blocking this thread.
    """
    if device.type == "cpu":
        if type(array) is np.ndarray and array.dtype != dtype:
            # Converted while copied, in one pass (``torch.tensor(np.asarray(array, dtype))`` copies twice).
            out = torch.empty(array.shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype)
            np.copyto(out.numpy(), array, casting="unsafe")
            return out
        return torch.tensor(np.asarray(array, dtype))
    array = np.asarray(array, dtype)
    pinned = torch.empty(array.shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True)
    pinned.numpy()[...] = array
    return pinned.to(device, non_blocking=True)


def _host(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as numpy in host memory: a view of a CPU tensor, a copy of a GPU one."""
    return tensor.detach().cpu().numpy()


def torch_device(name: str, stage: str = "") -> torch.device:
    """The torch device a stage's ``device`` names; ``ConfigError`` when it asks for CUDA that is not there."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = ("was built without CUDA" if torch.version.cuda is None
                     else f"has CUDA {torch.version.cuda} but finds no GPU")
            raise ConfigError(f"stage {stage!r}: device {name!r} asked for but no CUDA device is visible: torch "
                              f"{torch.__version__} {build} (check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES), "
                              f"or set device = \"cpu\"")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"stage {stage!r}: device {name!r} asked for but {count} CUDA device(s) are visible "
                              f"(cuda:0 to cuda:{count - 1})")
    return device


# ---------------------------------------------------------------- losses in torch
# The definitions and reductions of losses.py; a scalar tensor from (pred, target).

def _sum_squared_error(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    diff = pred - target
    return (diff * diff).sum()


def _mean_squared_error(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    diff = pred - target
    return (diff * diff).mean()


def _softmax_cross_entropy(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    classes = pred.shape[1]
    # Checked here because torch would skip the class id -100 (its ignore_index) instead of failing.
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= classes):
        raise ValueError(f"class ids must lie in [0, {classes}), got {int(target.min())}..{int(target.max())}")
    return nn.functional.cross_entropy(pred, target, reduction="mean")


_TORCH_LOSSES: dict[type[Loss], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    SumSquaredError: _sum_squared_error,
    MeanSquaredError: _mean_squared_error,
    SoftmaxCrossEntropy: _softmax_cross_entropy,
}
_TENSOR_LOSS_OPTIONS = ("weight", "pos_weight")     # torch loss keyword arguments that are tensors


def _torch_loss(loss: Loss, device: torch.device, stage: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The torch function computing ``loss``: losses.py's definitions, or the ``torch.nn`` class a
    ``TorchLoss`` names, made with its keyword arguments (``ConfigError`` when they do not fit)."""
    if type(loss) in _TORCH_LOSSES:
        return _TORCH_LOSSES[type(loss)]
    if not isinstance(loss, TorchLoss):
        raise ConfigError(f"stage {stage}: loss {type(loss).__name__} has no torch version")
    options = {k: torch.tensor(v, dtype=torch.float32, device=device) if k in _TENSOR_LOSS_OPTIONS and
               isinstance(v, list) else v for k, v in loss.options.items()}
    try:
        check_keyword_options(getattr(nn, loss.type), options)
        module = getattr(nn, loss.type)(**options).to(device)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"stage {stage}: torch.nn.{loss.type}(**{loss.options!r}) failed: {e}") from e
    if not loss.classifies or "ignore_index" in loss.options:
        return module

    def class_id_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        classes = pred.shape[1]
        # torch would skip the class id -100 (its default ignore_index) instead of failing
        if target.numel() and (int(target.min()) < 0 or int(target.max()) >= classes):
            raise ValueError(f"class ids must lie in [0, {classes}), got {int(target.min())}..{int(target.max())}")
        return module(pred, target)

    return class_id_loss


# ---------------------------------------------------------------- layers in torch

class ScaleModule(nn.Module):
    """``y = x * w``, torch's form of ``distgrad.model.nn.Scale``; ``w`` has shape ``(size,)``."""

    def __init__(self, w: np.ndarray) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


@dataclass(frozen=True)
class _Param:
    """One parameter under its distgrad name; ``transposed``: torch holds it transposed (``nn.Linear``)."""

    name: str
    tensor: nn.Parameter
    transposed: bool = False

    def view(self, value: torch.Tensor) -> np.ndarray:
        """``value`` (the parameter, its gradient or optimizer state) as numpy in distgrad's layout, sharing
        memory on the CPU (a host copy of a GPU tensor)."""
        array = _host(value)
        return array.T if self.transposed else array

    def from_numpy(self, array: np.ndarray) -> torch.Tensor:
        """A float32 tensor in torch's layout on the parameter's device for a numpy array in distgrad's
        (sharing memory on the CPU when it can)."""
        array = np.ascontiguousarray(array.T if self.transposed else array, np.float32)
        device = self.tensor.device
        return torch.from_numpy(array) if device.type == "cpu" else _tensor(array, np.float32, device)


class OwnBottomModule(nn.Module):
    """Torch's form of ``aggregate.OwnBottom`` (a vertical label owner's own ``bottom``), then ``top``.

    Its input is the parties' embeddings (``widths``, in party order) and the
    label owner's own feature columns side by side (``aggregate.join_input``);
    ``bottom`` turns the own columns into one more embedding, combined with
    the parties' as ``aggregate.combine`` does (``kind``: concat in order, or
    their sum, or mean, the label owner last), and ``top`` (the stage's layers
    or its module; None: nothing) takes the result. Autograd gives the bottom
    the gradient of its own embedding and each party exactly its own part.
    """

    def __init__(self, kind: str, widths: Sequence[int], bottom: nn.Module, top: nn.Module | None = None) -> None:
        super().__init__()
        self.kind, self.widths, self.bottom, self.top = kind, list(widths), bottom, top

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        edges = np.cumsum([0, *self.widths]).tolist()
        parts = [x[..., edges[k]:edges[k + 1]] for k in range(len(self.widths))]
        parts.append(self.bottom(x[..., edges[-1]:]))
        if self.kind == "concat":
            z = torch.cat(parts, dim=-1)
        else:
            z = parts[0]
            for part in parts[1:]:
                z = z + part
            if self.kind == "mean":
                z = z / torch.tensor(DTYPE(len(parts)), device=z.device)
        return z if self.top is None else self.top(z)


def _torch_bottom(layer: OwnBottom, top: nn.Module | None = None
                  ) -> tuple[OwnBottomModule, list[tuple[str, str, bool]]]:
    """Torch's form of a label owner's ``OwnBottom`` (its bottom's layers built in torch, each holding its
    values) over ``top``, and its parameters as ``_torch_layer`` names them (attributes under ``bottom``)."""
    modules, names = [], []
    for i, inner in enumerate(layer.bottom.layers):
        module, inner_names = _torch_layer(inner)
        modules.append(module)
        names += [(dg_name, f"bottom.{i}.{attr}", transposed) for dg_name, attr, transposed in inner_names]
    return OwnBottomModule(layer.kind, layer.widths, nn.Sequential(*modules), top), names


def _torch_layer(layer: Layer) -> tuple[nn.Module, list[tuple[str, str, bool]]]:
    """Torch's form of one numpy layer, holding its values, and ``(distgrad name, attribute, transposed)`` per parameter
    (an attribute path, as ``nn.Module.get_parameter`` takes it)."""
    if isinstance(layer, OwnBottom):
        return _torch_bottom(layer)
    with torch.no_grad():
        if isinstance(layer, Dense):
            linear = nn.utils.skip_init(nn.Linear, layer.n_in, layer.n_out)   # no draw from torch's RNG
            linear.weight.copy_(torch.from_numpy(layer.params[layer.w_name].T))
            linear.bias.copy_(torch.from_numpy(layer.params[layer.b_name]))
            return linear, [(layer.w_name, "weight", True), (layer.b_name, "bias", False)]
    if isinstance(layer, Scale):
        return ScaleModule(layer.params[layer.name]), [(layer.name, "w", False)]
    activations: dict[type[Layer], type[nn.Module]] = {ReLU: nn.ReLU, Tanh: nn.Tanh, Sigmoid: nn.Sigmoid}
    if type(layer) not in activations:
        raise ConfigError(f"layer {type(layer).__name__} has no torch version")
    return activations[type(layer)](), []


def _torch_optimizer(optimizer: Optimizer, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer with ``optimizer``'s (validated, float32) hyperparameters.

    Its ``lr`` is the rate of update 1; ``TorchStage.apply`` sets each later one from ``optimizer.schedule``.
    """
    if isinstance(optimizer, Adam):
        return torch.optim.Adam(_group(params), lr=float(optimizer.lr),
                                betas=(float(optimizer.beta1), float(optimizer.beta2)), eps=float(optimizer.epsilon))
    if isinstance(optimizer, SGD):
        return torch.optim.SGD(_group(params), lr=float(optimizer.lr))
    raise ConfigError(f"optimizer {type(optimizer).__name__} has no torch version")


def _group(params: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    """``params`` as one param group: what torch makes of a list of tensors, and also of an empty one (a stage
    with nothing to train, as a numpy stage of activations alone; torch refuses an empty list itself)."""
    return [{"params": list(params)}]


def _trial_step(cls: type[torch.optim.Optimizer], options: Mapping[str, Any], params: Sequence[torch.Tensor]) -> None:
    """Raise what ``cls(params, **options).step()`` raises, on copies of ``params`` with zero gradients: an
    optimizer that cannot update these parameters (SparseAdam's dense gradients, ``capturable`` on the CPU,
    ``differentiable`` leaves) fails when the stage is built, not at its first update."""
    copies = [p.detach().clone().requires_grad_() for p in params]
    for twin in copies:
        twin.grad = torch.zeros_like(twin)
    cls(_group(copies), **options).step()


_CLOSURE_OPTIMIZERS = ("lbfgs",)      # their step re-evaluates the model through a closure: not a split stage's


def _torch_optimizer_classes() -> list[str]:
    return sorted(name for name, value in vars(torch.optim).items() if isinstance(value, type)
                  and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer
                  and name.lower() not in _CLOSURE_OPTIMIZERS)


def check_keyword_options(cls: type, options: Mapping[str, Any], given: str = "", also: Sequence[str] = ()) -> None:
    """Refuse, before ``cls(...)`` is called, the options of a table that names a torch class
    (``torch.optim.Adam``, a ``torch.optim.lr_scheduler`` class, a ``torch.nn`` loss): a name ``cls`` does
    not take (``ConfigError`` listing the valid ones, as distgrad's own tables do) and a string or boolean
    where ``cls``'s default is a number (``lr = "0.01"``: torch would fail on a comparison, or take it), and
    a boolean for a required option annotated as a number (``step_size = true``, which torch takes as 1). ``given`` names the option
    positions the caller fills itself (the parameters, the optimizer), which a table may not give; ``also``
    the table's keys that distgrad reads itself (listed among the valid ones).
    """
    parameters = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return      # a class taking any keyword: its constructor is the judge
    valid = [name for name, p in parameters.items() if name != given
             and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown}; valid options: {', '.join(['type', *valid, *also])}")
    for name, value in options.items():
        default, annotation = parameters[name].default, parameters[name].annotation
        numeric_default = isinstance(default, (int, float)) and not isinstance(default, bool)
        if numeric_default and (isinstance(value, (str, bool)) or value is None):
            raise ConfigError(f"option {name!r}: {value!r} is not a number")
        # A required number (StepLR's step_size, annotated 'int'): torch would take true as 1. A string fails
        # when the class is first used, which building a stage does (its own error names it).
        if annotation in (int, float, "int", "float") and isinstance(value, bool):
            raise ConfigError(f"option {name!r}: {value!r} is not a number")


def module_optimizer(table: Mapping[str, Any], params: list[nn.Parameter], stage: str
                     ) -> tuple[torch.optim.Optimizer, Schedule | None]:
    """A module stage's optimizer and its learning-rate schedule (None without one).

    ``{ type = "Adam", lr = 0.001, ... }`` names a ``torch.optim`` class (as torch spells it, or in lower
    case: ``"rmsprop"``) and its keyword arguments (lists become tuples, for ``betas``); ``"adam"``/
    ``"sgd"`` (the default ``"adam"``) are distgrad's tables with their float32
    values. Either may hold a ``schedule`` table (``distgrad.model.schedules``):
    around the table's ``lr`` (else the class's default), its float32 rate of
    each update is set on every param group before the update. ``ConfigError``
    for an unknown class, arguments the class rejects or a bad schedule.
    """
    table = dict(table)
    kind = table.get("type", "adam")
    try:
        if isinstance(kind, str) and kind in OPTIMIZERS:
            built = build_optimizer(table)
            return _torch_optimizer(built, params), built.schedule if "schedule" in table else None
        if isinstance(kind, str) and kind.lower() in _CLOSURE_OPTIMIZERS:
            raise ConfigError(f"torch.optim.{kind} re-evaluates the whole model through a closure at every step, "
                              f"which a stage holding only its part cannot give; use another optimizer")
        classes = _torch_optimizer_classes()
        # torch.optim's spelling, or the lower-case one ("rmsprop" is RMSprop; "adam" and "sgd" are distgrad's)
        kind = {name.lower(): name for name in classes}.get(kind, kind) if isinstance(kind, str) else kind
        cls = getattr(torch.optim, kind, None) if kind in classes else None
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ConfigError(f"unknown optimizer {kind!r}: name a torch.optim class "
                              f"({', '.join(classes)}; the lower-case names too) or a distgrad one "
                              f"({', '.join(OPTIMIZERS)})")
        schedule_spec = table.pop("schedule", None)
        options: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items() if k != "type"}
        schedule = None
        if schedule_spec is not None:
            lr = options.get("lr")
            if lr is not None and (not isinstance(lr, (int, float)) or isinstance(lr, bool)):
                raise ConfigError(f"invalid option 'lr' for optimizer {kind!r}: {lr!r} is not a number")
            default_lr = inspect.signature(cls).parameters["lr"].default
            schedule = optimizer_schedule(kind, schedule_spec, lr, default_lr)
        try:
            check_keyword_options(cls, options, given="params", also=("schedule",))
            optimizer = cls(_group(params), **options)
        except Exception as e:      # torch's checks of the options raise many kinds (betas = [0.9]: IndexError)
            raise ConfigError(f"torch.optim.{kind} rejects {options!r}: {e}") from e
        try:
            _trial_step(cls, options, params)
        except Exception as e:      # whatever its step raises
            raise ConfigError(f"torch.optim.{kind} with {options!r} cannot update this stage's parameters: "
                              f"{type(e).__name__}: {e}") from e
        return optimizer, schedule
    except ConfigError as e:
        raise ConfigError(f"stage {stage!r}: {e}") from e


# Schedulers a table cannot give what they need, with the reason.
_REFUSED_SCHEDULERS = {
    "LambdaLR": "it takes a Python function, which a table cannot give",
    "MultiplicativeLR": "it takes a Python function, which a table cannot give",
    "SequentialLR": "it takes other schedulers, which a table cannot give",
    "ChainedScheduler": "it takes other schedulers, which a table cannot give",
}
_PLATEAU_FLOATS = ("best", "mode_worse")      # ReduceLROnPlateau's state floats that may be infinite
_SCHEDULER = "opt/scheduler"    # the checkpoint array of the scheduler's state: JSON text as uint8


def _scheduler_classes() -> list[str]:
    base = torch.optim.lr_scheduler.LRScheduler
    return sorted({name for name, value in vars(torch.optim.lr_scheduler).items() if isinstance(value, type)
                   and issubclass(value, base) and value is not base and not name.startswith("_")
                   and name not in _REFUSED_SCHEDULERS} | {PLATEAU})


def is_plateau(scheduler: Any) -> bool:
    """Whether ``scheduler`` steps on an evaluation's loss (``ReduceLROnPlateau``), not after each update."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _scheduler_state(scheduler: Any, optimizer: torch.optim.Optimizer) -> np.ndarray:
    """The scheduler's ``state_dict`` and the optimizer's param groups (which a scheduler may change: the
    rate, and momentum for OneCycleLR and CyclicLR) as JSON text in a uint8 array (never a pickle);
    ``TypeError``/``ValueError`` when they are not plain numbers, strings and lists."""
    state = scheduler.state_dict()
    if is_plateau(scheduler):       # its best loss starts infinite (and its worst is): JSON keeps them as text
        state = {k: finite_or_text(v) if isinstance(v, float) else v for k, v in state.items()}
    text = json_text({"scheduler": state, "param_groups": optimizer.state_dict()["param_groups"]}, strict=True)
    return np.frombuffer(text.encode(), np.uint8).copy()


def stage_scheduler(table: Mapping[str, Any] | None, optimizer: torch.optim.Optimizer, stage: str) -> Any:
    """The ``torch.optim.lr_scheduler`` class a stage's ``scheduler = { type = "StepLR", ... }`` names, made
    over ``optimizer`` with the table's other keys as keyword arguments; None without a table.

    Stepped once after each update (``TorchStage.apply``), or, for
    ``ReduceLROnPlateau``, once after each evaluation with its loss
    (``TorchStage.evaluated``), and checkpointed with the stage. ``ConfigError`` naming the stage for an unknown class, a
    refused one (``_REFUSED_SCHEDULERS``: the reason), arguments the class
    rejects or its first step cannot use (tried on a copy of the optimizer), or a state that cannot be
    checkpointed as JSON.
    """
    if table is None:
        return None
    options = dict(table)
    kind = options.pop("type", None)
    where = f"stage {stage!r}: scheduler {kind!r}"
    if kind in _REFUSED_SCHEDULERS:
        raise ConfigError(f"{where} is not supported: {_REFUSED_SCHEDULERS[kind]}")
    if not isinstance(kind, str) or kind not in _scheduler_classes():
        raise ConfigError(f"{where}: name a torch.optim.lr_scheduler class: {', '.join(_scheduler_classes())}")
    cls = getattr(torch.optim.lr_scheduler, kind)
    twin = copy.deepcopy(optimizer)     # made before the scheduler sets the rate and initial_lr of the real one
    try:
        check_keyword_options(cls, options, given="optimizer")
        scheduler = cls(optimizer, **options)
    except Exception as e:      # torch's checks of the options raise many kinds
        raise ConfigError(f"{where}: torch.optim.lr_scheduler.{kind} rejects {options!r}: {e}") from e
    try:
        # One update and one step of a twin: options its step cannot use (step_size = 0) fail here, not in an
        # update of the run.
        twin_scheduler = cls(twin, **options)
        twin.step()
        twin_scheduler.step(*([1.0] if is_plateau(twin_scheduler) else []))
    except Exception as e:      # whatever its step raises
        raise ConfigError(f"{where} with {options!r} cannot be stepped: {type(e).__name__}: {e}") from e
    try:
        _scheduler_state(scheduler, optimizer)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: its state cannot be checkpointed as JSON ({e}); use numbers and strings") from e
    return scheduler


# ---------------------------------------------------------------- your own module

def _inside(module: Any, folder: Path) -> bool:
    """True when ``module`` (a file, a package or a namespace package) was loaded from ``folder``."""
    origins = [getattr(module, "__file__", None), *getattr(module, "__path__", [])]
    return any(origin is not None and Path(origin).resolve().is_relative_to(folder) for origin in origins)


# The modules imported from a stage file's folder (its module and whatever of that folder its code imports), by
# name: the folder they came from. Another folder's stage must not find them in sys.modules under that name.
_FOLDER_MODULES: dict[str, Path] = {}
_FOLDER_LOCK = threading.RLock()        # sys.path and sys.modules are the process's: one stage folder at a time


@contextlib.contextmanager
def _stage_folder(folder: Path) -> Iterator[None]:
    """Run an import of a stage's code, or its factory, with ``folder`` first on ``sys.path`` and without the
    modules another stage folder put in ``sys.modules`` (two parties' ``model.py``, or the ``helpers.py`` each
    one's imports, in one process: ``--in-process``, the launcher's check of every stage, the API); the modules
    this folder's code imports are recorded as its own. Stages built before keep the modules they hold."""
    with _FOLDER_LOCK:
        for name, origin in list(_FOLDER_MODULES.items()):
            if origin != folder:
                sys.modules.pop(name, None)
                del _FOLDER_MODULES[name]
        before = set(sys.modules)
        sys.path.insert(0, str(folder))
        try:
            yield
        finally:
            sys.path.remove(str(folder))
            for name in set(sys.modules) - before:
                if _inside(sys.modules[name], folder):
                    _FOLDER_MODULES[name] = folder


def _import_module(path: str, base_dir: Path, where: str) -> Any:
    """Import ``path`` ("pkg.mod"), from ``base_dir`` when it holds ``pkg`` (a ``.py`` or a folder), else
    from ``sys.path``. A module of the same name already imported from elsewhere is replaced in
    ``sys.modules`` (two stage files may each have their own ``model.py``, and each its own modules that
    it imports: ``_stage_folder``)."""
    top = path.split(".")[0]
    folder = base_dir.resolve()
    local = (folder / f"{top}.py").is_file() or (folder / top).is_dir()
    try:
        if not local:
            return importlib.import_module(path)
        with _stage_folder(folder):
            stale = [name for name, module in list(sys.modules.items())
                     if (name == top or name.startswith(top + ".")) and not _inside(module, folder)]
            for name in stale:
                del sys.modules[name]
            return importlib.import_module(path)
    except ModuleNotFoundError as e:
        if e.name is not None and path != e.name and not path.startswith(e.name + "."):
            raise ConfigError(f"{where}: importing {path!r} failed: it imports {e.name!r}, which is not installed "
                              f"({e})") from e
        raise ConfigError(f"{where}: no module {path!r}: put {path.replace('.', '/')}.py next to the file that "
                          f"names it ({folder}), or install it or add its folder to PYTHONPATH") from e
    except Exception as e:       # the user's module raised anything while being imported
        raise ConfigError(f"{where}: importing {path!r} failed: {type(e).__name__}: {e}"
                          f"{_raised_at(e, folder if local else None)}") from e


def _raised_at(error: BaseException, folder: Path | None) -> str:
    """`` (at FILE line N)``: the innermost line of ``error``'s traceback in the user's code: the files under
    ``folder`` (None: any file but distgrad's and Python's import machinery); nothing when there is none
    (the call itself failed: a wrong keyword argument says so). A syntax error names its file and line itself."""
    if isinstance(error, SyntaxError):
        return ""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if (Path(frame.filename).resolve().is_relative_to(folder) if folder is not None
                  else not frame.filename.startswith("<") and Path(frame.filename).resolve() != Path(__file__).resolve())]
    return f" (at {frames[-1].filename} line {frames[-1].lineno})" if frames else ""


def build_module(spec: StageSpec, seed: int, overrides: Mapping[str, float] | None = None) -> nn.Module:
    """The ``torch.nn.Module`` a stage's ``module = "pkg.mod:factory"`` makes, on the CPU, float32, with the
    ``overrides`` (``--init``) that name its parameters applied.

    The factory is called with ``module_args`` as keyword arguments after
    ``torch.manual_seed(spec.init_seed(seed))`` (inside ``torch.random.fork_rng``:
    the caller's random state is left as it was), so every process draws the
    same initial values. Raises ``ConfigError`` naming the module path for an
    import that fails, a missing or uncallable factory, a factory that raises
    or returns something other than a module, or parameters other than float32
    (the file and line of the user's code that raised, when it did).
    """
    assert spec.module is not None, f"stage {spec.name} has no module"
    path, function = spec.module.split(":")
    where = f"stage {spec.name!r} (module {spec.module!r})"
    imported = _import_module(path, spec.base_dir, where)
    folder = spec.base_dir.resolve()         # the user's code, when the module was found there
    factory = getattr(imported, function, None)
    if not callable(factory):
        public = sorted(n for n, v in vars(imported).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(f"{where}: {path} ({getattr(imported, '__file__', '?')}) has no function {function!r}"
                          f"{'' if factory is None else ' (it is not callable)'}; its callables: {', '.join(public) or 'none'}")
    local = _inside(imported, folder)
    with torch.random.fork_rng(devices=[]), _stage_folder(folder) if local else contextlib.nullcontext():
        torch.manual_seed(spec.init_seed(seed))
        try:
            module = factory(**spec.module_args)      # its imports find its folder's files too
        except Exception as e:       # the user's factory raised anything
            raise ConfigError(f"{where}: {function}(**{spec.module_args!r}) raised {type(e).__name__}: {e}"
                              f"{_raised_at(e, folder if local else None)}") from e
    if not isinstance(module, nn.Module):
        raise ConfigError(f"{where}: {function} returned {type(module).__name__}, not a torch.nn.Module: return the "
                          f"model itself (e.g. torch.nn.Sequential(...))")
    for name, p in module.named_parameters():
        if p.dtype != torch.float32:
            raise ConfigError(f"{where}: parameter {name} is {p.dtype}; a torch stage computes in float32 (build "
                              f"the module with the default dtype, or return module.float())")
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in (overrides or {}).items():
            if name in params:
                params[name].fill_(value)
    return module


def module_param_names(exp: Experiment, name: str, seed: int, module: nn.Module | None = None) -> list[str]:
    """The parameter names of module stage ``name`` (``named_parameters``, by building its module unless
    given), and a vertical label owner's own ``bottom``'s (distgrad's names: ``own1.W``)."""
    spec = exp.spec(name)
    module = build_module(spec, seed) if module is None else module
    bottom = list(build_model(spec.bottom, spec.init_seed(seed)).params) if spec.bottom is not None else []
    return [n for n, _ in module.named_parameters()] + bottom


def _with_own_bottom(exp: Experiment, name: str, seed: int, init: Mapping[str, float], module: nn.Module,
                     params: list[_Param]) -> tuple[nn.Module, list[_Param]]:
    """A module stage of a vertical label owner with its own ``bottom`` (numpy layer tables, built in torch
    from the numpy build's values for ``seed`` and ``init``): ``OwnBottomModule`` over ``module``, and the
    parameters, the bottom's under distgrad's names (``own1.W``) first, then the module's as they were."""
    model = exp.bottom_layer(name, seed)
    for key, value in init.items():
        if key in model.bottom.params:
            model.bottom.params[key][...] = value
    joined, names = _torch_bottom(model, module)
    return joined, [_Param(dg_name, joined.get_parameter(attr), transposed)
                    for dg_name, attr, transposed in names] + params


class TorchStage(Stage):
    """A stage whose model is a ``torch.nn.Module`` updated by a ``torch.optim.Optimizer``.

    Same contract as ``Stage``: numpy float32 in and out, ``params`` maps
    names to live numpy views of the parameters, ``backward`` returns numpy
    gradients keyed like ``params`` (``engine.GradAccumulator`` sums
    micro-batches), ``apply`` makes one optimizer step. ``loss`` is the
    distgrad ``Loss`` whose definition the torch loss computes (its
    reduction decides how micro-batches combine); None except on the last
    stage. ``device`` is where it computes (default: where the parameters
    are); the module's buffers (``buffers``) are checkpointed with the
    parameters. Build one with ``from_experiment``, ``from_spec`` or
    ``from_module``.

    ``schedule`` (set by ``from_experiment``, and by ``from_spec`` for an
    optimizer table with a ``schedule``; None otherwise): the float32
    learning rate of update ``updates + 1``, set on every param group before
    each ``optimizer.step()``. ``updates`` counts the applied updates and is
    checkpointed as ``opt/updates``. ``scheduler`` (a stage's ``scheduler``
    table, ``stage_scheduler``; None otherwise): a ``torch.optim.lr_scheduler``
    stepped once after each ``optimizer.step()``, checkpointed with the param
    groups as JSON (``opt/scheduler``); a stage has a schedule or a scheduler,
    never both.
    """

    schedule: Schedule | None = None
    scheduler: Any = None           # a torch.optim.lr_scheduler.LRScheduler
    updates = 0
    applied_lr: float | None = None  # the rate of the latest update this process applied (learning_rate)

    def __init__(self, name: str, module: nn.Module, optimizer: torch.optim.Optimizer, loss: Loss | None,
                 input_shape: Shape, params: Sequence[_Param], device: torch.device | None = None) -> None:
        # Stage.__init__ is not called: it builds around a numpy Sequential. The bookkeeping every
        # stage holds (shapes, step) comes from Stage._setup.
        self.name, self.module, self.optimizer, self.loss = name, module, optimizer, loss
        self._params = list(params)
        self.device = device or (self._params[0].tensor.device if self._params else CPU)
        for p in self._params:
            if p.tensor.dtype != torch.float32 or p.tensor.device != self.device:
                raise ConfigError(f"stage {name}: parameter {p.name} is {p.tensor.dtype} on {p.tensor.device}; "
                                  f"a torch stage computes in float32, all on one device ({self.device})")
        # Buffers that the module's state_dict holds (batch norm's running statistics): part of the state.
        persistent = set(module.state_dict(keep_vars=True))
        self.buffers = {n: b for n, b in module.named_buffers() if n in persistent}
        known = {id(p.tensor) for p in self._params}
        self._opt_params = [t for group in optimizer.param_groups for t in group["params"]]
        if any(id(t) not in known for t in self._opt_params):
            raise ConfigError(f"stage {name}: the optimizer updates a tensor that is not a parameter of the module")
        self._trainable = [p for p in self._params if p.tensor.requires_grad]
        self._by_name = {p.name: p for p in self._params}
        self._module_names = {id(t): n for n, t in module.named_parameters()}    # for ``functional_call``
        self._loss_fn = _torch_loss(loss, self.device, name) if loss is not None else None
        self.input_shape = tuple(input_shape)        # the probe below needs it
        self._setup(name, optimizer, loss, input_shape, self._probe_output_shape())
        if self._loss_fn is not None:
            self._probe_loss()

    @classmethod
    def from_experiment(cls, exp: Experiment, name: str, seed: int | None = None,
                        init: Mapping[str, float] | None = None) -> "TorchStage":
        """Stage ``name`` of ``exp`` built in torch, starting from the numpy build's values for ``seed`` and ``init``.

        Raises ``ConfigError`` on a bad name or override, as ``Stage.from_experiment`` does.
        """
        seed = exp.seed if seed is None else seed
        model, optimizer, loss = build_stage_parts(exp, name, seed, init or {})
        device = torch_device(exp.spec(name).device, name)
        modules, params = [], []
        for layer in model.layers:
            module, names = _torch_layer(layer)
            module.to(device)
            params += [_Param(dg_name, module.get_parameter(attr), transposed) for dg_name, attr, transposed in names]
            modules.append(module)
        stage = cls(name, nn.Sequential(*modules), _torch_optimizer(optimizer, [p.tensor for p in params]), loss,
                    exp.input_shape(name, seed), params, device)
        stage.scheduler = stage_scheduler(exp.spec(name).scheduler, stage.optimizer, name)
        stage.schedule = optimizer.schedule if stage.scheduler is None else None
        return stage

    @classmethod
    def from_spec(cls, exp: Experiment, name: str, seed: int | None = None,
                  init: Mapping[str, float] | None = None) -> "TorchStage":
        """Module stage ``name`` of ``exp`` (``module = "pkg.mod:factory"``): the module (``build_module``)
        on the stage's device, its optimizer and schedule (``module_optimizer``), its scheduler
        (``stage_scheduler``) and, on the last stage, its loss.

        ``init`` may name the module's parameters and any other stage's.
        Raises ``ConfigError`` as ``build_module`` does, and for an unknown
        ``init`` name, optimizer or loss, or a module that does not take the
        stage's input.
        """
        seed = exp.seed if seed is None else seed
        spec = exp.spec(name)
        init = dict(init or {})
        device = torch_device(spec.device, name)
        module = build_module(spec, seed, init)
        others = set(init) - set(module_param_names(exp, name, seed, module)) - exp.all_param_names(seed)
        if others:     # names neither this module nor a layer-list stage has: another module's, or a typo
            check_init_overrides(exp, {k: init[k] for k in others})
        params = [_Param(n, p) for n, p in module.named_parameters()]
        if spec.bottom is not None:
            module, params = _with_own_bottom(exp, name, seed, init, module, params)
        module.to(device)
        optimizer, schedule = module_optimizer(spec.optimizer, [p.tensor for p in params if p.tensor.requires_grad],
                                               name)
        loss = stage_loss(spec) if name == exp.stage_names[-1] else None
        stage = cls(name, module, optimizer, loss, exp.input_shape(name, seed), params, device)
        stage.schedule = schedule
        stage.scheduler = stage_scheduler(spec.scheduler, optimizer, name)
        return stage

    @classmethod
    def from_module(cls, name: str, module: nn.Module, optimizer: torch.optim.Optimizer,
                    input_shape: Shape, loss: str | None = None) -> "TorchStage":
        """A stage from your own float32 ``module`` (on one device) and an ``optimizer`` over its parameters.

        ``input_shape`` is the per-step shape of what the stage receives (the
        output shape is found by one forward pass of zeros, in eval mode and
        without gradients). ``loss`` names the last stage's loss as an
        experiment does (``"softmax_cross_entropy"``, ...); None for other
        stages. Raises ``ConfigError`` for another dtype or parameters on
        several devices, for an optimizer over tensors the module does not
        own, an unknown loss, or a module that does not take ``input_shape``.
        """
        params = [_Param(n, p) for n, p in module.named_parameters()]
        return cls(name, module, optimizer, build_loss(loss) if loss is not None else None, input_shape, params)

    def _probe_output_shape(self) -> Shape:
        training = self.module.training
        self.module.eval()                  # no running statistics updated by the probe
        try:
            with torch.no_grad():
                out = self.module(torch.zeros(self.input_shape, dtype=torch.float32, device=self.device))
        except _COMPUTE_ERRORS as e:
            raise ConfigError(f"stage {self.name}: the module does not take input of shape {self.input_shape}: {e}") from e
        finally:
            self.module.train(training)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
            raise ConfigError(f"stage {self.name}: the module returns "
                              f"{out.dtype if isinstance(out, torch.Tensor) else type(out).__name__}; a stage's "
                              f"output is one float32 tensor")
        return tuple(out.shape)

    def _probe_loss(self) -> None:
        """Compute the loss once, on zeros of the output's shape against zero targets (class 0): options torch
        takes when the loss is made but not with this output (a class ``weight`` of another length,
        ``label_smoothing`` above 1) are a ``ConfigError`` when the stage is built, not a failure at step 1."""
        assert self.loss is not None and self._loss_fn is not None
        dtype = torch.from_numpy(np.empty(0, self.loss.target_dtype)).dtype
        try:
            target_shape = tuple(self.loss.target_shape(tuple(self.output_shape)))
            with torch.no_grad():
                self._loss_fn(torch.zeros(self.output_shape, dtype=torch.float32, device=self.device),
                              torch.zeros(target_shape, dtype=dtype, device=self.device))
        except _COMPUTE_ERRORS as e:
            raise ConfigError(f"stage {self.name}: its loss cannot be computed on its output of shape "
                              f"{tuple(self.output_shape)}: {e}") from e

    @property
    def params(self) -> dict[str, np.ndarray]:
        return {p.name: p.view(p.tensor) for p in self._params}

    @contextlib.contextmanager
    def _forward_mode(self, mb: int, training: bool) -> Iterator[None]:
        """In training, torch's RNG seeded from (seed, stage name, step in progress, ``mb``), so dropout draws
        the same masks in any process and after a resume; otherwise eval mode, the module's mode restored after."""
        if training:
            key = [self.seed, zlib.crc32(self.name.encode()), self.step + 1, mb]
            torch.manual_seed(int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0]))
            yield
            return
        was_training = self.module.training
        self.module.eval()
        try:
            yield
        finally:
            self.module.train(was_training)

    def _graph(self, x: np.ndarray, mb: int = 0, training: bool = True, own_copy: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The input as a leaf that can take a gradient, the module's output with its graph, and the tensors
        standing for the trainable parameters in that graph (in ``_trainable``'s order).

        ``own_copy``: the forward computes with a copy of the trainable parameters
        (``torch.func.functional_call``), so that its graph stays valid when the
        optimizer updates the parameters in place before its backward (steps in
        flight); the same values, so the same output bits.
        """
        x_t = _tensor(x, device=self.device).requires_grad_()
        with torch.enable_grad(), self._forward_mode(mb, training):
            if not own_copy:
                return x_t, self.module(x_t), [p.tensor for p in self._trainable]
            copies = {self._module_names[id(p.tensor)]: p.tensor.detach().clone().requires_grad_()
                      for p in self._trainable}
            out = torch.func.functional_call(self.module, copies, (x_t,))
            return x_t, out, list(copies.values())

    def _gradients(self, out: torch.Tensor, d_out: torch.Tensor | None, x_t: torch.Tensor,
                   leaves: list[torch.Tensor], need_dx: bool) -> tuple[np.ndarray | None, Grads]:
        """Back-propagate ``d_out`` from ``out`` (a scalar loss when None) once, to ``leaves`` (the trainable
        parameters' tensors in the graph) and ``x_t``; the graph is freed.

        Only what is asked for is computed (torch prunes the product for d(input)
        when ``need_dx`` is false). A parameter the output does not depend on
        gets no gradient, as in torch.
        """
        wanted = leaves + ([x_t] if need_dx else [])
        if not wanted:          # a first stage with nothing to train: no gradient to compute
            return None, {}
        found = torch.autograd.grad(out, wanted, grad_outputs=d_out, allow_unused=True)
        grads = {p.name: p.view(g) for p, g in zip(self._trainable, found) if g is not None}
        if not need_dx:
            return None, grads
        dx = found[-1]
        return (_host(dx) if dx is not None else np.zeros(x_t.shape, np.float32)), grads   # None: output ignores x

    def forward(self, x: np.ndarray, mb: int = 0, training: bool = True) -> tuple[np.ndarray, Any]:
        """Activations for ``x`` (float32 numpy), micro-batch ``mb`` of the step in progress, and the cache
        ``backward`` needs (the graph); ``training`` False runs the module in eval mode.

        A training forward computes with its own copy of the trainable parameters,
        so its cache stays valid after later updates: with steps in flight
        (staleness) its backward, after updates, gives the gradients at the
        parameters this forward used, as a numpy stage's does.
        """
        try:
            x_t, y_t, leaves = self._graph(x, mb, training, own_copy=training)
        except _COMPUTE_ERRORS as e:
            raise StageError(f"stage {self.name}: forward failed at step {self.step + 1}: {e}") from e
        y = _host(y_t)
        return y, self.with_objective(x, y, (x_t, y_t, leaves), training)

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        """d(loss)/d(input) (None unless ``need_dx``) and the parameter gradients, from d(loss)/d(output).

        Each cache is used once: its graph is freed.
        """
        cache, dy = self.own_objective(cache, dy)
        x_t, y_t, leaves = cache
        try:
            return self._gradients(y_t, _tensor(dy, device=self.device), x_t, leaves, need_dx)
        except _COMPUTE_ERRORS as e:
            raise StageError(f"stage {self.name}: backward failed at step {self.step + 1}: {e}") from e

    def backward_deferred(self, cache: Any, dy: np.ndarray) -> tuple[np.ndarray, Callable[[], Grads]]:
        """Everything at once: autograd computes the input and parameter gradients in one pass."""
        dx, grads = self.backward(cache, dy)
        assert dx is not None
        return dx, lambda: grads

    def loss_micro_batch_deferred(self, x: np.ndarray, target: np.ndarray, mb: int = 0
                                  ) -> tuple[np.float32, np.ndarray, Callable[[], Grads]]:
        loss, dx, grads = self.loss_micro_batch(x, target, mb)
        return loss, dx, lambda: grads

    def per_example_grads(self, x: np.ndarray, dy: np.ndarray, mb: int) -> list[Grads]:
        """Each row's contribution to the parameter gradients of micro-batch ``mb`` of input ``x`` given
        d(loss)/d(output) ``dy``: the gradient of ``sum(module(x[i:i+1]) * dy[i:i+1])`` for each trainable
        parameter (distgrad's names and layouts, float32), row i forwarded alone, as ``Stage.per_example_grads``.

        Computed by ``torch.func``: ``grad`` of that sum through ``functional_call``, mapped over the rows by
        ``vmap`` (one batched pass, the same values as a loop of single-row backward passes to float32
        rounding). A parameter the output ignores gets zeros. Raises ``StageError`` when the module cannot be
        mapped over single rows (a random draw, an in-place buffer update or a branch on a tensor's value in
        its forward; ``build_stage`` refuses batch norm and dropout modules before that).
        """
        names = [self._module_names[id(p.tensor)] for p in self._trainable]
        values = {name: p.tensor.detach() for name, p in zip(names, self._trainable)}

        def contribution(params: dict[str, torch.Tensor], row: torch.Tensor, d_row: torch.Tensor) -> torch.Tensor:
            out = torch.func.functional_call(self.module, params, (row.unsqueeze(0),))
            return (out * d_row.unsqueeze(0)).sum()

        try:
            x_t, dy_t = _tensor(x, device=self.device), _tensor(dy, device=self.device)
            with self._forward_mode(mb, training=True):
                found = torch.func.vmap(torch.func.grad(contribution), in_dims=(None, 0, 0))(values, x_t, dy_t)
        except _COMPUTE_ERRORS as e:
            raise StageError(f"stage {self.name}: dp_sgd's per-example gradients failed at step {self.step + 1}: "
                             f"torch.func cannot map the module over single rows ({e}); a forward that draws "
                             f"random numbers, updates buffers in place or branches on tensor values (.item(), "
                             f"if on a tensor) has no per-example gradient here") from e
        return [{p.name: p.view(found[name][i]) for name, p in zip(names, self._trainable)} for i in range(len(x))]

    def _loss_value(self, y_t: torch.Tensor, target: np.ndarray) -> torch.Tensor:
        assert self.loss is not None and self._loss_fn is not None, f"stage {self.name} has no loss"
        return self._loss_fn(y_t, _tensor(target, self.loss.target_dtype, self.device))

    def _training_loss_value(self, y_t: torch.Tensor, target: np.ndarray) -> torch.Tensor:
        """A training micro-batch's loss: the stage's own, or under ``label_dp`` its training loss
        (``privacy.labeldp``: -log sum_c w[i, c] softmax(y)[i, c], the flip-rate-aware weights or one-hot on the
        randomized label; rows whose labels are not released count zero), reduced as the stage's loss."""
        if self.label_dp is None:
            return self._loss_value(y_t, target)
        assert self.loss is not None, f"stage {self.name} has no loss"
        batch = self.label_dp.labels(target, _host(y_t.detach()), self.step)
        weights = _tensor(self.label_dp.weights(batch, y_t.shape[1]), device=self.device)
        losses = -torch.logsumexp(nn.functional.log_softmax(y_t, dim=1) + torch.log(weights), dim=1)
        if batch.active is not None:
            losses = torch.where(_tensor(batch.active, np.bool_, self.device), losses, torch.zeros_like(losses))
        return losses.sum() if self.loss.reduction == "sum" else losses.sum() / len(losses)

    def loss_backward(self, y: np.ndarray, target: np.ndarray) -> tuple[np.float32, np.ndarray]:
        """Loss value and d(loss)/d(y), computed by torch; last stage only."""
        try:
            y_t = _tensor(y, device=self.device).requires_grad_()
            with torch.enable_grad():
                loss_t = self._loss_value(y_t, target)
            (dy,) = torch.autograd.grad(loss_t, [y_t])
        except _COMPUTE_ERRORS as e:
            raise StageError(f"stage {self.name}: loss failed at step {self.step + 1}: {e}") from e
        return np.float32(loss_t.item()), _host(dy)

    def loss_micro_batch(self, x: np.ndarray, target: np.ndarray, mb: int = 0) -> tuple[np.float32, np.ndarray, Grads]:
        """Forward, loss and backward of micro-batch ``mb`` on the last stage, in one torch graph, without an update.

        Under DP-SGD (``private_update``) the parameter gradients are its, from the input and d(loss)/d(output),
        for the parameters the exact backward reaches (a parameter the output ignores stays without a gradient).
        """
        try:
            x_t, y_t, leaves = self._graph(x, mb)
            with torch.enable_grad():
                loss_t = self._training_loss_value(y_t, target)
            dy_t = None
            if self.private_update is None:
                dx, grads = self._gradients(loss_t, None, x_t, leaves, True)
            else:
                (dy_t,) = torch.autograd.grad(loss_t, [y_t], retain_graph=True)
                dx, grads = self._gradients(y_t, dy_t, x_t, leaves, True)
        except _COMPUTE_ERRORS as e:
            raise StageError(f"stage {self.name}: loss failed at step {self.step + 1}: {e}") from e
        if self.private_update is not None and dy_t is not None:
            private = self.private_update(x, _host(dy_t), mb)
            grads = {name: value for name, value in private.items() if name in grads}
        assert dx is not None
        return np.float32(loss_t.item()), dx, grads

    def evaluate_last(self, x: np.ndarray, target: np.ndarray, metrics: Sequence[str] = ()) -> dict[str, Any]:
        """Forward only, in eval mode, without a graph: ``{"loss", "correct" (None unless classifying), "count"}``
        and ``"metrics"`` (``Stage.evaluate_last``)."""
        assert self.loss is not None, f"stage {self.name} has no loss"
        try:
            with torch.no_grad(), self._forward_mode(0, training=False):
                y_t = self.module(_tensor(x, device=self.device))
                loss_t = self._loss_value(y_t, target)
        except _COMPUTE_ERRORS as e:
            raise StageError(f"stage {self.name}: evaluation failed after step {self.step}: {e}") from e
        y = _host(y_t)
        return {"loss": float(loss_t), "correct": self.loss.correct(y, target), "count": int(len(x)),
                **({"metrics": score(metrics, y, target)} if metrics else {})}

    def apply(self, grads: Grads) -> None:
        """One optimizer step from numpy ``grads`` keyed like ``params`` (then one scheduler step); counts the step.

        A parameter without a gradient is left alone (torch's rule for ``grad is None``).
        """
        for name, g in grads.items():
            p = self._by_name[name]
            p.tensor.grad = p.from_numpy(g)
        self.updates += 1
        if self.schedule is not None:
            lr = float(self.schedule(self.updates))     # a float32 value, exact as a Python float
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.applied_lr = float(self.optimizer.param_groups[0]["lr"])
        try:
            self.optimizer.step()
            if self.scheduler is not None and not is_plateau(self.scheduler):
                self.scheduler.step()
        except Exception as e:      # torch's optimizers and schedulers raise many kinds
            raise StageError(f"stage {self.name}: update {self.updates} failed: {type(e).__name__}: {e}") from e
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    def evaluated(self, loss: float) -> None:
        """An evaluation's ``loss`` (the validation rows' with a validation split) after this stage's latest
        update, before its next: a ``ReduceLROnPlateau`` scheduler steps on it; nothing else changes."""
        if is_plateau(self.scheduler):
            self.scheduler.step(float(loss))

    @property
    def plateau(self) -> bool:
        """Whether this stage's rate follows the loss of each evaluation (``ReduceLROnPlateau``)."""
        return is_plateau(self.scheduler)

    def learning_rate(self) -> float:
        """The learning rate of the latest update this process applied (its first param group's, before a
        ``scheduler`` steps it); before any: the rate the next update uses."""
        if self.applied_lr is not None:
            return self.applied_lr
        if self.schedule is not None:
            return float(self.schedule(self.updates + 1))
        return float(self.optimizer.param_groups[0]["lr"])

    def set_params(self, values: Mapping[str, np.ndarray]) -> None:
        """Set every parameter, in place on its device, to ``values[name]`` (distgrad's layout, as ``params``)."""
        with torch.no_grad():
            for p in self._params:
                p.tensor.copy_(p.from_numpy(np.asarray(values[p.name], np.float32)))

    def batch_mixing(self) -> str | None:
        """The module's batch norms (``batch_norms``), which normalise each row of a training batch by the
        batch's statistics, so one row's target reaches every row's gradient; None without one."""
        norms = batch_norms(self.module)
        return (f"batch norm normalises each row by the batch's statistics, so one label reaches every row's "
                f"gradient: {norms}") if norms else None

    def forward_state(self) -> dict[str, np.ndarray]:
        """Copies of the module's buffers in host memory (a training forward updates batch norm's)."""
        return {name: _host(b).copy() for name, b in self.buffers.items()}

    def restore_forward_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Set the buffers to ``state`` (what ``forward_state`` returned)."""
        with torch.no_grad():
            for name, value in state.items():
                self.buffers[name].copy_(torch.from_numpy(np.array(value)))

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Parameters (``param/NAME``, distgrad layout), buffers (``buffer/NAME``, their own dtype) and
        optimizer state (``opt/KEY/NAME``, torch's layout), in host memory."""
        arrays = {f"param/{name}": value for name, value in self.params.items()}
        arrays[_UPDATES] = np.array(self.updates, np.int64)
        if self.scheduler is not None:
            arrays[_SCHEDULER] = _scheduler_state(self.scheduler, self.optimizer)
        arrays.update({f"buffer/{name}": value for name, value in self.forward_state().items()})
        names = {id(p.tensor): p.name for p in self._params}
        for tensor, state in self.optimizer.state.items():
            for key, value in state.items():
                if value is not None:
                    arrays[f"opt/{key}/{names[id(tensor)]}"] = _host(torch.as_tensor(value)).copy()
        return {**arrays, **self.label_state()}

    def _saved_buffers(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The buffers in checkpoint ``arrays``; ``ValueError`` unless they are this module's, alike in shape and dtype."""
        saved = {k.split("/", 1)[1]: np.asarray(v) for k, v in arrays.items() if k.startswith("buffer/")}
        if set(saved) != set(self.buffers):
            raise ValueError(f"stage {self.name}: checkpoint has buffers {sorted(saved)}, the module has "
                             f"{sorted(self.buffers)}")
        for name, value in saved.items():
            ours = self.buffers[name]
            if tuple(value.shape) != tuple(ours.shape) or torch.from_numpy(np.empty(0, value.dtype)).dtype != ours.dtype:
                raise ValueError(f"stage {self.name}: checkpoint buffer {name} is {value.dtype} {value.shape}, the "
                                 f"module's {ours.dtype} {tuple(ours.shape)}")
        return saved

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray], step: int) -> None:
        """Restore what ``state_arrays`` returned, at ``step``; raises ``ValueError`` on a mismatch."""
        names = self._saved_param_names(arrays)
        buffers = self._saved_buffers(arrays)
        current = self.params
        for name in names:
            saved = np.asarray(arrays[f"param/{name}"], np.float32)
            if saved.shape != current[name].shape:
                raise ValueError(f"stage {self.name}: checkpoint {name} has shape {saved.shape}, "
                                 f"model {current[name].shape}")
        index = {id(t): i for i, t in enumerate(self._opt_params)}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in arrays.items():
            parts = key.split("/", 2)
            if parts[0] != "opt" or key in (_UPDATES, _SCHEDULER):
                continue
            p = self._by_name.get(parts[-1]) if len(parts) == 3 else None
            if p is None or id(p.tensor) not in index:
                raise ValueError(f"stage {self.name}: checkpoint has optimizer state {key!r} for no parameter "
                                 f"the optimizer updates")
            state.setdefault(index[id(p.tensor)], {})[parts[1]] = torch.from_numpy(np.array(value))
        groups = self._saved_scheduler(arrays)      # checked before anything of the stage changes
        with torch.no_grad():
            for name in names:
                p = self._by_name[name]
                p.tensor.copy_(p.from_numpy(np.array(arrays[f"param/{name}"], np.float32)))
        self.restore_forward_state(buffers)
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        self.load_label_state(arrays)
        self.step = step
        # As Stage.load_state_arrays: a checkpoint from before schedules counts its step as its updates.
        self.updates = int(arrays[_UPDATES]) if _UPDATES in arrays else step

    def _saved_scheduler(self, arrays: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
        """With a scheduler: restore its state from checkpoint ``arrays`` and return the saved param groups
        (the rate, and momentum, it set); else the optimizer's own. ``ValueError`` when the checkpoint has
        scheduler state and the stage no scheduler, or the reverse, or the state does not fit."""
        current = self.optimizer.state_dict()["param_groups"]
        if (_SCHEDULER in arrays) != (self.scheduler is not None):
            raise ValueError(f"stage {self.name}: the checkpoint {'has' if _SCHEDULER in arrays else 'has no'} "
                             f"learning-rate scheduler state, the stage {'has' if self.scheduler else 'has no'} "
                             f"scheduler")
        if self.scheduler is None:
            return current
        try:
            saved = json.loads(np.asarray(arrays[_SCHEDULER], np.uint8).tobytes().decode())
            groups = saved["param_groups"]
            if len(groups) != len(current) or any(set(g) != set(c) for g, c in zip(groups, current)):
                raise ValueError("its param groups differ from the optimizer's")
            state = saved["scheduler"]
            if is_plateau(self.scheduler):
                state = {k: float(v) if k in _PLATEAU_FLOATS else v for k, v in state.items()}   # "inf" as text
            self.scheduler.load_state_dict(state)
        except (ValueError, KeyError, TypeError) as e:   # JSON and Unicode errors are ValueErrors
            raise ValueError(f"stage {self.name}: the checkpoint's scheduler state does not fit: {e}") from e
        # JSON has lists where torch keeps tuples (Adam's betas)
        return [{k: tuple(v) if isinstance(c[k], tuple) else v for k, v in g.items()} for g, c in zip(groups, current)]

    parameters_suffix = ".pt"      # what ``save_parameters`` writes: a torch ``state_dict``

    def save_parameters(self, path: str | Path) -> Path:
        """The module's ``state_dict`` (parameters and buffers, on the CPU) via ``torch.save``, atomically."""
        state = {key: value.detach().cpu() for key, value in self.module.state_dict().items()}
        return write_atomic(path, lambda f: torch.save(state, f))

    def load_parameters(self, path: str | Path) -> None:
        """A ``state_dict`` file (``read_state_dict``); ``ConfigError`` naming the file when it cannot be
        read, and the entry when it does not fit the module exactly (names, shapes, dtypes: nothing is cast)."""
        state = read_state_dict(path)
        ours = self.module.state_dict()
        check_saved_parameters(self.name, path, state, {k: tuple(v.shape) for k, v in ours.items()})
        for key, value in state.items():
            if value.dtype != ours[key].dtype:
                raise member_error("--load", path, key, f"is {value.dtype}, stage {self.name}'s is "
                                                        f"{ours[key].dtype} (values are never cast)")
        with torch.no_grad():
            self.module.load_state_dict(state, strict=True)


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a torch stage's ``--load`` file, read with ``weights_only=True`` (tensors only, never
    arbitrary objects); ``ConfigError`` naming the file when it cannot be read or is not a ``state_dict``
    of real-valued tensors, and the entry when one is complex or holds values that are not finite."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:      # torch raises many kinds for a missing, truncated or foreign file
        raise ConfigError(f"--load {path}: cannot read a torch state_dict: {e}") from e
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"--load {path}: not a state_dict of tensors")
    for key, value in state.items():
        if value.is_complex():
            raise member_error("--load", path, key, f"is {value.dtype}: parameters are real")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise member_error("--load", path, key, "holds values that are not finite (Inf or NaN)")
    return dict(state)


def batch_norms(module: nn.Module) -> str:
    """The submodules of ``module`` that normalise each row by its batch's statistics in a training forward,
    each named with its type ("" for none)."""
    return ", ".join(f"{name or 'the module'} ({type(m).__name__})" for name, m in module.named_modules()
                     if isinstance(m, nn.modules.batchnorm._BatchNorm))


def per_example_refusal(module: nn.Module) -> str | None:
    """Why ``module`` has no per-example parameter gradients for DP-SGD (None: it has them): the submodules
    that mix the rows of a batch or draw at random in a training forward, each named with its type."""
    def named(kind: Callable[[nn.Module], bool]) -> str:
        return ", ".join(f"{name or 'the module'} ({type(m).__name__})" for name, m in module.named_modules()
                         if kind(m))
    mixing = named(lambda m: isinstance(m, nn.modules.batchnorm._BatchNorm) or (
        isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats))
    if mixing:
        return (f"batch norm normalises each row by the batch's statistics, and a norm with running statistics "
                f"updates them in its forward, so no example's gradient exists alone: {mixing}")
    drawing = named(lambda m: isinstance(m, nn.modules.dropout._DropoutNd))
    if drawing:
        return f"dropout draws one mask for the batch, and each example's gradient would need its own: {drawing}"
    return None


def build_stage(exp: Experiment, name: str, seed: int | None = None,
                init: Mapping[str, float] | None = None) -> TorchStage:
    """The builder ``Stage.from_experiment`` calls for a stage with ``framework = "torch"``: a layer list
    built in torch, or a ``module`` stage (``TorchStage.from_spec``), checked against the interface
    (``stage.check_cut``: ``ConfigError`` naming both shapes when its output is not the declared cut)."""
    seed = exp.seed if seed is None else seed
    spec = exp.spec(name)
    averaged = exp.clients.mode == "splitfed" and name == exp.stage_names[0]
    if averaged and (spec.module is not None or spec.device != "cpu"):
        # averaging writes the mean through the numpy views of ``params``, which a GPU stage has not
        raise ConfigError(f"stage {name!r}: SplitFed averaging takes a layer-list stage on the CPU; "
                          f"{'a module stage' if spec.module is not None else 'device ' + repr(spec.device)} "
                          f"is not supported there yet")
    if spec.module is None:
        stage = TorchStage.from_experiment(exp, name, seed, init)
    else:
        stage = TorchStage.from_spec(exp, name, seed, init)
        check_cut(exp, stage, seed)
    refusal = per_example_refusal(stage.module) if spec.defenses.dp_sgd is not None else None
    if refusal is not None:
        raise ConfigError(f"stage {name!r}: 'dp_sgd' needs each example's parameter gradient, forwarded alone "
                          f"(torch.func): {refusal}; remove them or dp_sgd")
    clip = spec.defenses.clip_noise
    mixing = stage.batch_mixing()
    if mixing and clip is not None and clip.epsilon is not None and label_owner_sends_gradients(exp, name):
        raise ConfigError(f"stage {name!r}: 'clip_noise' with a target epsilon is a label-DP budget, which needs "
                          f"each label to reach only its own gradient row; here {mixing}: give clip_noise a "
                          f"sigma (its summary then states no guarantee), or remove the batch norm")
    stage.allow_nonfinite = exp.allow_nonfinite
    return stage
