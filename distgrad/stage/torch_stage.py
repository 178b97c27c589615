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

This module is the door: it imports torch (a ``ConfigError`` saying how to
install it when it is missing), holds ``TorchStage`` and ``build_stage``, and
re-exports what other code imports from here. The parts: ``torch_state``
(``TorchState``, what a stage holds and its checkpoints), ``torch_tensors``
(arrays in and out, devices), ``torch_layers`` (layers and losses in torch),
``torch_optim`` (optimizer and scheduler), ``torch_module`` (your own
module), ``torch_per_example`` (DP-SGD's per-example gradients).
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from distgrad.config.defended import label_owner_sends_gradients
from distgrad.config.experiment import Experiment, build_stage_parts, check_init_overrides, stage_loss
from distgrad.errors import ConfigError, StageError
from distgrad.model.losses import Loss, build_loss
from distgrad.model.metrics import score
from distgrad.model.nn import Grads, Shape
from distgrad.stage.stage import check_cut
from distgrad.threads import one_torch_thread

try:
    import torch
    from torch import nn
except ImportError as e:
    raise ConfigError("a stage with framework 'torch' needs PyTorch: pip install 'distgrad[torch]'") from e

one_torch_thread(torch)     # imported inside a run's one_compute_thread, torch loaded after it began

# The parts of a torch stage (each imports torch itself: this module is the one door, whose import says how to
# install torch when it is missing). Names other code imports from here are re-exported (``__all__``).
from distgrad.stage.torch_layers import OwnBottomModule, ScaleModule, _torch_layer, _torch_loss, batch_norms  # noqa: E402
from distgrad.stage.torch_module import build_module, module_param_names, _with_own_bottom  # noqa: E402
from distgrad.stage.torch_optim import (  # noqa: E402
    _torch_optimizer, check_keyword_options, is_plateau, module_optimizer, stage_scheduler)
from distgrad.stage.torch_per_example import per_example_gradients, per_example_refusal  # noqa: E402
from distgrad.stage.torch_state import TorchState, read_state_dict  # noqa: E402
from distgrad.stage.torch_tensors import CPU, _COMPUTE_ERRORS, _host, _Param, _tensor, torch_device  # noqa: E402

__all__ = [
    "CPU", "OwnBottomModule", "ScaleModule", "TorchStage", "TorchState", "batch_norms", "build_module", "build_stage",
    "check_keyword_options", "is_plateau", "module_optimizer", "module_param_names", "per_example_refusal",
    "read_state_dict", "stage_scheduler", "torch_device", "_tensor", "_torch_loss",
]


class TorchStage(TorchState):
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

    What it holds between steps (parameters, buffers, optimizer state, the
    update count, the ``schedule`` or ``scheduler``) and its checkpoints are
    ``TorchState``'s; this class computes a step with them and updates them.
    """

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

        Computed by ``torch.func`` (``per_example_gradients``). A parameter the output ignores gets zeros.
        Raises ``StageError`` when the module cannot be mapped over single rows (a random draw, an in-place
        buffer update or a branch on a tensor's value in its forward; ``build_stage`` refuses batch norm and
        dropout modules before that).
        """
        names = [self._module_names[id(p.tensor)] for p in self._trainable]
        values = {name: p.tensor.detach() for name, p in zip(names, self._trainable)}
        try:
            x_t, dy_t = _tensor(x, device=self.device), _tensor(dy, device=self.device)
            with self._forward_mode(mb, training=True):
                found = per_example_gradients(self.module, values, x_t, dy_t)
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

    def batch_mixing(self) -> str | None:
        """The module's batch norms (``batch_norms``), which normalise each row of a training batch by the
        batch's statistics, so one row's target reaches every row's gradient; None without one."""
        norms = batch_norms(self.module)
        return (f"batch norm normalises each row by the batch's statistics, so one label reaches every row's "
                f"gradient: {norms}") if norms else None


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
