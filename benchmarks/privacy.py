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

``python benchmarks/privacy.py --table [--smoke] [--rows 12,13 [--reuse PATH]] [--json PATH]
[--write-docs]`` (the section "what protects what" below) measures instead each defense against the attack it
is meant for, one run per row of ``cases()`` (seed 0): held-out accuracy, the epsilon the run prints, what
the live meters show (the window meters and the strongest-attack meters, whole run and worst window) and
what an independent attacker (benchmarks/attackers.py, tests/hijacking.py,
benchmarks/held_out_reconstruction.py) obtains on the same run. A row whose attack needs only what
crossed trains in one process, traced (``train_in_process``: bitwise what the stage processes train and
send); the one-step runs and ``send_rows`` rows run a real label-owner process against the cut library as
the data owner. ``--write-docs`` writes the table, with date, commit and load, into docs/privacy.md's
section "What protects what, measured"; ``--rows`` measures only some rows, ``--reuse`` takes the others
from an earlier ``--json``.

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

from distgrad.config.parse import load_experiment, parse_experiment
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
    elif "guarantee" in clip:       # no epsilon can be stated there (one label reaches other rows)
        parts.append("none")
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


# --- what protects what: each attack against the defense meant for it, on one run ----------------------------

TABLE_SECTION = "## What protects what, measured"
TABLE_COMMAND = "python benchmarks/privacy.py --table --write-docs"
TRACED = frozenset({"sent_activation_grad", "sent_activation"})   # what crossed, as the receiver decoded it
G_CLIP = {"max_norm": 0.05, "sigma": 0.5}          # the label owner's documented clip_noise example
F_CLIP_HELD_OUT = "clip_noise = { max_norm = 10.0, sigma = 0.25 }"   # the data owner's, on evaluations
HOLDS_MARGIN = 0.05        # a label attack is held when its best figure is within this of chance (or of RR's limit)
INPUT_HOLDS_R2 = 0.25      # an input attack is held when its reconstruction R^2 is at most this
HIJACK_TARGET_R2 = 0.8     # the hijacker must be stopped before its reconstruction passes this
AVERAGING = ("data owner averages each row's received gradients over the run, then anchored k-means from 1 "
             "(and 10) known rows per class")


@dataclass(frozen=True)
class Case:
    """One row of the defense x attack table: ``attack``, what a party does; ``setting``, the defense as
    documented, whose stage-table ``keys`` go to ``party`` on ``task``; ``kind``, how it is measured:
    ``metered`` (one metered, traced run in one process, attacked on what its trace recorded as crossing),
    ``two_runs`` and ``send_rows`` (stage processes and the cut library as the data owner), ``hijack``,
    ``held_out``, ``completion`` (read off the metered rows)."""
    number: str
    attack: str
    setting: str
    task: str = "digits"
    party: str = ""
    keys: dict[str, Any] | None = None
    kind: str = "metered"
    traced: frozenset[str] = TRACED     # what the run's trace keeps (the attackers read it)


def budget_task(builtin: Path = ROOT / "distgrad" / "experiments" / "digits-budget.toml") -> Task:
    """The recommended experiment of a label owner's budget (docs/privacy.md, "Recommended settings: chosen by
    a budget"): the built-in ``digits-budget`` where it exists (its own ``clip_noise`` left out: each row gives
    the label owner its defenses), else the same model written out: digits with a wider, slower f (Dense
    64->256 + ReLU, Adam 0.0003), g Dense 256->10 (Adam 0.003), 30 epochs (1,320 steps)."""
    if builtin.exists():
        import tomllib
        raw = tomllib.loads(builtin.read_text())
        raw["data"]["path"] = str((builtin.parent / raw["data"]["path"]).resolve())
        for stage in raw["stages"]:
            stage.pop("clip_noise", None)
        return Task("digits-budget", int(raw.pop("steps")), 0.05, 8.0, raw)
    stages = _model(64, 256, 10, 0.003)
    stages[0]["optimizer"] = {"type": "adam", "lr": 0.0003}
    return Task("digits-budget", 1320, 0.05, 8.0,
                {"name": "digits-budget", "labels": "last", "seed": 0,
                 "data": {"kind": "npz", "path": str(DATASETS / "digits.npz"), "features": "pixels",
                          "labels": "digit", "feature_scale": 0.0625, "batch": 32, "test_fraction": 0.2},
                 "stages": stages})


def cases() -> list[Case]:
    """The rows of the table, in order."""
    def g(keys: dict[str, Any]) -> dict[str, Any]:
        return {"party": "g", "keys": keys}
    clip = {"clip_noise": G_CLIP}
    target = {"max_norm": 0.05, "epsilon": 8.0}
    return [
        Case("0", "every attack below; nothing defended", "undefended"),
        Case("1", AVERAGING, "label owner `clip_noise = { max_norm = 0.05, sigma = 0.5 }`", **g(clip)),
        Case("2a", AVERAGING, "label owner `clip_noise`, sigma = 1", **g({"clip_noise": {**G_CLIP, "sigma": 1.0}})),
        Case("2b", AVERAGING, "label owner `clip_noise`, sigma = 2", **g({"clip_noise": {**G_CLIP, "sigma": 2.0}})),
        Case("3", "the same, two classes (digit 0 against the rest)", "undefended", task="digits-0-vs-rest"),
        Case("3a", "the same, two classes", "label owner `marvell = { bound = 0.5 }`", task="digits-0-vs-rest",
             **g({"marvell": {"bound": 0.5}})),
        Case("3b", "the same, two classes", "label owner `marvell = { bound = 2 }`", task="digits-0-vs-rest",
             **g({"marvell": {"bound": 2.0}})),
        Case("4", "data owner reads one epoch: each row's gradient as first received, 1 known row per class "
             "(and the whole run averaged)", "label owner `max_norm = true`", **g({"max_norm": True})),
        Case("5a", AVERAGING, "label owner `label_dp = { epsilon = 2 }` (randomized response, corrected loss)",
             **g({"label_dp": {"epsilon": 2.0}})),
        Case("5b", AVERAGING, "label owner `label_dp = { epsilon = 2, stages = 2 }` (RR-with-prior)",
             **g({"label_dp": {"epsilon": 2.0, "stages": 2}})),
        Case("6", "data owner opens 18 one-step runs with the same activation rows (in pairs swapped from the "
             "third on) and tells from the replies' differences which pairs share a label", "label owner `clip_noise = { "
             "max_norm = 0.05, sigma = 0.5 }`, a fresh noise secret per run", kind="two_runs"),
        Case("7", "data owner (`send_rows`) puts the same 32 rows (1 known per class, 22 others) in every step "
             "of an epoch, averages each row's gradients", "label owner `clip_noise`, sigma = 0.5; then "
             "`epsilon = 8`", kind="send_rows"),
        Case("8", "data owner fits a classifier on its own f(x) with 10 labels per class (model completion)",
             "any label-owner defense", kind="completion"),
        Case("9", "label owner fits the best ridge decoder of the inputs on a public fifth of the rows",
             "data owner `nopeek = { weight = 7 }`, `input_guard = { max_r2 = 0.75 }`", party="f",
             keys={"nopeek": {"weight": 7.0}, "input_guard": {"max_r2": 0.75}}),
        Case("10", "malicious label owner returns its decoder's error gradient (feature-space hijacking)",
             "data owner `nopeek = { weight = 7 }`; with and without `input_guard = { max_r2 = 0.75 }`",
             kind="hijack"),
        Case("11", "label owner reconstructs held-out rows from the last evaluation's activations (ridge on a "
             "public fifth)", "data owner `clip_noise = { max_norm = 10, sigma = 0.25 }`", kind="held_out"),
        Case("12", AVERAGING, "label owner `clip_noise = { max_norm = 0.05, epsilon = 8 }` (recommended; "
             "`digits-budget`: f 64->256, Adam 0.0003, 30 epochs)", task="digits-budget",
             traced=frozenset({"sent_activation_grad"}), **g({"clip_noise": target})),
        Case("13", AVERAGING, "label owner `clip_noise = { max_norm = 0.05, epsilon = 8 }`, `dp_sgd = { "
             "max_norm = 1 }` (`digits-budget`)", task="digits-budget", traced=frozenset({"sent_activation_grad"}),
             **g({"clip_noise": target, "dp_sgd": {"max_norm": 1.0}})),
    ]


def staged_label_dp(epsilon: float, task: Task, steps: int) -> dict[str, Any]:
    """RR-with-prior in 2 stages of half a run of ``steps`` steps of ``task`` each: its ``label_dp`` table."""
    data = parse_experiment(json.loads(json.dumps(task.raw)), f"<{task.name}>").build_data()
    epochs = steps / data.batches_per_epoch      # type: ignore[attr-defined]
    return {"epsilon": epsilon, "stages": 2, "epochs_per_stage": round(epochs / 2, 2)}


def commit() -> str:
    """The repository's short commit id ('unknown' outside a git checkout)."""
    import subprocess
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _experiment(task: Task, party: str, keys: dict[str, Any] | None, steps: int) -> Any:
    """``task`` with ``keys`` in the stage table of ``party`` (label_dp's ``stages`` get half the run each)."""
    raw = json.loads(json.dumps(task.raw))
    keys = json.loads(json.dumps(keys or {}))
    if "stages" in keys.get("label_dp", {}):
        keys["label_dp"] = staged_label_dp(keys["label_dp"]["epsilon"], task, steps)
    for stage in raw["stages"]:
        if stage["name"] == party:
            stage.update(keys)
    return parse_experiment(raw, f"<{task.name}>")


def _short_budget(privacy: dict[str, Any]) -> str:
    """The label-DP epsilon the run prints, short ('233.6 over 19 releases: no meaningful guarantee'), or '-'."""
    out = []
    for entry in privacy.values():
        for key, value in entry.items():
            if isinstance(value, dict) and "epsilon" in value:
                epsilon = value["epsilon"]
                text = "∞" if epsilon == "inf" else f"{float(epsilon):.4g}"
                if "releases" in value:
                    text += f" over {value['releases']} releases"
                if key == "label_dp":
                    text += " (exact)"
                elif "scope" in value:
                    text += ", end to end" if "end to end" in value["scope"] else ", per release"
                if epsilon == "inf" or float(epsilon) >= 10:
                    text += ": no meaningful guarantee"
                out.append(f"{key} {text}")
    return "; ".join(out) or "-"


def metered_case(task: Task, case: Case, steps: int, seed: int, workdir: Path, attacker_seeds: int
                 ) -> dict[str, Any]:
    """``case`` trained in one process (bitwise what the stage processes train and send) with both meters on
    and a trace of what crossed; the meters' figures (``label_leak_extremes``, ``input_leak_extremes``) and
    the independent attackers' (benchmarks/attackers.py) on the trace."""
    import attackers
    from distgrad.errors import InputGuardStop
    exp = _experiment(task, case.party, case.keys, steps)
    trace = workdir / f"trace-{case.number}.jsonl"
    note = ""
    try:
        summary = train_in_process(exp, steps=steps, seed=seed, privacy_meter=True, trace_path=trace,
                                   trace_params=case.traced)
    except InputGuardStop as stop:          # an honest run the guard stopped: say so, measure it unguarded
        note = f"the guard stopped the honest run: {stop}"
        keys = {k: v for k, v in (case.keys or {}).items() if k != "input_guard"}
        exp = _experiment(task, case.party, keys, steps)
        summary = train_in_process(exp, steps=steps, seed=seed, privacy_meter=True, trace_path=trace,
                                   trace_params=case.traced)
    try:
        independent = attackers.attack_experiment(exp, str(trace), attacker_seeds, seed, first_epoch=True)
    finally:
        trace.unlink()
    meters = {name: entry for kind in ("label_leak_extremes", "input_leak_extremes")
              for name, entry in summary.get(kind, {}).items()}
    return {"test_accuracy": summary["test_accuracy"], "privacy": summary.get("privacy", {}),
            "epsilon": _short_budget(summary.get("privacy", {})), "meters": meters, "independent": independent,
            "input_guard": summary.get("input_guard"), "note": note, "elapsed_s": summary["elapsed_s"]}


def _digits_file(workdir: Path, name: str, g_lines: str, head_lines: str = "") -> Path:
    """The built-in digits experiment (its data by absolute path) with ``g_lines`` in the label owner's table
    and ``head_lines`` at the top level."""
    text = (ROOT / "distgrad" / "experiments" / "digits.toml").read_text().replace('"../datasets/',
                                                                                 f'"{DATASETS}/')
    text = text.replace("[data]", f"{head_lines}\n[data]", 1)
    path = workdir / f"{name}.toml"
    path.write_text(f"{text.rstrip()}\n{g_lines}\n")
    return path


def _parties(path: Path) -> tuple[Path, Path]:
    """``distgrad split`` of ``path``: the data owner's stage file for its own loop (``Cut``; its [stage]
    names it only, its [data] has no feature_scale: the loop scales its own features, as
    ``_initial_activations`` does), the label owner's stage file."""
    import subprocess
    import sys
    parts = path.with_suffix("")
    subprocess.run([sys.executable, "-m", "distgrad.cli", "split", str(path), str(parts)], check=True,
                   capture_output=True, timeout=60)
    f_file = parts / "f" / "f.toml"
    head, rest = f_file.read_text().split("[stage]\n")
    own_loop = f_file.with_name("f-lib.toml")
    data = re.sub(r"(?m)^feature_scale = .*\n", "", rest.split("[data]", 1)[1])
    own_loop.write_text(head + '[stage]\nname = "f"\n\n[data]' + data)
    return own_loop, parts / "g" / "g.toml"


class _LabelOwner:
    """A ``distgrad-stage`` label-owner process serving ``stage_file`` on a free port (its noise secret its
    own: ``DISTGRAD_NOISE_SECRET`` is removed from its environment); stopped on leaving."""

    def __init__(self, stage_file: Path, *extra: str) -> None:
        import os
        import subprocess
        import sys
        from distgrad.privacy.releases import NOISE_SECRET_VARIABLE
        self.ready = stage_file.with_name(f"{stage_file.stem}-{time.monotonic_ns()}.ready")
        env = {k: v for k, v in os.environ.items() if k != NOISE_SECRET_VARIABLE}
        self.log = open(self.ready.with_suffix(".log"), "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "distgrad.cli", "stage", "g", "--experiment",
                                      str(stage_file), "--bind", "tcp://127.0.0.1:*", "--ready-file",
                                      str(self.ready), *extra], stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)

    def __enter__(self) -> str:
        deadline = time.monotonic() + 60.0
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"the label owner did not start: {self.ready.with_suffix('.log').read_text()}")
            time.sleep(0.02)
        return self.ready.read_text().strip()

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def _initial_activations(exp: Any, rows: np.ndarray, seed: int) -> np.ndarray:
    """The data owner's first-layer activations of ``rows`` at its initial parameters (what it sends)."""
    from distgrad.stage.stage import Stage
    f = Stage.from_experiment(exp, exp.stage_names[0], seed)
    out, _ = f.forward(exp.build_data(seed, stage=exp.stage_names[0]).features_at(rows), training=False)
    return np.ascontiguousarray(out, np.float32)


def _auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """The AUC of ``scores`` for ``positive`` (ties half), or NaN with one class only."""
    pos, neg = scores[positive], scores[~positive]
    if not len(pos) or not len(neg):
        return float("nan")
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum())
                 / (len(pos) * len(neg)))


def two_runs_case(workdir: Path, pairings: int, seed: int = 0) -> dict[str, Any]:
    """The data owner (the cut library) opens ``pairings`` + 2 one-step runs of a ``--keep-serving`` label owner
    with ``clip_noise`` C 0.05 sigma 0.5: the first two with its activations h of step 1's rows (are the
    replies equal? the spread of their difference), each other with h's rows swapped in random pairs (i, j). Were the noise the same in every run (keyed by step and position,
    not by a per-run secret), (r_k[i] - r_0[i]) + (r_k[j] - r_0[j]) would be exactly zero when rows i and j
    share a label and not otherwise; the AUC of minus its norm as the score of "same label", over every pair,
    now and with sigma 0 (what repeated noise leaves: it cancels). Chance 0.5."""
    from distgrad.cut import Cut
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for name, sigma in (("now", 0.5), ("repeated_noise", 0.0)):
        path = _digits_file(workdir, f"two-runs-{name}", f"clip_noise = {{ max_norm = 0.05, sigma = {sigma} }}")
        f_file, g_file = _parties(path)
        exp = load_experiment(path)
        labels = exp.build_data(seed, stage="g").targets(1)
        rows = exp.build_data(seed, stage="f").step_rows(1)
        h = _initial_activations(exp, rows, seed)
        swaps = [rng.permutation(len(h)).reshape(-1, 2) for _ in range(pairings)]
        replies = []
        summary_path = workdir / f"two-runs-{name}.json"
        with _LabelOwner(g_file, "--keep-serving", "--summary", str(summary_path)) as endpoint:
            for k in range(pairings + 2):          # the first two send h itself, the others swap its pairs
                sent = h.copy()
                if k > 1:
                    pairs = swaps[k - 2]
                    sent[pairs[:, 0]], sent[pairs[:, 1]] = h[pairs[:, 1]], h[pairs[:, 0]]
                cut = Cut.connect(endpoint, interface=f_file, timeout_s=10.0, peer_deadline_s=60.0)
                try:
                    replies.append(np.asarray(cut.step(sent, cut.rows(1))[1], np.float64).reshape(len(h), -1))
                finally:
                    cut.close(finished=False)
            deadline = time.monotonic() + 30.0      # the last run's summary: written as that run ends
            while not summary_path.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        scores, same = [], []
        for k, pairs in enumerate(swaps, start=2):
            for i, j in pairs:
                diff = (replies[k][i] - replies[0][i]) + (replies[k][j] - replies[0][j])
                scores.append(-float(np.linalg.norm(diff)))
                same.append(labels[i] == labels[j])
        out[f"label_equality_auc_{name}"] = _auc(np.array(scores), np.array(same))
        if name == "now":
            out["replies_equal"] = bool(np.array_equal(replies[0], replies[1]))
            out["noise_std_of_difference"] = float(np.std(replies[0] - replies[1]))
            out["pairs"], out["same_label_pairs"] = len(same), int(np.sum(same))
            out["runs"] = len(replies)
            if summary_path.exists():     # a run's budget: the releases of that run only
                out["epsilon_per_run"] = _short_budget(json.loads(summary_path.read_text()).get("privacy", {}))
    return out


def send_rows_case(workdir: Path, steps: int, seed: int = 0) -> dict[str, Any]:
    """A data owner with ``send_rows`` (the cut library) puts the same 32 rows in each of ``steps`` steps: one
    known row per class and 22 others; it averages each row's received gradients and gives each other row the
    class of the known row its mean is closest to (cosine). Against the label owner's ``clip_noise`` sigma 0.5
    (its summary's budget: every release counted), then ``epsilon = 8`` (planned one release a row in an
    epoch: the second step is refused)."""
    from distgrad.cut import Cut
    from distgrad.errors import PeerRejected
    out: dict[str, Any] = {}
    for name, clip in (("sigma", "max_norm = 0.05, sigma = 0.5"), ("target", "max_norm = 0.05, epsilon = 8.0")):
        path = _digits_file(workdir, f"send-rows-{name}", f"clip_noise = {{ {clip} }}", "send_rows = true")
        path.write_text(path.read_text().replace("steps = 800\n", f"steps = {steps}\n", 1))
        f_file, g_file = _parties(path)
        exp = load_experiment(path)
        g_data = exp.build_data(seed, stage="g")
        order = np.concatenate([g_data.step_rows(s) for s in range(1, g_data.batches_per_epoch + 1)])
        labels_of = g_data.targets_at(order)
        known = np.array([order[np.flatnonzero(labels_of == c)[0]] for c in np.unique(labels_of)])
        others = np.array([r for r in order if r not in known])[:32 - len(known)]
        rows = np.concatenate([known, others]).astype(np.int64)
        h = _initial_activations(exp, rows, seed)
        summary_path = workdir / f"send-rows-{name}.json"
        received, refused = [], ""
        owner = _LabelOwner(g_file, "--summary", str(summary_path))
        with owner as endpoint:
            cut = Cut.connect(endpoint, interface=f_file, timeout_s=10.0, peer_deadline_s=60.0)
            try:
                for _ in range(steps):
                    received.append(np.asarray(cut.step(h, rows)[1], np.float64).reshape(len(rows), -1))
                cut.close()
            except PeerRejected as e:
                refused = f"refused at step {len(received) + 1}: {e}"
                cut.closed = True
                cut.link.close(linger_ms=0)
            if not refused:
                owner.wait()
        labels = g_data.targets_at(rows)
        mean = np.mean(received, axis=0)
        unit = mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-30)
        guess = labels[np.argmax(unit[len(known):] @ unit[:len(known)].T, axis=1)]
        entry = {"steps_answered": len(received), "recovery": float(np.mean(guess == labels[len(known):])),
                 "chance": 1.0 / len(known), "refused": refused}
        if summary_path.exists():
            privacy = json.loads(summary_path.read_text()).get("privacy", {})
            entry.update(privacy=privacy, epsilon=_short_budget(privacy))
        out[name] = entry
    return out


def hijack_case(task: Task, steps: int, seed: int, after: int = 50) -> dict[str, Any]:
    """tests/hijacking.py's label owner against the data owner's NoPeek weight 7, guarded by ``input_guard =
    { max_r2 = 0.75, after }`` (the step it is stopped before, the guard's R^2 there, the hijacker's best
    reconstruction R^2 of a step's private rows before it), then unguarded (its best over the run)."""
    import sys
    import pytest
    from distgrad.errors import InputGuardStop
    sys.path.insert(0, str(ROOT / "tests"))
    from hijacking import hijack
    out: dict[str, Any] = {}
    for name, keys in (("guarded", {"nopeek": {"weight": 7.0}, "input_guard": {"max_r2": 0.75, "after": after}}),
                       ("unguarded", {"nopeek": {"weight": 7.0}})):
        exp = _experiment(task, "f", keys, steps)
        with pytest.MonkeyPatch.context() as patch:
            attacker = hijack(patch, exp.build_data(seed, stage="g"), 64)
            stopped, guard_r2 = None, None
            try:
                train_in_process(exp, steps=steps, seed=seed)
            except InputGuardStop as stop:
                stopped = int(re.search(r"before sending step (\d+)", str(stop)).group(1))  # type: ignore[union-attr]
                guard_r2 = float(re.search(r"R\^2 ([0-9.]+)", str(stop)).group(1))         # type: ignore[union-attr]
        reached = [max(r2) for step, r2 in attacker.reconstruction.items() if stopped is None or step < stopped]
        out[name] = {"stopped_before": stopped, "guard_r2": guard_r2,
                     "hijacker_best_r2": max(reached) if reached else float("nan")}
    return out


def held_out_case(steps: int, workdir: Path, seed: int) -> dict[str, Any]:
    """benchmarks/held_out_reconstruction.py's attack, undefended and with the data owner's clip_noise C 10
    sigma 0.25 on its evaluations."""
    import held_out_reconstruction
    return {name: held_out_reconstruction.measure(extra, steps, workdir, seed)
            for name, extra in (("undefended", ""), ("defended", F_CLIP_HELD_OUT))}


def measure_table(smoke: bool = False, seed: int = 0, attacker_seeds: int = 20, only: set[str] | None = None,
                  reuse: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every row of ``cases()``, measured (``only``: those rows, the others taken from ``reuse``, the JSON of
    an earlier run); ``smoke``: a tiny configuration (30 steps, 4 pairings, 3 steps of ``send_rows``, 3
    attacker seeds) that only checks the code runs."""
    started, load, date = time.monotonic(), _load(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    attacker_seeds = 3 if smoke else attacker_seeds
    results: dict[str, Any] = dict(reuse["rows"]) if reuse else {}
    with tempfile.TemporaryDirectory(prefix="distgrad-table-") as name:
        workdir = Path(name)
        tasks = {task.name: task for task in [*prepare(workdir), budget_task()]}
        for case in cases():
            if only is not None and case.number not in only:
                continue
            task = tasks[case.task]
            steps = 30 if smoke else task.steps
            began = time.monotonic()
            if case.kind == "metered":
                result = metered_case(task, case, steps, seed, workdir, attacker_seeds)
            elif case.kind == "two_runs":
                result = two_runs_case(workdir, 4 if smoke else 16, seed)
            elif case.kind == "send_rows":
                result = send_rows_case(workdir, 3 if smoke else 44, seed)
            elif case.kind == "hijack":
                result = hijack_case(task, steps, seed, after=10 if smoke else 50)
            elif case.kind == "held_out":
                result = held_out_case(steps, workdir, seed)
            else:
                result = {}
            result["wall_s"] = time.monotonic() - began
            results[case.number] = result
            print(f"row {case.number} ({case.setting}): {json.dumps(_brief(result))} "
                  f"[{result['wall_s']:.0f} s]", flush=True)
    batch = {"rows": [c.number for c in cases() if c.number in results and (only is None or c.number in only)],
             "commit": commit(), "date": date,
             "elapsed_s": time.monotonic() - started, "load_before": load, "load_after": _load()}
    earlier = (reuse.get("batches") or [{**{k: reuse.get(k) for k in batch}, "rows": list(reuse["rows"])}]
               if reuse else [])
    earlier = [{**b, "rows": [r for r in b["rows"] if r not in batch["rows"]]} for b in earlier]
    return {"smoke": smoke, "seed": seed, "attacker_seeds": attacker_seeds, "rows": results,
            "batches": [b for b in earlier if b["rows"]] + [batch]}


def _load() -> list[float]:
    import os
    return [round(x, 2) for x in os.getloadavg()]


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in ("meters", "privacy")}


def _f(value: Any, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and np.isnan(value)) else f"{value:.{digits}f}"


def _meter(meters: dict[str, Any], name: str, run: bool = False) -> str:
    entry = meters.get(name)
    if not entry:
        return f"`{name}` -"
    head = f"run {_f(entry['run'])}, " if run and "run" in entry else f"mean {_f(entry['mean'])}, "
    return f"`{name}` {head}worst {_f(entry['worst'])} (step {entry['worst_step']})"


def rr_limit(epsilon: float, classes: int) -> float:
    """The share of labels randomized response over ``classes`` classes keeps (e^ε / (e^ε + k - 1)): the most
    any attack learns of the released labels recovers of the true ones, beyond what the inputs say."""
    return float(np.exp(epsilon) / (np.exp(epsilon) + classes - 1))


def _verdict(held: bool) -> str:
    return "holds" if held else "**does not hold**"


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    """The table's cells, one list per case measured: number, attack, setting, accuracy, epsilon, meter,
    attacker, verdict."""
    out = []
    rows = results["rows"]
    for case in cases():
        if case.number not in rows:
            continue
        r = rows[case.number]
        cells = [case.number, case.attack, case.setting]
        if case.kind == "metered":
            m, ind = r["meters"], r["independent"]
            chance = m.get("averaged_recovery_1", {}).get("chance", 0.1)
            accuracy, epsilon = _f(r["test_accuracy"], 4), r["epsilon"]
            if case.party == "f":
                guard = r.get("input_guard") or {}
                shown = (f"{_meter(m, 'distance_correlation')}; {_meter(m, 'ridge_r2')}; `ridge_r2_run` "
                         f"{_f(m.get('ridge_r2', {}).get('run'))}")
                if guard:
                    shown += f"; guard: not stopped, peak R^2 {_f(guard.get('peak_r2'))}"
                if r.get("note"):
                    shown += f"; {r['note']}"
                got = f"ridge R^2 (whole run) {_f(ind['ridge_r2_run'])} (chance 0)"
                verdict = _verdict(ind["ridge_r2_run"] <= INPUT_HOLDS_R2)
            else:
                two_classes = case.task == "digits-0-vs-rest"
                window = "direction_auc" if two_classes else "label_recovery"
                shown = (f"{_meter(m, window)}; {_meter(m, 'averaged_recovery_1', True)}; "
                         f"{_meter(m, 'averaged_recovery_10', True)}")
                if two_classes:
                    shown = f"{_meter(m, 'norm_auc')}; " + shown
                got = (f"averaged, 1 / 10 known: {_f(ind['averaged_recovery_1'])} / "
                       f"{_f(ind['averaged_recovery_10'])}")
                best = max(ind["averaged_recovery_1"], ind["averaged_recovery_10"])
                bound = chance
                if "averaged_direction_auc_10" in ind:   # unbalanced classes: the AUC's chance is 0.5 regardless
                    got += f"; averaged direction AUC, 10 known: {_f(ind['averaged_direction_auc_10'])}"
                    best = max(best, 0.5 + abs(ind["averaged_direction_auc_10"] - 0.5))
                if case.number == "4":
                    got = (f"first epoch, 1 known: {_f(ind['averaged_recovery_1_first_epoch'])}; " + got)
                    best = max(best, ind["averaged_recovery_1_first_epoch"])
                if "label_dp" in (case.keys or {}):      # DP bounds what is learned beyond what the inputs give
                    bound = max(rr_limit(2.0, 10), ind["model_completion"])
                    got += (f" (randomized response keeps {rr_limit(2.0, 10):.3f} of the labels; model completion "
                            f"{_f(ind['model_completion'])})")
                got += f" (chance {chance:.2f})"
                verdict = _verdict(best <= bound + HOLDS_MARGIN) if case.party else "(no defense)"
                if case.party == "" and case.task == "digits":
                    got += (f"; completion {_f(ind['model_completion'])}; ridge R^2 {_f(ind['ridge_r2_run'])}")
                    shown += (f"; {_meter(m, 'model_completion', True)}; {_meter(m, 'ridge_r2')}, `ridge_r2_run` "
                              f"{_f(m.get('ridge_r2', {}).get('run'))}; {_meter(m, 'distance_correlation')}")
            cells += [accuracy, epsilon, shown, got, verdict]
        elif case.kind == "two_runs":
            cells += ["-", f"each run's own: {r.get('epsilon_per_run', '-')}; the {r.get('runs', '-')} runs "
                      "release each row's label that many times (the label owner's `lifetime_epsilon` adds them up; "
                      "measured before it did)",
                      "- (nothing to meter: one step)",
                      f"label-equality AUC {_f(r['label_equality_auc_now'])} over {r['pairs']} pairs "
                      f"({r['same_label_pairs']} same-label; chance 0.5); with noise that repeats (sigma 0: "
                      f"it cancels) {_f(r['label_equality_auc_repeated_noise'])}; two replies to the same rows "
                      f"{'equal' if r['replies_equal'] else 'differ'} (spread of the difference "
                      f"{r['noise_std_of_difference']:.4f}, sqrt(2)·sigma·C = {np.sqrt(2) * 0.025:.4f})",
                      _verdict(abs(r["label_equality_auc_now"] - 0.5) <= 0.1)]
        elif case.kind == "send_rows":
            sigma, target = r["sigma"], r["target"]
            counted = sigma.get("privacy", {}).get("g", {}).get("clip_noise", {}).get("releases")
            refused = re.search(r"step (\d+).*?(more than the \d+ its privacy budget allows)", target["refused"])
            stop = f"refused at step {refused.group(1)}: {refused.group(2)}" if refused else "not refused"
            cells += ["-", f"sigma 0.5: {sigma.get('epsilon', '-')}; epsilon 8: {target.get('epsilon', '-')}, {stop}",
                      "- (the label owner's meter is refused with `send_rows`)",
                      f"sigma 0.5, {sigma['steps_answered']} steps: recovery {_f(sigma['recovery'])} (chance "
                      f"{sigma['chance']:.2f}); epsilon 8: {target['steps_answered']} step answered, recovery "
                      f"{_f(target['recovery'])}",
                      "budget counts every release: " + _verdict(counted == sigma["steps_answered"])
                      + "; sigma 0.5 itself: " + _verdict(sigma["recovery"] <= sigma["chance"] + HOLDS_MARGIN)
                      + "; epsilon 8: " + _verdict(bool(refused))]
        elif case.kind == "completion":
            pieces = []
            for other in cases():
                o = rows.get(other.number, {})
                if o and other.kind == "metered" and other.task != "digits-0-vs-rest" and other.party != "f":
                    pieces.append(f"{other.number}: {_f(o['meters'].get('model_completion', {}).get('run'))} / "
                                  f"{_f(o['independent'].get('model_completion'))}")
            cells += ["(each run's)", "-", "`model_completion`, run / attacker, by row: " + ", ".join(pieces),
                      "the same (chance 0.10)", "**no channel defense can hold** (labels that follow from the "
                      "inputs)"]
        elif case.kind == "hijack":
            g, u = r["guarded"], r["unguarded"]
            stop = (f"stopped before step {g['stopped_before']}, guard R^2 {_f(g['guard_r2'])}"
                    if g["stopped_before"] else "never stopped")
            cells += ["-", "-", f"guard: {stop}",
                      f"hijacker's best R^2 of a step's private rows: guarded {_f(g['hijacker_best_r2'])} (before "
                      f"the stop); NoPeek alone, unguarded {_f(u['hijacker_best_r2'])}",
                      f"NoPeek alone: {_verdict(u['hijacker_best_r2'] < HIJACK_TARGET_R2)}; with the guard: "
                      + _verdict(bool(g["stopped_before"]) and g["hijacker_best_r2"] < HIJACK_TARGET_R2)]
        elif case.kind == "held_out":
            d, u = r["defended"], r["undefended"]
            cells += [f"{_f(d['accuracy'], 4)} (undefended {_f(u['accuracy'], 4)})", "none stated (releases counted)",
                      "- (the meters judge training steps)",
                      f"held-out R^2 {_f(d['r2'])}; undefended {_f(u['r2'])}",
                      _verdict(d["r2"] <= INPUT_HOLDS_R2) + " (at that accuracy)"]
        out.append(cells)
    return out


def table_markdown(results: dict[str, Any]) -> str:
    head = ["#", "what a party does", "defense, documented setting", "held-out accuracy", "ε (as printed, short)",
            "what the meter shows", "what an independent attacker obtains", "holds?"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |" for cells in table_rows(results)]
    return "\n".join(lines) + "\n"


def write_table_docs(results: dict[str, Any], table: str) -> None:
    """Replace (or add, before '## Defenses') docs/privacy.md's section TABLE_SECTION: the table, its command,
    date, commit and machine load; the prose around it is the doc's own (kept between the markers)."""
    text = DOC.read_text()
    batches = results["batches"]
    when = "; ".join(
        (f"rows {', '.join(b['rows'])} " if len(batches) > 1 else "")
        + f"on {b['date']} at commit {b['commit']} ({b['elapsed_s'] / 60:.0f} min, load average "
        f"{b['load_before'][0]:g} before and {b['load_after'][0]:g} after)" for b in batches)
    intro = (f"Measured {when}, on the shared two-core development machine, by `{TABLE_COMMAND}` (it rewrites "
             f"the table below; `--rows` measures some rows again and `--reuse` keeps the others). Seed "
             f"{results['seed']}; every attacker figure is the mean over {results['attacker_seeds']} random "
             f"choices of its known rows or public share ({5 * results['attacker_seeds']} for one known row per "
             "class).")
    begin, end = "<!-- table: benchmarks/privacy.py --table -->", "<!-- end of table -->"
    block = f"{begin}\n{_fill(intro)}\n\n{table}{end}"
    if begin in text:
        text = re.sub(rf"{re.escape(begin)}.*?{re.escape(end)}", lambda _: block, text, flags=re.S)
    else:
        text = text.replace("\n## Defenses\n", f"\n{TABLE_SECTION}\n\n{block}\n\n## Defenses\n", 1)
    DOC.write_text(text)


def _fill(text: str) -> str:
    return textwrap.fill(text, 110, break_on_hyphens=False)


def table_main(args: argparse.Namespace) -> None:
    """``--table``: measure every row of ``cases()``, print the table, optionally write JSON and the docs."""
    reuse = json.loads(args.reuse.read_text()) if args.reuse else None
    only = set(args.rows.split(",")) if args.rows else None
    if reuse is not None and only is None:
        raise SystemExit("--reuse takes the rows not named by --rows from the JSON: name the rows to measure")
    results = measure_table(args.smoke, seed=args.seed, attacker_seeds=args.attacker_seeds, only=only,
                            reuse=reuse)
    table = table_markdown(results)
    last = results["batches"][-1]
    print(f"\n{table}\ntook {last['elapsed_s']:.0f} s, load {last['load_before']} -> {last['load_after']}")
    if args.json is not None:
        args.json.write_text(json.dumps({**results, "table": table}, indent=1, default=str))
    if args.write_docs:
        write_table_docs(results, table)


def table_docs_from(path: Path) -> None:
    """Write docs/privacy.md's table from the ``--table --json`` output at ``path`` (a run measured
    without ``--write-docs``)."""
    results = json.loads(path.read_text())
    write_table_docs(results, table_markdown(results))


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
    parser.add_argument("--table", action="store_true",
                        help="instead of the sweep: the defense x attack table (one run per row; --smoke: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="--table: the runs' seed")
    parser.add_argument("--rows", help="--table: measure only these rows (e.g. 12,13)")
    parser.add_argument("--reuse", type=Path, help="--table: the --json of an earlier table, for the other rows")
    parser.add_argument("--attacker-seeds", type=int, default=20,
                        help="--table: random choices of known rows each attacker figure is the mean over")
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
    if args.table:
        table_main(args)
        return
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
