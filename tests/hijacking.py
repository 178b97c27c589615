"""A malicious label owner for tests: feature-space hijacking (Pasquini et al., CCS 2021), as a custom stage.

Instead of the task's gradient, the label owner returns the gradient of its own decoder's reconstruction
error: it fits a linear decoder from the activations it receives to the inputs of its public rows (the rows
whose number is a multiple of 5, a fifth, whose inputs it knows) and sends up, for those rows, the gradient
of the decoder's squared error with respect to the activations (zero for the other rows), so the data
owner's layers learn activations its decoder inverts, for every row. Its own parameters never change and
the loss it reports is the decoder's error. ``reconstruction`` records, per step, what it obtains: the R^2
of the private rows' inputs reconstructed by its decoder, and by the best ridge decoder refitted on the
public rows of the latest steps.

Use ``hijack(monkeypatch, data)`` before ``train_in_process``: the stage named ``g`` then plays it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from distgrad.stage.stage import Stage

LR = 0.01            # the decoder's Adam step
SCALE = 32.0         # the gradient sent up, times the honest scale (1 / batch): strong enough to beat NoPeek
PUBLIC_EVERY = 5
RECENT_STEPS = 10    # the ridge refit's public rows: those of the latest steps


def _r2(predicted: np.ndarray, x: np.ndarray) -> float:
    return float(1 - ((predicted - x) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())


class Hijacker:
    """The decoder, its Adam state and what it reconstructs (``reconstruction``: step -> (decoder R^2,
    ridge R^2) of the private rows of that step's batch)."""

    def __init__(self, data: Any, width: int) -> None:
        self.data, self.step = data, 0
        inputs = int(np.prod(data.feature_shape[1:]))
        rng = np.random.default_rng(1)
        self.w = rng.normal(0, 1 / np.sqrt(width), (width + 1, inputs))
        self.m, self.v = np.zeros_like(self.w), np.zeros_like(self.w)
        self.recent: list[tuple[np.ndarray, np.ndarray]] = []
        self.reconstruction: dict[int, tuple[float, float]] = {}

    def loss_micro_batch(self, x: np.ndarray) -> tuple[np.float32, np.ndarray]:
        self.step += 1
        rows = self.data.step_rows(self.step)
        inputs = self.data.features(self.step).reshape(len(rows), -1).astype(np.float64)
        h = np.hstack([x.reshape(len(x), -1).astype(np.float64), np.ones((len(x), 1))])
        public = rows % PUBLIC_EVERY == 0
        error = h @ self.w - inputs
        if (~public).sum() > 1 and self.recent:
            ridge = self._ridge_r2(h[~public], inputs[~public])
            self.reconstruction[self.step] = (_r2(h[~public] @ self.w, inputs[~public]), ridge)
        self.recent = (self.recent + [(h[public], inputs[public])])[-RECENT_STEPS:]
        grad_w = 2 * h[public].T @ error[public] / len(x)
        self.m = 0.9 * self.m + 0.1 * grad_w
        self.v = 0.999 * self.v + 0.001 * grad_w ** 2
        self.w -= LR * (self.m / (1 - 0.9 ** self.step)) / (np.sqrt(self.v / (1 - 0.999 ** self.step)) + 1e-8)
        dx = np.zeros_like(h[:, :-1])
        dx[public] = SCALE * 2 * error[public] @ self.w[:-1].T / len(x)
        loss = float((error[public] ** 2).sum() / len(x))
        return np.float32(loss), dx.reshape(x.shape).astype(np.float32)

    def _ridge_r2(self, h_private: np.ndarray, x_private: np.ndarray) -> float:
        h = np.concatenate([a for a, _ in self.recent])
        x = np.concatenate([b for _, b in self.recent])
        penalty = np.eye(h.shape[1]) * 1e-2 * np.mean(h[:, :-1] ** 2) * len(h)
        penalty[-1, -1] = 0
        w = np.linalg.solve(h.T @ h + penalty, h.T @ x)
        return _r2(h_private @ w, x_private)


def hijack(monkeypatch: Any, data: Any, width: int, name: str = "g") -> Hijacker:
    """Make the stage ``name`` a hijacking label owner of ``data`` (its rows, as every party numbers them) whose
    input is ``width`` activations a row; returns it, to read ``reconstruction`` after the run."""
    attacker = Hijacker(data, width)
    honest = Stage.loss_micro_batch

    def loss_micro_batch(self: Stage, x: np.ndarray, target: np.ndarray, mb: int = 0):
        if self.name != name:
            return honest(self, x, target, mb)
        loss, dx = attacker.loss_micro_batch(x)
        return loss, dx, {key: np.zeros_like(value) for key, value in self.params.items()}
    monkeypatch.setattr(Stage, "loss_micro_batch", loss_micro_batch)
    return attacker
