"""The README and docs/ stay true and findable: the README is short and links every page, links
resolve in a clone, every flag (with its default), status code and metric is documented, no page
carries the project's development history, and every Grafana panel says what it shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import pytest

from scorer import cli, ray_local
from scorer.request import InvalidInput
from scorer.server.auth import Unauthenticated
from scorer.server.batcher import Closed, Dropped, OutOfMemory, QueueFull
from scorer.server.handler import MessageTooLarge, NotReady, status_for

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
DOCS_TEXT = "\n".join(p.read_text() for p in DOCS)
MOST_README_LINES = 250
# the project's development history and the team's own tooling, which the product's pages never name
HISTORY = re.compile(
    r"\bsession \d|\bsessions \d|\bissue \d|\bissues \d|\bstint|RESULTS section|\bsection \d+ of RESULTS"
    r"|\bprobe\d|\.gpu/|\bthe device machine|\bGPU kit|shared/seed|shared/gpu|\.\./shared",
    re.IGNORECASE,
)


def links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())


def test_the_readme_is_read_in_five_minutes():
    assert len(README.splitlines()) < MOST_README_LINES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve_in_the_repository(page):
    relative = [link for link in links(page) if not re.match(r"[a-z]+://", link)]
    missing = [link for link in relative if not (page.parent / link).resolve().exists()]
    assert not missing, missing
    assert all((page.parent / link).resolve().is_relative_to(ROOT) for link in relative)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / link).resolve() for link in links(ROOT / "README.md")}
    assert not [p.name for p in DOCS if p.resolve() not in linked]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_carries_development_history_or_team_paths(page):
    found = [m.group(0) for m in HISTORY.finditer(page.read_text())]
    assert not found, found


def test_the_status_code_table_lists_every_code_the_server_answers():
    api = (ROOT / "docs" / "api.md").read_text()
    table = api[api.index("**Status codes.**") : api.index("**Deadlines.**")]
    listed = set(re.findall(r"^\| `([A-Z_]+)`", table, flags=re.M))
    raised = (
        InvalidInput("docs", "x"),
        QueueFull(),
        OutOfMemory(),
        MessageTooLarge(),
        Dropped("deadline"),
        Dropped("cancelled"),
        NotReady(),
        Closed(),
        RuntimeError("a bug"),
        Unauthenticated(),
    )
    answered = {status_for(e)[0].name for e in raised}
    answered |= {
        grpc.StatusCode.CANCELLED.name,
        grpc.StatusCode.DEADLINE_EXCEEDED.name,
    }  # Front.cancelled_code
    assert listed == answered


def _flags(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def test_every_flag_is_documented():
    """Of scorer serve, scorer score and make deploy-local, each in backquotes somewhere in docs/."""
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    flags = _flags(sub.choices["serve"]) | _flags(sub.choices["score"]) | _flags(ray_local.build_parser())
    missing = sorted(f for f in flags if f"`{f}`" not in DOCS_TEXT)
    assert not missing, missing


def _shown(value) -> str:
    """A default as docs/operating.md's flag table writes it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None or value == "" else str(value)


def test_the_flag_table_shows_each_settings_default():
    """docs/operating.md's `| --flag | default | ... |` rows against ``Settings``' defaults, for every
    flag that is a setting (the rest, ``scorer score``'s call options, have no setting)."""
    import dataclasses

    from scorer.settings import Settings

    fields = {f.name: f.default for f in dataclasses.fields(Settings)}
    rows = re.findall(
        r"^\| `--([a-z0-9-]+)` \| ([^|]*) \|", (ROOT / "docs" / "operating.md").read_text(), re.M
    )
    checked = [
        (flag, shown.strip(), _shown(fields[flag.replace("-", "_")]))
        for flag, shown in rows
        if flag.replace("-", "_") in fields
    ]
    assert len(checked) > 40
    wrong = [row for row in checked if row[1] != row[2]]
    assert not wrong, wrong


def test_every_metric_is_documented():
    source = (ROOT / "scorer" / "metrics.py").read_text()
    names = set(re.findall(r'(?:Counter|Gauge|Histogram)\(\s*"(scorer_\w+)"', source))
    assert len(names) > 20
    documented = {n for n in names if n in DOCS_TEXT or f"{n}_total" in DOCS_TEXT}
    assert names == documented, sorted(names - documented)


def test_every_grafana_panel_says_what_it_shows():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "scorer-dashboard.json").read_text())
    bare = [p["title"] for p in dashboard["panels"] if len(p.get("description", "")) < 40]
    assert not bare, bare
