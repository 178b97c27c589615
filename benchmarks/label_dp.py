"""Label DP's accuracy against epsilon: plain randomized response against RR-with-prior, each label released once.

Usage: python benchmarks/label_dp.py [--smoke] [--seeds N] [--json PATH] [--write-docs]

For each epsilon in 0.5, 1, 2, 4, 8, the label owner's ``label_dp`` three ways, beside the undefended run:

* ``plain RR, plain loss``: randomized response once on each training label, cross-entropy on the randomized
  labels as if they were true (what ``label_dp = { epsilon = e, loss = "plain" }`` trains);
* ``plain RR, corrected loss``: the same labels, the flip-rate-aware loss (``label_dp = { epsilon = e }``);
* ``RR-with-prior, 2 stages``: half the rows with plain randomized response for the first half of the run,
  then the other half, each label drawn among the classes the model trained so far finds likeliest
  (``label_dp = { epsilon = e, stages = 2, epochs_per_stage = E }``, E half the run's epochs), corrected loss.

Two tasks of benchmarks/privacy.py (``prepare``): ``digits`` (10 classes, 800 steps) and ``breast-cancer`` (two
classes, 600 steps). Every run is one process (``train_in_process``: bitwise what the stage processes
train); held-out accuracy is the mean over the seeds (the seed also draws the held-out rows), with the
seeds' min-max. ``--write-docs`` writes the table, with the date and the commit measured, into
docs/privacy.md's section "Label DP: accuracy against epsilon" (replacing only that section).

``--smoke``: one seed, 60 steps, epsilon 2 only (the smoke test of tests/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from distgrad.config.parse import parse_experiment
from distgrad.run.inprocess import train_in_process

from privacy import ROOT, Task, prepare

DOC = ROOT / "docs" / "privacy.md"
SECTION = "## Label DP: accuracy against epsilon"
COMMAND = "python benchmarks/label_dp.py --write-docs"
EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0)
TASKS = ("digits", "breast-cancer")
METHODS = ("plain RR, plain loss", "plain RR, corrected loss", "RR-with-prior, 2 stages")


def label_dp(method: str, epsilon: float, task: Task, steps: int) -> dict[str, Any]:
    """The ``label_dp`` table of ``method`` at ``epsilon`` for a run of ``steps`` steps of ``task``."""
    if method == "plain RR, plain loss":
        return {"epsilon": epsilon, "loss": "plain"}
    if method == "plain RR, corrected loss":
        return {"epsilon": epsilon}
    data = parse_experiment(json.loads(json.dumps(task.raw)), f"<{task.name}>").build_data()
    epochs = steps / data.batches_per_epoch      # type: ignore[attr-defined]
    return {"epsilon": epsilon, "stages": 2, "epochs_per_stage": round(epochs / 2, 2)}


def one_run(task: Task, keys: dict[str, Any] | None, seed: int, steps: int) -> float:
    """``task`` trained in one process with the label owner's ``label_dp`` = ``keys`` (None: undefended);
    its held-out accuracy."""
    raw = json.loads(json.dumps(task.raw))
    if keys is not None:
        raw["stages"][-1]["label_dp"] = keys
    return float(train_in_process(parse_experiment(raw, f"<{task.name}>"), steps=steps, seed=seed)["test_accuracy"])


def summary(accuracies: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(accuracies), "min": min(accuracies), "max": max(accuracies),
            "accuracies": accuracies}


def markdown(results: dict[str, Any], seeds: int) -> str:
    """One table per task: a row per method, a column per epsilon (mean, and min-max over the seeds)."""
    out = []
    for task, rows in results.items():
        epsilons = sorted({float(e) for method in METHODS for e in rows.get(method, {})})
        plain = rows["undefended"]
        out.append(f"**{task}** (held-out accuracy, mean and min-max over {seeds} seed{'s' if seeds > 1 else ''}; "
                   f"undefended: {plain['mean']:.4f} ({plain['min']:.3f}-{plain['max']:.3f}))\n")
        out.append("| label_dp | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |")
        out.append("|---|" + "---|" * len(epsilons))
        for method in METHODS:
            cells = [rows[method][str(e)] for e in epsilons]
            out.append(f"| {method} | " + " | ".join(f"{c['mean']:.4f} ({c['min']:.3f}-{c['max']:.3f})"
                                                     for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_docs(results: dict[str, Any], table: str, seeds: int, elapsed_s: float) -> None:
    """Replace (or add, before '## Not done') docs/privacy.md's section SECTION."""
    digits = results["digits"]
    prior, plain = digits["RR-with-prior, 2 stages"]["2.0"], digits["plain RR, plain loss"]["2.0"]
    corrected = digits["plain RR, corrected loss"]["2.0"]
    intro = (f"Measured on {datetime.date.today().isoformat()} at commit {commit()} (`{COMMAND}`, {seeds} seeds, "
             f"about {elapsed_s:.0f} s on the shared two-core development machine; it rewrites this section). "
             "Each run trains in one process (bitwise what the stage processes train), the tasks and models of "
             "\"The trade-off, measured\" above: `digits` 800 steps, `breast-cancer` 600 steps; RR-with-prior "
             "takes two stages of half the run each. Every run is ε-label-DP for every training label, exactly: "
             "each label is released once. The target, digits at ε = 2 with held-out accuracy >= 0.90: "
             f"RR-with-prior {prior['mean']:.4f} (seeds {', '.join(f'{a:.4f}' for a in prior['accuracies'])}), "
             f"{'**met**' if prior['mean'] >= 0.90 else '**not met**'}; plain randomized response "
             f"{corrected['mean']:.4f} with the corrected loss (the default), {plain['mean']:.4f} trained as if its "
             "labels were true. On digits below ε = 2 the first stage's model is a poor prior, and plain randomized "
             "response with the corrected loss does better.")
    body = f"{SECTION}\n\n{_fill(intro)}\n\n{table}\n"
    text = DOC.read_text()
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## )", re.S | re.M)
    text = pattern.sub(lambda _: body, text) if pattern.search(text) else \
        text.replace("\n## Not done\n", f"\n{body}## Not done\n", 1)
    DOC.write_text(text)


def _fill(text: str) -> str:
    import textwrap
    return textwrap.fill(text, 110, break_on_hyphens=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one seed, 60 steps, epsilon 2 only")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every run's accuracy here")
    parser.add_argument("--write-docs", action="store_true", help=f"write the table into {DOC.relative_to(ROOT)}")
    args = parser.parse_args()
    if args.write_docs and args.smoke:
        parser.error("--write-docs takes the full sweep's figures only, not --smoke's")
    seeds, epsilons = (1, (2.0,)) if args.smoke else (args.seeds, EPSILONS)
    started = time.monotonic()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="distgrad-label-dp-") as name:
        for task in prepare(Path(name)):
            if task.name not in TASKS:
                continue
            steps = 60 if args.smoke else task.steps
            rows = results[task.name] = {"undefended": summary([one_run(task, None, s, steps) for s in range(seeds)])}
            for method in METHODS:
                rows[method] = {}
                for epsilon in epsilons:
                    keys = label_dp(method, epsilon, task, steps)
                    rows[method][str(epsilon)] = summary([one_run(task, keys, s, steps) for s in range(seeds)])
                    print(f"{task.name}: {method}, epsilon {epsilon:g}: accuracy "
                          f"{rows[method][str(epsilon)]['mean']:.4f}", flush=True)
    elapsed = time.monotonic() - started
    table = markdown(results, seeds)
    print(f"\n{table}\nsweep took {elapsed:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({"smoke": args.smoke, "seeds": seeds, "elapsed_s": elapsed,
                                         "results": results}, indent=1))
    if args.write_docs:
        write_docs(results, table, seeds, elapsed)


if __name__ == "__main__":
    main()
