"""Every stage reports its own learning rate at each step, in its own metrics file and
TensorBoard events (the data owner's rate is known only to it; a serving stage writes its own), and
``distgrad plot`` draws it. Over processes, a numpy stage with a ``schedule`` above a torch stage with a
``torch.optim.lr_scheduler``, and the reverse."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distgrad.model.schedules import build_schedule

from conftest import read_lines, run_launcher

EXPERIMENT = """
name = "rates"
steps = 6
seed = 3

[data]
kind = "synthetic_classification"
samples = 64
features = 4
classes = 2
batch = 8

[[stages]]
name = "f"
model = [{{ type = "dense", name = "f1", in = 4, out = 3 }}, {{ type = "tanh" }}]
{f}

[[stages]]
name = "g"
model = [{{ type = "dense", name = "g1", in = 3, out = 2 }}]
loss = "softmax_cross_entropy"
{g}
"""
SCHEDULED = ('optimizer = { type = "sgd", lr = 0.2, '
             'schedule = { type = "exponential", decay_rate = 0.5, decay_steps = 2 } }')
SCHEDULER = ('framework = "torch"\noptimizer = { type = "sgd", lr = 0.1 }\n'
             'scheduler = { type = "StepLR", step_size = 2, gamma = 0.5 }')


SCHEDULED_G = ('optimizer = { type = "sgd", lr = 0.1, '
               'schedule = { type = "exponential", decay_rate = 0.25, decay_steps = 3 } }')


def _numpy_rates(steps: int, lr: float = 0.2, decay_rate: float = 0.5, decay_steps: int = 2) -> list[float]:
    schedule = build_schedule({"type": "exponential", "decay_rate": decay_rate, "decay_steps": decay_steps}, lr)
    return [float(schedule(t)) for t in range(1, steps + 1)]


def _torch_rates(steps: int) -> list[float]:
    """StepLR's rate of update t (it steps after each update): lr * gamma ** ((t - 1) // step_size)."""
    return [float(np.float32(0.1)) * 0.5 ** ((t - 1) // 2) for t in range(1, steps + 1)]


# By default two numpy stages with schedules of their own; a torch stage on either side (its scheduler's rates
# through the same records) is slow: PyTorch processes start in seconds.
@pytest.mark.parametrize("f,g", [(SCHEDULED, SCHEDULED_G), pytest.param(SCHEDULED, SCHEDULER, marks=pytest.mark.slow),
                                 pytest.param(SCHEDULER, SCHEDULED, marks=pytest.mark.slow)],
                         ids=["numpy-numpy", "numpy-torch", "torch-numpy"])
def test_each_stage_writes_its_own_learning_rate(tmp_path: Path, f: str, g: str):
    """``distgrad run --metrics m.jsonl [--tensorboard board]``: the data owner's rates in m.jsonl (and board),
    the label owner's (its serving process's) in m.g.jsonl (and board/g), each the rate its update used."""
    if SCHEDULER in (f, g):
        pytest.importorskip("torch")
        pytest.importorskip("tensorboardX")
    from test_tensorboard import _scalars
    experiment = tmp_path / "rates.toml"
    experiment.write_text(EXPERIMENT.format(f=f, g=g))
    metrics, board = tmp_path / "m.jsonl", tmp_path / "board"
    with_board = SCHEDULER in (f, g)        # tensorboardX's import costs seconds a process: tested with torch (slow)
    result = run_launcher(["run", experiment, "--metrics", metrics, *(["--tensorboard", board] if with_board else [])])
    assert result.returncode == 0, result.stdout + result.stderr
    f_lines, g_lines = read_lines(metrics), read_lines(tmp_path / "m.g.jsonl")
    expected = {SCHEDULED: _numpy_rates(6), SCHEDULED_G: _numpy_rates(6, 0.1, 0.25, 3), SCHEDULER: _torch_rates(6)}
    assert [line["lr"] for line in f_lines] == expected[f]
    assert [line["step"] for line in g_lines] == list(range(1, 7))
    assert [line["lr"] for line in g_lines] == expected[g]
    assert [line["loss"] for line in g_lines] == [line["loss"] for line in f_lines]   # the label owner's loss
    assert all(line["wall_s"] >= 0 for line in g_lines)
    if not with_board:
        return
    assert [value for _, value in _scalars(board)["train/lr"]] == pytest.approx(expected[f], rel=1e-7)
    g_scalars = _scalars(board / "g")
    assert sorted(g_scalars) == ["train/loss", "train/lr"]
    assert [step for step, _ in g_scalars["train/lr"]] == list(range(1, 7))
    assert [value for _, value in g_scalars["train/lr"]] == pytest.approx(expected[g], rel=1e-7)
    if f == SCHEDULED:                 # the label owner's own file plots as the driver's does
        pytest.importorskip("matplotlib")
        from distgrad.plot import plot_metrics
        assert plot_metrics(tmp_path / "m.g.jsonl", tmp_path / "g.png").read_bytes().startswith(b"\x89PNG")


def test_the_plot_draws_a_learning_rate_panel():
    pytest.importorskip("matplotlib")
    from distgrad.plot import draw_metrics
    records = [{"step": t, "wall_s": 0.1 * t, "loss": 1.0 / t, "lr": 0.1 * 0.5 ** t} for t in range(1, 6)]
    figure = draw_metrics(records, "rates")
    assert [axes.get_ylabel() for axes in figure.axes][1] == "learning rate"
    assert list(figure.axes[1].lines[0].get_ydata()) == [r["lr"] for r in records]
    without = draw_metrics([{k: v for k, v in r.items() if k != "lr"} for r in records], "no rates")
    assert "learning rate" not in [axes.get_ylabel() for axes in without.axes]
