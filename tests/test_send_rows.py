"""``send_rows``: every training forward carries its micro-batch's row numbers, and the label owner trains on
the targets (an active one: its own columns too) of exactly those rows.

A run with it is bitwise equal to the run without it (processes and --in-process; micro-batches, steps in
flight, vertical parties, clients); a data owner whose loader takes other rows makes the label owner train
on those (equal to --in-process computing that order); rows the label owner may not train on are refused
with ``tensor`` and change nothing; parties that disagree on it, or send different rows, are refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

from conftest import StageGroup, digits_data_table, free_tcp_endpoint, hello_message, read_json, run_launcher, run_main
from distgrad.config.parse import load_experiment, parse_experiment
from distgrad.config.tomlfile import read_toml
from distgrad.errors import ConfigError, PeerRejected
from distgrad.run import handshake
from distgrad.run.inprocess import train_in_process
from distgrad.stage.stage import Stage
from distgrad.wire import messages as wire
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.transport import Client

import reordered_stage

BUILTINS = Path(__file__).parent.parent / "distgrad" / "experiments"
REORDERED = [sys.executable, str(Path(__file__).parent / "reordered_stage.py"), "--"]
DIGITS_STAGES = '''[[stages]]
name = "f"
model = [{ type = "dense", name = "f1", in = 64, out = 32 }, { type = "relu" }]
optimizer = { type = "adam", lr = 0.003 }

[[stages]]
name = "g"
model = [{ type = "dense", name = "g1", in = 32, out = 10 }]
optimizer = { type = "adam", lr = 0.003 }
loss = "softmax_cross_entropy"
'''


def _digits(tmp_path: Path, send_rows: bool = True, extra: str = "") -> Path:
    path = tmp_path / f"digits{'-rows' if send_rows else ''}.toml"
    path.write_text(f'name = "digits-rows"\nsteps = 30\nseed = 3\n{"send_rows = true" if send_rows else ""}\n'
                    f'{extra}\n{digits_data_table()}\n{DIGITS_STAGES}')
    return path


def _with_rows(builtin: str, tmp_path: Path, send_rows: bool = True) -> Path:
    """A built-in experiment (its data paths made absolute), with send_rows."""
    text = (BUILTINS / f"{builtin}.toml").read_text().replace("../datasets/", f"{BUILTINS.parent / 'datasets'}/")
    if send_rows:
        text = text.replace('\nseed = ', '\nsend_rows = true\nseed = ', 1)
    path = tmp_path / f"{builtin}{'-rows' if send_rows else ''}.toml"
    path.write_text(text)
    return path


def _in_process(experiment: Path, *flags: str) -> dict:
    path = experiment.with_suffix(".ref.json")
    result = run_main(["run", experiment, "--in-process", "--summary", path, *flags])
    assert result.returncode == 0, result.stderr
    return read_json(path)


def _launched(experiment: Path, *flags: str) -> dict:
    path = experiment.with_suffix(".run.json")
    result = run_launcher(["run", experiment, "--summary", path, *flags])
    assert result.returncode == 0, result.stdout + result.stderr
    return read_json(path)


# -------------------------------------------------------------------- the interface field

def test_send_rows_is_an_interface_field_only_when_set(tmp_path):
    plain, rows = load_experiment(_digits(tmp_path, False)), load_experiment(_digits(tmp_path))
    assert "send_rows" not in plain.interface_parts() and rows.interface_parts()["send_rows"] is True
    differ = {k for k in rows.interface_parts() if rows.interface_parts()[k] != plain.interface_parts().get(k)}
    # The data owner's loader picks the rows: the sample order digest covers the held-out rows alone.
    assert differ == {"send_rows", "sample order"}
    assert load_experiment("digits").interface_fingerprint == load_experiment("digits").interface_fingerprint
    assert run_main(["split", _digits(tmp_path), tmp_path / "files"]).returncode == 0
    for name in ("f", "g"):
        assert read_toml(tmp_path / "files" / name / f"{name}.toml")["interface"]["send_rows"] is True


def test_send_rows_where_it_cannot_act_is_refused(tmp_path):
    raw = read_toml(BUILTINS / "seed-reverse.toml")
    with pytest.raises(ConfigError, match="unbatched"):
        parse_experiment({**raw, "send_rows": True})
    with pytest.raises(ConfigError, match="must be true or false"):
        parse_experiment({**read_toml(_digits(tmp_path)), "send_rows": 1})
    first = read_toml(_digits(tmp_path))
    with pytest.raises(ConfigError, match='labels = "first"'):
        parse_experiment({**first, "labels": "first"})
    marvell = {**first, "stages": [first["stages"][0], {**first["stages"][1], "marvell": {"bound": 0.5}}]}
    with pytest.raises(ConfigError, match="Marvell reads its labels"):
        parse_experiment(marvell)
    meter = {**first, "stages": [first["stages"][0], {**first["stages"][1], "privacy_meter": True}]}
    with pytest.raises(ConfigError, match="with send_rows a step's rows"):
        parse_experiment(meter)


def test_the_label_owner_refuses_rows_it_may_not_train_on(tmp_path):
    """``refused_row``: out of range, held out, and (with [clients]) another data owner's shard."""
    exp = load_experiment(_digits(tmp_path))
    data = exp.build_data(stage="g")
    train, held = data.step_rows(1), int(data.test_rows[0])
    assert data.refused_row(train) is None
    assert data.refused_row(np.array([train[0], 1797])) == (1797, "out of range (the rows are 0 to 1796)")
    assert data.refused_row(np.array([held]))[1] == "held out for evaluation"
    client = exp.build_data(stage="g", client=None)
    client.shard(0, 2)
    other = np.setdiff1d(data.train_rows, client.train_rows)[:3]
    assert "another client's shard" in client.refused_row(other)[1]
    assert client.refused_row(client.step_rows(1)) is None
    assert np.array_equal(client.targets_at(client.step_rows(2)), client.targets(2))


# -------------------------------------------------------------------- bitwise equal to the plain run

@pytest.mark.parametrize("flags", [["--micro-batches", "2", "--eval-every", "10"],
                                   ["--staleness", "2", "--transport", "ipc"]])
def test_send_rows_over_processes_equals_the_plain_run(tmp_path, flags):
    rows = _launched(_digits(tmp_path), *flags)
    assert rows["params"] == _in_process(_digits(tmp_path), *flags)["params"]
    assert rows["params"] == _in_process(_digits(tmp_path, False), *flags)["params"]
    if "--eval-every" in flags:
        assert len(rows["evaluations"]) == 3


def test_send_rows_through_a_chain_equals_the_plain_run(tmp_path):
    """The middle stages pass the rows on to the label owner, which takes their targets."""
    plain = _with_rows("chain4-classify", tmp_path, False)
    plain.write_text(plain.read_text().replace('labels = "first"', 'labels = "last"'))
    rows = tmp_path / "chain-rows.toml"
    rows.write_text(plain.read_text().replace('labels = "last"', 'labels = "last"\nsend_rows = true'))
    flags = ["--steps", "12", "--micro-batches", "2"]
    summary = _launched(rows, *flags)
    assert summary["params"] == _in_process(rows, *flags)["params"] == _in_process(plain, *flags)["params"]


def test_send_rows_of_vertical_parties_and_an_active_label_owner_equal_the_plain_run(tmp_path):
    text = _with_rows("vertical-classify", tmp_path).read_text()
    c, g = text.index('[[stages]]\nname = "c"'), text.index('[[stages]]\nname = "g"')
    active = tmp_path / "active.toml"        # party c's columns held by the label owner under its own bottom
    active.write_text(text[:c] + '[[stages]]\nname = "g"\ncolumns = [8, 9, 10, 11]\nbottom = [{ type = "dense", '
                      'name = "own1", in = 4, out = 8 }, { type = "tanh" }]\n' + text[g + 22:])
    flags = ["--steps", "20", "--micro-batches", "2"]
    summary = _launched(active, *flags)
    assert summary["params"] == _in_process(active, *flags)["params"]
    plain = tmp_path / "active-plain.toml"
    plain.write_text(active.read_text().replace("send_rows = true\n", ""))
    assert summary["params"] == _in_process(plain, *flags)["params"]


def test_send_rows_of_clients_each_its_own_shard_equal_the_plain_run(tmp_path):
    flags = ["--steps", "12"]
    summary = _launched(_with_rows("digits-clients", tmp_path), *flags)
    assert summary["params"] == _in_process(_with_rows("digits-clients", tmp_path), *flags)["params"]
    assert summary["params"] == _in_process(_with_rows("digits-clients", tmp_path, False), *flags)["params"]


# -------------------------------------------------------------------- the data owner decides the rows

class _Pair(StageGroup):
    """f (its loader reversed: ``reordered_stage.py``) and g of one experiment."""

    def __init__(self, tmp_path: Path, experiment: Path, *flags: str) -> None:
        super().__init__(tmp_path)
        endpoint = free_tcp_endpoint()
        common = ["--experiment", experiment, "--summary"]
        self.args = {"g": ["g", "--bind", endpoint, *common, tmp_path / "g.json"],
                     "f": ["f", "--connect", endpoint, *common, tmp_path / "f.json", *flags]}
        self.commands = {"f": REORDERED}


def test_the_label_owner_trains_on_the_rows_the_data_owner_sends(tmp_path, stage_group, monkeypatch):
    experiment = _digits(tmp_path)
    pair = stage_group(_Pair, tmp_path, experiment, "--micro-batches", "2")
    pair.start("g")
    pair.start("f")
    pair.wait_all()
    exp = load_experiment(experiment)
    own_order = train_in_process(exp, micro_batches=2)["params"]
    monkeypatch.setattr(reordered_stage.RowBatches, "epoch_order", reordered_stage.RowBatches.epoch_order)
    reordered_stage.reverse_epochs()
    reference = train_in_process(exp, micro_batches=2)["params"]
    assert read_json(tmp_path / "g.json")["params"]["g"] == reference["g"] != own_order["g"]
    assert read_json(tmp_path / "f.json")["params"]["f"] == reference["f"]


# -------------------------------------------------------------------- refusals

def _forward(step: int, activation: np.ndarray, rows: np.ndarray | None, mb: int = 0, mbs: int = 1) -> Message:
    tensors = {"activation": activation, **({"rows": rows} if rows is not None else {})}
    return Message(wire.FORWARD, "run-1", step, mb, mbs, tensors=tensors)


def _refused(client: Client, msg: Message, code: ErrorCode, text: str) -> None:
    with pytest.raises(PeerRejected) as info:
        client.request(msg, 5)
    assert info.value.code == code and text in str(info.value), info.value


def test_bad_rows_are_refused_and_change_nothing(start_server, tmp_path, zmq_ctx):
    """Drive f by hand over a real socket and slip bad rows in before every step: g's result is unchanged."""
    steps, experiment = 8, _digits(tmp_path)
    g, endpoint = start_server(str(experiment), "--summary", tmp_path / "g.json")
    exp = load_experiment(experiment)
    f, data = Stage.from_experiment(exp, "f"), exp.build_data(stage="f")
    held_out, train = int(data.test_rows[0]), data.step_rows(1)
    client = Client(zmq_ctx, endpoint)
    assert client.request(hello_message(exp, "run-1"), 5).type == wire.WELCOME
    for step in range(1, steps + 1):
        y, cache = f.forward(data.features(step))
        rows = data.step_rows(step).astype(np.int64)
        for bad, text in [(np.where(np.arange(32) == 3, 1797, rows), "row 1797 out of range"),
                          (np.where(np.arange(32) == 5, -1, rows), "row -1 out of range"),
                          (np.where(np.arange(32) == 0, held_out, rows), f"row {held_out} held out"),
                          (np.where(np.arange(32) == 7, rows[2], rows), f"row {rows[2]} appears twice")]:
            _refused(client, _forward(step, y, bad), ErrorCode.TENSOR, text)
        _refused(client, _forward(step, y, rows.astype(np.int32)), ErrorCode.TENSOR, "rows")
        # One integer per row, shape (32,): the same 32 integers in another shape are refused too, though a
        # binary header would carry their bytes alike (they go self-describing); so are floats.
        for shaped in (rows.reshape(4, 8), rows.reshape(32, 1), rows.astype(np.float64), rows.astype(np.uint16)):
            _refused(client, _forward(step, y, shaped), ErrorCode.TENSOR, "'rows'")
        _refused(client, _forward(step, y, None), ErrorCode.TENSOR, "rows")
        reply = client.request(_forward(step, y, rows), 5)
        wire.expect_tensors(reply, {"activation_grad": (y.shape, np.float32)})
        _, grads = f.backward(cache, reply.tensors["activation_grad"].copy())
        f.apply(grads)
    client.request(Message(wire.BYE, "run-1", steps + 1, body={"steps": steps}), 5)
    assert g.wait() == 0, g.output
    reference = _in_process(experiment, "--steps", str(steps))["params"]
    assert read_json(tmp_path / "g.json")["params"]["g"] == reference["g"]
    assert {k: v.tolist() for k, v in f.params.items()} == reference["f"]
    assert len(train) == 32


def test_a_row_twice_in_a_step_across_micro_batches_is_refused(start_server, tmp_path):
    experiment = _digits(tmp_path)
    g, endpoint = start_server(str(experiment))
    exp = load_experiment(experiment)
    data = exp.build_data(stage="f")
    ctx = zmq.Context.instance()
    client = Client(ctx, endpoint)
    assert client.request(hello_message(exp, "run-1", micro_batches=2), 5).type == wire.WELCOME
    rows = data.step_rows(1).astype(np.int64)
    y = np.zeros((16, 32), np.float32)
    assert client.request(_forward(1, y, rows[:16], 0, 2), 5).type == wire.BACKWARD
    _refused(client, _forward(1, y, np.concatenate([rows[16:31], rows[4:5]]), 1, 2), ErrorCode.TENSOR,
             f"row {rows[4]} appears twice in the step")
    assert client.request(_forward(1, y, rows[16:], 1, 2), 5).type == wire.BACKWARD


def test_a_party_without_send_rows_is_refused_at_the_handshake(start_server, tmp_path):
    g, endpoint = start_server(str(_digits(tmp_path)))
    result = run_main(["stage", "f", "--experiment", _digits(tmp_path, False), "--connect", endpoint,
                       "--peer-deadline", "10"])
    assert result.returncode == 4 and "send_rows: f has nothing, g has True" in result.stderr, result.stderr


def test_vertical_parties_sending_different_rows_are_refused(start_server, tmp_path, zmq_ctx):
    experiment = _with_rows("vertical-classify", tmp_path)
    g, endpoint = start_server(str(experiment), "--steps", "5")
    exp = load_experiment(experiment)
    rows = exp.build_data(stage="a").step_rows(1).astype(np.int64)
    clients = {}
    for i, party in enumerate(exp.data_owners):
        clients[party] = Client(zmq_ctx, endpoint)
        hello = handshake.hello(exp, party, exp.seed, exp.cuts[i], f"run-{party}", [0], 5, 1)
        assert clients[party].request(hello, 5).type == wire.WELCOME
    for party in exp.data_owners:
        sent = rows if party != "b" else rows[::-1].copy()
        clients[party].send(Message(wire.FORWARD, f"run-{party}", 1, tensors={
            "activation": np.zeros((32, 8), np.float32), "rows": sent}))
    for party in exp.data_owners:
        with pytest.raises(PeerRejected) as info:
            clients[party].wait(f"run-{party}", {(1, 0)}, 5)
        assert info.value.code == ErrorCode.MISMATCH, info.value
        assert "the feature parties sent different rows for step 1" in str(info.value)


@pytest.mark.slow       # two torch processes and two in-process runs: about 5-8 s
def test_send_rows_with_torch_stages_equals_the_plain_run(tmp_path):
    """Both stages computed by torch (framework "torch"): the rows cross and pick the label owner's targets
    as with numpy stages, bitwise the run without send_rows."""
    pytest.importorskip("torch", reason="torch is not installed: send_rows on torch stages is not tested")
    torch_stages = lambda path: path.write_text(path.read_text().replace(  # noqa: E731
        'optimizer = { type = "adam", lr = 0.003 }', 'optimizer = { type = "adam", lr = 0.003 }\nframework = "torch"'))
    rows, plain = _digits(tmp_path), _digits(tmp_path, False)
    torch_stages(rows), torch_stages(plain)
    assert read_toml(rows, "experiment")["stages"][0]["framework"] == "torch"
    flags = ["--steps", "12", "--micro-batches", "2"]
    summary = _launched(rows, *flags)
    assert summary["params"] == _in_process(rows, *flags)["params"] == _in_process(plain, *flags)["params"]
