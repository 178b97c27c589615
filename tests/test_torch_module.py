"""Your own PyTorch module as a stage: ``module = "package.module:factory"`` (distgrad.stage.torch_stage.build_stage).

Oracles and tolerances:

* the built-in ``digits-cnn-torch`` and a user module in stage files,
  trained by two processes: bitwise equal to the in-process reference
  (same frameworks, same kernels, one thread each);
* a module last stage with a torch loss, over 2 micro-batches: against the
  same factories composed in plain torch on whole batches, ``rtol=1e-5,
  atol=1e-6`` (another float32 summation order; SGD does not amplify it);
* a checkpoint of a module with batch norm: the resumed stage equals the
  uninterrupted one bitwise, running statistics included;
* CUDA (skipped without a GPU): against the CPU run, ``rtol=1e-4,
  atol=1e-5`` (other kernels).
"""

from __future__ import annotations

import importlib.util
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from distgrad.stage.checkpoint import load as load_checkpoint, save as save_checkpoint
from distgrad.errors import ConfigError
from distgrad.config.experiment import check_run_settings
from distgrad.config.parse import load_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.stage.stage import Stage

from conftest import StageProcess, read_json, run_cli, run_launcher, train_last_step

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'distgrad[torch]'); "
                                               "CI installs it and sets DISTGRAD_REQUIRE=torch")

from distgrad.stage.torch_stage import TorchStage  # noqa: E402  (imports torch)

PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-6
CUDA_RTOL, CUDA_ATOL = 1e-4, 1e-5

# A user's model file, written next to the experiment or stage files that name it.
MYMODEL = '''
import torch
from torch import nn


class Encoder(nn.Module):
    def __init__(self, features, hidden, norm):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.norm = nn.BatchNorm1d(hidden) if norm else nn.Identity()
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        return torch.tanh(self.out(torch.relu(self.norm(self.inp(x)))))


def encoder(features=4, hidden=8, norm=False):
    return Encoder(features, hidden, norm)


def head(hidden=8, outputs=3):
    return nn.Linear(hidden, outputs)


def not_a_module(**kwargs):
    return "a string"


def boom(**kwargs):
    raise RuntimeError("kaboom")
'''

COMBINED = """
name = "own-module"
steps = {steps}
seed = 2
[data]
{data}
batch = 16
[[stages]]
name = "f"
module = "{f_module}"
module_args = {{ hidden = 8{f_args} }}
output = [{cut}]
optimizer = {f_optimizer}
{device}
[[stages]]
name = "g"
{g_stage}
"""
CLASSIFY = 'kind = "synthetic_classification"\nsamples = 256\nfeatures = 4\nclasses = 3'
REGRESS = 'kind = "synthetic_regression"\nsamples = 256\nfeatures = 4\noutputs = 2'
NUMPY_G = ('model = [{ type = "dense", name = "g1", in = 8, out = 3 }]\noptimizer = { type = "adam", lr = 0.01 }\n'
           'loss = "softmax_cross_entropy"')
SGD = '{ type = "SGD", lr = 0.05 }'


def _experiment(directory, *, steps=10, data=CLASSIFY, f_module="mymodel:encoder", f_args="", cut=8,
                f_optimizer=SGD, device="", g_stage=NUMPY_G, name="own.toml"):
    """Write mymodel.py and an experiment naming it into ``directory``; returns the experiment's path."""
    (directory / "mymodel.py").write_text(MYMODEL)
    path = directory / name
    path.write_text(COMBINED.format(steps=steps, data=data, f_module=f_module, f_args=f_args, cut=cut,
                                    f_optimizer=f_optimizer, device=device, g_stage=g_stage))
    return path


# ---------------------------------------------------------------- the built-in, through the launcher

PROCESS_STEPS = 100

# Trains the built-in's whole run in this process besides: slow. A torch module in a daemon against a numpy
# stage, bitwise, stays in the default suite (test_a_user_module_in_a_stage_file_trains_in_a_daemon_against_a_numpy_stage).
@pytest.mark.slow
def test_the_builtin_cnn_trains_in_two_processes_bitwise_as_in_one(tmp_path):
    """A user-written torch module, named by import path, trains in a daemon against a numpy
    g-stage; the digits CNN reaches >= 97% held-out accuracy.

    Bitwise equality does not depend on the length of the run: the processes train the first
    PROCESS_STEPS steps (and evaluate), equal bit for bit to the in-process run of as many steps;
    the accuracy of the built-in's whole run (800 steps) is that of the in-process run, trained
    here meanwhile."""
    summary_path = tmp_path / "run.json"
    exp = load_experiment("digits-cnn-torch")
    with ThreadPoolExecutor(1) as pool:      # the two processes run while this one trains the references
        launched = pool.submit(run_cli, ["run", "digits-cnn-torch", "--steps", PROCESS_STEPS, "--summary",
                                         summary_path, "--progress", "off"])
        reference = train_in_process(exp, steps=PROCESS_STEPS)
        whole = train_in_process(exp)
        result = launched.result()
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_json(summary_path)
    assert summary["mode"] == "two-process" and summary["steps"] == PROCESS_STEPS
    assert set(summary["params"]["f"]) == {"1.weight", "1.bias"}        # the module's named_parameters
    assert summary["params"] == reference["params"] and summary["final_loss"] == reference["final_loss"]
    assert summary["test_accuracy"] == reference["test_accuracy"]       # the evaluation crossed the wire too
    assert whole["steps"] == 800 and whole["test_accuracy"] >= 0.97
    print(f"digits-cnn-torch: test accuracy {whole['test_accuracy']:.4f} after 800 steps; two processes "
          f"{summary['elapsed_s']:.2f} s for {PROCESS_STEPS} steps")


# ---------------------------------------------------------------- stage files, two daemons by hand

INTERFACE = """
[interface]
name = "blobs"
stages = ["f", "g"]
batch = 16
activation = { shape = [8] }
steps = 40
seed = 4
"""
F_FILE = INTERFACE + """
[stage]
name = "f"
module = "models.encoder:make"
module_args = { hidden = 8 }
optimizer = { type = "SGD", lr = 0.1, momentum = 0.9 }

[data]
kind = "npz"
path = "blobs.npz"
features = "x"
batch = 16
"""
G_FILE = INTERFACE + """
[stage]
name = "g"
model = [{ type = "dense", name = "g1", in = 8, out = 3 }]
optimizer = { type = "adam", lr = 0.01 }
loss = "softmax_cross_entropy"

[data]
kind = "npz"
path = "blobs.npz"
labels = "y"
batch = 16
"""
ENCODER_PACKAGE = '''
import torch
from torch import nn


class Encoder(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.out = nn.Linear(16, hidden)

    def forward(self, x):
        return torch.relu(self.out(torch.relu(self.inp(x))))


def make(hidden):
    return Encoder(hidden)
'''


def _blobs(path) -> None:
    """Three Gaussian classes in 4 dimensions, 240 rows."""
    rng = np.random.default_rng(11)
    y = np.repeat(np.arange(3), 80)
    x = rng.normal(size=(240, 4)) + 3.0 * np.eye(3, 4)[y]
    np.savez(path, x=x.astype(np.float32), y=y.astype(np.int64))


def test_a_user_module_in_a_stage_file_trains_in_a_daemon_against_a_numpy_stage(tmp_path, start_server):
    """Each party has only its own stage file and data; f's model is a package next to its file
    (models/encoder.py), imported from there although the daemons run elsewhere."""
    f_dir, g_dir = tmp_path / "data-owner", tmp_path / "label-owner"
    (f_dir / "models").mkdir(parents=True)
    g_dir.mkdir()
    (f_dir / "models" / "__init__.py").write_text("")
    (f_dir / "models" / "encoder.py").write_text(ENCODER_PACKAGE)
    _blobs(f_dir / "blobs.npz")
    _blobs(g_dir / "blobs.npz")
    (f_dir / "f.toml").write_text(F_FILE)
    (g_dir / "g.toml").write_text(G_FILE)
    g, endpoint = start_server(str(g_dir / "g.toml"), "--summary", str(tmp_path / "g.json"))
    assert endpoint.startswith("tcp://127.0.0.1:")
    with StageProcess(["f", "--experiment", f_dir / "f.toml", "--connect", endpoint,
                       "--summary", tmp_path / "f.json"], tmp_path / "f.log") as f:
        assert f.wait() == 0, f.output
    assert g.wait() == 0, g.output
    reference = train_in_process(load_experiment([f_dir / "f.toml", g_dir / "g.toml"]))
    f_summary, g_summary = read_json(tmp_path / "f.json"), read_json(tmp_path / "g.json")
    assert set(f_summary["params"]["f"]) == {"inp.weight", "inp.bias", "out.weight", "out.bias"}
    assert f_summary["params"] == {"f": reference["params"]["f"]}
    assert g_summary["params"] == {"g": reference["params"]["g"]}
    assert f_summary["final_loss"] == g_summary["final_loss"] == reference["final_loss"]
    assert reference["test_accuracy"] >= 0.9          # three well-separated classes


# ---------------------------------------------------------------- a module last stage with a torch loss

def _user_module(directory):
    spec = importlib.util.spec_from_file_location("user_model_oracle", directory / "mymodel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("data,loss,loss_fn", [
    (CLASSIFY, '{ type = "CrossEntropyLoss" }', torch.nn.CrossEntropyLoss()),
    (REGRESS, '{ type = "MSELoss", reduction = "sum" }', torch.nn.MSELoss(reduction="sum")),
], ids=["CrossEntropyLoss-mean", "MSELoss-sum"])
def test_a_module_last_stage_with_a_torch_loss_trains_as_the_composed_torch_model(tmp_path, data, loss, loss_fn):
    outputs = 3 if "classes" in data else 2
    g_stage = (f'module = "mymodel:head"\nmodule_args = {{ outputs = {outputs} }}\n'
               f'optimizer = {{ type = "SGD", lr = 0.02 }}\nloss = {loss}')
    exp = load_experiment(_experiment(tmp_path, steps=12, data=data, g_stage=g_stage))
    assert exp.reduction == ("sum" if "sum" in loss else "mean")
    staged = train_in_process(exp, micro_batches=2)          # micro-batches combine by the loss's reduction
    rows = exp.build_data()
    head_stage = Stage.from_experiment(exp, "g")
    assert (head_stage.target_shape, head_stage.target_dtype) == (
        ((16,), np.int64) if "classes" in data else ((16, 2), np.float32))
    counted = head_stage.evaluate_last(Stage.from_experiment(exp, "f").forward(rows.features(1))[0], rows.targets(1))
    assert (counted["correct"] is None) == ("classes" not in data)    # CrossEntropyLoss classifies: it counts hits
    user = _user_module(tmp_path)
    torch.manual_seed(exp.seed)
    f = user.encoder(hidden=8)
    torch.manual_seed(exp.seed)
    g = user.head(outputs=outputs)
    f_opt, g_opt = torch.optim.SGD(f.parameters(), lr=0.05), torch.optim.SGD(g.parameters(), lr=0.02)
    for step in range(1, 13):
        value = loss_fn(g(f(torch.from_numpy(rows.features(step)))), torch.from_numpy(rows.targets(step)))
        f_opt.zero_grad()
        g_opt.zero_grad()
        value.backward()
        f_opt.step()
        g_opt.step()
    for stage, model in (("f", f), ("g", g)):
        assert set(staged["params"][stage]) == {name for name, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            np.testing.assert_allclose(np.array(staged["params"][stage][name], np.float32), p.detach().numpy(),
                                       rtol=PARAM_RTOL, atol=PARAM_ATOL, err_msg=f"{stage}/{name}")
    np.testing.assert_allclose(staged["final_loss"], value.item(), rtol=1e-4)


def test_init_and_trace_params_name_the_module_parameters(tmp_path):
    exp = load_experiment(_experiment(tmp_path, f_optimizer='{ type = "sgd", lr = 0.05 }'))
    f = Stage.from_experiment(exp, "f", init={"inp.bias": 0.25, "g1.b": -1.0})
    assert isinstance(f, TorchStage) and isinstance(f.optimizer, torch.optim.SGD)
    assert np.all(f.params["inp.bias"] == np.float32(0.25))
    assert f.optimizer.param_groups[0]["lr"] == float(np.float32(0.05))     # "sgd": the numpy table's float32
    assert np.all(Stage.from_experiment(exp, "g", init={"inp.bias": 0.25, "g1.b": -1.0}).params["g1.b"] == -1)
    assert {"inp.weight", "out.bias", "g1.W"} <= exp.known_param_names({"inp.weight"})
    check_run_settings(exp, init={"inp.bias": 0.25})
    with pytest.raises(ConfigError, match=r"unknown parameters \['inpt.bias'\].*'inp.bias'"):
        check_run_settings(exp, init={"inpt.bias": 0.25})
    # The same seed gives the same initial values; the factory's draws do not move the caller's RNG.
    state = torch.random.get_rng_state()
    again = Stage.from_experiment(exp, "f")
    assert torch.equal(state, torch.random.get_rng_state())
    assert np.array_equal(again.params["inp.weight"], Stage.from_experiment(exp, "f").params["inp.weight"])


def test_the_model_next_to_each_file_comes_first_then_sys_path(tmp_path, monkeypatch):
    """Two folders, each with its own mymodel.py: each experiment gets the file next to it, however often
    they alternate in one process; a module not next to the file is imported from sys.path."""
    for folder in ("a", "b", "lib"):
        (tmp_path / folder).mkdir()
    first = load_experiment(_experiment(tmp_path / "a"))
    second_path = _experiment(tmp_path / "b")
    (tmp_path / "b" / "mymodel.py").write_text("from torch import nn\n\n\ndef encoder(hidden):\n"
                                               "    return nn.Linear(4, hidden)\n")
    second = load_experiment(second_path)
    for exp, names in ((first, ["inp.bias", "inp.weight", "out.bias", "out.weight"]), (second, ["bias", "weight"]),
                       (first, ["inp.bias", "inp.weight", "out.bias", "out.weight"])):
        assert sorted(Stage.from_experiment(exp, "f").params) == names
    (tmp_path / "lib" / "installed_model.py").write_text(MYMODEL)
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    elsewhere = load_experiment(_experiment(tmp_path / "b", f_module="installed_model:encoder", name="lib.toml"))
    stage = Stage.from_experiment(elsewhere, "f")
    assert type(stage.module).__module__ == "installed_model" and "inp.weight" in stage.params


HELPED_MODEL = """
from torch import nn

import helpers


def encoder(hidden):
    return nn.Linear(4, helpers.width(hidden))


def late_encoder(hidden):
    import late_helpers        # imported when the factory runs: found next to this file too
    return nn.Linear(4, late_helpers.WIDTH)
"""


def test_each_folder_s_module_imports_its_own_helpers_in_one_process(tmp_path):
    """Two folders, each with its mymodel.py importing its own helpers.py: built in one process (as
    --in-process, the launcher's check and the API do), each gets its own folder's helpers, however often
    they alternate (the second used to get the first's from sys.modules); a factory's own imports find its
    folder's files."""
    experiments = []
    for folder, width in (("a", "hidden"), ("b", "hidden * 2")):
        (tmp_path / folder).mkdir()
        path = _experiment(tmp_path / folder, f_module="mymodel:encoder", cut=8 if folder == "a" else 16,
                           g_stage=NUMPY_G.replace("in = 8", "in = 8" if folder == "a" else "in = 16"))
        (tmp_path / folder / "mymodel.py").write_text(HELPED_MODEL)
        (tmp_path / folder / "helpers.py").write_text(f"def width(hidden):\n    return {width}\n")
        (tmp_path / folder / "late_helpers.py").write_text(f"WIDTH = {8 if folder == 'a' else 16}\n")
        experiments.append(load_experiment(path))
    for exp, width in ((experiments[0], 8), (experiments[1], 16), (experiments[0], 8)):
        assert Stage.from_experiment(exp, "f").output_shape == (16, width)
    late = _experiment(tmp_path / "b", f_module="mymodel:late_encoder", cut=16, name="late.toml",
                       g_stage=NUMPY_G.replace("in = 8", "in = 16"))
    (tmp_path / "b" / "mymodel.py").write_text(HELPED_MODEL)
    assert Stage.from_experiment(load_experiment(late), "f").output_shape == (16, 16)
    summary = train_in_process(experiments[1], steps=2)
    assert np.array(summary["params"]["f"]["weight"]).shape == (16, 4)


# ---------------------------------------------------------------- clear errors

@pytest.mark.parametrize("change,needle", [
    ({"f_module": "nosuch:make"}, r"module 'nosuch:make'\): no module 'nosuch': put nosuch.py next to the file"),
    ({"f_module": "mymodel:nope"}, r"has no function 'nope'; its callables: .*encoder"),
    ({"f_module": "mymodel:boom"}, r"boom\(\*\*\{'hidden': 8\}\) raised RuntimeError: kaboom"),
    ({"f_module": "mymodel:not_a_module"}, r"not_a_module returned str, not a torch.nn.Module"),
    ({"cut": 9, "g_stage": NUMPY_G.replace("in = 8", "in = 9")},
     r"stage 'f' outputs shape \(16, 8\), but the interface says the activation it sends is \(16, 9\)"),
    ({"f_optimizer": '{ type = "Adamm", lr = 0.1 }'}, r"unknown optimizer 'Adamm': name a torch.optim class \(.*AdamW"),
    ({"f_optimizer": '{ type = "SGD", lr = 0.1, moment = 0.9 }'}, r"torch.optim.SGD rejects .*moment"),
    ({"f_optimizer": '{ type = "LBFGS" }'}, r"LBFGS re-evaluates the whole model through a closure"),
    ({"g_stage": 'module = "mymodel:head"\nloss = { type = "MSELoss", size = 3 }'},
     r"torch.nn.MSELoss\(\*\*\{'size': 3\}\) failed"),
    ({"f_optimizer": '{ type = "Adam", betas = [0.9] }'}, r"torch.optim.Adam rejects .*'betas': \(0.9,\)"),
    # accepted by the constructor, refused by torch at the first update: found when the stage is built
    ({"f_optimizer": '{ type = "SparseAdam" }'},
     r"torch.optim.SparseAdam with \{\} cannot update this stage's parameters: .*dense gradients"),
    ({"f_optimizer": '{ type = "Adam", differentiable = true }'},
     r"torch.optim.Adam with \{'differentiable': True\} cannot update this stage's parameters"),
    # a loss torch makes with these options but cannot compute on this output: found when built, not at step 1
    ({"g_stage": 'module = "mymodel:head"\nloss = { type = "CrossEntropyLoss", weight = [1.0, 2.0] }'},
     r"stage g: its loss cannot be computed on its output of shape \(16, 3\): weight tensor should be defined "
     r"either for all 3 classes"),
    ({"g_stage": 'module = "mymodel:head"\nloss = { type = "CrossEntropyLoss", label_smoothing = 1.5 }'},
     r"its loss cannot be computed on its output of shape \(16, 3\): label_smoothing must be between"),
], ids=["no-module", "no-factory", "factory-raises", "not-a-module", "cut-shape", "unknown-optimizer",
        "optimizer-arguments", "closure-optimizer", "loss-arguments", "optimizer-option-shape",
        "optimizer-for-sparse-gradients", "optimizer-step-fails", "loss-weight-per-class", "loss-option-range"])
def test_a_bad_module_stage_is_a_config_error_naming_it(tmp_path, change, needle):
    exp = load_experiment(_experiment(tmp_path, **change))
    with pytest.raises(ConfigError, match=needle):
        for name in exp.stage_names:
            Stage.from_experiment(exp, name)


RELU_FIRST = """
name = "relu-first"
steps = 6
[data]
{data}
batch = 16
[[stages]]
name = "f"
{f_stage}
[[stages]]
name = "g"
{g_stage}
"""


@pytest.mark.parametrize("f_stage", [
    'module = "torch.nn:ReLU"\noutput = [4]\noptimizer = { type = "SGD", lr = 0.1 }',
    'module = "torch.nn:ReLU"\noutput = [4]',                 # the default optimizer, distgrad's adam
    'model = [{ type = "relu" }]\nframework = "torch"',
], ids=["module-torch-optimizer", "module-default-optimizer", "torch-layers"])
def test_a_first_stage_with_nothing_to_train_runs_in_torch_as_in_numpy(tmp_path, f_stage):
    """A stage of activations alone trains nothing, in either framework (a torch one was refused by
    torch.optim's empty parameter list, or failed with a traceback); the stage below trains alike."""
    g_stage = NUMPY_G.replace("in = 8", "in = 4")
    runs = []
    for name, stage in (("torch", f_stage), ("numpy", 'model = [{ type = "relu" }]')):
        path = tmp_path / f"{name}.toml"
        path.write_text(RELU_FIRST.format(data=CLASSIFY, f_stage=stage, g_stage=g_stage))
        summary = train_in_process(load_experiment(path))
        runs.append((summary["params"], summary["final_loss"]))
    assert runs[0] == runs[1] and runs[0][0]["f"] == {} and set(runs[0][0]["g"]) == {"g1.W", "g1.b"}


@pytest.mark.parametrize("g_stage,loss_name", [
    (NUMPY_G.replace("out = 3", "out = 2"), "softmax_cross_entropy"),
    ('module = "mymodel:head"\nmodule_args = { outputs = 2 }\nloss = { type = "CrossEntropyLoss" }', "CrossEntropyLoss"),
    ('module = "mymodel:head"\nmodule_args = { outputs = 2 }\nloss = { type = "NLLLoss" }', "NLLLoss"),
], ids=["numpy", "module", "module-nll"])
def test_labels_beyond_the_last_stage_s_classes_are_refused_before_training(tmp_path, g_stage, loss_name):
    """Three classes of labels against two scores a row: refused when the stage is built, numpy or torch alike
    (it failed at the first step or evaluation whose batch held class 2)."""
    with pytest.raises(ConfigError, match=re.escape(
            f"the labels hold class ids 0..2, but the last stage 'g' outputs scores for 2 classes (shape (16, 2)), "
            f"so {loss_name} takes class ids 0..1")):
        exp = load_experiment(_experiment(tmp_path, g_stage=g_stage))
        Stage.from_experiment(exp, "g")
    ignoring = g_stage.replace('"CrossEntropyLoss" }', '"CrossEntropyLoss", ignore_index = 2 }')
    if ignoring != g_stage:       # class 2 is the ignored one: its rows count for nothing, and nothing is refused
        Stage.from_experiment(load_experiment(_experiment(tmp_path, g_stage=ignoring)), "g")


@pytest.mark.parametrize("loss,needle", [
    ('{ type = "CrossEntropyLos" }', r"unknown loss 'CrossEntropyLos': a torch module stage takes a torch.nn loss "
                                     r"class, one of \[.*'CrossEntropyLoss'"),
    ('{ type = "MSELoss", reduction = "none" }', r"'reduction' must be \"mean\" or \"sum\""),
])
def test_an_unknown_torch_loss_fails_when_the_file_loads(tmp_path, loss, needle):
    with pytest.raises(ConfigError, match=needle):
        load_experiment(_experiment(tmp_path, g_stage=f'module = "mymodel:head"\nloss = {loss}'))


def test_splitfed_averaging_refuses_a_module_first_stage(tmp_path):
    path = _experiment(tmp_path)
    path.write_text(path.read_text() + '\n[clients]\ncount = 2\nmode = "splitfed"\naverage_every = 2\n')
    with pytest.raises(ConfigError, match="SplitFed averaging takes a layer-list stage on the CPU; a module stage"):
        Stage.from_experiment(load_experiment(path), "f")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_is_a_config_error(tmp_path):
    exp = load_experiment(_experiment(tmp_path, device='device = "cuda"'))
    with pytest.raises(ConfigError, match=r"device 'cuda' asked for but no CUDA device is visible: "):
        Stage.from_experiment(exp, "f")


# ---------------------------------------------------------------- checkpoints hold the buffers

def test_a_checkpoint_holds_the_batch_norm_statistics_and_resumes_exactly(tmp_path):
    exp = load_experiment(_experiment(tmp_path, f_args=", norm = true", f_optimizer='{ type = "Adam", lr = 0.01 }'))
    data = exp.build_data()
    g = Stage.from_experiment(exp, "g")
    trained, fresh = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "f")
    assert set(trained.buffers) == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}

    def step(f, i, g=g):
        activation, cache = f.forward(data.features(i))
        _, dx, _ = train_last_step(g, activation, data.targets(i))
        f.apply(f.backward(cache, dx, need_dx=False)[1])

    for i in range(1, 4):
        step(trained, i)
    path = save_checkpoint(tmp_path / "ck", "f", "run", 3, exp.fingerprint, trained.state_arrays())
    arrays = load_checkpoint(path).arrays
    assert arrays["buffer/norm.num_batches_tracked"].dtype == np.int64
    assert int(arrays["buffer/norm.num_batches_tracked"]) == 3
    assert not np.array_equal(arrays["buffer/norm.running_mean"], fresh.buffers["norm.running_mean"].numpy())
    fresh.load_state_arrays(arrays, 3)
    g_resumed = Stage.from_experiment(exp, "g")
    g_resumed.load_state_arrays(g.state_arrays(), 3)
    for i in range(4, 8):
        step(trained, i)
        step(fresh, i, g_resumed)
    for name, value in trained.params.items():
        assert np.array_equal(fresh.params[name], value), name
    for name, buffer in trained.buffers.items():
        assert torch.equal(fresh.buffers[name], buffer), name
    without = {k: v for k, v in arrays.items() if not k.startswith("buffer/")}
    with pytest.raises(ValueError, match=r"checkpoint has buffers \[\], the module has \['norm.num_batches_tracked'"):
        Stage.from_experiment(exp, "f").load_state_arrays(without, 3)


# ---------------------------------------------------------------- CUDA

@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible: the GPU run is not tested here")
def test_a_module_stage_on_cuda_trains_as_on_the_cpu(tmp_path):
    adam = '{ type = "Adam", lr = 0.01 }'
    on_cpu = load_experiment(_experiment(tmp_path, steps=20, f_optimizer=adam, f_args=", norm = true"))
    on_gpu = load_experiment(_experiment(tmp_path, steps=20, f_optimizer=adam, f_args=", norm = true",
                                         device='device = "cuda"', name="gpu.toml"))
    f = Stage.from_experiment(on_gpu, "f")
    assert f.device.type == "cuda" and all(p.is_cuda for p in f.module.parameters())
    assert isinstance(f.params["inp.weight"], np.ndarray)                       # a host copy
    cpu, gpu = train_in_process(on_cpu), train_in_process(on_gpu)
    for name, value in cpu["params"]["f"].items():
        np.testing.assert_allclose(np.array(gpu["params"]["f"][name], np.float32), np.array(value, np.float32),
                                   rtol=CUDA_RTOL, atol=CUDA_ATOL, err_msg=name)
    np.testing.assert_allclose(gpu["final_loss"], cpu["final_loss"], rtol=CUDA_RTOL)
    arrays = f.state_arrays()
    assert all(isinstance(v, np.ndarray) for v in arrays.values())


# Four torch processes and two in-process runs: slow (CI runs the slow set too). Saving and loading a module's
# state_dict in a daemon stays in the default suite (test_a_mistyped_or_non_finite_state_dict_is_refused...).
@pytest.mark.slow
def test_save_writes_a_torch_state_dict_and_load_starts_from_it(tmp_path):
    """``--save``: a module stage's file is its ``state_dict`` (``torch.load`` reads it, weights only); a
    numpy stage's an npz. ``--load`` of both starts a later run, the same in one process or two."""
    path = _experiment(tmp_path, f_args=", norm = true")
    first = run_cli(["run", path, "--save", tmp_path / "halves", "--summary", tmp_path / "first.json"])
    assert first.returncode == 0, first.stderr
    state = torch.load(tmp_path / "halves" / "f.pt", weights_only=True)
    assert {"norm.running_mean", "norm.running_var", "inp.weight"} <= set(state)
    saved = read_json(tmp_path / "first.json")["params"]["f"]
    assert state["inp.weight"].numpy().tolist() == saved["inp.weight"]
    assert (tmp_path / "halves" / "g.npz").is_file()
    # The state_dict starts the stage, buffers included.
    stage = Stage.from_experiment(load_experiment(path), "f")
    stage.load_parameters(tmp_path / "halves" / "f.pt")
    assert stage.params["inp.weight"].tolist() == saved["inp.weight"]
    assert torch.equal(stage.module.state_dict()["norm.running_mean"], state["norm.running_mean"])
    # --load over processes equals --load in one process: the same parameters and buffers at the end.
    later = run_cli(["run", path, "--steps", "5", "--load", tmp_path / "halves", "--save", tmp_path / "procs",
                     "--summary", tmp_path / "later.json"])
    assert later.returncode == 0, later.stderr
    continued = train_in_process(load_experiment(path), steps=5, load_dir=tmp_path / "halves",
                                 save_dir=tmp_path / "in-process")
    assert read_json(tmp_path / "later.json")["params"] == continued["params"]
    over_processes, in_process = (torch.load(tmp_path / directory / "f.pt", weights_only=True)
                                  for directory in ("procs", "in-process"))
    assert over_processes.keys() == in_process.keys() == state.keys()
    assert all(torch.equal(over_processes[k], in_process[k]) for k in state)
    assert not torch.equal(over_processes["norm.running_mean"], state["norm.running_mean"])   # trained on
    with np.load(tmp_path / "procs" / "g.npz") as procs_g, np.load(tmp_path / "in-process" / "g.npz") as one_g:
        assert procs_g.files == one_g.files and all(np.array_equal(procs_g[k], one_g[k]) for k in one_g.files)
    fresh = train_in_process(load_experiment(path), steps=5)
    assert continued["params"]["f"] != fresh["params"]["f"]
    with pytest.raises(ConfigError, match="cannot read a torch state_dict"):
        stage.load_parameters(tmp_path / "halves" / "g.npz")
    torch.save({"inp.weight": torch.zeros(3)}, tmp_path / "wrong.pt")
    with pytest.raises(ConfigError, match="does not fit stage f"):
        stage.load_parameters(tmp_path / "wrong.pt")


@pytest.mark.parametrize("change, needle", [
    (lambda s: s["inp.weight"].fill_(float("inf")), "'inp.weight' holds values that are not finite"),
    # The other refusals take the same path through a torch process each: slow (the non-finite one stays).
    pytest.param(lambda s: s.__setitem__("inp.weight", s["inp.weight"].to(torch.complex64)),
                 "'inp.weight' is torch.complex64", marks=pytest.mark.slow),
    pytest.param(lambda s: s.__setitem__("inp.weight", s["inp.weight"].to(torch.float64)),
                 "'inp.weight' is torch.float64", marks=pytest.mark.slow),
    pytest.param(lambda s: s.__setitem__("norm.num_batches_tracked", s["norm.num_batches_tracked"].float()),
                 "'norm.num_batches_tracked' is torch.float32", marks=pytest.mark.slow),
])
def test_a_mistyped_or_non_finite_state_dict_is_refused_naming_file_and_entry(tmp_path, change, needle):
    """A damaged --load file, for torch stages: a state_dict entry of another dtype than the module's (nothing is
    cast) or with values that are not finite is refused, exit 2 before any stage starts, in process and
    over processes (the launcher builds the module and loads the file into it first)."""
    path = _experiment(tmp_path, f_args=", norm = true")
    stage = Stage.from_experiment(load_experiment(path), "f")
    stage.save_parameters(tmp_path / "good.pt")
    state = torch.load(tmp_path / "good.pt", weights_only=True)
    change(state)
    (tmp_path / "bad").mkdir()
    torch.save(state, tmp_path / "bad" / "f.pt")
    Stage.from_experiment(load_experiment(path), "g").save_parameters(tmp_path / "bad" / "g.npz")
    with pytest.raises(ConfigError, match=needle):
        stage.load_parameters(tmp_path / "bad" / "f.pt")
    # The launcher in this process (torch is imported here already; a launcher process would import it again):
    # it refuses the file before it starts any stage process.
    for where in (["--in-process"], []):
        result = run_launcher(["run", path, "--load", tmp_path / "bad", "--steps", "2", *where])
        assert result.returncode == 2, (where, result.stderr)
        assert str(tmp_path / "bad" / "f.pt") in result.stderr and needle.split("'")[1] in result.stderr, result.stderr
        assert "stage f failed" not in result.stderr and "started" not in result.stdout, result.stdout


def test_the_python_api_serves_and_drives_a_module_stage_bitwise():
    """serve_stage / drive_stage build a module stage from its experiment as the daemons do."""
    from distgrad.api import drive_stage, serve_stage
    with serve_stage("digits-cnn-torch", steps=4) as g:
        f = drive_stage("digits-cnn-torch", g.endpoint, steps=4)
        served = g.wait()
    reference = train_in_process(load_experiment("digits-cnn-torch"), steps=4)
    assert f["params"]["f"] == reference["params"]["f"] and served["params"]["g"] == reference["params"]["g"]
