#!/usr/bin/env python
"""distgrad over an emulated WAN link: each schedule, codec and staleness against the bound the link allows.

    .venv/bin/python benchmarks/wan.py [--quick] [--json out.json] [--links wan10,lan1] [--no-accuracy]
                                       [--rows REGEX]
    .venv/bin/python benchmarks/wan.py --smoke            # seconds: two tiny configurations (the test suite)

Not part of the test suite (tests/test_benchmarks.py runs ``--smoke``). For
each link (``LINKS``: 10 ms / 100 Mbit/s and 1 ms / 1 Gbit/s, one way and per
direction) and each configuration, one run of mlp-classify at batch 256:

- the serving stage (``distgrad-stage g``) binds a free port on 127.0.0.1;
- a ``wan_link.LinkEmulator`` in this process listens on another free port and
  relays to it, shaping both directions (one-way delay, a rate cap; bytes in
  flight keep flowing);
- the driving stage (``distgrad-stage f``) connects through the link and
  writes a metrics line per step.

A run takes ``warm-up + S + measured + S`` steps (S the staleness; an auto
row takes ``AUTO_TAIL`` for S and reads the S it chose from the summary;
measured at least ``STEPS_PER_STALENESS`` x S);
steps/s and bytes per step are taken over the measured steps, which leave out
the S after the warm-up (the burst of S + 1 forwards a run starts with is
still crossing) and the last S (they send no forward: nothing is left to
send), from the driver's metrics
(``wall_s``, ``bytes_sent`` = down, ``bytes_received`` = up), and so are the
compute times the bound adds (``f_compute_s``, ``g_compute_s``). Every
process gets ``distgrad.run.launcher.pinned_env()`` (one BLAS thread), a
deadline, and is stopped in a ``finally``.

Each row's accuracy is the built-in ``digits`` experiment (batch 32, its 800
steps) trained with the row's codec, staleness and micro-batches in one
process (``digits_accuracy``): distgrad's runs over a link equal that bit for
bit, and the schedule and window change nothing, so each combination trains
once. The fastest row's flags also train digits through the link itself
(``accuracy``).

Configurations are flag sets. Schedule flags (``--micro-batches``,
``--schedule``, ``--in-flight``) go to the driving stage; codec
(``--activation-codec/--gradient-codec NAME``) flags to both stages, staleness
(``--staleness S``, 0 to 2 with every schedule, 4, 8 and 16 with lockstep and
gpipe M=4, and ``auto``) to the driving stage. A row whose flag this distgrad's
``distgrad-stage --help`` does not list is skipped with the reason printed,
so the same script measures it once the flag exists.

The bound of a configuration (seconds per step; its steps/s is the inverse),
with ``d`` the one-way delay, ``R`` the rate in bytes/s, ``D`` / ``U`` the
bytes down / up per step (measured), ``M`` micro-batches, ``W`` of them in
flight (1 lockstep, ``--in-flight`` for 1f1b, M for gpipe), ``c_f`` / ``c_g``
the driver's / serving stage's compute per step (measured) and ``S`` the
staleness:

    T_link(M, W): the step's last reply on the link model with zero compute
        (``link_time``): micro-batch i is sent at 0 (i < W) or when reply
        i - W arrives; it leaves the down serialiser at
        max(sent_i, leave_{i-1}) + D/(M R), reaches g after d, leaves the up
        serialiser at max(that, up_{i-1}) + U/(M R), reaches f after d.
        Lockstep: 2d + D/R + U/R. When W micro-batches cover the first
        reply's round trip (W D/(M R) >= 2d + (D + U)/(M R)) the down link
        never idles: 2d + D/R + U/(M R) (gpipe always). Otherwise it idles a
        round trip every W micro-batches: with D = U and s = D/(M R),
        ((M-1) mod W + 1) s + floor((M-1)/W) (2d + 2s) + 2d + s.
    T_sync = max(T_link(M, W) + (c_f + c_g) / M, c_f, c_g)
    T_bound = max(T_sync / (S + 1), D/R, U/R, c_f, c_g)

``(c_f + c_g) / M`` stands for the compute that cannot overlap the link: one
micro-batch's share (for lockstep, all of it). With staleness S, S + 1 steps
may be in flight, so each step's latency is shared by S + 1 steps, down to
the rate of the busier direction or the busier stage.

The link bound (``R / max(D, U)`` steps/s) and the compute bound
(``1 / max(c_f, c_g)``) are what no staleness can beat; "share of min" is a
row's steps/s over the smaller of the two. The target: the fastest
row whose digits accuracy is >= 95% reaches >= 90% of it.

Exit codes: 0 ok; 1 a measurement failed (the others are still reported);
2 usage; 130 / 143 stopped by SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (ROOT, HERE):                # run from a checkout without installing; wan_link sits beside us
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from distgrad.run.launcher import pinned_env, stop_process  # noqa: E402
from wan_link import LinkEmulator  # noqa: E402

BATCH = 256                              # mlp-classify's batch for the WAN figures
CODECS = ("none", "float16", "bfloat16", "int8", "topk:64")   # the same codec both ways (no +ef: not with staleness)
STALENESS = (0, 1, 2)                    # with every schedule
DEEP_STALENESS = (4, 8, 16)              # up to the link's bandwidth-delay product: with DEEP_SCHEDULES only
AUTO = "auto"                            # --staleness auto: the driver chooses S; the summary says which
AUTO_TAIL = 16                           # steps added to an auto row's run for the ones in flight at its end
# A stale row measures at least this many steps per step in flight: up to S replies may wait at the driver
# at one end of the window and not the other, which a short window counts as speed (a 40-step window at
# S = 16 read 118% of the link's rate).
STEPS_PER_STALENESS = 25
READY_TIMEOUT_S = 30.0                   # the serving stage must write its ready file within this
RUN_ALLOWANCE_S = 60.0                   # per run, on top of its expected time
REPLY_TIMEOUT_S = 30.0                   # the driver's --timeout: no resends for a slow link's steps
TICK_S = 0.05                            # polling interval while a run goes on
HELP_TIMEOUT_S = 30.0
ACCURACY_TARGET = 0.95                   # digits test accuracy of the best combination
SYNC_SHARE_TARGET = 0.90                 # the best synchronous schedule, as a share of its bound
SPEEDUP_TARGET = 5.0                     # the best combination against lockstep
FILL_TARGET = 0.90                       # the best accurate combination, as a share of min(link, compute) bound
ACCURACY_TIMEOUT_S = 120.0               # one in-process digits run


@dataclass(frozen=True)
class Link:
    """One emulated link: one-way ``delay_s`` and ``rate_bps`` (bits/s), the same both ways; ``steps``
    measured per configuration by default (``--quick``: a third)."""

    name: str
    delay_s: float
    rate_bps: float
    steps: int = 40

    @property
    def rate_Bps(self) -> float:
        return self.rate_bps / 8.0

    def describe(self) -> str:
        rate = f"{self.rate_bps / 1e9:g} Gbit/s" if self.rate_bps >= 1e9 else f"{self.rate_bps / 1e6:g} Mbit/s"
        return f"{self.delay_s * 1e3:g} ms / {rate}"


LINKS = {"wan10": Link("wan10", 0.010, 100e6, 40), "lan1": Link("lan1", 0.001, 1e9, 200)}
SMOKE_LINK = Link("smoke", 0.001, 200e6)


@dataclass(frozen=True)
class Schedule:
    """How one step's micro-batches cross: M of them, ``window`` in flight at once."""

    name: str
    micro_batches: int = 1
    schedule: str = "1f1b"
    in_flight: int | None = None         # 1f1b only; None: distgrad's default (two)

    @property
    def window(self) -> int:
        if self.schedule == "gpipe":
            return self.micro_batches
        return min(self.micro_batches, 2 if self.in_flight is None else self.in_flight)

    def flags(self, window: bool = True) -> list[str]:
        """The driving stage's flags; ``window`` False leaves out ``--in-flight`` (refused with steps in
        flight, which send every micro-batch of a step at once)."""
        if self.micro_batches == 1:
            return []
        flags = ["--micro-batches", str(self.micro_batches), "--schedule", self.schedule]
        return flags + (["--in-flight", str(self.in_flight)] if self.in_flight is not None and window else [])


LOCKSTEP = Schedule("lockstep")
SCHEDULES = (
    LOCKSTEP,
    Schedule("1f1b M=4", 4), Schedule("1f1b M=4 N=4", 4, in_flight=4),
    Schedule("1f1b M=8", 8), Schedule("1f1b M=8 N=4", 8, in_flight=4), Schedule("1f1b M=8 N=8", 8, in_flight=8),
    Schedule("gpipe M=4", 4, "gpipe"), Schedule("gpipe M=8", 8, "gpipe"),
)
# With steps in flight every micro-batch of a step leaves at once, so the schedule's window no longer
# matters: the deep rows take lockstep and the fastest pipelined schedule of the shallow ones.
DEEP_SCHEDULES = tuple(s for s in SCHEDULES if s.name in ("lockstep", "gpipe M=4"))


@dataclass(frozen=True)
class Config:
    """One row: a schedule, a codec (both directions) and a staleness."""

    schedule: Schedule
    codec: str = "none"
    staleness: int | str = 0             # S, or AUTO (the driver chooses; ``chosen`` reads it from a summary)

    @property
    def label(self) -> str:
        parts = [self.schedule.name]
        if self.codec != "none":
            parts.append(self.codec)
        if self.staleness:
            parts.append(f"stale {self.staleness}")
        return ", ".join(parts)

    def chosen(self, staleness: int) -> "Config":
        """This row with the staleness a run of it used (``--staleness auto``: the one it chose)."""
        return Config(self.schedule, self.codec, staleness)

    @property
    def synchronous(self) -> bool:
        return self.codec == "none" and self.staleness == 0

    def driver_flags(self) -> list[str]:
        """Flags only the driving stage takes (the serving stage follows its hello): schedule, staleness."""
        if not self.staleness:
            return self.schedule.flags()
        return self.schedule.flags(window=False) + ["--staleness", str(self.staleness)]

    def shared_flags(self) -> list[str]:
        """Flags both stages take: the codecs (part of the interface the handshake compares)."""
        return ["--activation-codec", self.codec, "--gradient-codec", self.codec] if self.codec != "none" else []

    def missing(self, known: set[str]) -> list[str]:
        """The flags of this row that the installed distgrad-stage does not know."""
        wanted = [f for f in self.driver_flags() + self.shared_flags() if f.startswith("--")]
        return sorted({f for f in wanted if f not in known})


def grid(full: bool) -> list[Config]:
    """Every row of one link: all schedules plain, then every codec x staleness combination with the
    schedules that matter for it (``full``: all of them; else lockstep, 1f1b M=8 N=4 and gpipe M=8), the
    deep staleness (``DEEP_STALENESS``) with ``DEEP_SCHEDULES`` (not ``full``: uncoded and int8 only), and
    ``--staleness auto`` with those for the uncoded and the int8 rows."""
    rows = [Config(s) for s in SCHEDULES]
    combined = SCHEDULES if full else tuple(s for s in SCHEDULES if s.name in ("lockstep", "1f1b M=8 N=4",
                                                                               "gpipe M=8"))
    for codec in CODECS:
        for staleness in STALENESS:
            if codec == "none" and staleness == 0:
                continue
            rows += [Config(s, codec, staleness) for s in combined]
        for staleness in DEEP_STALENESS if full or codec in ("none", "int8") else ():
            rows += [Config(s, codec, staleness) for s in DEEP_SCHEDULES]
    for codec in ("none", "int8"):
        rows += [Config(s, codec, AUTO) for s in DEEP_SCHEDULES]
    return rows


# ---------------------------------------------------------------- the bound

def link_time(micro_batches: int, window: int, down_bytes: float, up_bytes: float, delay_s: float,
              rate_Bps: float) -> float:
    """Seconds from a step's first send to its last reply on the link model, with zero compute.

    Micro-batch i is sent at 0 (i < window) or when reply i - window arrives;
    each direction is one serialiser of ``rate_Bps`` then ``delay_s``
    (``wan_link``'s pipe model).
    """
    s_down, s_up = down_bytes / micro_batches / rate_Bps, up_bytes / micro_batches / rate_Bps
    down_free = up_free = 0.0
    arrive: list[float] = []
    for i in range(micro_batches):
        sent = 0.0 if i < window else arrive[i - window]
        down_free = max(sent, down_free) + s_down
        up_free = max(down_free + delay_s, up_free) + s_up
        arrive.append(up_free + delay_s)
    return arrive[-1]


def bound_s(config: Config, link: Link, down_bytes: float, up_bytes: float, f_compute_s: float,
            g_compute_s: float) -> dict[str, float]:
    """The bound of ``config`` (a whole staleness) on ``link`` (module docstring), seconds per step, and its
    terms: ``rate_s`` the link bound (the busier direction's bytes at the rate), ``compute_s`` the compute
    bound (the busier stage), neither of which any staleness can beat."""
    m = config.schedule.micro_batches
    w = m if config.staleness else config.schedule.window   # steps in flight send all their micro-batches
    t_link = link_time(m, w, down_bytes, up_bytes, link.delay_s, link.rate_Bps)
    t_sync = max(t_link + (f_compute_s + g_compute_s) / m, f_compute_s, g_compute_s)
    rate, compute = max(down_bytes, up_bytes) / link.rate_Bps, max(f_compute_s, g_compute_s)
    return {"bound_s": max(t_sync / (int(config.staleness) + 1), rate, compute),
            "link_s": t_link, "sync_s": t_sync, "rate_s": rate, "compute_s": compute}


# ---------------------------------------------------------------- runs

class BenchError(RuntimeError):
    """A run failed: a stage exited non-zero, missed its deadline or wrote no metrics."""


class _Terminated(BaseException):
    """Raised by the SIGTERM handler: unwinds through every ``finally``, which stops the children."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated


def say(text: str) -> None:
    print(f"[wan {time.strftime('%H:%M:%S')}] {text}", flush=True)


def stage_argv(stage: str, experiment: str, steps: int, flags: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "distgrad.cli", "stage", stage, "--experiment", experiment, "--steps", str(steps),
            *flags]


def known_flags() -> set[str]:
    """Every ``--flag`` the installed ``distgrad-stage --help`` lists."""
    out = subprocess.run([sys.executable, "-m", "distgrad.cli", "stage", "--help"], capture_output=True, text=True,
                         timeout=HELP_TIMEOUT_S, env=pinned_env(), stdin=subprocess.DEVNULL, cwd=ROOT)
    if out.returncode != 0:
        raise BenchError(f"distgrad-stage --help exited {out.returncode}: {out.stderr[-500:]}")
    return set(re.findall(r"--[a-z][a-z0-9-]*", out.stdout))


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(f"    {line}" for line in text[-lines:])


def _wait_ready(proc: subprocess.Popen, ready: Path, log: Path) -> int:
    """The port the serving stage bound, from its ready file; ``BenchError`` if it exits or is late."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (ready.exists() and ready.read_text().strip()):
        if proc.poll() is not None:
            raise BenchError(f"g exited with code {proc.returncode} before it was ready\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise BenchError(f"g did not bind within {READY_TIMEOUT_S:g} s\n{_tail(log)}")
        time.sleep(TICK_S)
    return int(ready.read_text().strip().rsplit(":", 1)[1])


def run_pair(experiment: str, steps: int, link: Link, driver_flags: Sequence[str], shared_flags: Sequence[str],
             workdir: Path, tag: str, expected_s: float) -> dict[str, Any]:
    """One run of g and f with the link between them: the driver's metrics lines and summary, and the
    link's byte counts."""
    ready, metrics, summary = (workdir / f"{tag}.{suffix}" for suffix in ("ready", "metrics.jsonl", "f.json"))
    logs = {name: workdir / f"{tag}.{name}.log" for name in ("f", "g")}
    for stale in (ready, metrics, summary):
        stale.unlink(missing_ok=True)
    env = pinned_env()
    procs: list[subprocess.Popen] = []
    files = []
    link_stats: dict[str, int] = {}
    try:
        def spawn(name: str, argv: list[str]) -> subprocess.Popen:
            out = open(logs[name], "w")
            files.append(out)
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    cwd=ROOT)
            procs.append(proc)
            return proc

        g = spawn("g", stage_argv("g", experiment, steps, ["--bind", "tcp://127.0.0.1:*", "--ready-file", str(ready),
                                                           "--log-level", "WARNING", *shared_flags]))
        g_port = _wait_ready(g, ready, logs["g"])
        with LinkEmulator(0, g_port, delay_s=link.delay_s, rate_bps=link.rate_bps) as emulator:
            f = spawn("f", stage_argv("f", experiment, steps, [
                "--connect", f"tcp://127.0.0.1:{emulator.port}", "--metrics", str(metrics), "--summary", str(summary),
                "--timeout", str(REPLY_TIMEOUT_S), "--progress", "off", "--log-level", "WARNING",
                *driver_flags, *shared_flags]))
            deadline = time.monotonic() + RUN_ALLOWANCE_S + 3 * expected_s
            for proc, name in ((f, "f"), (g, "g")):
                while proc.poll() is None:
                    if time.monotonic() > deadline:
                        raise BenchError(f"{name} still running at its deadline\n{_tail(logs[name])}")
                    time.sleep(TICK_S)
                if proc.returncode != 0:
                    raise BenchError(f"{name} exited with code {proc.returncode}\n{_tail(logs[name])}")
            link_stats = emulator.stats()
    finally:
        for proc in procs:
            stop_process(proc)
        for out in files:
            out.close()
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if len(lines) != steps:
        raise BenchError(f"{len(lines)} metrics lines for {steps} steps\n{_tail(logs['f'])}")
    return {"metrics": lines, "summary": json.loads(summary.read_text()), "link": link_stats}


def measure(config: Config, link: Link, experiment: str, warmup: int, steps: int, workdir: Path,
            expected_s: float) -> dict[str, Any]:
    """One configuration: steps/s, bytes per step each way, compute per step and the bound, over the
    ``steps`` after ``warmup``; with ``--staleness auto``, the bound of the S the run chose (its summary's
    ``staleness``)."""
    tag = re.sub(r"[^A-Za-z0-9]+", "-", f"{link.name}-{config.label}")
    extra = AUTO_TAIL if config.staleness == AUTO else config.staleness
    steps = max(steps, STEPS_PER_STALENESS * extra)
    total = warmup + extra + steps + extra
    run = run_pair(experiment, total, link, config.driver_flags(), config.shared_flags(), workdir, tag,
                   expected_s)
    staleness = run["summary"].get("staleness", config.staleness)
    if not isinstance(staleness, int):
        raise BenchError(f"{config.label}: the summary does not say which staleness the run used")
    # Not measured: the first S steps after the warm-up, while the burst of S + 1 forwards a run starts with
    # drains through the link, and the last S, which send no forward (nothing is left to send).
    start = warmup + staleness
    first, lines = run["metrics"][start - 1], run["metrics"][start:total - staleness]
    steps = len(lines)
    if steps < 1:
        raise BenchError(f"{config.label}: staleness {staleness} leaves no steps to measure of {total}")
    last = lines[-1]
    step_s = (last["wall_s"] - first["wall_s"]) / steps
    down = (last["bytes_sent"] - first["bytes_sent"]) / steps
    up = (last["bytes_received"] - first["bytes_received"]) / steps
    f_compute = sum(line["f_compute_s"] for line in lines) / steps
    g_compute = sum(line["g_compute_s"] for line in lines) / steps
    bound = bound_s(config.chosen(staleness), link, down, up, f_compute, g_compute)
    return {"steps_per_s": 1.0 / step_s, "step_s": step_s, "steps": steps, "bytes_down": down, "bytes_up": up,
            "f_compute_s": f_compute, "g_compute_s": g_compute, **bound, "staleness": staleness,
            "bound_steps_per_s": 1.0 / bound["bound_s"], "share": bound["bound_s"] / step_s,
            "link_bound_steps_per_s": 1.0 / bound["rate_s"], "compute_bound_steps_per_s": 1.0 / bound["compute_s"],
            "fill": max(bound["rate_s"], bound["compute_s"]) / step_s,
            "staleness_auto": run["summary"].get("staleness_auto"),
            "final_loss": run["summary"].get("final_loss"), "link_bytes": run["link"]}


def accuracy(config: Config, link: Link, steps: int | None, workdir: Path) -> dict[str, Any]:
    """The built-in ``digits`` experiment trained with ``config``'s flags through ``link``: its held-out accuracy."""
    from distgrad.config.parse import load_experiment

    total = steps or load_experiment("digits").steps
    run = run_pair("digits", total, link, config.driver_flags(), config.shared_flags(), workdir,
                   re.sub(r"[^A-Za-z0-9]+", "-", f"digits-{link.name}-{config.label}"), expected_s=total * 0.1)
    summary = run["summary"]
    return {"config": config.label, "steps": total, "test_accuracy": summary.get("test_accuracy"),
            "test_loss": summary.get("test_loss"), "elapsed_s": summary.get("elapsed_s"),
            "staleness": summary.get("staleness")}


def digits_accuracy(config: Config, steps: int | None, workdir: Path, cache: dict[tuple, float]) -> float:
    """The held-out accuracy of the built-in ``digits`` experiment (``steps``, default its own) trained with
    ``config``'s codec, staleness (a whole one) and micro-batches, in one process.

    A run through the link computes the same parameters bit for bit (distgrad's contract; ``accuracy`` checks
    it for the fastest row), and the schedule and window change nothing, so each (codec, staleness,
    micro-batches) is trained once (``cache``).
    """
    key = (config.codec, config.staleness, config.schedule.micro_batches, steps)
    if key not in cache:
        summary = workdir / f"digits-{'-'.join(re.sub(r'[^A-Za-z0-9]+', '', str(k)) for k in key)}.json"
        argv = [sys.executable, "-m", "distgrad.cli", "run", "digits", "--in-process", "--summary", str(summary),
                "--staleness", str(config.staleness), "--micro-batches", str(config.schedule.micro_batches),
                *config.shared_flags(), *(["--steps", str(steps)] if steps else [])]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=ACCURACY_TIMEOUT_S, env=pinned_env(),
                             stdin=subprocess.DEVNULL, cwd=ROOT)
        if out.returncode != 0:
            raise BenchError(f"digits in process exited {out.returncode}: {out.stderr[-500:]}")
        cache[key] = json.loads(summary.read_text())["test_accuracy"]
    return cache[key]


def mlp_experiment(workdir: Path, batch: int) -> Path:
    """mlp-classify with batches of ``batch`` rows, as a file both stages read."""
    import distgrad

    text = (Path(distgrad.__file__).parent / "experiments" / "mlp-classify.toml").read_text()
    if "\nbatch = 32\n" not in text:
        raise BenchError("mlp-classify.toml no longer says 'batch = 32': update wan.py's copy of it")
    path = workdir / f"mlp-classify-b{batch}.toml"
    path.write_text(text.replace('name = "mlp-classify"', f'name = "mlp-classify-b{batch}"')
                    .replace("\nbatch = 32\n", f"\nbatch = {batch}\n"))
    return path


# ---------------------------------------------------------------- report

def fmt_bytes(n: float) -> str:
    return f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n:.0f} B"


def table(link: Link, rows: list[dict[str, Any]], markdown: bool = True) -> str:
    """The rows of one link: steps/s, x lockstep, bytes per step each way, bound and share, the link and
    compute bounds and the share of the smaller, and the row's digits accuracy."""
    lock = next((r["result"]["steps_per_s"] for r in rows if r["label"] == "lockstep" and "result" in r), None)
    head = ["configuration", "steps/s", "x lockstep", "down/step", "up/step", "bound steps/s", "share of bound",
            "link bound", "compute bound", "share of min", "digits acc"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        r = row.get("result")
        if r is None:
            lines.append(f"| {row['label']} | {row.get('skipped') or 'failed: ' + row.get('error', '?')[:60]} |"
                         + " |" * (len(head) - 2))
            continue
        label = row["label"] + (f" (S={r['staleness']})" if row["staleness"] == AUTO else "")
        speedup = f"{r['steps_per_s'] / lock:.2f}x" if lock else "-"
        acc = row.get("digits_accuracy")
        lines.append(f"| {label} | {r['steps_per_s']:.1f} | {speedup} | {fmt_bytes(r['bytes_down'])} | "
                     f"{fmt_bytes(r['bytes_up'])} | {r['bound_steps_per_s']:.1f} | {100 * r['share']:.0f}% | "
                     f"{r['link_bound_steps_per_s']:.0f} | {r['compute_bound_steps_per_s']:.0f} | "
                     f"{100 * r['fill']:.0f}% | {'-' if acc is None else f'{acc:.3f}'} |")
    return f"{link.name}: {link.describe()}\n\n" + "\n".join(lines)


def targets(rows: list[dict[str, Any]], accuracy_result: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The targets on the 10 ms / 100 Mbit/s link, from one run's rows."""
    done = [row for row in rows if "result" in row]
    lock = next((row["result"]["steps_per_s"] for row in done if row["label"] == "lockstep"), None)
    sync = [row for row in done if row["synchronous"]]
    out = []
    if sync:
        best = max(sync, key=lambda row: row["result"]["steps_per_s"])
        share = best["result"]["share"]
        out.append({"target": f"best synchronous schedule >= {SYNC_SHARE_TARGET:.0%} of its bound",
                    "config": best["label"], "figure": share, "unit": "%", "met": share >= SYNC_SHARE_TARGET})
    if done and lock:
        best = max(done, key=lambda row: row["result"]["steps_per_s"])
        speedup = best["result"]["steps_per_s"] / lock
        out.append({"target": f"best combination >= {SPEEDUP_TARGET:g}x lockstep steps/s", "config": best["label"],
                    "figure": speedup, "unit": "x", "met": speedup >= SPEEDUP_TARGET})
        acc = accuracy_result.get("test_accuracy") if accuracy_result else None
        out.append({"target": f"its digits accuracy >= {ACCURACY_TARGET:.0%}", "config": best["label"],
                    "figure": acc, "unit": "%", "met": None if acc is None else acc >= ACCURACY_TARGET})
    accurate = [row for row in done if (row.get("digits_accuracy") or 0.0) >= ACCURACY_TARGET]
    if accurate:
        best = max(accurate, key=lambda row: row["result"]["steps_per_s"])
        r = best["result"]
        out.append({"target": f"best combination with digits accuracy >= {ACCURACY_TARGET:.0%} >= "
                              f"{FILL_TARGET:.0%} of min(link bound, compute bound)",
                    "config": f"{best['label']} ({r['steps_per_s']:.1f} steps/s; link bound "
                              f"{r['link_bound_steps_per_s']:.0f}, compute bound {r['compute_bound_steps_per_s']:.0f};"
                              f" digits {best['digits_accuracy']:.3f})",
                    "figure": r["fill"], "unit": "%", "met": r["fill"] >= FILL_TARGET})
    return out


# ---------------------------------------------------------------- main

def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="fewer steps, and the codec x staleness combinations only with lockstep, 1f1b M=8 N=4 "
                        "and gpipe M=8 (staleness 4, 8, 16 only uncoded and int8)")
    p.add_argument("--smoke", action="store_true",
                   help="seconds: a tiny model (batch 32) on a 1 ms link, two configurations and a codec row")
    p.add_argument("--links", default="wan10,lan1", help=f"comma-separated, of {', '.join(LINKS)}")
    p.add_argument("--warmup", type=int, help="steps before the measured ones (default 5, quick 3)")
    p.add_argument("--steps", type=int,
                   help="measured steps per configuration (default: wan10 40, lan1 200; --quick a third)")
    p.add_argument("--no-accuracy", action="store_true",
                   help="skip the digits runs: each row's (in one process) and the best combination's (through "
                        "the link)")
    p.add_argument("--accuracy-steps", type=int, help="steps of those digits runs (default: the experiment's)")
    p.add_argument("--rows", type=re.compile, metavar="REGEX",
                   help="only the configurations whose label this matches (re.search), e.g. 'int8, stale'")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--workdir", type=Path, help="keep the runs' files here (default: a temporary directory)")
    args = p.parse_args(argv)
    for name in args.links.split(","):
        if name not in LINKS:
            p.error(f"unknown link {name!r}: use {', '.join(LINKS)}")
    for name in ("warmup", "steps", "accuracy_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return args


def run_link(link: Link, configs: list[Config], known: set[str], experiment: str, warmup: int, steps: int,
             workdir: Path, accuracy_steps: int | None, accuracies: dict[tuple, float] | None) -> list[dict[str, Any]]:
    """Every configuration on ``link``, and (``accuracies``: their cache, None for none) each one's digits
    accuracy (``digits_accuracy``)."""
    rows = []
    reported: set[str] = set()
    for config in configs:
        row: dict[str, Any] = {"label": config.label, "synchronous": config.synchronous,
                               "micro_batches": config.schedule.micro_batches, "window": config.schedule.window,
                               "codec": config.codec, "staleness": config.staleness}
        missing = config.missing(known)
        if missing:
            row["skipped"] = f"skipped: distgrad-stage has no {' '.join(missing)}"
            if tuple(missing) not in reported:
                reported.add(tuple(missing))
                say(f"{link.name}: rows with {' '.join(missing)} skipped (this distgrad-stage --help does not "
                    f"list it; the rows run once it does)")
            rows.append(row)
            continue
        deepest = max(DEEP_STALENESS)
        expected = (warmup + max(steps, STEPS_PER_STALENESS * deepest) + 2 * deepest) * 0.2
        try:
            row["result"] = r = measure(config, link, experiment, warmup, steps, workdir, expected)
            if accuracies is not None:
                try:
                    row["digits_accuracy"] = digits_accuracy(config.chosen(r["staleness"]), accuracy_steps, workdir,
                                                             accuracies)
                except (BenchError, subprocess.TimeoutExpired) as e:
                    row["digits_error"] = str(e)
            say(f"{link.name} {config.label}: {r['steps_per_s']:.1f} steps/s, {100 * r['share']:.0f}% of the bound "
                f"{r['bound_steps_per_s']:.1f} (down {fmt_bytes(r['bytes_down'])}, up {fmt_bytes(r['bytes_up'])}), "
                f"{100 * r['fill']:.0f}% of min(link {r['link_bound_steps_per_s']:.0f}, compute "
                f"{r['compute_bound_steps_per_s']:.0f}), S={r['staleness']}, digits {row.get('digits_accuracy')}")
        except BenchError as e:
            row["error"] = str(e)
            say(f"{link.name} {config.label}: FAILED {e}")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="distgrad-wan-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        known = known_flags()
        if args.smoke:
            links = [SMOKE_LINK]
            experiment = str(mlp_experiment(workdir, 32))
            configs = [Config(LOCKSTEP), Config(Schedule("1f1b M=2 N=1", 2, in_flight=1)), Config(LOCKSTEP, "int8")]
            warmup, steps = args.warmup or 2, args.steps or 3
        else:
            links = [LINKS[name] for name in args.links.split(",")]
            experiment = str(mlp_experiment(workdir, BATCH))
            configs = grid(full=not args.quick)
            warmup, steps = args.warmup or (3 if args.quick else 5), args.steps
        if args.rows is not None:
            configs = [c for c in configs if args.rows.search(c.label)]
        results: dict[str, Any] = {"meta": {"batch": 32 if args.smoke else BATCH, "warmup": warmup,
                                            "quick": args.quick, "smoke": args.smoke},
                                   "links": {}, "failures": 0}
        accuracies: dict[tuple, float] | None = None if args.no_accuracy or args.smoke else {}
        try:
            for link in links:
                measured = steps or (link.steps // 3 if args.quick else link.steps)
                say(f"link {link.name}: {link.describe()}, {len(configs)} configurations, {warmup} + {measured} "
                    f"steps each")
                rows = run_link(link, configs, known, experiment, warmup, measured, workdir, args.accuracy_steps,
                                accuracies)
                results["links"][link.name] = {"delay_s": link.delay_s, "rate_bps": link.rate_bps, "steps": measured,
                                               "rows": rows}
                results["failures"] += sum("error" in row for row in rows)
            main_link = "wan10" if "wan10" in results["links"] else None
            acc = None
            if main_link and not args.no_accuracy:
                rows = [row for row in results["links"][main_link]["rows"] if "result" in row]
                if rows:
                    best = max(rows, key=lambda row: row["result"]["steps_per_s"])
                    config = next(c for c in configs if c.label == best["label"]).chosen(best["result"]["staleness"])
                    say(f"digits accuracy of the best combination on {main_link}: {config.label}")
                    try:
                        acc = accuracy(config, LINKS[main_link], args.accuracy_steps, workdir)
                    except BenchError as e:
                        acc = {"config": config.label, "error": str(e)}
                        results["failures"] += 1
                    results["accuracy"] = acc
            if main_link:
                results["targets"] = targets(results["links"][main_link]["rows"], acc)
        except _Terminated:
            say("stopped by SIGTERM")
            return 143
        except KeyboardInterrupt:
            say("stopped by SIGINT")
            return 130
    results["meta"]["elapsed_s"] = time.monotonic() - started
    for name, entry in results["links"].items():
        link = LINKS.get(name, SMOKE_LINK)
        print()
        print(table(link, entry["rows"]))
    if results.get("accuracy"):
        a = results["accuracy"]
        print(f"\ndigits with {a['config']}: test accuracy {a.get('test_accuracy')} ({a.get('steps')} steps)"
              if "error" not in a else f"\ndigits with {a['config']}: FAILED {a['error']}")
    for t in results.get("targets", []):
        figure = t["figure"]
        text = "-" if figure is None else f"{figure:.2f}x" if t["unit"] == "x" else f"{figure:.1%}"
        state = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        print(f"target: {t['target']}: {t['config']}: {text}: {state}")
    print(f"\nwan.py took {results['meta']['elapsed_s']:.1f} s, {results['failures']} failed run(s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
