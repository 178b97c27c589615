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

from typing import Mapping

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


# The strongest attacks known, as the meters run them: a per-row average of every gradient row a data owner
# received, clustered from a few known rows; and the label owner's best linear decoder of the inputs.

KNOWN_ROWS_KEY = 33        # the seed of the known rows' draws (a constant: the figure is a function of its rows)
KMEANS_ITERATIONS = 30     # Lloyd's iterations of the anchored k-means at most (it stops once no row moves)
RIDGE_ALPHAS = (1e-6, 1e-4, 1e-2, 1e-1, 1.0)   # ridge strengths tried, times the activations' mean square
PUBLIC_EVERY = 5           # the label owner's public share: the rows whose number is a multiple of 5 (a fifth)


def anchored_recovery(rows: np.ndarray, labels: np.ndarray, known: int, draws: int = 1) -> float:
    """The accuracy of anchored k-means on the directions of ``rows`` (one per example, e.g. each row's mean
    received gradient), the mean over ``draws`` choices of the known rows (``_known_rows``; with one known row
    the result depends much on which, and the mean is what an attacker can expect): each class's
    centre starts at the mean of its known rows' directions, every row joins the centre its cosine is
    largest with (known rows stay in their class), centres move to their rows' mean, until no row moves.
    Scored on the rows not known; raises ``ValueError`` when every row is known or a class has one row."""
    x = _unit(_flat(rows))
    y = _labels(labels, len(x))
    classes = np.unique(y)
    if len(classes) < 2:
        raise ValueError("anchored k-means needs rows of two classes at least")
    anchors = np.stack([_known_rows(y, classes, known, draw) for draw in range(draws)])     # (draws, rows)
    if anchors.all(axis=1).any():
        raise ValueError("every row is known: no row left to score")
    index = np.searchsorted(classes, y)
    member = np.eye(len(classes))[index]                                                  # (rows, classes)
    # Every draw's k-means at once (draws x classes x elements centres): a few large products per iteration.
    known_members = anchors[:, :, None] * member[None]                                   # (draws, rows, classes)
    centres = (known_members.transpose(0, 2, 1) @ x) / known_members.sum(1)[:, :, None]
    assigned = np.full(anchors.shape, -1)
    for _ in range(KMEANS_ITERATIONS):
        norms = np.linalg.norm(centres, axis=2, keepdims=True)
        unit = np.divide(centres, norms, out=np.zeros_like(centres), where=norms > TINY)
        new = np.argmax(x @ unit.transpose(0, 2, 1), axis=2)
        new = np.where(anchors, index[None], new)
        if np.array_equal(new, assigned):
            break
        assigned = new
        onehot = np.eye(len(classes))[assigned]                                           # (draws, rows, classes)
        counts = onehot.sum(1)
        sums = onehot.transpose(0, 2, 1) @ x
        centres = np.where(counts[:, :, None] > 0, sums / np.maximum(counts, 1.0)[:, :, None], centres)
    right = (assigned == index[None]) & ~anchors
    return float(np.mean(right.sum(1) / (~anchors).sum(1)))


def _known_rows(y: np.ndarray, classes: np.ndarray, known: int, draw: int) -> np.ndarray:
    """Draw ``draw``'s known rows: ``known`` rows of each class chosen by a permutation of its rows seeded with
    the draw alone (so the same rows give the same figure; rows of one class that are neighbours in the data,
    often alike, are not taken together)."""
    anchors = np.zeros(len(y), bool)
    rng = np.random.default_rng([KNOWN_ROWS_KEY, draw])     # one stream for every class: independent choices
    for c in classes:
        anchors[rng.permutation(np.flatnonzero(y == c))[:known]] = True
    return anchors


def few_shot_accuracy(rows: np.ndarray, labels: np.ndarray, known: int, draws: int = 1) -> float:
    """Model completion: the accuracy of a nearest-class-mean classifier fitted on ``known`` rows of each class
    (features standardised by the known rows' mean and spread) over every other row; the mean over ``draws``
    choices of the known rows, as ``anchored_recovery`` chooses them. Raises ``ValueError`` when every
    row is known or fewer than two classes are given."""
    x = _flat(rows)
    y = _labels(labels, len(x))
    classes = np.unique(y)
    if len(classes) < 2:
        raise ValueError("a classifier needs rows of two classes at least")
    scores = []
    for draw in range(draws):
        anchors = _known_rows(y, classes, known, draw)
        if anchors.all():
            raise ValueError("every row is known: no row left to score")
        mean, scale = x[anchors].mean(0), x[anchors].std(0) + 1e-8
        z = (x - mean) / scale
        centres = np.stack([z[anchors & (y == c)].mean(0) for c in classes])
        distances = (z[~anchors] ** 2).sum(1)[:, None] - 2 * z[~anchors] @ centres.T + (centres ** 2).sum(1)[None]
        scores.append(np.mean(classes[np.argmin(distances, axis=1)] == y[~anchors]))
    return float(np.mean(scores))


class RidgeStats:
    """What a ridge decoder of inputs from activations needs of a set of (activation, input) row pairs, summed
    over the rows (float64): ``zz`` (activations with a constant 1 appended, Gram), ``zx`` (their products
    with the inputs), ``xx`` (the inputs' total sum of squares), ``xsum`` and ``count``. Adding rows and
    merging sets are sums, so the stats of a whole run cost no more memory than one step's."""

    def __init__(self) -> None:
        self.count = 0
        self.zz, self.zx, self.xsum = np.zeros((0, 0)), np.zeros((0, 0)), np.zeros(0)
        self.xx = 0.0

    def add(self, z: np.ndarray, x: np.ndarray) -> None:
        """Rows ``z`` (activations) paired with rows ``x`` (inputs), each flattened."""
        z1, xf = _flat(z), _flat(x)
        if len(z1) != len(xf):
            raise ValueError(f"{len(z1)} activation rows for {len(xf)} input rows")
        z1 = np.hstack([z1, np.ones((len(z1), 1))])
        if self.count == 0:
            self.zz, self.zx = np.zeros((z1.shape[1], z1.shape[1])), np.zeros((z1.shape[1], xf.shape[1]))
            self.xsum = np.zeros(xf.shape[1])
        elif self.zz.shape[0] != z1.shape[1] or self.zx.shape[1] != xf.shape[1]:
            raise ValueError("rows of another width than the ones added before")
        self.zz = self.zz + z1.T @ z1
        self.zx = self.zx + z1.T @ xf
        self.xx += float(np.sum(xf * xf))
        self.xsum = self.xsum + xf.sum(0)
        self.count += len(z1)

    def merged(self, other: "RidgeStats") -> "RidgeStats":
        """The stats of both sets of rows."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        out = RidgeStats()
        out.count, out.xx = self.count + other.count, self.xx + other.xx
        out.zz, out.zx, out.xsum = self.zz + other.zz, self.zx + other.zx, self.xsum + other.xsum
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        """The stats as arrays (``count``, ``xx``, ``zz``, ``zx``, ``xsum``), which ``from_arrays`` reads back
        bit for bit: what a checkpoint keeps of them."""
        return {"count": np.array(self.count, np.int64), "xx": np.array(self.xx, np.float64), "zz": self.zz,
                "zx": self.zx, "xsum": self.xsum}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> "RidgeStats":
        """The stats ``arrays`` gave; ``ValueError`` naming what is missing or of the wrong shape."""
        missing = sorted({"count", "xx", "zz", "zx", "xsum"} - set(arrays))
        if missing:
            raise ValueError(f"ridge statistics without {missing}")
        stats = cls()
        stats.count, stats.xx = int(arrays["count"]), float(arrays["xx"])
        stats.zz, stats.zx, stats.xsum = (np.array(arrays[name], np.float64) for name in ("zz", "zx", "xsum"))
        if stats.count < 0 or stats.zz.ndim != 2 or stats.zx.ndim != 2 or stats.xsum.ndim != 1 or \
                stats.zz.shape[0] != stats.zz.shape[1] or stats.zx.shape != (stats.zz.shape[0], len(stats.xsum)):
            raise ValueError(f"ridge statistics of {stats.count} rows with zz {stats.zz.shape}, zx {stats.zx.shape} "
                             f"and xsum {stats.xsum.shape}: not one set of rows")
        return stats


def ridge_r2(public: RidgeStats, private: RidgeStats) -> float:
    """The reconstruction R^2 of the private rows' inputs by the best ridge decoder (an affine map, its bias
    not penalised) fitted on the public rows: 1 - (squared error) / (squared deviation from the private rows'
    mean input), pooled over every input element; the best over ``RIDGE_ALPHAS`` (times the public
    activations' mean square). 0 is what the private mean predicts; raises ``ValueError`` without rows on
    either side or when the private inputs do not vary."""
    if public.count < 2 or private.count < 1:
        raise ValueError(f"a decoder needs public rows ({public.count}) and private rows ({private.count})")
    total = private.xx - float(private.xsum @ private.xsum) / private.count
    if total <= TINY:
        raise ValueError("the private inputs do not vary: nothing to reconstruct")
    width = public.zz.shape[0] - 1
    penalty = np.eye(width + 1)
    penalty[-1, -1] = 0.0
    scale = max(float(np.trace(public.zz[:-1, :-1])) / max(width * public.count, 1), TINY)
    best = -np.inf
    for alpha in RIDGE_ALPHAS:
        w = np.linalg.solve(public.zz + alpha * scale * public.count * penalty, public.zx)
        error = private.xx - 2.0 * float(np.vdot(w, private.zx)) + float(np.vdot(w, private.zz @ w))
        best = max(best, 1.0 - max(error, 0.0) / total)
    return float(best)


def public_rows(rows: np.ndarray) -> np.ndarray:
    """Which of the row numbers ``rows`` are in the label owner's public share (a multiple of ``PUBLIC_EVERY``)."""
    return np.asarray(rows).reshape(-1) % PUBLIC_EVERY == 0
