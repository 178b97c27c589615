"""Label differential privacy that keeps accuracy: randomized response with a prior, in stages, and a loss that
knows the flip rate. Pure functions of numpy arrays and one state keyed by the run's secret (``LabelRelease``).

* ``randomized_response`` (``privacy.defenses``) answers a label truthfully with probability
  e^eps / (e^eps + K - 1), else one of the other K - 1 classes: epsilon-label-DP.
* RR-with-prior (Ghazi et al., "Deep Learning with Label Differential Privacy", NeurIPS 2021): given a prior
  p over the classes that does not depend on the row's label, keep only the k most likely classes, the k that
  maximises e^eps / (e^eps + k - 1) * p(top k), and run randomized response among them (a label outside them is
  answered by a class of the set drawn uniformly). Still epsilon-label-DP for each row, exactly, whatever the
  prior: the answer's distribution for two labels differs by at most e^eps. With a good prior the set is
  small and the answer is right far more often.
* In stages (``LabelRelease``): the training rows are split into K equal parts by a shuffle keyed, like every
  answer, by the stage's run secret (never the seed: a party that knows the seed cannot redraw the answers).
  Stage 1 trains on part 1 with plain randomized response (a uniform prior); from stage t on, part t's rows
  take part, and each row's label is drawn the first time the label owner sees the row in a training step, with
  the model's own softmax output for that row as the prior: a model trained so far only on randomized labels.
  Each row's label is released once in the run, so the run is epsilon-label-DP exactly.
* ``corrected_loss``: forward correction (Patrini et al., 2017) by the known transition of the mechanism:
  the model's probabilities p(y | x) become the probability of the answer actually released,
  q = sum_c P(answer | true class c) p(c | x), and the loss is -log q. Its minimiser is the true posterior,
  not the noisy one, so the randomized labels' flips are not learned as signal.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from distgrad.errors import ConfigError
from distgrad.privacy.releases import RunSecret

DTYPE = np.float32
LOSSES = ("corrected", "plain")      # the label owner's training loss under label_dp (LabelDP.loss)
STATE_PREFIX = "label_dp/"           # a stage's checkpoint arrays of its released labels
UNRELEASED = -1                      # a row whose label is not drawn yet (LabelRelease.noisy)


@dataclass(frozen=True)
class LabelDP:
    """A label owner's ``label_dp`` setting: randomized response at ``epsilon`` on each training label, once.

    ``stages`` K >= 2: RR-with-prior in K stages, each but the last ``epochs_per_stage`` passes over the
    training rows long, counted in the label owner's updates (that many times its training rows / batch);
    None: the experiment's ``steps`` split evenly among the stages. ``loss``: ``"corrected"`` (the
    flip-rate-aware loss, ``corrected_loss``), ``"plain"`` (cross-entropy on the randomized labels as if they
    were true), or None: corrected where the stage's loss is a softmax cross-entropy, else plain
    (``loss_for``)."""

    epsilon: float
    stages: int = 1
    epochs_per_stage: float | None = None
    loss: str | None = None

    @property
    def staged(self) -> bool:
        """Whether labels are released during training (RR-with-prior), not all before it."""
        return self.stages > 1

    def loss_for(self, softmax_cross_entropy: bool) -> str:
        """The training loss for a stage whose own loss is (or is not) a softmax cross-entropy."""
        if self.loss is not None:
            return self.loss
        return "corrected" if softmax_cross_entropy else "plain"

    def updates_per_stage(self, updates_per_epoch: int, run_updates: int) -> int:
        """The label owner's updates in each stage but the last: ``epochs_per_stage`` epochs of
        ``updates_per_epoch``, else ``run_updates`` (the experiment's steps, in updates) / ``stages``; at least 1."""
        if self.epochs_per_stage is not None:
            return max(1, round(self.epochs_per_stage * updates_per_epoch))
        return max(1, run_updates // self.stages)

    def as_table(self) -> dict[str, Any]:
        """The stage-table value that gives this setting (what ``parse_label_dp`` reads back)."""
        table: dict[str, Any] = {"epsilon": self.epsilon}
        if self.staged:
            table.update(prior="stages", stages=self.stages)
            if self.epochs_per_stage is not None:
                table["epochs_per_stage"] = self.epochs_per_stage
        if self.loss is not None:
            table["loss"] = self.loss
        return table

    def budget(self) -> dict[str, Any]:
        """The summary's ``privacy.<stage>.label_dp`` entry: each training label released once at ``epsilon``
        (and, for RR-with-prior, its ``stages``)."""
        return {"epsilon": self.epsilon, **({"stages": self.stages} if self.staged else {})}


PRIORS = ("uniform", "stages")      # label_dp's prior: plain randomized response, or the model's in stages
DEFAULT_STAGES = 2                  # the stages of prior = "stages" when 'stages' is not given


def parse_label_dp(value: Any, stage: str) -> LabelDP:
    """The ``label_dp`` table of ``stage``: ``{ epsilon = e }``, optionally ``prior = "uniform" | "stages"``,
    ``stages = K`` (K >= 2: the prior "stages"; default 2 with it) and ``epochs_per_stage = E``, and ``loss =
    "corrected" | "plain"``. Raises ``ConfigError`` naming the key and what it must be."""
    where = f"stage {stage!r}: 'label_dp'"
    keys = {"epsilon", "prior", "stages", "epochs_per_stage", "loss"}
    if not isinstance(value, dict) or "epsilon" not in value or not set(value) <= keys:
        raise ConfigError(f"{where} must be {{ epsilon = e }}, optionally with prior = \"stages\", stages = K and "
                          f"epochs_per_stage = E (randomized response with a prior, in K stages) and loss = "
                          f"\"corrected\" or \"plain\"; got {value!r}")
    epsilon = _number(value["epsilon"], f"{where} epsilon", "> 0")
    prior = value.get("prior")
    if prior is not None and prior not in PRIORS:
        raise ConfigError(f"{where} prior must be \"uniform\" (plain randomized response) or \"stages\" (the "
                          f"model's, in stages), got {prior!r}")
    stages = value.get("stages", DEFAULT_STAGES if prior == "stages" else 1)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"{where} stages must be an integer >= 1 (1: plain randomized response), got {stages!r}")
    if prior == "stages" and stages < 2:
        raise ConfigError(f"{where} prior = \"stages\" needs stages = K >= 2 (the first stage has no model yet), "
                          f"got {stages}")
    if prior == "uniform" and stages > 1:
        raise ConfigError(f"{where} stages = {stages} takes its prior from the model: give prior = \"stages\" "
                          f"or no prior")
    epochs = value.get("epochs_per_stage")
    if epochs is not None:
        if stages < 2:
            raise ConfigError(f"{where} epochs_per_stage is the length of a stage: it needs stages = K >= 2")
        epochs = _number(epochs, f"{where} epochs_per_stage", "> 0")
    loss = value.get("loss")
    if loss is not None and loss not in LOSSES:
        raise ConfigError(f"{where} loss must be \"corrected\" (accounts for the known flip rate) or \"plain\", "
                          f"got {loss!r}")
    return LabelDP(epsilon, stages, epochs, loss)


def _number(value: Any, what: str, rule: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what} must be a number {rule}, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------- the mechanism

def keep_rate(epsilon: float, k: np.ndarray | int) -> np.ndarray:
    """The probability randomized response among ``k`` classes answers the true one: e^eps / (e^eps + k - 1)
    (float64)."""
    return 1.0 / (1.0 + (np.asarray(k, np.float64) - 1.0) * math.exp(-epsilon))


def prior_sets(prior: np.ndarray, epsilon: float) -> np.ndarray:
    """RRWithPrior's answer sets (Ghazi et al., Algorithm 2): for each row of ``prior`` ``(rows, K)``, the k
    most likely classes (ties: the lower class first) with k maximising keep_rate(eps, k) * p(top k) (the
    smallest such k). Returns a bool ``(rows, K)`` mask. A uniform prior gives every class."""
    prior = np.asarray(prior, np.float64)
    order = np.argsort(-prior, axis=1, kind="stable")
    mass = np.cumsum(np.take_along_axis(prior, order, axis=1), axis=1)
    k = np.argmax(keep_rate(epsilon, np.arange(1, prior.shape[1] + 1)) * mass, axis=1) + 1
    sets = np.zeros(prior.shape, bool)
    np.put_along_axis(sets, order, np.arange(prior.shape[1]) < k[:, None], axis=1)
    return sets


def rr_with_prior(labels: np.ndarray, sets: np.ndarray, epsilon: float, uniforms: np.ndarray) -> np.ndarray:
    """The answers of randomized response restricted to ``sets`` (bool ``(rows, K)``) for true ``labels``
    ``(rows,)``, from ``uniforms`` ``(rows, 2)`` in [0, 1): a label in its set is kept with probability
    keep_rate(eps, k) (k its set's size), else answered by one of the other k - 1 members, uniformly; a label
    outside its set by one of the k members, uniformly. int64 ``(rows,)``."""
    labels = np.asarray(labels, np.int64)
    rows = np.arange(len(labels))
    k = sets.sum(axis=1)
    inside = sets[rows, labels]
    keep = inside & (uniforms[:, 0] < keep_rate(epsilon, k))
    others = sets.copy()
    others[rows[inside], labels[inside]] = False          # the members an answer other than the label takes
    count = others.sum(axis=1)
    pick = np.minimum((uniforms[:, 1] * count).astype(np.int64), count - 1)
    # the pick-th member (0-based, in class order) of each row's ``others``
    chosen = np.argmax(np.cumsum(others, axis=1) > pick[:, None], axis=1)
    return np.where(keep | (count == 0), labels, chosen).astype(np.int64)


def transition_weights(answers: np.ndarray, sets: np.ndarray | None, epsilon: float, classes: int,
                       outputs: int) -> np.ndarray:
    """P(answer | true class c) for each row's released ``answers`` and each of ``outputs`` classes c, float32
    ``(rows, outputs)``: keep_rate(eps, k) for c = answer, (1 - keep_rate) / (k - 1) for the set's other
    members, 1 / k for a class outside the set (whose label is answered uniformly within the set), and 0 for
    a class the labels never hold (c >= ``classes``). ``sets`` None (or a row's set empty): every one of
    ``classes`` (plain randomized response)."""
    rows = len(answers)
    if sets is None:
        sets = np.zeros((rows, outputs), bool)
        sets[:, :classes] = True
    else:
        sets = np.pad(sets, ((0, 0), (0, outputs - sets.shape[1]))) if sets.shape[1] < outputs else sets.copy()
        sets[~sets.any(axis=1), :classes] = True      # a row not released yet (its loss is masked): any weights
    k = sets.sum(axis=1).astype(np.float64)
    kept = keep_rate(epsilon, k)
    other = np.where(k > 1, (1.0 - kept) / np.maximum(k - 1.0, 1.0), 0.0)
    weights = np.where(sets, other[:, None], 1.0 / k[:, None])
    weights[:, classes:] = 0.0
    weights[np.arange(rows), answers] = kept
    return weights.astype(DTYPE)


def corrected_loss(pred: np.ndarray, weights: np.ndarray, active: np.ndarray | None,
                   reduction: str = "mean") -> tuple[np.float32, np.ndarray]:
    """The forward-corrected cross-entropy and its gradient, float32: for logits ``pred`` ``(rows, classes)``
    with p = softmax(pred), row i's loss is -log q_i, q_i = sum_c weights[i, c] p[i, c] (``transition_weights``:
    the probability of the answer released), and d loss_i / d pred[i, j] = p[i, j] (1 - weights[i, j] / q_i).
    ``weights`` one-hot on the released labels is plain cross-entropy. Rows where ``active`` is False (labels
    not released yet) count zero. ``reduction``: the sum over the rows, or that sum / rows ("mean")."""
    # In the log domain, as a cross-entropy is computed: q_i never underflows to 0 for a confident model.
    logits = np.asarray(pred, DTYPE)
    shifted = logits - np.max(logits, axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True, dtype=DTYPE))
    with np.errstate(divide="ignore"):
        log_wp = log_p + np.log(np.asarray(weights, DTYPE))          # -inf where a class has weight 0
    top = np.max(log_wp, axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, DTYPE(0))
    log_q = top + np.log(np.exp(log_wp - top).sum(axis=1, keepdims=True, dtype=DTYPE))
    losses = -log_q[:, 0]
    grad = np.exp(log_p) - np.exp(log_wp - log_q)
    if active is not None:
        losses = np.where(active, losses, DTYPE(0))
        grad[~active] = 0
    scale = DTYPE(1) if reduction == "sum" else DTYPE(1) / DTYPE(len(logits))
    return DTYPE(losses.sum(dtype=DTYPE) * scale), (grad * scale).astype(DTYPE)


# --------------------------------------------------------------------------- labels in stages

@dataclass(frozen=True)
class ReleasedBatch:
    """What a training micro-batch trains on: each row's released ``answers`` (int64; 0 where not released),
    its answer set (``sets``, bool; None: every class) and whether it is released (``active``; None: all)."""

    answers: np.ndarray
    sets: np.ndarray | None
    active: np.ndarray | None


class LabelRelease:
    """RR-with-prior in stages over one label owner's training rows: which stage each row belongs to, and
    each row's answer and answer set once released. The answers are a function of the stage's run secret
    (never of the seed, which the other party may know), the rows' true labels and the model outputs the stage
    computed, so a run in processes releases exactly what the in-process reference given the same secret
    does; the state is checkpointed with the stage (``state_arrays``; the secret with its checkpoint).

    ``labels``: every row's true class id, by row number; ``train_rows``: the rows that may be trained on (of
    every data owner); ``classes``: K; ``updates_per_stage``: the label owner's updates of each stage but the
    last; ``secret``/``stage``: what the draws are keyed by: the run's secret, or the ``RunSecret`` holding
    it, read when a row is drawn (a new run's secret, a new draw)."""

    def __init__(self, setting: LabelDP, labels: np.ndarray, train_rows: np.ndarray, classes: int,
                 updates_per_stage: int, secret: int | RunSecret, stage: str) -> None:
        self.setting, self.classes = setting, classes
        self.updates_per_stage = max(1, int(updates_per_stage))
        self._labels = np.asarray(labels, np.int64)
        self._train_rows = np.asarray(train_rows, np.int64)
        self.key = secret if isinstance(secret, RunSecret) else RunSecret(secret)
        self.stage = stage
        self._drawn: tuple[int, np.ndarray, np.ndarray] | None = None     # (secret, uniforms, part)
        self.answers = np.full(len(labels), UNRELEASED, np.int64)
        self.sets = np.zeros((len(labels), classes), bool)

    def _draws(self) -> tuple[np.ndarray, np.ndarray]:
        """The uniforms of every row's answer and the stage (``part``) of each, from the secret's value."""
        secret = self.key.value
        if self._drawn is None or self._drawn[0] != secret:
            rng = np.random.default_rng([secret, zlib.crc32(self.stage.encode()), zlib.crc32(b"label_dp prior")])
            uniforms = rng.random((len(self._labels), 2))
            shuffled = self._train_rows[rng.permutation(len(self._train_rows))]
            part = np.zeros(len(self._labels), np.int64)
            for t, rows in enumerate(np.array_split(shuffled, self.setting.stages), start=1):
                part[rows] = t
            self._drawn = secret, uniforms, part
        return self._drawn[1], self._drawn[2]

    @property
    def part(self) -> np.ndarray:
        """The 1-based stage of each training row, by row number (0: not a training row)."""
        return self._draws()[1]

    def stage_at(self, update: int) -> int:
        """The stage (1-based) of the label owner's update ``update`` (0-based: its updates applied so far)."""
        return min(self.setting.stages, 1 + update // self.updates_per_stage)

    def release(self, rows: np.ndarray, logits: np.ndarray, update: int) -> ReleasedBatch:
        """The labels of ``rows`` (row numbers, a training micro-batch in order) as the stage trains on them at
        its update ``update``, releasing, first seen first, each row of a stage begun that has none yet: stage
        1's with plain randomized response, a later stage's with the softmax of its ``logits`` (the stage's
        output for that row in this forward) as the prior. A row of a stage not begun is not active."""
        rows = np.asarray(rows, np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self._labels)):
            raise ValueError(f"label_dp: row numbers must lie in [0, {len(self._labels)}), got "
                             f"{rows.min()}..{rows.max()}")
        current = self.stage_at(update)
        uniforms, part = self._draws()
        _, first = np.unique(rows, return_index=True)
        fresh = np.zeros(len(rows), bool)
        fresh[first] = True
        # A row kept from before a rollback is released but waits, as it did, for its stage to begin.
        begun = (part[rows] >= 1) & (part[rows] <= current)
        fresh &= (self.answers[rows] == UNRELEASED) & begun
        if fresh.any():
            new = rows[fresh]
            prior = _softmax64(np.asarray(logits)[fresh][:, :self.classes])
            sets = np.where((part[new] == 1)[:, None], True, prior_sets(prior, self.setting.epsilon))
            self.sets[new] = sets
            self.answers[new] = rr_with_prior(self._labels[new], sets, self.setting.epsilon, uniforms[new])
        answers = self.answers[rows]
        active = (answers != UNRELEASED) & begun
        return ReleasedBatch(np.where(active, answers, 0), self.sets[rows], active)

    @property
    def released(self) -> int:
        """How many rows' labels are released so far (each once)."""
        return int((self.answers != UNRELEASED).sum())

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The released answers and sets (a bit per class), for the stage's checkpoint."""
        return {f"{STATE_PREFIX}answers": self.answers.copy(), f"{STATE_PREFIX}sets": np.packbits(self.sets, axis=1)}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Return to what ``state_arrays`` returned (a checkpoint without them: nothing released), keeping every
        label this object has released since: a run rolled back to an earlier step never draws a row's label
        a second time (with another prior), so a data owner cannot collect two answers for one label by
        making the label owner compute a step again on other activations. An honest replay would draw the very
        same answers, so the run stays bitwise the uninterrupted one. Raises ``ValueError`` when the arrays do
        not fit these rows and classes."""
        answers, packed = arrays.get(f"{STATE_PREFIX}answers"), arrays.get(f"{STATE_PREFIX}sets")
        if answers is None or packed is None:
            answers, sets = np.full_like(self.answers, UNRELEASED), np.zeros_like(self.sets)
        else:
            width = (self.classes + 7) // 8
            if answers.shape != self.answers.shape or packed.shape != (len(self.answers), width):
                raise ValueError(f"label_dp: the checkpoint's released labels are for {answers.shape[0]} rows and "
                                 f"{packed.shape[-1] * 8} classes at most, this stage has {len(self.answers)} and "
                                 f"{self.classes}")
            sets = np.unpackbits(np.asarray(packed, np.uint8), axis=1, count=self.classes).astype(bool)
        kept = (answers == UNRELEASED) & (self.answers != UNRELEASED)
        self.answers[...] = np.where(kept, self.answers, answers)
        self.sets[...] = np.where(kept[:, None], self.sets, sets)

    def keep_released(self, other: "LabelRelease") -> None:
        """Take over every label ``other`` (this run's release before a rollback to its start) released."""
        kept = (self.answers == UNRELEASED) & (other.answers != UNRELEASED)
        self.answers[kept] = other.answers[kept]
        self.sets[kept] = other.sets[kept]


def _softmax64(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


class TrainingLabels:
    """What a label owner's stage needs under ``label_dp`` beyond its data: the setting, the classes and the
    training loss, and with stages the ``release`` that draws the labels during training (its data then
    gives the rows' numbers as targets). ``labels`` and ``loss`` are what ``Stage`` calls for a training
    micro-batch; held-out rows are scored with the stage's own loss on their true labels."""

    def __init__(self, setting: LabelDP, classes: int, loss: str, release: LabelRelease | None) -> None:
        self.setting, self.classes, self.loss_name, self.release = setting, classes, loss, release

    def labels(self, target: np.ndarray, logits: np.ndarray, update: int) -> ReleasedBatch:
        """The micro-batch's ``ReleasedBatch``: ``target`` holds the randomized labels themselves, or with a
        release the rows' numbers (``LabelRelease.release`` at the stage's update ``update``)."""
        if self.release is None:
            return ReleasedBatch(np.asarray(target, np.int64), None, None)
        return self.release.release(target, logits, update)

    def weights(self, batch: ReleasedBatch, outputs: int) -> np.ndarray:
        """Per row and class, what the training loss weighs each class's probability by: the transition
        probabilities (corrected) or one-hot on the answer (plain), float32 ``(rows, outputs)``."""
        if batch.answers.size and (batch.answers.min() < 0 or batch.answers.max() >= outputs):
            raise ValueError(f"class ids must lie in [0, {outputs}), got {batch.answers.min()}..{batch.answers.max()}")
        if self.loss_name == "corrected":
            return transition_weights(batch.answers, batch.sets, self.setting.epsilon, self.classes, outputs)
        onehot = np.zeros((len(batch.answers), outputs), DTYPE)
        onehot[np.arange(len(batch.answers)), batch.answers] = 1
        return onehot

    def loss(self, pred: np.ndarray, target: np.ndarray, update: int, reduction: str) -> tuple[np.float32, np.ndarray]:
        """A numpy stage's training loss and its gradient for logits ``pred`` (``corrected_loss``)."""
        batch = self.labels(target, pred, update)
        return corrected_loss(pred, self.weights(batch, pred.shape[1]), batch.active, reduction)
