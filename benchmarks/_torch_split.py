#!/usr/bin/env python
"""The mlp-classify split over torch.distributed (gloo, send/recv on 127.0.0.1), for benchmarks/bench.py.

Rank 0 (f) holds the data and Linear(784, HIDDEN) + ReLU, rank 1 (g) holds
Linear(HIDDEN, 10), the labels and the cross-entropy; each runs
torch.optim.Adam(lr=0.001). Per step f sends the activation, g replies with
its gradient after its own update, f backpropagates and updates: the same
lockstep as distgrad and the bare split. Run with an interpreter that has
torch (bench.py's ``--torch-python``); one thread per process.

    _torch_split.py RANK PORT BATCH HIDDEN STEPS   # rank 0 prints {"steps", "elapsed_s"}
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")      # loopback only

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _raw_split import CLASSES, FEATURES, make_data  # noqa: E402

WARMUP_STEPS = 2


def main(argv: list[str]) -> int:
    rank, port, batch, hidden, steps = (int(a) for a in argv)
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    x_np, y_np = make_data(batch)
    batches = len(y_np) // batch
    try:
        if rank == 0:
            x_all = torch.from_numpy(x_np)
            layer = torch.nn.Linear(FEATURES, hidden)
            opt = torch.optim.Adam(layer.parameters(), lr=0.001)
            grad = torch.empty(batch, hidden)

            def one_step(step: int) -> None:
                i = step % batches
                a = F.relu(layer(x_all[i * batch:(i + 1) * batch]))
                dist.send(a.detach(), dst=1)
                dist.recv(grad, src=1)
                a.backward(grad)
                opt.step()
                opt.zero_grad(set_to_none=True)

            for step in range(WARMUP_STEPS):
                one_step(step)
            started = time.perf_counter()
            for step in range(WARMUP_STEPS, WARMUP_STEPS + steps):
                one_step(step)
            elapsed = time.perf_counter() - started
            print(json.dumps({"steps": steps, "elapsed_s": elapsed, "torch": torch.__version__}), flush=True)
        else:
            y_all = torch.from_numpy(y_np)
            layer = torch.nn.Linear(hidden, CLASSES)
            opt = torch.optim.Adam(layer.parameters(), lr=0.001)
            buf = torch.empty(batch, hidden)
            for step in range(WARMUP_STEPS + steps):
                i = step % batches
                dist.recv(buf, src=0)
                a = buf.detach().requires_grad_(True)
                loss = F.cross_entropy(layer(a), y_all[i * batch:(i + 1) * batch])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                dist.send(a.grad, dst=0)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
