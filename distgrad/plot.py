"""``distgrad plot``: loss and throughput curves from a ``--metrics`` file, as a PNG (one curve per client
when the file is the merged metrics of several clients), with the held-out loss and scores (accuracy and the
label owner's metrics) at the steps that evaluated (``--eval-every``), the stage's learning rate when the file
has them, and the privacy meter's figures beside their chance levels (dashed) at the steps that closed a window
(``--privacy-meter``).

Needs matplotlib (``pip install 'distgrad[plot]'``); it is imported only here.
"""

from __future__ import annotations

import logging
import math
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from distgrad.errors import ConfigError
from distgrad.jsontext import json_text, parse_json
from distgrad.privacy.meter import METER_FIGURES
from distgrad.wire.messages import LOSS_WITHHELD

SMOOTH_STEPS = 20        # throughput is averaged over this many steps
MAX_LINE_BYTES = 16 * 2 ** 20     # the longest metrics line read (a line is a few hundred bytes to a few KiB)

log = logging.getLogger("distgrad")


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics file (one JSON object a line, as ``--metrics`` writes). Raises
    ``ConfigError`` naming the file (and the line) when it is missing, no regular file (a directory, a
    device such as ``/dev/zero``, a pipe: never read without bound), empty, or holds a line that is not a
    metrics record (but a last line cut short, with no line end: a killed writer's, skipped with a warning):
    not JSON, nested too deeply, over ``MAX_LINE_BYTES``, or not an object whose ``step``
    is a whole number, ``wall_s`` a finite number, ``client`` (if any) a whole number and every figure
    drawn (``figure_keys``) a number, ``null`` or a non-finite figure's text (``"nan"``, ``"inf"``)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ConfigError(f"metrics file {path} is not a regular file: give the file --metrics wrote")
        records = []
        with open(path, "rb") as f:
            for number, text in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
                where = f"metrics file {path} line {number}"
                if len(text) > MAX_LINE_BYTES:
                    raise ConfigError(f"{where} is over {MAX_LINE_BYTES} bytes: no metrics line is that long")
                if not text.strip():
                    continue
                if not text.endswith(b"\n") and not _parses(text):
                    # the last line, cut short: the stage writing it was killed mid-write; the steps before it stand
                    log.warning("%s is cut short (its writer was stopped while writing it): drawn without it", where)
                    continue
                records.append(_record(parse_json(text, where), where))
    except OSError as e:
        raise ConfigError(f"cannot read metrics file {path}: {e.strerror or e}") from e
    if not records:
        raise ConfigError(f"{path} holds no distgrad metrics lines (write one with --metrics)")
    return records


def _parses(text: bytes) -> bool:
    """Whether ``text`` is one JSON value (``parse_json`` then says what else is wrong with it)."""
    try:
        parse_json(text, "")
    except ConfigError:
        return False
    return True


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def figure_keys(record: dict) -> list[str]:
    """The keys of a metrics record whose values ``draw_metrics`` draws (besides ``step`` and ``wall_s``)."""
    return [key for key in record if key in ("loss", "lr") or key.startswith(("test_", "validation_"))
            or key.rsplit("/", 1)[-1].removesuffix("_chance") in METER_FIGURES]


def _record(record: Any, where: str) -> dict:
    """``record`` if it is a metrics record ``draw_metrics`` can draw (``read_metrics``), else ``ConfigError``."""
    if not isinstance(record, dict) or "step" not in record or "wall_s" not in record:
        raise ConfigError(f"{where} is no distgrad metrics line (a JSON object with 'step' and 'wall_s', as "
                          f"--metrics writes)")
    step, wall, client = record["step"], record["wall_s"], record.get("client")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"{where}: 'step' must be a whole number >= 0, got {json_text(step)[:40]}")
    if not _is_number(wall) or not math.isfinite(wall):
        raise ConfigError(f"{where}: 'wall_s' must be a finite number, got {json_text(wall)[:40]}")
    if client is not None and (not isinstance(client, int) or isinstance(client, bool) or client < 0):
        raise ConfigError(f"{where}: 'client' must be a whole number >= 0, got {json_text(client)[:40]}")
    for key in figure_keys(record):
        value = record[key]
        if not (value is None or _is_number(value) or value in ("nan", "inf", "-inf")):
            raise ConfigError(f"{where}: {key!r} must be a number, got {json_text(value)[:40]}")
    return record


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
    ordered = {client: sorted(rows, key=lambda point: point[0]) for client, rows in points.items()}
    return {client: (np.array([p[0] for p in rows], float), np.array([p[1] for p in rows], float))
            for client, rows in sorted(ordered.items(), key=lambda item: -1 if item[0] is None else item[0])}


def _rate(steps: np.ndarray, wall: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Steps per second over a window of ``SMOOTH_STEPS`` steps (fewer for a short run)."""
    window = min(SMOOTH_STEPS, len(steps) - 1) or 1
    rate = window / np.maximum(wall[window:] - wall[:-window], 1e-12) if len(steps) > 1 else np.array([])
    return steps[window:], rate, window


def _pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed); ``ConfigError`` without matplotlib."""
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("distgrad plot needs matplotlib: pip install 'distgrad[plot]'") from e
    return plt


def _meter_figures(records: list[dict]) -> dict[str, dict[int | None, tuple[np.ndarray, np.ndarray]]]:
    """The privacy meter's figures in ``records`` (``_held_out`` of each), in ``METER_FIGURES`` order, those
    without any point left out. A figure's name is NAME, or PARTY/NAME: the label owner's meter of a feature
    party (its figures of each party)."""
    leak_names = sorted({key for record in records for key in record if key.rsplit("/", 1)[-1] in METER_FIGURES},
                        key=lambda key: (METER_FIGURES.index(key.rsplit("/", 1)[-1]), key))
    leaks = {name: _held_out(records, name) for name in leak_names}
    return {name: points for name, points in leaks.items() if points}


def _draw_leaks(ax_leak: Any, records: list[dict],
                leaks: dict[str, dict[int | None, tuple[np.ndarray, np.ndarray]]]) -> None:
    """The privacy meter's panel: each figure of ``leaks`` (``_meter_figures``) per client, its chance level
    dashed in the same colour."""
    for name in leaks:
        for client, (steps, values) in leaks[name].items():
            suffix = "" if client is None else f" (client {client})"
            (line,) = ax_leak.plot(steps, values, "o-", lw=1, ms=4, label=name + suffix)
            chances = _held_out(records, f"{name}_chance").get(client)
            if chances is not None:         # each figure's line holds its chance level as distgrad writes it
                ax_leak.plot(*chances, "--", lw=1, color=line.get_color())
    ax_leak.set_ylabel("leak (dashed: chance)")
    ax_leak.legend(loc="lower left", fontsize="small")


def _draw_scores(ax_scores: Any, scores: dict[str, dict[int | None, tuple[np.ndarray, np.ndarray]]],
                 names: list[str], client: int | None, color: Any, label: str | None) -> None:
    """The held-out scores ``names`` of ``client`` on the scores panel: a single score in the client's
    ``color`` (as its loss), several each with its own marker and label."""
    for name, marker in zip(names, "os^vD<>ph*"):
        if client in scores[name] and len(names) == 1:      # the client's colour, as its loss
            ax_scores.plot(*scores[name][client], "o-", lw=1, ms=4, color=color, label=label)
        elif client in scores[name]:
            ax_scores.plot(*scores[name][client], f"{marker}-", lw=1, ms=4,
                           label=name.split('_', 1)[1] if client is None else f"{label} {name.split('_', 1)[1]}")


def _title_loss_panel(ax_loss: Any, records: list[dict], curves: dict[int | None, tuple[np.ndarray, np.ndarray, np.ndarray]],
                      title: str, positive: bool, legend: bool) -> None:
    """The loss panel's title (steps, seconds, clients), label and scale (log when every loss drawn is
    ``positive``), a note when no line carried a training loss, and the ``legend`` if asked."""
    if all(record.get("loss") is None for record in records):      # the label owner's replies carried none
        ax_loss.text(0.5, 0.5, f"training loss {LOSS_WITHHELD}", transform=ax_loss.transAxes, ha="center",
                     va="center", color="gray")
    if positive:
        ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss")
    last_step = max(int(steps[-1]) for steps, _, _ in curves.values())
    wall_s = max(float(wall[-1]) for _, _, wall in curves.values())
    clients = "" if None in curves else f", {len(curves)} clients"
    ax_loss.set_title(f"{title}: {last_step} steps in {wall_s:.2f} s{clients}")
    if legend:
        ax_loss.legend(loc="upper right")


def draw_metrics(records: list[dict], title: str):
    """A matplotlib figure of loss per step (top) and steps/s (bottom): one line per client when the
    records carry ``client`` (the merged metrics of several clients, labelled), else one. Records with
    ``test_loss`` add the held-out loss to the top panel (markers), with other held-out scores
    (``test_accuracy``, the label owner's ``test_NAME`` metrics) a panel of them between the two, one
    line per score (and client), with ``lr`` a panel of the learning rate, and with privacy-meter figures
    a panel of them, above steps/s."""
    plt = _pyplot()
    curves = _curves(records)
    # With a validation split the evaluations during training are the validation rows' figures.
    kind = "validation" if any("validation_loss" in record for record in records) else "test"
    test_loss, rates = _held_out(records, f"{kind}_loss"), _held_out(records, "lr")
    names = sorted({key for record in records for key in record
                    if key.startswith(f"{kind}_") and key not in (f"{kind}_loss", f"{kind}_count")})
    scores = {name: _held_out(records, name) for name in names}
    leaks = _meter_figures(records)
    panels = 2 + bool(scores) + bool(rates) + bool(leaks)
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2 + 2 * panels), sharex=True)
    ax_loss, ax_rate = axes[0], axes[-1]
    # Each optional panel is None without its figures, and only drawn on when they exist.
    ax_scores: Any = axes[1] if scores else None
    ax_lr: Any = axes[-2 - bool(leaks)] if rates else None
    if leaks:
        _draw_leaks(axes[-2], records, leaks)
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
        _draw_scores(ax_scores, scores, names, client, line.get_color(), label)
        rate_steps, rate, window = _rate(steps, wall)
        ax_rate.plot(rate_steps, rate, lw=1, label=label, **({"color": "tab:orange"} if client is None else {}))
        positive = positive and bool(not np.isnan(loss).all() and np.nanmin(loss) > 0)
    _title_loss_panel(ax_loss, records, curves, title, positive, None not in curves or bool(test_loss))
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
    PNG, written to ``out`` as named), that names ``path``, or that cannot be written. ``out`` is written whole
    or not at all (``records.write_atomic``): a failure or a kill while drawing keeps the file that was there.
    """
    from distgrad.run.options import check_not_read
    from distgrad.stage.records import write_atomic

    records = read_metrics(path)
    import matplotlib.pyplot as plt

    fig = draw_metrics(records, path.name)
    try:
        formats = fig.canvas.get_supported_filetypes()
        suffix = out.suffix[1:].lower()
        if suffix and suffix not in formats:
            raise ConfigError(f"--out {out}: {suffix!r} is no image format matplotlib writes; use .png (or one of "
                              f"{', '.join(sorted(formats))})")
        check_not_read([("--out", out)], [("the metrics file", path)])
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            # exactly ``out``, no suffix added; under a temporary name first, so never seen half drawn
            write_atomic(out, lambda f: fig.savefig(f, dpi=100, format=suffix or "png"))
        except OSError as e:
            raise ConfigError(f"cannot write --out {out}: {e.strerror or e}") from e
    finally:
        plt.close(fig)
    return out
