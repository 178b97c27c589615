"""distgrad's layers and losses built in torch: a layer-list stage's ``nn.Sequential`` holding the numpy build's
values (``_torch_layer``), a vertical label owner's own bottom (``OwnBottomModule``), and each loss with
losses.py's definition and reduction, or the ``torch.nn`` loss a ``TorchLoss`` names (``_torch_loss``).

Part of ``distgrad.stage.torch_stage``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from distgrad.errors import ConfigError
from distgrad.model.aggregate import OwnBottom
from distgrad.model.losses import Loss, MeanSquaredError, SoftmaxCrossEntropy, SumSquaredError, TorchLoss
from distgrad.model.nn import DTYPE, Dense, Layer, ReLU, Scale, Sigmoid, Tanh
from distgrad.stage.torch_optim import check_keyword_options


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


def batch_norms(module: nn.Module) -> str:
    """The submodules of ``module`` that normalise each row by its batch's statistics in a training forward,
    each named with its type ("" for none)."""
    return ", ".join(f"{name or 'the module'} ({type(m).__name__})" for name, m in module.named_modules()
                     if isinstance(m, nn.modules.batchnorm._BatchNorm))
