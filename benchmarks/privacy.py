"""The privacy trade-off, measured: held-out accuracy against every leak figure, for each defense's parameter.

Usage: python benchmarks/privacy.py [--smoke] [--seeds N] [--json PATH] [--plot PNG] [--write-docs]
       python benchmarks/privacy.py --averaging EXPERIMENT [--seeds N] [--secrets K] [--epochs E]

Three tasks: ``digits`` (the built-in experiment, 10 classes), ``digits-0-vs-rest``
(the same images relabelled: 1 for a zero, 0 for any other digit, and a
Dense 64->2 head) and ``breast-cancer`` (distgrad/datasets/breast_cancer.csv,
its 30 columns standardised over all rows, Dense 30->16 + ReLU, then
Dense 16->2). Each defense (docs/privacy.md, "Defenses") is swept over its
parameter on each task, beside the undefended run, three seeds each (the seed
also draws the held-out split), in one process (``train_in_process``:
bitwise what the stage processes of ``distgrad run`` train) with both live
meters on (``privacy_meter``).

A run's leak figure is the mean over the meter's windows (50 steps each,
and the last) of the whole run: what the other party sees over training,
not only at its end. The table gives, per setting, the mean over the seeds
(and, for held-out accuracy, the spread of the seeds: min-max), and the
label-DP epsilon the run's summary states (``privacy``). ``--write-docs``
writes the table, the plot and the privacy targets (label recovery and accuracy) into
docs/privacy.md's section "The trade-off, measured" (replacing only that
section) and the plot to docs/privacy_tradeoff.png.

``--smoke``: one seed, 60 steps, two settings per task (the smoke test of
tests/test_benchmarks.py).

``--averaging EXPERIMENT``: instead of the sweep, the data owner's strongest
attack on the label owner's noised gradients (``averaging_attack``: each
row's received gradients averaged over the run, then k-means anchored on 1 or
10 known rows per class) against a built-in experiment with its own
``clip_noise`` (the recommended ``digits-budget``), on ``--seeds`` split seeds
with ``--secrets`` noise secrets each: a markdown table of sigma, epsilon,
held-out accuracy and the labels recovered (docs/privacy.md, "Recommended
settings: chosen by a budget").
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from distgrad.config.parse import parse_experiment
from distgrad.run.inprocess import train_in_process

ROOT = Path(__file__).resolve().parent.parent
DATASETS = ROOT / "distgrad" / "datasets"
DOC = ROOT / "docs" / "privacy.md"
PLOT = ROOT / "docs" / "privacy_tradeoff.png"
SECTION = "## The trade-off, measured"
COMMAND = "python benchmarks/privacy.py --write-docs"
FIGURES = ("label_recovery", "cosine_auc", "norm_auc", "direction_auc", "distance_correlation")


@dataclass(frozen=True)
class Task:
    """One data set and model: a combined experiment built from ``raw`` (its data written by ``prepare``)."""
    name: str
    steps: int
    clip_g: float              # the label owner's clip_noise bound C (about its gradient rows' typical norm)
    clip_f: float              # the data owner's clip_noise bound C (about its activation rows' typical norm)
    raw: dict[str, Any]


@dataclass(frozen=True)
class Setting:
    """A defense with one value of its parameter: ``keys`` go into the stage table of ``party``."""
    family: str                # e.g. "g clip_noise": the sweep it belongs to (a line of the plot)
    label: str                 # e.g. "g clip_noise C=0.05 sigma=0.5"
    party: str                 # "f", "g" or "" (undefended)
    keys: dict[str, Any]


def _model(inputs: int, hidden: int, classes: int, lr: float) -> list[dict[str, Any]]:
    return [{"name": "f", "model": [{"type": "dense", "name": "f1", "in": inputs, "out": hidden}, {"type": "relu"}],
             "optimizer": {"type": "adam", "lr": lr}},
            {"name": "g", "model": [{"type": "dense", "name": "g1", "in": hidden, "out": classes}],
             "optimizer": {"type": "adam", "lr": lr}, "loss": "softmax_cross_entropy"}]


def prepare(workdir: Path) -> list[Task]:
    """Write the two-class data sets into ``workdir`` and return the three tasks."""
    digits = np.load(DATASETS / "digits.npz")
    np.savez(workdir / "digits0.npz", pixels=digits["pixels"], zero=(digits["digit"] == 0).astype(np.int64))
    with open(DATASETS / "breast_cancer.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))[1:]
    values = np.array([[float(v) for v in row[1:-1]] for row in rows])
    np.savez(workdir / "breast.npz", x=((values - values.mean(axis=0)) / values.std(axis=0)).astype(np.float32),
             y=np.array([int(row[-1]) for row in rows], dtype=np.int64))
    pixels = {"kind": "npz", "features": "pixels", "feature_scale": 0.0625, "batch": 32, "test_fraction": 0.2}
    common = {"labels": "last", "seed": 0}
    return [
        Task("digits", 800, 0.05, 8.0,
             {"name": "digits", **common, "data": {**pixels, "path": str(DATASETS / "digits.npz"), "labels": "digit"},
              "stages": _model(64, 64, 10, 0.003)}),
        Task("digits-0-vs-rest", 800, 0.05, 8.0,
             {"name": "digits-0-vs-rest", **common,
              "data": {**pixels, "path": str(workdir / "digits0.npz"), "labels": "zero"},
              "stages": _model(64, 64, 2, 0.003)}),
        Task("breast-cancer", 600, 0.05, 4.0,
             {"name": "breast-cancer", **common,
              "data": {"kind": "npz", "path": str(workdir / "breast.npz"), "features": "x", "labels": "y",
                       "batch": 16, "test_fraction": 0.2},
              "stages": _model(30, 16, 2, 0.01)}),
    ]


def settings(task: Task, smoke: bool) -> list[Setting]:
    """The undefended run and each defense's sweep on ``task`` (two settings with ``smoke``)."""
    g_clip = [Setting("g clip_noise", f"g clip_noise C={task.clip_g} sigma={s}", "g",
                      {"clip_noise": {"max_norm": task.clip_g, "sigma": s}}) for s in (0.25, 0.5, 1.0, 2.0, 4.0)]
    plain = Setting("undefended", "undefended", "", {})
    if smoke:
        return [plain, g_clip[1]]
    return [plain, *g_clip,
            Setting("g max_norm", "g max_norm", "g", {"max_norm": True}),
            *[Setting("g max_norm + clip_noise", f"g max_norm + clip_noise C={task.clip_g} sigma={s}", "g",
                      {"max_norm": True, "clip_noise": {"max_norm": task.clip_g, "sigma": s}}) for s in (0.25, 1.0)],
            *[Setting("g label_dp", f"g label_dp epsilon={e}", "g", {"label_dp": {"epsilon": e}})
              for e in (0.5, 1.0, 2.0, 4.0, 8.0)],
            *[Setting("f clip_noise", f"f clip_noise C={task.clip_f} sigma={s}", "f",
                      {"clip_noise": {"max_norm": task.clip_f, "sigma": s}}) for s in (0.05, 0.1, 0.25, 0.5)],
            *[Setting("f nopeek", f"f nopeek weight={w}", "f", {"nopeek": {"weight": w}})
              for w in (0.5, 2.0, 5.0, 7.0, 10.0)]]


def one_run(task: Task, setting: Setting, seed: int, steps: int) -> dict[str, Any]:
    """Train ``task`` with ``setting`` in one process, meters on; its accuracy, leak figures and budget."""
    raw = json.loads(json.dumps(task.raw))
    for stage in raw["stages"]:
        if stage["name"] == setting.party:
            stage.update(setting.keys)
    summary = train_in_process(parse_experiment(raw, f"<{task.name}>"), steps=steps, seed=seed, privacy_meter=True)
    windows = summary.get("label_leaks", []) + summary.get("input_leaks", [])
    figures: dict[str, float] = {}
    for name in FIGURES:
        for suffix in ("", "_chance"):
            values = [w[name + suffix] for w in windows if name + suffix in w]
            if values:
                figures[name + suffix] = float(np.mean(values))
                if not suffix:
                    figures[name + "_max"], figures[name + "_last"] = float(np.max(values)), float(values[-1])
    return {"test_accuracy": summary["test_accuracy"], "figures": figures, "privacy": summary.get("privacy", {}),
            "elapsed_s": summary["elapsed_s"]}


def budget(privacy: dict[str, Any]) -> str:
    """The label owner's stated label-DP epsilon, short: '2 (exact)', '81.1 at δ=1e-05', or 'none'."""
    parts = []
    entry = privacy.get("g", {})
    if "label_dp" in entry:
        parts.append(f"{entry['label_dp']['epsilon']:g} (exact)")
    clip = entry.get("clip_noise", {})
    if "epsilon" in clip:
        parts.append(f"{clip['epsilon']:.3g} at δ={clip['delta']:g}")
    elif clip:
        parts.append("needs dp-accounting")
    return " + ".join(parts) if parts else "none"


def aggregate(setting: Setting, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The seeds' mean of each figure, and their accuracies' mean, min and max."""
    accuracies = [r["test_accuracy"] for r in runs]
    names = sorted(set().union(*(r["figures"] for r in runs)))
    return {"test_accuracy": statistics.fmean(accuracies), "test_accuracy_min": min(accuracies),
            "test_accuracy_max": max(accuracies), "accuracies": accuracies,
            "figures": {n: statistics.fmean(r["figures"][n] for r in runs if n in r["figures"]) for n in names},
            "budget": budget(runs[0]["privacy"]), "family": setting.family, "runs": runs}


def _cell(figures: dict[str, float], name: str) -> str:
    return f"{figures[name]:.3f}" if name in figures else "-"


def markdown(results: dict[str, dict[str, dict[str, Any]]], seeds: int) -> str:
    """One table per task: each setting's accuracy, leak figures (chance in the first line) and budget."""
    out = []
    for task, rows in results.items():
        plain = rows["undefended"]["figures"]
        names = [n for n in FIGURES if n in plain]
        out.append(f"**{task}** ({seeds} seed{'s' if seeds > 1 else ''}; held-out accuracy: mean, and min-max "
                   "over the seeds; leak figures: mean over the run's meter windows and the seeds)\n")
        out.append("| setting | held-out accuracy | " + " | ".join(f"`{n}`" for n in names) + " | label-DP ε |")
        out.append("|---|---|" + "---|" * len(names) + "---|")
        out.append("| *chance* | | " + " | ".join(_cell(plain, n + "_chance") for n in names) + " | |")
        for label, row in rows.items():
            acc = f"{row['test_accuracy']:.4f} ({row['test_accuracy_min']:.3f}-{row['test_accuracy_max']:.3f})"
            out.append(f"| {label} | {acc} | " + " | ".join(_cell(row["figures"], n) for n in names)
                       + f" | {row['budget']} |")
        out.append("")
    return "\n".join(out)


def targets(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The privacy targets this sweep measures, each with its figure and met / not met."""
    lines = []

    def best(task: str, floor: float, score: Any, bound: float) -> tuple[str, dict[str, Any], bool] | None:
        """Among the settings of accuracy >= floor: the most accurate one whose score is <= bound (met), else
        the one of the lowest score (not met); None when no setting reaches the floor."""
        found = [(label, row) for label, row in results[task].items() if row["test_accuracy"] >= floor]
        meeting = [(label, row) for label, row in found if score(row) <= bound]
        if meeting:
            return (*max(meeting, key=lambda item: item[1]["test_accuracy"]), True)
        return (*min(found, key=lambda item: score(item[1])), False) if found else None

    def verdict(met: bool) -> str:
        return "**met**" if met else "**not met**"

    if "digits" in results:
        hit = best("digits", 0.95, lambda r: r["figures"]["label_recovery_max"], 0.25)
        if hit:
            label, row, met = hit
            lines.append(f"- Digits, anchor recovery <= 0.25 at held-out accuracy >= 0.95, in every window: "
                         f"{verdict(met)}. "
                         f"{'The most accurate such setting' if met else 'Lowest recovery at accuracy >= 0.95'}: "
                         f"{label}, recovery {row['figures']['label_recovery']:.3f} (worst window "
                         f"{row['figures']['label_recovery_max']:.3f}) at accuracy {row['test_accuracy']:.4f}.")
        else:
            lines.append("- Digits, anchor recovery <= 0.25 at held-out accuracy >= 0.95: **not met** "
                         "(no setting reached accuracy 0.95).")
    for task in ("digits-0-vs-rest", "breast-cancer"):
        if task not in results:
            continue
        plain = results[task]["undefended"]["test_accuracy"]
        hit = best(task, plain - 0.01, two_class_leak, 0.60)
        if hit:
            label, row, met = hit
            lines.append(f"- {task}, norm AUC and direction AUC both <= 0.60 (and >= 0.40: a flipped score leaks "
                         f"alike) at accuracy within one point of the undefended {plain:.4f}: {verdict(met)}. "
                         f"{'The most accurate such setting' if met else 'Closest'}: {label}, norm AUC "
                         f"{row['figures']['norm_auc']:.3f}, direction AUC {row['figures']['direction_auc']:.3f}, "
                         f"accuracy {row['test_accuracy']:.4f} (worst windows: norm AUC "
                         f"{row['figures']['norm_auc_max']:.3f}, direction AUC "
                         f"{row['figures']['direction_auc_max']:.3f}).")
    dp = results.get("digits", {}).get("g label_dp epsilon=2.0")
    if dp:
        lines.append(f"- `label_dp` epsilon = 2 on digits, accuracy >= 0.90: {verdict(dp['test_accuracy'] >= 0.90)} "
                     f"({dp['test_accuracy']:.4f}; seeds {', '.join(f'{a:.4f}' for a in dp['accuracies'])}), with "
                     "the default loss. RR-with-prior against plain randomized response: benchmarks/label_dp.py "
                     "(\"Label DP: accuracy against epsilon\").")
    if "digits" in results:
        base = results["digits"]["undefended"]["figures"]["distance_correlation"]
        nopeek = {label: row for label, row in results["digits"].items() if "nopeek" in label}
        good = {label: row for label, row in nopeek.items() if row["test_accuracy"] >= 0.97}
        if good:
            label, row = min(good.items(), key=lambda item: item[1]["figures"]["distance_correlation"])
            drop = 1 - row["figures"]["distance_correlation"] / base
            last = results["digits"]["undefended"]["figures"]["distance_correlation_last"]
            drop_last = 1 - row["figures"]["distance_correlation_last"] / last
            lines.append(f"- NoPeek on digits, distance correlation down >= 30% at accuracy >= 0.97: "
                         f"{verdict(drop >= 0.30)} over the whole run. Best: {label}, distance correlation "
                         f"{row['figures']['distance_correlation']:.3f} against {base:.3f} undefended "
                         f"({-100 * drop:+.0f}%; in the last window {row['figures']['distance_correlation_last']:.3f}"
                         f" against {last:.3f}, {-100 * drop_last:+.0f}%), accuracy {row['test_accuracy']:.4f}.")
        elif nopeek:
            lines.append("- NoPeek on digits, distance correlation down >= 30% at accuracy >= 0.97: **not met** "
                         "(no NoPeek setting reached accuracy 0.97).")
    lines.append("- The meter against the offline audit within 0.02, and every defense bitwise equal to "
                 "`--in-process` (micro-batches, codec, kill -9 and resume): not measured by this sweep "
                 "(`distgrad audit` and tests/test_defenses.py).")
    return lines


def two_class_leak(row: dict[str, Any]) -> float:
    """The larger of the norm and direction AUC, each taken as max(AUC, 1 - AUC): an AUC below 0.5 leaks as much
    as its mirror above (the attacker flips the score)."""
    return max(max(a, 1 - a) for a in (row["figures"]["norm_auc"], row["figures"]["direction_auc"]))


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    """One row of panels per task, one panel per leak figure: held-out accuracy against it, a line per defense."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), len(FIGURES), figsize=(4 * len(FIGURES), 3.4 * len(results)),
                             squeeze=False)
    for row, (task, rows) in enumerate(results.items()):
        families: dict[str, list[dict[str, Any]]] = {}
        for result in rows.values():
            families.setdefault(result["family"], []).append(result)
        for col, name in enumerate(FIGURES):
            ax = axes[row][col]
            plain = rows["undefended"]["figures"]
            if name not in plain:
                ax.set_axis_off()
                continue
            for family, members in families.items():
                xs = [m["figures"].get(name) for m in members]
                ys = [m["test_accuracy"] for m in members]
                if family == "undefended":
                    ax.plot(xs, ys, "k*", markersize=12, label=family)
                else:
                    ax.plot(xs, ys, "o-", markersize=4, label=family)
            ax.axvline(plain[name + "_chance"], color="grey", linestyle="--", linewidth=1)
            ax.set_xlabel(f"{name} (dashed: chance)")
            ax.set_ylabel("held-out accuracy")
            ax.set_title(task, fontsize=10)
        axes[row][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_docs(results: dict[str, dict[str, dict[str, Any]]], table: str, target_lines: list[str], seeds: int,
               elapsed_s: float) -> None:
    """Replace (or add, before '## Not done') docs/privacy.md's section SECTION."""
    max_norm = results["digits"]["g max_norm"]["figures"]
    noise = results["digits-0-vs-rest"]["g clip_noise C=0.05 sigma=4.0"]["figures"]
    intro = (f"Each defense swept over its parameter on three tasks, beside the undefended run, {seeds} seeds each "
             f"(the seed also draws the held-out rows), in one process with both meters on (`{COMMAND}`, about "
             f"{elapsed_s:.0f} s on the shared two-core development machine; it rewrites this section and "
             "[privacy_tradeoff.png](privacy_tradeoff.png)). The tasks: `digits` (the built-in experiment, 800 steps, "
             "359 held-out rows), `digits-0-vs-rest` (the same images, label 1 for a zero; a Dense 64->2 head; 800 "
             "steps) and `breast-cancer` (the 30 columns standardised, Dense 30->16 + ReLU, Dense 16->2, batch 16, "
             "600 steps, 114 held-out rows: one row is 0.9 points). The label owner's clip bound is C = 0.05, "
             "about the largest gradient rows at the start of training (their median norm at step 1: 0.038, 0.010, "
             "0.053; they shrink as the loss falls), so the clip seldom binds and the noise, sigma·C per element, is "
             "what defends. The data owner's is C = 8 (digits) or 4 (breast cancer), against activation rows of "
             "median norm 3 at the start and 10, 7 and 7 at the end (measured once, at the step-1 and final "
             "parameters of seed 0). Leak figures are those of the live meter "
             "(\"The live leak meter\" above), averaged over the windows of the whole run; `distance_correlation` is "
             "the data owner's meter (its inputs against the activations it sends), the others the label owner's "
             "(the true training labels, also under `label_dp`, against the gradient rows it sends). A label "
             "owner's defense leaves the distance correlation where it was and a data owner's the label figures: "
             "each row shows both. The targets below take the mean over the windows, except anchor recovery on "
             f"`digits`, which must hold in the worst window too: `max_norm` there recovers "
             f"{max_norm['label_recovery']:.2f} on average but {max_norm['label_recovery_max']:.2f} in its worst "
             "window (the first, before training spreads the rows' norms). A two-class AUC's worst window is "
             "biased above 0.5 by the few label-1 rows a window scores (about 14 on digits-0-vs-rest): "
             f"with sigma = 4, rows that are nearly pure noise, it still reaches {noise['norm_auc_max']:.2f} (norm) "
             f"and {noise['direction_auc_max']:.2f} (direction) there. The JSON output "
             "(`--json`) has each figure's worst and last window.")
    bullets = [textwrap.fill(line, 110, subsequent_indent="  ", break_on_hyphens=False) for line in target_lines]
    body = (f"{SECTION}\n\n{textwrap.fill(intro, 110, break_on_hyphens=False)}\n\n"
            f"![held-out accuracy against each leak figure](privacy_tradeoff.png)\n\n{table}\n"
            "**The privacy targets**, as measured here:\n\n" + "\n".join(bullets) + "\n\n")
    text = DOC.read_text()
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## )", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: body, text)
    else:
        text = text.replace("\n## Not done\n", f"\n{body}## Not done\n", 1)
    DOC.write_text(text)


# --- the per-row averaging attack (a data owner that knows every row's id) ---------------------------------

def row_means(step_rows: np.ndarray, received: np.ndarray, weighted: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Each row's mean received gradient (``step_rows[s]``: the row ids of step s, ``received[s]``: its
    gradient rows in that order): the row ids seen and their means, scaled to norm 1 (k-means then compares
    directions). ``weighted``: each epoch's gradient of a row is weighted by how much label signal that epoch
    carries, estimated without labels from the products of a row's gradients in different epochs (the noise
    of two epochs is independent, the signal is not): early epochs, whose gradients are large, count more."""
    ids = np.asarray(step_rows, np.int64)
    flat = np.asarray(received, np.float64).reshape(ids.size, -1)
    seen = np.unique(ids)
    weights = np.ones(len(ids))
    if weighted:
        # rows are walked once per epoch: epoch e holds steps whose rows complete a pass over the seen rows
        per_epoch = max(1, len(seen) // ids.shape[1])
        epochs = np.arange(len(ids)) // per_epoch
        count = int(epochs.max()) + 1
        by_epoch = np.zeros((count, int(ids.max()) + 1, flat.shape[1]))
        for e in range(count):
            at = np.repeat(epochs == e, ids.shape[1])
            by_epoch[e, ids.reshape(-1)[at]] = flat[at]
        total = by_epoch.sum(axis=0)
        signal = np.array([np.mean(np.sum(by_epoch[e][seen] * (total[seen] - by_epoch[e][seen]), axis=1))
                           for e in range(count)])
        weights = np.maximum(signal, 0.0)[epochs] if count > 1 else weights
    sums = np.zeros((int(ids.max()) + 1, flat.shape[1]))
    np.add.at(sums, ids.reshape(-1), flat * np.repeat(weights, ids.shape[1])[:, None])
    means = sums[seen]
    norms = np.linalg.norm(means, axis=1, keepdims=True)
    return seen, means / np.where(norms > 0, norms, 1.0)


def anchored_kmeans(points: np.ndarray, truth: np.ndarray, known: int = 1, seed: int = 0,
                    iterations: int = 50) -> float:
    """The share of ``points`` whose class (``truth``) k-means anchored on ``known`` points per class with
    known labels gets right: each class's first centroid is its known points' mean, and they stay in their
    class. Scored on the other points; chance is about the largest class's share."""
    classes = np.unique(truth)
    rng = np.random.default_rng(seed)
    anchors = {int(c): rng.choice(np.flatnonzero(truth == c), size=min(known, int((truth == c).sum())),
                                  replace=False) for c in classes}
    anchored = np.full(len(points), -1)
    for c, rows in anchors.items():
        anchored[rows] = c
    centroids = np.stack([points[anchors[int(c)]].mean(axis=0) for c in classes])
    assigned = np.full(len(points), -2)
    for _ in range(iterations):
        distances = ((points[:, None, :] - centroids[None, :, :]) ** 2).sum(axis=2)
        nearest = np.where(anchored >= 0, anchored, classes[np.argmin(distances, axis=1)])
        if np.array_equal(nearest, assigned):
            break
        assigned = nearest
        centroids = np.stack([points[assigned == c].mean(axis=0) if (assigned == c).any() else centroids[i]
                              for i, c in enumerate(classes)])
    scored = anchored < 0
    return float(np.mean(assigned[scored] == truth[scored]))


def averaging_attack(step_rows: np.ndarray, received: np.ndarray, labels: np.ndarray, known: int = 1,
                     seed: int = 0, weighted: bool = False) -> float:
    """The share of labels a data owner that knows every row's id recovers from the gradient rows it
    received: each row's gradients averaged over the steps it was in (``row_means``), then k-means anchored
    on ``known`` rows per class (``anchored_kmeans``). ``labels``: every row's true class, by row id."""
    seen, means = row_means(step_rows, received, weighted)
    return anchored_kmeans(means, np.asarray(labels)[seen], known, seed)


def averaging_run(clip: dict[str, Any] | None, epochs: int = 30, seed: int = 0, known: tuple[int, ...] = (1, 10),
                  experiment: str = "digits", noise_secret: int | None = None) -> dict[str, Any]:
    """The built-in ``experiment`` (digits, or a variant of it such as ``digits-budget``) for ``epochs`` epochs
    with the label owner's ``clip_noise = clip`` (None: the experiment's own), in one process, its trace keeping
    what the data owner received (``sent_activation_grad``): the held-out accuracy, the summary's budget and
    ``averaging_attack``'s recovery with each count of ``known`` rows per class. ``noise_secret``: the run's
    (None: a fresh one, or ``DISTGRAD_NOISE_SECRET``)."""
    from distgrad.config.parse import load_experiment
    with tempfile.TemporaryDirectory(prefix="distgrad-averaging-") as name:
        path = Path(name) / f"{experiment}.toml"
        text = (ROOT / "distgrad" / "experiments" / f"{experiment}.toml").read_text().replace(
            '"../datasets/', f'"{DATASETS}/')
        if clip is not None:
            inline = ", ".join(f"{k} = {v}" for k, v in clip.items())
            head, f_stage, g_stage = text.split("[[stages]]")
            text = "[[stages]]".join([head, f_stage, g_stage.rstrip() + f"\nclip_noise = {{ {inline} }}\n"])
        path.write_text(text)
        exp = load_experiment(path)
        data = exp.build_data(seed, stage="g")
        steps = epochs * data.batches_per_epoch
        trace = Path(name) / "trace.jsonl"
        summary = train_in_process(exp, steps=steps, seed=seed, trace_path=trace,
                                   trace_params={"sent_activation_grad"}, noise_secret=noise_secret)
        received, rows = [], []
        with trace.open() as lines:
            for line in lines:
                entry = json.loads(line)
                received.append(np.array(entry["grads"]["sent_activation_grad"], np.float32))
                rows.append(data.step_rows(entry["step"]))
    labels = np.zeros(data.row_count, np.int64)
    everything = np.concatenate(rows)
    labels[everything] = np.concatenate([data.targets_at(r) for r in rows])
    return {"test_accuracy": summary["test_accuracy"], "privacy": summary["privacy"]["g"]["clip_noise"],
            "steps": steps, **{f"recovery_known_{k}{'_weighted' if w else ''}":
                               averaging_attack(np.stack(rows), np.stack(received), labels, k, seed, w)
                               for k in known for w in (False, True)}}


def averaging_table(experiment: str, seeds: int, secrets: int, epochs: int) -> str:
    """``averaging_run`` of the built-in ``experiment`` (its own clip_noise) on split seeds 0..``seeds``-1, each
    with noise secrets 1..``secrets``: one markdown row per run (seed, secret, sigma, epsilon, held-out
    accuracy, the labels recovered with 1 and 10 known rows per class, plain / weighted by epoch)."""
    lines = ["| seed | secret | sigma | epsilon (worst row, releases) | held-out accuracy | recovered, 1 known "
             "(plain / weighted) | recovered, 10 known (plain / weighted) |", "|---|---|---|---|---|---|---|"]
    for seed in range(seeds):
        for secret in range(1, secrets + 1):
            r = averaging_run(None, epochs, seed, experiment=experiment, noise_secret=secret)
            budget = r["privacy"]
            lines.append(f"| {seed} | {secret} | {budget['sigma']:.3f} | {budget['epsilon']:.2f} "
                         f"({budget['releases']}) | {r['test_accuracy']:.4f} | {r['recovery_known_1']:.3f} / "
                         f"{r['recovery_known_1_weighted']:.3f} | {r['recovery_known_10']:.3f} / "
                         f"{r['recovery_known_10_weighted']:.3f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one seed, 60 steps, two settings per task")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("--plot", type=Path, help="draw the trade-off here (PNG; needs matplotlib)")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"write the table and targets into {DOC.relative_to(ROOT)} and the plot to "
                             f"{PLOT.relative_to(ROOT)}")
    parser.add_argument("--averaging", metavar="EXPERIMENT",
                        help="instead of the sweep: the per-row averaging attack against the built-in EXPERIMENT "
                             "(e.g. digits-budget) with its own clip_noise, on split seeds 0..--seeds-1, "
                             "each with --secrets noise secrets, --epochs epochs")
    parser.add_argument("--secrets", type=int, default=2, help="with --averaging: noise secrets per seed")
    parser.add_argument("--epochs", type=int, default=30, help="with --averaging: epochs of each run")
    args = parser.parse_args()
    if args.averaging is not None:
        print(averaging_table(args.averaging, args.seeds, args.secrets, 2 if args.smoke else args.epochs))
        return
    if args.write_docs and args.smoke:
        parser.error("--write-docs takes the full sweep's figures only, not --smoke's")
    seeds = 1 if args.smoke else args.seeds
    started = time.monotonic()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="distgrad-privacy-") as name:
        for task in prepare(Path(name)):
            steps = 60 if args.smoke else task.steps
            results[task.name] = {}
            for setting in settings(task, args.smoke):
                runs = [one_run(task, setting, seed, steps) for seed in range(seeds)]
                results[task.name][setting.label] = aggregate(setting, runs)
                row = results[task.name][setting.label]
                print(f"{task.name}: {setting.label}: accuracy {row['test_accuracy']:.4f}, "
                      + ", ".join(f"{n} {row['figures'][n]:.3f}" for n in FIGURES if n in row["figures"]),
                      flush=True)
    elapsed = time.monotonic() - started
    table, target_lines = markdown(results, seeds), targets(results)
    print(f"\n{table}\n" + "\n".join(target_lines) + f"\n\nsweep took {elapsed:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({"smoke": args.smoke, "seeds": seeds, "elapsed_s": elapsed,
                                         "results": results, "targets": target_lines}, indent=1))
    if args.plot is not None or args.write_docs:
        plot(results, args.plot or PLOT)
    if args.write_docs:
        write_docs(results, table, target_lines, seeds, elapsed)


if __name__ == "__main__":
    main()
