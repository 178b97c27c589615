"""Wire codecs end to end: every codec, both directions, bitwise equal to the in-process reference.

Runs over processes are few and short (one per codec, both directions coded at once, with
micro-batches; one chain and one vertical run; one kill -9 and resume with error feedback);
the rest is in-process or the serving stage without sockets.
"""

from __future__ import annotations


import numpy as np
import pytest

from distgrad.wire import messages as wire
from distgrad.wire.codecs import parse_codec
from distgrad.config.experiment import BUILTIN_DIR
from distgrad.config.parse import load_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.run.options import StageOptions
from distgrad.run.serving import ServingStage
from distgrad.stage.stage import Stage
from distgrad.wire.messages import ErrorCode, Message

from conftest import free_tcp_endpoint, read_json, read_lines, run_launcher, run_main
from handshake import hello_message, only_reply
from test_faults import Pair

# digits' cut is 32x64 a batch (and it holds rows out, so evaluations cross too): topk keeps 16 of each
# row's 64 entries.
CODECS = ["none", "float16", "bfloat16", "int8", "topk:16", "topk:16+ef"]
CUT = (32, 64)
STEPS, MICRO_BATCHES = 40, 2
PEER = [b"peer"]


def _run(tmp_path, label, *args):
    """``distgrad run ARGS --summary``: stage processes, or with --in-process the reference in this process."""
    path = tmp_path / f"{label}.json"
    run = run_main if "--in-process" in args else run_launcher
    result = run(["run", *map(str, args), "--summary", path])
    assert result.returncode == 0, result.stdout + result.stderr
    return read_json(path)


def _codec_args(activation: str, gradient: str) -> list[str]:
    return ["--activation-codec", activation, "--gradient-codec", gradient]


@pytest.mark.parametrize("codec", CODECS)
def test_each_codec_both_directions_over_processes_is_bitwise_the_in_process_run(tmp_path, codec):
    args = ["digits", "--steps", STEPS, "--micro-batches", MICRO_BATCHES, *_codec_args(codec, codec)]
    reference = _run(tmp_path, "inproc", *args, "--in-process")
    summary = _run(tmp_path, "run", *args, "--metrics", tmp_path / "metrics.jsonl")
    assert summary["params"] == reference["params"]
    assert summary["final_loss"] == reference["final_loss"]
    assert summary["test_loss"] == reference["test_loss"]          # evaluations cross coded too
    assert summary["test_accuracy"] == reference["test_accuracy"]
    # The metrics count what crossed: each step sends M coded activations and receives M coded gradients,
    # plus at most a few hundred bytes of header per message.
    lines = read_lines(tmp_path / "metrics.jsonl")
    sent = lines[2]["bytes_sent"] - lines[1]["bytes_sent"]
    received = lines[2]["bytes_received"] - lines[1]["bytes_received"]
    coded = MICRO_BATCHES * parse_codec(codec).wire_bytes((CUT[0] // MICRO_BATCHES, CUT[1]))
    assert coded <= sent <= coded + 400 * MICRO_BATCHES
    assert coded <= received <= coded + 400 * MICRO_BATCHES
    if codec == "float16":
        plain = 4 * CUT[0] * CUT[1]
        assert 0.5 <= sent / plain < 0.6 and 0.5 <= received / plain < 0.6   # about half of float32's


def test_the_codecs_change_what_the_receiver_computes_with():
    """Not a no-op: each lossy codec gives other parameters than none (so the equality above is not vacuous)."""
    exp = load_experiment("digits")
    plain = train_in_process(exp, steps=5, micro_batches=MICRO_BATCHES)["params"]
    for codec in CODECS[1:]:
        for activation, gradient in ((codec, "none"), ("none", codec)):
            coded = train_in_process(exp.with_codecs(activation, gradient), steps=5, micro_batches=MICRO_BATCHES)
            assert coded["params"] != plain, (activation, gradient)


@pytest.mark.parametrize("experiment,activation,gradient", [
    ("chain4-classify", "topk:8+ef", "int8"),          # middle stages encode both ways
    ("vertical-classify", "bfloat16", "topk:4+ef"),    # each feature party's embedding and its gradient
])
def test_chains_and_feature_parties_code_every_cut_bitwise(tmp_path, experiment, activation, gradient):
    args = [experiment, "--steps", 15, "--micro-batches", 2, *_codec_args(activation, gradient)]
    assert _run(tmp_path, "run", *args)["params"] == _run(tmp_path, "inproc", *args, "--in-process")["params"]


@pytest.mark.parametrize("experiment,activation,gradient", [
    ("digits-clients", "int8", "topk:16+ef"),        # g keeps one residual stream per client
    ("digits-splitfed", "topk:16+ef", "bfloat16"),   # each client's own residuals, across averaging
])
def test_several_clients_code_every_cut_bitwise(tmp_path, experiment, activation, gradient):
    """With ``[clients]`` every client's cut is coded both ways, over processes as in one, client by client."""
    args = [experiment, "--steps", 12, "--micro-batches", 2, *_codec_args(activation, gradient)]
    summary, reference = _run(tmp_path, "run", *args), _run(tmp_path, "inproc", *args, "--in-process")
    assert summary["params"] == reference["params"]
    results = [[{k: c[k] for k in ("client", "final_loss", "evaluations")} for c in run["clients"]]
               for run in (summary, reference)]
    assert results[0] == results[1]                                 # each client's loss and evaluations
    plain = _run(tmp_path, "plain", experiment, "--steps", 12, "--micro-batches", 2, "--in-process")
    assert plain["params"] != reference["params"]                 # the codecs did change what was computed


def test_kill_9_and_resume_with_error_feedback_is_bitwise(tmp_path, stage_group):
    """Residuals are stage state: checkpointed, restored on resume and on the rollback that follows."""
    steps, codec = "300", "topk:8+ef"
    pair = stage_group(Pair, tmp_path, "tanh-regression", steps, free_tcp_endpoint())
    for name in ("f", "g"):
        pair.args[name] += _codec_args(codec, codec)
    pair.args["f"] += ["--micro-batches", "2"]
    pair.start("g")
    pair.start("f")
    for victim, target in (("g", 90), ("f", 190)):
        pair.wait_for_step(target)
        pair.kill_9_and_restart(victim)
    f_summary, g_summary = pair.finish()
    reference = train_in_process(load_experiment("tanh-regression").with_codecs(codec, codec), steps=int(steps),
                                 micro_batches=2)
    assert f_summary["params"]["f"] == reference["params"]["f"]
    assert g_summary["params"]["g"] == reference["params"]["g"]


def test_digits_keeps_its_accuracy_with_each_codec_both_ways():
    """Held-out accuracy of the digits built-in with each codec on both directions (in-process: the runs
    over processes are bitwise the same). Figures at seed 0: none, float16, bfloat16, int8 0.9916;
    topk:24 0.9721; topk:24+ef 0.9861 (topk:16 falls to 0.925)."""
    exp = load_experiment("digits")
    for codec in ["float16", "bfloat16", "int8", "topk:24", "topk:24+ef"]:
        summary = train_in_process(exp.with_codecs(codec, codec))
        assert summary["test_accuracy"] >= 0.95, (codec, summary["test_accuracy"])


# ---------------------------------------------------------------- configuration and handshake

def test_a_bad_codec_is_a_configuration_error(tmp_path):
    for codec in ("fp8", "topk:0", "topk:33", "topk:8+EF"):
        result = run_main(["run", "tanh-regression", "--in-process", "--activation-codec", codec])
        assert result.returncode == 2 and "codec" in result.stderr, (codec, result.stderr)
    experiment = tmp_path / "bad.toml"
    experiment.write_text((BUILTIN_DIR / "tanh-regression.toml").read_text()
                          .replace('labels = "last"', 'labels = "last"\ngradient_codec = "int4"'))
    result = run_main(["run", str(experiment), "--in-process"])
    assert result.returncode == 2 and "'gradient_codec'" in result.stderr and "int4" in result.stderr


def test_a_codec_of_a_one_stage_experiment_is_refused_not_ignored(tmp_path):
    """Nothing crosses a wire in an experiment of one stage: a codec there (flag or key) is refused, naming
    the direction, rather than accepted and never applied."""
    from test_staleness import ONE_STAGE

    experiment = tmp_path / "one.toml"
    experiment.write_text(ONE_STAGE)
    for flag, key in (("--activation-codec", "activation_codec"), ("--gradient-codec", "gradient_codec")):
        result = run_main(["run", experiment, "--in-process", flag, "int8"])
        assert result.returncode == 2 and f"{key} 'int8'" in result.stderr and "one stage" in result.stderr
        keyed = tmp_path / f"{key}.toml"
        keyed.write_text(ONE_STAGE.replace("steps = 4\n", f'steps = 4\n{key} = "float16"\n'))
        result = run_main(["run", keyed])
        assert result.returncode == 2 and f"{key} 'float16'" in result.stderr, result.stderr
    assert run_main(["run", experiment, "--in-process", "--activation-codec", "none"]).returncode == 0


def test_a_codec_of_finite_values_only_is_refused_where_nan_may_cross(tmp_path):
    """int8 and topk:K carry finite values only: with allow_nonfinite (NaN and Inf may cross) they are refused
    at configuration, naming the direction, rather than failing the first step that holds one; float16 and
    bfloat16 carry NaN and Inf and are taken."""
    experiment = tmp_path / "nonfinite.toml"
    experiment.write_text((BUILTIN_DIR / "tanh-regression.toml").read_text()
                          .replace('labels = "last"', 'labels = "last"\nallow_nonfinite = true'))
    for flag, key, codec in (("--activation-codec", "activation_codec", "int8"),
                             ("--gradient-codec", "gradient_codec", "topk:4+ef")):
        result = run_main(["run", experiment, "--in-process", "--steps", "2", flag, codec])
        assert result.returncode == 2, result.stderr
        assert f"{key} {codec!r} carries only finite values" in result.stderr and "allow_nonfinite" in result.stderr
    for codec in ("float16", "bfloat16"):
        assert run_main(["run", experiment, "--in-process", "--steps", "2", "--activation-codec", codec,
                         "--gradient-codec", codec]).returncode == 0


def test_no_codec_keeps_the_interface_and_a_codec_is_part_of_it():
    exp = load_experiment("tanh-regression")
    assert exp.with_codecs("none", "none") is exp
    assert not any("codec" in key for key in exp.interface_parts())
    coded = exp.with_codecs("topk:08", None)
    assert coded.interface_parts()["activation_codec"] == "topk:8"       # canonical
    assert coded.interface_fingerprint != exp.interface_fingerprint
    assert coded.fingerprint != exp.fingerprint                           # its checkpoints are not this run's


def test_a_hello_with_other_codecs_is_refused_naming_the_field():
    exp = load_experiment("tanh-regression")
    server = ServingStage(StageOptions(exp.with_codecs("float16", None), "g", exp.seed))
    with pytest.raises(wire.ProtocolError) as refused:
        server.handle(PEER, hello_message(exp, "r"), 0.0)
    assert refused.value.code == ErrorCode.MISMATCH
    assert "activation_codec: f has nothing, g has 'float16'" in str(refused.value)


@pytest.mark.integration        # the cut library's label owner binds a socket (it receives nothing)
def test_a_hello_keeping_steps_in_flight_is_refused_where_error_feedback_cannot_follow():
    """Steps in flight with an error-feedback codec are refused by the data owner's configuration; a peer
    whose hello asks for them anyway is refused by the serving stage and by the cut library's label owner
    for the same reason (and taken without the codec's +ef)."""
    from distgrad.run.cut_server import CutServer

    exp = load_experiment("tanh-regression").with_codecs(None, "topk:8+ef")
    server = ServingStage(StageOptions(exp, "g", exp.seed))
    with pytest.raises(wire.ProtocolError) as refused:
        server.handle(PEER, hello_message(exp, "r", staleness=1), 0.0)
    assert refused.value.code == ErrorCode.MISMATCH and "error feedback" in str(refused.value)
    with CutServer.bind("tcp://127.0.0.1:*", name="cut-unit", stages=["f", "g"], batch=4, activation=[3],
                        steps=3, seed=0, gradient_codec="topk:2+ef", liveness_s=1.0, peer_deadline_s=1.0) as library:
        with pytest.raises(wire.ProtocolError, match="error feedback"):
            library._hello(hello_message(library.exp, "r", staleness=1), "")
        library._hello(hello_message(library.exp, "r"), "")           # in lockstep it serves
    plain = load_experiment("tanh-regression").with_codecs(None, "topk:8")
    reply = only_reply(ServingStage(StageOptions(plain, "g", plain.seed)).handle(
        PEER, hello_message(plain, "r", staleness=1), 0.0))
    assert reply.type == wire.WELCOME


# ---------------------------------------------------------------- the receiver, hostile parts

def _topk_server():
    exp = load_experiment("tanh-regression").with_codecs("topk:8", None)
    server = ServingStage(StageOptions(exp, "g", exp.seed))
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    return server, exp


def _topk_forward(exp, values=None, indices=None) -> Message:
    f = Stage.from_experiment(exp, "f")
    y = f.forward(exp.build_data().features(1))[0]
    parts = parse_codec("topk:8").encode(y)
    return Message(wire.FORWARD, "r", 1, tensors={"activation.values": parts["values"] if values is None else values,
                                                  "activation.indices": parts["indices"] if indices is None
                                                  else indices})


def test_hostile_coded_parts_are_refused_and_change_nothing():
    server, exp = _topk_server()
    good = _topk_forward(exp)
    indices = good.tensors["activation.indices"]
    cases = {
        "indices out of range": _topk_forward(exp, indices=np.where(indices == indices.max(), 32, indices)
                                              .astype(np.int32)),
        "indices not increasing": _topk_forward(exp, indices=indices[:, ::-1].copy()),
        "wrong dtype": _topk_forward(exp, indices=indices.astype(np.int64)),
        "wrong shape": _topk_forward(exp, values=good.tensors["activation.values"][:, :4].copy()),
        "the plain tensor instead": Message(wire.FORWARD, "r", 1, tensors={"activation": np.zeros((32, 32),
                                                                                                 np.float32)}),
    }
    before = {k: v.copy() for k, v in server.stage.params.items()}
    for what, msg in cases.items():
        with pytest.raises(wire.ProtocolError) as refused:
            server.handle(PEER, msg, 0.0)
        assert refused.value.code == ErrorCode.TENSOR, what
    reply = only_reply(server.handle(PEER, good, 0.0))           # nothing of the refusals was kept
    assert reply.type == wire.BACKWARD and set(reply.tensors) == {"activation_grad"}
    server.settle()
    assert server.stage.step == 1 and any(not np.array_equal(before[k], v) for k, v in server.stage.params.items())


def test_a_bfloat16_nan_is_refused_as_nonfinite():
    exp = load_experiment("tanh-regression").with_codecs("bfloat16", None)
    server = ServingStage(StageOptions(exp, "g", exp.seed))
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    bits = np.full((32, 32), 0x7FC0, np.uint16)                   # quiet NaN
    with pytest.raises(wire.ProtocolError) as refused:
        server.handle(PEER, Message(wire.FORWARD, "r", 1, tensors={"activation.bits": bits}), 0.0)
    assert refused.value.code == ErrorCode.NONFINITE


# ---------------------------------------------------------------- values a codec cannot carry

OVERFLOW = """
name = "overflow"
steps = 3
[data]
kind = "synthetic_regression"
samples = 256
features = 4
outputs = 1
hidden = 8
batch = 32
[[stages]]
name = "f"
model = [{ type = "dense", name = "f1", in = 4, out = 8, init = 30000.0 }]
[[stages]]
name = "g"
model = [{ type = "dense", name = "g1", in = 8, out = 1 }]
loss = "sum_squared_error"
"""


def test_a_float16_overflow_fails_the_run_naming_tensor_and_step(tmp_path):
    experiment = tmp_path / "overflow.toml"
    experiment.write_text(OVERFLOW)
    result = run_main(["run", str(experiment), "--in-process", "--activation-codec", "float16"])
    assert result.returncode == 1
    assert "codec float16: tensor 'activation/mb0of1' at step 1" in result.stderr
    assert "beyond float16's range" in result.stderr
    # The gradient direction, over processes: the serving stage fails the step, nothing is applied, and
    # every stage exits 1 (as for a non-finite gradient).
    result = run_launcher(["run", experiment, "--gradient-codec", "float16", "--init", "g1.W=30000",
                           "--summary", tmp_path / "s.json"])
    assert result.returncode == 1, result.stdout + result.stderr
    message = "stage g: codec float16: tensor 'activation_grad/mb0of1' at step 1"
    for stage in ("f", "g"):            # both name the tensor and the step (and both exit 1)
        assert any(line.startswith(f"[{stage}] ") and message in line for line in result.stdout.splitlines())


def test_residuals_become_state_only_with_the_update():
    """A step's residuals are pending until committed (the update) and forgotten when it is dropped, so a
    micro-batch sent again after a rollback is encoded from the same residual."""
    from distgrad.wire.wirecodec import ACTIVATION, Senders

    senders = Senders({ACTIVATION: parse_codec("topk:1+ef")})
    x = np.array([[3.0, 1.0, 2.0]], np.float32)
    first = senders.encode(ACTIVATION, x, "s", 1)
    senders.discard()                                             # the step was dropped: same bits again
    assert all(np.array_equal(first[k], v) for k, v in senders.encode(ACTIVATION, x, "s", 1).items())
    assert senders.state_arrays() == {}
    senders.commit()
    np.testing.assert_array_equal(senders.state_arrays()["codec/s"], [[0.0, 1.0, 2.0]])
    assert senders.roundtrip(ACTIVATION, x, "s", 2).tolist() == [[0.0, 0.0, 4.0]]   # 2 + residual 2 wins


def test_a_bad_coded_reply_is_named_by_stage_step_and_micro_batch():
    """A backward reply whose int8 gradient is malformed: the refusal names the stage that sent it, the
    step and the micro-batch, not only the codec's complaint."""
    from distgrad.wire.link import check_reply
    from distgrad.wire.wirecodec import Expected, WireTensor

    specs = Expected(WireTensor("activation_grad", (4, 3), parse_codec("int8")))
    reply = Message(wire.BACKWARD, "run", 7, 1, 2, body={"loss": 0.5},
                    tensors={"activation_grad.q": np.zeros((4, 3), np.int8),
                             "activation_grad.scale": np.array([1, -1, 1, 1], np.float32)})
    with pytest.raises(wire.ProtocolError) as refused:
        check_reply(reply, 7, specs, False, "g")
    assert str(refused.value) == ("tensor: stage g's reply to step 7 micro-batch 1/2: codec int8: every 'scale' "
                                  "must be finite and >= 0")
