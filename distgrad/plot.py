"""``distgrad plot``: loss and throughput curves from a ``--metrics`` file, as a PNG (one curve per client
when the file is the merged metrics of several clients), with the held-out loss and scores (accuracy and the
label owner's metrics) at the steps that evaluated (``--eval-every``), the stage's learning rate when the file
has them, and the privacy meter's figures beside their chance levels (dashed) at the steps that closed a window
(``--privacy-meter``).

Needs matplotlib (``pip install 'distgrad[plot]'``); it is imported only here.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from distgrad.errors import ConfigError
from distgrad.privacy.meter import METER_FIGURES

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


def _curves(records: list[dict]) -> dict[int | None, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``{client: (steps, loss, wall_s)}`` per client in client order; ``{None: ...}`` without clients."""
    by_client: dict[int | None, list[dict]] = {}
    for record in records:
        by_client.setdefault(record.get("client"), []).append(record)
    curves = {}
    for client in sorted(by_client, key=lambda c: -1 if c is None else c):
        rows = sorted(by_client[client], key=lambda r: r["step"])
        curves[client] = (np.array([r["step"] for r in rows], float),
                          np.array([np.nan if r.get("loss") is None else r["loss"] for r in rows], float),
                          np.array([r["wall_s"] for r in rows], float))
    return curves


def _held_out(records: list[dict], key: str) -> dict[int | None, tuple[np.ndarray, np.ndarray]]:
    """``{client: (steps, values)}`` of ``key`` (``test_loss``, ``test_accuracy``, ``test_auc``, ``lr``, ...)
    on the lines that have it, in step order; clients without any are left out."""
    points: dict[int | None, list[tuple[int, float]]] = {}
    for record in records:
        if record.get(key) is not None:
            points.setdefault(record.get("client"), []).append((record["step"], record[key]))
    return {client: (np.array([p[0] for p in sorted(rows)], float), np.array([p[1] for p in sorted(rows)], float))
            for client, rows in sorted(points.items(), key=lambda item: -1 if item[0] is None else item[0])}


def _rate(steps: np.ndarray, wall: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Steps per second over a window of ``SMOOTH_STEPS`` steps (fewer for a short run)."""
    window = min(SMOOTH_STEPS, len(steps) - 1) or 1
    rate = window / np.maximum(wall[window:] - wall[:-window], 1e-12) if len(steps) > 1 else np.array([])
    return steps[window:], rate, window


def draw_metrics(records: list[dict], title: str):
    """A matplotlib figure of loss per step (top) and steps/s (bottom): one line per client when the
    records carry ``client`` (the merged metrics of several clients, labelled), else one. Records with
    ``test_loss`` add the held-out loss to the top panel (markers), with other held-out scores
    (``test_accuracy``, the label owner's ``test_NAME`` metrics) a panel of them between the two, one
    line per score (and client), with ``lr`` a panel of the learning rate, and with privacy-meter figures
    a panel of them, above steps/s."""
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("distgrad plot needs matplotlib: pip install 'distgrad[plot]'") from e
    curves = _curves(records)
    # With a validation split the evaluations during training are the validation rows' figures.
    kind = "validation" if any("validation_loss" in record for record in records) else "test"
    test_loss, rates = _held_out(records, f"{kind}_loss"), _held_out(records, "lr")
    names = sorted({key for record in records for key in record
                    if key.startswith(f"{kind}_") and key not in (f"{kind}_loss", f"{kind}_count")})
    scores = {name: _held_out(records, name) for name in names}
    # NAME, or PARTY/NAME: the label owner's meter of a feature party (its figures of each party)
    leak_names = sorted({key for record in records for key in record if key.rsplit("/", 1)[-1] in METER_FIGURES},
                        key=lambda key: (METER_FIGURES.index(key.rsplit("/", 1)[-1]), key))
    leaks = {name: _held_out(records, name) for name in leak_names}
    leaks = {name: points for name, points in leaks.items() if points}
    panels = 2 + bool(scores) + bool(rates) + bool(leaks)
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2 + 2 * panels), sharex=True)
    ax_loss, ax_rate = axes[0], axes[-1]
    # Each optional panel is None without its figures, and only drawn on when they exist.
    ax_scores: Any = axes[1] if scores else None
    ax_lr: Any = axes[-2 - bool(leaks)] if rates else None
    if leaks:
        ax_leak = axes[-2]
        for name in leaks:
            for client, (steps, values) in leaks[name].items():
                suffix = "" if client is None else f" (client {client})"
                (line,) = ax_leak.plot(steps, values, "o-", lw=1, ms=4, label=name + suffix)
                _, chance = _held_out(records, f"{name}_chance")[client]
                ax_leak.plot(steps, chance, "--", lw=1, color=line.get_color())
        ax_leak.set_ylabel("leak (dashed: chance)")
        ax_leak.legend(loc="lower left", fontsize="small")
    window, positive = 1, True
    for client, (steps, loss, wall) in curves.items():
        label = None if client is None else f"client {client}"
        (line,) = ax_loss.plot(steps, loss, lw=1, label="training loss" if client is None else label)
        if client in test_loss:
            held_steps, held = test_loss[client]
            ax_loss.plot(held_steps, held, "o--", lw=1, ms=4, color=line.get_color(),
                         label="held-out loss" if client is None else f"{label} held-out")
            positive = positive and bool(np.nanmin(held) > 0)
        if client in rates:
            ax_lr.plot(*rates[client], lw=1, color=line.get_color(), label=label)
        for name, marker in zip(names, "os^vD<>ph*"):
            if client in scores[name] and len(names) == 1:      # the client's colour, as its loss
                ax_scores.plot(*scores[name][client], "o-", lw=1, ms=4, color=line.get_color(), label=label)
            elif client in scores[name]:
                ax_scores.plot(*scores[name][client], f"{marker}-", lw=1, ms=4,
                               label=name.split('_', 1)[1] if client is None else f"{label} {name.split('_', 1)[1]}")
        rate_steps, rate, window = _rate(steps, wall)
        ax_rate.plot(rate_steps, rate, lw=1, label=label, **({"color": "tab:orange"} if client is None else {}))
        positive = positive and bool(np.nanmin(loss) > 0)
    if positive:
        ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss")
    last_step = max(int(steps[-1]) for steps, _, _ in curves.values())
    wall_s = max(float(wall[-1]) for _, _, wall in curves.values())
    clients = "" if None in curves else f", {len(curves)} clients"
    ax_loss.set_title(f"{title}: {last_step} steps in {wall_s:.2f} s{clients}")
    if None not in curves or test_loss:
        ax_loss.legend(loc="upper right")
    if scores:
        ax_scores.set_ylabel(f"held-out {names[0].split('_', 1)[1]}" if len(names) == 1 else "held-out scores")
        if len(names) > 1:
            ax_scores.legend(loc="lower right", fontsize="small")
    if rates:
        ax_lr.set_ylabel("learning rate")
    ax_rate.set_ylabel(f"steps/s (over {window} steps)")
    ax_rate.set_xlabel("step")
    fig.tight_layout()
    return fig


def plot_metrics(path: Path, out: Path) -> Path:
    """Draw loss per step and steps/s per step from ``path`` into the PNG ``out``; return ``out``.

    A metrics file of several clients (lines with ``client``) gets one line per client. ``ConfigError`` for an
    ``out`` whose suffix names no image format matplotlib writes (``.png``, ``.svg``, ``.pdf``, ...; no suffix: a
    PNG, written to ``out`` as named), or that cannot be written.
    """
    records = read_metrics(path)
    import matplotlib.pyplot as plt

    fig = draw_metrics(records, path.name)
    try:
        formats = fig.canvas.get_supported_filetypes()
        suffix = out.suffix[1:].lower()
        if suffix and suffix not in formats:
            raise ConfigError(f"--out {out}: {suffix!r} is no image format matplotlib writes; use .png (or one of "
                              f"{', '.join(sorted(formats))})")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(out, dpi=100, format=suffix or "png")      # exactly ``out``, no suffix added
        except OSError as e:
            raise ConfigError(f"cannot write --out {out}: {e.strerror or e}") from e
    finally:
        plt.close(fig)
    return out
