"""The documentation holds together: every relative link of the README and docs/ reaches a file that exists and,
with an anchor, a heading of that file; the README stays a front page."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, a repeated
    heading numbered from -1."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_every_relative_link_reaches_a_file_and_a_heading():
    broken = []
    for page in PAGES:
        for target in _links(page):
            if re.match(r"[a-z]+:", target):
                continue                                    # https:, mailto:
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_page():
    """What it is, the two commands, a run on your own CSV, your own loop, the features with links, where next;
    the reference lives in docs/."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 220
    headings = re.findall(r"^## (.+)$", FENCE.sub("", text), re.M)
    assert headings[0] == "Quickstart"
    for heading in ("Two parties, your own CSV", "Your own PyTorch loop, on either side of the cut", "What it does",
                    "Where to go next"):
        assert heading in headings, heading
    for page in ("cli.md", "experiments.md", "pipelining.md", "watching.md", "testing.md"):
        assert f"(docs/{page}" in text, page


TICKET = re.compile(r"\bissues? ?#?[0-9]|\bissue-[0-9]", re.I)
# What is not the repository's own text: git's store, the virtual environment, caches and build output.
NOT_OURS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", ".mypy_cache", "build",
            "dist", "runs"}


def _repository_files() -> list[Path]:
    files = []
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [s for s in subfolders if s not in NOT_OURS and not s.endswith(".egg-info")]
        files += [Path(folder) / name for name in names]
    return files


def test_no_file_cites_a_tracker_issue_by_number():
    """Comments, docstrings, tests and docs name the behaviour they mean, never a ticket of a tracker the repository
    does not contain: no number after the word, nor a heading anchor made of the two."""
    found = []
    for path in _repository_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue                                        # binary: images, archives
        for number, line in enumerate(text.splitlines(), 1):
            if TICKET.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "name the behaviour instead:\n" + "\n".join(found)


# Flags of other programs a page shows (pip, docker, kubectl, systemctl, tensorboard, py-spy).
OTHER_PROGRAMS_FLAGS = {"--index-url", "--build", "--volumes", "--no-deps", "--rm", "--from-file", "--now", "--logdir",
                        "--format", "--idle", "--nonblocking"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
SCRIPTS = [*sorted((ROOT / "benchmarks").glob("*.py")), ROOT / "distgrad" / "vertical_example.py"]


def _script_flags(path: Path) -> set[str]:
    """The option strings a script's ``add_argument`` calls declare (read from its source: no process started)."""
    flags = set()
    for head in re.findall(r"add_argument\(\s*((?:\"-[^\"]*\"\s*,\s*)+)", path.read_text()):
        flags.update(f for f in re.findall(r"\"(--[^\"]+)\"", head))
    return flags


def _commands() -> dict[str, set[str]]:
    """Each command the pages show, by the words that start it, with its option strings."""
    import argparse

    from distgrad import cli

    def options(parser: argparse.ArgumentParser) -> set[str]:
        return {s for action in parser._actions for s in action.option_strings if s.startswith("--")}

    stage = options(cli.build_stage_parser())
    commands = {"distgrad-stage": stage, "distgrad stage": stage}
    for action in cli.build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands.update({f"distgrad {name}": options(sub) for name, sub in action.choices.items() if name != "stage"})
    commands.update({path.name: _script_flags(path) for path in SCRIPTS})
    commands["distgrad.vertical_example"] = commands.pop("vertical_example.py")
    return commands


def _command_lines(page: Path) -> list[str]:
    """The lines of a page's code blocks (continuations joined) and its inline code spans."""
    text = page.read_text()
    lines = [line for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
             for line in block.replace("\\\n", " ").splitlines()]
    for paragraph in re.split(r"\n\s*\n", FENCE.sub("", text)):
        lines += re.findall(r"`([^`]+)`", " ".join(paragraph.split()))
    return lines


def test_every_flag_a_page_gives_a_command_is_one_of_its_flags():
    """A flag written after ``distgrad SUB``, ``distgrad-stage``, a benchmark script or ``python -m
    distgrad.vertical_example`` (in a code block or an inline span) is one that command takes, and every flag a page
    names is one of some command's (or of another program it shows: pip, docker, tensorboard, ...)."""
    commands = _commands()
    known = set().union(*commands.values()) | OTHER_PROGRAMS_FLAGS
    wrong = []
    for page in PAGES:
        for line in _command_lines(page):
            tokens, flags = line.split(), None
            for i, token in enumerate(tokens):
                word = token.rsplit("/", 1)[-1]
                pair = f"{word} {tokens[i + 1]}" if i + 1 < len(tokens) else ""
                if pair in commands or word in commands:
                    command, flags = (pair, commands[pair]) if pair in commands else (word, commands[word])
                elif token in ("#", "|", "&&", ";", "&", "||"):
                    flags = None
                elif flags is not None and FLAG.match(token.lstrip("[")):
                    flag = FLAG.match(token.lstrip("[")).group(0)
                    if flag not in flags:
                        wrong.append(f"{page.relative_to(ROOT)}: {command} has no {flag}: {line.strip()[:100]}")
        for flag in sorted(set(FLAG.findall(page.read_text())) - known):
            wrong.append(f"{page.relative_to(ROOT)}: {flag} is no flag of any command")
    assert not wrong, "\n".join(wrong)


def test_the_command_line_page_names_every_flag():
    """docs/cli.md holds every flag: each of ``distgrad-stage`` in its flags table, each of ``distgrad run`` and
    the other subcommands on the page (``distgrad audit``'s on the privacy page, where its section is)."""
    commands = _commands()
    text = (ROOT / "docs" / "cli.md").read_text()
    table = text.split("`distgrad-stage STAGE` (also", 1)[1].split("\n\n", 2)[1]
    missing = sorted(commands["distgrad-stage"] - set(FLAG.findall(table)) - {"--help"})
    assert not missing, f"not in docs/cli.md's table of distgrad-stage's flags: {missing}"
    privacy = (ROOT / "docs" / "privacy.md").read_text()
    for command, flags in commands.items():
        if command.startswith("distgrad "):
            page = privacy if command == "distgrad audit" else text
            missing = sorted(flags - set(FLAG.findall(page)) - {"--help"})
            assert not missing, f"{command}'s flags not in its page: {missing}"


def test_the_stage_help_lists_the_exit_codes_the_command_line_page_gives():
    """The exit codes of docs/cli.md's "Flags and commands" are the ones ``distgrad-stage --help`` lists."""
    from distgrad import cli

    text = " ".join((ROOT / "docs" / "cli.md").read_text().split("## Flags and commands", 1)[1].split())
    paragraph = text.split("Exit codes: ", 1)[1].split("SIGINT / SIGTERM", 1)[0]
    codes = {int(c) for pair in re.findall(r"(?:^|; )(\d+)(?: / (\d+))? ", paragraph) for c in pair if c}
    assert {0, 1, 2, 3, 4, 130, 143} <= codes, codes
    described = " ".join(cli.build_stage_parser().description.split())
    missing = sorted(c for c in codes if not re.search(rf"\b{c}\b", described))
    assert not missing, f"distgrad-stage --help lists no exit code {missing}: {described}"


def test_an_init_command_into_a_folder_the_repository_ships_says_force():
    """``distgrad init`` refuses an ``--out`` folder that holds files unless ``--force``: a page's init command
    that writes the repository's own folders again (deploy/parties/...) gives it, so it runs as written."""
    import shlex

    refused = []
    for page in PAGES:
        for line in _command_lines(page):
            argv = shlex.split(line, comments=True) if line.lstrip().startswith("distgrad init") else []
            if "--out" in argv and argv.index("--out") + 1 < len(argv):
                out = ROOT / argv[argv.index("--out") + 1]
                if out.is_dir() and any(out.iterdir()) and "--force" not in argv:
                    refused.append(f"{page.relative_to(ROOT)}: {line.strip()}")
    assert not refused, "--out holds files, so init exits 2 without --force:\n" + "\n".join(refused)


def _defines(source: str, name: str) -> bool:
    """Whether a module's source defines or imports ``name``: a function, class, method, field, constant or import."""
    return bool(re.search(rf"^\s*(?:async def|def|class) {name}\b|^\s*(?:self\.)?{name}\s*[:=]|\bimport\b[^\n]*\b{name}\b"
                          rf"|^\s+{name},|[\'\"]{name}[\'\"]", source, re.M))


def _unreachable_names(page: Path) -> list[str]:
    """The ``distgrad.MODULE.NAME`` spans, ``distgrad/...``, ``tests/...`` and ``benchmarks/...`` paths (with a
    ``::test`` name) of a page that name no module, definition, file or test of the repository."""
    wrong = []
    for span in set(re.findall(r"`([^`\s]+)`", FENCE.sub("", page.read_text()))):
        span = span.rstrip(".,;:")
        path = re.fullmatch(r"((?:distgrad|tests|benchmarks)/[\w./*-]+?)(?:::(\w+))?", span)
        if path:
            found = sorted(ROOT.glob(path.group(1)))
            if not found:
                wrong.append(span)
            elif path.group(2) and not any(_defines(f.read_text(), path.group(2)) for f in found if f.is_file()):
                wrong.append(span)
            continue
        dotted = re.fullmatch(r"distgrad(?:\.\w+)+", re.sub(r"\(.*", "", span))
        if not dotted:
            continue
        parts = dotted.group(0).split(".")
        for n in range(len(parts), 0, -1):
            module = ROOT.joinpath(*parts[:n])
            file = module / "__init__.py" if module.is_dir() else module.with_suffix(".py")
            if file.is_file():
                break
        rest = parts[n:]
        if rest and not _defines(file.read_text(), rest[-1]):
            wrong.append(span)
    return wrong


def test_every_module_name_and_file_a_page_names_exists():
    """``distgrad.wire.link.evaluation_reply``, ``distgrad/run/driver.py``, ``tests/test_x.py::test_y``: each
    module, definition, file and test a page names in code spans is in the repository (read, not imported)."""
    wrong = [f"{page.relative_to(ROOT)}: {name}" for page in PAGES for name in _unreachable_names(page)]
    assert not wrong, "\n".join(wrong)
