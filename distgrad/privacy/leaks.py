"""What the rows that cross the cut give away: attacks and measures, as pure numpy functions.

The label owner's measures take the activation-gradient rows the data owner
received (one per example, any shape after the batch axis, flattened) and
the true labels of those rows; the data owner's take its raw input rows and
the activation rows it sent. Every function is deterministic, changes
nothing it is given, and raises ``ValueError`` for inputs it cannot score
(mismatched rows, fewer than two classes where two are needed). The live
meter (``distgrad.privacy.meter``) and the offline audit call these, so the
two agree by construction.

Chance levels are what an attacker without the leak scores: 1/k for the
nearest-anchor attack over k classes, 0.5 for every AUC, and for the
distance correlation the same statistic with the rows' pairing broken
(``distance_correlation_chance``: each input row paired with the next
row's activation), which is what the (biased) sample statistic shows for
independent rows of that size.

References: Li et al., "Label Leakage and Protection in Two-party Split
Learning", ICLR 2022 (norm and direction leaks); Vepakomma et al.,
"NoPeek", 2020, and Szekely, Rizzo and Bakirov, 2007 (distance correlation).
"""

from __future__ import annotations

import numpy as np

TINY = 1e-30        # norms below this count as zero (a zero row has cosine 0 with everything)
PAIR_ROWS = 2048    # cosine_auc scores the pairs of at most this many rows, evenly spaced over all it is given
                    # (n^2/2 pairs are sorted: 2048 rows are about 2.1 million pairs, a fraction of a second)


def _flat(rows: np.ndarray) -> np.ndarray:
    """``rows`` as a float64 matrix, one row per example."""
    rows = np.asarray(rows)
    if rows.ndim < 1 or len(rows) == 0:
        raise ValueError("no rows to score")
    return rows.reshape(len(rows), -1).astype(np.float64)


def _labels(labels: np.ndarray, count: int) -> np.ndarray:
    """Class labels as a 1-D integer array of ``count`` entries (one-hot rows become their argmax)."""
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] > 1:
        labels = labels.argmax(axis=1)
    labels = labels.reshape(-1)
    if len(labels) != count:
        raise ValueError(f"{len(labels)} labels for {count} rows")
    return labels.astype(np.int64)


def _unit(rows: np.ndarray) -> np.ndarray:
    """Each row divided by its norm (zero rows stay zero)."""
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return np.divide(rows, norms, out=np.zeros_like(rows), where=norms > TINY)


def auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """The area under the ROC curve of ``scores`` for the boolean ``positive``: the Mann-Whitney U count,
    P(score of a positive > score of a negative) + P(tie) / 2. Raises ``ValueError`` without both kinds."""
    scores = np.asarray(scores, np.float64).reshape(-1)
    positive = np.asarray(positive, bool).reshape(-1)
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("an AUC needs positive and negative examples")
    order = np.argsort(scores)          # ties get their average rank, whatever their order
    ordered = scores[order]
    ranks = np.empty(len(scores), np.float64)
    # average ranks (1-based) over ties
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], len(ordered)]
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    u = ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def label_recovery(rows: np.ndarray, labels: np.ndarray) -> float:
    """The accuracy of the nearest-anchor attack: the first row of each class is a known anchor; every other
    row is given the class of the anchor its cosine is largest with (ties: the lowest class). Scored on the
    rows that are not anchors; raises ``ValueError`` when every row is an anchor."""
    x = _unit(_flat(rows))
    y = _labels(labels, len(x))
    classes, first = np.unique(y, return_index=True)
    others = np.setdiff1d(np.arange(len(y)), first)
    if len(others) == 0:
        raise ValueError("every row is an anchor: no row left to score")
    guess = classes[np.argmax(x[others] @ x[first].T, axis=1)]
    return float(np.mean(guess == y[others]))


def label_recovery_chance(labels: np.ndarray) -> float:
    """A guess among the anchors' k classes: 1/k."""
    return 1.0 / len(np.unique(_labels(labels, len(np.asarray(labels)))))


def spread(count: int, most: int) -> np.ndarray:
    """Indices of at most ``most`` of ``count`` rows, evenly spaced from the first to the last (all of them
    when ``count <= most``): a sample that covers the whole range, the same for the same ``count``."""
    if count <= most:
        return np.arange(count)
    return np.round(np.linspace(0, count - 1, most)).astype(np.int64)


def cosine_auc(rows: np.ndarray, labels: np.ndarray, max_rows: int = PAIR_ROWS) -> float:
    """The AUC of "same label" over every pair of distinct rows, scored by the cosine of their rows; beyond
    ``max_rows`` rows, over the pairs of ``max_rows`` rows evenly spaced over all of them (``spread``), so the
    figure always covers the whole range given. Raises ``ValueError`` when every pair is of one kind."""
    x = _unit(_flat(rows))
    y = _labels(labels, len(x))
    kept = spread(len(x), max_rows)
    x, y = x[kept], y[kept]
    upper = np.triu_indices(len(x), k=1)
    return auc((x @ x.T)[upper], (y[:, None] == y[None, :])[upper])


def _two_classes(labels: np.ndarray, count: int) -> np.ndarray:
    """Two-class labels as booleans (True: class 1, the positive class of Li et al.)."""
    y = _labels(labels, count)
    if not set(np.unique(y).tolist()) <= {0, 1}:
        raise ValueError("the norm and direction leaks are defined for two classes (labels 0 and 1)")
    return y == 1


def norm_auc(rows: np.ndarray, labels: np.ndarray) -> float:
    """Li et al.'s norm leak: the AUC of a row's gradient norm as the score of label 1."""
    x = _flat(rows)
    return auc(np.linalg.norm(x, axis=1), _two_classes(labels, len(x)))


def direction_auc(rows: np.ndarray, labels: np.ndarray) -> float:
    """Li et al.'s direction (cosine) leak: the first row of label 1 is known; every other row is scored
    by its cosine with it, as the score of label 1. Raises ``ValueError`` without a row of label 1."""
    x = _unit(_flat(rows))
    positive = _two_classes(labels, len(x))
    if not positive.any():
        raise ValueError("no row of label 1 to take as the known one")
    known = int(np.argmax(positive))
    others = np.arange(len(x)) != known
    return auc(x[others] @ x[known], positive[others])


AUC_CHANCE = 0.5


def centred_distances(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairwise Euclidean distances of ``rows`` (each row flattened, in float64) and their double-centred
    matrix (symmetric: its row and column means agree). The one computation behind every distance
    correlation: the meter's and the audit's here, NoPeek's and its gradient in ``defenses``."""
    flat = _flat(rows)
    squared = np.einsum("ij,ij->i", flat, flat)
    d = np.sqrt(np.maximum(squared[:, None] + squared[None, :] - 2.0 * (flat @ flat.T), 0.0))
    np.fill_diagonal(d, 0.0)
    means = d.sum(axis=0) / len(d)
    return d, d - means[None, :] - means[:, None] + means.sum() / len(d)


def _dcor(a: np.ndarray, b: np.ndarray) -> float:
    """The distance correlation of two double-centred distance matrices of the same rows."""
    dcov, var_x, var_z = np.vdot(a, b), np.vdot(a, a), np.vdot(b, b)      # each n^2 times the mean
    if var_x <= 0 or var_z <= 0:
        return 0.0
    return float(np.sqrt(max(dcov, 0.0) / np.sqrt(var_x * var_z)))


def _centred_pair(x: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = centred_distances(x)[1], centred_distances(z)[1]
    if len(a) != len(b):
        raise ValueError(f"{len(a)} input rows paired with {len(b)} activation rows")
    return a, b


def distance_correlation(x: np.ndarray, z: np.ndarray) -> float:
    """The sample distance correlation of paired rows ``x`` and ``z`` (Szekely et al. 2007; NoPeek's
    measure): in [0, 1], 0 when either side is constant."""
    return _dcor(*_centred_pair(x, z))


def distance_correlation_chance(x: np.ndarray, z: np.ndarray) -> float:
    """The distance correlation with the pairing broken: input row i with activation row i+1 (cyclically)."""
    return distance_correlations(x, z)[1]


def distance_correlations(x: np.ndarray, z: np.ndarray) -> tuple[float, float]:
    """``distance_correlation`` and ``distance_correlation_chance`` of ``x`` and ``z``, from one pair of
    distance matrices (the broken pairing permutes ``z``'s rows and columns alike)."""
    a, b = _centred_pair(x, z)
    shift = np.roll(np.arange(len(b)), -1)
    return _dcor(a, b), _dcor(a, b[np.ix_(shift, shift)])


def label_figures(rows: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The label owner's figures of the activation-gradient ``rows`` and their class ``labels`` (one per
    row, or one-hot rows), each beside ``NAME_chance``: ``label_recovery`` (chance 1/k) and ``cosine_auc``,
    and when the labels are the two classes 0 and 1 ``norm_auc`` and ``direction_auc`` (chance 0.5). With
    fewer than two classes nothing can be scored (empty); a figure these rows cannot score is left out.
    The one definition of the figures that the live meter and the offline audit both report."""
    y = _labels(labels, len(_flat(rows)))
    classes = np.unique(y)
    if len(classes) < 2:
        return {}
    measures = [("label_recovery", label_recovery, 1.0 / len(classes)), ("cosine_auc", cosine_auc, AUC_CHANCE)]
    if classes.tolist() == [0, 1]:
        measures += [("norm_auc", norm_auc, AUC_CHANCE), ("direction_auc", direction_auc, AUC_CHANCE)]
    figures: dict[str, float] = {}
    for name, measure, chance in measures:
        try:
            figures[name] = measure(rows, y)
        except ValueError:
            continue                     # not scorable on these rows
        figures[f"{name}_chance"] = chance
    return figures


def input_figures(batches: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """The data owner's figures of its (input rows, activation rows) ``batches``, one pair per micro-batch:
    ``distance_correlation``, the mean over the micro-batches of more than one row of each one's statistic,
    beside ``distance_correlation_chance`` (the same mean with the pairing broken); empty when no micro-batch
    has two rows. The one definition that the live meter and the offline audit both report."""
    pairs = [distance_correlations(x, z) for x, z in batches if len(x) > 1]
    if not pairs:
        return {}
    return {"distance_correlation": float(np.mean([dcor for dcor, _ in pairs])),
            "distance_correlation_chance": float(np.mean([chance for _, chance in pairs]))}
