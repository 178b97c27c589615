"""An optimizer is named as a PyTorch user writes it ("Adam", "SGD", "RMSprop") or in lower case, on a layer
list (numpy or framework "torch") as on a module; an unknown name is refused listing the accepted ones."""

from __future__ import annotations

import pytest

from distgrad.config.parse import load_experiment
from distgrad.errors import ConfigError
from distgrad.model.optim import SGD, Adam, build_optimizer
from distgrad.run.inprocess import train_in_process

torch = pytest.importorskip("torch")

LAYERS = """
name = "named-optimizer"
steps = 5
seed = 0
[data]
kind = "synthetic_regression"
samples = 256
features = 4
outputs = 1
hidden = 8
batch = 32
noise = 0.01
[[stages]]
name = "f"
framework = "{framework}"
model = [{{ type = "dense", name = "f1", in = 4, out = 8 }}, {{ type = "tanh" }}]
optimizer = {{ type = "{kind}", lr = 0.01 }}
[[stages]]
name = "g"
framework = "{framework}"
model = [{{ type = "dense", name = "g1", in = 8, out = 1 }}]
optimizer = {{ type = "{kind}", lr = 0.01 }}
loss = "mean_squared_error"
"""


def _layers(tmp_path, framework: str, kind: str):
    path = tmp_path / f"{framework}-{kind}.toml"
    path.write_text(LAYERS.format(framework=framework, kind=kind))
    return load_experiment(path)


@pytest.mark.parametrize("torch_name, ours, cls", [("Adam", "adam", Adam), ("SGD", "sgd", SGD)])
def test_torch_spellings_build_the_same_optimizer(torch_name, ours, cls):
    assert type(build_optimizer({"type": torch_name, "lr": 0.1})) is cls
    assert type(build_optimizer({"type": ours, "lr": 0.1})) is cls


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("torch_name, ours", [("Adam", "adam"), ("SGD", "sgd")])
def test_a_layer_list_trains_the_same_whichever_spelling(tmp_path, framework, torch_name, ours):
    spelled = train_in_process(_layers(tmp_path, framework, torch_name))
    lower = train_in_process(_layers(tmp_path, framework, ours))
    assert spelled["params"] == lower["params"]


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_an_unknown_name_on_a_layer_list_lists_the_accepted_ones(tmp_path, framework):
    with pytest.raises(ConfigError, match="unknown optimizer 'Adagrad': use one of adam, Adam, sgd, SGD"):
        _layers(tmp_path, framework, "Adagrad")


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("kind, cls", [("Adam", "Adam"), ("RMSprop", "RMSprop"), ("rmsprop", "RMSprop"),
                                       ("adamw", "AdamW"), ("SGD", "SGD"), ("sgd", "SGD"), ("adam", "Adam")])
def test_a_module_takes_torch_spellings_and_lower_case(kind, cls):
    from distgrad.stage.torch_stage import module_optimizer
    optimizer, _ = module_optimizer({"type": kind, "lr": 0.01}, _params(), "f")
    assert type(optimizer).__name__ == cls


def test_an_unknown_name_on_a_module_lists_the_accepted_ones():
    from distgrad.stage.torch_stage import module_optimizer
    with pytest.raises(ConfigError, match=r"unknown optimizer 'Adamm'.*RMSprop.*lower-case.*adam, sgd"):
        module_optimizer({"type": "Adamm"}, _params(), "f")
    with pytest.raises(ConfigError, match="re-evaluates the whole model"):
        module_optimizer({"type": "lbfgs"}, _params(), "f")


@pytest.mark.parametrize("kind", ["Adam", "RMSprop", "adamw"])
def test_a_module_optimizer_option_the_torch_class_does_not_take_lists_the_valid_ones(kind):
    from distgrad.stage.torch_stage import module_optimizer
    with pytest.raises(ConfigError, match=r"stage 'f': torch.optim.\w+ rejects .*unknown option\(s\) "
                                          r"\['learning_rate'\]; valid options: type, lr, .*schedule"):
        module_optimizer({"type": kind, "learning_rate": 0.01}, _params(), "f")


@pytest.mark.parametrize("option, value", [("lr", "0.01"), ("lr", True), ("weight_decay", "0")])
def test_a_module_optimizer_option_that_is_not_a_number_is_refused_naming_it(option, value):
    from distgrad.stage.torch_stage import module_optimizer
    with pytest.raises(ConfigError, match=f"torch.optim.Adam rejects .*option '{option}': .* is not a number"):
        module_optimizer({"type": "Adam", option: value}, _params(), "f")


def test_a_scheduler_option_the_torch_class_does_not_take_lists_the_valid_ones():
    from distgrad.stage.torch_stage import module_optimizer, stage_scheduler
    optimizer, _ = module_optimizer({"type": "Adam", "lr": 0.01}, _params(), "f")
    with pytest.raises(ConfigError, match=r"stage 'f': scheduler 'StepLR': .*StepLR rejects .*unknown option\(s\) "
                                          r"\['stepsize'\]; valid options: type, step_size, gamma"):
        stage_scheduler({"type": "StepLR", "stepsize": 10}, optimizer, "f")
    with pytest.raises(ConfigError, match="option 'gamma': '0.5' is not a number"):
        stage_scheduler({"type": "StepLR", "step_size": 10, "gamma": "0.5"}, optimizer, "f")


@pytest.mark.parametrize("kind, option, value", [("StepLR", "step_size", True), ("CosineAnnealingLR", "T_max", False)])
def test_a_boolean_for_a_required_scheduler_number_is_refused_naming_it(kind, option, value):
    """A required option has no default to compare with: torch took ``step_size = true`` as 1 (a decay every
    step) and trained."""
    from distgrad.stage.torch_stage import module_optimizer, stage_scheduler
    optimizer, _ = module_optimizer({"type": "Adam", "lr": 0.01}, _params(), "f")
    with pytest.raises(ConfigError, match=f"scheduler '{kind}': .*option '{option}': {value!r} is not a number"):
        stage_scheduler({"type": kind, option: value}, optimizer, "f")


def test_a_torch_loss_option_the_class_does_not_take_lists_the_valid_ones():
    from distgrad.model.losses import build_module_loss
    from distgrad.stage.torch_stage import _torch_loss
    for options, needle in [({"size": 3}, r"unknown option\(s\) \['size'\]; valid options: type, size_average, "
                                          r"reduce, reduction"),
                            ({"label_smoothing": "0.1"}, r"option 'label_smoothing': '0.1' is not a number")]:
        kind = "MSELoss" if "size" in options else "CrossEntropyLoss"
        loss = build_module_loss({"type": kind, **options})
        with pytest.raises(ConfigError, match=rf"stage g: torch.nn.{kind}\(.*\) failed: {needle}"):
            _torch_loss(loss, torch.device("cpu"), "g")
