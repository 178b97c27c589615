"""The cut as a library (distgrad.cut, distgrad.torch): a user's own loop on either side of the cut, against
a daemon or another user loop, over real processes and sockets; bitwise equal to the configured run of the
same model, resumed exactly after a kill -9 from the user's own checkpoint, and loud about misuse."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import DIGITS_NPZ, StageProcess, free_tcp_endpoint, read_json, wait_for_file  # noqa: E402
from distgrad.config.parse import load_experiment  # noqa: E402
from distgrad.errors import ConfigError, CutMisuse, PeerRejected, PeerTimeout, ProtocolError  # noqa: E402
from distgrad.run.inprocess import train_in_process  # noqa: E402

LOOPS = Path(__file__).resolve().parent / "cut_loops.py"
STEPS = 12

ENCODER = "from torch import nn\n\n\ndef make():\n    return nn.Sequential(nn.Linear(64, 16), nn.ReLU())\n"
HEAD = "from torch import nn\n\n\ndef make():\n    return nn.Sequential(nn.Linear(16, 10))\n"


def _interface(steps: int = STEPS, extra: str = "") -> str:
    return (f'[interface]\nname = "cut-test"\nstages = ["f", "g"]\nbatch = 32\n'
            f'activation = {{ shape = [16], dtype = "float32" }}\nsteps = {steps}\nseed = 0\nlabels = "last"\n'
            f'reduction = "mean"\n{extra}\n')


def _data(part: str) -> str:
    return f'[data]\nkind = "npy"\n{part}\nbatch = 32\ntest_fraction = 0.0\n'


F_DATA, G_DATA = _data('features = "pixels.npy"'), _data('labels = "digits.npy"')


def write_parties(folder: Path, steps: int = STEPS, extra: str = "") -> Path:
    """Both parties' files in one folder: the daemons' stage files (f.toml, g.toml: modules, optimiser,
    loss) and the library's (f-lib.toml, g-lib.toml: the same interface and data, [stage] names only)."""
    folder.mkdir(parents=True, exist_ok=True)
    digits = np.load(DIGITS_NPZ)
    np.save(folder / "pixels.npy", (digits["pixels"] / 16.0).astype(np.float32))
    np.save(folder / "digits.npy", digits["digit"].astype(np.int64))
    (folder / "encoder.py").write_text(ENCODER)
    (folder / "head.py").write_text(HEAD)
    iface = _interface(steps, extra)
    (folder / "f.toml").write_text(iface + '[stage]\nname = "f"\nmodule = "encoder:make"\n'
                                           'optimizer = { type = "Adam", lr = 0.003 }\n' + F_DATA)
    (folder / "g.toml").write_text(iface + '[stage]\nname = "g"\nmodule = "head:make"\n'
                                           'optimizer = { type = "Adam", lr = 0.003 }\n'
                                           'loss = { type = "CrossEntropyLoss" }\n' + G_DATA)
    (folder / "f-lib.toml").write_text(iface + '[stage]\nname = "f"\n' + F_DATA)
    (folder / "g-lib.toml").write_text(iface + '[stage]\nname = "g"\n' + G_DATA)
    return folder


def reference(folder: Path) -> dict:
    """The configured run of the same model, in one process."""
    return train_in_process(load_experiment([folder / "f.toml", folder / "g.toml"]))["params"]


def loop(folder: Path, side: str, target: Path | str, *flags: str, name: str | None = None) -> StageProcess:
    """A user loop of tests/cut_loops.py in its own process."""
    return StageProcess([LOOPS, side, folder, target, *flags], folder / f"{name or side}-loop.log",
                        command=[sys.executable])


def daemon(folder: Path, stage: str, *args: str) -> StageProcess:
    return StageProcess([stage, "--experiment", folder / f"{stage}.toml", "--summary", folder / f"{stage}.json",
                         *args], folder / f"{stage}-daemon.log")


def test_a_torch_loop_drives_a_label_owner_daemon_bitwise_as_the_configured_run(tmp_path):
    folder = write_parties(tmp_path / "p")
    ready = folder / "g.ready"
    with daemon(folder, "g", "--bind", "tcp://127.0.0.1:*", "--ready-file", ready) as g:
        endpoint = wait_for_file(ready, g)
        with loop(folder, "f", endpoint) as f:
            assert f.wait() == 0, f.output
        assert g.wait() == 0, g.output
    expected = reference(folder)
    assert json.loads((folder / "f-params.json").read_text()) == expected["f"]
    assert read_json(folder / "g.json")["params"]["g"] == expected["g"]


def test_a_data_owner_daemon_drives_a_torch_loop_bitwise_as_the_configured_run(tmp_path):
    folder = write_parties(tmp_path / "p")
    ready = folder / "g.ready"
    with loop(folder, "g", ready) as g:
        endpoint = wait_for_file(ready, g)
        with daemon(folder, "f", "--connect", endpoint) as f:
            assert f.wait() == 0, f.output
        assert g.wait() == 0, g.output
    expected = reference(folder)
    assert read_json(folder / "f.json")["params"]["f"] == expected["f"]
    result = json.loads((folder / "g-params.json").read_text())
    assert result["params"] == expected["g"]
    assert result["seen"] == list(range(1, STEPS + 1))


def _two_loops(folder: Path, f_flags: tuple = (), g_flags: tuple = (), restart: str = "") -> dict:
    """Run both user loops; ``restart`` names the side whose loop kills itself (its flags say when) and is
    started again, resuming from its own checkpoint. Returns both sides' results."""
    ready = folder / "g.ready"
    with loop(folder, "g", ready, *g_flags) as g:
        endpoint = wait_for_file(ready, g)
        with loop(folder, "f", endpoint, *f_flags) as f:
            if restart == "f":
                assert f.wait() == -9, f.output
                with loop(folder, "f", endpoint, name="f2") as f2:
                    assert f2.wait() == 0, f2.output
            elif restart == "g":
                assert g.wait() == -9, g.output
                with loop(folder, "g", ready, name="g2") as g2:
                    assert f.wait() == 0, f.output
                    assert g2.wait() == 0, g2.output
            else:
                assert f.wait() == 0, f.output
        if restart != "g":
            assert g.wait() == 0, g.output
    return {"f": json.loads((folder / "f-params.json").read_text()),
            "g": json.loads((folder / "g-params.json").read_text())}


@pytest.mark.slow
def test_two_torch_loops_train_bitwise_as_the_configured_run(tmp_path):
    folder = write_parties(tmp_path / "p")
    result = _two_loops(folder)
    expected = reference(folder)
    assert result["f"] == expected["f"] and result["g"]["params"] == expected["g"]
    assert result["g"]["seen"] == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.parametrize("side,flags", [("f", ("--die-after-reply", "5")), ("g", ("--die-before-send", "5"))],
                         ids=["data-owner-killed-after-its-reply-came", "label-owner-killed-before-its-reply-left"])
def test_a_loop_killed_9_resumes_from_its_own_checkpoint_with_no_step_lost_or_doubled(tmp_path, side, flags):
    """Step 5's reply is cached in the label owner's checkpoint: the data owner, resumed at step 4, sends
    step 5 again and gets that reply; the label owner's loop never computes a step twice."""
    folder = write_parties(tmp_path / "p")
    result = _two_loops(folder, **{f"{side}_flags": flags}, restart=side)
    expected = reference(folder)
    assert result["f"] == expected["f"] and result["g"]["params"] == expected["g"]
    assert result["g"]["seen"] == list(range(1, STEPS + 1))


def _numpy_reference(folder: Path) -> dict:
    """The numpy loops of cut_loops.py composed in one process: the same arithmetic with no wire."""
    from distgrad.run.cut_interface import FIRST, cut_side
    side = cut_side(FIRST, folder / "f-lib.toml", {})
    pixels, labels = np.load(folder / "pixels.npy"), np.load(folder / "digits.npy")
    w = np.random.default_rng(1).normal(0, 0.1, (64, 16)).astype(np.float32)
    v = np.random.default_rng(2).normal(0, 0.1, (16, 10)).astype(np.float32)
    losses = []
    for step in range(1, STEPS + 1):
        rows = side.rows(step)
        x = pixels[rows]
        h = x @ w
        z = h @ v
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        y = labels[rows]
        losses.append(float(-np.mean(np.log(p[np.arange(len(y)), y]))))
        dz = p.copy()
        dz[np.arange(len(y)), y] -= 1
        dz /= np.float32(len(y))
        dh = (dz @ v.T).astype(np.float32)
        v -= np.float32(0.1) * (h.T @ dz).astype(np.float32)
        w -= np.float32(0.1) * (x.T @ dh)
    return {"w": w.tolist(), "v": v.tolist(), "losses": losses}


def test_two_numpy_loops_compute_what_the_same_loops_compute_in_one_process(tmp_path):
    folder = write_parties(tmp_path / "p")
    result = _two_loops(folder, ("--numpy",), ("--numpy",))
    expected = _numpy_reference(folder)
    assert result["f"]["w"] == expected["w"]
    assert result["g"]["v"] == expected["v"] and result["g"]["losses"] == expected["losses"]
