"""How well the label owner reconstructs the data owner's held-out rows from the evaluation activations it
receives, with and without the data owner's ``clip_noise`` on them.

The attacker (the label owner) knows the inputs of a public share of the held-out rows (``PUBLIC_FRACTION``,
seeded) and fits a ridge regression from their received activations back to their inputs; the figure is the
R^2 of its reconstruction of the other held-out rows (1 - squared error / squared distance to the public
share's mean input). Each setting trains digits in one process (bitwise a run of stage processes), then sends
the held-out rows' activations of the final evaluation as the data owner's ``Senders`` does.

    python benchmarks/held_out_reconstruction.py [--steps N]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from distgrad.config.defended import row_defense
from distgrad.config.experiment import BUILTIN_DIR
from distgrad.config.parse import load_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.stage.stage import Stage
from distgrad.wire.wirecodec import Senders

PUBLIC_FRACTION = 0.2
RIDGES = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)   # penalties tried, relative to the mean diagonal of the Gram matrix
SETTINGS = ["", "clip_noise = { max_norm = 10.0, sigma = 0.05 }", "clip_noise = { max_norm = 10.0, sigma = 0.1 }",
            "clip_noise = { max_norm = 10.0, sigma = 0.25 }"]     # digits' activations have norm 8.6-10.9


def ridge_r2(h: np.ndarray, x: np.ndarray, public: np.ndarray) -> float:
    """R^2 of the ridge decoder fitted on rows ``public`` (a boolean mask) of (``h``, ``x``), on the others:
    the best over the penalties ``RIDGES`` (an upper bound on what the attacker gets choosing it blind)."""
    return max(_ridge_r2(h, x, public, ridge) for ridge in RIDGES)


def _ridge_r2(h: np.ndarray, x: np.ndarray, public: np.ndarray, ridge: float) -> float:
    h = np.hstack([h.reshape(len(h), -1).astype(np.float64), np.ones((len(h), 1))])
    x = x.reshape(len(x), -1).astype(np.float64)
    gram = h[public].T @ h[public]
    penalty = ridge * np.trace(gram) / len(gram) * np.eye(len(gram))
    weights = np.linalg.solve(gram + penalty, h[public].T @ x[public])
    rest = ~public
    error = np.sum((h[rest] @ weights - x[rest]) ** 2)
    return float(1.0 - error / np.sum((x[rest] - x[public].mean(axis=0)) ** 2))


def measure(f_extra: str, steps: int, directory: Path, seed: int = 0) -> dict[str, float]:
    """Train digits with ``f_extra`` on the data owner for ``steps`` steps; the held-out accuracy and the
    reconstruction R^2 from the final evaluation's activations as the label owner receives them."""
    text = (BUILTIN_DIR / "digits.toml").read_text().replace('"../datasets/', f'"{BUILTIN_DIR.parent / "datasets"}/')
    head, f_stage, g_stage = text.split("[[stages]]")
    path = directory / f"digits-{abs(hash(f_extra))}.toml"
    path.write_text("[[stages]]".join([head, f"{f_stage.rstrip()}\n{f_extra}\n\n", g_stage]))
    exp = load_experiment(path)
    summary = train_in_process(exp, steps=steps, seed=seed)
    f = Stage.from_experiment(exp, "f", seed)
    for name, value in summary["params"]["f"].items():
        f.params[name][...] = np.asarray(value, np.float32)
    data = exp.build_data(seed, stage="f")
    x = data.test_features()
    clean, _ = f.forward(x, training=False)
    received = Senders(exp.codecs, row_defense(exp, "f", seed)).evaluation_roundtrip(clean, steps + 1)
    public = np.random.default_rng(seed).random(len(x)) < PUBLIC_FRACTION
    return {"accuracy": summary["test_accuracy"], "r2": ridge_r2(received, x, public),
            "r2_clean": ridge_r2(clean, x, public)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for setting in SETTINGS:
            figures = measure(setting, args.steps, Path(tmp))
            print(f"| {setting or 'undefended'} | {figures['accuracy']:.4f} | {figures['r2']:.3f} | "
                  f"{figures['r2_clean']:.3f} |")


if __name__ == "__main__":
    main()
