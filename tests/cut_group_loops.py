"""The user loops tests/test_cut_group.py runs in their own processes: several data owners (vertical feature
parties, or clients in turn) and one label owner, each its own numpy or PyTorch loop through distgrad's cut
library, each checkpointing after every step.

    python cut_group_loops.py party FOLDER ENDPOINT INDEX [--die-after-reply K] [--up FILE] [--torch]
    python cut_group_loops.py client FOLDER ENDPOINT INDEX [--die-after-reply K] [--up FILE] [--torch]
    python cut_group_loops.py server FOLDER READY_FILE [--die-before-send K] [--liveness S] [--deadline S]
                                                       [--torch]

FOLDER holds the stage files (``p{i}.toml`` and ``g.toml`` for vertical parties, ``f.toml`` and ``g.toml``
for clients) and the data (``x{i}.npy``: party i's feature columns, ``x.npy``: every client's, ``y.npy``:
the labels). Each loop writes its checkpoint (``{name}.npz``: arrays and JSON, no pickle), how it ended (``{name}-outcome.json``:
``{"error": the exception's class or null, "message"}``) and its parameters (``{name}-params.json``);
a resumed loop starts from its checkpoint. ``--die-after-reply K``: a data owner kills itself (SIGKILL)
once step K's reply has arrived, before it applies or saves it; ``--die-before-send K``: the label owner
kills itself once step K is applied and saved, before its replies have left. ``--up FILE``: a data
owner writes FILE once it is about to say hello (so a test can start the label owner after it). The label
owner's
checkpoint holds the (step, client) of each step it computed (``seen``).

The models: a data owner's one linear layer to an embedding of ``WIDTH``, the label owner's linear
softmax head on the combined embedding; plain SGD (numpy) or ``torch.optim.SGD`` (PyTorch).
``reference`` computes the same in one process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

WIDTH = 8          # each data owner's embedding
CLASSES = 10
LR = np.float32(0.1)


def _save(obj: dict, path: Path) -> None:
    """A checkpoint of plain values and numpy arrays (a state_dict's): the arrays in an npz file, the rest as
    JSON in it; no pickle, and no torch import for the numpy loops."""
    arrays: dict[str, np.ndarray] = {}

    def plain(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            arrays[f"a{len(arrays)}"] = value
            return {"array": f"a{len(arrays) - 1}"}
        if isinstance(value, dict):
            return {"dict": [[k, plain(v)] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value.item() if isinstance(value, np.generic) else value

    tree = np.frombuffer(json.dumps(plain(obj)).encode(), np.uint8)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, tree=tree, **arrays)
    os.replace(tmp, path)           # a kill never leaves half a checkpoint


def _load(path: Path) -> dict | None:
    if not path.exists():
        return None
    with np.load(path) as saved:
        def value(node: Any) -> Any:
            if isinstance(node, dict) and "array" in node:
                return saved[node["array"]]
            if isinstance(node, dict):
                return {k: value(v) for k, v in node["dict"]}
            return [value(v) for v in node] if isinstance(node, list) else node
        return value(json.loads(saved["tree"].tobytes()))


def _outcome(folder: Path, name: str, run: Callable[[], None]) -> None:
    """``run()``, then how it ended written to FOLDER/{name}-outcome.json; an error is raised again."""
    path = folder / f"{name}-outcome.json"
    try:
        run()
    except BaseException as e:
        path.write_text(json.dumps({"error": type(e).__name__, "message": str(e)}))
        raise
    path.write_text(json.dumps({"error": None, "message": ""}))


def initial(columns: int, seed: int, out: int = WIDTH) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.1, (columns, out)).astype(np.float32)


def softmax_step(h: np.ndarray, y: np.ndarray, v: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """The label owner's numpy step: loss, d(loss)/dh and d(loss)/dv of a softmax head ``v`` on ``h``."""
    z = h @ v
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.mean(np.log(p[np.arange(len(y)), y])))
    dz = p.copy()
    dz[np.arange(len(y)), y] -= 1
    dz /= np.float32(len(y))
    return loss, (dz @ v.T).astype(np.float32), (h.T @ dz).astype(np.float32)


def _torch_module(columns: int, seed: int, out: int = WIDTH) -> Any:
    import torch
    torch.manual_seed(seed)
    return torch.nn.Linear(columns, out)


def _params(module: Any) -> dict:
    return {name: p.detach().numpy().tolist() for name, p in module.named_parameters()}


def data_owner(folder: Path, endpoint: str, index: int, kind: str, options: dict) -> None:
    """Party ``index``'s loop (``kind`` "party": its stage file p{index}.toml and columns x{index}.npy) or
    client ``index``'s (``kind`` "client": f.toml, x.npy, its shard of the rows)."""
    import distgrad.cut

    name = f"{'p' if kind == 'party' else 'c'}{index}"
    x = np.load(folder / (f"x{index}.npy" if kind == "party" else "x.npy"))
    torch_loop = "--torch" in options
    saved = _load(folder / f"{name}.npz")
    where = {"interface": folder / (f"{name}.toml" if kind == "party" else "f.toml"),
             **({"client": index} if kind == "client" else {}), "timeout_s": 1.0, "peer_deadline_s": 30.0}
    w = None
    if torch_loop:
        import torch

        import distgrad.torch
        encoder = _torch_module(x.shape[1], 10 + index)
        opt = torch.optim.SGD(encoder.parameters(), lr=float(LR))
        if saved is not None:
            encoder.load_state_dict({k: torch.from_numpy(v) for k, v in saved["model"].items()})
        cut: Any = distgrad.torch.Cut.connect(endpoint, state=saved and saved["cut"], **where)
    else:
        w = saved["w"] if saved is not None else initial(x.shape[1], 10 + index)
        cut = distgrad.cut.Cut.connect(endpoint, state=saved and saved["cut"], **where)

    def train() -> None:
        nonlocal w
        if "--up" in options:
            Path(options["--up"]).write_text("up")
        with cut:
            for step in range(cut.applied + 1, (cut.numpy if torch_loop else cut).exp.steps + 1):
                rows = cut.rows(step)
                if torch_loop:
                    cut.step(encoder(torch.from_numpy(x[rows.numpy()])), rows)
                else:
                    loss, dh = cut.step(x[rows] @ w, rows)
                if step == options.get("--die-after-reply") and saved is None:
                    os.kill(os.getpid(), signal.SIGKILL)
                if torch_loop:
                    opt.step()
                    opt.zero_grad()
                    _save({"model": {k: v.detach().numpy() for k, v in encoder.state_dict().items()},
                           "cut": cut.numpy.state_dict()}, folder / f"{name}.npz")
                else:
                    w = w - LR * (x[rows].T @ dh)
                    _save({"w": w, "cut": cut.state_dict()}, folder / f"{name}.npz")

    _outcome(folder, name, train)
    params = _params(encoder) if torch_loop else {"w": w.tolist()}
    (folder / f"{name}-params.json").write_text(json.dumps(params))


def label_owner(folder: Path, ready: Path, options: dict) -> None:
    import distgrad.cut

    y = np.load(folder / "y.npy")
    torch_loop = "--torch" in options
    v = None
    saved = _load(folder / "g.npz")
    seen = [] if saved is None else [list(map(int, s)) for s in saved["seen"]]
    endpoint = ready.read_text() if ready.exists() else "tcp://127.0.0.1:*"
    bounds = {"liveness_s": options.get("--liveness", 5.0), "peer_deadline_s": options.get("--deadline", 30.0)}
    if torch_loop:
        import torch

        import distgrad.torch
        server: Any = distgrad.torch.CutServer.bind(endpoint, interface=folder / "g.toml",
                                                    state=saved and saved["cut"], **bounds)
        head = _torch_module(server.numpy.side.shape[-1], 2, CLASSES)
        opt = torch.optim.SGD(head.parameters(), lr=float(LR))
        criterion = torch.nn.CrossEntropyLoss()
        if saved is not None:
            head.load_state_dict({k: torch.from_numpy(v) for k, v in saved["model"].items()})
    else:
        server = distgrad.cut.CutServer.bind(endpoint, interface=folder / "g.toml", state=saved and saved["cut"],
                                             **bounds)
        v = saved["v"] if saved is not None else initial(server.side.shape[-1], 2, CLASSES)

    def train() -> None:
        nonlocal v
        with server:
            tmp = ready.with_suffix(".tmp")
            tmp.write_text(server.endpoint)
            os.replace(tmp, ready)
            for batch in server:
                if torch_loop:
                    loss = criterion(head(batch.h), torch.from_numpy(y)[batch.rows])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    batch.reply(loss)
                    state = {"model": {k: t.detach().numpy() for k, t in head.state_dict().items()}}
                else:
                    loss, dh, dv = softmax_step(batch.h, y[batch.rows], v)
                    batch.reply(loss, dh)
                    v = v - LR * dv
                    state = {"v": v}
                seen.append([batch.step, -1 if batch.client is None else batch.client])
                _save({**state, "cut": server.numpy.state_dict() if torch_loop else server.state_dict(),
                       "seen": np.array(seen, np.int64)}, folder / "g.npz")
                if batch.step == options.get("--die-before-send") and saved is None:
                    os.kill(os.getpid(), signal.SIGKILL)

    _outcome(folder, "g", train)
    params = _params(head) if torch_loop else {"v": v.tolist()}
    (folder / "g-params.json").write_text(json.dumps({"params": params, "seen": seen}))


# -- the same computation in one process
def reference(folder: Path, kind: str, count: int, aggregate: str = "concat", torch_loop: bool = False) -> dict:
    """The loops above composed in one process with no wire: the parties' embeddings joined by hand
    (``aggregate``), or the clients in client order each step. Returns every side's parameters as the
    loops write them."""
    from distgrad.run.cut_interface import FIRST, cut_side

    y = np.load(folder / "y.npy")
    names = [f"p{i}" if kind == "party" else f"c{i}" for i in range(count)]
    if kind == "party":
        xs = [np.load(folder / f"x{i}.npy") for i in range(count)]
        sides = [cut_side(FIRST, folder / "p0.toml", {})] * count      # the parties share the rows
    else:
        xs = [np.load(folder / "x.npy")] * count
        sides = [cut_side(FIRST, folder / "f.toml", {}, client=c) for c in range(count)]
    steps = sides[0].exp.steps
    width = WIDTH * count if kind == "party" and aggregate == "concat" else WIDTH
    if torch_loop:
        return _torch_reference(xs, y, sides, names, kind, aggregate, width, steps)
    ws = [initial(x.shape[1], 10 + i) for i, x in enumerate(xs)]
    v = initial(width, 2, CLASSES)
    for step in range(1, steps + 1):
        if kind == "party":
            rows = sides[0].rows(step)
            hs = [x[rows] @ w for x, w in zip(xs, ws)]
            h = np.concatenate(hs, axis=1) if aggregate == "concat" else _added(hs, aggregate)
            _, dh, dv = softmax_step(h, y[rows], v)
            v = v - LR * dv
            for i in range(count):
                part = dh[:, i * WIDTH:(i + 1) * WIDTH] if aggregate == "concat" else (
                    dh / np.float32(count) if aggregate == "mean" else dh)
                ws[i] = ws[i] - LR * (xs[i][rows].T @ part)
        else:
            for c in range(count):
                rows = sides[c].rows(step)
                _, dh, dv = softmax_step(xs[c][rows] @ ws[c], y[rows], v)
                v = v - LR * dv
                ws[c] = ws[c] - LR * (xs[c][rows].T @ dh)
    return {**{name: {"w": w.tolist()} for name, w in zip(names, ws)}, "g": {"v": v.tolist()}}


def _added(hs: list[np.ndarray], aggregate: str) -> np.ndarray:
    total = hs[0]
    for h in hs[1:]:
        total = total + h
    return total / np.float32(len(hs)) if aggregate == "mean" else total


def _torch_reference(xs: list, y: np.ndarray, sides: list, names: list[str], kind: str, aggregate: str,
                     width: int, steps: int) -> dict:
    import torch
    encoders = [_torch_module(x.shape[1], 10 + i) for i, x in enumerate(xs)]
    head = _torch_module(width, 2, CLASSES)
    opts = [torch.optim.SGD(e.parameters(), lr=float(LR)) for e in encoders]
    head_opt = torch.optim.SGD(head.parameters(), lr=float(LR))
    criterion = torch.nn.CrossEntropyLoss()
    labels = torch.from_numpy(y)
    for step in range(1, steps + 1):
        turns = [list(range(len(xs)))] if kind == "party" else [[c] for c in range(len(xs))]
        for group in turns:
            rows = torch.from_numpy(sides[group[0]].rows(step))
            hs = [encoders[i](torch.from_numpy(xs[i])[rows]) for i in group]
            if len(hs) == 1:
                h = hs[0]
            elif aggregate == "concat":
                h = torch.cat(hs, dim=1)
            else:
                h = hs[0]
                for part in hs[1:]:
                    h = h + part
            loss = criterion(head(h), labels[rows])
            head_opt.zero_grad()
            loss.backward()
            head_opt.step()
            for i in group:
                opts[i].step()
                opts[i].zero_grad()
    return {**{name: _params(e) for name, e in zip(names, encoders)}, "g": _params(head)}


if __name__ == "__main__":
    role, where = sys.argv[1], Path(sys.argv[2])
    rest = sys.argv[3:]
    valued = {"--die-after-reply", "--die-before-send", "--liveness", "--deadline"}
    options: dict[str, Any] = {rest[i]: float(rest[i + 1]) if "." in rest[i + 1] else int(rest[i + 1])
                               for i in range(len(rest) - 1) if rest[i] in valued}
    options.update({rest[i]: rest[i + 1] for i in range(len(rest) - 1) if rest[i] == "--up"})
    valued.add("--up")
    options.update({flag: True for flag in rest if flag.startswith("--") and flag not in valued})
    if role == "server":
        label_owner(where, Path(rest[0]), options)
    else:
        data_owner(where, rest[0], int(rest[1]), role, options)
