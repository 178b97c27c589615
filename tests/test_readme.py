"""Every command in the README and the reference pages it points to runs as written (``make`` targets are run by
.ci/run).

Shell blocks run in order in a scratch directory; a serving ``distgrad-stage``
starts in the background and the commands after it run against it. The port
5555 and the placeholder G_ADDR are replaced by a free loopback port. A page's
TOML block whose first line is ``# NAME.toml`` is written there first, with a
CSV of made-up rows for a csv ``[data]`` it names.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import numpy as np
import pytest

from distgrad.run.launcher import pinned_env, stop_process

from conftest import BIN, free_tcp_port, run_launcher

README = Path(__file__).resolve().parent.parent / "README.md"
DOCS = README.parent / "docs"
# The front page and the reference pages its sections moved to: every command block of each runs.
PAGES = [README] + [DOCS / name for name in ("cli.md", "experiments.md", "pipelining.md", "watching.md",
                                             "testing.md")]
INLINE_RUN = re.compile(r"`(distgrad run [^`<>]*?)`")
NAMED_TOML = re.compile(r"```toml\n# ([\w.-]+\.toml)\n(.*?)```", re.S)
NAMED_CSV = re.compile(r"```csv\n# ([\w.-]+\.csv)\n(.*?)```", re.S)
CSV_ROWS = 96           # the made-up rows of a page's CSV sample


def _commands(block: str) -> list[list[str]]:
    joined = block.replace("\\\n", " ")
    return [argv for argv in (shlex.split(line, comments=True) for line in joined.splitlines()) if argv]


def _blocks() -> list[list[list[str]]]:
    blocks: list[list[list[str]]] = []
    inline: list[list[str]] = []
    for page in PAGES:
        text = page.read_text()
        blocks += [_commands(b) for b in re.findall(r"```sh\n(.*?)```", text, re.S)]
        inline += [argv for argv in map(shlex.split, INLINE_RUN.findall(text))
                   if not any(re.fullmatch(r"[A-Z_]+", token) for token in argv)]    # generic forms: NAME, M
    return blocks + [[argv] for argv in inline]


BLOCKS = _blocks()


def _write_named_files(folder: Path) -> None:
    """Write every page's ``# NAME.toml`` block into FOLDER, and for a csv ``[data]`` a file of 64 made-up rows
    with the columns it names (an ID column, the features as numbers, the labels as class ids 0 and 1)."""
    rng = np.random.default_rng(0)
    for page in PAGES:
        for name, body in NAMED_TOML.findall(page.read_text()):
            (folder / name).write_text(body)
            data = tomllib.loads(body).get("data", {})
            if data.get("kind") != "csv":
                continue
            columns = [data["id_column"], *data["features"], data["labels"]]
            rows = [[f"p{i}", *(f"{v:.4f}" for v in rng.normal(size=len(data["features"]))), str(i % 2)]
                    for i in range(64)]
            (folder / data["path"]).write_text("\n".join(",".join(r) for r in [columns, *rows]) + "\n")
        for name, body in NAMED_CSV.findall(page.read_text()):
            (folder / name).write_text(_made_up_table(body, rng))


def _made_up_table(sample: str, rng: np.random.Generator) -> str:
    """``CSV_ROWS`` rows like a page's CSV ``sample`` (its header, then a few rows): a column of the sample's
    numbers gets random numbers, a column of text one of the sample's texts, the first column distinct IDs;
    a column with a missing cell in the sample has one in every seventh row."""
    header, *rows = [line.split(",") for line in sample.strip().splitlines()]
    columns = list(zip(*rows))
    out = [header]
    for i in range(CSV_ROWS):
        row = [f"{header[0]}{i}"]
        for k, cells in enumerate(columns[1:], start=1):
            present = [c for c in cells if c not in ("", "NA")]
            if len(present) < len(cells) and i % 7 == k % 7:
                row.append("NA")
            elif all(c.replace(".", "", 1).isdigit() for c in present):
                row.append(f"{rng.uniform(0, 2 * max(float(c) for c in present)):.2f}")
            else:
                row.append(present[int(rng.integers(0, len(present)))])
        out.append(row)
    return "\n".join(",".join(r) for r in out) + "\n"


def test_the_readme_has_the_commands_this_test_expects():
    flat = [" ".join(argv) for block in BLOCKS for argv in block]
    assert any(c.startswith("make demo") for c in flat) and any(c.startswith("make test") for c in flat)
    assert sum(c.startswith("distgrad-stage g") for c in flat) >= 3
    assert any("seed-simple" in c for c in flat) and any(c.startswith("distgrad plot") for c in flat)


# Whole recommended runs (digits-budget: 1,320 steps; digits-label-dp: 800) are slow: the same commands on the
# other experiments run by default, and tests/test_budget.py and tests/test_label_dp.py train both settings.
LONG_RUNS = ("distgrad run digits-budget", "distgrad run digits-label-dp")


def _block_param(index: int):
    long = any(" ".join(argv).startswith(LONG_RUNS) for argv in BLOCKS[index])
    return pytest.param(index, marks=pytest.mark.slow) if long else index


@pytest.mark.parametrize("index", [_block_param(i) for i in range(len(BLOCKS))],
                         ids=lambda i: " | ".join(" ".join(a[:3]) for a in BLOCKS[i]))
def test_readme_block_runs(tmp_path, monkeypatch, index):
    port = str(free_tcp_port())
    background: list[subprocess.Popen] = []
    _write_named_files(tmp_path)
    try:
        for argv in BLOCKS[index]:
            if argv[0] == "make":
                continue                            # .ci/run runs the make targets
            if argv[0] in (".", "source"):
                continue                            # the activation: test_activating_the_venv_puts_the_commands_on_the_path
            argv = [a.replace("5555", port).replace("G_ADDR", "127.0.0.1") for a in argv]
            assert argv[0] in ("distgrad", "distgrad-stage"), argv
            argv[0] = str(BIN / argv[0])
            if argv[1:3] == ["g", "--experiment"] or (argv[1] in ("g", "predict") and "--bind" in argv):
                log = open(tmp_path / f"g{len(background)}.log", "w")
                background.append(subprocess.Popen(argv, cwd=tmp_path, env=pinned_env(), stdout=log,
                                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
                continue
            if Path(argv[0]).name == "distgrad":
                # distgrad.cli.main, here (the console script is that function: see
                # test_activating_the_venv_puts_the_commands_on_the_path): `distgrad run` still starts every
                # stage as a process; only the launcher's interpreter start and plot's matplotlib import
                # are saved.
                monkeypatch.chdir(tmp_path)
                result = run_launcher(argv[1:])
            else:
                result = subprocess.run(argv, cwd=tmp_path, env=pinned_env(), capture_output=True, text=True,
                                        timeout=120, stdin=subprocess.DEVNULL)
            assert result.returncode == 0, f"{' '.join(argv)}\n{result.stdout}\n{result.stderr}"
        for proc in background:
            assert proc.wait(60) == 0, (tmp_path / "g0.log").read_text()
    finally:
        for proc in background:
            stop_process(proc)


def test_activating_the_venv_puts_the_commands_on_the_path(tmp_path):
    """After ``make demo`` the README's hand-run commands need ``.venv/bin`` on the PATH: its Quickstart says how."""
    flat = [" ".join(argv) for block in BLOCKS for argv in block]
    activate = next(c for c in flat if c.split()[0] in (".", "source"))
    assert activate.split()[1] == ".venv/bin/activate"
    quickstart = README.read_text().split("## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    assert ". .venv/bin/activate" in quickstart                     # before the first hand-run command
    env = dict(pinned_env(), PATH="/usr/bin:/bin")                  # a shell that has not activated anything
    script = f". {BIN / 'activate'} && command -v distgrad-stage && command -v distgrad"
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(BIN / "distgrad-stage"), str(BIN / "distgrad")]


def test_the_readme_and_the_security_page_say_a_stage_file_is_code():
    """A stage or experiment file runs code and reads where it says: the README and docs/security.md say that it
    is trusted like a Python script, that a party reads any file it did not write, and that only the interface
    needs sending."""
    security = (README.parent / "docs" / "security.md").read_text()
    for text in (" ".join(README.read_text().split()), " ".join(security.split())):
        assert "trusted like a Python script" in text
        assert 'module = "os:system"' in text and "may point anywhere" in text
        assert "read any file it did not write" in text or "Read any experiment or stage file you did not write" in text
        assert "the only part" in text and "interface" in text
    assert "## Experiment and stage files are code" in security


def _flat(path: Path) -> str:
    return " ".join(path.read_text().split())


def test_what_crosses_the_wire_names_splitfeds_parameters_wherever_it_is_said():
    """SplitFed's ``average`` carries a client's first-stage parameters to the label owner and their mean back:
    no page says parameters never cross, and the concepts (docs/experiments.md), security and privacy pages name
    that exception."""
    docs = README.parent / "docs"
    concepts, security, privacy = _flat(docs / "experiments.md"), _flat(docs / "security.md"), _flat(docs / "privacy.md")
    for text in (_flat(README), concepts, security):
        assert "Never parameters" not in text and "Parameters and optimiser state stay on their stage" not in text
        assert "Weights, Adam's `m`/`v` and beta powers are never sent" not in text
    assert "SplitFed" in concepts and "**its first-stage parameters**" in concepts
    assert "except in SplitFed" in security and "first-stage parameters to the label owner" in security
    assert "with SplitFed" in privacy and "first-stage parameters to the label owner" in privacy


def test_the_topologies_page_lists_every_training_and_predict_message_as_crossing():
    """docs/topologies.md, "What crosses the wire": every message type of the stages' protocol (the align
    tool's are in docs/security.md) is in the table, SplitFed's average among them."""
    from distgrad.wire import messages as wire

    text = (README.parent / "docs" / "topologies.md").read_text()
    section = text.split("## What crosses the wire\n", 1)[1].split("\n## ", 1)[0]
    stage_messages = {t for t in wire.MESSAGE_TYPES if not t.startswith("align_")}
    missing = sorted(t for t in stage_messages if f"`{t}`" not in section)
    assert not missing, f"not in docs/topologies.md's What crosses the wire: {missing}"
    splitfed = next(line for line in section.splitlines() if 'mode = "splitfed"' in line)
    assert "`average`" in splitfed and "first-stage parameters" in splitfed
