"""The repository speaks of the product, not of how it was built: no tracked file (code, tests,
docs, scripts, data) and no tracked path carries a history label: the name of a work stint or of
a tracker entry with its number, a cross reference to a numbered section of bench/RESULTS.md, a
numbered probe, or a path of the team's machines. A comment says what and why, with the measured
fact, and points at bench/RESULTS.md by the heading of its topic; when something was learned
belongs in git history.

The patterns are narrow on purpose: a pytest or Ray session, the article's section 5.3, another
project's ``owner/repo#123`` and "results 20 ms" are not labels (see the first test)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()  # it spells out the labels it looks for

LABELS = {
    "a work stint": r"\bsessions?[ -]?\d+|\bstints?\b",
    # a bare "#40"; not "owner/repo#2201", an XML "&#10;" or a colour "#333"
    "a tracker entry": r"\b(?:issues?|tasks?|tickets?)[ -]?#?\d+|(?<![\w/.&#-])#\d{1,2}\b",
    # "section 5." ends a sentence; "section 5.3" is the article's
    "a numbered section of bench/RESULTS.md": r"\bsections?[ -]?\d+(?!\.?\d)|§ ?\d+"
    r"|\b(?-i:RESULTS)(?:\.md)?,? \d+",
    "a numbered probe": r"\bprobe[_-]?\d+",
    "a path of the team's machines": r"/work/(?:main|wt)\b",
}
PATTERN = re.compile("|".join(f"(?P<k{i}>{p})" for i, p in enumerate(LABELS.values())), re.IGNORECASE)
KINDS = list(LABELS)


# the label words, spelt apart so that this file carries no label of its own
STINT, TRACKER = "ses" + "sion", "is" + "sue"


def labels(text: str) -> list[tuple[str, str]]:
    """(kind, the label as written) for every history label in ``text``."""
    return [(KINDS[int(m.lastgroup[1:])], m.group(0)) for m in PATTERN.finditer(text)]


def tracked_files() -> list[str]:
    """The repository's tracked files (every file under it, but hidden and build folders, when it is
    not a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        skip = {"__pycache__", "out", "build", "dist"}
        return [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts)
        ]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def test_the_patterns_find_each_kind_of_label_and_leave_the_product_words_alone():
    found = [
        "measured in " + STINT + " 21",
        "Sessions 9-15's buckets",
        "bench/data/" + STINT + "15/refit",
        "a stint of work",
        TRACKER.capitalize() + " 12, item 6",
        "fixed in #40",
        "task 3",
        "RESULTS section 27",
        "section 3's kernel grid",
        "bench/RESULTS.md, section 5.",
        "RESULTS 30",
        "§12",
        "scripts/gpu/probe18.sh",
        "/work/main/scorer/engine.py",
    ]
    for text in found:
        assert labels(text), text
    assert labels(f"bench/data/{STINT}15/refit/e2e.json") == [("a work stint", f"{STINT}15")]
    kept = [
        '@pytest.fixture(scope="session")',
        "the session's Ray",
        "Ray session /tmp/ray/session_2026-12-06_04-50-22_123456_1",
        "the article's section 5.3 guide",
        "flashinfer-ai/flashinfer#2201",
        "encode/httpx#3215",
        "https://github.com/ray-project/ray/issues/4512",
        '"first"\'s results 20 ms',
        "bench/RESULTS.md, The prefix cache",
        "#!/usr/bin/env bash",
        "color: #333",
        '"color": "#1f77b4"',
        "line&#10;",
    ]
    for text in kept:
        assert not labels(text), (text, labels(text))


def test_no_tracked_file_or_path_carries_a_history_label():
    found = []
    for name in tracked_files():
        found += [f"{name}: in its path: {label!r} ({kind})" for kind, label in labels(name)]
        path = ROOT / name
        if path.resolve() == THIS or not path.is_file():
            continue
        text = text_of(path)
        for n, line in enumerate((text or "").splitlines(), 1):
            found += [f"{name}:{n}: {label!r} ({kind}): {line.strip()[:100]}" for kind, label in labels(line)]
    assert not found, (
        f"{len(found)} history labels in tracked files. Say what and why with the measured fact, point at"
        " bench/RESULTS.md by the heading of its topic (not a section number), name data by what it"
        " measures, and leave when it was learned to git:\n" + "\n".join(found)
    )
