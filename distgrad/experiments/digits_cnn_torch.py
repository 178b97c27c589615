"""The f-stage of the built-in ``digits-cnn-torch``: a small convolutional network in PyTorch.

``make_f`` is the factory the experiment names (``module = "digits_cnn_torch:make_f"``): distgrad
imports this file from the experiment's folder, seeds torch, calls ``make_f(**module_args)`` and trains
the module it returns in a daemon, against a numpy g-stage. Input: ``(batch, 64)`` flat 8x8 digit
images; output: ``(batch, channels * 16)`` features, the activation that crosses the wire.
"""

from __future__ import annotations

import torch
from torch import nn


class Pixels(nn.Module):
    """``(batch, 64)`` flat pixels as ``(batch, 1, 8, 8)`` images."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], 1, 8, 8)


def make_f(channels: int = 16) -> nn.Module:
    """Conv2d(1, channels, 3, padding 1) -> ReLU -> MaxPool 2x2 -> Flatten: ``(batch, 64)`` to
    ``(batch, channels * 16)``."""
    return nn.Sequential(
        Pixels(),
        nn.Conv2d(1, channels, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
