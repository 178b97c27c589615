#!/usr/bin/env python
"""Bytes a step allocates, copies and checks per byte moved, on each side of a split: a count, not a timing.

    .venv/bin/python benchmarks/copies.py [--sizes BYTES,...] [--steps N] [--json PATH]

Runs the size group's two-stage identity model (``bench_sections.configs.trivial_toml``: an activation
of N bytes goes to the label owner, a gradient of N bytes comes back) as two real ``distgrad stage``
processes on tcp loopback. Each process runs with ``tracemalloc`` on (numpy reports its array buffers
to it) and with ``transport.send_frames`` wrapped: one send per step and side, so the interval between
two sends is one step. For each step it records

- ``peak``: the most bytes allocated at once during the step beyond what was held when the previous
  send returned (every full-size temporary alive at the same moment counts: a copy, a mask, an output),
- ``kept``: the growth of held bytes over the step (an allocation per step that is never freed),
- ``copied``: the bytes of received tensors copied out of their frames (``FrameLayout._aligned``, ``_received``:
  a frame libzmq hands out off alignment is copied into an aligned buffer before the compute reads it),
- ``checked``: the bytes checked for finiteness (``all_finite``: one pass over an array, received or about
  to be sent),
- ``python_calls``: the Python function calls the main thread made during the step (``sys.setprofile``),
- ``page_faults``: the minor page faults of the process during the step (``getrusage``), per MiB moved:
  memory mapped afresh and touched (glibc maps every allocation above 32 MiB anew, so an array of that
  size allocated every step costs 256 faults per MiB, where one reused costs none).

ZeroMQ's own buffers (libzmq's malloc) are not seen: a frame received with ``copy=False`` costs
nothing here, one received as ``bytes`` (a copy) does. The figures are deterministic for a given
code and numpy, so ``tests/test_benchmarks.py::test_copies`` asserts a bound on them. The reported
figure is the median over the steps after the first ``WARM_STEPS``, divided by the activation's bytes
(``--sizes 4`` gives the small step's call counts).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_sections.configs import trivial_toml  # noqa: E402
from bench_sections.wrapped_pair import bench_env, child_argv, run_wrapped_pair  # noqa: E402

SIZES = [256 << 10, 4 << 20, 64 << 20]
WARM_STEPS = 3                # the first steps allocate what later steps reuse


# The modules that call ``all_finite`` by that name (imported from distgrad.wire.messages).
FINITE_CHECKERS = ("distgrad.wire.messages", "distgrad.stage.stage", "distgrad.wire.wirecodec", "distgrad.wire.codecs")


def count_copies_and_checks(counts: dict[str, int]) -> None:
    """Wrap the receive path's copies and the finiteness checks so that ``counts`` adds up their bytes:
    ``copied`` and ``checked`` (see the module's docstring)."""
    import importlib

    import distgrad.wire.messages as messages
    all_finite, aligned, received = messages.all_finite, messages.FrameLayout._aligned, messages._received

    def counted_all_finite(array: Any) -> bool:
        counts["checked"] += array.nbytes
        return all_finite(array)

    def counted_aligned(self: Any, view: Any, *args: Any) -> Any:
        counts["copied"] += view.nbytes
        return aligned(self, view, *args)

    def counted_received(array: Any) -> Any:
        out = received(array)
        if out is not array:
            counts["copied"] += array.nbytes
        return out

    for name in FINITE_CHECKERS:
        setattr(importlib.import_module(name), "all_finite", counted_all_finite)
    messages.FrameLayout._aligned = counted_aligned  # type: ignore[method-assign]
    messages._received = counted_received  # type: ignore[assignment]


def child(out: Path, argv: list[str]) -> int:
    """Run ``distgrad stage ARGV`` with tracemalloc on and every send recorded; write the records to ``out``."""
    import distgrad.wire.transport as transport
    from distgrad.cli import main as cli_main

    counts = {"copied": 0, "checked": 0}
    count_copies_and_checks(counts)
    tracemalloc.start()
    records: list[tuple[int, ...]] = []
    held = [tracemalloc.get_traced_memory()[0]]
    calls = [0]
    faults = [resource.getrusage(resource.RUSAGE_SELF).ru_minflt]
    send = transport.send_frames

    def count_calls(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls[0] += 1

    def recorded_send(sock: Any, frames: Any, envelope: Any = ()) -> int:
        current, peak = tracemalloc.get_traced_memory()
        minflt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        records.append((peak - held[0], current - held[0], calls[0] - 1, minflt - faults[0],  # less this call
                        counts["copied"], counts["checked"]))
        sent = send(sock, frames, envelope)
        for key in counts:
            counts[key] = 0
        tracemalloc.reset_peak()
        held[0], calls[0] = tracemalloc.get_traced_memory()[0], 0
        faults[0] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        return sent

    transport.send_frames = recorded_send  # type: ignore[assignment]
    sys.setprofile(count_calls)               # the main thread's, where the step runs
    try:
        code = cli_main(["stage", *argv])
    finally:
        sys.setprofile(None)
        out.write_text(json.dumps(records))
    return code


def measure(size: int, steps: int, workdir: Path) -> dict[str, Any]:
    """One run of the identity split at ``size`` bytes; the per-step figures of each side."""
    exp = workdir / f"copies-{size}.toml"
    exp.write_text(trivial_toml(size))
    run_wrapped_pair(Path(__file__).resolve(), exp, steps, workdir, str(size), bench_env(ROOT))
    result: dict[str, Any] = {"bytes": size, "steps": steps}
    for side in "fg":
        records = json.loads((workdir / f"{side}-{size}.json").read_text())
        # f's first send is the hello and g's the welcome; then one forward (f) or backward (g) per step.
        big = records[1:][WARM_STEPS:WARM_STEPS + steps]
        if not big:
            raise RuntimeError(f"stage {side} recorded {len(records)} sends, too few for {steps} steps")
        result[side] = {"peak_per_byte": statistics.median(r[0] for r in big) / size,
                        "kept_per_byte": statistics.median(r[1] for r in big) / size,
                        "max_peak_per_byte": max(r[0] for r in big) / size, "steps_counted": len(big),
                        "python_calls": statistics.median(r[2] for r in big),
                        "page_faults_per_mib": statistics.median(r[3] for r in big) / (size / (1 << 20)),
                        "copied_per_byte": statistics.median(r[4] for r in big) / size,
                        "checked_per_byte": statistics.median(r[5] for r in big) / size}
    return result


def main() -> int:
    wrapped = child_argv(sys.argv)
    if wrapped is not None:
        return child(*wrapped)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="activation bytes, comma-separated")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="distgrad-copies-") as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            results.append(measure(size, args.steps, Path(tmp)))
    print("Per byte moved, each side: bytes allocated at the step's peak, kept; bytes copied out of frames, "
          "checked for finiteness; Python calls; page faults per MiB.")
    print("| activation | side | peak | kept | copied | checked | Python calls | page faults / MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        for side in "fg":
            x = r[side]
            print(f"| {r['bytes']} B | {side} | {x['peak_per_byte']:.2f} | {x['kept_per_byte']:.2f} | "
                  f"{x['copied_per_byte']:.2f} | {x['checked_per_byte']:.2f} | {x['python_calls']:.0f} | "
                  f"{x['page_faults_per_mib']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"sizes": results, "load": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
