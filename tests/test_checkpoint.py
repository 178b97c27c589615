"""Checkpoint files: atomic, checksummed, pruned, and a corrupt one falls back to the previous."""

from __future__ import annotations

import numpy as np
import pytest

from distgrad import checkpoint
from distgrad.checkpoint import CheckpointError, CheckpointStore
from distgrad.experiment import load_experiment
from distgrad.stage import Stage


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
    store.discard_other_runs("new-run")
    assert [c.run for c in store.valid()] == ["new-run"]


def test_no_temporary_files_are_left_and_nothing_is_pickled(tmp_path):
    store = _store(tmp_path)
    path = store.save("run", 1, _arrays(1.0), {})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [path.name]
    assert path.read_bytes().startswith(checkpoint.MAGIC)
    assert b"pickle" not in path.read_bytes()


def test_stage_state_round_trip_continues_bitwise():
    exp = load_experiment("tanh-regression")
    data = exp.build_data()
    f, g = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    restored = Stage.from_experiment(exp, "g")

    def step(stage, i):
        x, _ = f.forward(data.features(i))
        stage.train_last(x, data.targets(i))

    for i in range(1, 6):
        step(g, i)
    restored.load_state_arrays({k: v.copy() for k, v in g.state_arrays().items()}, g.step)
    for i in range(6, 11):
        step(g, i)
        step(restored, i)
    assert restored.step == g.step == 10
    for name in g.params:
        np.testing.assert_array_equal(restored.params[name], g.params[name])


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
