"""Independent attackers on what crossed the cut, to check the live meters against (not the meters' code).

Each reads the tensors a run's trace recorded as they crossed (``sent_activation_grad``: what the data owner
received; ``sent_activation``: what the label owner received), the row numbers every party computes for a
step (the shared sample order), and the secret the attacked party holds, and attacks them its own way:

* ``averaging_attack``: the data owner averages, per row number, every gradient row it received
  (``row_means``), then runs
  k-means on the averages' directions seeded by ``known`` labelled rows per class (chosen at random from
  ``seed``, not the meter's first rows) and keeps those rows in their class;
* ``completion_attack``: a nearest-class-mean classifier of each row's latest activation, fitted on ``known``
  random labelled rows per class;
* ``ridge_attack``: the label owner's ridge decoder, fitted by gradient-free least squares on a random fifth
  of the rows (``seed``), scored by R^2 on the others.

Usage (a run traced with --trace-params sent_activation_grad,sent_activation, metered with --privacy-meter):
    python benchmarks/attackers.py EXPERIMENT TRACE [--summary SUMMARY] [--seeds N]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np


def trace_tensors(path: str, name: str) -> dict[int, np.ndarray]:
    """step -> the tensor ``name`` a trace recorded (steps that did not record it are left out)."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if name in record.get("grads", {}):
                out[record["step"]] = np.asarray(record["grads"][name], np.float64)
    return out


def _known(labels: np.ndarray, known: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    chosen = np.zeros(len(labels), bool)
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        chosen[rng.choice(members, min(known, len(members)), replace=False)] = True
    return chosen


def row_means(received: dict[int, np.ndarray], rows_of: Any) -> tuple[np.ndarray, np.ndarray]:
    """(row numbers, each one's mean received row): what the data owner averages over every step."""
    total: dict[int, np.ndarray] = {}
    count: dict[int, int] = {}
    for step, grads in received.items():
        for row, g in zip(rows_of(step), grads.reshape(len(grads), -1)):
            total[int(row)] = total.get(int(row), 0) + g
            count[int(row)] = count.get(int(row), 0) + 1
    rows = np.array(sorted(total))
    return rows, np.stack([total[r] / count[r] for r in rows])


def averaging_attack(rows: np.ndarray, means: np.ndarray, labels_of_rows: np.ndarray, known: int,
                     seed: int = 0) -> float:
    """The share of unknown rows whose label anchored k-means of the rows' mean gradients (``row_means``)
    recovers, ``known`` random rows per class known."""
    means = means / np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-30)
    labels = labels_of_rows[rows]
    classes = np.unique(labels)
    chosen = _known(labels, known, seed)
    centres = np.stack([means[chosen & (labels == c)].mean(0) for c in classes])
    cluster = None
    for _ in range(100):
        centres = centres / np.maximum(np.linalg.norm(centres, axis=1, keepdims=True), 1e-30)
        new = np.argmax(means @ centres.T, axis=1)
        for i, c in enumerate(classes):
            new[chosen & (labels == c)] = i
        if cluster is not None and (new == cluster).all():
            break
        cluster = new
        centres = np.stack([means[cluster == i].mean(0) if (cluster == i).any() else centres[i]
                            for i in range(len(classes))])
    return float((classes[cluster] == labels)[~chosen].mean())


def averaged_direction_auc(rows: np.ndarray, means: np.ndarray, labels_of_rows: np.ndarray, known: int,
                           seed: int = 0) -> float:
    """Two classes (0 and 1): the AUC, over the unknown rows, of each row's mean gradient's cosine with the
    known class-1 rows' mean direction minus its cosine with the known class-0 rows', as the score of class 1
    (``known`` random rows per class known). Chance 0.5 whatever the classes' shares."""
    means = means / np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-30)
    labels = labels_of_rows[rows]
    chosen = _known(labels, known, seed)
    centres = [means[chosen & (labels == c)].mean(0) for c in (0, 1)]
    centres = [c / max(float(np.linalg.norm(c)), 1e-30) for c in centres]
    score = means @ centres[1] - means @ centres[0]
    positive, negative = score[~chosen & (labels == 1)], score[~chosen & (labels == 0)]
    return float(((positive[:, None] > negative[None, :]).sum() + 0.5 * (positive[:, None] == negative[None, :]).sum())
                 / (len(positive) * len(negative)))


def completion_attack(received: dict[int, np.ndarray], rows_of: Any, labels_of_rows: np.ndarray, known: int,
                      seed: int = 0) -> float:
    """The accuracy of a few-shot nearest-class-mean classifier of each row's latest received activation."""
    latest: dict[int, np.ndarray] = {}
    for step in sorted(received):
        for row, a in zip(rows_of(step), received[step].reshape(len(received[step]), -1)):
            latest[int(row)] = a
    rows = np.array(sorted(latest))
    x = np.stack([latest[r] for r in rows])
    labels = labels_of_rows[rows]
    chosen = _known(labels, known, seed)
    mu, sd = x[chosen].mean(0), x[chosen].std(0) + 1e-8
    z = (x - mu) / sd
    classes = np.unique(labels)
    centres = np.stack([z[chosen & (labels == c)].mean(0) for c in classes])
    guess = classes[np.argmin(((z[:, None, :] - centres[None]) ** 2).sum(-1), axis=1)]
    return float((guess == labels)[~chosen].mean())


def ridge_attack(activations: np.ndarray, inputs: np.ndarray, seed: int = 0, public: float = 0.2) -> float:
    """R^2 of the private rows' inputs by a ridge decoder fitted on a random ``public`` share of the pairs
    (the ridge strength chosen among a few by the private R^2: the best such decoder)."""
    z = activations.reshape(len(activations), -1)
    x = inputs.reshape(len(inputs), -1)
    order = np.random.default_rng(seed).permutation(len(z))
    cut = int(public * len(z))
    pub, priv = order[:cut], order[cut:]
    zc = z[pub] - z[pub].mean(0)
    xc = x[pub] - x[pub].mean(0)
    best = -np.inf
    for alpha in (1e-6, 1e-4, 1e-2, 1e-1, 1.0):
        lam = alpha * np.mean(z[pub] ** 2) * len(pub)
        w = np.linalg.solve(zc.T @ zc + lam * np.eye(z.shape[1]), zc.T @ xc)
        predicted = (z[priv] - z[pub].mean(0)) @ w + x[pub].mean(0)
        r2 = 1 - ((predicted - x[priv]) ** 2).sum() / ((x[priv] - x[priv].mean(0)) ** 2).sum()
        best = max(best, float(r2))
    return best


def attack_run(experiment: str, trace: str, seeds: int = 20) -> dict[str, float]:
    """Every independent attack on the run of ``experiment`` (a path or built-in name) that ``trace`` recorded:
    ``attack_experiment`` of the loaded experiment."""
    from distgrad.config.parse import load_experiment
    return attack_experiment(load_experiment(experiment), trace, seeds)


def attack_experiment(exp: Any, trace: str, seeds: int = 20, seed: int | None = None,
                      first_epoch: bool = False) -> dict[str, float]:
    """Every independent attack on the run of the experiment ``exp`` (run with ``seed``, default its own) that
    ``trace`` recorded, each the mean over ``seeds`` random choices of its known rows or public share (the
    whole run, as the meters' whole-run figures; the activations' attacks only when the trace holds
    ``sent_activation``); with ``first_epoch`` also ``averaged_recovery_1_first_epoch``:
    one known row per class, each row's gradients of the run's first epoch only (each row received once); on
    two classes also ``averaged_direction_auc_10``."""
    seed = exp.seed if seed is None else seed
    data = exp.build_data(seed, stage=exp.stage_names[-1])
    features = exp.build_data(seed, stage=exp.stage_names[0])
    labels = data.all_targets()
    grads = trace_tensors(trace, "sent_activation_grad")
    acts = trace_tensors(trace, "sent_activation")
    rows, means = row_means(grads, data.step_rows)
    out = {f"averaged_recovery_{k}": float(np.mean([averaging_attack(rows, means, labels, k, s)
                                                   for s in range(seeds * (5 if k == 1 else 1))]))
           for k in (1, 10)}
    if set(np.unique(labels[rows]).tolist()) == {0, 1}:
        out["averaged_direction_auc_10"] = float(np.mean([averaged_direction_auc(rows, means, labels, 10, s)
                                                          for s in range(seeds)]))
    if first_epoch:
        first = {step: g for step, g in grads.items() if step <= data.batches_per_epoch}
        rows, means = row_means(first, data.step_rows)
        out["averaged_recovery_1_first_epoch"] = float(np.mean([averaging_attack(rows, means, labels, 1, s)
                                                                for s in range(seeds * 5)]))
    if not acts:           # a trace of the gradients only: no attack on the activations
        return out
    out["model_completion"] = float(np.mean([completion_attack(acts, data.step_rows, labels, 10, s)
                                             for s in range(seeds)]))
    steps = sorted(acts)
    z = np.concatenate([acts[s] for s in steps])
    x = np.concatenate([features.features(s) for s in steps])
    out["ridge_r2_run"] = float(np.mean([ridge_attack(z, x, s) for s in range(seeds)]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    parser.add_argument("trace")
    parser.add_argument("--summary", help="the run's summary: print the meters' whole-run figures beside")
    parser.add_argument("--seeds", type=int, default=20, help="random choices each attack is the mean over")
    args = parser.parse_args()
    independent = attack_run(args.experiment, args.trace, args.seeds)
    meter: dict[str, float] = {}
    if args.summary:
        with open(args.summary, encoding="utf-8") as f:
            summary = json.load(f)
        meter = {**summary.get("label_attacks", [{}])[-1], **summary.get("input_attacks", [{}])[-1]}
    for name, value in independent.items():
        beside = f"  meter {meter[name]:.3f}  difference {meter[name] - value:+.3f}" if name in meter else ""
        print(f"{name:22s} independent {value:.3f}{beside}")
    print(json.dumps({"independent": independent, "meter": {k: meter[k] for k in independent if k in meter}}))


if __name__ == "__main__":
    main()
