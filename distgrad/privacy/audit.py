"""The offline audit's attacks, as pure numpy functions on the rows that crossed the cut.

``label_attacks`` plays the data owner against the label owner's labels:
from the activation-gradient rows it received and the true labels (which the
auditing label owner supplies), the live meter's figures, through the same
function (``leaks.label_figures``: on the same rows the audit and the meter
agree exactly), plus ``clustering_accuracy``: k-means of the rows, each cluster
matched to a label so that the most rows are right (no anchor needed).

``input_attacks`` plays the label owner against the data owner's inputs:
a decoder fitted on a public share of (activation, input) pairs, a linear
least-squares map and optionally a small MLP, maps the other activation
rows back to inputs; the figure is its reconstruction error against a
baseline that predicts the share's mean input. Every draw comes from the
``seed`` given, so an audit is repeatable.
"""

from __future__ import annotations

import itertools

import numpy as np

from distgrad.privacy import leaks

KMEANS_ITERATIONS = 100
KMEANS_RESTARTS = 4
MLP_HIDDEN, MLP_EPOCHS, MLP_LR = 64, 300, 1e-2


def _rows(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, np.float64)
    return rows.reshape(len(rows), -1)


def kmeans(rows: np.ndarray, k: int, seed: int) -> np.ndarray:
    """Cluster ids (0..k-1) of ``rows`` by k-means (Lloyd's iterations, k-means++ starts, the best of
    ``KMEANS_RESTARTS`` by within-cluster squared distance), drawn from ``seed``."""
    x = _rows(rows)
    if not 1 <= k <= len(x):
        raise ValueError(f"k-means of {len(x)} rows into {k} clusters")
    rng = np.random.default_rng(seed)
    best, best_cost = np.zeros(len(x), np.int64), np.inf
    for _ in range(KMEANS_RESTARTS):
        centres = x[[rng.integers(len(x))]]
        while len(centres) < k:          # k-means++: the next centre far from the ones chosen
            d = ((x[:, None, :] - centres[None]) ** 2).sum(-1).min(1)
            p = d / d.sum() if d.sum() > 0 else np.full(len(x), 1.0 / len(x))
            centres = np.vstack([centres, x[rng.choice(len(x), p=p)]])
        ids = np.zeros(len(x), np.int64)
        for iteration in range(KMEANS_ITERATIONS):
            d = ((x[:, None, :] - centres[None]) ** 2).sum(-1)
            new = d.argmin(1)
            if iteration and np.array_equal(new, ids):      # converged
                break
            ids = new
            centres = np.array([x[ids == c].mean(0) if (ids == c).any() else centres[c] for c in range(k)])
        cost = float(((x - centres[ids]) ** 2).sum())
        if cost < best_cost:
            best, best_cost = ids, cost
    return best


def clustering_accuracy(rows: np.ndarray, labels: np.ndarray, seed: int) -> float:
    """k-means of the directions of ``rows`` (each scaled to unit norm: a gradient row's size shrinks as
    training goes, its direction keeps its class) into as many clusters as ``labels`` has classes, then the
    accuracy of the
    best one-to-one matching of clusters to classes (Hungarian by exhaustion up to 8 classes, else each
    cluster takes its majority class, which can only score higher)."""
    y = np.asarray(labels).reshape(-1)
    classes = np.unique(y)
    x = _rows(rows)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    ids = kmeans(np.divide(x, norms, out=np.zeros_like(x), where=norms > leaks.TINY), len(classes), seed)
    counts = np.array([[np.sum((ids == c) & (y == label)) for label in classes] for c in range(len(classes))])
    if len(classes) <= 8:
        best = max(sum(counts[c, m] for c, m in enumerate(match))
                   for match in itertools.permutations(range(len(classes))))
    else:
        best = counts.max(1).sum()
    return float(best / len(y))


def label_attacks(rows: np.ndarray, labels: np.ndarray, seed: int = 0,
                  metered: np.ndarray | None = None) -> dict[str, float]:
    """What the data owner recovers of ``labels`` (one per row, class ids) from the activation-gradient
    ``rows`` it received: the live meter's figures (``leaks.label_figures``: ``label_recovery``,
    ``cosine_auc`` and, for the two classes 0 and 1, ``norm_auc`` and ``direction_auc``) of the rows the
    meter scores (``metered``: a boolean per row; default every row) and ``clustering_accuracy`` of every
    row, each with ``NAME_chance``. A figure that cannot be scored is left out (with one
    class, all of them). Raises ``ValueError`` for labels that are not class ids or do not pair with rows."""
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1 or labels.dtype.kind not in "iuf" or not np.array_equal(labels, np.round(labels)):
        raise ValueError("the label attacks need one class id per row (integer labels)")
    if len(labels) and labels.min() < 0:
        raise ValueError(f"class ids are whole numbers from 0, got {labels.min():g}")
    labels = labels.astype(np.int64)
    if len(labels) != len(rows):
        raise ValueError(f"{len(labels)} labels for {len(rows)} gradient rows")
    if metered is None:
        metered = np.ones(len(labels), bool)
    metered = np.asarray(metered, bool)
    if metered.shape != labels.shape:
        raise ValueError(f"{metered.shape[0] if metered.ndim else 0} metered flags for {len(labels)} rows")
    figures = leaks.label_figures(np.asarray(rows)[metered], labels[metered])
    if figures:
        figures["clustering_accuracy"] = clustering_accuracy(rows, labels, seed)
        figures["clustering_accuracy_chance"] = float(np.bincount(labels).max() / len(labels))
    return figures


def _fit_linear(z: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Least-squares weights (with a bias row) of ``x`` from ``z``."""
    return np.linalg.lstsq(np.hstack([z, np.ones((len(z), 1))]), x, rcond=None)[0]


def _fit_mlp(z: np.ndarray, x: np.ndarray, seed: int):
    """A one-hidden-layer tanh MLP from ``z`` to ``x`` (full-batch Adam on the mean squared error); returns
    the map it learned."""
    rng = np.random.default_rng(seed)
    mean, scale = z.mean(0), z.std(0) + 1e-8
    zs = (z - mean) / scale
    params = [rng.normal(0, 1 / np.sqrt(z.shape[1]), (z.shape[1], MLP_HIDDEN)), np.zeros(MLP_HIDDEN),
              rng.normal(0, 1 / np.sqrt(MLP_HIDDEN), (MLP_HIDDEN, x.shape[1])), x.mean(0)]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for t in range(1, MLP_EPOCHS + 1):
        h = np.tanh(zs @ params[0] + params[1])
        err = (h @ params[2] + params[3] - x) * (2.0 / x.size)
        dh = (err @ params[2].T) * (1 - h ** 2)
        grads = [zs.T @ dh, dh.sum(0), h.T @ err, err.sum(0)]
        for i, g in enumerate(grads):
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g * g
            params[i] -= MLP_LR * (m[i] / (1 - 0.9 ** t)) / (np.sqrt(v[i] / (1 - 0.999 ** t)) + 1e-8)
    return lambda q: np.tanh(((q - mean) / scale) @ params[0] + params[1]) @ params[2] + params[3]


def input_attacks(activations: np.ndarray, inputs: np.ndarray, public_fraction: float = 0.5, seed: int = 0,
                  mlp: bool = False, batches: list[int] | None = None,
                  metered: list[bool] | None = None) -> dict[str, float]:
    """What the label owner recovers of the data owner's ``inputs`` from the ``activations`` it received
    (paired rows): a seeded ``public_fraction`` of the rows is a public share the decoder is fitted on;
    on the other rows, ``linear_reconstruction_mse`` (least squares), with ``mlp`` also
    ``mlp_reconstruction_mse``, beside ``reconstruction_mse_chance`` (predicting the share's mean input);
    and the live meter's ``distance_correlation`` (``leaks.input_figures``, with its chance): the mean over
    ``batches`` (consecutive row counts, one per micro-batch; default: all rows as one) the meter scores
    (``metered``: a flag per batch; default every batch) of each one's statistic."""
    z, x = _rows(activations), _rows(inputs)
    if len(z) != len(x):
        raise ValueError(f"{len(z)} activation rows for {len(x)} input rows")
    if not 0 < public_fraction < 1:
        raise ValueError(f"the public share must be a fraction in (0, 1), got {public_fraction}")
    order = np.random.default_rng(seed).permutation(len(z))
    cut = int(round(public_fraction * len(z)))
    if cut < 2 or len(z) - cut < 1:
        raise ValueError(f"{len(z)} rows are too few to fit a decoder on a public share and test it")
    public, private = order[:cut], order[cut:]
    weights = _fit_linear(z[public], x[public])
    linear = np.hstack([z[private], np.ones((len(private), 1))]) @ weights
    figures = {"linear_reconstruction_mse": float(np.mean((linear - x[private]) ** 2)),
               "reconstruction_mse_chance": float(np.mean((x[public].mean(0) - x[private]) ** 2))}
    if mlp:
        decoder = _fit_mlp(z[public], x[public], seed)
        figures["mlp_reconstruction_mse"] = float(np.mean((decoder(z[private]) - x[private]) ** 2))
    bounds = np.cumsum([0] + list(batches if batches is not None else [len(z)]))
    if bounds[-1] != len(z):
        raise ValueError(f"batches of {bounds[-1]} rows for {len(z)} rows")
    flags = [True] * (len(bounds) - 1) if metered is None else list(metered)
    if len(flags) != len(bounds) - 1:
        raise ValueError(f"{len(flags)} metered flags for {len(bounds) - 1} batches")
    figures.update(leaks.input_figures([(x[a:b], z[a:b])
                                        for a, b, flag in zip(bounds[:-1], bounds[1:], flags) if flag]))
    return figures
