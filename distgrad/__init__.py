"""distgrad: train one model g(f(x)) across a process or host boundary, exactly.

The public API is re-exported lazily, so ``distgrad.cli`` can pin BLAS
threads before numpy is first imported.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "load_experiment": "distgrad.config.parse",
    "Experiment": "distgrad.config.experiment",
    "train_in_process": "distgrad.run.inprocess",
    "run_local": "distgrad.run.launcher",
    "Stage": "distgrad.stage.stage",
    "serve_stage": "distgrad.api",
    "drive_stage": "distgrad.api",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'distgrad' has no attribute {name!r}")
