"""The runner: ``Variant`` (one measured configuration) and ``Runner`` (starts every kind of peer,
interleaves and repeats the variants of a group, records failures); the figures' formatting."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .common import (COMPUTE_MIN_S, HERE, HIDDEN, KIB, MIB, READY_TIMEOUT_S, STARTUP_ALLOWANCE_S, BenchError, median,
                     say)
from .procs import PROGRESS_LINE, Proc, log_time, free_tcp_port, read_status, read_summary


@dataclass
class Variant:
    """One measured configuration; ``fn(steps or seconds)`` returns a dict with ``t`` (seconds per step)."""

    key: str
    fn: Callable[[float], dict[str, Any]]
    est_s: float = 1e-3
    timed: bool = False            # fn takes a duration (round-trip clients) instead of a step count
    min_steps: int = 3
    max_steps: int = 20000
    samples: list[dict[str, Any]] = field(default_factory=list)
    failed: str | None = None

    def measure(self, target_s: float) -> dict[str, Any]:
        arg = target_s if self.timed else max(self.min_steps, min(self.max_steps, round(target_s / self.est_s)))
        result = self.fn(arg)
        self.est_s = result["t"]
        self.samples.append(result)
        return result

    @property
    def t(self) -> float | None:
        return median([s["t"] for s in self.samples])


class Runner:
    def __init__(self, workdir: Path, src: Path, env: dict[str, str], torch_python: str | None, repeats: int,
                 target_s: float) -> None:
        self.workdir, self.src, self.env, self.torch_python = workdir, src, env, torch_python
        self.repeats, self.target_s = repeats, target_s
        self.compute_min_s = COMPUTE_MIN_S
        self.logdir = workdir / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.expdir = workdir / "experiments"
        self.expdir.mkdir(exist_ok=True)
        self.live: list[Proc] = []
        self.seq = 0
        self.failures: list[dict[str, str]] = []
        self.servers: dict[tuple[str, str], tuple[Proc, str]] = {}

    # -- plumbing

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        return Proc(self, name, argv, env or self.env)

    def run_json(self, name: str, argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict:
        proc = self.spawn(name, argv, env)
        try:
            code = proc.wait(time.monotonic() + timeout_s)
            if code != 0:
                raise BenchError(f"{name} exited with code {code}\n{proc.tail()}")
            return proc.json_line()
        finally:
            proc.stop()

    def wait_ready(self, proc: Proc, ready: Path) -> str:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if ready.exists():
                text = ready.read_text().strip()
                if text:
                    return text
            if proc.proc.poll() is not None:
                raise BenchError(f"{proc.name} exited with code {proc.proc.returncode} before it was ready\n"
                                 f"{proc.tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"{proc.name} wrote no endpoint within {READY_TIMEOUT_S:g} s\n{proc.tail()}")
            time.sleep(0.02)

    def bind_endpoint(self, transport: str, name: str) -> str:
        return "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{self.workdir}/{name}.sock"

    def write_experiment(self, name: str, text: str) -> Path:
        path = self.expdir / f"{name}.toml"
        path.write_text(text)
        return path

    def stop_all(self) -> None:
        for proc in reversed(list(self.live)):
            proc.stop()

    # -- echo servers (kept for the whole run)

    def server(self, role: str, transport: str) -> str:
        key = (role, transport)
        known = self.servers.get(key)
        if known is not None and known[0].proc.poll() is not None:
            say(f"{role} over {transport} exited with code {known[0].proc.returncode}; starting it again")
            known[0].stop()
            known = None
        if known is None:
            ready = self.workdir / f"{role}-{transport}.ready"
            ready.unlink(missing_ok=True)
            proc = self.spawn(f"{role}-{transport}", [sys.executable, str(HERE / "_peers.py"), role, str(ready),
                                                      self.bind_endpoint(transport, f"{role}-{transport}")])
            known = self.servers[key] = (proc, self.wait_ready(proc, ready))
        return known[1]

    def round_trip(self, role: str, transport: str, size: int, seconds: float) -> dict[str, Any]:
        endpoint = self.server(f"{role}-server", transport)
        r = self.run_json(f"{role}-client-{transport}-{size}",
                          [sys.executable, str(HERE / "_peers.py"), f"{role}-client", endpoint, str(size),
                           str(seconds)], STARTUP_ALLOWANCE_S + 10 * seconds)
        return {"t": r["rt_s"], "round_trips": r["round_trips"], "elapsed_s": r["elapsed_s"]}

    # -- distgrad

    def distgrad_pair(self, experiment: Path, steps: int, transport: str = "tcp", driver_flags: tuple = (),
                      expected_s: float = 5.0, extra_s: float = 0.0, stage_flags: tuple = (),
                      cpu: bool = False) -> dict[str, Any]:
        """One run of the two stage processes; the driver's summary gives ``elapsed_s``.

        ``stage_flags`` go to both stages. With ``cpu``, g writes a summary too
        (cheap only for a small g) and ``cores`` is the CPU time both processes
        used (every thread) over the driver's elapsed time.

        The f-stage's VmRSS / VmHWM are sampled every tick together with the last
        progress line it logged, so the training loop's part can be told apart
        from start-up and the summary write.
        """
        tag = f"{experiment.stem}-{transport}-{'-'.join(map(str, driver_flags + stage_flags)) or 'm1'}"
        ready, summary = self.workdir / f"{tag}.ready", self.workdir / f"{tag}.f.json"
        g_summary = self.workdir / f"{tag}.g.json"
        for path in (ready, summary, g_summary):
            path.unlink(missing_ok=True)
        stage = [sys.executable, "-m", "distgrad.cli", "stage"]
        common = ["--experiment", str(experiment), "--steps", str(steps), "--timeout", "60", *map(str, stage_flags)]
        deadline = time.monotonic() + STARTUP_ALLOWANCE_S + 5 * expected_s + extra_s
        g = f = None
        samples: list[dict[str, Any]] = []
        try:
            g = self.spawn(f"g-{tag}", [*stage, "g", *common, "--bind", self.bind_endpoint(transport, tag),
                                        "--ready-file", str(ready), "--log-level", "WARNING",
                                        *(["--summary", str(g_summary)] if cpu else [])])
            endpoint = self.wait_ready(g, ready)
            f = self.spawn(f"f-{tag}", [*stage, "f", *common, "--connect", endpoint, *map(str, driver_flags),
                                        "--summary", str(summary), "--log-level", "INFO"])
            log = open(f.err_path, errors="replace")
            progress = {"step": 0, "total": steps}
            logged: list[tuple[int, float]] = []      # (step, time of its progress line)
            t0 = time.monotonic()

            def tick() -> None:
                for line in log.readlines():
                    m = PROGRESS_LINE.search(line)
                    if m:
                        progress["step"], progress["total"] = int(m.group(2)), int(m.group(3))
                        logged.append((progress["step"], log_time(m.group(1))))
                status = read_status(f.proc.pid)
                if status:
                    samples.append({"t": round(time.monotonic() - t0, 3), "step": progress["step"],
                                     "rss_kib": status.get("VmRSS"), "hwm_kib": status.get("VmHWM")})

            try:
                code = f.wait(deadline, tick)
                tick()
            finally:
                log.close()
            if code != 0:
                raise BenchError(f"f-stage exited with code {code}\n{f.tail()}\n{g.tail()}")
            code = g.wait(min(deadline, time.monotonic() + 30))
            if code != 0:
                raise BenchError(f"g-stage exited with code {code}\n{g.tail()}")
            result = read_summary(summary)
            if cpu:
                g_cpu = read_summary(g_summary).get("cpu_s")
                if result.get("cpu_s") is not None and g_cpu is not None:
                    result["cores"] = (result["cpu_s"] + g_cpu) / result["elapsed_s"]
        finally:
            for proc in (f, g):
                if proc is not None:
                    proc.stop()
            summary.unlink(missing_ok=True)
            g_summary.unlink(missing_ok=True)
        result["t"] = result["elapsed_s"] / result["steps"]
        result["memory"] = memory_stats(samples, steps)
        # Between the driver's first and last progress lines: no handshake, first step or bye.
        if len(logged) >= 2 and logged[-1][0] > logged[0][0]:
            result["steady_t"] = (logged[-1][1] - logged[0][1]) / (logged[-1][0] - logged[0][0])
        return result

    def inprocess_cli(self, experiment: Path, steps: int, expected_s: float) -> dict[str, Any]:
        summary = self.workdir / f"{experiment.stem}.inproc.json"
        summary.unlink(missing_ok=True)
        proc = self.spawn(f"inproc-{experiment.stem}", [sys.executable, "-m", "distgrad.cli", "run", str(experiment),
                                                        "--in-process", "--steps", str(steps), "--summary",
                                                        str(summary), "--log-level", "WARNING"])
        try:
            code = proc.wait(time.monotonic() + STARTUP_ALLOWANCE_S + 5 * expected_s)
            if code != 0:
                raise BenchError(f"in-process run exited with code {code}\n{proc.tail()}")
            result = read_summary(summary)
        finally:
            proc.stop()
            summary.unlink(missing_ok=True)
        result["t"] = result["elapsed_s"] / result["steps"]
        return result

    def inprocess_api(self, experiment: Path, steps: int, expected_s: float) -> dict[str, Any]:
        r = self.run_json(f"inproc-{experiment.stem}", [sys.executable, str(HERE / "_peers.py"), "inprocess",
                                                        str(experiment), str(steps)],
                          STARTUP_ALLOWANCE_S + 5 * expected_s)
        return {"steps": r["steps"], "elapsed_s": r["elapsed_s"], "t": r["elapsed_s"] / r["steps"]}

    def stage_compute(self, experiment: Path, micro_batches: int) -> dict[str, Any]:
        return self.run_json(f"compute-{experiment.stem}-m{micro_batches}",
                             [sys.executable, str(HERE / "_peers.py"), "stage-compute", str(experiment),
                              str(micro_batches), str(self.compute_min_s)], STARTUP_ALLOWANCE_S + 30)

    # -- the other implementations of the same split

    def bare_pair(self, batch: int, steps: int, expected_s: float) -> dict[str, Any]:
        """The bare raw-frame numpy split of mlp-classify (``_raw_split.py``) at ``batch``, over tcp."""
        return self._bare(f"bare-b{batch}", "_raw_split.py", "tcp", [str(batch), str(HIDDEN)], steps, expected_s)

    def bare_identity(self, transport: str, size: int, steps: int, expected_s: float,
                      script: str = "_bare_identity.py") -> dict[str, Any]:
        """The bare lockstep split of the identity model of ``size`` activation bytes (``_bare_identity.py``):
        the floor a split step reaches on this machine beside the raw round trip of the same frames; with
        ``script="_parts_identity.py"``, the same loop made of distgrad's model and wire calls."""
        return self._bare(f"{Path(script).stem}-{size}-{transport}", script, transport, [str(size)], steps,
                          expected_s)

    def _bare(self, tag: str, script_name: str, transport: str, args: list[str], steps: int,
              expected_s: float) -> dict[str, Any]:
        """One run of a bare split script's two processes: ``g READY ENDPOINT *args``, ``f ENDPOINT *args STEPS``."""
        ready = self.workdir / f"{tag}.ready"
        ready.unlink(missing_ok=True)
        script = [sys.executable, str(HERE / script_name)]
        deadline = time.monotonic() + STARTUP_ALLOWANCE_S + 5 * expected_s
        g = f = None
        try:
            g = self.spawn(f"g-{tag}", [*script, "g", str(ready), self.bind_endpoint(transport, tag), *args])
            endpoint = self.wait_ready(g, ready)
            f = self.spawn(f"f-{tag}", [*script, "f", endpoint, *args, str(steps)])
            code = f.wait(deadline)
            if code != 0:
                raise BenchError(f"bare f exited with code {code}\n{f.tail()}\n{g.tail()}")
            r = f.json_line()
            g.wait(min(deadline, time.monotonic() + 10))
        finally:
            for proc in (f, g):
                if proc is not None:
                    proc.stop()
        return {"steps": r["steps"], "elapsed_s": r["elapsed_s"], "t": r["elapsed_s"] / r["steps"]}

    def torch_pair(self, batch: int, steps: int, expected_s: float) -> dict[str, Any]:
        assert self.torch_python is not None
        port = free_tcp_port()
        env = dict(self.env, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
        script = [self.torch_python, str(HERE / "_torch_split.py")]
        deadline = time.monotonic() + STARTUP_ALLOWANCE_S + 5 * expected_s
        procs: list[Proc] = []
        try:
            for rank in (1, 0):
                procs.append(self.spawn(f"torch-r{rank}-b{batch}", [*script, str(rank), str(port), str(batch),
                                                                    str(HIDDEN), str(steps)], env))
            g, f = procs
            code = f.wait(deadline)
            if code != 0:
                raise BenchError(f"torch rank 0 exited with code {code}\n{f.tail()}\n{g.tail()}")
            r = f.json_line()
            code = g.wait(min(deadline, time.monotonic() + 20))
            if code != 0:
                raise BenchError(f"torch rank 1 exited with code {code}\n{g.tail()}")
        finally:
            for proc in reversed(procs):
                proc.stop()
        return {"steps": r["steps"], "elapsed_s": r["elapsed_s"], "t": r["elapsed_s"] / r["steps"],
                "torch": r.get("torch")}

    # -- scheduling

    def interleave(self, group: str, variants: list[Variant], repeats: int | None = None) -> None:
        """Each repeat runs every variant once; the order rotates by one every repeat."""
        repeats = self.repeats if repeats is None else repeats
        for rep in range(repeats):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for v in order:
                if v.failed:
                    continue
                try:
                    r = v.measure(self.target_s)
                except BenchError as e:
                    v.failed = str(e)
                    self.failures.append({"group": group, "variant": v.key, "repeat": str(rep), "error": str(e)})
                    say(f"FAILED {group} {v.key}: {str(e).splitlines()[0]}")
                    continue
                extra = f" ({r['steps']} steps)" if "steps" in r else f" ({r.get('round_trips')} round trips)"
                say(f"{group} {v.key} rep {rep + 1}/{repeats}: {fmt_time(r['t'])}{extra}")


def memory_stats(samples: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """The f-stage's memory during its training loop, from samples taken with its last progress line.

    The loop is the part between its 10% progress line (step 2 at least) and its final one
    (start-up before, the summary write after). ``loop_hwm_kib`` is VmHWM at
    the last sample of the loop: the peak up to the end of the loop, start-up
    included. ``growth_hwm_kib`` is how much that peak rose after the 10% mark:
    every step reaches the same transient peak, so it stays flat unless memory
    accumulates. ``growth_rss_kib`` compares the largest sampled RSS of the
    second half of the loop with the first (sampling may miss transients).
    """
    final_hwm = max((s["hwm_kib"] for s in samples if s.get("hwm_kib")), default=None)
    in_loop = [s for s in samples if 0 < s["step"] < steps and s.get("rss_kib")]
    # Step 1 allocates the optimiser's state only at its end, so the peak settles from step 2 on.
    loop = [s for s in in_loop if s["step"] >= max(2, steps // 10)]
    if len(loop) < 2:
        return {"samples": len(samples), "loop_samples": len(loop), "final_hwm_kib": final_hwm}
    half = (loop[0]["step"] + loop[-1]["step"]) / 2
    first = [s["rss_kib"] for s in loop if s["step"] <= half] or [loop[0]["rss_kib"]]
    second = [s["rss_kib"] for s in loop if s["step"] > half] or [loop[-1]["rss_kib"]]
    return {"samples": len(samples), "loop_samples": len(loop), "final_hwm_kib": final_hwm,
            "loop_hwm_kib": in_loop[-1]["hwm_kib"], "loop_max_rss_kib": max(first + second),
            "loop_min_rss_kib": min(first + second), "growth_hwm_kib": in_loop[-1]["hwm_kib"] - loop[0]["hwm_kib"],
            "growth_rss_kib": max(second) - max(first), "loop_steps": [loop[0]["step"], loop[-1]["step"]],
            "steps": steps}


def cores(v: Variant) -> float | None:
    """CPU time of both stage processes over the run's wall time (median over the repeats)."""
    return median([s["cores"] for s in v.samples if s.get("cores") is not None])


def fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    if t < 1e-3:
        return f"{t * 1e6:.1f} us"
    if t < 1:
        return f"{t * 1e3:.2f} ms"
    return f"{t:.2f} s"


def fmt_size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB" if n >= KIB else f"{n} B"


def fmt_ratio(r: float | None, digits: int = 2) -> str:
    return "-" if r is None else f"{r:.{digits}f}x"


def fmt_rate(r: float | None) -> str:
    return "-" if r is None else f"{r:.0f}" if r >= 100 else f"{r:.1f}"


def summarise(v: Variant) -> dict[str, Any]:
    return {"t_s": v.t, "steps_per_s": (1 / v.t) if v.t else None, "samples": v.samples, "failed": v.failed}
