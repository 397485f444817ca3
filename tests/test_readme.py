"""The README stays true: its relative links resolve in a clone, and its status-code table lists
exactly the codes a client can get from the server."""

from __future__ import annotations

import re
from pathlib import Path

import grpc

from scorer.request import InvalidInput
from scorer.server.auth import Unauthenticated
from scorer.server.batcher import Closed, Dropped, OutOfMemory, QueueFull
from scorer.server.handler import MessageTooLarge, NotReady, status_for

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_relative_links_resolve_in_the_repository():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    relative = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert relative, "no links found"
    missing = [link for link in relative if not (ROOT / link).resolve().exists()]
    assert not missing, missing
    assert all((ROOT / link).resolve().is_relative_to(ROOT) for link in relative)


def test_the_status_code_table_lists_every_code_the_server_answers():
    table = README[README.index("**Status codes.**") : README.index("**Batching and limits.**")]
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
