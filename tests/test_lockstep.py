"""The lockstep path (one data owner, one label owner, no staleness, one micro-batch) keeps every guarantee.

That path is short on both sides (``driver._Driver._lockstep_step``; the serving stage's shortcuts, the reply
cache of a lockstep peer pruned to its one reply, binary headers read against a precomputed layout,
misaligned frames copied into reused aligned buffers, ``wire.RECEIVE_BUFFERS``). Each test here runs real
stage processes over real sockets with activations of 256 KiB (64 x 1024 float32: every frame of that size
is copied into an aligned receive buffer, libzmq's frames being 8-byte aligned), with numpy layer lists or
PyTorch modules on both sides, and checks a guarantee against the in-process reference, bitwise:

- exactly-once replies: a resent forward gets the very bytes of its first reply and changes nothing, before
  and after its update was applied; a duplicate of an older step is refused (``step``) and changes nothing;
- hostile input refused: a future step, another run, a wrong size, dtype or shape, NaN and Inf, an extra or
  a missing frame, a truncated binary header, a frame bigger than the layout: each a clear error (a frame over
  the stage's frame limit, its largest expected frame: the connection dropped by ZeroMQ before anything is
  allocated, as docs/protocol.md says; the peer's wait for a reply times out), the daemon serves on, its
  checkpoint files are byte for byte unchanged and the run ends bitwise equal to the reference;
- resume: either stage killed -9 mid-run and restarted with ``--resume`` ends bitwise as an uninterrupted run,
  the received tensors in reused aligned buffers and, with a 32 MiB gradient, the label owner's in its reused
  ``BufferRing``; a link cut inside a step's forward or reply is resent and answered once;
- bounded waits: a frozen peer (SIGSTOP) is a clear timeout error on the other side within its deadline.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from distgrad.config.parse import load_experiment
from distgrad.wire import messages as wire
from distgrad.wire.messages import ErrorCode, Message

from conftest import (HonestDataOwner, StageProcess, free_tcp_endpoint, hello_message, read_json, run_main,
                      wait_for_file, watched_dealer)

ROWS, WIDTH = 64, 1024          # the activation: 64 x 1024 float32 = 256 KiB, over wire.ALWAYS_COPY_BYTES
STEPS = 6
REPLY_TIMEOUT_MS = 20_000       # a hang guard: a reply that does not come fails the test

EXPERIMENT = """
name = "lockstep-{kind}"
steps = {steps}
seed = 5
labels = "last"
[data]
kind = "synthetic_regression"
samples = 512
features = 8
outputs = 1
batch = {rows}
[[stages]]
name = "f"
{f}
[[stages]]
name = "g"
{g}
"""
F_STAGES = {
    "numpy": ('model = [{ type = "dense", name = "a", in = 8, out = %d }, { type = "tanh" }]\n'
              'optimizer = { type = "adam", lr = 0.01 }' % WIDTH),
    "torch": 'module = "lockstep_torch:body"\noutput = [%d]\noptimizer = { type = "Adam", lr = 0.01 }' % WIDTH,
}
G_STAGES = {
    "numpy": ('model = [{ type = "dense", name = "b", in = %d, out = 1 }]\noptimizer = { type = "adam", lr = 0.01 }\n'
              'loss = "mean_squared_error"' % WIDTH),
    "torch": 'module = "lockstep_torch:head"\noptimizer = { type = "Adam", lr = 0.01 }\nloss = { type = "MSELoss" }',
}
TORCH_MODULES = f"""
from torch import nn


def body():
    return nn.Sequential(nn.Linear(8, {WIDTH}), nn.Tanh())


def head():
    return nn.Sequential(nn.Linear({WIDTH}, 16), nn.Tanh(), nn.Linear(16, 1))
"""
# Torch stages take the same paths as numpy ones (the default case); only their compute differs, and torch's
# import costs seconds a process: slow.
KINDS = pytest.mark.parametrize("kind", ["numpy", pytest.param("torch", marks=pytest.mark.slow)])


def write_experiment(tmp_path: Path, kind: str, steps: int = STEPS) -> Path:
    """The lockstep experiment with stages of ``kind`` (numpy layer lists, or torch modules); torch cases are
    skipped without torch."""
    if kind == "torch":
        pytest.importorskip("torch", reason="torch is not installed (pip install 'distgrad[torch]')")
        (tmp_path / "lockstep_torch.py").write_text(TORCH_MODULES)
    path = tmp_path / f"lockstep-{kind}.toml"
    path.write_text(EXPERIMENT.format(kind=kind, steps=steps, rows=ROWS, f=F_STAGES[kind], g=G_STAGES[kind]))
    return path


def in_process_params(tmp_path: Path, experiment: Path, steps: int, *extra: str) -> dict:
    """Both stages' parameters after ``steps`` steps of ``experiment`` in one process (``extra``: options)."""
    path = tmp_path / "reference.json"
    result = run_main(["run", str(experiment), "--in-process", "--steps", str(steps), "--summary", path, *extra])
    assert result.returncode == 0, result.stderr
    return read_json(path)["params"]


def files_digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (checkpoints, their metadata) by relative path: its SHA-256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


class RawPeer:
    """A DEALER on which the test sends frames as it builds them, and reads each reply as bytes."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.ctx, self.endpoint = ctx, endpoint
        self._connect()

    def _connect(self) -> None:
        self.sock, self.monitor = watched_dealer(self.ctx, self.endpoint)

    def request(self, frames: list, timeout_ms: int = REPLY_TIMEOUT_MS) -> list[bytes] | None:
        """The reply's frames, or None when the stage dropped the connection instead (a frame over its limit:
        the socket is then made anew). Fails when neither happens within ``timeout_ms``."""
        self.sock.send_multipart(frames, copy=True)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        assert ready, f"neither a reply nor a dropped connection within {timeout_ms} ms"
        if self.sock in ready:
            return self.sock.recv_multipart()
        assert recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED
        self.close()
        self._connect()
        return None

    def message(self, msg: Message) -> tuple[Message, list[bytes]]:
        """``msg`` sent; its reply decoded (its tensors read as a backward's, when it is one) and as bytes."""
        raw = self.request(wire.encode(msg))
        assert raw is not None, f"the stage dropped the connection of {msg.describe()}"
        reply = wire.decode(raw)
        if reply.frames is not None:
            wire.expect_tensors(reply, {"activation_grad": ((ROWS, WIDTH), np.dtype("<f4"))})
        return reply, raw

    def error_code(self, frames: list) -> str | None:
        """The code of the error ``frames`` got (None: no reply, the connection dropped)."""
        raw = self.request(frames)
        if raw is None:
            return None
        reply = wire.decode(raw)
        assert reply.type == wire.ERROR, f"expected an error reply, got {reply.describe()} {reply.body}"
        return reply.body["code"]

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


def binary_forward(run: str, step: int, frames: list, count: int | None = None, mb: int = 0) -> list:
    """A forward's binary header (declaring ``count`` tensors, by default as many as ``frames``, and micro-batch
    ``mb`` of one, whatever it is) and ``frames``."""
    header = wire.encode(Message(wire.FORWARD, run, step, tensors={"activation": np.zeros(1, np.float32)}))[0]
    header = bytearray(header)
    header[4] = len(frames) if count is None else count       # the tensor count's byte (BINARY_HEADER)
    header[16:20] = mb.to_bytes(4, "little")                  # mb, then mbs (1)
    return [bytes(header), *frames]


def msgpack_forward(run: str, step: int, dtype: str, shape: list[int], frame: bytes) -> list:
    """A forward with a self-describing header naming ``dtype`` and ``shape`` for ``frame``."""
    header = {"v": wire.PROTOCOL_VERSION, "type": wire.FORWARD, "run": run, "step": step, "mb": 0, "mbs": 1,
              "body": {}, "tensors": [["activation", dtype, shape]]}
    return [msgpack.packb(header, use_bin_type=True), frame]


def hostile_forwards(run: str, step: int, good: np.ndarray) -> list[tuple[str, list, str | None]]:
    """(what, frames, the error code it must get; None: ZeroMQ drops the connection) of forwards for step
    ``step`` of ``run`` that the label owner must refuse, changing nothing; ``good`` is a valid activation."""
    data = good.tobytes()
    nan, inf = good.copy(), good.copy()
    nan.reshape(-1)[-1] = np.nan          # at the very end: a check that stops short misses it
    inf.reshape(-1)[0] = -np.inf
    half = np.ascontiguousarray(good, np.float16).tobytes()
    return [
        ("a future step", binary_forward(run, step + 1, [data]), ErrorCode.STEP),
        ("another run", binary_forward(uuid.uuid4().hex, step, [data]), ErrorCode.RUN),
        ("a frame 4 bytes short", binary_forward(run, step, [data[:-4]]), ErrorCode.TENSOR),
        # the stage's frame limit is its largest expected frame: one byte more and ZeroMQ drops the connection
        ("a frame 4 bytes long", binary_forward(run, step, [data + b"\0" * 4]), None),
        ("float16 bytes", binary_forward(run, step, [half]), ErrorCode.TENSOR),
        ("float64 declared", msgpack_forward(run, step, "float64", [ROWS, WIDTH // 2], data), ErrorCode.TENSOR),
        ("another shape", msgpack_forward(run, step, "float32", [ROWS * 2, WIDTH // 2], data), ErrorCode.TENSOR),
        ("NaN", binary_forward(run, step, [nan.tobytes()]), ErrorCode.NONFINITE),
        ("-Inf", binary_forward(run, step, [inf.tobytes()]), ErrorCode.NONFINITE),
        ("an extra frame", binary_forward(run, step, [data, data]), ErrorCode.TENSOR),
        ("no frame", binary_forward(run, step, []), ErrorCode.TENSOR),
        ("a count of 2 with one frame", binary_forward(run, step, [data], count=2), ErrorCode.TENSOR),
        ("a truncated binary header", [binary_forward(run, step, [data])[0][:20], data], ErrorCode.MALFORMED),
        ("a frame 8 times the layout", binary_forward(run, step, [data * 8]), None),
        ("micro-batch 0 of 2", wire.encode(Message(wire.FORWARD, run, step, 0, 2, tensors={"activation": good})),
         ErrorCode.STEP),
        ("micro-batch 1 of 1", binary_forward(run, step, [data], mb=1), ErrorCode.MALFORMED),
        ("a bye before the last step", wire.encode(Message(wire.BYE, run, step, body={"steps": step})),
         ErrorCode.STEP),
        ("an evaluation of the wrong rows", wire.encode(Message(wire.EVALUATE, run, step,
                                                                tensors={"activation": good[:3]})), ErrorCode.TYPE),
    ]


def ping_step(peer: RawPeer, run: str) -> int:
    """The label owner's applied steps, as its pong says (a barrier: the reply before it has left)."""
    reply, _ = peer.message(Message(wire.PING, run, 0))
    assert reply.type == wire.PONG
    return reply.body["step"]


@KINDS
def test_resent_and_hostile_forwards_on_the_lockstep_path_change_nothing(kind, tmp_path, start_server, zmq_ctx):
    """A hand-driven lockstep run against a ``distgrad-stage g`` daemon: every forward is sent twice (its reply
    lost) and gets the same reply bytes, before and after its update; a duplicate of the step before, or of the
    first step, is refused;
    between steps, every hostile forward of ``hostile_forwards`` gets its error, leaves the checkpoint files
    byte for byte as they were, and the run ends bitwise equal to the in-process one."""
    experiment = write_experiment(tmp_path, kind)
    reference = in_process_params(tmp_path, experiment, STEPS)
    bind = free_tcp_endpoint() if kind == "numpy" else f"ipc://{tmp_path}/g.sock"
    checkpoints = tmp_path / "ckpt"
    g, endpoint = start_server(str(experiment), "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1",
                               "--summary", str(tmp_path / "g.json"), bind=bind)
    peer, hostile = RawPeer(zmq_ctx, endpoint), RawPeer(zmq_ctx, endpoint)
    honest, run = HonestDataOwner(load_experiment(str(experiment))), uuid.uuid4().hex
    welcome, _ = peer.message(hello_message(honest.exp, run))
    assert welcome.type == wire.WELCOME and welcome.body["next_step"] == 1
    sent: list[list] = []                      # every step's forward, as sent
    for step in range(1, STEPS + 1):
        forward = honest.forward(run, step)
        frames = wire.encode(forward)
        if step == 3:       # before this step's forward: every hostile one, each refused, changing nothing
            before = files_digest(checkpoints)
            assert before, "no checkpoint was written"
            for what, bad, code in hostile_forwards(run, step, forward.tensors["activation"]):
                assert hostile.error_code(bad) == code, what
                assert ping_step(peer, run) == step - 1, what
                assert files_digest(checkpoints) == before, what
                assert g.proc.poll() is None, g.output
        reply, first = peer.message(forward)
        assert reply.type == wire.BACKWARD, (reply.describe(), reply.body)
        again = peer.request(frames)           # the first reply was lost: the same bytes, no second update
        assert again == first
        assert ping_step(peer, run) == step
        assert peer.request(frames) == first   # and once the update is applied
        assert hostile.request(frames) == first     # and on a fresh connection, as the driver resends
        for old in sent[-1:] + sent[:1]:       # a duplicate of the step before, of the first: refused, no change
            assert peer.error_code(old) == ErrorCode.STEP
            assert peer.request(frames) == first
        honest.took(step, reply)
        sent.append(frames)
    bye, _ = peer.message(Message(wire.BYE, run, STEPS + 1, body={"steps": STEPS}))
    assert bye.type == wire.BYE
    assert g.wait() == 0, g.output
    summary = read_json(tmp_path / "g.json")
    assert summary["steps"] == STEPS and summary["params"]["g"] == reference["g"]
    assert {name: value.tolist() for name, value in honest.f.params.items()} == reference["f"]
    peer.close()
    hostile.close()


# ---------------------------------------------------------------- a frozen peer

FROZEN_STEPS = 100_000          # more than the run reaches before its peer is frozen
FROZEN_TIMEOUTS = ["--timeout", "0.3", "--liveness", "1", "--peer-deadline", "1"]


# A silent data owner is given up on in the default suite (tests/test_two_process.py::
# test_server_gives_up_on_a_lost_client_and_exits_3, a lockstep run): the frozen one is slow.
@pytest.mark.parametrize("frozen", ["g", pytest.param("f", marks=pytest.mark.slow)])
def test_a_frozen_peer_is_a_clear_timeout_on_the_other_side_not_a_hang(frozen, tmp_path, start_server):
    """SIGSTOP of either stage of a lockstep run in progress: the other exits 3 (``PeerTimeout``) with a message
    naming what it waited for, within its deadlines (the wait for it is a hang guard, not a timing claim)."""
    experiment = write_experiment(tmp_path, "numpy", FROZEN_STEPS)
    g, endpoint = start_server(str(experiment), *FROZEN_TIMEOUTS)
    metrics = tmp_path / "f.metrics.jsonl"
    with StageProcess(["f", "--experiment", experiment, "--connect", endpoint, "--metrics", metrics,
                       *FROZEN_TIMEOUTS], tmp_path / "f.log") as f:
        wait_for_file(metrics, f)
        while metrics.read_text().count("\n") < 3:   # a few steps applied: the run is in its lockstep loop
            assert f.proc.poll() is None and g.proc.poll() is None, f.output + g.output
        victim, survivor = (g, f) if frozen == "g" else (f, g)
        victim.signal(signal.SIGSTOP)
        try:
            code = survivor.wait(60)
        finally:
            victim.signal(signal.SIGKILL)
        assert code == 3, survivor.output
        if frozen == "g":
            assert f"no reply from {endpoint}" in survivor.output and "gave up after" in survivor.output, survivor.output
        else:
            assert "lost for more than" in survivor.output and "giving up" in survivor.output, survivor.output
        assert "Traceback" not in survivor.output, survivor.output


# ---------------------------------------------------------------- kill -9 and resume, large tensors

# g's model is an identity over a 1024 x 8192 activation (32 MiB) with the sum of squared errors: its activation
# gradient is the loss's, written into the loss's ``BufferRing`` (arrays from ``buffers.REUSE_MIN_BYTES`` up are
# reused once nothing holds them) and sent, and kept for a resend, as it is.
RING = """
name = "lockstep-ring"
steps = {steps}
seed = 5
labels = "last"
[data]
kind = "synthetic_regression"
samples = 2048
features = 8
outputs = 8192
batch = 1024
[[stages]]
name = "f"
model = [{{ type = "dense", name = "a", in = 8, out = 8192 }}, {{ type = "tanh" }}]
optimizer = {{ type = "adam", lr = 0.01 }}
[[stages]]
name = "g"
model = [{{ type = "identity" }}]
loss = "sum_squared_error"
"""


def checkpointed(folder: Path, stage: str) -> int:
    """The newest step ``stage`` has a checkpoint of in ``folder`` (0: none yet)."""
    return max((int(p.stem.rsplit("-", 1)[1]) for p in folder.glob(f"{stage}-*.ckpt")), default=0)


# The default suite kills stages of a lockstep run (one micro-batch, no staleness, two stages) with small
# tensors: tests/test_faults.py::test_sigkill_at_several_steps_then_restart_gives_bitwise_equal_parameters. These
# add tensors on the aligned-buffer path (256 KiB), a torch label owner, and the 32 MiB gradient ring: slow.
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind,steps,transport,extra,f_extra", [
    ("numpy", 60, "tcp", [], []), ("torch", 60, "ipc", [], []), ("ring", 24, "ipc", [], []),
    # codecs with error feedback and the data owner's privacy meter (the label owner's targets are real-valued,
    # so it has none and refuses one): tensors a codec and a meter hold
    ("numpy", 60, "ipc", ["--activation-codec", "int8", "--gradient-codec", "topk:1000+ef"], ["--privacy-meter"])],
    ids=["numpy", "torch", "ring", "codecs-meter"])
def test_lockstep_stages_killed_9_and_resumed_end_bitwise_as_in_process(kind, steps, transport, extra, f_extra,
                                                                        tmp_path, stage_group):
    """g killed -9 a third of the way, f two thirds of the way, each restarted with ``--resume``: the final
    parameters are bitwise those of the in-process run (with the same ``extra`` options), every tensor having
    crossed in reused receive buffers (and, for ``ring``, the label owner's gradients in its reused ring)."""
    from conftest import StageGroup

    if kind == "ring":
        experiment = tmp_path / "lockstep-ring.toml"
        experiment.write_text(RING.format(steps=steps))
    else:
        experiment = write_experiment(tmp_path, kind, steps)
    reference = in_process_params(tmp_path, experiment, steps, *extra, *f_extra)
    endpoint = free_tcp_endpoint() if transport == "tcp" else f"ipc://{tmp_path}/g.sock"
    common = [*extra, "--experiment", experiment, "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", "2",
              "--resume", "--timeout", "2", "--peer-deadline", "60"]
    pair = stage_group(StageGroup, tmp_path)
    pair.args = {"g": ["g", "--bind", endpoint, "--summary", tmp_path / "g.json", *common],
                 "f": ["f", "--connect", endpoint, "--summary", tmp_path / "f.json", *common, *f_extra]}
    pair.start("g")
    pair.start("f")
    for fraction, victim in ((1 / 3, "g"), (2 / 3, "f")):
        target = int(steps * fraction)
        pair.wait_until(lambda: checkpointed(tmp_path / "ckpt", "f") >= target, f"step {target}", timeout=300)
        pair.kill_9_and_restart(victim)
    pair.wait_all(timeout=300)
    f_summary, g_summary = read_json(tmp_path / "f.json"), read_json(tmp_path / "g.json")
    assert f_summary["steps"] == g_summary["steps"] == steps
    assert f_summary["params"]["f"] == reference["f"]
    assert g_summary["params"].get("g", {}) == reference.get("g", {})
    assert "resumed" in pair.logs()


# ---------------------------------------------------------------- a reply lost on a real link

RELAY = Path(__file__).resolve().parent / "tcp_relay.py"
STEP_BYTES = 2 * 4 * ROWS * WIDTH       # a step's forward and reply, tensors only, both directions


# The default suite resends forwards and checks each reply's bytes over a real socket (the hand-driven run above);
# this one lets the real driver do it after a real cut, as tests/test_netns.py does in namespaces: slow.
@pytest.mark.slow
@pytest.mark.parametrize("cut_in", ["forward", "reply"])
def test_a_link_cut_mid_step_is_resent_and_answered_once_bitwise(cut_in, tmp_path, start_server):
    """A relay between the stages resets both connections once, inside step 11's forward or its reply (the
    reply lost after g applied the step): the driver resends on a fresh connection, g answers from its reply
    cache or computes the step then, and both stages end bitwise equal to the in-process run."""
    steps = 30
    experiment = write_experiment(tmp_path, "numpy", steps)
    reference = in_process_params(tmp_path, experiment, steps)
    g, endpoint = start_server(str(experiment), "--summary", str(tmp_path / "g.json"), "--liveness", "5",
                               bind=free_tcp_endpoint())
    listen = free_tcp_endpoint().removeprefix("tcp://")
    cut = 10 * STEP_BYTES + (STEP_BYTES // 4 if cut_in == "forward" else 3 * STEP_BYTES // 4)
    relay = StageProcess([RELAY, "--listen", listen, "--target", endpoint.removeprefix("tcp://"),
                          "--cut-after-bytes", cut, "--report", tmp_path / "relay.json",
                          "--ready-file", tmp_path / "relay.ready"], tmp_path / "relay.log",
                         command=[sys.executable])
    with relay:
        wait_for_file(tmp_path / "relay.ready", relay)
        with StageProcess(["f", "--experiment", experiment, "--connect", f"tcp://{listen}", "--summary",
                           tmp_path / "f.json", "--timeout", "0.5", "--peer-deadline", "30"],
                          tmp_path / "f.log") as f:
            assert f.wait() == 0, f.output
        assert g.wait() == 0, g.output
        assert read_json(tmp_path / "relay.json")["cuts"] == 1
    f_summary, g_summary = read_json(tmp_path / "f.json"), read_json(tmp_path / "g.json")
    assert f_summary["params"]["f"] == reference["f"] and g_summary["params"]["g"] == reference["g"]
    assert f_summary["steps"] == g_summary["steps"] == steps
    assert "reconnecting" in f.output and "shaking hands again" not in f.output, f.output


# The default suite covers a driver retrying on fresh connections until its peer answers again
# (tests/test_faults.py::test_server_restarted_while_the_driver_waits); a thawed peer, which then finds every
# resend queued, is slow.
@pytest.mark.slow
@pytest.mark.parametrize("frozen", ["g", "f"])
def test_a_peer_frozen_within_the_deadlines_then_thawed_changes_nothing(frozen, tmp_path, start_server):
    """SIGSTOP of either stage for longer than several reply timeouts but within every deadline, then SIGCONT:
    the driver's resends (each on a fresh connection) reach g together once it thaws, each is answered from the
    reply cache or refused as an older step, and both stages end bitwise equal to the in-process run."""
    steps = 40
    timeouts = ["--timeout", "0.2", "--liveness", "10", "--peer-deadline", "30"]
    experiment = write_experiment(tmp_path, "numpy", steps)
    reference = in_process_params(tmp_path, experiment, steps)
    g, endpoint = start_server(str(experiment), "--summary", str(tmp_path / "g.json"), *timeouts)
    metrics = tmp_path / "f.metrics.jsonl"
    with StageProcess(["f", "--experiment", experiment, "--connect", endpoint, "--metrics", metrics,
                       "--summary", tmp_path / "f.json", *timeouts], tmp_path / "f.log") as f:
        wait_for_file(metrics, f)
        while metrics.read_text().count("\n") < 3:     # a few steps applied: the run is in its lockstep loop
            assert f.proc.poll() is None and g.proc.poll() is None, f.output + g.output
        victim = g if frozen == "g" else f
        victim.signal(signal.SIGSTOP)
        try:
            with pytest.raises(subprocess.TimeoutExpired):      # past several of f's 0.2 s reply timeouts
                (f if frozen == "g" else g).proc.wait(1.5)
        finally:
            victim.signal(signal.SIGCONT)
        assert f.wait() == 0, f.output
    assert g.wait() == 0, g.output
    f_summary, g_summary = read_json(tmp_path / "f.json"), read_json(tmp_path / "g.json")
    assert f_summary["params"]["f"] == reference["f"] and g_summary["params"]["g"] == reference["g"]
    assert f_summary["steps"] == g_summary["steps"] == steps
    if frozen == "g":
        assert f.output.count("reconnecting") >= 2, f.output
