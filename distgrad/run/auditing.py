"""``distgrad audit``: a run's recorded view of the cut, read and attacked as the other party would.

The view is a trace (``--trace``) holding what crossed on its traced steps,
exactly as the receiver decoded it (after the sender's defenses and codec):
``sent_activation_grad`` (the label owner's, what the data owner received) and
``sent_activation`` (the data owner's, what the label owner received). The
secret rows they belong to come from the experiment's own data, rebuilt with
the run's seed, as the meter takes them: the label owner's true labels of
each traced step, the data owner's raw input rows. The attacks are
``distgrad.privacy.audit``'s. Bad files and settings raise ``ConfigError``
(exit 2) naming what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from distgrad.config.parse import load_experiment
from distgrad.errors import ConfigError
from distgrad.privacy import audit
from distgrad.stage.records import read_trace

LABEL_VIEW, INPUT_VIEW = "sent_activation_grad", "sent_activation"


def _trace_lines(path: Path) -> list[dict[str, Any]]:
    try:
        lines = read_trace(path)
    except FileNotFoundError:
        raise ConfigError(f"audit: no trace file {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"audit: {path} is not a trace (one JSON object a line, as --trace writes): {e}") from None
    if not all(isinstance(line, dict) and isinstance(line.get("step"), int) for line in lines):
        raise ConfigError(f"audit: {path} is not a trace: every line must be an object with an integer 'step'")
    return lines


def _view(lines: list[dict[str, Any]], name: str, first: int, last: int | None,
          path: Path) -> list[tuple[int, np.ndarray]]:
    """The traced steps in [first, last] that hold ``name``, with its rows."""
    view = []
    for line in lines:
        step, grads = line["step"], line.get("grads", {})
        if name in grads and step >= first and (last is None or step <= last):
            try:
                rows = np.asarray(grads[name], np.float64)
            except (TypeError, ValueError):
                raise ConfigError(f"audit: {path}: step {step}'s {name} is not an array of numbers") from None
            if rows.ndim < 1 or not np.isfinite(rows).all():
                raise ConfigError(f"audit: {path}: step {step}'s {name} is not a finite array of rows")
            view.append((step, rows))
    return view


def run_audit(experiment: str, trace: Path, seed: int | None = None, first: int = 1, last: int | None = None,
              public_fraction: float = 0.5, mlp: bool = False) -> dict[str, dict[str, float]]:
    """The audit of the run of ``experiment`` (a name, an experiment file or the auditing party's stage
    file; ``seed``: the run's, default the experiment's) recorded in ``trace``, over its traced steps
    ``first`` to ``last``: ``{"labels": figures, "inputs": figures}``, each present when the trace holds
    that view and ``experiment`` defines the stage whose secret it is (a stage file: its own). Raises ``ConfigError`` for a missing or malformed trace, one that holds neither view, an
    experiment whose data cannot pair with it, or bad settings."""
    exp = load_experiment(experiment)
    if exp.federated or exp.vertical:
        raise ConfigError("audit: experiments with [clients] or feature parties are not supported yet "
                          "(the audit pairs one data owner's rows with one label owner's)")
    if len(exp.stage_names) < 2:
        raise ConfigError("audit: a one-stage experiment has no cut to audit")
    seed = exp.seed if seed is None else seed
    lines = _trace_lines(trace)
    report: dict[str, dict[str, float]] = {}
    # A party's stage file holds only its own data: it audits what the other party learns of its secret.
    labels_view = _view(lines, LABEL_VIEW, first, last, trace) if exp.has_stage(exp.label_owner) else []
    if labels_view:
        data = exp.build_data(seed, stage=exp.label_owner)
        rows, labels = _paired(labels_view, data.true_targets, "labels", trace)
        try:
            report["labels"] = audit.label_attacks(rows, labels, seed)
        except ValueError as e:
            raise ConfigError(f"audit: the labels of {exp.label_owner!r} cannot be attacked: {e}") from None
    inputs_view = _view(lines, INPUT_VIEW, first, last, trace) if exp.has_stage(exp.data_owners[0]) else []
    if inputs_view:
        data = exp.build_data(seed, stage=exp.data_owners[0])
        z, x = _paired(inputs_view, data.features, "input rows", trace)
        try:
            report["inputs"] = audit.input_attacks(z, x, public_fraction, seed, mlp,
                                                   batches=[len(rows) for _, rows in inputs_view])
        except ValueError as e:
            raise ConfigError(f"audit: the inputs cannot be attacked: {e}") from None
    if not report:
        views = [name for name, owner in ((LABEL_VIEW, exp.label_owner), (INPUT_VIEW, exp.data_owners[0]))
                 if exp.has_stage(owner)]
        raise ConfigError(f"audit: {trace} holds no {' or '.join(views)} on steps {first} to "
                          f"{'the last' if last is None else last}, which is what {experiment}'s data can be "
                          f"paired with: trace the run with --trace (and, with --trace-params, name "
                          f"{' or '.join(views)})")
    return report


def _paired(view: list[tuple[int, np.ndarray]], secret_of: Any, what: str,
            path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The view's rows and the secret rows of the same steps, stacked; ``ConfigError`` when they do not pair
    (the trace is of another experiment or seed)."""
    rows, secrets = [], []
    for step, sent in view:
        secret = np.asarray(secret_of(step))
        if len(secret) != len(sent):
            raise ConfigError(f"audit: {path}: step {step} sent {len(sent)} rows but the experiment's {what} of "
                              f"that step are {len(secret)}: is the trace of this experiment and --seed?")
        rows.append(sent.reshape(len(sent), -1))
        secrets.append(secret.reshape(len(secret), -1) if secret.ndim > 1 else secret)
    return np.concatenate(rows), np.concatenate(secrets)


def audit_text(report: dict[str, dict[str, float]]) -> str:
    """The report as lines: ``labels: label_recovery 1.000 (chance 0.100), ...``."""
    out = []
    for view, figures in report.items():
        shown = [f"{name} {value:.3f} (chance {figures[name + '_chance']:.3f})"
                 for name, value in figures.items() if not name.endswith("_chance") and name + "_chance" in figures]
        shown += [f"{name} {value:.4f} (chance {figures['reconstruction_mse_chance']:.4f})"
                  for name, value in figures.items() if name.endswith("_reconstruction_mse")]
        out.append(f"{view}: " + ", ".join(shown))
    return "\n".join(out)
