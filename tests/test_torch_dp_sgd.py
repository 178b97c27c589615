"""The label owner's DP-SGD (``dp_sgd``) on a torch stage: per-example gradients through ``torch.func``.

Oracles and tolerances:

* each example's parameter gradient against a loop of single-row backward passes through the module in
  plain torch autograd, and their sum against the stage's batch backward, ``rtol=1e-5, atol=1e-7`` (a
  batched kernel sums in another order: a few float32 roundings);
* a torch layer list's per-example gradients against the numpy stage's (names and layouts), the same
  tolerance; DP-SGD with a bound no example reaches and sigma 0 against the exact batch gradient;
* a torch label owner with dp_sgd over stage processes: bitwise the in-process run (parameters, test loss,
  privacy entries), and so after kill -9 of either stage and resume.

What cannot be honoured is refused with the reason: batch norm and dropout modules, a class-id loss whose
mean is weighted, [clients], the label owner's own bottom.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from distgrad.config.parse import load_experiment
from distgrad.errors import ConfigError, StageError
from distgrad.privacy.defenses import dp_sgd_gradients
from distgrad.run.inprocess import train_in_process
from distgrad.stage.stage import Stage

from conftest import read_json, run_main
from test_defenses import _digits, _equal_over_processes

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'distgrad[torch]'); "
                                               "CI installs it and sets DISTGRAD_REQUIRE=torch")

from distgrad.stage.torch_stage import TorchStage  # noqa: E402  (imports torch)

RTOL, ATOL = 1e-5, 1e-7
DP_SGD = "clip_noise = { max_norm = 0.05, sigma = 1.0 }\ndp_sgd = { max_norm = 1.0 }"

# The label owner's module, written next to the experiment that names it: digits' 64 features to 10 classes.
DPHEAD = '''
import torch
from torch import nn


class Drawing(nn.Module):
    """Dropout by the functional form: no module a check can see."""

    def forward(self, x):
        return nn.functional.dropout(x, 0.5, self.training)


def make(hidden=16, extra=""):
    layers = [nn.Linear(64, hidden), nn.ReLU()]
    layers += {"": [], "batch": [nn.BatchNorm1d(hidden)], "dropout": [nn.Dropout(0.2)],
               "instance": [nn.Unflatten(1, (1, hidden)), nn.InstanceNorm1d(1, track_running_stats=True),
                            nn.Flatten()], "drawing": [Drawing()]}[extra]
    return nn.Sequential(*layers, nn.Linear(hidden, 10))
'''


def _module_digits(tmp_path: Path, g_extra: str = DP_SGD, module_args: str = "",
                   loss: str = '{ type = "CrossEntropyLoss" }', name: str = "module.toml") -> Path:
    """The digits experiment with its label owner the module ``dphead:make`` (``module_args``), ``loss``
    and ``g_extra`` lines."""
    (tmp_path / "dphead.py").write_text(DPHEAD)
    path = _digits(tmp_path, "", g_extra, name)
    g_model = 'model = [{ type = "dense", name = "g1", in = 64, out = 10 }]'
    text = path.read_text()
    assert g_model in text
    path.write_text(text.replace(g_model, f'module = "dphead:make"\nmodule_args = {{ {module_args} }}').replace(
        'loss = "softmax_cross_entropy"', f"loss = {loss}"))
    return path


class _Unused(torch.nn.Module):
    """Pixels as 8x8 images through a convolution, a frozen bias and a parameter the output ignores."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 3, 3, padding=1)
        self.out = torch.nn.Linear(3 * 16, 10)
        self.out.bias.requires_grad_(False)
        self.unused = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images = x.view(x.shape[0], 1, 8, 8)
        return self.out(torch.nn.functional.max_pool2d(torch.tanh(self.conv(images)), 2).flatten(1))


def _rows(rows: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, 64)).astype(np.float32), rng.standard_normal((rows, 10)).astype(np.float32),
            rng.integers(0, 10, rows))


def test_each_examples_gradient_is_a_backward_pass_of_that_row_alone():
    torch.manual_seed(0)
    module = _Unused()
    trainable = [p for p in module.parameters() if p.requires_grad]
    stage = TorchStage.from_module("g", module, torch.optim.SGD(trainable, lr=0.1), (6, 64), "softmax_cross_entropy")
    x, dy, _ = _rows()
    per_example = stage.per_example_grads(x, dy, 0)
    assert len(per_example) == len(x)
    for i, grads in enumerate(per_example):
        assert set(grads) == {"conv.weight", "conv.bias", "out.weight", "unused"}     # the frozen bias has none
        module.zero_grad(set_to_none=True)
        module(torch.from_numpy(x[i:i + 1])).backward(torch.from_numpy(dy[i:i + 1]))
        for name, p in module.named_parameters():
            if p.requires_grad:
                expected = p.grad.numpy() if p.grad is not None else np.zeros(p.shape, np.float32)
                assert grads[name].dtype == np.float32 and grads[name].shape == expected.shape, name
                np.testing.assert_allclose(grads[name], expected, rtol=RTOL, atol=ATOL, err_msg=name)
    _, cache = stage.forward(x)
    _, batch = stage.backward(cache, dy, need_dx=False)
    for name, value in batch.items():
        np.testing.assert_allclose(sum(g[name] for g in per_example), value, rtol=RTOL, atol=ATOL, err_msg=name)


def test_dp_sgd_of_a_torch_stage_is_the_exact_gradient_without_clipping_or_noise_and_keeps_the_cut_gradient():
    """With a bound no example reaches and sigma 0, DP-SGD's update is the exact batch gradient; the
    activation gradient sent up is the exact one, bit for bit; the parameter the output ignores stays
    without a gradient, as in the exact backward."""
    torch.manual_seed(0)
    module = _Unused()
    stage = TorchStage.from_module("g", module, torch.optim.SGD([p for p in module.parameters() if p.requires_grad],
                                                                lr=0.1), (6, 64), "softmax_cross_entropy")
    x, _, target = _rows()
    loss, dx, exact = stage.loss_micro_batch(x, target)
    seen = []

    def update(x_mb: np.ndarray, dy: np.ndarray, mb: int) -> dict[str, np.ndarray]:
        seen.append(dy)
        return dp_sgd_gradients(stage.per_example_grads(x_mb, dy, mb), 1e9, 0.0, float(len(x_mb)),
                                np.random.default_rng(0))
    stage.private_update = update
    private_loss, private_dx, private = stage.loss_micro_batch(x, target)
    assert private_loss == loss and np.array_equal(private_dx, dx)
    np.testing.assert_array_equal(seen[0], stage.loss_backward(stage.forward(x, training=False)[0], target)[1])
    assert set(private) == set(exact) and "unused" not in private
    for name, value in exact.items():
        np.testing.assert_allclose(private[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


def test_a_torch_layer_lists_per_example_gradients_are_the_numpy_stages(tmp_path):
    numpy_stage = Stage.from_experiment(load_experiment("digits"), "g", 0)
    torch_stage = Stage.from_experiment(load_experiment(_digits(tmp_path, "", 'framework = "torch"')), "g", 0)
    assert isinstance(torch_stage, TorchStage)
    x, dy, _ = _rows(8, 1)
    ours, theirs = torch_stage.per_example_grads(x, dy, 0), numpy_stage.per_example_grads(x, dy, 0)
    for mine, reference in zip(ours, theirs):
        assert set(mine) == set(reference) == {"g1.W", "g1.b"}
        for name, value in reference.items():
            np.testing.assert_allclose(mine[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


def test_a_torch_label_owner_trains_by_dp_sgd_in_the_same_budget(tmp_path):
    """A torch layer list and a module label owner accept dp_sgd: the update differs from the exact one, the
    same secret gives the same run, and the budget counts the update (two releases in ten steps of one
    epoch's rows: the cut gradient and the update) with an end-to-end scope."""
    layers = load_experiment(_digits(tmp_path, "", 'framework = "torch"\n' + DP_SGD, "layers.toml"))
    private = train_in_process(layers, steps=10, noise_secret=3)
    assert private["params"] == train_in_process(layers, steps=10, noise_secret=3)["params"]
    exact = train_in_process(load_experiment(_digits(tmp_path, "", 'framework = "torch"\nclip_noise = '
                                                     '{ max_norm = 0.05, sigma = 1.0 }', "exact.toml")),
                             steps=10, noise_secret=3)
    assert private["params"]["g"] != exact["params"]["g"] and private["params"]["f"] != exact["params"]["f"]
    module = train_in_process(load_experiment(_module_digits(tmp_path)), steps=10, noise_secret=3)
    for summary in (private, module):
        clip = summary["privacy"]["g"]["clip_noise"]
        assert clip["releases"] == 2 and clip["scope"].startswith("end to end")
    assert exact["privacy"]["g"]["clip_noise"]["scope"].startswith("per release, on the cut gradients only")


@pytest.mark.parametrize("extra, message", [
    ("batch", r"batch's statistics.*: 2 \(BatchNorm1d\); remove"),
    ("instance", r"running statistics.*: 3 \(InstanceNorm1d\); remove"),
    ("dropout", r"dropout draws.*: 2 \(Dropout\); remove")])
def test_a_module_that_mixes_or_draws_across_the_batch_is_refused_when_built(tmp_path, extra, message):
    exp = load_experiment(_module_digits(tmp_path, module_args=f'extra = "{extra}"'))
    with pytest.raises(ConfigError, match="stage 'g': 'dp_sgd' needs each example's parameter gradient"):
        Stage.from_experiment(exp, "g")
    with pytest.raises(ConfigError, match=message):
        Stage.from_experiment(exp, "g")
    Stage.from_experiment(load_experiment(_module_digits(tmp_path, "", f'extra = "{extra}"', name="plain.toml")),
                          "g")      # without dp_sgd the same module is a stage


def test_distgrad_run_refuses_a_batch_norm_module_with_dp_sgd_before_any_stage_starts(tmp_path):
    result = run_main(["run", _module_digits(tmp_path, module_args='extra = "batch"'), "--steps", "2"])
    assert result.returncode == 2, result.stderr
    assert "'dp_sgd' needs each example's parameter gradient" in result.stderr and "BatchNorm1d" in result.stderr
    out = result.stdout + result.stderr
    assert "[f]" not in out and "[g]" not in out, f"a stage was started:\n{out}"      # the launcher's prefixes


def test_a_module_drawing_at_random_in_its_forward_fails_the_step_naming_the_reason(tmp_path):
    exp = load_experiment(_module_digits(tmp_path, module_args='extra = "drawing"'))
    with pytest.raises(StageError, match="dp_sgd's per-example gradients failed at step 1.*draws random numbers"):
        train_in_process(exp, steps=1, noise_secret=3)


@pytest.mark.parametrize("loss, refused", [
    ('{ type = "CrossEntropyLoss", weight = [1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0] }', True),
    ('{ type = "CrossEntropyLoss", ignore_index = 3 }', True),
    ('{ type = "CrossEntropyLoss", ignore_index = 3, reduction = "sum" }', False),
    ('{ type = "CrossEntropyLoss", label_smoothing = 0.1 }', False)])
def test_a_class_id_loss_whose_mean_is_weighted_is_refused(tmp_path, loss, refused):
    path = _module_digits(tmp_path, loss=loss)
    if not refused:
        load_experiment(path)
        return
    with pytest.raises(ConfigError, match="'dp_sgd': CrossEntropyLoss with .* total weight.*reduction = \"sum\""):
        load_experiment(path)


@pytest.mark.parametrize("module_args, loss, reason", [
    ('extra = "batch"', '{ type = "CrossEntropyLoss" }', r"batch norm normalises each row .*BatchNorm1d"),
    ("", '{ type = "CrossEntropyLoss", ignore_index = 3 }', r"CrossEntropyLoss with ignore_index and reduction"),
    ("", '{ type = "CrossEntropyLoss", weight = [1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0] }',
     r"CrossEntropyLoss with weight and reduction \"mean\" divides")])
def test_clip_noise_states_no_budget_where_one_label_reaches_every_row(tmp_path, module_args, loss, reason):
    """The label owner's clip_noise budget (sensitivity 2C) needs each label to reach only its own gradient
    row: a module's batch norm and a class-id mean weighted by the labels make every row depend on every
    label. The summary then states no guarantee and why, and the target form (a budget) is refused."""
    clip = "clip_noise = { max_norm = 0.05, sigma = 4.0 }"
    path = _module_digits(tmp_path, clip, module_args, loss)
    entry = train_in_process(load_experiment(path), steps=2, noise_secret=3)["privacy"]["g"]["clip_noise"]
    assert "epsilon" not in entry and entry["releases"] == 1, entry
    assert re.match(f"no differential-privacy guarantee: {reason}", entry["guarantee"]), entry
    target = _module_digits(tmp_path, "clip_noise = { max_norm = 0.05, epsilon = 8.0 }", module_args, loss,
                            "target.toml")
    with pytest.raises(ConfigError, match=f"'clip_noise' with a target epsilon is a label-DP budget.*{reason}"):
        Stage.from_experiment(load_experiment(target), "g")
    # (without them the same label owner states its epsilon: test_defenses.py and test_budget.py)


# Slow (torch.func's first use imports torch._dynamo in each process: 15-25 s under load). By default
# test_budget.py::test_dp_sgd_over_processes_is_bitwise_the_in_process_run covers DP-SGD over processes (numpy)
# and the in-process tests above the torch stage's per-example gradients and update; CI runs this one.
@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.usefixtures("fixed_noise_secret")
def test_a_torch_label_owners_dp_sgd_over_processes_is_bitwise_the_in_process_run(tmp_path):
    summary = _equal_over_processes(tmp_path, _module_digits(tmp_path), "--micro-batches", "2")
    assert summary["privacy"]["g"]["clip_noise"]["scope"].startswith("end to end")


# Four torch processes, each paying for torch.func's first use (about 40 s on two loaded cores). DP-SGD
# keeps nothing across steps (its noise is keyed by the run's secret, the step and digests of what it is
# computed from), so what a restart must get right is the torch stage's checkpoint and the ledger, which the
# default suite covers: test_a_torch_label_owners_dp_sgd_over_processes_is_bitwise_the_in_process_run (this
# run without kills) and test_faults.py::test_sigkill_at_several_steps_then_restart_gives_bitwise_equal_parameters
# (kill -9 and resume).
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("fixed_noise_secret")
def test_a_torch_label_owners_dp_sgd_survives_kill_9_of_either_stage_bitwise(tmp_path, stage_group):
    """As test_faults.run_killing_each_stage (g killed -9 at 30% of the steps, f at 60%, each restarted with
    its command line), with waits long enough for a torch process to start on a loaded machine."""
    from test_faults import Pair
    path = _module_digits(tmp_path)
    steps = 150
    reference = train_in_process(load_experiment(path), steps=steps)
    pair = stage_group(Pair, tmp_path, str(path), str(steps), f"ipc://{tmp_path}/g.sock")
    pair.start("g")
    pair.start("f")
    for fraction, victim in ((0.3, "g"), (0.6, "f")):
        pair.wait_for_step(int(steps * fraction), timeout=90.0)
        pair.kill_9_and_restart(victim)
    pair.wait_all(120.0)
    f_summary, g_summary = read_json(tmp_path / "f.json"), read_json(tmp_path / "g.json")
    assert f_summary["params"]["f"] == reference["params"]["f"]
    assert g_summary["params"]["g"] == reference["params"]["g"]
    assert g_summary["privacy"]["g"]["clip_noise"]["scope"].startswith("end to end")
    assert pair.starts["g"] == pair.starts["f"] == 2
