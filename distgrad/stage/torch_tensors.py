"""A torch stage's tensors at its boundary: numpy arrays into torch memory on the stage's device and back, the
device a stage names, and a parameter under its distgrad name and layout (``_Param``).

Part of ``distgrad.stage.torch_stage`` (which imports torch with a message saying how to install it); the
numerics that make a run bitwise in one process or two start here: every array crosses into memory torch
allocated (``_tensor``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from distgrad.errors import ConfigError

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
