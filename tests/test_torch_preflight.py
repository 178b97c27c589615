"""Configuration errors of torch stages exit 2 before any stage starts.

``distgrad run`` builds every torch stage in the launcher first (imports its
module, makes it, its optimizer, scheduler and loss, and checks its output
against the cut with a forward of zeros), as the numpy stages are built when
the file loads. (A bad ``distgrad predict --input`` exits 2 and tells the
label owner: tests/test_predict.py.) These are unit tests: the test guard
fails any of them that starts a process or opens a socket, which each did
before the check.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import run_main

pytest.importorskip("torch", reason="torch is not installed (pip install 'distgrad[torch]'); "
                                    "CI installs it and sets DISTGRAD_REQUIRE=torch")

DIGITS = Path(__file__).resolve().parents[1] / "distgrad" / "datasets" / "digits.npz"
MODEL = '''
from torch import nn


def make(out=16):
    return nn.Sequential(nn.Linear(64, out), nn.ReLU())


def boom():
    raise RuntimeError("kaboom")
'''
EXPERIMENT = f"""
name = "preflight"
steps = 5
[data]
kind = "npz"
path = "{DIGITS}"
features = "pixels"
labels = "digit"
batch = 16
[[stages]]
name = "f"
module = "{{module}}"
{{args}}
output = [16]
optimizer = {{{{ type = "Adam", lr = 0.01 }}}}
[[stages]]
name = "g"
model = [{{{{ type = "dense", name = "g1", in = 16, out = 10 }}}}]
optimizer = {{{{ type = "adam", lr = 0.01 }}}}
loss = "softmax_cross_entropy"
"""


def _experiment(directory: Path, module: str = "prefmodel:make", args: str = "") -> Path:
    (directory / "prefmodel.py").write_text(MODEL)
    path = directory / "preflight.toml"
    path.write_text(EXPERIMENT.format(module=module, args=args))
    return path


@pytest.mark.parametrize("module,args,needle", [
    ("nomodule:make", "", "no module 'nomodule': put nomodule.py next to the file that names it"),
    ("prefmodel:boom", "", "boom(**{}) raised RuntimeError: kaboom"),
    ("prefmodel:make", "module_args = { out = 7 }",
     "stage 'f' outputs shape (16, 7), but the interface says the activation it sends is (16, 16)"),
])
def test_a_bad_module_stage_exits_2_before_any_stage_starts(tmp_path, module, args, needle):
    result = run_main(["run", _experiment(tmp_path, module, args), "--steps", "2"])
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr
    out = result.stdout + result.stderr
    assert "[f]" not in out and "[g]" not in out, f"a stage was started:\n{out}"      # the launcher's prefixes


RAISES_ON_IMPORT = '''
import math

SIZE = math.sqrt(-1)
'''


@pytest.mark.parametrize("module,args,optimizer,needle", [
    ("prefmodel:boom", "", None, r"boom\(\*\*\{\}\) raised RuntimeError: kaboom \(at .*prefmodel.py line 10\)"),
    ("raising:make", "", None, r"importing 'raising' failed: ValueError: math domain error \(at .*raising.py line 4\)"),
    # raised inside torch: the line named is the user's that called it
    ("prefmodel:make", 'module_args = { out = "wide" }', None, r"raised TypeError: .*\(at .*prefmodel.py line 6\)$"),
    ("prefmodel:make", 'module_args = { width = 3 }', None, r"unexpected keyword argument 'width'$"),
    ("prefmodel:make", "module_args = { out = 7 }", None,
     r"outputs shape \(16, 7\), but the interface says the activation it sends is \(16, 16\)"),
    ("prefmodel:make", "", '{ type = "SparseAdam" }', r"torch.optim.SparseAdam with \{\} cannot update"),
    ("prefmodel:make", 'scheduler = { type = "StepLR", step_size = 0 }', None,
     r"scheduler 'StepLR' with \{'step_size': 0\} cannot be stepped: ZeroDivisionError"),
    ("prefmodel:make", 'scheduler = { type = "ExponentialLR", gamma = "half" }', None,
     r"scheduler 'ExponentialLR' with \{'gamma': 'half'\} cannot be stepped: TypeError"),
], ids=["factory-raises", "import-raises", "torch-raises", "factory-arguments", "cut-shape", "optimizer-step", "scheduler-step", "scheduler-option-type"])
def test_what_only_building_a_module_stage_finds_names_the_stage_file_and_the_line(tmp_path, module, args, optimizer,
                                                                                     needle):
    """The errors a module stage's build finds (its code raising, its output, an optimizer or scheduler torch
    accepts but cannot step) name the file that declared the stage, as the errors of reading it do, and the
    line of the user's code that raised; none is a traceback or a failure in the run."""
    path = _experiment(tmp_path, module, args)
    (tmp_path / "raising.py").write_text(RAISES_ON_IMPORT)
    if optimizer is not None:
        path.write_text(path.read_text().replace('{ type = "Adam", lr = 0.01 }', optimizer))
    result = run_main(["run", path, "--steps", "2"])
    assert result.returncode == 2, result.stderr
    assert re.search(f"ERROR distgrad: experiment {re.escape(str(path))}: stage 'f'.*{needle}", result.stderr, re.M), \
        result.stderr
    assert "Traceback" not in result.stderr
