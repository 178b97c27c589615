"""A stage computed by PyTorch: a ``torch.nn.Module`` with a torch optimizer (``pip install 'distgrad[torch]'``).

``TorchStage`` has the interface of ``distgrad.stage.Stage``, so the daemons,
the in-process path, micro-batches, checkpoints and traces use it unchanged,
and it speaks the same wire protocol: a torch f-stage trains against a numpy
g-stage and the reverse. Arrays crossing its boundary are numpy float32 (the
wire's type; class ids int64); inside, tensors are torch float32 on the CPU
and autograd computes the gradients.

Two ways to get one:

* ``framework = "torch"`` on an experiment stage (``Stage.from_experiment``
  then calls ``TorchStage.from_experiment``): the same layer list built in
  torch (``dense`` is ``nn.Linear`` holding ``W`` transposed, ``scale`` a
  one-parameter module, ``relu``/``tanh``/``sigmoid`` torch's own) with the
  initial values of the numpy build for that seed and ``--init``, the
  optimizer table mapped to ``torch.optim.Adam(lr, betas, eps)`` or
  ``torch.optim.SGD(lr)`` (with the float32 values the numpy optimizer
  uses: ``lr = 0.01`` is ``float32(0.01)``, as in every numpy stage; with a
  ``schedule``, each update's float32 rate from ``distgrad.schedules`` is
  set on every param group before its ``step()``), and
  on the last stage the loss in torch with
  losses.py's definitions and reductions. Parameters keep their numpy names
  and layout (``NAME.W`` is ``(n_in, n_out)``), so summaries and traces of
  either framework compare key by key.
* ``TorchStage.from_module(name, module, optimizer, input_shape, loss=None)``
  for a module of your own; parameter names and layouts are those of
  ``module.named_parameters()``.

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
way), and a run resumed from checkpoints.

Threads: on import this module sets ``torch.set_num_threads(1)`` unless
``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` gives a count (torch reads those
itself), so two stages on two cores do not fight; call
``torch.set_num_threads`` after importing it to choose another count.

Modules train in whatever mode they are in (``train()`` by default) and
are evaluated in ``eval()`` mode (their mode restored after). Before each
training forward, torch's RNG is seeded from (the run's seed, the stage's
name, the step, the micro-batch), so dropout draws the same masks in one
process or two and after a resume. Layers that keep running statistics
(batch norm) still make a run depend on more than its seed and step, which
the rollback and resume machinery assumes; keep them out of a stage that
has to resume exactly.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from .errors import ConfigError, StageError
from .experiment import Experiment, build_stage_parts
from .losses import Loss, MeanSquaredError, SoftmaxCrossEntropy, SumSquaredError, build_loss
from .nn import Dense, Grads, Layer, ReLU, Scale, Shape, Sigmoid, Tanh
from .optim import SGD, Adam, Optimizer
from .records import write_atomic
from .schedules import Schedule
from .stage import Stage, check_saved_parameters

try:
    import torch
    from torch import nn
except ImportError as e:
    raise ConfigError("a stage with framework 'torch' needs PyTorch: pip install 'distgrad[torch]'") from e

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")   # a count the user chose; torch honours them
if not any(name in os.environ for name in THREAD_ENV_VARS):
    torch.set_num_threads(1)

_UPDATES = "opt/updates"     # the checkpoint array of the update count (as a numpy stage's optimizer writes it)

# What torch raises for bad shapes, dtypes and values; reported as the stage's StageError.
_COMPUTE_ERRORS = (ValueError, ArithmeticError, RuntimeError, IndexError)


def _tensor(array: np.ndarray, dtype: np.dtype | type = np.float32) -> torch.Tensor:
    """A copy of ``array`` as a CPU tensor of ``dtype``, in memory torch allocated.

    Copied so that a matmul kernel sees the same alignment whether the array
    is a received frame or one of this process's arrays (MKL's results can
    depend on it), and so that read-only frames can be used.
    """
    return torch.tensor(np.asarray(array, dtype))


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


# ---------------------------------------------------------------- layers in torch

class ScaleModule(nn.Module):
    """``y = x * w``, torch's form of ``distgrad.nn.Scale``; ``w`` has shape ``(size,)``."""

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
        """``value`` (the parameter, its gradient or optimizer state) as numpy in distgrad's layout, sharing memory."""
        array = value.detach().numpy()
        return array.T if self.transposed else array

    def from_numpy(self, array: np.ndarray) -> torch.Tensor:
        """A float32 tensor in torch's layout for a numpy array in distgrad's (sharing memory when it can)."""
        return torch.from_numpy(np.ascontiguousarray(array.T if self.transposed else array, np.float32))


def _torch_layer(layer: Layer) -> tuple[nn.Module, list[tuple[str, str, bool]]]:
    """Torch's form of one numpy layer, holding its values, and ``(distgrad name, attribute, transposed)`` per parameter."""
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
        return torch.optim.Adam(params, lr=float(optimizer.lr), betas=(float(optimizer.beta1), float(optimizer.beta2)),
                                eps=float(optimizer.epsilon))
    if isinstance(optimizer, SGD):
        return torch.optim.SGD(params, lr=float(optimizer.lr))
    raise ConfigError(f"optimizer {type(optimizer).__name__} has no torch version")


class TorchStage(Stage):
    """A stage whose model is a ``torch.nn.Module`` updated by a ``torch.optim.Optimizer``.

    Same contract as ``Stage``: numpy float32 in and out, ``params`` maps
    names to live numpy views of the parameters, ``backward`` returns numpy
    gradients keyed like ``params`` (``engine.GradAccumulator`` sums
    micro-batches), ``apply`` makes one optimizer step. ``loss`` is the
    distgrad ``Loss`` whose definition the torch loss computes (its
    reduction decides how micro-batches combine); None except on the last
    stage. Build one with ``from_experiment`` or ``from_module``.

    ``schedule`` (set by ``from_experiment``; None for ``from_module``): the
    float32 learning rate of update ``updates + 1``, set on every param
    group before each ``optimizer.step()``. ``updates`` counts the applied
    updates and is checkpointed as ``opt/updates``.
    """

    schedule: Schedule | None = None
    updates = 0

    def __init__(self, name: str, module: nn.Module, optimizer: torch.optim.Optimizer, loss: Loss | None,
                 input_shape: Shape, params: Sequence[_Param]) -> None:
        # Stage.__init__ is not called: it builds around a numpy Sequential. The bookkeeping every
        # stage holds (shapes, step) comes from Stage._setup.
        self.name, self.module, self.optimizer, self.loss = name, module, optimizer, loss
        self._params = list(params)
        for p in self._params:
            if p.tensor.dtype != torch.float32 or p.tensor.device.type != "cpu":
                raise ConfigError(f"stage {name}: parameter {p.name} is {p.tensor.dtype} on {p.tensor.device}; "
                                  f"a torch stage computes in float32 on the CPU")
        known = {id(p.tensor) for p in self._params}
        self._opt_params = [t for group in optimizer.param_groups for t in group["params"]]
        if any(id(t) not in known for t in self._opt_params):
            raise ConfigError(f"stage {name}: the optimizer updates a tensor that is not a parameter of the module")
        self._trainable = [p for p in self._params if p.tensor.requires_grad]
        self._by_name = {p.name: p for p in self._params}
        self._loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        if loss is not None:
            if type(loss) not in _TORCH_LOSSES:
                raise ConfigError(f"stage {name}: loss {type(loss).__name__} has no torch version")
            self._loss_fn = _TORCH_LOSSES[type(loss)]
        self.input_shape = tuple(input_shape)        # the probe below needs it
        self._setup(name, optimizer, loss, input_shape, self._probe_output_shape())

    @classmethod
    def from_experiment(cls, exp: Experiment, name: str, seed: int | None = None,
                        init: Mapping[str, float] | None = None) -> "TorchStage":
        """Stage ``name`` of ``exp`` built in torch, starting from the numpy build's values for ``seed`` and ``init``.

        Raises ``ConfigError`` on a bad name or override, as ``Stage.from_experiment`` does.
        """
        seed = exp.seed if seed is None else seed
        model, optimizer, loss = build_stage_parts(exp, name, seed, init or {})
        modules, params = [], []
        for layer in model.layers:
            module, names = _torch_layer(layer)
            params += [_Param(dg_name, getattr(module, attr), transposed) for dg_name, attr, transposed in names]
            modules.append(module)
        stage = cls(name, nn.Sequential(*modules), _torch_optimizer(optimizer, [p.tensor for p in params]), loss,
                    exp.input_shape(name, seed), params)
        stage.schedule = optimizer.schedule
        return stage

    @classmethod
    def from_module(cls, name: str, module: nn.Module, optimizer: torch.optim.Optimizer,
                    input_shape: Shape, loss: str | None = None) -> "TorchStage":
        """A stage from your own float32 CPU ``module`` and an ``optimizer`` over its parameters.

        ``input_shape`` is the per-step shape of what the stage receives (the
        output shape is found by one forward pass of zeros, in eval mode and
        without gradients). ``loss`` names the last stage's loss as an
        experiment does (``"softmax_cross_entropy"``, ...); None for other
        stages. Raises ``ConfigError`` for another dtype or device, for an
        optimizer over tensors the module does not own, an unknown loss, or a
        module that does not take ``input_shape``.
        """
        params = [_Param(n, p) for n, p in module.named_parameters()]
        return cls(name, module, optimizer, build_loss(loss) if loss is not None else None, input_shape, params)

    def _probe_output_shape(self) -> Shape:
        training = self.module.training
        self.module.eval()                  # no running statistics updated by the probe
        try:
            with torch.no_grad():
                return tuple(self.module(torch.zeros(self.input_shape, dtype=torch.float32)).shape)
        except _COMPUTE_ERRORS as e:
            raise ConfigError(f"stage {self.name}: the module does not take input of shape {self.input_shape}: {e}") from e
        finally:
            self.module.train(training)

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

    def _graph(self, x: np.ndarray, mb: int = 0, training: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The input as a leaf that can take a gradient, and the module's output with its graph."""
        x_t = _tensor(x).requires_grad_()
        with torch.enable_grad(), self._forward_mode(mb, training):
            return x_t, self.module(x_t)

    def _gradients(self, out: torch.Tensor, d_out: torch.Tensor | None, x_t: torch.Tensor,
                   need_dx: bool) -> tuple[np.ndarray | None, Grads]:
        """Back-propagate ``d_out`` from ``out`` (a scalar loss when None) once; the graph is freed.

        Only what is asked for is computed (torch prunes the product for d(input)
        when ``need_dx`` is false). A parameter the output does not depend on
        gets no gradient, as in torch.
        """
        inputs = [p.tensor for p in self._trainable] + ([x_t] if need_dx else [])
        found = torch.autograd.grad(out, inputs, grad_outputs=d_out, allow_unused=True)
        grads = {p.name: p.view(g) for p, g in zip(self._trainable, found) if g is not None}
        if not need_dx:
            return None, grads
        dx = found[-1]
        return (dx.numpy() if dx is not None else np.zeros(x_t.shape, np.float32)), grads   # None: output ignores x

    def forward(self, x: np.ndarray, mb: int = 0, training: bool = True) -> tuple[np.ndarray, Any]:
        """Activations for ``x`` (float32 numpy), micro-batch ``mb`` of the step in progress, and the cache
        ``backward`` needs (the graph); ``training`` False runs the module in eval mode."""
        try:
            x_t, y_t = self._graph(x, mb, training)
        except _COMPUTE_ERRORS as e:
            raise StageError(f"stage {self.name}: forward failed at step {self.step + 1}: {e}") from e
        return y_t.detach().numpy(), (x_t, y_t)

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        """d(loss)/d(input) (None unless ``need_dx``) and the parameter gradients, from d(loss)/d(output).

        Each cache is used once: its graph is freed.
        """
        x_t, y_t = cache
        try:
            return self._gradients(y_t, _tensor(dy), x_t, need_dx)
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

    def _loss_value(self, y_t: torch.Tensor, target: np.ndarray) -> torch.Tensor:
        assert self.loss is not None and self._loss_fn is not None, f"stage {self.name} has no loss"
        return self._loss_fn(y_t, _tensor(target, self.loss.target_dtype))

    def loss_backward(self, y: np.ndarray, target: np.ndarray) -> tuple[np.float32, np.ndarray]:
        """Loss value and d(loss)/d(y), computed by torch; last stage only."""
        try:
            y_t = _tensor(y).requires_grad_()
            with torch.enable_grad():
                loss_t = self._loss_value(y_t, target)
            (dy,) = torch.autograd.grad(loss_t, [y_t])
        except _COMPUTE_ERRORS as e:
            raise StageError(f"stage {self.name}: loss failed at step {self.step + 1}: {e}") from e
        return np.float32(loss_t.item()), dy.numpy()

    def loss_micro_batch(self, x: np.ndarray, target: np.ndarray, mb: int = 0) -> tuple[np.float32, np.ndarray, Grads]:
        """Forward, loss and backward of micro-batch ``mb`` on the last stage, in one torch graph, without an update."""
        try:
            x_t, y_t = self._graph(x, mb)
            with torch.enable_grad():
                loss_t = self._loss_value(y_t, target)
            dx, grads = self._gradients(loss_t, None, x_t, True)
        except _COMPUTE_ERRORS as e:
            raise StageError(f"stage {self.name}: loss failed at step {self.step + 1}: {e}") from e
        assert dx is not None
        return np.float32(loss_t.item()), dx, grads

    def evaluate_last(self, x: np.ndarray, target: np.ndarray) -> dict[str, Any]:
        """Forward only, in eval mode, without a graph: ``{"loss", "correct" (None unless classifying), "count"}``."""
        assert self.loss is not None, f"stage {self.name} has no loss"
        try:
            with torch.no_grad(), self._forward_mode(0, training=False):
                y_t = self.module(_tensor(x))
                loss_t = self._loss_value(y_t, target)
        except _COMPUTE_ERRORS as e:
            raise StageError(f"stage {self.name}: evaluation failed after step {self.step}: {e}") from e
        return {"loss": float(loss_t), "correct": self.loss.correct(y_t.numpy(), target), "count": int(len(x))}

    def apply(self, grads: Grads) -> None:
        """One optimizer step from numpy ``grads`` keyed like ``params``; counts the step.

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
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Parameters (``param/NAME``, distgrad layout) and optimizer state (``opt/KEY/NAME``, torch's layout)."""
        arrays = {f"param/{name}": value for name, value in self.params.items()}
        arrays[_UPDATES] = np.array(self.updates, np.int64)
        names = {id(p.tensor): p.name for p in self._params}
        for tensor, state in self.optimizer.state.items():
            for key, value in state.items():
                if value is not None:
                    arrays[f"opt/{key}/{names[id(tensor)]}"] = torch.as_tensor(value).detach().numpy().copy()
        return arrays

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray], step: int) -> None:
        """Restore what ``state_arrays`` returned, at ``step``; raises ``ValueError`` on a mismatch."""
        names = self._saved_param_names(arrays)
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
            if parts[0] != "opt" or key == _UPDATES:
                continue
            p = self._by_name.get(parts[-1]) if len(parts) == 3 else None
            if p is None or id(p.tensor) not in index:
                raise ValueError(f"stage {self.name}: checkpoint has optimizer state {key!r} for no parameter "
                                 f"the optimizer updates")
            state.setdefault(index[id(p.tensor)], {})[parts[1]] = torch.from_numpy(np.array(value))
        with torch.no_grad():
            for name in names:
                p = self._by_name[name]
                p.tensor.copy_(p.from_numpy(np.array(arrays[f"param/{name}"], np.float32)))
        self.optimizer.load_state_dict({"state": state, "param_groups": self.optimizer.state_dict()["param_groups"]})
        self.step = step
        # As Stage.load_state_arrays: a checkpoint from before schedules counts its step as its updates.
        self.updates = int(arrays[_UPDATES]) if _UPDATES in arrays else step

    parameters_suffix = ".pt"      # what ``save_parameters`` writes: a torch ``state_dict``

    def save_parameters(self, path: str | Path) -> Path:
        """The module's ``state_dict`` (parameters and buffers, on the CPU) via ``torch.save``, atomically."""
        state = {key: value.detach().cpu() for key, value in self.module.state_dict().items()}
        return write_atomic(path, lambda f: torch.save(state, f))

    def load_parameters(self, path: str | Path) -> None:
        """A ``state_dict`` file, read with ``weights_only=True`` (tensors only, never arbitrary objects);
        ``ConfigError`` naming the file when it cannot be read or does not fit the module exactly."""
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:      # torch raises many kinds for a missing, truncated or foreign file
            raise ConfigError(f"--load {path}: cannot read a torch state_dict for stage {self.name}: {e}") from e
        if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ConfigError(f"--load {path}: not a state_dict of tensors")
        check_saved_parameters(self.name, path, state,
                               {k: tuple(v.shape) for k, v in self.module.state_dict().items()})
        with torch.no_grad():
            self.module.load_state_dict(state, strict=True)


def build_stage(exp: Experiment, name: str, seed: int | None = None,
                init: Mapping[str, float] | None = None) -> TorchStage:
    """The builder ``Stage.from_experiment`` calls for a stage with ``framework = "torch"``."""
    stage = TorchStage.from_experiment(exp, name, seed, init)
    stage.allow_nonfinite = exp.allow_nonfinite
    return stage
