#!/usr/bin/env python
"""How a distgrad step scales with the label owner's fan-in and with the activation size.

    .venv/bin/python benchmarks/scaling.py --json out.json --plot docs/scaling.png [--quick] [--groups vertical,logic]

Not part of the test suite. One run measures, over tcp on 127.0.0.1, with real
stage processes (``python -m distgrad.cli stage``) and the label owner ``g``
serving them all:

- **vertical**: K = 2, 4, 8, 16 feature parties (``p0`` .. ``p{K-1}``), each
  with the embedding of ``digits-halves`` (32 columns -> Dense 32->32 + ReLU,
  Adam), ``aggregate = "concat"``, g a Dense 32K->10 + softmax
  cross-entropy; batch 32 of synthetic rows;
- **logic**: the label owner's logic alone for the same K, in one process
  without sockets (``--logic-child``: each party's forward encoded, decoded
  and handled by ``ServingStage`` as ``serve`` does, the replies encoded):
  its CPU per step, free of the other processes' contention;
- **clients**: N = 1, 4, 16, 64 data owners (``[clients]``, ``mode =
  "separate"``; N = 1 is the plain two-stage run), each the f of
  ``digits-clients`` (Dense 64->64 + ReLU), g Dense 64->10; a step (round)
  takes one batch of 32 from every client in turn;
- **size**: the two-stage identity model of ``bench.py``'s message path
  (``bench_sections.configs.trivial_toml``), activations of 4 B .. 64 MiB and
  a gradient of the same size back, beside a bare pyzmq round trip of the
  same frames (``_peers.py raw``, the link's bytes/s).

For each: steps/s of g's steady state (its ``--metrics`` lines from the 10%
step to the last), the label owner's CPU seconds per step and every stage
process's (``/proc/PID/stat`` utime + stime, sampled every 10 ms against
the first driver's ``--progress lines``, read every 10 ms), and the bound: the smallest
fan-in's figure times the fan-in (vertical: K/2 x the 2-party figure;
clients: N x the one-client figure) and, for the size, one raw round trip
per step. Variants of a group are interleaved, ``--repeats`` times, medians
reported. Exit codes: 0 ok; 1 a measurement failed (the others are still
reported); 2 usage; 130 / 143 stopped by SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:          # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from bench_sections.common import (BLAS_OVERRIDES, KIB, MIB, SIZES, BenchError, Terminated, median,  # noqa: E402
                                   on_sigterm, ratio, say)
from bench_sections.configs import trivial_toml  # noqa: E402
from bench_sections.machine import machine_info, snapshot_distgrad  # noqa: E402
from bench_sections.procs import Proc  # noqa: E402
from bench_sections.runner import Runner, Variant, fmt_size  # noqa: E402
from distgrad.run.launcher import pinned_env  # noqa: E402

PARTIES, CLIENTS = [2, 4, 8, 16], [1, 4, 16, 64]
GROUPS = ("vertical", "logic", "clients", "size")
QUICK = {"parties": [2, 8], "clients": [1, 4], "sizes": [4, 256 * KIB, 4 * MIB]}
SMOKE = {"parties": [2], "clients": [2], "sizes": [4]}
EMBED = 32                       # digits-halves: each party turns 32 pixels into a 32-wide embedding
TICK_S = 0.01                    # how often the first driver's progress lines are read
STEADY_FROM = 0.1                # the steady window starts at this share of the steps
TARGET = (8, 2, 0.7)             # vertical: steps/s at 8 parties >= 0.7x the 2-party figure
CLK_TCK = os.sysconf("SC_CLK_TCK")
START_S = 180.0                  # every process of a group started and said hello (64 clients on 2 busy cores)
# Initial guesses of seconds per step; after a variant's first run its own figure sizes the next.
EST_S = {"vertical": lambda k: 6e-4 * k, "clients": lambda n: 1.5e-3 * n,
         "size": lambda b: {4: 6e-4, 4 * KIB: 6e-4, 256 * KIB: 2e-3, 4 * MIB: 1.5e-2, 64 * MIB: 0.35}[b]}


def vertical_toml(k: int) -> str:
    """K feature parties of digits-halves' size over synthetic rows of 32K features; g joins them (concat)."""
    lines = [f'name = "scale-vertical-{k}"', "steps = 100", "seed = 0", 'labels = "last"', 'aggregate = "concat"',
             "", "[data]", 'kind = "synthetic_classification"', "samples = 2048", f"features = {EMBED * k}",
             "classes = 10", "batch = 32", "spread = 2.0"]
    for i in range(k):
        lines += ["", "[[stages]]", f'name = "p{i}"', f"columns = {list(range(i * EMBED, (i + 1) * EMBED))}",
                  f'model = [{{ type = "dense", name = "p{i}d", in = {EMBED}, out = {EMBED} }}, {{ type = "relu" }}]',
                  'optimizer = { type = "adam", lr = 0.003 }']
    lines += ["", "[[stages]]", 'name = "g"', f'model = [{{ type = "dense", name = "g1", in = {EMBED * k}, out = 10 }}]',
              'optimizer = { type = "adam", lr = 0.003 }', 'loss = "softmax_cross_entropy"']
    return "\n".join(lines) + "\n"


def clients_toml(n: int) -> str:
    """digits-clients' model with N data owners (none: N = 1) over synthetic rows, 128 rows per client at least."""
    clients = f'\n[clients]\ncount = {n}\nmode = "separate"\n' if n > 1 else ""
    return f'''name = "scale-clients-{n}"
steps = 100
seed = 0
labels = "last"
{clients}
[data]
kind = "synthetic_classification"
samples = {max(2048, 128 * n)}
features = 64
classes = 10
batch = 32
spread = 2.0

[[stages]]
name = "f"
model = [{{ type = "dense", name = "f1", in = 64, out = 64 }}, {{ type = "relu" }}]
optimizer = {{ type = "adam", lr = 0.003 }}

[[stages]]
name = "g"
model = [{{ type = "dense", name = "g1", in = 64, out = 10 }}]
optimizer = {{ type = "adam", lr = 0.003 }}
loss = "softmax_cross_entropy"
'''


def _groups(text: str) -> list[str]:
    chosen = [g.strip() for g in text.split(",") if g.strip()]
    unknown = sorted(set(chosen) - set(GROUPS))
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown group(s) {', '.join(unknown) or '(none)'}; "
                                         f"choose from {','.join(GROUPS)}")
    return chosen


def cpu_s(pid: int) -> float | None:
    """utime + stime of ``pid`` (every thread), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def steady_rate(metrics: Path, steps: int) -> tuple[float, float] | None:
    """``(steps/s, seconds)`` of g's steps from the STEADY_FROM share to the last, from its ``--metrics`` lines
    (with several clients, a step is a round: its last line)."""
    at: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        at[record["step"]] = record["wall_s"]
    first = max(2, int(steps * STEADY_FROM))
    done = sorted(s for s in at if s >= first)
    if len(done) < 2:
        return None
    return (done[-1] - done[0]) / (at[done[-1]] - at[done[0]]), at[done[-1]] - at[done[0]]


def per_step(samples: list[tuple[float, int, float, float]], steps: int) -> tuple[float | None, float | None]:
    """CPU seconds per step of g and of every stage process, between the first sample at the STEADY_FROM share
    of the steps and the last before the end (``samples``: time, step, g's CPU, every process's CPU)."""
    first = max(2, int(steps * STEADY_FROM))
    window = [s for s in samples if first <= s[1] < steps]
    if len(window) < 2 or window[-1][1] <= window[0][1]:
        return None, None
    (_, s0, g0, a0), (_, s1, g1, a1) = window[0], window[-1]
    return (g1 - g0) / (s1 - s0), (a1 - a0) / (s1 - s0)


def group_run(runner: Runner, experiment: Path, drivers: list[list[str]], steps: int, expected_s: float) -> dict:
    """One run of g (bound on tcp) and a process per entry of ``drivers`` (a stage name and its flags): g's
    steady steps/s, its CPU per step and every process's. Every process is stopped in a ``finally``."""
    tag = f"{experiment.stem}-{steps}"
    ready, metrics = runner.workdir / f"{tag}.ready", runner.workdir / f"{tag}.g.jsonl"
    for path in (ready, metrics):
        path.unlink(missing_ok=True)
    stage = [sys.executable, "-m", "distgrad.cli", "stage"]
    common = ["--experiment", str(experiment), "--steps", str(steps), "--log-level", "WARNING", "--liveness", "60",
              "--peer-deadline", "120"]
    procs: list[Proc] = []
    deadline = time.monotonic() + START_S + 5 * expected_s
    try:
        g = runner.spawn(f"g-{tag}", [*stage, "g", *common, "--bind", "tcp://127.0.0.1:*", "--ready-file", str(ready),
                                      "--metrics", str(metrics)])
        procs.append(g)
        endpoint = runner.wait_ready(g, ready)
        for i, driver in enumerate(drivers):
            procs.append(runner.spawn(f"{driver[0]}{i}-{tag}", [*stage, *driver, *common, "--connect", endpoint,
                                                                "--timeout", "60", "--progress",
                                                                "lines" if i == 0 else "off"]))
        samples: list[tuple[float, int, float, float]] = []
        step, pending = 0, ""
        with open(procs[1].err_path, errors="replace") as progress:
            while any(p.proc.poll() is None for p in procs[1:]):
                if time.monotonic() > deadline:
                    raise BenchError(f"{tag} still running at its deadline\n{g.tail()}\n{procs[1].tail()}")
                *complete, pending = (pending + progress.read()).split("\n")     # whole lines only
                lines = [line for line in complete if line.startswith("progress {")]
                if lines:       # the CPU when a step is reported (every 0.1 s): 65 processes' /proc cost little
                    step = json.loads(lines[-1][len("progress "):])["step"]
                    cpus = [cpu_s(p.proc.pid) for p in procs]
                    if None not in cpus:
                        samples.append((time.monotonic(), step, cpus[0], sum(cpus)))
                time.sleep(TICK_S)
        for p in procs[1:]:
            if p.proc.returncode != 0:
                raise BenchError(f"{p.name} exited with code {p.proc.returncode}\n{p.tail()}\n{g.tail()}")
        code = g.wait(time.monotonic() + 30)
        if code != 0:
            raise BenchError(f"g exited with code {code}\n{g.tail()}")
        rate = steady_rate(metrics, steps)
        if rate is None:
            raise BenchError(f"{tag}: g wrote too few --metrics lines for a steady window ({steps} steps)")
        g_cpu, all_cpu = per_step(samples, steps)
    finally:
        for p in reversed(procs):
            p.stop()
        metrics.unlink(missing_ok=True)
    return {"steps": steps, "steady_s": rate[1], "t": 1 / rate[0], "g_cpu_s": g_cpu, "all_cpu_s": all_cpu,
            "processes": len(procs), "cpu_samples": len(samples)}


def measure_group(runner: Runner, name: str, keys: list[int], experiment: Any, drivers: Any,
                  min_steps: int) -> dict[str, Any]:
    """Interleave one variant per fan-in (or size) ``key``; the medians of steps/s and CPU per step."""
    variants = []
    for key in keys:
        exp = runner.write_experiment(f"scale-{name}-{key}", experiment(key))
        variants.append(Variant(str(key), lambda n, exp=exp, key=key: group_run(
            runner, exp, drivers(key), int(n), n * EST_S[name](key)), est_s=EST_S[name](key), min_steps=min_steps))
    runner.interleave(name, variants)
    out = {}
    for key, v in zip(keys, variants):
        t = v.t
        out[str(key)] = {"steps_per_s": 1 / t if t else None, "g_cpu_per_step_s": median(
            [s["g_cpu_s"] for s in v.samples if s["g_cpu_s"] is not None]), "all_cpu_per_step_s": median(
            [s["all_cpu_s"] for s in v.samples if s["all_cpu_s"] is not None]), "samples": v.samples,
            "failed": v.failed}
    return out


def logic_child(k: int, steps: int, experiment: Path) -> None:
    """``--logic-child``: the label owner's logic alone for K parties, no sockets and no other process (each
    party's forward encoded, then decoded and handled by ``ServingStage`` as ``serve`` does, the replies
    encoded); prints its CPU seconds per step."""
    import logging
    import numpy as np
    from distgrad.config.parse import load_experiment
    from distgrad.run.handshake import hello
    from distgrad.run.options import StageOptions
    from distgrad.run.serving import ServingStage, decode_and_handle
    from distgrad.wire import messages as wire
    log = logging.getLogger("scaling")
    exp = load_experiment(str(experiment))
    g = ServingStage(StageOptions(exp, "g", exp.seed, steps=steps))
    for i, name in enumerate(exp.stage_names[:-1]):
        g.handle([name.encode()], hello(exp, name, exp.seed, exp.cuts[i], name, [0], steps, 1), 0.0)
    rng = np.random.default_rng(0)
    embeddings = [rng.random(exp.cuts[i], dtype=np.float32) for i in range(k)]
    started = time.process_time()
    for step in range(1, steps + 1):
        for i, name in enumerate(exp.stage_names[:-1]):
            frames = wire.encode(wire.Message(wire.FORWARD, name, step, tensors={"activation": embeddings[i]}))
            _, replies, refused = decode_and_handle(frames, g.max_tensor_bytes,
                                                    lambda m, name=name: g.handle([name.encode()], m, 0.0), log)
            if refused:
                raise BenchError(f"the label owner refused a forward: {replies}")
            while replies:
                for _, reply in replies:
                    wire.encode(reply)
                replies = g.settle()
    print(json.dumps({"k": k, "steps": steps, "cpu_per_step_s": (time.process_time() - started) / steps}))


def measure_logic(runner: Runner, keys: list[int]) -> dict[str, Any]:
    """``logic_child`` for each K, interleaved and repeated: the label owner's CPU per step without sockets."""
    variants = []
    for k in keys:
        exp = runner.write_experiment(f"scale-vertical-{k}", vertical_toml(k))
        variants.append(Variant(str(k), lambda n, exp=exp, k=k: (lambda r: {**r, "t": r["cpu_per_step_s"]})(
            runner.run_json(f"logic-{k}", [sys.executable, str(Path(__file__).resolve()), "--logic-child", str(k),
                                           str(int(n)), str(exp)], 120)), est_s=1e-4 * k, min_steps=20))
    runner.interleave("logic", variants)
    base = variants[0].t
    return {v.key: {"cpu_per_step_s": v.t, "cpu_per_party_s": v.t / int(v.key) if v.t else None,
                    "bound_cpu_per_step_s": base * int(v.key) / keys[0] if base else None,
                    "samples": v.samples} for v in variants}


def with_bounds(rows: dict[str, Any], unit: int) -> None:
    """Each row's bound: the first row's figures times its fan-in over the first's (``unit``: that fan-in);
    ``share`` is the bound's time over the measured (1: as good as linear), ``cpu_over_bound`` the other way."""
    base = rows.get(str(unit), {})
    cores = len(os.sched_getaffinity(0))
    for key, row in rows.items():
        scale = int(key) / unit
        row["bound_steps_per_s"] = base["steps_per_s"] / scale if base.get("steps_per_s") else None
        row["bound_g_cpu_per_step_s"] = base["g_cpu_per_step_s"] * scale if base.get("g_cpu_per_step_s") else None
        row["share_of_bound"] = ratio(row["steps_per_s"], row["bound_steps_per_s"])
        row["g_cpu_over_bound"] = ratio(row["g_cpu_per_step_s"], row["bound_g_cpu_per_step_s"])
        # What the machine's cores allow at this CPU cost, every process busy all the time.
        row["cores_steps_per_s"] = cores / row["all_cpu_per_step_s"] if row.get("all_cpu_per_step_s") else None
        row["vs_first"] = ratio(row["steps_per_s"], base.get("steps_per_s"))



def measure_sizes(runner: Runner, results: dict[str, Any], sizes: list[int], min_steps: int) -> None:
    """The size group: the two-stage identity model per activation size, beside one raw round trip of it."""
    results["size"] = measure_group(runner, "size", sizes, trivial_toml, lambda b: [["f"]], min_steps)
    raw = [Variant(str(b), lambda s, b=b: runner.round_trip("raw", "tcp", b, s), timed=True) for b in sizes]
    # The floor: the same split written bare (_bare_identity.py), in the same minutes as the raw round trips.
    estimate = {b: max(2e-4, 2 * b / 5e8) for b in sizes}          # seconds per step, generous: 0.5 GB/s
    bare = [Variant(f"bare {b}", lambda n, b=b: runner.bare_identity("tcp", b, int(n), n * estimate[b]),
                    min_steps=min_steps, est_s=estimate[b]) for b in sizes]
    runner.interleave("raw and bare", [v for pair in zip(raw, bare) for v in pair])
    for v, floor in zip(raw, bare):
        row = results["size"][v.key]
        row["raw_rt_s"] = v.t
        row["bound_steps_per_s"] = 1 / v.t if v.t else None        # the link: 2 x size bytes per step
        row["share_of_bound"] = ratio(row["steps_per_s"], row["bound_steps_per_s"])
        row["bare_step_s"] = floor.t
        row["bare_share_of_bound"] = ratio(v.t, floor.t)
        if int(v.key) >= 256 * KIB:         # per byte only where the bytes, not the messages, cost
            row["g_cpu_per_mib_s"] = ratio(row["g_cpu_per_step_s"], 2 * int(v.key) / MIB)


def measure(args: argparse.Namespace, env: dict[str, str]) -> tuple[dict[str, Any], int]:
    """Snapshot distgrad, run the three groups in a work directory, stop every child."""
    started = time.monotonic()
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    sizes = {"smoke": SMOKE, "quick": QUICK}.get(mode, {"parties": PARTIES, "clients": CLIENTS, "sizes": SIZES})
    results: dict[str, Any] = {}
    code = 0
    with tempfile.TemporaryDirectory(prefix="distgrad-scaling-") as tmp_name:
        workdir = (args.workdir or Path(tmp_name)).resolve()
        (workdir / "src").mkdir(parents=True, exist_ok=True)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(workdir / "src"), env.get("PYTHONPATH")]))
        snapshot = snapshot_distgrad(workdir / "src", env)
        repeats = args.repeats or (1 if mode != "full" else 3)
        target_s = args.target_s or {"smoke": 0.05, "quick": 1.5, "full": 3.0}[mode]
        runner = Runner(workdir, workdir / "src", env, None, repeats, target_s)
        min_steps = 10 if args.smoke else 40
        try:
            results["meta"] = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
                               "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "mode": mode,
                               "repeats": repeats, "target_s": target_s, "distgrad_snapshot": snapshot,
                               "machine": machine_info(runner)}
            say(f"{mode} run: {repeats} repeat(s), ~{target_s:g} s per measurement")
            if "vertical" in args.groups:
                results["vertical"] = measure_group(runner, "vertical", sizes["parties"], vertical_toml,
                                                    lambda k: [[f"p{i}"] for i in range(k)], min_steps)
                with_bounds(results["vertical"], sizes["parties"][0])
            if "logic" in args.groups:
                results["logic"] = measure_logic(runner, sizes["parties"])
            if "clients" in args.groups:
                results["clients"] = measure_group(
                    runner, "clients", sizes["clients"], clients_toml,
                    lambda n: [["f", "--client", str(c)] for c in range(n)] if n > 1 else [["f"]], min_steps)
                with_bounds(results["clients"], sizes["clients"][0])
            if "size" in args.groups:
                measure_sizes(runner, results, sizes["sizes"], min_steps)
        except KeyboardInterrupt:
            code = 130
        except Terminated:
            code = 143
        finally:
            runner.stop_all()
        results["target"] = target(results)
        results["failures"] = runner.failures
        results["runtime_s"] = round(time.monotonic() - started, 1)
        results["meta"]["loadavg_end"] = os.getloadavg()
    return results, code or (1 if runner.failures else 0)


def target(results: dict[str, Any]) -> dict[str, Any]:
    k, base, wanted = TARGET
    rows = results.get("vertical", {})
    figure = ratio(rows.get(str(k), {}).get("steps_per_s"), rows.get(str(base), {}).get("steps_per_s"))
    return {"target": f"vertical, {k} parties: steps/s / the {base}-party figure", "figure": figure,
            "wanted": f">= {wanted}", "met": None if figure is None else figure >= wanted}


def _f(x: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def report(results: dict[str, Any], out: TextIO) -> None:
    """The tables (Markdown) of a run."""
    meta = results.get("meta", {})
    out.write(f"scaling run {meta.get('date_utc')} ({meta.get('mode')}, {meta.get('repeats')} repeat(s)); "
              f"load average {meta.get('machine', {}).get('loadavg_start')} -> {meta.get('loadavg_end')}\n\n")
    head = ("| {0} | steps/s | x first | bound steps/s | share of bound | g CPU ms/step | bound g CPU ms/step "
            "| g CPU / bound | all processes' CPU ms/step | cores allow steps/s |\n|" + "---|" * 10 + "\n")
    for group, title in (("vertical", "parties K"), ("clients", "data owners N")):
        out.write(head.format(title))
        for key, r in results.get(group, {}).items():
            out.write(f"| {key} | {_f(r['steps_per_s'])} | {_f(r.get('vs_first'), 1, 2)} | "
                      f"{_f(r.get('bound_steps_per_s'))} | {_f(r.get('share_of_bound'), 1, 2)} | "
                      f"{_f(r['g_cpu_per_step_s'], 1e3, 3)} | {_f(r.get('bound_g_cpu_per_step_s'), 1e3, 3)} | "
                      f"{_f(r.get('g_cpu_over_bound'), 1, 2)} | {_f(r['all_cpu_per_step_s'], 1e3, 3)} | "
                      f"{_f(r.get('cores_steps_per_s'))} |\n")
        out.write("\n")
    logic = results.get("logic", {})
    if logic:
        out.write("| parties K (the label owner's logic alone, no sockets) | CPU ms/step | per party us | "
                  "bound (linear) ms/step |\n|---|---|---|---|\n")
        for key, r in logic.items():
            out.write(f"| {key} | {_f(r['cpu_per_step_s'], 1e3, 3)} | {_f(r['cpu_per_party_s'], 1e6, 1)} | "
                      f"{_f(r['bound_cpu_per_step_s'], 1e3, 3)} |\n")
        out.write("\n")
    out.write("| activation | steps/s | raw round trip | bound steps/s (link) | share of bound | bare split's share "
              "(the floor) | g CPU ms/step | g CPU ms per MiB moved | all processes' CPU ms/step |\n|" + "---|" * 9
              + "\n")
    for key, r in results.get("size", {}).items():
        out.write(f"| {fmt_size(int(key))} | {_f(r['steps_per_s'], 1, 1)} | {_f(r.get('raw_rt_s'), 1e3, 3)} ms | "
                  f"{_f(r.get('bound_steps_per_s'), 1, 1)} | {_f(r.get('share_of_bound'), 1, 2)} | "
                  f"{_f(r.get('bare_share_of_bound'), 1, 2)} | "
                  f"{_f(r['g_cpu_per_step_s'], 1e3, 3)} | {_f(r.get('g_cpu_per_mib_s'), 1e3, 2)} | "
                  f"{_f(r['all_cpu_per_step_s'], 1e3, 3)} |\n")
    t = results.get("target", {})
    out.write(f"\n| target | figure | wanted | met |\n|---|---|---|---|\n| {t.get('target')} | "
              f"{_f(t.get('figure'), 1, 2)} | {t.get('wanted')} | {t.get('met')} |\n")


def plot(results: dict[str, Any], path: Path) -> None:
    """Steps/s (top) and the label owner's CPU per step (bottom) against the fan-in and the size, each beside
    its bound."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for col, (group, label) in enumerate((("vertical", "feature parties K"), ("clients", "data owners N"),
                                          ("size", "activation bytes"))):
        rows = results.get(group, {})
        xs = [int(k) for k in rows]
        for row, (key, bound, name) in enumerate((("steps_per_s", "bound_steps_per_s", "steps/s"),
                                                   ("g_cpu_per_step_s", "bound_g_cpu_per_step_s",
                                                    "label owner CPU s/step"))):
            ax = axes[row][col]
            values = [rows[str(x)].get(key) or float("nan") for x in xs]
            ax.plot(xs, values, "o-", label="measured")
            if any(rows[str(x)].get(bound) for x in xs):
                ax.plot(xs, [rows[str(x)].get(bound) or float("nan") for x in xs], "--",
                        label="bound (link)" if group == "size" else "bound (linear)")
            ax.set_xscale("log", base=2 if group != "size" else 10)
            if row == 0 and any(rows[str(x)].get("cores_steps_per_s") for x in xs):
                ax.plot(xs, [rows[str(x)].get("cores_steps_per_s") or float("nan") for x in xs], ":",
                        label="the cores, at the CPU all processes use")
            if any(v > 0 for v in values):       # a smoke run measures no CPU
                ax.set_yscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel(name)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("distgrad scaling (benchmarks/scaling.py)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="distgrad scaling: vertical parties, data owners, activation size.")
    p.add_argument("--json", type=Path, metavar="PATH", help="write every figure and sample here")
    p.add_argument("--plot", type=Path, metavar="PNG", help="draw the figures here (needs the plot extra)")
    p.add_argument("--quick", action="store_true", help="K = 2, 8; N = 1, 4; three sizes; one repeat")
    p.add_argument("--smoke", action="store_true", help="one tiny run per group, to check the script runs")
    p.add_argument("--repeats", type=int, help="repeats per variant (default 3; quick and smoke 1)")
    p.add_argument("--target-s", type=float, help="seconds of steps per measurement (default 3; quick 1.5)")
    p.add_argument("--workdir", type=Path, help="keep logs and generated experiments here")
    p.add_argument("--groups", type=_groups, default=list(GROUPS), metavar="G,G",
                   help=f"comma-separated subset of {','.join(GROUPS)} (default: all)")
    p.add_argument("--report", type=Path, metavar="JSON", help="measure nothing: print an earlier run's tables")
    p.add_argument("--logic-child", nargs=3, metavar=("K", "STEPS", "TOML"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.logic_child:
        logic_child(int(args.logic_child[0]), int(args.logic_child[1]), Path(args.logic_child[2]))
        return 0
    if args.report:
        results = json.loads(args.report.read_text())
        report(results, sys.stdout)
        if args.plot:
            plot(results, args.plot)
        return 0
    if args.smoke and args.quick:
        p.error("--smoke and --quick exclude each other")
    if (args.repeats is not None and args.repeats < 1) or (args.target_s is not None and not args.target_s > 0):
        p.error("--repeats must be >= 1 and --target-s > 0")
    signal.signal(signal.SIGTERM, on_sigterm)
    env = dict(os.environ)
    for name in BLAS_OVERRIDES:       # numpy's native kernel, as bench.py
        env.pop(name, None)
    try:
        results, code = measure(args, pinned_env(env))
    except BenchError as e:
        say(f"FAILED: {e}")
        return 1
    report(results, sys.stdout)
    for failure in results["failures"]:
        print(f"FAILED {failure['group']} {failure['variant']} (repeat {failure['repeat']}):\n{failure['error']}")
    print(f"\nscaling run took {results['runtime_s']:.0f} s; {len(results['failures'])} failed measurement(s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    if args.plot:
        plot(results, args.plot)
    return code


if __name__ == "__main__":
    sys.exit(main())
