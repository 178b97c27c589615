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
