"""f and g in two network namespaces joined by a veth pair: a real (if short) network hop.

The module makes two namespaces of its own, ``dg-<pid>-f`` (10.231.7.1) and
``dg-<pid>-g`` (10.231.7.2), linked by one veth pair, and runs each stage in
its own namespace with ``ip netns exec``. No traffic leaves those namespaces.

- Over the clean link both stages end with bitwise the parameters of
  ``distgrad run --in-process``.
- Impaired link: ``tc netem`` is not available everywhere, so a TCP relay
  (``tests/tcp_relay.py``) runs in g's namespace between f and g, delays every
  chunk 20 ms each way or, in the variant that also resets the connection
  mid-run, 5 ms (what is tested there is the cut, not the delay).
  The reliability flags (reply timeout, peer deadline, checkpoints, resume)
  carry the run over the cut, still bitwise equal to the in-process run.

Needs root and permission to create network namespaces; otherwise the module
is skipped. The namespaces are deleted in the fixture's finalizer whatever
happens, and every process started here is stopped in a ``finally``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pytest

from conftest import CLI, read_json, read_lines, run_main
from distgrad.run.launcher import pinned_env, stop_process

REPO = Path(__file__).resolve().parent.parent
RELAY = Path(__file__).resolve().parent / "tcp_relay.py"
IP_TIMEOUT_S = 10.0
RUN_DEADLINE_S = 45.0         # one stage process, start to exit
READY_DEADLINE_S = 20.0

F_ADDR, G_ADDR, PREFIX = "10.231.7.1", "10.231.7.2", 24
DELAY_MS = 20
CUT_DELAY_MS = 5              # messages are still in flight when the link is cut; the run takes 4x less
RELIABILITY = ["--checkpoint-every", "25", "--resume"]
DRIVER_RELIABILITY = ["--timeout", "1", "--peer-deadline", "30"]


# -- namespaces -------------------------------------------------------------------------------------------

def _ip(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S,
                            stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


@dataclass
class Netns:
    f: str
    g: str
    veth_f: str
    veth_g: str

    def argv(self, ns: str, argv: Sequence[object]) -> list[str]:
        return ["ip", "netns", "exec", ns, *map(str, argv)]

    def veth_bytes(self) -> int:
        """Bytes f's end of the veth pair has sent plus received."""
        out = _ip("-n", self.f, "-j", "-s", "link", "show", "dev", self.veth_f, check=True).stdout
        stats = json.loads(out)[0]["stats64"]
        return stats["rx"]["bytes"] + stats["tx"]["bytes"]


def _delete_namespaces(names: Sequence[str], veths: Sequence[str]) -> None:
    """Stop whatever still runs in our namespaces (only ours can), then delete them and any stray veth."""
    for ns in names:
        pids = _ip("netns", "pids", ns).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        if pids:
            time.sleep(0.2)
    for ns in names:
        _ip("netns", "del", ns)
    for veth in veths:                       # still in the root namespace if moving it failed
        if _ip("link", "show", "dev", veth).returncode == 0:
            _ip("link", "del", "dev", veth)


@pytest.fixture(scope="module")
def netns():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("the ip tool (iproute2) is not installed")
    pid = os.getpid()
    ns = Netns(f=f"dg-{pid}-f", g=f"dg-{pid}-g", veth_f=f"dgv{pid}f", veth_g=f"dgv{pid}g")
    created: list[str] = []
    veths = [ns.veth_f, ns.veth_g]
    try:
        for name in (ns.f, ns.g):
            result = _ip("netns", "add", name)
            if result.returncode != 0:
                pytest.skip(f"network namespaces not permitted here: {result.stderr.strip()}")
            created.append(name)
        result = _ip("link", "add", ns.veth_f, "type", "veth", "peer", "name", ns.veth_g)
        if result.returncode != 0:
            pytest.skip(f"cannot create a veth pair here: {result.stderr.strip()}")
        _ip("link", "set", ns.veth_f, "netns", ns.f, check=True)
        _ip("link", "set", ns.veth_g, "netns", ns.g, check=True)
        for name, veth, addr in ((ns.f, ns.veth_f, F_ADDR), (ns.g, ns.veth_g, G_ADDR)):
            _ip("-n", name, "addr", "add", f"{addr}/{PREFIX}", "dev", veth, check=True)
            _ip("-n", name, "link", "set", veth, "up", check=True)
            _ip("-n", name, "link", "set", "lo", "up", check=True)
        ping = _wait_reachable(ns)
        if ping:
            pytest.skip(f"the veth pair does not carry traffic: {ping}")
        yield ns
    finally:
        _delete_namespaces(created, veths)


def _wait_reachable(ns: Netns) -> str:
    """Empty once a TCP connection from f's namespace reaches g's address (a refusal counts); else why not."""
    probe = (f"import socket,sys\ns=socket.socket();s.settimeout(1)\n"
             f"try: s.connect(('{G_ADDR}', 9))\nexcept ConnectionRefusedError: sys.exit(0)\n"
             f"except OSError as e: print(e); sys.exit(1)\n")
    deadline = time.monotonic() + 5.0
    why = ""
    while time.monotonic() < deadline:
        result = subprocess.run(ns.argv(ns.f, [sys.executable, "-c", probe]), capture_output=True, text=True,
                                timeout=IP_TIMEOUT_S, stdin=subprocess.DEVNULL)
        if result.returncode == 0:
            return ""
        why = (result.stdout + result.stderr).strip()
        time.sleep(0.1)
    return why


# -- processes --------------------------------------------------------------------------------------------

class NsProcess:
    """A process run in a namespace; output to a log file; always stopped and reaped."""

    def __init__(self, argv: Sequence[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(list(argv), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=pinned_env(), cwd=REPO)

    @property
    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def wait(self, timeout: float = RUN_DEADLINE_S) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


def _wait_file(path: Path, proc: NsProcess, timeout: float = READY_DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.proc.poll() is None, f"exited {proc.proc.returncode} before writing {path}:\n{proc.output}"
        assert time.monotonic() < deadline, f"{path} not written within {timeout} s:\n{proc.output}"
        time.sleep(0.02)


_references: dict[tuple[str, tuple[str, ...]], dict] = {}


def _reference(tmp_path: Path, experiment: str, steps: Sequence[str]) -> dict:
    """``distgrad run EXPERIMENT --in-process`` params (memoised per experiment and --steps)."""
    key = (experiment, tuple(steps))
    if key not in _references:
        path = tmp_path / "reference.json"
        result = run_main(["run", experiment, "--in-process", *steps, "--summary", path])
        assert result.returncode == 0, result.stderr
        _references[key] = read_json(path)["params"]
    return _references[key]


@dataclass
class Run:
    f: dict
    g: dict
    trace: list[dict]
    logs: str
    relay: dict | None


def _train(ns: Netns, tmp: Path, experiment: str, steps: Sequence[str], port: int, *,
           relay: Sequence[str] | None = None, reliable: bool = False) -> Run:
    """Train with g in its namespace on G_ADDR:port and f in its own; optionally through the relay."""
    g_endpoint = f"tcp://{G_ADDR}:{port}"
    f_endpoint = f"tcp://{G_ADDR}:{port + 1}" if relay is not None else g_endpoint
    common = ["--experiment", experiment, *steps]
    g_extra, f_extra = [], []
    if reliable:
        g_extra = ["--checkpoint-dir", tmp / "ckpt", *RELIABILITY]
        f_extra = ["--checkpoint-dir", tmp / "ckpt", *RELIABILITY, *DRIVER_RELIABILITY]
    g_argv = [*CLI, "stage", "g", *common, "--bind", g_endpoint, "--ready-file", tmp / "g.ready",
              "--summary", tmp / "g.json", *g_extra]
    f_argv = [*CLI, "stage", "f", *common, "--connect", f_endpoint, "--summary", tmp / "f.json",
              "--trace", tmp / "f.jsonl", *f_extra]
    procs: dict[str, NsProcess] = {}

    def logs() -> str:
        return "\n".join(f"--- {name}\n{proc.output}" for name, proc in procs.items())

    try:
        procs["g"] = NsProcess(ns.argv(ns.g, g_argv), tmp / "g.log")
        _wait_file(tmp / "g.ready", procs["g"])
        if relay is not None:
            procs["relay"] = NsProcess(ns.argv(ns.g, [
                sys.executable, RELAY, "--listen", f"{G_ADDR}:{port + 1}", "--target", f"{G_ADDR}:{port}",
                "--report", tmp / "relay.json", "--ready-file", tmp / "relay.ready", "--max-seconds", "90",
                *relay]), tmp / "relay.log")
            _wait_file(tmp / "relay.ready", procs["relay"])
        procs["f"] = NsProcess(ns.argv(ns.f, f_argv), tmp / "f.log")
        for name in ("f", "g"):
            code = procs[name].wait()
            assert code == 0, f"stage {name} exited {code} (None: still running after {RUN_DEADLINE_S} s):\n{logs()}"
        report = None
        if relay is not None:
            procs["relay"].stop()                  # SIGTERM: it writes its final report and exits
            report = read_json(tmp / "relay.json")
        return Run(read_json(tmp / "f.json"), read_json(tmp / "g.json"), read_lines(tmp / "f.jsonl"), logs(), report)
    finally:
        for proc in procs.values():
            proc.stop()


def _assert_matches_reference(tmp: Path, run: Run, experiment: str, steps: Sequence[str]) -> None:
    reference = _reference(tmp, experiment, steps)
    assert run.f["params"]["f"] == reference["f"], run.logs
    assert run.g["params"]["g"] == reference["g"], run.logs
    assert run.f["steps"] == run.g["steps"] == len(run.trace)
    assert [line["step"] for line in run.trace] == list(range(1, len(run.trace) + 1))   # none lost or doubled


# -- tests ------------------------------------------------------------------------------------------------

CLEAN = {"seed-reverse": [], "tanh-regression": ["--steps", "200"]}


@pytest.mark.parametrize("experiment", sorted(CLEAN))
def test_clean_veth_link_gives_bitwise_the_in_process_result(netns, tmp_path, experiment):
    steps = CLEAN[experiment]
    before = netns.veth_bytes()
    run = _train(netns, tmp_path, experiment, steps, port=5600 + 10 * sorted(CLEAN).index(experiment))
    _assert_matches_reference(tmp_path, run, experiment, steps)
    if not steps:
        assert len(run.trace) == 900
    # The traffic really crossed the veth pair: at least one activation per step went over it.
    assert netns.veth_bytes() - before > 20 * len(run.trace)


def test_delayed_link_slows_every_step_and_changes_nothing(netns, tmp_path):
    total = 50
    steps = ["--steps", str(total)]
    run = _train(netns, tmp_path, "seed-reverse", steps, port=5700, relay=["--delay-ms", str(DELAY_MS)])
    _assert_matches_reference(tmp_path, run, "seed-reverse", steps)
    assert run.relay["connections"] == 1 and run.relay["cuts"] == 0, run.relay
    # One request and one reply per step, each held DELAY_MS by the relay.
    assert run.f["elapsed_s"] >= total * 2 * DELAY_MS / 1000, run.f["elapsed_s"]


# Bytes the relay sees per step (both directions, measured) and how far into the run to cut.
CUT = {"seed-reverse": (150, 165), "tanh-regression": (100, 8500)}   # protocol 5's binary headers
CUT_AT_FRACTION = 0.4


# One reset path: tanh-regression's stays in the default suite, seed-reverse's (the same path, a smaller
# model) runs with -m slow.
@pytest.mark.parametrize("experiment", [pytest.param("seed-reverse", marks=pytest.mark.slow), "tanh-regression"])
def test_connection_reset_mid_run_is_survived_bitwise(netns, tmp_path, experiment):
    total, bytes_per_step = CUT[experiment]
    steps = ["--steps", str(total)]
    cut_after = int(total * CUT_AT_FRACTION * bytes_per_step)
    run = _train(netns, tmp_path, experiment, steps, port=5800 + 10 * sorted(CUT).index(experiment),
                 relay=["--delay-ms", str(CUT_DELAY_MS), "--cut-after-bytes", str(cut_after)], reliable=True)
    _assert_matches_reference(tmp_path, run, experiment, steps)
    assert len(run.trace) == total
    report = run.relay
    assert report["cuts"] == 1 and report["connections"] >= 2, report
    # Training went on well after the cut, over a later connection.
    assert report["bytes_up"] + report["bytes_down"] > report["cut_at_bytes"] + 0.3 * total * bytes_per_step, report
