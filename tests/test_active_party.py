"""A vertical label owner that also holds features (the active party): its own ``bottom`` over its own columns.

Its bottom's output joins the feature parties' embeddings as one more, last
party (``aggregate``) before its model; the bottom learns from the gradient of
its own embedding, no wire involved. Over processes (and from the stage files
``distgrad split`` writes, and through kill -9 and --resume: slow) the run is
bitwise equal to the in-process reference.
"""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest

from conftest import (StageGroup, StageProcess, free_tcp_endpoint, read_json, run_cli, run_launcher, run_main,
                      wait_for_file)
from distgrad.config.parse import load_experiment, parse_experiment
from distgrad.config.tomlfile import read_toml
from distgrad.errors import ConfigError
from distgrad.model import aggregate
from distgrad.model.nn import build_model
from distgrad.stage.stage import Stage

BUILTIN = Path(__file__).parent.parent / "distgrad" / "experiments" / "vertical-classify.toml"
OWN = '[[stages]]\nname = "g"\ncolumns = [8, 9, 10, 11]\nbottom = [{ type = "dense", name = "own1", in = 4, ' \
      'out = 8 }, { type = "tanh" }]\n'


def _active(tmp_path: Path, kind: str = "concat") -> Path:
    """vertical-classify with party c's columns held by the label owner g, under its own bottom."""
    text = BUILTIN.read_text()
    c = text.index('[[stages]]\nname = "c"')
    g = text.index('[[stages]]\nname = "g"')
    text = text[:c] + OWN + text[g + len('[[stages]]\nname = "g"\n'):]
    text = text.replace('aggregate = "concat"', f'aggregate = "{kind}"')
    if kind != "concat":
        text = text.replace("in = 24", "in = 8")
    path = tmp_path / f"active-{kind}.toml"
    path.write_text(text)
    return path


def _digits_active(tmp_path: Path) -> Path:
    """digits-halves with the right half of every image held by the label owner under its own bottom."""
    text = (BUILTIN.parent / "digits-halves.toml").read_text().replace("../datasets/", str(BUILTIN.parent.parent /
                                                                                          "datasets") + "/")
    right, g = text.index('[[stages]]\nname = "right"'), text.index('[[stages]]\nname = "g"')
    columns = text[right:g].split("columns = ")[1].split("\nmodel")[0]
    text = text[:right] + f'[[stages]]\nname = "g"\ncolumns = {columns}\nbottom = [{{ type = "dense", ' \
                          f'name = "own1", in = 32, out = 32 }}, {{ type = "relu" }}]\n' + text[g + 22:]
    path = tmp_path / "digits-active.toml"
    path.write_text(text)
    return path


def _reference(tmp_path: Path, experiment: Path, *flags: str) -> dict:
    path = tmp_path / "reference.json"
    result = run_main(["run", str(experiment), *flags, "--in-process", "--summary", path])
    assert result.returncode == 0, result.stderr
    return read_json(path)


def test_own_bottom_joins_last_and_learns_from_its_own_embeddings_gradient():
    rng = np.random.default_rng(0)
    bottom = build_model([{"type": "dense", "name": "own1", "in": 3, "out": 2}], 0)
    layer = aggregate.OwnBottom("concat", [2, 1], bottom)
    parts = [rng.normal(size=(4, w)).astype(np.float32) for w in (2, 1)]
    own = rng.normal(size=(4, 3)).astype(np.float32)
    x = aggregate.join_input(parts, own, "concat")
    z, cache = layer.forward(x)
    embedding, bottom_cache = bottom.forward(own)
    assert np.array_equal(z, np.hstack([*parts, embedding])) and layer.output_shape((4, 6)) == (4, 5)
    dz = rng.normal(size=z.shape).astype(np.float32)
    dx, grads = layer.backward(cache, dz)
    assert np.array_equal(grads["own1.W"], bottom.backward(bottom_cache, dz[:, 3:])[1]["own1.W"])
    assert np.array_equal(dx, np.hstack([dz[:, :3], np.zeros((4, 3), np.float32)]))
    assert [p.tolist() for p in aggregate.split_input(dx, True, "concat", [2, 1])] == [dz[:, :2].tolist(),
                                                                                      dz[:, 2:3].tolist()]
    mean = aggregate.OwnBottom("mean", [2, 2], build_model([{"type": "dense", "name": "o", "in": 3, "out": 2}], 0))
    same = [rng.normal(size=(4, 2)).astype(np.float32) for _ in range(2)]
    z, _ = mean.forward(aggregate.join_input(same, own, "mean"))
    e, _ = mean.bottom.forward(own)
    assert np.array_equal(z, ((same[0] + same[1]) + e) / np.float32(3))   # the label owner's counts as a party


@pytest.mark.parametrize("kind,transport,micro_batches", [("digits", "tcp", 2), ("mean", "ipc", 1)])
def test_active_label_owner_over_processes_equals_in_process(tmp_path, kind, transport, micro_batches):
    """The digits with the label owner holding the right half of each image (two processes, with held-out
    evaluations), and two parties and the label owner's embedding averaged (three processes)."""
    experiment = _digits_active(tmp_path) if kind == "digits" else _active(tmp_path, kind)
    flags = ["--micro-batches", str(micro_batches), "--steps", "40", "--eval-every", "20"]
    path = tmp_path / "run.json"
    result = run_launcher(["run", experiment, "--transport", transport, "--summary", path, *flags])
    assert result.returncode == 0, result.stdout + result.stderr
    summary, reference = read_json(path), _reference(tmp_path, experiment, *flags)
    own = ["g1.W", "g1.b", "own1.W", "own1.b"]
    assert sorted(summary["params"]["g"]) == own and summary["params"] == reference["params"]
    if kind == "digits":
        assert summary["evaluations"] == reference["evaluations"] and len(summary["evaluations"]) == 2
        assert summary["test_accuracy"] == reference["test_accuracy"] > 0.5


HEAD_MODULE = """import torch


def head(width: int = 24, classes: int = 4) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(width, classes))
"""


def _torch_active(tmp_path: Path, kind: str) -> Path:
    """``_active`` with the label owner computed by torch: its layers (framework "torch"), or a module."""
    text = _active(tmp_path).read_text()
    if kind == "framework":
        text = text.replace('loss = "softmax', 'framework = "torch"\nloss = "softmax')
    else:
        (tmp_path / "head.py").write_text(HEAD_MODULE)
        text = text.replace('model = [{ type = "dense", name = "g1", in = 24, out = 4 }]\noptimizer = { type = '
                            '"adam", lr = 0.01 }', 'module = "head:head"\noptimizer = { type = "Adam", lr = 0.01 }')
        assert 'module = "head:head"' in text
    path = tmp_path / f"active-{kind}.toml"
    path.write_text(text)
    return path


# A torch label owner's own bottom over processes (three torch processes): slow. The numpy bottom's runs over
# processes stay in the default suite; a torch layer list is the module path with distgrad building the module.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["framework", "module"])
def test_a_torch_label_owners_own_bottom_over_processes_equals_in_process(tmp_path, kind):
    """The label owner's bottom built in torch, before its layers (framework "torch") or its module."""
    pytest.importorskip("torch", reason="torch is not installed: the torch label owner's bottom is not tested")
    experiment = _torch_active(tmp_path, kind)
    flags = ["--micro-batches", "2", "--steps", "20"]
    path = tmp_path / "run.json"
    result = run_launcher(["run", experiment, "--summary", path, *flags])
    assert result.returncode == 0, result.stdout + result.stderr
    summary, reference = read_json(path), _reference(tmp_path, experiment, *flags)
    own = ["own1.W", "own1.b"] + (["g1.W", "g1.b"] if kind == "framework" else ["0.bias", "0.weight"])
    assert sorted(summary["params"]["g"]) == sorted(own) and summary["params"] == reference["params"]
    start = _reference(tmp_path, experiment, "--steps", "1")["params"]["g"]["own1.W"]
    assert summary["params"]["g"]["own1.W"] != start          # the bottom learns


def test_one_feature_party_and_an_active_label_owner_from_split_stage_files(tmp_path):
    """`distgrad split` writes the label owner's bottom and its own columns (with its labels) into its files."""
    text = _active(tmp_path).read_text()
    b = text.index('[[stages]]\nname = "b"')
    one = tmp_path / "one.toml"
    one.write_text(text[:b] + text[text.index('[[stages]]\nname = "g"'):].replace("in = 24", "in = 16"))
    assert run_main(["split", one, tmp_path / "files"]).returncode == 0
    files = [tmp_path / "files" / name / f"{name}.toml" for name in ("a", "g")]
    own = files[1].read_text()
    assert "bottom = [" in own and "features" in own and "labels" in own
    assert "bottom" not in files[0].read_text()                   # the bottom is the label owner's own
    path = tmp_path / "run.json"
    result = run_launcher(["run", *files, "--summary", path, "--steps", "30", "--save", tmp_path / "saved"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_json(path)["params"] == _reference(tmp_path, one, "--steps", "30")["params"]
    # distgrad predict: a sends its embeddings of new rows, g takes its own columns of them (by position)
    features = np.random.default_rng(3).normal(size=(45, 12)).astype(np.float32)
    np.save(tmp_path / "a.npy", features[:, :4])
    np.save(tmp_path / "g.npy", features[:, 8:])
    out = tmp_path / "out.csv"
    _predict_pair(tmp_path, ["--load", tmp_path / "saved" / "g.npz", "--output", out, "--input", tmp_path / "g.npy"],
                  files[1], ["--load", tmp_path / "saved" / "a.npz", "--input", tmp_path / "a.npy"], files[0])
    table = np.loadtxt(out, delimiter=",", skiprows=1, dtype=np.int64)
    expected = _in_process_predictions(one, tmp_path / "saved", {"a": features[:, :4], "g": features[:, 8:]})
    assert len(table) == 45 and np.array_equal(table[:, 1], expected)


def _predict_pair(tmp_path: Path, g_args: list, g_file: Path, a_args: list, a_file: Path) -> str:
    """``distgrad predict`` served by the label owner g and sent by the one party a; both exit 0. Returns g's
    output."""
    ready = tmp_path / "g.ready"
    with StageProcess(["predict", g_file, *g_args, "--bind", "tcp://127.0.0.1:*", "--ready-file", ready],
                      tmp_path / "g-predict.log", distgrad=True) as g:
        a = run_cli(["predict", a_file, *a_args, "--connect", wait_for_file(ready, g)])
        assert a.returncode == 0, a.stderr
        assert g.wait() == 0, g.output
        return g.output


def _in_process_predictions(experiment: Path, saved: Path, rows: dict) -> np.ndarray:
    """The predictions of ``rows`` (stage -> its own columns of them) by the stages of one process with the
    parameters ``--save`` wrote."""
    exp = load_experiment(experiment)
    stages = {name: Stage.from_experiment(exp, name) for name in exp.stage_names}
    for name, stage in stages.items():
        stage.load_parameters(saved / f"{name}.npz")
    own = {name: rows[name] for name in exp.stage_names}
    parts = [stages[name].forward(own[name], training=False)[0] for name in exp.data_owners]
    last = stages[exp.stage_names[-1]]
    y, _ = last.forward(aggregate.join_input(parts, own[exp.stage_names[-1]], exp.aggregate), training=False)
    return last.loss.predict(y)


def test_predict_matches_an_active_label_owners_own_rows_by_id(tmp_path):
    """The party's and the label owner's --input rows carry IDs in different orders: g takes its own columns
    of each chunk's rows by ID; a row ID g does not hold is refused (mismatch)."""
    text = _active(tmp_path).read_text()
    one = tmp_path / "one.toml"
    one.write_text(text[:text.index('[[stages]]\nname = "b"')] + text[text.index('[[stages]]\nname = "g"'):]
                   .replace("in = 24", "in = 16").replace("steps = 60", "steps = 20"))
    assert run_main(["run", one, "--in-process", "--save", tmp_path / "saved"]).returncode == 0
    rng = np.random.default_rng(5)
    features = rng.normal(size=(40, 12)).astype(np.float32)
    ids = [f"p{i:03d}" for i in range(40)]
    order = rng.permutation(40)

    def write(path: Path, columns: slice, rows) -> Path:
        lines = ["id," + ",".join(f"c{i}" for i in range(columns.start, columns.stop))]
        lines += [ids[r] + "," + ",".join(repr(float(v)) for v in features[r, columns]) for r in rows]
        path.write_text("\n".join(lines) + "\n")
        return path

    a_rows, g_rows = write(tmp_path / "a.csv", slice(0, 4), range(40)), write(tmp_path / "g.csv", slice(8, 12), order)
    out = tmp_path / "out.csv"
    g_args = ["--stage", "g", "--load", tmp_path / "saved" / "g.npz", "--output", out, "--id-column", "id"]
    a_args = ["--stage", "a", "--load", tmp_path / "saved" / "a.npz", "--input", a_rows, "--id-column", "id"]
    _predict_pair(tmp_path, [*g_args, "--input", g_rows], one, a_args, one)
    table = np.loadtxt(out, delimiter=",", skiprows=1, dtype=str)
    expected = _in_process_predictions(one, tmp_path / "saved", {"a": features[:, 0:4], "g": features[:, 8:12]})
    assert table[:, 0].tolist() == ids and table[:, 1].astype(np.int64).tolist() == expected.tolist()
    short = write(tmp_path / "g-short.csv", slice(8, 12), [r for r in order if r != 7])
    ready = tmp_path / "short.ready"
    with StageProcess(["predict", one, *g_args, "--input", short, "--force", "--bind", "tcp://127.0.0.1:*",
                       "--ready-file", ready, "--peer-deadline", "5"], tmp_path / "g-short.log", distgrad=True) as g:
        a = run_cli(["predict", one, *a_args, "--connect", wait_for_file(ready, g)])
    assert a.returncode == 4 and "row ID 'p007' is not among the label owner's own rows" in a.stderr, a.stderr


def test_a_bottom_where_it_cannot_work_is_refused(tmp_path):
    raw = read_toml(_active(tmp_path))
    layers = [{"type": "dense", "name": "x1", "in": 4, "out": 8}]
    with pytest.raises(ConfigError, match="only the last stage"):
        parse_experiment({**raw, "stages": [dict(raw["stages"][0], bottom=layers), *raw["stages"][1:]]})
    with pytest.raises(ConfigError, match="vertical experiment"):
        parse_experiment({key: value for key, value in raw.items() if key != "aggregate"})
    with pytest.raises(ConfigError, match=r"own1. takes \(batch, 5\), got \(32, 4\)"):     # a module's bottom too
        module = {key: value for key, value in raw["stages"][2].items() if key != "model"}
        parse_experiment({**raw, "stages": [*raw["stages"][:2], dict(module, module="head:head", bottom=[
            {"type": "dense", "name": "own1", "in": 5, "out": 8}])]})
    with pytest.raises(ConfigError, match=r"own1. takes \(batch, 5\), got \(32, 4\)"):
        wrong = [{"type": "dense", "name": "own1", "in": 5, "out": 8}]
        parse_experiment({**raw, "stages": [*raw["stages"][:2], dict(raw["stages"][2], bottom=wrong)]})
    assert load_experiment(_active(tmp_path)).input_shape("g") == (32, 20)    # a's 8, b's 8, its own 4 columns


class _ActiveRun(StageGroup):
    """Parties a and b and the active label owner g, each a process with its own log and checkpoints."""

    def __init__(self, tmp_path: Path, experiment: Path, steps: int, endpoint: str) -> None:
        super().__init__(tmp_path)
        common = ["--experiment", str(experiment), "--steps", str(steps), "--checkpoint-dir", tmp_path / "ckpt",
                  "--checkpoint-every", "1", "--resume", "--timeout", "0.5", "--liveness", "0.5",
                  "--peer-deadline", "30"]
        self.args = {"g": ["g", "--bind", endpoint, "--summary", tmp_path / "g.json", *common]}
        for name in ("a", "b"):
            self.args[name] = [name, "--connect", endpoint, "--summary", tmp_path / f"{name}.json",
                               "--trace", tmp_path / f"{name}.jsonl", "--trace-params", f"{name}1.b", *common]


@pytest.mark.slow
@pytest.mark.parametrize("killed,transport", [("g", "ipc"), ("a", "tcp")])
def test_kill_9_of_the_active_label_owner_or_a_party_resumes_bitwise(tmp_path, stage_group, killed, transport):
    """kill -9 mid-run, restarted with the same command line (--resume): the label owner's bottom comes back
    from its checkpoint with the rest of its stage, and every stage ends bitwise equal to --in-process."""
    steps, experiment = 200, _active(tmp_path)
    endpoint = f"ipc://{tmp_path}/g.sock" if transport == "ipc" else free_tcp_endpoint()
    run = stage_group(_ActiveRun, tmp_path, experiment, steps, endpoint)
    for name in ("g", "a", "b"):
        run.start(name)
    run.wait_until(lambda: run.lines("a.jsonl") >= 40, "party a to reach step 40")
    run.procs[killed].signal(signal.SIGKILL)
    assert run.procs[killed].wait(10) == -signal.SIGKILL, f"{killed} ended before the kill"
    run.start(killed)
    run.wait_all()
    assert "resumed run" in run.logs()
    reference = _reference(tmp_path, experiment, "--steps", str(steps))["params"]
    for name in ("a", "b", "g"):
        assert read_json(tmp_path / f"{name}.json")["params"][name] == reference[name], name
