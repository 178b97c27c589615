"""``distgrad plot``: loss and throughput curves from a ``--metrics`` file, as a PNG.

Needs matplotlib (``pip install 'distgrad[plot]'``); it is imported only here.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from .errors import ConfigError

SMOOTH_STEPS = 20        # throughput is averaged over this many steps


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics file; raises ``ConfigError`` if it is missing, empty or not JSON lines."""
    try:
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read metrics file {path}: {e}") from e
    if not records or not all("step" in r and "wall_s" in r for r in records):
        raise ConfigError(f"{path} holds no distgrad metrics lines (write one with --metrics)")
    return records


def plot_metrics(path: Path, out: Path) -> Path:
    """Draw loss per step and steps/s per step from ``path`` into the PNG ``out``; return ``out``."""
    records = read_metrics(path)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("distgrad plot needs matplotlib: pip install 'distgrad[plot]'") from e
    steps = np.array([r["step"] for r in records], float)
    loss = np.array([np.nan if r.get("loss") is None else r["loss"] for r in records], float)
    wall = np.array([r["wall_s"] for r in records], float)
    window = min(SMOOTH_STEPS, len(steps) - 1) or 1
    rate_steps = steps[window:]
    rate = window / np.maximum(wall[window:] - wall[:-window], 1e-12) if len(steps) > 1 else np.array([])
    fig, (ax_loss, ax_rate) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_loss.plot(steps, loss, lw=1)
    if np.nanmin(loss) > 0:
        ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"{path.name}: {int(steps[-1])} steps in {wall[-1]:.2f} s")
    ax_rate.plot(rate_steps, rate, lw=1, color="tab:orange")
    ax_rate.set_ylabel(f"steps/s (over {window} steps)")
    ax_rate.set_xlabel("step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
