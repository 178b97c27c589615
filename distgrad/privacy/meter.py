"""The live leak meter: a window of what one stage sent, scored with ``distgrad.privacy.leaks``.

A stage's meter is fed, for each micro-batch it sends across the cut, the
rows exactly as the receiver gets them (after any defense and codec) and the
secret rows they belong to: the label owner's labels, or the data owner's raw
inputs (``observe``). After each applied step the runner asks for the
window's figures (``close``): every ``window`` steps and at the run's last
step (which the runner says) they are computed from the steps since the previous window and those
steps are forgotten. The meter only reads: it copies what it is given and
sends, draws and changes nothing, so a metered run is bitwise the unmetered.

Only a sample of a window's steps is scored (``wants``: ``SAMPLED_STEPS``
evenly spaced ones, every micro-batch of each), which keeps the meter's cost
low; the sample is a function of the step alone, so every runner scores the
same rows. A micro-batch observed again (sent again after a rollback) replaces the
earlier one; steps rolled back past are dropped (``rollback``).

Both meters survive a restart: ``state(step)`` is what a meter holds after a
step as arrays for that step's checkpoint (only what the steps up to it sent:
a later step in flight is sent again after a restart), and ``load_state``
takes it back, so a run resumed from a checkpoint scores what the
uninterrupted run scores, bit for bit.

Figures (each beside its chance level, ``NAME_chance``):

* labels: ``leaks.label_figures`` of the window's rows: ``label_recovery``
  and ``cosine_auc``; ``norm_auc`` and ``direction_auc`` when its labels are
  the two classes 0 and 1 (Li et al.);
* inputs: ``leaks.input_figures``: ``distance_correlation``, the mean over
  the window's batches of each one's distance correlation between input and
  activation rows (a step's micro-batches together: ``whole_batches``).

The offline audit reports the same figures through the same two functions,
so on the same rows the two agree exactly.

``AttackMeter`` plays the strongest attacks known against the whole run so
far (fed every step's every micro-batch, not a sample): the per-row averaging
of the gradients a data owner received, model completion, and the label
owner's best ridge decoder of the inputs; ``extremes`` sums each figure up as
its worst window, mean, last and whole-run value.

A figure that cannot be scored on a window (a single class, a regression's
real-valued targets) is left out of it.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from distgrad.privacy import leaks

LABELS, INPUTS = "labels", "inputs"      # what a meter guards: the label owner's or the data owner's secret
DEFAULT_WINDOW = 50                      # steps per window when the run does not evaluate periodically
SAMPLED_STEPS = 4      # steps of a window scored (evenly spaced): what keeps the meter's cost near 10% of a step
FIGURES = ("label_recovery", "cosine_auc", "norm_auc", "direction_auc", "distance_correlation")   # each has NAME_chance


def sampled(offset: int, window: int) -> bool:
    """Whether the step ``offset`` steps after a window's first is scored in a window of ``window`` steps: every
    ``window // SAMPLED_STEPS``-th (every step of a window shorter than ``2 * SAMPLED_STEPS``). The one rule
    of which steps the meter scores, which the offline audit applies too."""
    return (offset % window) % max(1, window // SAMPLED_STEPS) == 0


def window_steps(eval_every: int) -> int:
    """A meter's window: the run's evaluation period, else ``DEFAULT_WINDOW``."""
    return eval_every if eval_every > 0 else DEFAULT_WINDOW


def prefixed(prefix: str, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``arrays`` with each name after ``prefix``: one part of a meter's ``state``."""
    return {prefix + name: value for name, value in arrays.items()}


def under(prefix: str, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays named ``prefix``..., without it: the part ``prefixed`` put there."""
    return {name[len(prefix):]: value for name, value in arrays.items() if name.startswith(prefix)}


def keys_array(keys: list[tuple[int, int]]) -> np.ndarray:
    """(step, micro-batch) keys as an int64 array of two columns."""
    return np.array(keys, np.int64).reshape(len(keys), 2)


def read_keys(arrays: Mapping[str, np.ndarray]) -> list[tuple[int, int]]:
    """The (step, micro-batch) keys ``keys_array`` wrote as ``keys``; ``ValueError`` when they are not."""
    keys = np.asarray(arrays.get("keys", np.zeros((0, 2), np.int64)))
    if keys.ndim != 2 or keys.shape[1] != 2 or keys.dtype.kind not in "iu":
        raise ValueError(f"its micro-batch keys are not (step, micro-batch) pairs (shape {keys.shape}, "
                         f"dtype {keys.dtype})")
    return [(int(step), int(mb)) for step, mb in keys]


def _array(arrays: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    if name not in arrays:
        raise ValueError(f"no array {name!r}")
    return np.array(arrays[name])


class LeakMeter:
    """Scores what one stage sends over windows of ``window`` steps; ``kind`` is ``LABELS`` or ``INPUTS``."""

    def __init__(self, kind: str, window: int) -> None:
        if kind not in (LABELS, INPUTS):
            raise ValueError(f"unknown meter kind {kind!r}; use {LABELS!r} or {INPUTS!r}")
        if window < 1:
            raise ValueError(f"a meter's window must be at least one step, got {window}")
        self.kind, self.window = kind, window
        self._rows: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}   # (step, mb) -> (secret, sent)

    def wants(self, step: int) -> bool:
        """Whether ``step`` is scored: every ``window // SAMPLED_STEPS``-th step (every step of a short window),
        counted from each window's first; what the other steps send is not looked at."""
        return sampled(step - 1, self.window)

    def observe(self, step: int, mb: int, secret: np.ndarray, sent: np.ndarray) -> None:
        """Micro-batch ``mb`` of ``step``: its secret rows and the rows sent for them, as received (kept only
        when the meter ``wants`` the step)."""
        if not self.wants(step):
            return
        secret, sent = np.asarray(secret), np.asarray(sent)
        if len(secret) != len(sent):
            raise ValueError(f"{len(secret)} secret rows for {len(sent)} sent rows")
        self._rows[(step, mb)] = (secret.copy(), sent.copy())

    def rollback(self, step: int) -> None:
        """The run stands at ``step`` again: forget what later steps sent."""
        self._rows = {key: value for key, value in self._rows.items() if key[0] <= step}

    def state(self, step: int) -> dict[str, np.ndarray]:
        """The open window after ``step`` as arrays (``keys``; ``secret/I``, ``sent/I``: the rows of the I-th
        micro-batch kept, the steps up to ``step`` only): at most ``SAMPLED_STEPS`` steps' rows (every step of
        a window shorter than twice that)."""
        keys = sorted(key for key in self._rows if key[0] <= step)
        arrays = {"keys": keys_array(keys)}
        for i, key in enumerate(keys):
            arrays[f"secret/{i}"], arrays[f"sent/{i}"] = self._rows[key]
        return arrays

    def load_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """The open window ``state`` gave, instead of this one; ``ValueError`` when ``arrays`` are not one."""
        rows = {}
        for i, key in enumerate(read_keys(arrays)):
            secret, sent = _array(arrays, f"secret/{i}"), _array(arrays, f"sent/{i}")
            if secret.ndim < 1 or sent.ndim < 1 or len(secret) != len(sent):
                raise ValueError(f"micro-batch {key}: secret rows of shape {secret.shape} for sent rows of shape "
                                 f"{sent.shape}")
            rows[key] = (secret, sent)
        self._rows = rows

    def close(self, step: int, last: bool = False) -> dict[str, float] | None:
        """After applying ``step`` (``last``: the run's last): when a window closes (every ``window`` steps and
        at the last), its figures, and the window is forgotten; else None."""
        if step % self.window and not last:
            return None
        keys = sorted(key for key in self._rows if key[0] <= step)
        taken = [self._rows.pop(key) for key in keys]
        if not taken:
            return None
        return self._labels(taken) if self.kind == LABELS else self._inputs(whole_batches(keys, taken))

    @staticmethod
    def _labels(taken: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
        labels = np.concatenate([secret.reshape(len(secret), -1) for secret, _ in taken])
        rows = np.concatenate([sent.reshape(len(sent), -1) for _, sent in taken])
        if labels.shape[1] == 1:
            labels = labels[:, 0]
        if labels.ndim == 1 and not np.array_equal(labels, np.round(labels)):
            return {}                        # real-valued targets: nothing to recover by class
        return leaks.label_figures(rows, labels)

    @staticmethod
    def _inputs(taken: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
        return leaks.input_figures(taken)


def whole_batches(keys: list[tuple[int, int]], taken: list[tuple[np.ndarray, np.ndarray]]
                  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (secret rows, sent rows) of each step's whole batch, from its micro-batches ``taken`` under ``keys``
    ((step, micro-batch), sorted): the input figures are each batch's, however the run split it."""
    steps: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for (step, _), pair in zip(keys, taken):
        steps.setdefault(step, []).append(pair)
    return [(np.concatenate([secret for secret, _ in parts]), np.concatenate([sent for _, sent in parts]))
            for parts in steps.values()]


KNOWN_ROWS = (1, 10)        # rows of each class the averaging attacker knows (one figure each)
ANCHOR_DRAWS = {1: 64, 10: 8}   # by known rows per class: the choices of them a figure is the mean over (one
                                # known row swings the figure by about 0.1 from one choice to another)
COMPLETION_KNOWN = 10       # labelled rows per class of the model-completion classifier
ATTACK_FIGURES = ("averaged_recovery_1", "averaged_recovery_10", "model_completion", "ridge_r2", "ridge_r2_run")
# Every figure a meter reports, each beside NAME_chance: what the progress bar, TensorBoard and the plot show,
# the strongest attacks' too (a window's figure alone understates what a determined party gets).
METER_FIGURES = FIGURES + ATTACK_FIGURES
RUN_FIGURES = {"averaged_recovery_1": "averaged_recovery_1", "averaged_recovery_10": "averaged_recovery_10",
               "model_completion": "model_completion", "ridge_r2": "ridge_r2_run"}   # a figure -> its whole-run one


def _grown(array: np.ndarray, size: int, fill: float = 0.0) -> np.ndarray:
    """``array`` with at least ``size`` rows (new rows ``fill``)."""
    if len(array) >= size:
        return array
    extra = np.full((max(size, 2 * len(array)) - len(array),) + array.shape[1:], fill, array.dtype)
    return np.concatenate([array, extra])


class AttackMeter:
    """The strongest attacks known on what one stage sends, over the whole run so far (``kind``: ``LABELS`` or
    ``INPUTS``), closed with the same windows as ``LeakMeter`` but fed every step's every micro-batch.

    * labels (the data owner knows each row's number, and averages every gradient row it received of that
      row, over every step so far, then clusters the means): ``averaged_recovery_K``, anchored k-means
      (``leaks.anchored_recovery``) of each row's mean received gradient with K known rows per class, K in
      ``KNOWN_ROWS``; and ``model_completion``, a few-shot classifier (``leaks.few_shot_accuracy``,
      ``COMPLETION_KNOWN`` labels per class) of each row's latest activation row as the label owner received
      it (``observe_activations``): what the data owner gets from its own f. Chance 1/k.
    * inputs: ``ridge_r2``, the reconstruction R^2 of the private rows' inputs by the best ridge decoder fitted
      on the public rows (``leaks.public_rows``: the label owner's public share) of the window, and
      ``ridge_r2_run``, the same over every step so far; chance 0.

    Each ``close`` (after every applied step) folds the steps up to it into the per-row sums (labels) or the
    window's ridge statistics (inputs), in (step, micro-batch) order. A micro-batch observed again before its
    step is folded replaces the first; after, it is ignored (a rollback behind it restores an earlier
    ``state`` instead). Without row numbers (data that does not number its rows) the label figures are not
    scored, and the public share is every ``leaks.PUBLIC_EVERY``-th row of a micro-batch. The meter only
    reads what it is given."""

    def __init__(self, kind: str, window: int) -> None:
        if kind not in (LABELS, INPUTS):
            raise ValueError(f"unknown meter kind {kind!r}; use {LABELS!r} or {INPUTS!r}")
        self.kind, self.window = kind, window
        self.closed_through = 0                  # the last step a window closed at
        self.folded_through = 0                  # the last step folded in (its rows, and every earlier step's)
        self._open: dict[tuple[int, int], tuple[Any, ...]] = {}     # (step, mb) -> its rows, not folded yet
        self._sums = np.zeros((0, 0))           # row number -> sum of its received gradient rows
        self._counts = np.zeros(0)
        self._labels = np.zeros(0, np.int64)     # row number -> its class (-1: not seen)
        self._latest = np.zeros((0, 0))          # row number -> its latest activation row (model completion)
        self._seen = np.zeros(0, bool)
        self._window = (leaks.RidgeStats(), leaks.RidgeStats())  # (public, private) stats of the open window
        self._run = (leaks.RidgeStats(), leaks.RidgeStats())     # (public, private) stats of closed windows

    def observe(self, step: int, mb: int, secret: np.ndarray, sent: np.ndarray, rows: np.ndarray | None) -> None:
        """Micro-batch ``mb`` of ``step``: its secret rows, the rows sent for them as received, and their row
        numbers (None: unnumbered)."""
        if step <= self.folded_through:
            return
        secret, sent = np.asarray(secret), np.asarray(sent)
        if len(secret) != len(sent) or (rows is not None and len(rows) != len(sent)):
            raise ValueError(f"{len(secret)} secret rows for {len(sent)} sent rows")
        if self.kind == LABELS:
            if rows is not None and np.array_equal(secret, np.round(secret)):   # class ids, not real targets
                labels = leaks._labels(secret, len(secret))
                self._open[(step, mb)] = (np.asarray(rows).copy(), labels, leaks._flat(sent))
            return
        public = (leaks.public_rows(rows) if rows is not None
                  else np.arange(len(sent)) % leaks.PUBLIC_EVERY == 0)
        stats = (leaks.RidgeStats(), leaks.RidgeStats())
        for side, chosen in zip(stats, (public, ~public)):
            if chosen.any():
                side.add(sent[chosen], secret[chosen])
        self._open[(step, mb)] = stats

    def observe_activations(self, rows: np.ndarray, activations: np.ndarray) -> None:
        """The label owner received ``activations`` for row numbers ``rows`` (model completion's input)."""
        flat = leaks._flat(activations)
        rows = np.asarray(rows).reshape(-1)
        if len(rows) != len(flat):
            raise ValueError(f"{len(rows)} row numbers for {len(flat)} activation rows")
        size = int(rows.max()) + 1 if len(rows) else 0
        if self._latest.shape[1:] != flat.shape[1:]:
            self._latest = np.zeros((0, flat.shape[1]))
        self._latest = _grown(self._latest, size)
        self._latest[rows] = flat

    def close(self, step: int, last: bool = False) -> dict[str, float] | None:
        """After applying ``step`` (``last``: the run's last): fold its rows in, and when a window closes (every
        ``window`` steps and at the last; once), its figures (None when nothing is scored)."""
        self._fold(step)
        if (step % self.window and not last) or step <= self.closed_through:
            return None
        self.closed_through = step
        return (self._label_figures() if self.kind == LABELS else self._input_figures()) or None

    def _fold(self, step: int) -> None:
        """Fold the rows of the steps up to ``step`` in, in (step, micro-batch) order."""
        if step <= self.folded_through:
            return
        keys = sorted(key for key in self._open if key[0] <= step)
        taken = [self._open.pop(key) for key in keys]
        if self.kind == LABELS:
            self._add_labels(taken)
        else:
            for pub, priv in taken:
                self._window = (self._window[0].merged(pub), self._window[1].merged(priv))
        self.folded_through = step

    def _add_labels(self, taken: list[tuple[Any, ...]]) -> None:
        for rows, labels, sent in taken:
            size = int(rows.max()) + 1 if len(rows) else 0
            if self._sums.shape[1:] != sent.shape[1:]:
                self._sums = np.zeros((0, sent.shape[1]))
            self._sums = _grown(self._sums, size)
            self._counts, self._seen = _grown(self._counts, size), _grown(self._seen, size, False)
            self._labels = _grown(self._labels, size, -1)
            np.add.at(self._sums, rows, sent)
            np.add.at(self._counts, rows, 1.0)
            self._labels[rows], self._seen[rows] = labels, True

    def _label_figures(self) -> dict[str, float]:
        seen = np.flatnonzero(self._seen)
        if len(seen) == 0:
            return {}
        labels = self._labels[seen]
        chance = 1.0 / len(np.unique(labels))
        means = self._sums[seen] / self._counts[seen][:, None]
        figures: dict[str, float] = {}
        for known in KNOWN_ROWS:
            try:
                figures[f"averaged_recovery_{known}"] = leaks.anchored_recovery(means, labels, known,
                                                                                  ANCHOR_DRAWS[known])
            except ValueError:
                continue
            figures[f"averaged_recovery_{known}_chance"] = chance
        if len(self._latest) and self._latest.shape[1]:
            have = seen[seen < len(self._latest)]
            have = have[np.abs(self._latest[have]).sum(1) > 0] if len(have) else have
            try:
                figures["model_completion"] = leaks.few_shot_accuracy(self._latest[have], self._labels[have],
                                                                      COMPLETION_KNOWN,
                                                                      ANCHOR_DRAWS[COMPLETION_KNOWN])
                figures["model_completion_chance"] = 1.0 / len(np.unique(self._labels[have]))
            except ValueError:
                pass
        return figures

    def _input_figures(self) -> dict[str, float]:
        window, self._window = self._window, (leaks.RidgeStats(), leaks.RidgeStats())
        self._run = (self._run[0].merged(window[0]), self._run[1].merged(window[1]))
        figures: dict[str, float] = {}
        for name, stats in (("ridge_r2", window), ("ridge_r2_run", self._run)):
            try:
                figures[name] = leaks.ridge_r2(*stats)
            except (ValueError, np.linalg.LinAlgError):
                continue
            figures[f"{name}_chance"] = 0.0
        return figures

    def state(self, step: int) -> dict[str, np.ndarray]:
        """What the attacker holds after ``step`` (the steps up to it folded in first), as arrays: ``through``
        (the last window closed, the last step folded); for labels each row's gradient sum, count, class, and
        latest activation (``sums``, ``counts``, ``labels``, ``seen``, ``latest``: rows x width, up to the
        highest row seen; ``latest`` in float32 when that holds it exactly); for inputs the ridge statistics of the open window and of the closed ones
        (``window/public/...``, ``window/private/...``, ``run/...``: each (width + 1) x (width + 1 + inputs)).
        Raises ``ValueError`` for a step before the last folded in (its state is gone)."""
        if step < self.folded_through:
            raise ValueError(f"the attack meter folded step {self.folded_through} in: its state after step "
                             f"{step} is gone")
        self._fold(step)
        arrays: dict[str, np.ndarray] = {"through": np.array([self.closed_through, self.folded_through], np.int64)}
        if self.kind == LABELS:
            seen = np.flatnonzero(self._seen)
            used = int(seen[-1]) + 1 if len(seen) else 0
            written = np.flatnonzero(np.any(self._latest != 0, axis=1)) if self._latest.size else np.zeros(0, int)
            latest = self._latest[:int(written[-1]) + 1 if len(written) else 0]
            narrow = latest.astype(np.float32)      # received rows are float32 values: half the bytes, exactly
            arrays.update(sums=self._sums[:used], counts=self._counts[:used], labels=self._labels[:used],
                          seen=self._seen[:used],
                          latest=narrow if np.array_equal(narrow, latest, equal_nan=True) else latest)
            return arrays
        for name, (public, private) in (("window", self._window), ("run", self._run)):
            arrays.update(prefixed(f"{name}/public/", public.arrays()))
            arrays.update(prefixed(f"{name}/private/", private.arrays()))
        return arrays

    def load_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """The state ``state`` gave, instead of this one (rows observed since are forgotten); ``ValueError``
        when ``arrays`` are not one."""
        through = _array(arrays, "through")
        if through.shape != (2,) or through.dtype.kind not in "iu":
            raise ValueError(f"'through' is not two step numbers: {through!r}")
        if self.kind == LABELS:
            sums, counts, labels, seen, latest = (_array(arrays, name) for name in
                                                  ("sums", "counts", "labels", "seen", "latest"))
            if sums.ndim != 2 or latest.ndim != 2 or any(a.shape != (len(sums),) for a in (counts, labels, seen)):
                raise ValueError(f"per-row arrays of shapes {sums.shape}, {counts.shape}, {labels.shape}, "
                                 f"{seen.shape}: not one row each")
            self._sums, self._counts = sums.astype(np.float64), counts.astype(np.float64)
            self._labels, self._seen, self._latest = labels.astype(np.int64), seen.astype(bool), \
                latest.astype(np.float64)
        else:
            stats = {name: (leaks.RidgeStats.from_arrays(under(f"{name}/public/", arrays)),
                            leaks.RidgeStats.from_arrays(under(f"{name}/private/", arrays)))
                     for name in ("window", "run")}
            self._window, self._run = stats["window"], stats["run"]
        self.closed_through, self.folded_through = int(through[0]), int(through[1])
        self._open = {}


def leaking(name: str, value: float, chance: float) -> float:
    """How far ``value`` of figure ``name`` is toward a leak: an AUC leaks on either side of 0.5 (a flipped
    score is as good), every other figure upward."""
    return abs(value - chance) if name.endswith("_auc") else value


def extremes(windows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """For each figure of ``windows`` (each ``{"step": ..., NAME: value, NAME_chance: ...}``): its ``worst``
    window (the one that leaks most, ``leaking``; ``worst_step`` is its step), the ``mean`` over the windows,
    the ``last`` window's, its ``chance`` there, and where the figure has a whole-run form (``RUN_FIGURES``)
    the ``run`` figure after the last window."""
    out: dict[str, dict[str, float]] = {}
    names = dict.fromkeys(name for window in windows for name in window
                          if name != "step" and not name.endswith("_chance") and name not in ("ridge_r2_run",))
    for name in names:
        scored = [w for w in windows if name in w]
        worst = max(scored, key=lambda w: leaking(name, w[name], w.get(name + "_chance", 0.0)))
        entry = {"worst": worst[name], "worst_step": worst["step"],
                 "mean": float(np.mean([w[name] for w in scored])), "last": scored[-1][name],
                 "chance": scored[-1].get(name + "_chance", 0.0)}
        run_name = RUN_FIGURES.get(name)
        if run_name is not None:
            runs = [w for w in windows if run_name in w]
            if runs:
                entry["run"] = runs[-1][run_name]
        out[name] = entry
    return out
