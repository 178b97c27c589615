"""The user loops tests/test_cut.py runs in their own processes: a data owner's and a label owner's own
PyTorch (or numpy) training loop through distgrad's cut library, each checkpointing after every step.

    python cut_loops.py f FOLDER ENDPOINT [--die-after-reply K] [--numpy]
    python cut_loops.py g FOLDER READY_FILE [--die-before-send K] [--evaluate] [--numpy]

FOLDER holds the stage files (f-lib.toml, g-lib.toml), the data and the modules (encoder.py, head.py); each
loop writes its checkpoint (FOLDER/f.pt, g.pt) and, at the end, its parameters (f-params.json,
g-params.json). A resumed loop starts from its checkpoint. ``--die-after-reply K``: the data owner kills
itself (SIGKILL) once step K's reply has arrived, before it applies or saves it; ``--die-before-send K``:
the label owner kills itself once step K is applied and saved, before its reply has left. The label owner's
checkpoint holds the steps its loop computed (``seen``), so a test can tell whether a step was computed twice.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np


def _load(path: Path) -> dict | None:
    import torch
    return torch.load(path, weights_only=True) if path.exists() else None


def _save(obj: dict, path: Path) -> None:
    import torch
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _announce(ready: Path, endpoint: str) -> None:
    """Write the bound endpoint where the test waits for it, whole (never an empty file)."""
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(endpoint)
    os.replace(tmp, ready)


def _params(module) -> dict:
    return {name: p.detach().numpy().tolist() for name, p in module.named_parameters()}


def _build(folder: Path, name: str):
    """The module as the daemons build it: the factory after torch.manual_seed(the interface's seed)."""
    import torch
    sys.path.insert(0, str(folder))
    sys.modules.pop(name, None)             # another folder's module of that name, in a test process
    try:
        factory = __import__(name).make
    finally:
        sys.path.remove(str(folder))
    torch.manual_seed(0)
    return factory()


def data_owner(folder: Path, endpoint: str, die_after: int | None) -> None:
    import torch

    import distgrad.torch

    encoder = _build(folder, "encoder")
    opt = torch.optim.Adam(encoder.parameters(), lr=0.003)
    pixels = torch.from_numpy(np.load(folder / "pixels.npy"))
    saved = _load(folder / "f.pt")
    if saved is not None:
        encoder.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    with distgrad.torch.Cut.connect(endpoint, interface=folder / "f-lib.toml", timeout_s=1.0,
                                    peer_deadline_s=30.0, state=saved and saved["cut"]) as cut:
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(pixels, torch.arange(len(pixels))),
                                             batch_sampler=distgrad.torch.batch_sampler(cut))
        for x, rows in loader:
            h = encoder(x)
            cut.step(h, rows)
            if die_after is not None and cut.applied == die_after and saved is None:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            opt.zero_grad()
            _save({"model": encoder.state_dict(), "opt": opt.state_dict(), "cut": cut.state_dict()}, folder / "f.pt")
    (folder / "f-params.json").write_text(json.dumps(_params(encoder)))


def label_owner(folder: Path, ready: Path, die_before: int | None, evaluates: bool = False) -> None:
    import torch

    import distgrad.torch

    head = _build(folder, "head")
    opt = torch.optim.Adam(head.parameters(), lr=0.003)
    criterion = torch.nn.CrossEntropyLoss()
    labels = torch.from_numpy(np.load(folder / "digits.npy"))
    saved = _load(folder / "g.pt")
    seen = [] if saved is None else saved["seen"]
    if saved is not None:
        head.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    endpoint = ready.read_text() if ready.exists() else "tcp://127.0.0.1:*"

    def evaluate(h, rows):
        out = head(h)
        return criterion(out, labels[rows]), (out.argmax(dim=1) == labels[rows]).sum()

    with distgrad.torch.CutServer.bind(endpoint, interface=folder / "g-lib.toml", liveness_s=5.0,
                                       peer_deadline_s=30.0, state=saved and saved["cut"],
                                       evaluate=evaluate if evaluates else None) as server:
        _announce(ready, server.endpoint)
        for batch in server:
            loss = criterion(head(batch.h), labels[batch.rows])
            if batch.mb == 0:
                opt.zero_grad()
            loss.backward()                     # micro-batches: their gradients add up in p.grad, in order
            if batch.last:
                seen.append(batch.step)
                if batch.mbs > 1:
                    for p in head.parameters():
                        p.grad.mul_(server.scale)   # as the daemons scale the sum (1/M for a mean)
                opt.step()
            batch.reply(loss)
            if not batch.last:
                continue
            _save({"model": head.state_dict(), "opt": opt.state_dict(), "cut": server.state_dict(), "seen": seen},
                  folder / "g.pt")
            if die_before is not None and batch.step == die_before and saved is None:
                os.kill(os.getpid(), signal.SIGKILL)
    (folder / "g-params.json").write_text(json.dumps({"params": _params(head), "seen": seen}))


def _numpy_data_owner(folder: Path, endpoint: str) -> None:
    """A numpy loop: one linear layer and plain SGD, its own arithmetic."""
    from distgrad.cut import Cut

    pixels = np.load(folder / "pixels.npy")
    w = np.random.default_rng(1).normal(0, 0.1, (64, 16)).astype(np.float32)
    with Cut.connect(endpoint, interface=folder / "f-lib.toml", timeout_s=1.0, peer_deadline_s=30.0) as cut:
        for step in range(1, cut.exp.steps + 1):
            x = pixels[cut.rows(step)]
            loss, dh = cut.step(x @ w, cut.rows(step))
            w -= np.float32(0.1) * (x.T @ dh)
    (folder / "f-params.json").write_text(json.dumps({"w": w.tolist()}))


def _numpy_label_owner(folder: Path, ready: Path) -> None:
    """A numpy loop: a softmax layer on the activations, plain SGD."""
    from distgrad.cut import CutServer

    labels = np.load(folder / "digits.npy")
    v = np.random.default_rng(2).normal(0, 0.1, (16, 10)).astype(np.float32)
    losses = []
    with CutServer.bind("tcp://127.0.0.1:*", interface=folder / "g-lib.toml", liveness_s=5.0,
                        peer_deadline_s=30.0) as server:
        _announce(ready, server.endpoint)
        for batch in server:
            z = batch.h @ v
            p = np.exp(z - z.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            y = labels[batch.rows]
            loss = -np.mean(np.log(p[np.arange(len(y)), y]))
            dz = p.copy()
            dz[np.arange(len(y)), y] -= 1
            dz /= np.float32(len(y))
            batch.reply(float(loss), (dz @ v.T).astype(np.float32))
            v -= np.float32(0.1) * (batch.h.T @ dz).astype(np.float32)
            losses.append(float(loss))
    (folder / "g-params.json").write_text(json.dumps({"v": v.tolist(), "losses": losses}))


if __name__ == "__main__":
    side, where, target = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    flags = sys.argv[4:]
    numbered = {flags[i]: int(flags[i + 1]) for i in range(len(flags) - 1) if flags[i].startswith("--die")}
    if side == "f":
        (_numpy_data_owner(where, target) if "--numpy" in flags
         else data_owner(where, target, numbered.get("--die-after-reply")))
    else:
        (_numpy_label_owner(where, Path(target)) if "--numpy" in flags
         else label_owner(where, Path(target), numbered.get("--die-before-send"), "--evaluate" in flags))
