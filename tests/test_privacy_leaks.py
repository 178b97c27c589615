"""The leak measures (distgrad.privacy.leaks) against brute-force and textbook computations."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from distgrad.privacy import leaks


def _brute_auc(scores, positive):
    pos = [s for s, p in zip(scores, positive) if p]
    neg = [s for s, p in zip(scores, positive) if not p]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def _cos(a, b):
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return 0.0 if na == 0 or nb == 0 else float(a @ b / (na * nb))


def test_auc_is_the_mann_whitney_count_with_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 40).astype(float)       # many ties
    positive = rng.random(40) < 0.4
    assert leaks.auc(scores, positive) == pytest.approx(_brute_auc(scores, positive), abs=1e-12)
    with pytest.raises(ValueError, match="positive and negative"):
        leaks.auc([1.0, 2.0], [True, True])


def test_label_recovery_is_the_nearest_anchor_by_cosine():
    rng = np.random.default_rng(1)
    rows, labels = rng.normal(size=(30, 4)), rng.integers(0, 3, 30)
    anchors = {}
    for i, y in enumerate(labels):
        anchors.setdefault(int(y), i)
    hits, scored = 0, 0
    for i, y in enumerate(labels):
        if i in anchors.values():
            continue
        best = max(sorted(anchors), key=lambda c: (_cos(rows[i], rows[anchors[c]]), -c))
        hits += best == y
        scored += 1
    assert leaks.label_recovery(rows, labels) == pytest.approx(hits / scored)
    assert leaks.label_recovery_chance(labels) == pytest.approx(1 / 3)
    onehot = np.eye(3)[labels]
    assert leaks.label_recovery(rows, onehot) == leaks.label_recovery(rows, labels)


def test_label_recovery_of_rows_that_point_by_class_is_perfect():
    labels = np.arange(20) % 4
    rows = np.eye(4)[labels] * np.linspace(1, 3, 20)[:, None]
    assert leaks.label_recovery(rows, labels) == 1.0
    with pytest.raises(ValueError, match="every row is an anchor"):
        leaks.label_recovery(rows[:4], labels[:4])


def test_cosine_auc_over_every_pair():
    rng = np.random.default_rng(2)
    rows, labels = rng.normal(size=(15, 3)), rng.integers(0, 3, 15)
    pairs = list(itertools.combinations(range(15), 2))
    expected = _brute_auc([_cos(rows[i], rows[j]) for i, j in pairs], [labels[i] == labels[j] for i, j in pairs])
    assert leaks.cosine_auc(rows, labels) == pytest.approx(expected, abs=1e-12)


def test_norm_and_direction_auc_as_li_et_al_define_them():
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 2, 25)
    rows = rng.normal(size=(25, 2)) + np.where(labels[:, None] == 1, 1.0, -0.5)
    norms = np.linalg.norm(rows, axis=1)
    assert leaks.norm_auc(rows, labels) == pytest.approx(_brute_auc(norms, labels == 1), abs=1e-12)
    known = int(np.flatnonzero(labels == 1)[0])
    others = [i for i in range(25) if i != known]
    expected = _brute_auc([_cos(rows[i], rows[known]) for i in others], [labels[i] == 1 for i in others])
    assert leaks.direction_auc(rows, labels) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="two classes"):
        leaks.norm_auc(rows, labels + 1)


def test_binary_gradients_leak_their_labels_by_direction():
    """The gradient of a sigmoid cross-entropy at one logit is p - y: its sign is the label's."""
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 2, 50)
    p = rng.uniform(0.05, 0.95, 50)
    rows = (p - labels)[:, None] * rng.uniform(0.5, 1.0, (50, 1))
    assert leaks.direction_auc(rows, labels) == 1.0


def _textbook_dcor(x, z):
    n = len(x)

    def centred(v):
        d = np.array([[np.linalg.norm(v[i] - v[j]) for j in range(n)] for i in range(n)])
        return d - d.mean(0) - d.mean(1)[:, None] + d.mean()
    a, b = centred(x), centred(z)
    return np.sqrt((a * b).sum() / n ** 2 / np.sqrt((a * a).sum() / n ** 2 * (b * b).sum() / n ** 2))


def test_distance_correlation_is_szekelys():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(20, 5))
    z = np.tanh(x @ rng.normal(size=(5, 3)))
    assert leaks.distance_correlation(x, z) == pytest.approx(_textbook_dcor(x, z), abs=1e-9)
    assert leaks.distance_correlation(x, 2 * x + 1) == pytest.approx(1.0)
    assert leaks.distance_correlation(x, np.ones((20, 3))) == 0.0
    assert leaks.distance_correlation_chance(x, z) == pytest.approx(_textbook_dcor(x, np.roll(z, -1, 0)), abs=1e-9)
    assert leaks.distance_correlation_chance(x, z) < leaks.distance_correlation(x, z)


def _pairs_auc(rows, labels):
    """An independent oracle: the AUC of "same label" by cosine over every pair of ``rows``, counted
    pair against pair (vectorised Mann-Whitney, ties half)."""
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    i, j = np.triu_indices(len(rows), k=1)
    scores, same = np.sum(unit[i] * unit[j], axis=1), labels[i] == labels[j]
    pos, neg = scores[same], scores[~same]
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum())
                 / (len(pos) * len(neg)))


def test_cosine_auc_scores_every_row_it_is_given_not_the_first_96():
    """Rows whose first 96 point by class and whose later ones are noise: the figure is that of all the
    pairs, not 1.0 (what the first 96 alone give)."""
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 3, 160)
    rows = np.eye(3)[labels] + rng.normal(scale=0.01, size=(160, 3))
    rows[96:] = rng.normal(size=(64, 3))
    assert leaks.cosine_auc(rows[:96], labels[:96]) == 1.0
    whole = leaks.cosine_auc(rows, labels)
    assert whole == pytest.approx(_pairs_auc(rows, labels), abs=1e-12) and whole < 0.95


def test_cosine_auc_beyond_its_row_cap_scores_rows_spread_over_the_whole_range():
    rng = np.random.default_rng(5)
    labels = rng.integers(0, 2, 100)
    rows = rng.normal(size=(100, 4)) + labels[:, None]
    kept = leaks.spread(100, 10)
    assert kept[0] == 0 and kept[-1] == 99 and len(np.unique(kept)) == 10
    assert list(leaks.spread(7, 10)) == list(range(7))
    assert leaks.cosine_auc(rows, labels, max_rows=10) == pytest.approx(_pairs_auc(rows[kept], labels[kept]),
                                                                       abs=1e-12)


def test_the_figure_sets_leave_out_what_cannot_be_scored():
    rows = np.random.default_rng(6).normal(size=(8, 3))
    assert leaks.label_figures(rows, np.zeros(8, np.int64)) == {}           # one class: nothing to tell apart
    figures = leaks.label_figures(rows, np.arange(8) % 3)
    assert set(figures) == {"label_recovery", "label_recovery_chance", "cosine_auc", "cosine_auc_chance"}
    assert figures["label_recovery_chance"] == pytest.approx(1 / 3)
    assert leaks.input_figures([(rows[:1], rows[:1])]) == {}                 # one row: no distance correlation
