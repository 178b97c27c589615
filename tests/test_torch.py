"""Torch stages (distgrad.stage.torch_stage) against torch's own autograd and against numpy stages.

Oracles and tolerances (see the module docstring of distgrad.stage.torch_stage):

* one step's gradients, torch vs numpy or vs a composed torch model:
  ``rtol=1e-5`` (a few float32 roundings through a handful of layers);
* parameters after SGD steps, mixed frameworks vs all-torch:
  ``rtol=1e-5, atol=1e-6`` (rounding only; SGD does not amplify it); the
  same for 4 micro-batches vs 1 and for torch stages vs torch's Adam on the
  composed model (the same frameworks, another summation order or lr);
* a run with the same frameworks in one process or two: bitwise.

Cross-framework Adam runs are not compared to float32 tolerance: TF1's
Adam (numpy stages) and torch's place epsilon differently, which after 50
steps of tanh-regression moves a weight by up to 8e-4 at lr 0.01; the
torch Adam mapping is checked against torch's Adam on the composed model.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from distgrad.stage.checkpoint import load as load_checkpoint, save as save_checkpoint
from distgrad.errors import ConfigError
from distgrad.config.parse import load_experiment, parse_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.model.nn import build_model
from distgrad.stage.stage import Stage

from conftest import read_json, read_lines, run_launcher, train_last_step

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'distgrad[torch]'); "
                                               "CI installs it and sets DISTGRAD_REQUIRE=torch")

from distgrad.stage.torch_stage import TorchStage  # noqa: E402  (imports torch)

GRAD_RTOL = 1e-5
PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-6
STEPS = 30

# tanh-regression, shortened, with each stage's framework and optimizer to fill in.
TANH = """
name = "tanh-torch"
steps = {steps}
seed = 0
[data]
kind = "synthetic_regression"
samples = 1024
features = 4
outputs = 1
hidden = 8
batch = 32
noise = 0.01
[[stages]]
name = "f"
framework = "{f}"
model = [{{ type = "dense", name = "f1", in = 4, out = 32 }}, {{ type = "tanh" }}]
optimizer = {optimizer}
[[stages]]
name = "g"
framework = "{g}"
model = [{{ type = "dense", name = "g1", in = 32, out = 16 }}, {{ type = "tanh" }},
         {{ type = "dense", name = "g2", in = 16, out = 1 }}]
optimizer = {optimizer}
loss = "mean_squared_error"
"""
SGD = '{ type = "sgd", lr = 0.05 }'
ADAM = '{ type = "adam", lr = 0.01 }'


def _tanh(directory, f: str, g: str, optimizer: str = SGD, steps: int = STEPS):
    path = directory / f"tanh-{f}-{g}-{'sgd' if optimizer == SGD else 'adam'}.toml"
    path.write_text(TANH.format(f=f, g=g, optimizer=optimizer, steps=steps))
    return path


def _run_two_processes(path, *extra: str) -> tuple[dict, list[dict]]:
    """``distgrad run PATH`` with each stage a process of its own; the launcher runs in this process, which has
    imported torch already (a launcher process would import it again, a torch stage's start of CPU time)."""
    summary, trace = path.with_suffix(".json"), path.with_suffix(".trace.jsonl")
    result = run_launcher(["run", path, "--summary", summary, "--trace", trace, "--progress", "off", *extra])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_json(summary)
    assert summary["mode"] == "two-process"
    return summary, read_lines(trace)


def _assert_params_close(actual: dict, expected: dict, rtol: float, atol: float) -> float:
    """Every parameter of ``actual`` within tolerance of ``expected``; returns the largest difference."""
    assert actual.keys() == expected.keys()
    worst = 0.0
    for stage in expected:
        assert actual[stage].keys() == expected[stage].keys()
        for name in expected[stage]:
            a, e = np.array(actual[stage][name], np.float32), np.array(expected[stage][name], np.float32)
            np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"{stage}/{name}")
            worst = max(worst, float(np.abs(a - e).max()))
    return worst


@pytest.fixture(scope="module")
def mixed_runs(tmp_path_factory):
    """Two-process SGD runs of tanh-regression, torch f + numpy g and numpy f + torch g, by experiment path."""
    directory = tmp_path_factory.mktemp("mixed")
    paths = {frameworks: _tanh(directory, *frameworks) for frameworks in (("torch", "numpy"), ("numpy", "torch"))}
    return {frameworks: (path, *_run_two_processes(path)) for frameworks, path in paths.items()}


def _composed_torch_model(exp) -> tuple[torch.nn.Module, torch.nn.Module]:
    """f and g of tanh-regression written directly in torch, from the numpy build's initial values."""
    f_params = build_model(exp.stages[0].model, exp.seed).params
    g_params = build_model(exp.stages[1].model, exp.seed).params

    def linear(params, name):
        layer = torch.nn.Linear(*params[f"{name}.W"].shape)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(params[f"{name}.W"].T))
            layer.bias.copy_(torch.from_numpy(params[f"{name}.b"]))
        return layer

    f = torch.nn.Sequential(linear(f_params, "f1"), torch.nn.Tanh())
    g = torch.nn.Sequential(linear(g_params, "g1"), torch.nn.Tanh(), linear(g_params, "g2"))
    return f, g


def test_the_gradient_crossing_the_wire_is_torch_autograd_of_the_composed_model(mixed_runs):
    path, _, trace = mixed_runs[("torch", "numpy")]
    exp = load_experiment(path)
    data = exp.build_data()
    f, g = _composed_torch_model(exp)
    x, target = torch.from_numpy(data.features(1)), torch.from_numpy(data.targets(1))
    activation = f(x)
    loss = torch.nn.functional.mse_loss(g(activation), target)
    d_activation, d_weight, d_bias = torch.autograd.grad(loss, [activation, f[0].weight, f[0].bias])
    step1 = trace[0]
    assert step1["step"] == 1
    crossed = np.array(step1["grads"]["activation_grad"], np.float32)
    assert crossed.shape == (32, 32)
    np.testing.assert_allclose(crossed, d_activation.numpy(), rtol=GRAD_RTOL, atol=1e-7 * float(d_activation.abs().max()))
    np.testing.assert_allclose(step1["loss"], loss.item(), rtol=GRAD_RTOL)
    # The torch f-stage's own gradients, from the gradient it received, are the composed model's too.
    np.testing.assert_allclose(np.array(step1["grads"]["f1.W"], np.float32), d_weight.numpy().T, rtol=GRAD_RTOL,
                               atol=1e-7 * float(d_weight.abs().max()))
    np.testing.assert_allclose(np.array(step1["grads"]["f1.b"], np.float32), d_bias.numpy(), rtol=GRAD_RTOL,
                               atol=1e-7 * float(d_bias.abs().max()))


@pytest.mark.parametrize("frameworks", [("torch", "numpy"), ("numpy", "torch")], ids="f={0[0]},g={0[1]}".format)
def test_mixed_two_process_runs_match_an_all_torch_run(mixed_runs, tmp_path, frameworks):
    path, summary, trace = mixed_runs[frameworks]
    assert summary["steps"] == STEPS and len(trace) == STEPS
    # Same frameworks in one process: bitwise (JSON floats hold float32 exactly).
    same = train_in_process(load_experiment(path))
    assert summary["params"] == same["params"] and summary["final_loss"] == same["final_loss"]
    all_torch = train_in_process(load_experiment(_tanh(tmp_path, "torch", "torch")))
    worst = _assert_params_close(summary["params"], all_torch["params"], PARAM_RTOL, PARAM_ATOL)
    np.testing.assert_allclose(summary["final_loss"], all_torch["final_loss"], rtol=1e-4)
    print(f"{frameworks}: largest parameter difference from all-torch after {STEPS} SGD steps: {worst:.3g}")


def test_torch_adam_stages_train_as_torch_adam_on_the_composed_model(tmp_path):
    exp = load_experiment(_tanh(tmp_path, "torch", "torch", ADAM, steps=20))
    staged = train_in_process(exp)
    data = exp.build_data()
    f, g = _composed_torch_model(exp)
    params = [*f.parameters(), *g.parameters()]
    optimizer = torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    for step in range(1, 21):
        loss = torch.nn.functional.mse_loss(g(f(torch.from_numpy(data.features(step)))),
                                            torch.from_numpy(data.targets(step)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    composed = {"f": {"f1.W": f[0].weight.detach().numpy().T, "f1.b": f[0].bias.detach().numpy()},
                "g": {"g1.W": g[0].weight.detach().numpy().T, "g1.b": g[0].bias.detach().numpy(),
                      "g2.W": g[2].weight.detach().numpy().T, "g2.b": g[2].bias.detach().numpy()}}
    _assert_params_close(staged["params"], composed, PARAM_RTOL, PARAM_ATOL)
    np.testing.assert_allclose(staged["final_loss"], loss.item(), rtol=GRAD_RTOL)


# Every layer type and every loss, one stage pair each, torch against numpy.
LAYERS = {
    "sum_squared_error": ({"kind": "synthetic_regression", "samples": 64, "features": 3, "outputs": 2, "batch": 8},
                          [{"type": "dense", "name": "b", "in": 6, "out": 2}, {"type": "sigmoid"}]),
    "mean_squared_error": ({"kind": "synthetic_regression", "samples": 64, "features": 3, "outputs": 2, "batch": 8},
                           [{"type": "dense", "name": "b", "in": 6, "out": 2}, {"type": "tanh"}]),
    "softmax_cross_entropy": ({"kind": "synthetic_classification", "samples": 64, "features": 3, "classes": 4,
                               "batch": 8}, [{"type": "dense", "name": "b", "in": 6, "out": 4}]),
}


def _layer_experiment(loss: str, framework: str):
    data, g_model = LAYERS[loss]
    f_model = [{"type": "scale", "name": "s", "size": 3, "init": {"kind": "truncated_normal", "stddev": 0.5}},
               {"type": "dense", "name": "a", "in": 3, "out": 6, "bias_init": 0.1}, {"type": "relu"}]
    return parse_experiment({
        "name": f"layers-{loss}", "seed": 5, "data": data,
        "stages": [{"name": "f", "framework": framework, "model": f_model, "optimizer": {"type": "sgd", "lr": 0.1}},
                   {"name": "g", "framework": framework, "model": g_model, "loss": loss,
                    "optimizer": {"type": "adam", "lr": 0.01}}]})


def _close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.dtype == np.float32 and actual.shape == expected.shape, what
    np.testing.assert_allclose(actual, expected, rtol=GRAD_RTOL, atol=1e-6 * float(np.abs(expected).max()),
                               err_msg=what)


@pytest.mark.parametrize("loss", sorted(LAYERS))
def test_each_loss_with_scale_dense_and_activation_layers_matches_the_numpy_stage(loss):
    exps = {fw: _layer_experiment(loss, fw) for fw in ("numpy", "torch")}
    (nf, ng), (tf, tg) = ([Stage.from_experiment(exps[fw], name, init={"s": 1.5}) for name in ("f", "g")]
                          for fw in ("numpy", "torch"))
    assert isinstance(tf, TorchStage) and isinstance(tg, TorchStage) and not isinstance(nf, TorchStage)
    for numpy_stage, torch_stage in ((nf, tf), (ng, tg)):
        assert torch_stage.params.keys() == numpy_stage.params.keys()
        for name, value in numpy_stage.params.items():          # the same initial values, --init included
            assert np.array_equal(torch_stage.params[name], value), name
        assert (torch_stage.input_shape, torch_stage.output_shape) == (numpy_stage.input_shape, numpy_stage.output_shape)
        assert (torch_stage.target_shape, torch_stage.target_dtype) == (numpy_stage.target_shape, numpy_stage.target_dtype)
    assert np.all(tf.params["s"] == 1.5)
    data = exps["numpy"].build_data()
    x, target = data.features(1), data.targets(1)
    (y, numpy_cache), (torch_y, torch_cache) = nf.forward(x), tf.forward(x)
    _close(torch_y, y, "f output")
    # g from the same activations, f from the same gradient: each stage is compared on its own.
    numpy_loss, dy, numpy_g = ng.loss_micro_batch(y, target)
    torch_loss, torch_dy, torch_g = tg.loss_micro_batch(y, target)
    np.testing.assert_allclose(torch_loss, numpy_loss, rtol=GRAD_RTOL)
    assert torch_loss.dtype == np.float32
    prediction = ng.forward(y)[0]
    (torch_value, torch_dpred), (value, dpred) = tg.loss_backward(prediction, target), ng.loss_backward(prediction, target)
    np.testing.assert_allclose(torch_value, value, rtol=GRAD_RTOL)
    _close(torch_dpred, dpred, "d(loss)/d(prediction)")
    _close(torch_dy, dy, "d(loss)/d(activation)")
    numpy_dx, numpy_f = nf.backward(numpy_cache, dy)
    torch_dx, torch_f = tf.backward(torch_cache, dy)
    _close(torch_dx, numpy_dx, "d(loss)/d(x)")
    assert torch_g.keys() == numpy_g.keys() and torch_f.keys() == numpy_f.keys()
    for name in numpy_g:
        _close(torch_g[name], numpy_g[name], name)
    for name in numpy_f:
        _close(torch_f[name], numpy_f[name], name)
    evaluated, expected = tg.evaluate_last(y, target), ng.evaluate_last(y, target)
    assert (evaluated["correct"], evaluated["count"]) == (expected["correct"], expected["count"])
    np.testing.assert_allclose(evaluated["loss"], expected["loss"], rtol=GRAD_RTOL)


# Two launches of torch processes (8 s): slow-marked for the default suite's five minutes. A torch stage's
# checkpoint arrays round-trip bitwise (test_state_arrays_round_trip_through_a_checkpoint_file, and with its
# schedule, test_a_torch_stage_sets_each_scheduled_rate_and_resumes_it); resuming over processes is the
# framework-free StageState path every numpy kill/resume test runs.
@pytest.mark.slow
def test_micro_batches_and_resume_from_a_checkpoint_with_torch_stages(tmp_path):
    path = _tanh(tmp_path, "numpy", "torch", ADAM, steps=20)      # one torch import per launch: keeps it fast
    checkpoints = ["--micro-batches", "4", "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", "5"]
    _run_two_processes(path, *checkpoints, "--steps", "10")
    assert max(p.name[-14:] for p in (tmp_path / "ck").glob("g-*.ckpt")) == "000000010.ckpt"   # g-RUN-STEP.ckpt
    resumed, trace = _run_two_processes(path, *checkpoints, "--resume")
    assert resumed["steps"] == 20 and [line["step"] for line in trace] == list(range(11, 21))
    exp = load_experiment(path)
    reference = train_in_process(exp, micro_batches=4)
    assert resumed["params"] == reference["params"]           # bitwise: the Adam state came back from the files
    unsplit = train_in_process(exp)          # another float32 summation order, then 20 Adam steps
    worst = _assert_params_close(reference["params"], unsplit["params"], PARAM_RTOL, PARAM_ATOL)
    print(f"largest parameter difference, 4 micro-batches vs 1, after 20 Adam steps: {worst:.3g}")


def test_state_arrays_round_trip_through_a_checkpoint_file(tmp_path):
    exp = load_experiment(_tanh(tmp_path, "numpy", "torch", ADAM))
    data = exp.build_data()
    upstream = Stage.from_experiment(exp, "f")
    trained, fresh = TorchStage.from_experiment(exp, "g"), TorchStage.from_experiment(exp, "g")

    def step(stage, i):
        train_last_step(stage, upstream.forward(data.features(i))[0], data.targets(i))

    for i in range(1, 4):
        step(trained, i)
    path = save_checkpoint(tmp_path / "ck", "g", "run", 3, exp.fingerprint, trained.state_arrays())
    arrays = load_checkpoint(path).arrays
    assert {k for k in arrays if k.startswith("opt/")} >= {"opt/exp_avg/g1.W", "opt/exp_avg_sq/g1.W", "opt/step/g1.W"}
    fresh.load_state_arrays(arrays, 3)
    assert fresh.step == 3
    for i in range(4, 7):
        step(trained, i)
        step(fresh, i)
    assert all(np.array_equal(fresh.params[k], v) for k, v in trained.params.items())
    with pytest.raises(ValueError, match="checkpoint has parameters"):
        fresh.load_state_arrays({"param/other": np.zeros(1, np.float32)}, 1)


# An SGD and an Adam table with a learning-rate schedule (warm-up, then a decay) for torch stages.
SGD_SCHEDULED = ('{ type = "sgd", lr = 0.05, schedule = { type = "exponential", decay_rate = 0.5, decay_steps = 10, '
                 'warmup_steps = 5 } }')
ADAM_SCHEDULED = '{ type = "adam", lr = 0.01, schedule = { type = "cosine", decay_steps = 6, warmup_steps = 2 } }'


def test_torch_stages_follow_the_schedule_of_numpy_stages(tmp_path):
    # SGD carries rounding differences along without amplifying them, so the tolerance of the mixed runs
    # above holds; a torch stage that ignored the schedule would be off by far more (checked below).
    numpy_run = train_in_process(load_experiment(_tanh(tmp_path, "numpy", "numpy", SGD_SCHEDULED)))
    torch_run = train_in_process(load_experiment(_tanh(tmp_path, "torch", "torch", SGD_SCHEDULED)))
    worst = _assert_params_close(torch_run["params"], numpy_run["params"], PARAM_RTOL, PARAM_ATOL)
    constant = train_in_process(load_experiment(_tanh(tmp_path, "torch", "torch", SGD)))
    unscheduled_by = np.abs(np.array(constant["params"]["g"]["g2.W"]) - np.array(torch_run["params"]["g"]["g2.W"]))
    assert unscheduled_by.max() > 100 * worst


def test_a_torch_stage_sets_each_scheduled_rate_and_resumes_it(tmp_path):
    exp = load_experiment(_tanh(tmp_path, "numpy", "torch", ADAM_SCHEDULED))
    data = exp.build_data()
    upstream = Stage.from_experiment(exp, "f")
    rates = [float(Stage.from_experiment(exp, "f").optimizer.schedule(t)) for t in range(1, 9)]   # same table
    assert len(set(rates)) == 7                                            # update 2 ends the warm-up at lr, 3 is lr
    trained, fresh, old = (TorchStage.from_experiment(exp, "g") for _ in range(3))
    assert trained.optimizer.param_groups[0]["lr"] == rates[0]

    def step(stage, i):
        train_last_step(stage, upstream.forward(data.features(i))[0], data.targets(i))
        assert stage.updates == i and all(group["lr"] == rates[i - 1] for group in stage.optimizer.param_groups)

    for i in range(1, 5):
        step(trained, i)
    arrays = load_checkpoint(save_checkpoint(tmp_path / "ck", "g", "run", 4, exp.fingerprint,
                                             trained.state_arrays())).arrays
    assert arrays["opt/updates"] == 4
    fresh.load_state_arrays(arrays, 4)
    old.load_state_arrays({k: v for k, v in arrays.items() if k != "opt/updates"}, 4)   # from before schedules
    assert fresh.updates == old.updates == 4
    for i in range(5, 9):
        for stage in (trained, fresh, old):
            step(stage, i)
    for name, value in trained.params.items():
        assert np.array_equal(fresh.params[name], value) and np.array_equal(old.params[name], value), name


class Head(torch.nn.Module):
    """tanh-regression's g, written by hand: Linear(32, 16), tanh, Linear(16, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(32, 16)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(a)))


def _head_stage(exp) -> TorchStage:
    """tanh-regression's g as a hand-written module, starting from the experiment's initial values."""
    initial = Stage.from_experiment(exp, "g").params
    head = Head()
    with torch.no_grad():
        for layer, name in ((head.hidden, "g1"), (head.out, "g2")):
            layer.weight.copy_(torch.from_numpy(initial[f"{name}.W"].T))
            layer.bias.copy_(torch.from_numpy(initial[f"{name}.b"]))
    # The experiment's adam table as a torch stage reads it: the float32 values the numpy Adam uses.
    optimizer = torch.optim.Adam(head.parameters(), lr=float(np.float32(0.01)),
                                 betas=(float(np.float32(0.9)), float(np.float32(0.999))), eps=float(np.float32(1e-8)))
    return TorchStage.from_module("g", head, optimizer, Stage.from_experiment(exp, "f").output_shape,
                                  loss="mean_squared_error")


def test_a_hand_written_module_serves_over_the_wire(tmp_path):
    """The Python API takes a stage factory: a numpy f drives a hand-written torch g over a real socket."""
    from distgrad.api import drive_stage, serve_stage

    exp = load_experiment(_tanh(tmp_path, "numpy", "torch", ADAM, steps=15))
    with serve_stage(exp, stage_factory=lambda: _head_stage(exp)) as g:
        f_summary = drive_stage(exp, g.endpoint)
        g_summary = g.wait()
    reference = train_in_process(exp)["params"]
    assert f_summary["params"]["f"] == reference["f"]
    assert np.array_equal(np.array(g_summary["params"]["g"]["hidden.weight"], np.float32).T,
                          np.array(reference["g"]["g1.W"], np.float32))


def test_a_hand_written_module_is_a_stage(tmp_path):
    exp = load_experiment(_tanh(tmp_path, "numpy", "torch", ADAM, steps=15))
    f = Stage.from_experiment(exp, "f")
    g = _head_stage(exp)
    assert sorted(g.params) == ["hidden.bias", "hidden.weight", "out.bias", "out.weight"]
    assert (g.output_shape, g.target_shape, g.is_last) == ((32, 1), (32, 1), True)
    data = exp.build_data()
    for step in range(1, 16):                   # the order every path uses: forward down, backward up
        activation, cache = f.forward(data.features(step))
        _, dx, _ = train_last_step(g, activation, data.targets(step))
        f.apply(f.backward(cache, dx, need_dx=False)[1])
    reference = train_in_process(exp)["params"]
    assert np.array_equal(g.params["hidden.weight"].T, np.array(reference["g"]["g1.W"], np.float32))
    assert np.array_equal(g.params["out.bias"], np.array(reference["g"]["g2.b"], np.float32))
    assert all(np.array_equal(v, np.array(reference["f"][k], np.float32)) for k, v in f.params.items())
    other = Head()
    with pytest.raises(ConfigError, match="does not take input of shape"):
        TorchStage.from_module("g", other, torch.optim.SGD(other.parameters(), lr=0.1), (32, 7))
    with pytest.raises(ConfigError, match="not a parameter of the module"):
        TorchStage.from_module("g", Head(), g.optimizer, (32, 32))


def test_without_torch_a_torch_stage_says_how_to_install_it(monkeypatch, tmp_path):
    exp = load_experiment(_tanh(tmp_path, "torch", "numpy"))
    monkeypatch.setitem(sys.modules, "torch", None)            # import torch now raises ImportError
    monkeypatch.delitem(sys.modules, "distgrad.stage.torch_stage")
    with pytest.raises(ConfigError, match=r"pip install 'distgrad\[torch\]'"):
        Stage.from_experiment(exp, "f")
    assert type(Stage.from_experiment(exp, "g")) is Stage     # numpy stages do not need it


def test_an_array_of_another_dtype_crosses_into_torch_in_one_copy():
    """A target of another dtype (int32 class ids for an int64 loss) is converted while copied into torch's
    memory: no numpy copy of it first (tracemalloc sees numpy's arrays, not torch's), and the same values."""
    import tracemalloc

    from distgrad.stage.torch_stage import _tensor

    labels = np.arange(1 << 20, dtype=np.int32) % 10
    tracemalloc.start()
    try:
        tensor = _tensor(labels, np.int64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < labels.nbytes, f"a numpy copy of {peak} bytes was made on the way"
    assert tensor.dtype == torch.int64 and torch.equal(tensor, torch.from_numpy(labels.astype(np.int64)))


class _SometimesBiased(torch.nn.Module):
    """``x @ W``, plus ``b`` only for a micro-batch whose inputs sum above 0: a graph that depends on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.W = torch.nn.Parameter(torch.full((3, 2), 0.5))
        self.b = torch.nn.Parameter(torch.zeros(2))

    def forward(self, x):
        y = x @ self.W
        return y + self.b if float(x.detach().sum()) > 0 else y


def test_a_module_parameter_no_micro_batch_of_a_step_uses_is_left_alone_as_torch_leaves_it():
    """torch leaves a parameter whose ``grad`` is None alone; the step engine's micro-batch sums must too, even
    after an earlier step gave it a gradient (the accumulator once applied that step's buffer again)."""
    from distgrad.stage.engine import StepEngine
    from distgrad.stage.stage import micro_batch

    module = _SometimesBiased()
    stage = TorchStage.from_module("f", module, torch.optim.Adam(module.parameters(), lr=0.1), (4, 3))
    engine = StepEngine(stage, lambda count: np.float32(1.0 / count))
    dy = np.ones((2, 2), np.float32)
    for step, sign in ((1, 1.0), (2, -1.0)):
        x = np.full((4, 3), sign, np.float32)
        caches = [stage.forward(micro_batch(x, i, 2), i)[1] for i in range(2)]
        b_before = stage.params["b"].copy()
        engine.apply_step(step, 2, ((stage.backward(cache, dy, need_dx=False)[1], None) for cache in caches))
    assert not np.array_equal(stage.params["W"], np.full((3, 2), 0.5, np.float32))
    assert np.array_equal(stage.params["b"], b_before)      # step 2 never used b
