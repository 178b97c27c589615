"""The processes a measurement starts: ``Proc`` (deadline, RSS samples, stop in a ``finally``) and what
they leave behind (the driver's summary)."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Protocol

from .common import BIG_SUMMARY_BYTES, BenchError, STOP_GRACE_S, TICK_S

PROGRESS_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\bstep (\d+)/(\d+) loss")


def log_time(stamp: str) -> float:
    """Seconds since the epoch of a logging ``asctime`` (``2026-01-01 12:00:00,123``, local time)."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def read_status(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (KiB) of ``pid``; empty once it is gone."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


class ProcOwner(Protocol):
    """What a ``Proc`` needs of whoever starts it (the measurement ``Runner``): a sequence number for its log
    names, the folder for its logs, the source tree to run in, and the list of live processes it joins until
    stopped."""

    seq: int
    logdir: Path
    src: Path
    live: list[Proc]


class Proc:
    """A child process with stdout and stderr in files; ``stop()`` always stops and reaps it."""

    def __init__(self, runner: ProcOwner, name: str, argv: list[str], env: dict[str, str]) -> None:
        runner.seq += 1
        stem = runner.logdir / f"{runner.seq:04d}-{name}"
        self.name, self.out_path, self.err_path = name, stem.with_suffix(".out"), stem.with_suffix(".log")
        self._out, self._err = open(self.out_path, "w"), open(self.err_path, "w")
        try:
            self.proc = subprocess.Popen(argv, stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL,
                                         env=env, cwd=runner.src)
        except BaseException:
            self._out.close()
            self._err.close()
            raise
        self.started = time.monotonic()
        runner.live.append(self)
        self._runner = runner

    def wait(self, deadline: float, on_tick: Callable[[], None] | None = None) -> int:
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name} still running at its deadline; killed\n{self.tail()}")
            if on_tick is not None:
                on_tick()
            time.sleep(TICK_S)
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        for f in (self._out, self._err):
            if not f.closed:
                f.close()
        if self in self._runner.live:
            self._runner.live.remove(self)

    def json_line(self) -> dict[str, Any]:
        """The last JSON line the process printed on stdout."""
        self._out.flush()
        for line in reversed(self.out_path.read_text(errors="replace").splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise BenchError(f"{self.name} printed no result\n{self.tail()}")

    def tail(self, lines: int = 12) -> str:
        text = []
        for path in (self.out_path, self.err_path):
            try:
                text += path.read_text(errors="replace").splitlines()
            except OSError:
                pass
        return "\n".join(f"  [{self.name}] {line}" for line in text[-lines:])


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_summary(path: Path) -> dict[str, Any]:
    """``steps`` and ``elapsed_s`` of a summary; a huge one (a 64 MiB model's parameters) is scanned."""
    if not path.exists():
        raise BenchError(f"no summary at {path}")
    if path.stat().st_size <= BIG_SUMMARY_BYTES:
        data = json.loads(path.read_text())
        return {"steps": data["steps"], "elapsed_s": data["elapsed_s"], "cpu_s": data.get("cpu_s")}
    text = path.read_bytes()
    found = {key: re.search(rb'"%s":\s*([0-9.eE+-]+)' % key.encode(), text)
             for key in ("steps", "elapsed_s", "cpu_s")}
    if not (found["steps"] and found["elapsed_s"]):
        raise BenchError(f"summary {path} has no steps / elapsed_s")
    return {"steps": int(found["steps"].group(1)), "elapsed_s": float(found["elapsed_s"].group(1)),
            "cpu_s": float(found["cpu_s"].group(1)) if found["cpu_s"] else None}
