"""Checkpoint files: atomic, checksummed, pruned, and a corrupt one falls back to the previous."""

from __future__ import annotations

import ast
import errno
import io
import json
import os
import pickle
import struct
import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest

from distgrad.stage import checkpoint
from distgrad.stage.checkpoint import CheckpointError, CheckpointStore
from distgrad.errors import CheckpointWriteError, ConfigError
from distgrad.config.parse import load_experiment
from distgrad.stage.records import TraceWriter, read_trace
from distgrad.stage.stage import Stage

from conftest import run_launcher, train_last_step


def _store(tmp_path, stage="g"):
    return CheckpointStore(tmp_path / "ckpt", stage, "fp")


def _arrays(value: float) -> dict[str, np.ndarray]:
    return {"param/w": np.full((3, 2), value, np.float32), "opt/beta1_power": np.array(0.9, np.float32)}


def test_round_trip_is_bitwise(tmp_path):
    store = _store(tmp_path)
    arrays = {"param/w": np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)}
    path = store.save("run", 7, arrays, {"seed": 3})
    ckpt = checkpoint.load(path)
    assert (ckpt.stage, ckpt.run, ckpt.step, ckpt.meta) == ("g", "run", 7, {"seed": 3})
    np.testing.assert_array_equal(ckpt.arrays["param/w"], arrays["param/w"])
    assert ckpt.arrays["param/w"].dtype == np.float32


def test_only_the_newest_are_kept(tmp_path):
    store = _store(tmp_path)
    for step in range(0, 100, 10):
        store.save("run", step, _arrays(step), {})
    assert store.steps("run") == [70, 80, 90]
    assert checkpoint.KEEP_LAST >= 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage):
    store = _store(tmp_path)
    store.save("run", 10, _arrays(1.0), {})
    newest = store.save("run", 20, _arrays(2.0), {})
    data = bytearray(newest.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-10] ^= 0xFF
    elif damage == "garbage":
        data = bytearray(b"\x00" * len(data))
    else:
        data = bytearray()
    newest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        checkpoint.load(newest)
    latest = store.latest()
    assert latest is not None and latest.step == 10
    np.testing.assert_array_equal(latest.arrays["param/w"], _arrays(1.0)["param/w"])


def test_checkpoints_of_another_experiment_or_run_are_not_used(tmp_path):
    CheckpointStore(tmp_path / "ckpt", "g", "other-experiment").save("run", 5, _arrays(5.0), {})
    store = _store(tmp_path)
    assert store.latest() is None
    store.save("old-run", 30, _arrays(3.0), {})
    store.save("new-run", 0, _arrays(0.0), {})
    assert [c.run for c in store.valid("new-run")] == ["new-run"]
    assert [c.run for c in store.valid()] == ["new-run", "old-run"]     # the other run's file is kept


def _payload(path) -> tuple[dict, bytes]:
    """A checkpoint file's header and its array payload."""
    data = path.read_bytes()
    (size,) = struct.unpack_from("<I", data, len(checkpoint.MAGIC))
    start = len(checkpoint.MAGIC) + 4
    return msgpack.unpackb(data[start:start + size]), data[start + size:]


def _rewrite(path, payload: bytes) -> None:
    """Replace a checkpoint's payload, with a checksum that verifies (it has no key: anyone can)."""
    header, _ = _payload(path)
    fields = {k: header[k] for k in ("stage", "run", "step", "fingerprint", "meta", "saved_ns")}
    packed = msgpack.packb(dict(fields, sha256=checkpoint._digest(fields, payload)))
    path.write_bytes(checkpoint.MAGIC + struct.pack("<I", len(packed)) + packed + payload)


@pytest.mark.parametrize("field, value", [("run", 7), ("step", "2"), ("step", 2.5), ("step", True),
                                          ("stage", None), ("fingerprint", 1), ("meta", [1, 2])])
def test_a_checkpoint_whose_header_fields_have_other_types_is_skipped_as_not_ours(tmp_path, field, value):
    """A file of another writer passes its checksum (anyone can compute it); a header field of another type
    makes it not a checkpoint of this format: skipped with the reason (the previous one serves), never a crash
    or a step read from a string, and no file changes."""
    store = _store(tmp_path)
    store.save("run", 1, _arrays(1.0), {})
    path = store.save("run", 2, _arrays(2.0), {})
    header, payload = _payload(path)
    fields = {k: header[k] for k in ("stage", "run", "step", "fingerprint", "meta", "saved_ns")}
    fields[field] = value
    packed = msgpack.packb(dict(fields, sha256=checkpoint._digest(fields, payload)))
    path.write_bytes(checkpoint.MAGIC + struct.pack("<I", len(packed)) + packed + payload)
    with pytest.raises(CheckpointError, match=f"its header's '{field}' is {type(value).__name__}, not"):
        checkpoint.load(path)
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    assert store.latest().step == 1
    assert [c.step for c in store.valid("run")] == [1]
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before


def test_a_fifo_under_a_checkpoints_name_is_skipped_not_waited_on(tmp_path):
    """Reading a FIFO blocks until someone writes to it (and SIGTERM does not end the read): a file under a
    checkpoint's name that is not a regular file is skipped with the reason, and the previous one serves."""
    store = _store(tmp_path)
    store.save("run", 1, _arrays(1.0), {})
    fifo = tmp_path / "ckpt" / "g-run-000000002.ckpt"
    os.mkfifo(fifo)
    found: list = []
    reader = threading.Thread(target=lambda: found.append(store.latest()), daemon=True)
    reader.start()
    reader.join(10)
    try:
        assert not reader.is_alive(), "the store waited on the FIFO"
        assert found[0].step == 1
        with pytest.raises(CheckpointError, match="is not a regular file"):
            checkpoint.load(fifo)
    finally:
        if reader.is_alive():                   # the old behaviour: let the blocked read end
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(10)


def test_no_temporary_files_are_left_and_nothing_is_pickled(tmp_path):
    """No pickle in a checkpoint: the payload loads with allow_pickle=False, member by member, and the writer refuses an
    array of Python objects (which numpy.savez would pickle) before writing anything."""
    store = _store(tmp_path)
    path = store.save("run", 1, _arrays(1.0), {})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [path.name]
    assert path.read_bytes().startswith(checkpoint.MAGIC)
    with np.load(io.BytesIO(_payload(path)[1]), allow_pickle=False) as npz:
        assert {name: npz[name].dtype for name in npz.files} == {"param/w": np.float32, "opt/beta1_power": np.float32}
    with pytest.raises(TypeError, match="'param/x' holds Python objects"):
        store.save("run", 2, {**_arrays(1.0), "param/x": np.array([object()], dtype=object)}, {})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [path.name]


def test_every_numpy_read_and_write_of_the_package_refuses_pickles():
    """Every np.load / np.save in distgrad passes allow_pickle=False; np.savez (which has no such flag in
    numpy 1.x) is called only by npzfile.write_npz, which refuses object arrays."""
    package = Path(checkpoint.__file__).parent.parent
    unsafe = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "np"):
                continue
            flag = {k.arg: k.value for k in node.keywords}.get("allow_pickle")
            if node.func.attr in ("load", "save") and not (isinstance(flag, ast.Constant) and flag.value is False):
                unsafe.append(f"{path.name}:{node.lineno} np.{node.func.attr}")
            if node.func.attr.startswith("savez") and path.name != "npzfile.py":
                unsafe.append(f"{path.name}:{node.lineno} np.{node.func.attr}")
    assert not unsafe, unsafe


def test_a_checkpoint_that_verifies_but_holds_pickles_is_refused_and_left_alone(tmp_path):
    """No pickle in a checkpoint: one whose checksum verifies but whose payload is a pickle, or an npz with an
    object (pickled) member, is refused with a ConfigError naming the file, never loaded or skipped as
    torn, and no file of the directory changes."""
    store = _store(tmp_path)
    store.save("run", 1, _arrays(1.0), {})
    path = store.save("run", 2, _arrays(2.0), {})
    with_objects = io.BytesIO()
    np.savez(with_objects, **_arrays(2.0), **{"param/x": np.array([{"a": 1}], dtype=object)})
    payloads = {"its arrays \\['param/x'\\] hold Python objects": with_objects.getvalue(),
                "its arrays are not an npz archive": pickle.dumps(_arrays(2.0))}
    for needle, payload in payloads.items():
        _rewrite(path, payload)
        before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
        with pytest.raises(ConfigError, match=f"checkpoint {path} passes its checksum, but {needle}"):
            store.latest()
        assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before


def test_resuming_from_a_pickled_checkpoint_exits_2_before_any_stage_starts(tmp_path):
    """No pickle in a checkpoint, end to end: `distgrad run --resume` over a checkpoint directory where one stage's newest
    checkpoint verifies but holds an object member exits 2 naming it, and leaves every file as it was."""
    folder = tmp_path / "ckpt"
    first = run_launcher(["run", "digits", "--steps", "2", "--checkpoint-dir", folder, "--checkpoint-every", "1"])
    assert first.returncode == 0, first.stderr
    newest = max(folder.glob("g-*.ckpt"))
    with np.load(io.BytesIO(_payload(newest)[1]), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    arrays["param/g1.W"] = arrays["param/g1.W"].astype(object)
    payload = io.BytesIO()
    np.savez(payload, **arrays)
    _rewrite(newest, payload.getvalue())
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    result = run_launcher(["run", "digits", "--steps", "4", "--checkpoint-dir", folder, "--resume"])
    assert result.returncode == 2, result.stderr
    assert f"checkpoint {newest} passes its checksum" in result.stderr and "[g]" not in result.stdout
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_stage_state_round_trip_continues_bitwise():
    exp = load_experiment("tanh-regression")
    data = exp.build_data()
    f, g = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    restored = Stage.from_experiment(exp, "g")

    def step(stage, i):
        x, _ = f.forward(data.features(i))
        train_last_step(stage, x, data.targets(i))

    for i in range(1, 6):
        step(g, i)
    restored.load_state_arrays({k: v.copy() for k, v in g.state_arrays().items()}, g.step)
    for i in range(6, 11):
        step(g, i)
        step(restored, i)
    assert restored.step == g.step == 10
    for name in g.params:
        np.testing.assert_array_equal(restored.params[name], g.params[name])


def test_the_update_count_is_checkpointed_and_an_old_checkpoint_counts_its_step():
    exp = load_experiment("tanh-regression")
    data = exp.build_data()
    f, g = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    for i in range(1, 6):
        train_last_step(g, f.forward(data.features(i))[0], data.targets(i))
    arrays = {k: v.copy() for k, v in g.state_arrays().items()}
    assert arrays["opt/updates"] == 5 and arrays["opt/updates"].dtype == np.int64
    arrays["opt/updates"] = np.array(3, np.int64)           # the saved count wins over the step
    restored = Stage.from_experiment(exp, "g")
    restored.load_state_arrays(arrays, 5)
    assert restored.optimizer.updates == 3 and restored.step == 5
    del arrays["opt/updates"]                                # written before schedules: the step is the count
    restored.load_state_arrays(arrays, 5)
    assert restored.optimizer.updates == 5


def test_checkpoints_made_with_another_seed_or_init_are_not_used(tmp_path):
    CheckpointStore(tmp_path / "ckpt", "g", "fp", {"seed": 1}).save("run", 5, _arrays(5.0), {"seed": 1})
    assert CheckpointStore(tmp_path / "ckpt", "g", "fp", {"seed": 2}).latest() is None
    assert CheckpointStore(tmp_path / "ckpt", "g", "fp", {"seed": 1}).latest().step == 5


def test_a_flipped_header_bit_is_caught(tmp_path):
    path = _store(tmp_path).save("abcdef", 12, _arrays(1.0), {})
    data = path.read_bytes().replace(b"abcdef", b"abcdeg", 1)
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoint.load(path)


def test_a_run_never_prunes_or_overwrites_another_runs_checkpoints(tmp_path):
    store = _store(tmp_path)
    for step in range(0, 1001, 50):
        store.save("first", step, _arrays(step), {})
    for step in (0, 50, 100, 150):
        store.save("second", step, _arrays(-step), {})
    assert store.steps("first") == [900, 950, 1000]         # another run's newest, untouched
    assert store.steps("second") == [50, 100, 150]          # and this run keeps its own newest
    ckpt = store.at("second", 50)
    np.testing.assert_array_equal(ckpt.arrays["param/w"], _arrays(-50)["param/w"])   # not overwritten


@pytest.mark.parametrize("stage", ["data owner", "a/b", "../up", "f\u00e9", "f\n"])
def test_any_stage_name_keeps_its_files_inside_the_directory_found_and_pruned(tmp_path, stage):
    """A stage file may name a stage with any characters: its checkpoints and lock are still inside
    the directory, found on resume, pruned to the newest, and apart from every other stage's."""
    directory = tmp_path / "d" / "ckpt"
    with checkpoint.lock_stage(directory, stage):
        with pytest.raises(ConfigError, match="is in use"):
            checkpoint.lock_stage(directory, stage)
        checkpoint.lock_stage(directory, "f").release()
        store, other = CheckpointStore(directory, stage, "fp"), CheckpointStore(directory, "f", "fp")
        other.save("run", 0, _arrays(-1), {})
        for step in range(0, 60, 10):
            store.save("run", step, _arrays(step), {})
    assert store.steps("run") == [30, 40, 50] and store.latest().step == 50
    assert store.latest().stage == stage and other.steps("run") == [0]
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file() and p.parent != directory) == []
    assert len([p for p in directory.iterdir() if p.name.endswith(".ckpt")]) == 4


def test_resume_takes_the_run_written_last_whatever_the_steps_of_others(tmp_path):
    store = _store(tmp_path)
    for step in (800, 900, 1000):
        store.save("older", step, _arrays(step), {})
    store.save("newer", 0, _arrays(0.0), {})
    store.save("newer", 50, _arrays(50.0), {})
    latest = store.latest()
    assert (latest.run, latest.step) == ("newer", 50)
    store.save("older", 1050, _arrays(1050.0), {})
    assert (store.latest().run, store.latest().step) == ("older", 1050)


@pytest.mark.parametrize("run", ["../../x y", "..", ".", "", "/etc/passwd", "a/b", "a\\b", "~", "x" * 4096,
                                 "\x00", "g-h0000-000000005.ckpt"], ids=repr)
def test_a_run_id_from_the_network_never_makes_a_path(tmp_path, run):
    """Whatever the run id (separators, dots, absolute paths, NUL, a checkpoint's own name, 4 KiB), the file is
    a new one in the store's folder, named without it, and reads back as that run's."""
    store = _store(tmp_path)
    path = store.save(run, 5, _arrays(1.0), {})
    assert path.parent == tmp_path / "ckpt" and "/" not in path.name[:-5] and ".." not in path.name
    assert run not in path.name or run in ("", "."), path.name
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".ckpt"] == [path.name]
    assert store.at(run, 5).run == run


def test_old_format_names_are_still_read(tmp_path):
    store = _store(tmp_path)
    path = store.save("run", 20, _arrays(2.0), {})
    path.rename(path.with_name("g-000000020.ckpt"))
    assert (store.latest().run, store.latest().step) == ("run", 20)


def test_a_second_process_of_a_stage_cannot_lock_its_directory(tmp_path):
    directory = tmp_path / "ckpt"
    with checkpoint.lock_stage(directory, "f"):
        with pytest.raises(ConfigError, match=rf"{directory}.*stage f is already running.*pid {os.getpid()}"):
            checkpoint.lock_stage(directory, "f")
        checkpoint.lock_stage(directory, "g").release()           # another stage: its own lock
        checkpoint.lock_stage(directory, "f@1").release()
    checkpoint.lock_stage(directory, "f").release()               # free again once released


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
def test_a_lock_path_that_is_no_regular_file_is_refused_and_nothing_is_written_through_it(tmp_path, kind):
    """``DIR/.f.lock`` as a symlink (say, to another run's checkpoint), a directory or a FIFO: exit 2 naming it,
    and the file it points to keeps every byte (the pid was once written through the link)."""
    directory, other = tmp_path / "ckpt", tmp_path / "another-runs.ckpt"
    other.write_bytes(b"another run's checkpoint")
    directory.mkdir()
    lock = directory / ".f.lock"
    {"symlink": lambda: lock.symlink_to(other), "directory": lock.mkdir, "fifo": lambda: os.mkfifo(lock)}[kind]()
    with pytest.raises(ConfigError, match=r"\.f\.lock is not a regular file"):
        checkpoint.lock_stage(directory, "f")
    assert other.read_bytes() == b"another run's checkpoint"


def test_the_lock_removes_only_this_stages_leftover_temporary_files(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    stale = [".f-abc-000000050.ckpt.123.tmp", ".f-000000050.ckpt.77.tmp"]
    kept = [".g-abc-000000050.ckpt.123.tmp", ".f@1-abc-000000050.ckpt.5.tmp", ".f-abc-000000050.ckpt.tmp",
            "notes.tmp", ".f-abc-000000050.ckpt.123.tmp.bak", "f-abc-000000050.ckpt"]
    for name in stale + kept:
        (directory / name).write_bytes(b"x")
    checkpoint.lock_stage(directory, "f").release()
    assert sorted(p.name for p in directory.iterdir()) == sorted(kept + [".f.lock"])


def test_a_failed_save_leaves_no_file_and_names_the_directory(tmp_path, monkeypatch):
    store = _store(tmp_path)
    store.save("run", 1, _arrays(1.0), {})

    def full(fd, *args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.os, "fsync", full)
    with pytest.raises(CheckpointWriteError, match=rf"{tmp_path / 'ckpt'}.*No space left on device"):
        store.save("run", 2, _arrays(2.0), {})
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["g-run-000000001.ckpt"]


def test_a_trace_rolled_back_on_resume_keeps_the_checkpoints_steps_and_drops_a_torn_line(tmp_path):
    """A stage killed while writing its trace may leave part of a line; on resume the trace goes back
    to the checkpoint's step (later lines and the torn one dropped) and goes on from there."""
    path = tmp_path / "f.jsonl"
    values = {"w": np.array([1.5, -2.0], np.float32)}
    with TraceWriter(path) as trace:
        for step in (1, 2, 3):
            trace.write(step, 0.5, values, values)
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step":4,"grads":{"w":[1.5,')              # the kill came mid-line
    with pytest.raises(json.JSONDecodeError):
        read_trace(path)
    with TraceWriter(path, append=True) as resumed:
        resumed.rollback(2)
        resumed.write(3, 0.25, values, values)
    lines = read_trace(path)
    assert [line["step"] for line in lines] == [1, 2, 3] and lines[-1]["loss"] == 0.25
    assert lines[0]["params"] == {"w": [1.5, -2.0]}


def test_checkpoints_past_a_billion_steps_are_found_and_pruned(tmp_path: Path) -> None:
    """A step number of ten digits or more gets a longer name, not a name the stage then ignores: such a
    checkpoint was never found again (a restart started over) and never pruned (the directory grew without
    bound). Names of nine digits are read as before."""
    arrays = {"param/w": np.zeros(2, np.float32)}
    steps = [999_999_999, 1_000_000_000, 1_000_000_001, 12_345_678_901, 12_345_678_902]
    for step in steps:
        checkpoint.save(tmp_path, "g", "run1", step, "fp", arrays)
    assert checkpoint.steps_on_disk(tmp_path, "g") == steps[-checkpoint.KEEP_LAST:]
    assert len(list(tmp_path.glob("*.ckpt"))) == checkpoint.KEEP_LAST
    newest = checkpoint.load(sorted(tmp_path.glob("*12345678902.ckpt"))[0])
    assert newest.step == 12_345_678_902


def test_a_defended_stage_with_any_name_keeps_its_release_records_inside_the_directory(tmp_path):
    """The files of a stage's releases (``.STAGE.released``, ``.STAGE.lifetime.json``) are named with the same
    token as its checkpoints and lock: a label owner named with a slash writes them inside the directory."""
    from distgrad.run.options import StageOptions
    from distgrad.run.stage_state import StageState

    source = (Path(checkpoint.__file__).parent.parent / "experiments" / "tanh-regression.toml").read_text()
    assert source.count('name = "g"') == 1 and source.endswith('loss = "mean_squared_error"\n')
    text = source.replace('name = "g"', 'name = "label/owner"') + "clip_noise = { max_norm = 0.05, sigma = 1.0 }\n"
    (tmp_path / "exp.toml").write_text(text)
    exp = load_experiment(tmp_path / "exp.toml")
    directory = tmp_path / "d" / "ckpt"
    checkpoint.lock_stage(directory, "label/owner").release()       # the stage process's first act
    state = StageState(StageOptions(exp, "label/owner", exp.seed, checkpoint_dir=directory, steps=10))
    assert state.releases.released_file is not None and state.releases.lifetime is not None
    state.begin("run")
    state.releases.ledger.release(1, "gradient", "digest", np.arange(4))
    outside = [p for p in tmp_path.rglob("*") if p.is_file() and p.parent != directory and p.name != "exp.toml"]
    assert outside == [] and state.releases.released_file.parent == directory
    assert state.releases.released_file.read_text().count('"step": 1') == 1


def test_resume_says_once_that_a_new_run_starts_when_no_checkpoint_file_can_be_used(tmp_path, caplog):
    """--resume over files of the stage that are all torn (or of other settings): each is skipped with its
    reason, and the stage says that a new run starts at step 0 and that the files stay."""
    from distgrad.run.options import StageOptions
    from distgrad.run.stage_state import StageState

    exp = load_experiment("tanh-regression")
    directory = tmp_path / "ckpt"
    state = StageState(StageOptions(exp, "f", exp.seed, checkpoint_dir=directory, resume=True))
    assert not state.resume_latest() and "a new run starts" not in caplog.text     # a first start: nothing said
    directory.mkdir()
    torn = directory / "f-abc-000000010.ckpt"
    torn.write_bytes(checkpoint.MAGIC + b"\x00\x00")
    with caplog.at_level("WARNING"):
        assert not state.resume_latest()
    assert "skipping checkpoint" in caplog.text
    assert (f"none of the 1 checkpoint file(s) of stage f in {directory} can be resumed" in caplog.text
            and "a new run starts at step 0" in caplog.text)
    assert torn.read_bytes() == checkpoint.MAGIC + b"\x00\x00"
