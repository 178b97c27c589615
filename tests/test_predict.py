"""``distgrad predict``: forward only through live stages, the predictions written at the
label owner only; nothing but an acknowledgement travels back to the data owner."""

from __future__ import annotations

import csv
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from distgrad.wire import messages as wire
from distgrad.errors import ProtocolError
from distgrad.config.parse import load_experiment
from distgrad.run.options import StageOptions
from distgrad.run.predict import PredictionServer
from distgrad.stage.stage import Stage
from distgrad.wire.messages import ErrorCode, Message

from conftest import StageProcess, read_json, run_cli, run_launcher, run_main, wait_for_file


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The digits experiment split into two parties' files and trained; their halves saved."""
    root = tmp_path_factory.mktemp("predict")
    assert run_main(["split", "digits", root / "parties"]).returncode == 0
    result = run_launcher(["run", root / "parties" / "f" / "f.toml", root / "parties" / "g" / "g.toml",
                           "--steps", "150", "--save", root / "halves", "--summary", root / "summary.json"])
    assert result.returncode == 0, result.stderr
    return root

def _serving_in_thread(serve: Callable[[], Any], ready: Path) -> tuple[threading.Thread, list[BaseException]]:
    """``serve`` (a label owner's ``serve_predictions``) in a daemon thread, returned once it is bound (its
    ``ready`` file written; at most 30 s), with the list that gets what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            serve()
        except BaseException as e:        # noqa: BLE001 - the thread's outcome, asserted by the caller
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    for _ in range(1500):
        if ready.exists() or not thread.is_alive():
            break
        thread.join(0.02)
    assert ready.exists(), raised
    return thread, raised



def _expected(root: Path, rows: np.ndarray) -> np.ndarray:
    """The predictions computed in one process from the saved halves."""
    exp = load_experiment([root / "parties" / "f" / "f.toml", root / "parties" / "g" / "g.toml"])
    f, g = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    f.load_parameters(root / "halves" / "f.npz")
    g.load_parameters(root / "halves" / "g.npz")
    return exp.final_loss.predict(g.forward(f.forward(rows)[0])[0])


def _predict_two(tmp_path: Path, g_args: list, f_args: list) -> tuple[str, str]:
    """``distgrad predict`` served by g (``g_args``: its stage file or experiment, --load, --output, ...) and sent
    by f (``f_args``); both must exit 0. Returns f's and g's output."""
    ready = tmp_path / "g.ready"
    with StageProcess(["predict", *g_args, "--bind", "tcp://127.0.0.1:*", "--ready-file", ready], tmp_path / "g.log",
                      distgrad=True) as g:
        endpoint = wait_for_file(ready, g)
        f = run_cli(["predict", *f_args, "--connect", endpoint])
        assert f.returncode == 0, f.stderr
        assert g.wait() == 0, g.output
        return f.stdout + f.stderr, g.output


def _predict(root: Path, tmp_path: Path, output: Path, *f_extra, g_extra: tuple = ()) -> tuple[str, str]:
    return _predict_two(tmp_path, [root / "parties" / "g" / "g.toml", "--load", root / "halves" / "g.npz",
                                   "--output", output, *g_extra],
                        [root / "parties" / "f" / "f.toml", "--load", root / "halves" / "f.npz", *f_extra])


def test_the_label_owner_writes_the_predictions_of_the_held_out_rows(trained: Path, tmp_path: Path):
    output = tmp_path / "predictions.csv"
    f_output, g_output = _predict(trained, tmp_path, output)
    table = np.loadtxt(output, delimiter=",", skiprows=1, dtype=np.int64)
    exp = load_experiment(trained / "parties" / "g" / "g.toml")
    labels = exp.build_data().test_targets()
    assert np.array_equal(table[:, 0], np.arange(len(labels)))
    rows = load_experiment(trained / "parties" / "f" / "f.toml").build_data().test_features()
    assert np.array_equal(table[:, 1], _expected(trained, rows))
    accuracy = float((table[:, 1] == labels).mean())
    assert accuracy == read_json(trained / "summary.json")["test_accuracy"]
    assert f"sent {len(labels)} rows" in f_output and "row,prediction" not in f_output
    assert f"wrote {len(labels)} predictions" in g_output


def test_new_rows_from_a_file_give_npy_predictions(trained: Path, tmp_path: Path):
    rows = np.random.default_rng(1).integers(0, 17, size=(45, 64)).astype(np.float64)
    np.savetxt(tmp_path / "rows.csv", rows, delimiter=",", fmt="%d")
    output = tmp_path / "predictions.npy"
    _predict(trained, tmp_path, output, "--input", tmp_path / "rows.csv")
    predictions = np.load(output)
    assert predictions.dtype == np.int64 and predictions.shape == (45,)
    assert np.array_equal(predictions, _expected(trained, rows.astype(np.float32) * np.float32(0.0625)))


def test_rows_of_the_wrong_width_are_a_configuration_error(trained: Path, tmp_path: Path):
    np.save(tmp_path / "rows.npy", np.zeros((3, 10), np.float32))
    result = run_cli(["predict", trained / "parties" / "f" / "f.toml", "--connect", "tcp://127.0.0.1:9", "--load",
                      trained / "halves" / "f.npz", "--input", tmp_path / "rows.npy"])
    assert result.returncode == 2 and "rows of shape (10,)" in result.stderr
    result = run_cli(["predict", trained / "parties" / "g" / "g.toml", "--bind", "tcp://127.0.0.1:*", "--load",
                      trained / "halves" / "g.npz"])
    assert result.returncode == 2 and "--output" in result.stderr


def test_the_prediction_server_refuses_bad_input_and_keeps_its_state(trained: Path, tmp_path: Path):
    exp = load_experiment(trained / "parties" / "g" / "g.toml")
    server = PredictionServer(StageOptions(exp, "g", exp.seed, load_path=trained / "halves" / "g.npz"),
                              tmp_path / "out.npy", None)
    f_exp = load_experiment(trained / "parties" / "f" / "f.toml")
    from distgrad.run import handshake
    hello = handshake.hello(f_exp, "f", f_exp.seed, f_exp.cuts[0], "run1", [0], 0, 1)
    with pytest.raises(ProtocolError, match="not a training run"):
        server.handle(hello, 0.0)                       # a training hello
    hello.body.update(purpose="predict", rows=40)
    with pytest.raises(ProtocolError) as info:
        server.handle(Message(wire.PREDICT, "run1", 1), 0.0)
    assert info.value.code == ErrorCode.RUN
    assert server.handle(hello, 0.0).type == wire.WELCOME
    chunk = np.ones((32, 64), np.float32)
    for bad in (np.ones((33, 64), np.float32), np.ones((32, 63), np.float32), np.ones((0, 64), np.float32),
                chunk.astype(np.float64), np.full((32, 64), np.nan, np.float32)):
        with pytest.raises(ProtocolError):
            server.handle(Message(wire.PREDICT, "run1", 1, tensors={"activation": bad}), 0.1)
    assert server.session.chunks == {}
    assert server.handle(Message(wire.PREDICT, "run1", 1, tensors={"activation": chunk}), 0.2).body == {"rows": 32}
    assert server.handle(Message(wire.PREDICT, "run1", 1, tensors={"activation": chunk}), 0.3).body == {"rows": 32}
    with pytest.raises(ProtocolError, match="missing chunks"):
        server.handle(Message(wire.BYE, "run1", 3, body={"chunks": 2, "rows": 40}), 0.4)
    assert not (tmp_path / "out.npy").exists()
    server.handle(Message(wire.PREDICT, "run1", 2, tensors={"activation": chunk[:8]}), 0.5)
    reply = server.handle(Message(wire.BYE, "run1", 3, body={"chunks": 2, "rows": 40}), 0.6)
    assert reply.type == wire.BYE and not reply.tensors and np.load(tmp_path / "out.npy").shape == (40,)


def _predict_through_a_chain(parties: Path, halves: Path, tmp_path: Path, rows: Path, run: str) -> tuple[int, list]:
    """g, m2 and m1 serve ``distgrad predict`` (g writes ``out-RUN.npy``), then f sends ``rows``; returns f's exit
    code and the stopped serving processes (their exit codes and output)."""
    procs, below = [], None
    try:
        for name in ("g", "m2", "m1"):
            ready = tmp_path / f"{name}.{run}.ready"
            args = ["predict", parties / name / f"{name}.toml", "--bind", "tcp://127.0.0.1:*", "--ready-file", ready,
                    "--load", halves / f"{name}.npz"]
            args += ["--output", tmp_path / f"out-{run}.npy"] if below is None else ["--connect", below]
            procs.append(StageProcess(args, tmp_path / f"{name}.{run}.log", distgrad=True))
            below = wait_for_file(ready, procs[-1])
        f = run_cli(["predict", parties / "f" / "f.toml", "--connect", below, "--load", halves / "f.npz",
                     "--input", rows])
        for p in procs:
            p.wait(15)
        return f.returncode, procs
    finally:
        for p in procs:
            p.stop()


def test_a_middle_stage_passes_activations_on_and_sees_no_prediction(tmp_path: Path):
    parties = tmp_path / "parties"
    assert run_main(["split", "chain4-classify", parties]).returncode == 0
    files = [parties / name / f"{name}.toml" for name in ("f", "m1", "m2", "g")]
    trained = run_launcher(["run", *files, "--steps", "20", "--save", tmp_path / "halves"])
    assert trained.returncode == 0, trained.stderr
    rows = np.random.default_rng(2).normal(size=(40, 64)).astype(np.float32)
    np.save(tmp_path / "rows.npy", rows)
    code, procs = _predict_through_a_chain(parties, tmp_path / "halves", tmp_path, tmp_path / "rows.npy", "good")
    assert code == 0 and [p.proc.returncode for p in procs] == [0, 0, 0], "\n".join(p.output for p in procs)
    exp = load_experiment(files)
    x = rows
    for name in exp.stage_names:
        stage = Stage.from_experiment(exp, name)
        stage.load_parameters(tmp_path / "halves" / f"{name}.npz")
        x = stage.forward(x)[0]
    assert np.array_equal(np.load(tmp_path / "out-good.npy"), exp.final_loss.predict(x))
    assert "passed on 40 rows" in procs[1].output

    # A data owner whose --input cannot be read: the middle stages pass its notice on, every stage stops.
    np.save(tmp_path / "bad.npy", np.zeros((3, 10), np.float32))
    code, procs = _predict_through_a_chain(parties, tmp_path / "halves", tmp_path, tmp_path / "bad.npy", "bad")
    assert code == 2 and [p.proc.returncode for p in procs] == [1, 1, 1], "\n".join(p.output for p in procs)
    assert all("stage f stopped: --input" in p.output for p in procs)


def test_the_prediction_server_bounds_what_a_sender_may_claim(trained: Path, tmp_path: Path):
    exp = load_experiment(trained / "parties" / "g" / "g.toml")
    server = PredictionServer(StageOptions(exp, "g", exp.seed, load_path=trained / "halves" / "g.npz"),
                              tmp_path / "out.npy", None)
    f_exp = load_experiment(trained / "parties" / "f" / "f.toml")
    from distgrad.run import handshake
    hello = handshake.hello(f_exp, "f", f_exp.seed, f_exp.cuts[0], "run1", [0], 0, 1)
    for rows in (0, -1, 2**62, "5", None):
        hello.body.update(purpose="predict", rows=rows)
        with pytest.raises(ProtocolError):
            server.handle(hello, 0.0)
    hello.body.update(rows=40)
    server.handle(hello, 0.0)
    chunk = np.ones((32, 64), np.float32)
    with pytest.raises(ProtocolError, match="out of range 1..2"):
        server.handle(Message(wire.PREDICT, "run1", 3, tensors={"activation": chunk}), 0.1)
    for body in ({"chunks": 2**62, "rows": 40}, {"chunks": 2, "rows": 2**62}, {"chunks": 0, "rows": 40}, {}):
        with pytest.raises(ProtocolError):
            server.handle(Message(wire.BYE, "run1", 3, body=body), 0.2)
    assert server.session.chunks == {} and not (tmp_path / "out.npy").exists()


def test_a_training_stage_refuses_a_prediction_hello_and_stays_free(trained: Path):
    from distgrad.run import handshake
    from distgrad.run.serving import ServingStage
    exp = load_experiment(trained / "parties" / "g" / "g.toml")
    server = ServingStage(StageOptions(exp, "g", exp.seed))
    f_exp = load_experiment(trained / "parties" / "f" / "f.toml")
    hello = handshake.hello(f_exp, "f", f_exp.seed, f_exp.cuts[0], "run1", [0], 0, 1)
    hello.body.update(purpose="predict", rows=5)
    with pytest.raises(ProtocolError, match="this stage trains") as info:
        server.handle([b"peer"], hello, 0.0)
    assert info.value.code == ErrorCode.MISMATCH and not server.active


@pytest.mark.parametrize("content", [np.float32(3.0), np.array(["a", "b"]), np.zeros((0, 64))], ids=["0-d", "strings",
                                                                                                      "empty"])
def test_unreadable_input_rows_are_a_configuration_error(trained: Path, tmp_path: Path, content):
    from distgrad.errors import ConfigError
    from distgrad.run.predict import read_rows
    np.save(tmp_path / "rows.npy", content)
    with pytest.raises(ConfigError, match="--input"):
        read_rows(tmp_path / "rows.npy", load_experiment(trained / "parties" / "f" / "f.toml"), "f")
    (tmp_path / "rows.csv").write_text("")
    with pytest.raises(ConfigError, match="--input"):
        read_rows(tmp_path / "rows.csv", load_experiment(trained / "parties" / "f" / "f.toml"), "f")


def _serve(parties: Path, halves: Path, tmp_path: Path, output: Path) -> tuple[StageProcess, str]:
    ready = tmp_path / "g.ready"
    g = StageProcess(["predict", parties / "g" / "g.toml", "--bind", "tcp://127.0.0.1:*", "--ready-file", ready,
                      "--load", halves / "g.npz", "--output", output], tmp_path / "g.log", distgrad=True)
    return g, wait_for_file(ready, g)


def test_a_csv_with_a_header_and_an_id_column_keeps_the_ids(trained: Path, tmp_path: Path):
    """A spreadsheet's file: a header, an ID column (here first, given by --id-column), the features after it;
    the label owner writes the IDs as its first column, in the input's order."""
    rows = np.random.default_rng(2).integers(0, 17, size=(45, 64)).astype(np.float64)
    ids = [f"patient,{n}" if n % 7 == 0 else f"p{n}" for n in range(45)]      # some need quoting
    with open(tmp_path / "rows.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["person", *(f"pixel{i}" for i in range(64))])
        writer.writerows([key, *map(int, row)] for key, row in zip(ids, rows))
    output = tmp_path / "predictions.csv"
    _predict(trained, tmp_path, output, "--input", tmp_path / "rows.csv", "--id-column", "person")
    with open(output, newline="") as f:
        header, *lines = list(csv.reader(f))
    assert header == ["person", "prediction"]
    assert [line[0] for line in lines] == ids
    expected = _expected(trained, rows.astype(np.float32) * np.float32(0.0625))
    assert [int(line[1]) for line in lines] == expected.tolist()


def test_an_npy_output_refuses_rows_with_ids(trained: Path, tmp_path: Path):
    (tmp_path / "rows.csv").write_text("id," + ",".join(map(str, range(64))) + "\n" + "a," + ",".join(["1"] * 64)
                                       + "\n")
    g, endpoint = _serve(trained / "parties", trained / "halves", tmp_path, tmp_path / "out.npy")
    with g:
        f = run_cli(["predict", trained / "parties" / "f" / "f.toml", "--connect", endpoint, "--load",
                     trained / "halves" / "f.npz", "--input", tmp_path / "rows.csv", "--id-column", "0"])
        assert f.returncode == 4 and "give it --output FILE.csv" in f.stderr, f.stderr
        g.stop()


def test_bad_input_stops_the_label_owner_at_once(trained: Path, tmp_path: Path):
    """The data owner's --input cannot be read (a word among the numbers): it exits 2 and tells the label
    owner, which exits 1 at once naming the reason, instead of waiting out its 60 s deadline."""
    (tmp_path / "rows.csv").write_text(",".join(["1"] * 64) + "\n" + ",".join(["1"] * 63 + ["oops"]) + "\n")
    output = tmp_path / "predictions.csv"
    g, endpoint = _serve(trained / "parties", trained / "halves", tmp_path, output)
    with g:
        f = run_cli(["predict", trained / "parties" / "f" / "f.toml", "--connect", endpoint, "--load",
                     trained / "halves" / "f.npz", "--input", tmp_path / "rows.csv"])
        assert f.returncode == 2 and "--input" in f.stderr, f.stderr
        # Exit 1 within 30 s of f's exit, half its 60 s deadline: it did not wait the deadline out.
        assert g.wait(30) == 1, g.output
    assert "stage f stopped: --input" in g.output and "oops" in g.output, g.output
    assert not output.exists()


def test_a_csv_read_as_its_csv_data_reads_it(tmp_path: Path):
    """A stage whose [data] is csv (header, features by name, id_column): --input in the same form (as
    distgrad align writes it) needs no flag; the IDs reach the output."""
    rng = np.random.default_rng(3)
    with open(tmp_path / "train.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["b", "person", "a", "label"])
        writer.writerows([f"{rng.normal():.5f}", f"t{n}", f"{rng.normal():.5f}", n % 2] for n in range(40))
    experiment = tmp_path / "e.toml"
    experiment.write_text('''name = "csv-ids"
steps = 3
seed = 1

[data]
kind = "csv"
path = "train.csv"
header = true
features = ["a", "b"]
labels = "label"
id_column = "person"
batch = 4

[[stages]]
name = "f"
model = [{ type = "dense", name = "f1", in = 2, out = 3 }]
optimizer = { type = "sgd", lr = 0.1 }

[[stages]]
name = "g"
model = [{ type = "dense", name = "g1", in = 3, out = 2 }]
optimizer = { type = "sgd", lr = 0.1 }
loss = "softmax_cross_entropy"
''')
    assert run_main(["run", experiment, "--in-process", "--save", tmp_path / "halves"]).returncode == 0
    with open(tmp_path / "new.csv", "w", newline="") as f:
        csv.writer(f).writerows([["b", "person", "a"], ["0.5", "new-1", "-1"], ["2", "new-2", "0.25"]])
    output = tmp_path / "out.csv"
    _predict_two(tmp_path, [experiment, "--stage", "g", "--load", tmp_path / "halves" / "g.npz", "--output", output],
                 [experiment, "--stage", "f", "--load", tmp_path / "halves" / "f.npz", "--input", tmp_path / "new.csv"])
    exp = load_experiment(experiment)
    fs, gs = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    fs.load_parameters(tmp_path / "halves" / "f.npz")
    gs.load_parameters(tmp_path / "halves" / "g.npz")
    expected = exp.final_loss.predict(gs.forward(fs.forward(np.array([[-1, 0.5], [0.25, 2]], np.float32))[0])[0])
    assert output.read_text() == "person,prediction\n" + "".join(
        f"new-{i + 1},{p}\n" for i, p in enumerate(expected.tolist()))


def test_a_vertical_partys_refused_hello_or_chunk_names_none_of_another_partys_rows(tmp_path: Path):
    """A party whose prediction hello announces another row count or ID column than another party is
    refused with its own count and column only: it learns neither of the other party's --input."""
    from distgrad.run import handshake
    exp = load_experiment("digits-halves")

    def hello(name: str, rows: int, id_column: str | None) -> Message:
        message = handshake.hello(exp, name, exp.seed, exp.cuts[exp.stage_index(name)], f"run-{name}", [0], 0, 1)
        message.body.update(purpose="predict", rows=rows, **({"id_column": id_column} if id_column else {}))
        return message

    server = PredictionServer(StageOptions(exp, "g", exp.seed), tmp_path / "out.csv", None)
    server.handle(hello("left", 43, "secret_column"), 0.0)
    with pytest.raises(ProtocolError, match="party right announces 31 rows") as info:
        server.handle(hello("right", 31, "secret_column"), 0.0)
    assert "43" not in str(info.value) and info.value.code == ErrorCode.MISMATCH
    with pytest.raises(ProtocolError, match="every party keeps the ID column, or none") as info:
        server.handle(hello("right", 43, "person"), 0.0)
    assert "secret_column" not in str(info.value)
    server.handle(hello("right", 43, "secret_column"), 0.0)       # the same rows: accepted
    # The first refusal says why the prediction ends (serve_predictions ends it), naming neither party's rows.
    assert server.unaligned is not None and "right's hello announces other rows" in server.unaligned
    assert "31" not in server.unaligned and "43" not in server.unaligned and "secret" not in server.unaligned

def test_vertical_parties_whose_rows_have_other_ids_are_refused(tmp_path: Path):
    """Each feature party sends its rows' IDs: the label owner refuses a chunk whose IDs are not the other
    party's (their files are not aligned), keeping nothing of it, and a party that sends no IDs."""
    from distgrad.run import handshake
    exp = load_experiment("digits-halves")
    server = PredictionServer(StageOptions(exp, "g", exp.seed), tmp_path / "out.csv", None)

    def hello(name: str, id_column: str | None) -> Message:
        message = handshake.hello(exp, name, exp.seed, exp.cuts[exp.stage_index(name)], f"run-{name}", [0], 0, 1)
        message.body.update(purpose="predict", rows=2, **({"id_column": id_column} if id_column else {}))
        return message

    def chunk(name: str, ids: list[str]) -> Message:
        width = exp.cuts[exp.stage_index(name)][1]
        return Message(wire.PREDICT, f"run-{name}", 1, body={"ids": ids},
                       tensors={"activation": np.ones((2, width), np.float32)})

    server.handle(hello("left", "person"), 0.0)
    with pytest.raises(ProtocolError, match="every party keeps the ID column, or none"):
        server.handle(hello("right", None), 0.0)
    server.handle(hello("right", "person"), 0.0)
    server.handle(chunk("left", ["a", "b"]), 0.1)
    with pytest.raises(ProtocolError, match=r"party right's row 2 of the chunk \(ID 'c'\) is not party left's") \
            as info:
        server.handle(chunk("right", ["a", "c"]), 0.2)
    assert info.value.code == ErrorCode.MISMATCH and server.sessions["right"].chunks == {}
    assert "'b'" not in str(info.value)         # the refused party learns no ID of the other party's rows
    server.handle(chunk("right", ["a", "b"]), 0.3)
    assert server.predictions[1].shape == (2,) and server.prediction_ids[1] == ["a", "b"]
    # The same when the first party's chunk comes last: it is told its own ID, not the other's.
    server = PredictionServer(StageOptions(exp, "g", exp.seed), tmp_path / "out.csv", None)
    server.handle(hello("left", "person"), 0.0)
    server.handle(hello("right", "person"), 0.0)
    server.handle(chunk("right", ["x-right-only", "d"]), 0.1)
    with pytest.raises(ProtocolError, match=r"party left's row 1 of the chunk \(ID 'x-left-only'\)") as info:
        server.handle(chunk("left", ["x-left-only", "d"]), 0.2)
    assert "x-right-only" not in str(info.value) and server.sessions["left"].chunks == {}


@pytest.mark.integration(reason="the label owner and the parties in threads, over tcp")
# Slow: the same ending after a refused hello; by default the ids case covers the ending and
# test_a_vertical_partys_refused_hello_or_chunk_names_none_of_another_partys_rows the refused hello's unaligned.
@pytest.mark.parametrize("differ", ["ids", pytest.param("rows", marks=pytest.mark.slow)])
def test_a_vertical_prediction_of_unaligned_rows_ends_at_once_and_every_party_is_told_why(tmp_path: Path, differ):
    """Feature parties whose --input rows are not the same rows (IDs that differ at one row, or another row
    count) cannot complete a prediction: the party refused (its chunk, or its hello) gets ``mismatch`` naming
    its own ID or count only, and the label owner ends the prediction at once (``mismatch``, no file written)
    and tells the other party why, naming nothing of either party's rows, instead of waiting out its deadline
    for rows that will never match (then blaming the refused party's silence) while the other party's bye
    waits for no reason it is given; so no party can try one guess of another's IDs or count after another."""
    import threading
    from distgrad.errors import PeerRejected
    from distgrad.run.options import StopFlag
    from distgrad.run.predict import NewRows, send_predictions, serve_predictions
    exp = load_experiment("digits-halves")
    ready, output, outcomes = tmp_path / "g.ready", tmp_path / "out.csv", {}

    def label_owner() -> None:
        try:
            serve_predictions(StageOptions(exp, "g", exp.seed, peer_deadline_s=30, liveness_s=1.0),
                              "tcp://127.0.0.1:*", output, StopFlag(), ready_file=ready)
        except BaseException as e:        # noqa: BLE001 - the thread's outcome, asserted below
            outcomes["g"] = e

    def party(name: str, ids: list[str]) -> None:
        rows = NewRows(exp.build_data(stage=name).test_features()[:len(ids)], ids, "person")
        try:
            send_predictions(StageOptions(exp, name, exp.seed, timeout_s=5, liveness_s=1.0, peer_deadline_s=30),
                             ready.read_text(), rows, StopFlag())
        except BaseException as e:        # noqa: BLE001 - the thread's outcome, asserted below
            outcomes[name] = e

    threads = [threading.Thread(target=label_owner, daemon=True)]
    threads[0].start()
    for _ in range(1500):                   # at most 30 s for the label owner to bind
        if ready.exists() or not threads[0].is_alive():
            break
        threads[0].join(0.02)
    assert ready.exists(), outcomes
    ids = {"left": ["p1", "p2", "left-only-3", "p4", "p5"], "right": ["p1", "p2", "right-only-3", "p4", "p5"]}
    if differ == "rows":
        ids = {"left": [f"p{k}" for k in range(1, 6)], "right": [f"p{k}" for k in range(1, 8)]}
    threads += [threading.Thread(target=party, args=(name, ids[name]), daemon=True) for name in ids]
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), outcomes
    refused = [name for name in ids if getattr(outcomes.get(name), "code", None) == ErrorCode.MISMATCH]
    assert len(refused) == 1, outcomes      # the party whose chunk (or hello) came last
    told = "right" if refused == ["left"] else "left"
    own = f"(ID '{refused[0]}-only-3')" if differ == "ids" else f"announces {len(ids[refused[0]])} rows"
    assert own in str(outcomes[refused[0]])
    assert isinstance(outcomes[told], PeerRejected) and outcomes[told].code == ErrorCode.ABORTED, outcomes
    assert isinstance(outcomes["g"], ProtocolError) and outcomes["g"].code == ErrorCode.MISMATCH, outcomes
    for text in (str(outcomes[told]), str(outcomes["g"])):
        assert "not aligned" in text and f"party {refused[0]}'s" in text and "-only-3" not in text, text
        assert str(len(ids[told])) not in text and str(len(ids[refused[0]])) not in text, text
    assert not output.exists()


@pytest.mark.integration(reason="the label owner serves in a thread, over tcp")
def test_a_vertical_prediction_a_party_never_joins_ends_naming_it_and_the_waiting_party_is_told(tmp_path: Path):
    """The label owner waits for every feature party's rows: one that never comes (or stops sending) is named
    after --peer-deadline, and a party whose bye waits for it is answered with that reason at once (it was
    left to wait out its own deadline and end on "no reply"). The label owner in a thread, over tcp."""
    from distgrad.errors import PeerRejected, PeerTimeout
    from distgrad.run.options import StopFlag
    from distgrad.run.predict import NewRows, send_predictions, serve_predictions
    exp = load_experiment("digits-halves")
    ready, output, raised = tmp_path / "g.ready", tmp_path / "out.npy", []

    thread, raised = _serving_in_thread(
        lambda: serve_predictions(StageOptions(exp, "g", exp.seed, peer_deadline_s=1.5, liveness_s=1.0),
                                  "tcp://127.0.0.1:*", output, StopFlag(), ready_file=ready), ready)
    rows = NewRows(exp.build_data(stage="left").test_features()[:5])
    with pytest.raises(PeerRejected, match=r"party right has not joined \(no hello accepted\) for 1\.5 s") as info:
        send_predictions(StageOptions(exp, "left", exp.seed, timeout_s=0.5, liveness_s=1.0, peer_deadline_s=15),
                         ready.read_text(), rows, StopFlag())
    assert info.value.code == ErrorCode.ABORTED
    thread.join(10)
    assert not thread.is_alive() and len(raised) == 1 and isinstance(raised[0], PeerTimeout), raised
    assert "party right has not joined" in str(raised[0]) and not output.exists()


def test_predictions_cross_with_the_activation_codec_as_evaluations_do(trained: Path, tmp_path: Path):
    """What leaves a stage passes one pipeline in every runner (``Senders``); a prediction's
    activations cross as an evaluation's do, coded with the interface's activation codec (chunk n at step n),
    so the label owner's predictions are those of the decoded activations, chunk by chunk."""
    from distgrad.wire.wirecodec import Senders
    coded = tmp_path / "coded"
    for party in ("f", "g"):
        (coded / "parties" / party).mkdir(parents=True)
        for item in (trained / "parties" / party).iterdir():
            text = item.read_bytes()
            if item.suffix == ".toml":
                text = text.replace(b"[interface]\n", b'[interface]\nactivation_codec = "topk:3"\n', 1)
            (coded / "parties" / party / item.name).write_bytes(text)
    (coded / "halves").symlink_to(trained / "halves")
    rows = np.random.default_rng(2).integers(0, 17, size=(70, 64)).astype(np.float32)
    np.savetxt(tmp_path / "rows.csv", rows, delimiter=",", fmt="%d")
    output = tmp_path / "predictions.npy"
    _predict(coded, tmp_path, output, "--input", tmp_path / "rows.csv")
    exp = load_experiment([coded / "parties" / "f" / "f.toml", coded / "parties" / "g" / "g.toml"])
    assert exp.codecs["activation"].name == "topk:3"
    f, g = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    f.load_parameters(trained / "halves" / "f.npz")
    g.load_parameters(trained / "halves" / "g.npz")
    senders, expected, uncoded = Senders(exp.codecs), [], []
    for number, start in enumerate(range(0, len(rows), exp.batch), start=1):
        y = f.forward(rows[start:start + exp.batch] * np.float32(0.0625), training=False)[0]
        crossed = senders.evaluation_roundtrip(y, number)
        expected.append(exp.final_loss.predict(g.forward(crossed, training=False)[0]))
        uncoded.append(exp.final_loss.predict(g.forward(y, training=False)[0]))
    assert not np.array_equal(np.concatenate(expected), np.concatenate(uncoded)), "topk:3 should change a prediction"
    assert np.array_equal(np.load(output), np.concatenate(expected))


def _logits(root: Path, rows: np.ndarray) -> np.ndarray:
    """The label owner's outputs of ``rows``, computed in one process from the saved halves."""
    exp = load_experiment([root / "parties" / "f" / "f.toml", root / "parties" / "g" / "g.toml"])
    f, g = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    f.load_parameters(root / "halves" / "f.npz")
    g.load_parameters(root / "halves" / "g.npz")
    return g.forward(f.forward(rows, training=False)[0], training=False)[0]


def test_output_scores_writes_the_class_probabilities_beside_the_class_and_the_ids(trained: Path, tmp_path: Path):
    """``--output-scores`` adds score_0..score_9, the softmax of the logits, after the predicted
    class; the ID column of the input still leads each line."""
    rows = np.random.default_rng(4).integers(0, 17, size=(45, 64)).astype(np.float64)
    ids = [f"r{n}" for n in range(45)]
    with open(tmp_path / "rows.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["person", *(f"pixel{i}" for i in range(64))])
        writer.writerows([key, *map(int, row)] for key, row in zip(ids, rows))
    output = tmp_path / "predictions.csv"
    _predict(trained, tmp_path, output, "--input", tmp_path / "rows.csv", "--id-column", "person",
             g_extra=("--output-scores",))
    with open(output, newline="") as f:
        header, *lines = list(csv.reader(f))
    assert header == ["person", "prediction", *(f"score_{k}" for k in range(10))]
    assert [line[0] for line in lines] == ids
    logits = _logits(trained, rows.astype(np.float32) * np.float32(0.0625))
    predicted = np.array([int(line[1]) for line in lines])
    scores = np.array([[float(v) for v in line[2:]] for line in lines], np.float32)
    assert np.array_equal(predicted, logits.argmax(axis=1))
    assert np.array_equal(scores.argmax(axis=1), predicted)
    shifted = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    assert np.allclose(scores, shifted / shifted.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)
    assert np.allclose(scores.sum(axis=1), 1, atol=1e-5)


def test_output_scores_of_an_npy_output_go_to_a_file_beside_it(trained: Path, tmp_path: Path):
    rows = np.random.default_rng(5).integers(0, 17, size=(30, 64)).astype(np.float32)
    np.save(tmp_path / "rows.npy", rows)
    output = tmp_path / "predictions.npy"
    _predict(trained, tmp_path, output, "--input", tmp_path / "rows.npy", g_extra=("--output-scores",))
    logits = _logits(trained, rows * np.float32(0.0625))
    exp = load_experiment(trained / "parties" / "g" / "g.toml")
    scores = np.load(tmp_path / "predictions.scores.npy")
    assert scores.dtype == np.float32 and scores.shape == (30, 10)
    assert np.array_equal(scores, exp.final_loss.scores(logits))
    assert np.array_equal(np.load(output), logits.argmax(axis=1))


def test_output_scores_is_for_the_label_owner(trained: Path, tmp_path: Path):
    result = run_cli(["predict", trained / "parties" / "f" / "f.toml", "--connect", "tcp://127.0.0.1:9", "--load",
                      trained / "halves" / "f.npz", "--output-scores"])
    assert result.returncode == 2 and "--output-scores is for the label owner" in result.stderr
    # Nor does the data owner take --output or --ready-file (they were accepted and left unused).
    for flag, value in (("--output", tmp_path / "mine.csv"), ("--ready-file", tmp_path / "ready")):
        result = run_main(["predict", trained / "parties" / "f" / "f.toml", "--connect", "tcp://127.0.0.1:9",
                           "--load", trained / "halves" / "f.npz", flag, value, "--timeout", "0.2",
                           "--peer-deadline", "0.5"])
        assert result.returncode == 2 and f"{flag} is for a stage that serves (--bind)" in result.stderr, flag


TORCH_HEAD = """
from torch import nn


def head():
    return nn.Linear(3, 4)
"""
TORCH_EXPERIMENT = """
name = "torch-scores"
steps = 8
seed = 2

[data]
kind = "synthetic_classification"
samples = 64
features = 5
classes = 4
batch = 8

[[stages]]
name = "f"
model = [{ type = "dense", name = "f1", in = 5, out = 3 }, { type = "tanh" }]
optimizer = { type = "sgd", lr = 0.1 }

[[stages]]
name = "g"
module = "scorehead:head"
optimizer = { type = "SGD", lr = 0.1 }
loss = { type = "%s" }
"""


# Torch processes on both sides: slow (CI runs the slow set too); a numpy label owner's probabilities stay
# (test_output_scores_writes_the_class_probabilities_beside_the_class_and_the_ids).
@pytest.mark.slow
def test_a_torch_label_owner_writes_its_losss_probabilities(tmp_path: Path):
    """A torch label owner's scores over processes: torch's softmax of CrossEntropyLoss's logits."""
    torch = pytest.importorskip("torch")
    (tmp_path / "scorehead.py").write_text(TORCH_HEAD)
    experiment = tmp_path / "e.toml"
    experiment.write_text(TORCH_EXPERIMENT % "CrossEntropyLoss")
    assert run_main(["run", experiment, "--in-process", "--save", tmp_path / "halves"]).returncode == 0
    rows = np.random.default_rng(6).normal(size=(11, 5)).astype(np.float32)
    np.save(tmp_path / "rows.npy", rows)
    output = tmp_path / "out.csv"
    _predict_two(tmp_path, [experiment, "--stage", "g", "--load", tmp_path / "halves" / "g.pt", "--output", output,
                            "--output-scores"],
                 [experiment, "--stage", "f", "--load", tmp_path / "halves" / "f.npz", "--input",
                  tmp_path / "rows.npy"])
    exp = load_experiment(experiment)
    fs, gs = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    fs.load_parameters(tmp_path / "halves" / "f.npz")
    gs.load_parameters(tmp_path / "halves" / "g.pt")
    outputs = torch.from_numpy(gs.forward(fs.forward(rows, training=False)[0], training=False)[0])
    expected = torch.softmax(outputs, dim=1)
    with open(output, newline="") as f:
        header, *lines = list(csv.reader(f))
    assert header == ["row", "prediction", "score_0", "score_1", "score_2", "score_3"]
    assert [int(line[1]) for line in lines] == outputs.argmax(dim=1).tolist()
    scores = np.array([[float(v) for v in line[2:]] for line in lines], np.float32)
    assert np.allclose(scores, expected.numpy(), rtol=1e-5, atol=1e-7)


def test_each_loss_scores_as_torch_would():
    """``Loss.scores`` beside torch's own functions: softmax for class ids, exp of NLLLoss's log-probabilities,
    sigmoid for BCEWithLogitsLoss, the output itself for BCELoss and the regression losses."""
    torch = pytest.importorskip("torch")
    from distgrad.model.losses import MeanSquaredError, SoftmaxCrossEntropy, TorchLoss
    logits = np.random.default_rng(7).normal(scale=30, size=(6, 3)).astype(np.float32)
    t = torch.from_numpy(logits)
    assert np.allclose(SoftmaxCrossEntropy().scores(logits), torch.softmax(t, 1).numpy(), rtol=1e-5, atol=1e-7)
    assert np.allclose(TorchLoss("CrossEntropyLoss", {}).scores(logits), torch.softmax(t, 1).numpy(), rtol=1e-5,
                       atol=1e-7)
    assert np.allclose(TorchLoss("NLLLoss", {}).scores(logits / 30), torch.exp(t / 30).numpy(), rtol=1e-5, atol=1e-7)
    assert np.allclose(TorchLoss("BCEWithLogitsLoss", {}).scores(logits), torch.sigmoid(t).numpy(), rtol=1e-5,
                       atol=1e-7)
    for loss in (TorchLoss("MSELoss", {}), TorchLoss("BCELoss", {}), MeanSquaredError()):
        assert np.array_equal(loss.scores(logits), logits)


def test_the_label_owner_never_overwrites_a_file_already_there_unless_forced(trained: Path, tmp_path: Path):
    """An --output (or, with --output-scores, its NAME.scores.npy) already there is another prediction's,
    say: refused before anything is served, the file left as it is; a folder of that name too, even with
    --force. --force overwrites; the data owner, which writes nothing, refuses it."""
    g = [trained / "parties" / "g" / "g.toml", "--bind", "tcp://127.0.0.1:*", "--load", trained / "halves" / "g.npz"]
    (tmp_path / "mine.csv").write_text("row,prediction\n0,3\n")
    (tmp_path / "out.scores.npy").write_text("another run's scores")
    (tmp_path / "folder.csv").mkdir()
    for output, extra, what in (("mine.csv", [], "mine.csv exists"), ("out.npy", ["--output-scores"],
                                "out.scores.npy exists"), ("folder.csv", ["--force"], "is a folder")):
        result = run_main(["predict", *g, "--output", tmp_path / output, *extra, "--peer-deadline", "0.3"])
        assert result.returncode == 2 and what in result.stderr, result.stderr
    assert (tmp_path / "mine.csv").read_text() == "row,prediction\n0,3\n" and not (tmp_path / "out.npy").exists()
    assert (tmp_path / "out.scores.npy").read_text() == "another run's scores"
    result = run_main(["predict", trained / "parties" / "f" / "f.toml", "--connect", "tcp://127.0.0.1:9", "--load",
                       trained / "halves" / "f.npz", "--force", "--timeout", "0.2", "--peer-deadline", "0.3"])
    assert result.returncode == 2 and "--force lets the label owner overwrite its --output" in result.stderr

    # A file that appears while the prediction runs is left as it is: the prediction fails naming it.
    exp = load_experiment(trained / "parties" / "g" / "g.toml")
    f_exp = load_experiment(trained / "parties" / "f" / "f.toml")
    from distgrad.errors import OutputWriteError
    from distgrad.run import handshake
    for overwrite in (False, True):
        output = tmp_path / f"late-{overwrite}.npy"
        server = PredictionServer(StageOptions(exp, "g", exp.seed, load_path=trained / "halves" / "g.npz"), output,
                                  None, output_scores=True, overwrite=overwrite)
        hello = handshake.hello(f_exp, "f", f_exp.seed, f_exp.cuts[0], "run1", [0], 0, 1)
        hello.body.update(purpose="predict", rows=8)
        server.handle(hello, 0.0)
        server.handle(Message(wire.PREDICT, "run1", 1, tensors={"activation": np.ones((8, 64), np.float32)}), 0.1)
        output.write_text("written meanwhile")
        bye = Message(wire.BYE, "run1", 2, body={"chunks": 1, "rows": 8})
        if overwrite:
            assert server.handle(bye, 0.2).type == wire.BYE and np.load(output).shape == (8,)
            continue
        with pytest.raises(OutputWriteError, match="the file appeared while this prediction ran"):
            server.handle(bye, 0.2)
        assert output.read_text() == "written meanwhile"
        assert sorted(p.name for p in tmp_path.glob("*late-False*")) == ["late-False.npy"]  # no scores, no temporary


def test_an_aborted_notice_naming_no_run_stops_no_live_prediction(tmp_path: Path):
    """A notice naming no run comes from a data owner that stopped before its hello (a second one whose
    --input is bad, say): it stops the label owner only while no prediction is live there, so it cannot end
    another data owner's prediction (refused with ``run``, its chunks kept); one naming the run does."""
    from distgrad.run import handshake
    from distgrad.run.predict import PredictionAborted
    exp = load_experiment("digits")
    server = PredictionServer(StageOptions(exp, "g", exp.seed, liveness_s=10.0), tmp_path / "out.npy", None)
    hello = handshake.hello(exp, "f", exp.seed, exp.cuts[0], "run1", [0], 0, 1)
    hello.body.update(purpose="predict", rows=40)
    server.handle(hello, 0.0)
    server.handle(Message(wire.PREDICT, "run1", 1, tensors={"activation": np.ones((32, 64), np.float32)}), 1.0)
    with pytest.raises(ProtocolError, match="names no run") as info:
        server.handle(wire.abort_notice("", "f", "another data owner's --input is bad"), 2.0)
    assert info.value.code == ErrorCode.RUN and list(server.session.chunks) == [1] and not server.session.done
    with pytest.raises(PredictionAborted, match="its own failure"):      # the prediction's own data owner
        server.handle(wire.abort_notice("run1", "f", "its own failure"), 3.0)
    # Once the prediction's sender has been silent for liveness_s, its place is free: a notice naming no run
    # may be the next data owner's, and stops the label owner (it would otherwise wait out its deadline).
    server = PredictionServer(StageOptions(exp, "g", exp.seed, liveness_s=10.0), tmp_path / "out.npy", None)
    server.handle(hello, 0.0)
    with pytest.raises(PredictionAborted, match="bad input"):
        server.handle(wire.abort_notice("", "f", "bad input"), 10.5)


@pytest.mark.integration(reason="the label owner serves in a thread, over tcp")
def test_a_data_owner_that_fails_after_its_hello_stops_the_label_owner_naming_its_run(tmp_path: Path):
    """The data owner's stage fails on its second chunk (after its hello was accepted): it tells the label
    owner, naming its run, and the label owner stops at once (PredictionAborted) rather than waiting out its
    60 s deadline. The label owner in a thread, over tcp."""
    from distgrad.errors import StageError
    from distgrad.run.options import StopFlag
    from distgrad.run.predict import NewRows, PredictionAborted, send_predictions, serve_predictions
    exp = load_experiment("digits")
    ready, output, raised = tmp_path / "g.ready", tmp_path / "out.csv", []

    def failing_stage() -> Stage:
        stage, forward, calls = Stage.from_experiment(exp, "f"), None, []

        def fails_second(x, training=True):
            calls.append(1)
            if len(calls) == 2:
                raise StageError("a forward failed on the second chunk")
            return forward(x, training=training)
        forward, stage.forward = stage.forward, fails_second      # type: ignore[method-assign]
        return stage

    thread, raised = _serving_in_thread(
        lambda: serve_predictions(StageOptions(exp, "g", exp.seed, trains=False),
                                  "tcp://127.0.0.1:*", output, StopFlag(), ready_file=ready), ready)
    with pytest.raises(StageError, match="second chunk"):
        send_predictions(StageOptions(exp, "f", exp.seed, trains=False, stage_factory=failing_stage),
                         ready.read_text(), NewRows(np.ones((40, 64), np.float32)), StopFlag())
    thread.join(20)                         # a third of its 60 s deadline: it did not wait it out
    assert not thread.is_alive() and len(raised) == 1 and isinstance(raised[0], PredictionAborted), raised
    assert "a forward failed on the second chunk" in str(raised[0]) and not output.exists()


@pytest.mark.integration(reason="the label owner serves in a thread, over tcp")
def test_a_client_of_an_experiment_with_clients_predicts_with_its_own_parameters(tmp_path: Path):
    """A data owner of an experiment with [clients] is told to say which client it is: `distgrad predict`
    takes --client K (it was asked for and refused as an unknown flag) and predicts with that client's
    parameters. The label owner in a thread, over tcp; the data owner through the CLI in this process."""
    import threading
    from distgrad.run.options import StopFlag
    from distgrad.run.predict import serve_predictions
    exp = load_experiment("digits-clients")
    f, g = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    f.save_parameters(tmp_path / "f@1.npz")
    g.save_parameters(tmp_path / "g.npz")
    rows = np.random.default_rng(3).normal(size=(40, 64)).astype(np.float32)
    np.save(tmp_path / "rows.npy", rows)
    f_args = ["predict", "digits-clients", "--stage", "f", "--load", tmp_path / "f@1.npz", "--input",
              tmp_path / "rows.npy", "--timeout", "2", "--peer-deadline", "5"]
    result = run_main([*f_args, "--connect", "tcp://127.0.0.1:9"])      # refused before it connects
    assert result.returncode == 2 and "give --client 0 to 2" in result.stderr
    ready, output, raised = tmp_path / "g.ready", tmp_path / "out.npy", []

    def label_owner() -> None:
        try:
            serve_predictions(StageOptions(exp, "g", exp.seed, load_path=tmp_path / "g.npz", trains=False,
                                           peer_deadline_s=20), "tcp://127.0.0.1:*", output, StopFlag(),
                              ready_file=ready)
        except BaseException as e:        # noqa: BLE001 - the thread's outcome, asserted below
            raised.append(e)

    thread = threading.Thread(target=label_owner, daemon=True)
    thread.start()
    for _ in range(1500):                   # at most 30 s for the label owner to bind
        if ready.exists() or not thread.is_alive():
            break
        thread.join(0.02)
    assert ready.exists(), raised
    result = run_main([*f_args, "--client", "1", "--connect", ready.read_text()])
    assert result.returncode == 0, result.stderr
    thread.join(20)
    assert not thread.is_alive() and not raised, raised
    assert np.array_equal(np.load(output), exp.final_loss.predict(g.forward(f.forward(rows)[0])[0]))


@pytest.mark.integration(reason="the label owner serves in a thread, over tcp")
def test_a_data_owner_whose_load_file_is_damaged_tells_the_label_owner(tmp_path: Path):
    """A damaged --load fails the data owner's options, before it reads a row: it tells the label owner all
    the same, which stops at once naming it rather than waiting out its deadline. The label owner in a
    thread, over tcp; the data owner through the CLI in this process."""
    from distgrad.run.options import StopFlag
    from distgrad.run.predict import PredictionAborted, serve_predictions
    exp = load_experiment("digits")
    Stage.from_experiment(exp, "f").save_parameters(tmp_path / "f.npz")
    (tmp_path / "damaged.npz").write_bytes((tmp_path / "f.npz").read_bytes()[:1000])
    ready, output, raised = tmp_path / "g.ready", tmp_path / "out.csv", []

    thread, raised = _serving_in_thread(
        lambda: serve_predictions(StageOptions(exp, "g", exp.seed, trains=False, peer_deadline_s=60),
                                  "tcp://127.0.0.1:*", output, StopFlag(), ready_file=ready), ready)
    result = run_main(["predict", "digits", "--stage", "f", "--load", tmp_path / "damaged.npz", "--connect",
                       ready.read_text()])
    assert result.returncode == 2 and "damaged.npz" in result.stderr, result.stderr
    thread.join(20)                         # a third of its 60 s deadline: it did not wait it out
    assert not thread.is_alive() and len(raised) == 1 and isinstance(raised[0], PredictionAborted), raised
    assert "stage f stopped: --load" in str(raised[0]) and not output.exists()


def test_an_output_is_placed_whole_and_never_over_a_file_even_without_hard_links(tmp_path: Path, monkeypatch):
    """``_place_new`` puts a written file where no file is, by a hard link or, on a file system without them,
    a rename; a file already there is left as it is (``OutputWriteError``), the written one stays for the
    caller to remove."""
    import os
    from distgrad.errors import OutputWriteError
    from distgrad.run.predict import _place_new
    for links in (True, False):
        if not links:
            monkeypatch.setattr(os, "link", lambda *_: (_ for _ in ()).throw(PermissionError(1, "no hard links")))
        whole, path, there = tmp_path / f"whole-{links}", tmp_path / f"new-{links}.csv", tmp_path / f"old-{links}.csv"
        whole.write_text("predictions")
        there.write_text("another run's")
        with pytest.raises(OutputWriteError, match="the file appeared while this prediction ran"):
            _place_new(whole, there)
        assert there.read_text() == "another run's" and whole.exists()
        _place_new(whole, path)
        assert path.read_text() == "predictions"


def test_more_rows_than_one_prediction_sends_are_refused_saying_the_bound(tmp_path: Path, monkeypatch):
    """The data owner refuses rows of more chunks than a prediction may send before it connects, telling the
    stage below (a notice naming no run: it said no hello); the label owner's refusal of such a hello names
    the bound too."""
    from distgrad.errors import ConfigError
    from distgrad.run import handshake, predict
    from distgrad.run.options import StopFlag
    exp = load_experiment("digits")
    monkeypatch.setattr(predict, "MAX_CHUNKS", 2)
    told: list = []
    monkeypatch.setattr(predict, "send_abort_notice", lambda *args: told.append(args))
    with pytest.raises(ConfigError, match="65 rows make more than 2 chunks of 32 .* predict them in parts"):
        predict.send_predictions(StageOptions(exp, "f", exp.seed, trains=False), "tcp://127.0.0.1:9",
                                 predict.NewRows(np.ones((65, 64), np.float32)), StopFlag())
    assert len(told) == 1 and told[0][-1] == "" and "predict them in parts" in told[0][2]
    server = PredictionServer(StageOptions(exp, "g", exp.seed, trains=False), tmp_path / "out.npy", None)
    hello = handshake.hello(exp, "f", exp.seed, exp.cuts[0], "run1", [0], 0, 1)
    hello.body.update(purpose="predict", rows=65)
    with pytest.raises(ProtocolError, match=r"hello has rows=65; expected 1 to 64 \(2 chunks of the batch at most\)"):
        server.handle(hello, 0.0)
