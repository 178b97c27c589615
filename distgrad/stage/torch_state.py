"""What a torch stage holds between steps and how its checkpoints hold it: ``TorchState``, the base of
``TorchStage``, owns the parameters (in distgrad's names and layouts), the module's buffers, the optimizer's
state, the update count and the learning-rate schedule or scheduler; ``read_state_dict`` reads a ``--load`` file.

Part of ``distgrad.stage.torch_stage``. A checkpoint is numpy arrays (never a pickle): ``param/NAME``,
``buffer/NAME``, ``opt/KEY/NAME``, ``opt/updates`` and the scheduler's JSON text as ``opt/scheduler``, so a
resume is bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from distgrad.config.npzfile import member_error
from distgrad.errors import ConfigError
from distgrad.model.schedules import Schedule
from distgrad.stage.records import write_atomic
from distgrad.stage.stage import Stage, check_saved_parameters
from distgrad.stage.torch_optim import _scheduler_state, is_plateau
from distgrad.stage.torch_tensors import _host, _Param

_UPDATES = "opt/updates"     # the checkpoint array of the update count (as a numpy stage's optimizer writes it)
_PLATEAU_FLOATS = ("best", "mode_worse")      # ReduceLROnPlateau's state floats that may be infinite
_SCHEDULER = "opt/scheduler"    # the checkpoint array of the scheduler's state: JSON text as uint8


class TorchState(Stage):
    """The state of a torch stage: its parameters, buffers, optimizer state, update count and rate schedule,
    read and set in distgrad's names and layouts, and written to and restored from checkpoint arrays.

    ``params`` maps names to live numpy views of the parameters (host copies
    on a GPU); the module's buffers (``buffers``) are checkpointed with them.
    ``schedule`` (set by ``from_experiment``, and by ``from_spec`` for an
    optimizer table with a ``schedule``; None otherwise): the float32
    learning rate of update ``updates + 1``, set on every param group before
    each ``optimizer.step()``. ``updates`` counts the applied updates and is
    checkpointed as ``opt/updates``. ``scheduler`` (a stage's ``scheduler``
    table, ``stage_scheduler``; None otherwise): a ``torch.optim.lr_scheduler``
    stepped once after each ``optimizer.step()``, checkpointed with the param
    groups as JSON (``opt/scheduler``); a stage has a schedule or a scheduler,
    never both. ``TorchStage.__init__`` sets the rest.
    """

    schedule: Schedule | None = None
    scheduler: Any = None           # a torch.optim.lr_scheduler.LRScheduler
    updates = 0
    applied_lr: float | None = None  # the rate of the latest update this process applied (learning_rate)
    module: nn.Module
    device: torch.device
    buffers: dict[str, torch.Tensor]    # the module's persistent buffers (batch norm's running statistics)
    _params: list[_Param]               # every parameter, under its distgrad name
    _by_name: dict[str, _Param]
    _opt_params: list[torch.Tensor]     # the tensors the optimizer updates, in its param groups' order

    parameters_suffix = ".pt"      # what ``save_parameters`` writes: a torch ``state_dict``

    @property
    def params(self) -> dict[str, np.ndarray]:
        return {p.name: p.view(p.tensor) for p in self._params}

    def set_params(self, values: Mapping[str, np.ndarray]) -> None:
        """Set every parameter, in place on its device, to ``values[name]`` (distgrad's layout, as ``params``)."""
        with torch.no_grad():
            for p in self._params:
                p.tensor.copy_(p.from_numpy(np.asarray(values[p.name], np.float32)))

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
