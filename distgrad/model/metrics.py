"""Held-out scores beyond the loss: the label owner's ``metrics = [...]``, and which way each one improves.

Every metric is computed in float64 from the last stage's float32 output on the
held-out rows, with scikit-learn's definitions:

- ``accuracy``: the share of rows whose largest score is the right class
  (``accuracy_score``); a classifying loss only.
- ``precision``, ``recall``, ``f1``: with two classes, of class 1 (scikit-learn's
  default ``average="binary"``, ``pos_label=1``); with more, the unweighted mean
  over the classes that occur in the labels or the predictions
  (``average="macro"``). A ratio whose denominator is 0 counts as 0
  (``zero_division=0``, what scikit-learn's default warns and returns).
- ``auc``: the area under the ROC curve of the softmax probability (ties share
  their ranks, as ``roc_auc_score``); with two classes, of class 1; with more,
  one class against the rest, the unweighted mean over the classes that occur
  in the labels (``multi_class="ovr", average="macro"``). Undefined (None) when
  the held-out labels hold a single class.
- ``mse``, ``mae``: the mean over every element of the squared and absolute
  difference between output and target (``mean_squared_error``,
  ``mean_absolute_error``); a loss whose target is shaped like its output only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from distgrad.errors import ConfigError

CLASSIFYING = ("accuracy", "auc", "f1", "precision", "recall")
REGRESSING = ("mse", "mae")
METRICS = CLASSIFYING + REGRESSING
LOWER_IS_BETTER = frozenset({"loss", "mse", "mae"})     # every other score is better higher


def check_metrics(names: Sequence[str], classifies: bool, where: str) -> None:
    """Raise ``ConfigError`` unless ``names`` are distinct known metrics that fit the loss (class ids or
    targets shaped like the output)."""
    unknown = [n for n in names if n not in METRICS]
    if unknown:
        raise ConfigError(f"{where}: unknown metrics {unknown}; known: {list(METRICS)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: 'metrics' names a metric twice: {list(names)}")
    misfit = [n for n in names if (n in REGRESSING) == classifies]
    if misfit:
        kind = "a loss of class ids" if classifies else "a loss whose targets are shaped like its output"
        fit = CLASSIFYING if not classifies else REGRESSING
        raise ConfigError(f"{where}: metrics {misfit} do not fit {kind}; {list(fit)} need the other kind of loss")


def score(names: Sequence[str], output: np.ndarray, target: np.ndarray) -> dict[str, float | None]:
    """``{name: value}`` of each metric in ``names`` for ``output`` (scores ``(rows, classes)`` when
    classifying, else shaped like ``target``) against ``target`` (class ids ``(rows,)``, or values)."""
    out: dict[str, float | None] = {}
    if any(n in CLASSIFYING for n in names):
        scores = np.asarray(output, dtype=np.float64).reshape(len(output), -1)
        truth = np.asarray(target).reshape(-1)
        predicted = scores.argmax(axis=1)
        for name in (n for n in names if n in CLASSIFYING):
            out[name] = (float(np.mean(predicted == truth)) if name == "accuracy"
                         else _auc(scores, truth) if name == "auc"
                         else _precision_recall_f1(predicted, truth, scores.shape[1])[name])
    if any(n in REGRESSING for n in names):
        diff = np.asarray(output, dtype=np.float64) - np.asarray(target, dtype=np.float64)
        for name in (n for n in names if n in REGRESSING):
            out[name] = float(np.mean(diff * diff) if name == "mse" else np.mean(np.abs(diff)))
    return {name: out[name] for name in names}


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _precision_recall_f1(predicted: np.ndarray, truth: np.ndarray, classes: int) -> dict[str, float]:
    """Binary (class 1) with two classes, else the macro mean over the classes seen in either."""
    labels = [1] if classes == 2 else sorted(set(truth.tolist()) | set(predicted.tolist()))
    per = []
    for c in labels:
        tp = float(np.sum((predicted == c) & (truth == c)))
        precision = _ratio(tp, float(np.sum(predicted == c)))
        recall = _ratio(tp, float(np.sum(truth == c)))
        per.append((precision, recall, _ratio(2 * tp, float(np.sum(predicted == c) + np.sum(truth == c)))))
    precision, recall, f1 = (float(np.mean([p[i] for p in per])) for i in range(3))
    return {"precision": precision, "recall": recall, "f1": f1}


def _auc(scores: np.ndarray, truth: np.ndarray) -> float | None:
    """ROC AUC of the softmax probabilities: class 1 with two classes, else one-vs-rest, macro."""
    shifted = np.exp(scores - scores.max(axis=1, keepdims=True))
    prob = shifted / shifted.sum(axis=1, keepdims=True)
    if len(set(truth.tolist())) < 2:
        return None
    if scores.shape[1] == 2:
        return _binary_auc(prob[:, 1], truth == 1)
    return float(np.mean([_binary_auc(prob[:, c], truth == c) for c in sorted(set(truth.tolist()))]))


def _binary_auc(score_: np.ndarray, positive: np.ndarray) -> float:
    """The Mann-Whitney statistic with average ranks for ties: the trapezoidal ROC area."""
    order = np.argsort(score_, kind="mergesort")
    ranked = score_[order]
    ranks = np.empty(len(score_), dtype=np.float64)
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    ends = np.r_[starts[1:], len(ranked)]
    for start, end in zip(starts, ends):
        ranks[order[start:end]] = (start + end + 1) / 2.0      # the mean of the 1-based ranks start+1..end
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
