"""A label owner's DP-SGD on a torch stage: each row's parameter gradient by ``torch.func``
(``per_example_gradients``), and the modules that have none (``per_example_refusal``: batch norm, dropout).

Part of ``distgrad.stage.torch_stage``; the clipping, sum and noise are the numpy stage's
(``privacy.defenses.dp_sgd_gradients``), so a run is bitwise in one process or two and after a resume.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def per_example_gradients(module: nn.Module, values: dict[str, torch.Tensor], x: torch.Tensor,
                          dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """For each name of ``values`` (parameters of ``module`` by their ``named_parameters`` names), the gradients
    of ``sum(module(x[i:i+1]) * dy[i:i+1])`` for every row i, stacked along a first axis of rows.

    ``grad`` of that sum through ``functional_call``, mapped over the rows by ``vmap``: one batched pass, the
    same values as a loop of single-row backward passes to float32 rounding. Raises what ``torch.func`` raises
    for a module it cannot map over single rows.
    """
    def contribution(params: dict[str, torch.Tensor], row: torch.Tensor, d_row: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(module, params, (row.unsqueeze(0),))
        return (out * d_row.unsqueeze(0)).sum()

    found: dict[str, torch.Tensor] = torch.func.vmap(torch.func.grad(contribution), in_dims=(None, 0, 0))(values, x, dy)
    return found


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
