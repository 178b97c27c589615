"""Keep and use the trained halves: ``--save`` writes each stage's final parameters, ``--load``
starts a later run from them, on every path (stage daemons, ``distgrad run``, in-process), bitwise alike."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distgrad.errors import ConfigError
from distgrad.config.parse import load_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.stage.stage import Stage

from conftest import read_json, run_cli, run_launcher, run_main


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as archive:
        return {name: archive[name] for name in archive.files}


def test_save_then_load_continues_from_the_saved_halves_bitwise_over_processes_and_in_process(tmp_path: Path):
    first = run_launcher(["run", "digits", "--steps", "20", "--save", tmp_path / "halves", "--summary",
                          tmp_path / "first.json"])
    assert first.returncode == 0, first.stderr
    saved = {name: _arrays(tmp_path / "halves" / f"{name}.npz") for name in ("f", "g")}
    summary = read_json(tmp_path / "first.json")
    for name in ("f", "g"):
        assert {k: v.tolist() for k, v in saved[name].items()} == summary["params"][name]
        assert all(v.dtype == np.float32 for v in saved[name].values())
    reference = train_in_process(load_experiment("digits"), steps=20, save_dir=tmp_path / "in-process")
    for name in ("f", "g"):
        again = _arrays(tmp_path / "in-process" / f"{name}.npz")
        assert all(np.array_equal(again[k], saved[name][k]) for k in saved[name])
    assert reference["params"] == summary["params"]
    # A later run starts from the saved halves: the same as the in-process run that loads them.
    later = run_launcher(["run", "digits", "--steps", "10", "--load", tmp_path / "halves", "--summary",
                          tmp_path / "later.json"])
    assert later.returncode == 0, later.stderr
    continued = train_in_process(load_experiment("digits"), steps=10, load_dir=tmp_path / "halves")
    assert read_json(tmp_path / "later.json")["params"] == continued["params"]
    fresh = train_in_process(load_experiment("digits"), steps=10)
    assert continued["params"] != fresh["params"]
    assert continued["test_loss"] < fresh["test_loss"]


def test_a_loaded_stage_holds_exactly_the_saved_values(tmp_path: Path):
    exp = load_experiment("mlp-classify")
    trained = Stage.from_experiment(exp, "g")
    for value in trained.params.values():
        value += np.float32(0.25)
    trained.save_parameters(tmp_path / "g.npz")
    fresh = Stage.from_experiment(exp, "g")
    fresh.load_parameters(tmp_path / "g.npz")
    assert all(np.array_equal(fresh.params[k], trained.params[k]) for k in trained.params)


def test_parameters_named_like_savez_keywords_are_saved_and_loaded_like_any_other(tmp_path: Path):
    """A parameter's name is the archive member's name, whatever it is: scale layers named ``file`` and
    ``allow_pickle`` (``numpy.savez``'s own keywords) are written, read by ``numpy.load`` and loaded back."""
    from distgrad.model.nn import build_model
    from distgrad.model.optim import build_optimizer

    def stage() -> Stage:
        model = build_model([{"type": "scale", "name": "file", "size": 3},
                             {"type": "scale", "name": "allow_pickle", "size": 3}], seed=7)
        return Stage("f", model, build_optimizer({"type": "sgd", "lr": 0.1}), None, (2, 3))

    trained = stage()
    for value in trained.params.values():
        value += np.float32(0.25)
    trained.save_parameters(tmp_path / "f.npz")
    saved = _arrays(tmp_path / "f.npz")
    assert sorted(saved) == ["allow_pickle", "file"]
    assert all(np.array_equal(saved[k], trained.params[k]) for k in trained.params)
    fresh = stage()
    fresh.load_parameters(tmp_path / "f.npz")
    assert all(np.array_equal(fresh.params[k], trained.params[k]) for k in trained.params)


def test_a_parameters_file_that_does_not_fit_is_a_configuration_error(tmp_path: Path):
    exp = load_experiment("digits")
    Stage.from_experiment(exp, "f").save_parameters(tmp_path / "f.npz")
    with pytest.raises(ConfigError, match=r"does not fit stage g: it lacks \['g1.W', 'g1.b'\]"):
        Stage.from_experiment(exp, "g").load_parameters(tmp_path / "f.npz")
    (tmp_path / "junk.npz").write_bytes(b"not an archive")
    with pytest.raises(ConfigError, match="not a readable npz archive"):
        Stage.from_experiment(exp, "g").load_parameters(tmp_path / "junk.npz")
    result = run_cli(["stage", "g", "--experiment", "digits", "--bind", "tcp://127.0.0.1:*", "--load",
                      tmp_path / "f.npz"])
    assert result.returncode == 2 and "does not fit stage g" in result.stderr
    missing = run_launcher(["run", "digits", "--load", tmp_path / "nowhere"])
    assert missing.returncode == 2 and "--load" in missing.stderr and "no such file" in missing.stderr
    both = run_cli(["stage", "f", "--experiment", "digits", "--connect", "tcp://127.0.0.1:9", "--load",
                    tmp_path / "f.npz", "--init", "f1.b=0"])
    assert both.returncode == 2 and "--load and --init" in both.stderr


def _starting_files(directory: Path, shift: float) -> Path:
    """``directory`` holding digits' f.npz and g.npz: the initial values plus ``shift``."""
    exp = load_experiment("digits")
    directory.mkdir()
    for name in ("f", "g"):
        stage = Stage.from_experiment(exp, name)
        for value in stage.params.values():
            value += np.float32(shift)
        stage.save_parameters(directory / f"{name}.npz")
    return directory


def test_checkpoints_of_another_starting_file_are_not_resumed(tmp_path: Path):
    """A checkpoint belongs to its starting point: resuming with another --load file starts afresh.

    A run from files A stops after 4 of 8 steps, checkpointed. ``--resume --load B`` then trains 8
    steps from B, equal to the in-process run from B, and logs why it skipped A's checkpoints;
    ``--resume --load A`` continues A's run instead (equal to 8 steps from A in one go)."""
    a, b = _starting_files(tmp_path / "a", 0.0), _starting_files(tmp_path / "b", 0.01)
    checkpoints = tmp_path / "checkpoints"

    def run(load: Path, steps: int, *extra: object) -> dict:
        summary = tmp_path / f"summary-{load.name}-{steps}.json"
        result = run_launcher(["run", "digits", "--steps", steps, "--load", load, "--checkpoint-dir", checkpoints,
                               "--checkpoint-every", "2", "--summary", summary, "--log-level", "INFO", *extra])
        assert result.returncode == 0, result.stderr
        return {"params": read_json(summary)["params"], "output": result.stdout + result.stderr}

    run(a, 4)                                   # the run from A, 4 of 8 steps, checkpointed
    from_b = run(b, 8, "--resume")
    assert "made with other settings" in from_b["output"]
    assert from_b["params"] == train_in_process(load_experiment("digits"), steps=8, load_dir=b)["params"]
    continued = run(a, 8, "--resume")
    assert "resumed run" in continued["output"]
    assert continued["params"] == train_in_process(load_experiment("digits"), steps=8, load_dir=a)["params"]
    assert continued["params"] != from_b["params"]


def test_a_plain_npy_file_is_refused_as_parameters(tmp_path: Path):
    np.save(tmp_path / "f.npy", np.zeros(3, np.float32))
    with pytest.raises(ConfigError, match="not an npz archive"):
        Stage.from_experiment(load_experiment("digits"), "f").load_parameters(tmp_path / "f.npy")


def _damaged_copies(saved: Path, into: Path) -> dict[str, Path]:
    """Copies of a parameters folder whose ``f.npz`` is damaged one way each (``g.npz`` left intact)."""
    arrays = _arrays(saved / "f.npz")
    raw = (saved / "f.npz").read_bytes()
    flipped = bytearray(raw)
    flipped[len(raw) // 3] ^= 0x01                 # inside f1.W's data: its CRC-32 no longer matches
    changes = {
        "inf": lambda a: a["f1.W"].__setitem__((0, 0), np.inf),
        "float64 1e300": lambda a: a.__setitem__("f1.W", np.full(a["f1.W"].shape, 1e300)),
        "complex": lambda a: a.__setitem__("f1.W", a["f1.W"].astype(np.complex64) + 1j),
        "int64": lambda a: a.__setitem__("f1.W", np.ones(a["f1.W"].shape, np.int64)),
        "string": lambda a: a.__setitem__("f1.W", np.full(a["f1.W"].shape, "0.5")),
        "object": lambda a: a.__setitem__("f1.W", np.array([object()] * 3, dtype=object)),
    }
    folders = {}
    for name, change in {**changes, "cut short": None, "flipped bit": None}.items():
        folder = into / name.replace(" ", "-")
        folder.mkdir()
        (folder / "g.npz").write_bytes((saved / "g.npz").read_bytes())
        if change is not None:
            copy = dict(arrays)
            change(copy)
            np.savez(folder / "f.npz", **copy)       # allow_pickle defaults to True on writing: a pickled member
        else:
            (folder / "f.npz").write_bytes(raw[:len(raw) // 2] if name == "cut short" else bytes(flipped))
        folders[name] = folder
    return folders


def test_a_damaged_or_mistyped_parameters_file_is_refused_with_exit_2_naming_file_and_member(tmp_path: Path):
    """A damaged --load file is refused whole: a cut-short or bit-flipped archive, a string or object (pickled) member, a member of Inf
    or float64 1e300, a complex or int64 member: each refused before any stage starts, over processes and
    in one process, exit 2 naming the file and the member; nothing is cast, nothing trains."""
    saved = tmp_path / "saved"
    first = run_main(["run", "digits", "--steps", "2", "--in-process", "--save", saved])
    assert first.returncode == 0, first.stderr
    for name, folder in _damaged_copies(saved, tmp_path).items():
        before = (folder / "f.npz").read_bytes()
        # Both modes refuse through Stage.load_parameters: over processes for two of the damages, in one
        # process for every one (each run over processes starts the launcher: the suite's time). The
        # launcher runs in this process (run_launcher; its stage processes would be real ones) and so does
        # the command of the in-process runs: no interpreter is started for a refusal.
        for mode in ([], ["--in-process"]) if name in ("cut short", "object") else (["--in-process"],):
            result = (run_main if mode else run_launcher)(["run", "digits", "--steps", "2", "--load", folder,
                                                           "--summary", tmp_path / "s.json", *mode])
            assert result.returncode == 2, (name, mode, result.stderr)
            assert f"--load {folder / 'f.npz'}" in result.stderr, (name, result.stderr)
            if name != "cut short":                  # no member can be told from a file that is no archive
                assert "'f1.W'" in result.stderr, (name, result.stderr)
            assert "Traceback" not in result.stderr and "[f]" not in result.stderr, (name, result.stderr)
            assert not (tmp_path / "s.json").exists()
        assert (folder / "f.npz").read_bytes() == before
    stage = Stage.from_experiment(load_experiment("digits"), "f")
    with pytest.raises(ConfigError, match=r"member 'f1.W' is int64, the parameter is float32"):
        stage.load_parameters(tmp_path / "int64" / "f.npz")


def test_a_load_file_that_is_no_archive_is_named_for_what_it_is_never_a_pickle(tmp_path: Path):
    """numpy takes a file that is neither a zip archive nor an .npy array for a pickle, and says so with advice
    to load it unsafely: --load names what it is instead (a distgrad checkpoint, or the file's first bytes)
    and what it takes."""
    from distgrad.stage.checkpoint import MAGIC
    exp = load_experiment("digits")
    (tmp_path / "g.ckpt").write_bytes(MAGIC + b"\x10\x00\x00\x00rest of a checkpoint")
    (tmp_path / "notes.npz").write_bytes(b"just some text")
    for name, what in (("g.ckpt", "it is a distgrad checkpoint (of --checkpoint-dir)"),
                       ("notes.npz", "it is a file beginning b'just s'")):
        with pytest.raises(ConfigError, match="not a readable npz archive") as info:
            Stage.from_experiment(exp, "g").load_parameters(tmp_path / name)
        assert what in str(info.value) and "--save writes" in str(info.value)
        assert "pickle" not in str(info.value), info.value


@pytest.mark.parametrize("name", ["data owner", "../up", "a/b", "f@0", "f"])
def test_a_parameters_file_stays_inside_its_folder_whatever_the_stage_is_called(tmp_path, name):
    """``--save DIR`` / ``--load DIR``: a stage file may name its stage anything; its parameters file is a file
    directly in DIR (plain names as they are: ``DIR/f.npz``, ``DIR/f@0.npz``)."""
    from distgrad.stage.stage import parameters_file
    exp = load_experiment("seed-reverse")
    path = parameters_file(tmp_path, name, exp, "f")
    assert path.parent == tmp_path and path.suffix == ".npz"
    if name in ("f", "f@0"):
        assert path.name == f"{name}.npz"
