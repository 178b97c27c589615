"""The user loops tests/test_cut.py runs in their own processes: a data owner's and a label owner's own
PyTorch (or numpy) training loop through distgrad's cut library, each checkpointing after every step.

    python cut_loops.py f FOLDER ENDPOINT [--die-after-reply K] [--shuffle] [--numpy]
    python cut_loops.py g FOLDER READY_FILE [--die-before-send K] [--evaluate] [--numpy]
    python cut_loops.py f FOLDER ENDPOINT --numpy [--bad-shape-at K] [--close-at K] [--deadline S]
    python cut_loops.py g FOLDER READY_FILE --numpy [--leave-after-last] [--close-at K] [--forget-reply-at K]
                                                    [--liveness S] [--deadline S]

FOLDER holds the stage files (f-lib.toml, g-lib.toml), the data and the modules (encoder.py, head.py); each
loop writes its checkpoint (FOLDER/f.pt, g.pt) and, at the end, its parameters (f-params.json,
g-params.json). A resumed loop starts from its checkpoint. ``--die-after-reply K``: the data owner kills
itself (SIGKILL) once step K's reply has arrived, before it applies or saves it; ``--die-before-send K``:
the label owner kills itself once step K is applied and saved, before its reply has left. ``--shuffle``
(with ``send_rows``): the data owner's DataLoader takes its own shuffle of the rows (``own_order``), not the
shared order. The label owner's
checkpoint holds the steps its loop computed (``seen``), so a test can tell whether a step was computed twice.

The numpy loops end as a test asks: the data owner gives step K an activation of the wrong shape
(``--bad-shape-at``) or closes its cut after step K without ending the run (``--close-at``); the label
owner leaves its loop after replying to the run's last step, before the bye (``--leave-after-last``), or
after step K (``--close-at``), or forgets to reply to step K (``--forget-reply-at``). ``--liveness`` and
``--deadline`` bound their waits (seconds). Each writes how it ended to FOLDER/f-outcome.json or
g-outcome.json: ``{"error": the exception's class or null, "message", "steps": the steps applied}``.
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


def own_order(train_rows: np.ndarray, epoch: int) -> np.ndarray:
    """The data owner's own shuffle of its training rows for an epoch (with ``send_rows``): not the shared
    order the interface's seed gives."""
    return np.random.default_rng([7, epoch]).permutation(train_rows)


def own_batches(cut, train_rows: np.ndarray) -> list[list[int]]:
    """The rows of each step after the cut's applied ones, batched from ``own_order``."""
    batch, per_epoch = cut.exp.batch, len(train_rows) // cut.exp.batch
    steps = range(cut.applied, cut.exp.steps)
    return [own_order(train_rows, k // per_epoch)[(k % per_epoch) * batch:(k % per_epoch + 1) * batch].tolist()
            for k in steps]


def data_owner(folder: Path, endpoint: str, die_after: int | None, shuffle: bool = False,
               evaluates: bool = False, micro: int = 0) -> None:
    """The data owner's loop; ``micro`` M > 0: each step as its M micro-batches (``cut.step`` of a list),
    their parameter gradients added up by autograd and scaled by ``cut.scale``, as a daemon does."""
    import torch

    import distgrad.torch

    encoder = _build(folder, "encoder")
    opt = torch.optim.Adam(encoder.parameters(), lr=0.003)
    pixels = torch.from_numpy(np.load(folder / "pixels.npy"))
    saved = _load(folder / "f.pt")
    scores = []
    if saved is not None:
        encoder.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    with distgrad.torch.Cut.connect(endpoint, interface=folder / "f-lib.toml", timeout_s=1.0,
                                    peer_deadline_s=30.0, state=saved and saved["cut"]) as cut:
        sampler = (own_batches(cut.numpy, cut.numpy.side.data.train_rows) if shuffle
                   else distgrad.torch.batch_sampler(cut))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(pixels, torch.arange(len(pixels))),
                                             batch_sampler=sampler)
        for x, rows in loader:
            if micro:
                cut.step([encoder(part) for part in x.chunk(micro)], rows)
                for p in encoder.parameters():
                    p.grad.mul_(cut.scale)
            else:
                cut.step(encoder(x), rows)
            if die_after is not None and cut.applied == die_after and saved is None:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            opt.zero_grad()
            if evaluates and cut.evaluation_due:        # the held-out rows, scored by the label owner
                with torch.no_grad():
                    scores.append({"step": cut.applied, **cut.evaluate(encoder(pixels[cut.test_rows]))})
            _save({"model": encoder.state_dict(), "opt": opt.state_dict(), "cut": cut.state_dict()}, folder / "f.pt")
    (folder / "f-params.json").write_text(json.dumps(_params(encoder)))
    if evaluates:
        (folder / "f-evaluations.json").write_text(json.dumps(scores))


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


def _outcome(path: Path, run, progress) -> None:
    """``run()``, then how it ended written to ``path`` (``progress()``: the steps applied); an error is
    raised again after it is written."""
    try:
        run()
    except BaseException as e:
        path.write_text(json.dumps({"error": type(e).__name__, "message": str(e), "steps": progress()}))
        raise
    path.write_text(json.dumps({"error": None, "message": "", "steps": progress()}))


def _numpy_data_owner(folder: Path, endpoint: str, options: dict) -> None:
    """A numpy loop: one linear layer and plain SGD, its own arithmetic."""
    from distgrad.cut import Cut

    pixels = np.load(folder / "pixels.npy")
    w = np.random.default_rng(1).normal(0, 0.1, (64, 16)).astype(np.float32)
    cut = Cut.connect(endpoint, interface=folder / "f-lib.toml", timeout_s=1.0,
                      peer_deadline_s=options.get("--deadline", 30.0))

    def train() -> None:
        nonlocal w
        with cut:
            for step in range(1, cut.exp.steps + 1):
                x = pixels[cut.rows(step)]
                h = x @ w
                loss, dh = cut.step(h[:, :-1] if step == options.get("--bad-shape-at") else h, cut.rows(step))
                w -= np.float32(0.1) * (x.T @ dh)
                if step == options.get("--close-at"):
                    cut.close(finished=False)
                    return

    _outcome(folder / "f-outcome.json", train, lambda: cut.applied)
    (folder / "f-params.json").write_text(json.dumps({"w": w.tolist()}))


def _numpy_label_owner(folder: Path, ready: Path, options: dict) -> None:
    """A numpy loop: a softmax layer on the activations, plain SGD."""
    from distgrad.cut import CutServer

    labels = np.load(folder / "digits.npy")
    v = np.random.default_rng(2).normal(0, 0.1, (16, 10)).astype(np.float32)
    losses = []
    server = CutServer.bind("tcp://127.0.0.1:*", interface=folder / "g-lib.toml",
                            liveness_s=options.get("--liveness", 5.0), peer_deadline_s=options.get("--deadline", 30.0))
    leave_after = server.exp.steps if "--leave-after-last" in options else options.get("--close-at")

    def train() -> None:
        nonlocal v
        with server:
            _announce(ready, server.endpoint)
            for batch in server:
                if batch.step == options.get("--forget-reply-at"):
                    continue                    # the loop forgets batch.reply: the next batch is misuse
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
                if batch.step == leave_after:   # a loop that counts its steps and leaves
                    break

    _outcome(folder / "g-outcome.json", train, lambda: server.step)
    (folder / "g-params.json").write_text(json.dumps({"v": v.tolist(), "losses": losses}))


if __name__ == "__main__":
    side, where, target = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    flags = sys.argv[4:]
    valued = {"--die-after-reply", "--die-before-send", "--bad-shape-at", "--close-at", "--forget-reply-at",
              "--liveness", "--deadline"}
    numbered = {flags[i]: float(flags[i + 1]) if "." in flags[i + 1] else int(flags[i + 1])
                for i in range(len(flags) - 1) if flags[i] in valued}
    numbered.update({flag: True for flag in flags if flag.startswith("--") and flag not in valued})
    if side == "f":
        (_numpy_data_owner(where, target, numbered) if "--numpy" in flags
         else data_owner(where, target, numbered.get("--die-after-reply"), "--shuffle" in flags))
    else:
        (_numpy_label_owner(where, Path(target), numbered) if "--numpy" in flags
         else label_owner(where, Path(target), numbered.get("--die-before-send"), "--evaluate" in flags))
