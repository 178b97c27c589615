"""A torch stage's optimizer and learning-rate scheduler, made from a stage's tables and checked when the stage
is built (an option torch would take and ignore, or fail on at the first update, is a ``ConfigError`` naming
the stage): ``module_optimizer``, ``stage_scheduler``, and the scheduler's state as JSON for checkpoints.

Part of ``distgrad.stage.torch_stage``; ``check_keyword_options`` is also the check of a ``torch.nn`` loss's table.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from distgrad.errors import ConfigError
from distgrad.jsontext import finite_or_text, json_text
from distgrad.model.optim import OPTIMIZERS, SGD, Adam, Optimizer, build_optimizer
from distgrad.model.schedules import PLATEAU, Schedule, optimizer_schedule


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


def _optimizer_class(kind: Any) -> tuple[str, type[torch.optim.Optimizer]]:
    """The ``torch.optim`` class an optimizer table's ``type`` names, with its name as torch spells it;
    ``ConfigError`` for an optimizer that steps through a closure, or a name that is no ``torch.optim`` class."""
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
    return kind, cls


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
        kind, cls = _optimizer_class(kind)
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
