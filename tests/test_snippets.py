"""Every shell and Python snippet of the README and docs/ runs as written against a live server
(the HTTP ones through curl and the real SDKs of the dev extra), and a sample output marked as
such equals what its snippet prints.

A fenced block is a snippet when its language is bash, sh or python. The line before its fence
may say otherwise: ``<!-- not run: why -->`` for the few that cannot run here (a GPU, a download,
a server that does not stop). ``<!-- output of the block above -->`` before a ``text`` block makes
it the exact output of the snippet above it. The snippets of one page run in order in one
scratch environment, from the repository root (they write under the git-ignored ``out/``), with
the environment's ``scorer`` and ``python`` first on the PATH, as after ``source .venv/bin/activate``.
The server listens on free ports: a snippet's default ports (50051, 8080, 9464) are replaced by
them before it runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "rpc"))
from rpc_harness import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"bash", "sh"}
RUNNABLE = SHELLS | {"python"}
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->")
OUTPUT = "<!-- output of the block above -->"
DEFAULT_PORTS = {"grpc": 50051, "http": 8080, "metrics": 9464}
MOST_NOT_RUN = 20  # a few snippets that cannot run here; the rest must
SNIPPET_S = 300
START_S = 180

pytestmark = pytest.mark.slow


@dataclass
class Snippet:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    not_run: str | None = None  # the reason it is not run
    output: str | None = None  # the exact output it must print

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def snippets(page: Path) -> list[Snippet]:
    """The fenced blocks of a page in order, with the marker on the line before each."""
    found: list[Snippet] = []
    lines = page.read_text().splitlines()
    i, previous = 0, ""
    while i < len(lines):
        fence = re.match(r"^```(\w*)", lines[i])
        if not fence:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        code = "\n".join(body) + "\n"
        marker = NOT_RUN.fullmatch(previous)
        if previous == OUTPUT:
            assert fence[1] == "text" and found and found[-1].lang in RUNNABLE, f"{page}:{start + 1}"
            found[-1].output = code
        else:
            found.append(Snippet(page, start + 1, fence[1], code, marker[1] if marker else None))
        i, previous = i + 1, ""
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``scorer serve`` with its HTTP routes, on free ports, until the module's tests end."""
    ports = {name: free_port() for name in DEFAULT_PORTS}
    cache = tmp_path_factory.mktemp("snippets-cache")
    env = os.environ | {"PYTHONPATH": str(ROOT), "SCORER_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-m", "scorer", "serve", "--port", str(ports["grpc"])]
    cmd += ["--http-port", str(ports["http"]), "--metrics-port", str(ports["metrics"])]
    log = (cache / "server.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    give_up = time.monotonic() + START_S
    while True:
        assert proc.poll() is None, (cache / "server.log").read_text()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert time.monotonic() < give_up, (cache / "server.log").read_text()
        time.sleep(0.5)
    yield ports, env
    proc.terminate()
    proc.wait(60)
    log.close()


def on_ports(code: str, ports: dict[str, int]) -> str:
    for name, default in DEFAULT_PORTS.items():
        code = re.sub(rf"(?<![\d.]){default}(?!\d)", str(ports[name]), code)
    return code


def run(snippet: Snippet, ports: dict[str, int], env: dict[str, str]) -> subprocess.CompletedProcess:
    code = on_ports(snippet.code, ports)
    if snippet.lang in SHELLS:
        argv = ["bash", "-euo", "pipefail", "-c", code]
    else:
        argv = [sys.executable, "-c", code]
    path = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        argv, cwd=ROOT, env=env | {"PATH": path}, capture_output=True, text=True, timeout=SNIPPET_S
    )


def runnable(page: Path) -> list[Snippet]:
    return [s for s in snippets(page) if s.lang in RUNNABLE and s.not_run is None]


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: p.name)
def test_every_snippet_of_the_page_runs_as_written(page, server):
    ports, env = server
    for snippet in runnable(page):
        done = run(snippet, ports, env)
        assert done.returncode == 0, (
            f"{snippet} exited {done.returncode}:\n{snippet.code}\n{done.stderr[-3000:]}"
        )
        if snippet.output is not None:
            assert done.stdout == snippet.output, f"{snippet} printed:\n{done.stdout}"


def test_no_run_snippet_installs_into_the_tests_environment():
    """A snippet that installs packages would change the environment every later test runs in (an
    upgraded huggingface_hub broke transformers' requirement): such a block is marked not run."""
    installs = [
        str(s) for p in PAGES for s in runnable(p) if re.search(r"\b(pip|uv|apt-get) install\b", s.code)
    ]
    assert not installs, installs


def test_few_snippets_are_not_run_and_each_says_why():
    skipped = [s for p in PAGES for s in snippets(p) if s.not_run is not None]
    assert len(skipped) <= MOST_NOT_RUN, [str(s) for s in skipped]
    assert all(len(s.not_run) > 5 for s in skipped), [str(s) for s in skipped]
    assert all(s.lang in RUNNABLE for s in skipped), [f"{s} ({s.lang})" for s in skipped]


def test_every_code_block_says_its_language():
    """A block without a language would be neither run nor checked."""
    unnamed = [str(s) for p in PAGES for s in snippets(p) if not s.lang]
    assert not unnamed, unnamed


def test_the_readme_shows_what_the_example_client_prints():
    (client,) = [s for s in snippets(ROOT / "README.md") if "examples/client.py" in s.code and s.output]
    assert client.not_run is None and client.lang in SHELLS


def test_the_marker_parser_reads_markers_outputs_and_order(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "intro\n\n```bash\necho one\n```\n\n<!-- output of the block above -->\n```text\none\n```\n\n"
        "<!-- not run: needs a GPU -->\n```python\nimport torch\n```\n\n```json\n{}\n```\n"
    )
    got = [(s.line, s.lang, s.code, s.not_run, s.output) for s in snippets(page)]
    assert got == [
        (3, "bash", "echo one\n", None, "one\n"),
        (13, "python", "import torch\n", "needs a GPU", None),
        (17, "json", "{}\n", None, None),
    ]
    assert on_ports(
        "curl localhost:8080/x; 127.0.0.1:50051 :9464 18080", {"grpc": 1, "http": 2, "metrics": 3}
    ) == ("curl localhost:2/x; 127.0.0.1:1 :3 18080")


def test_info_reports_the_models_positions_as_the_longest_input(server):
    """/info's max_input_length is what a document can really have: the embedded model has 4,096
    positions, under the default --max-doc-tokens of 8,192."""
    ports, _ = server
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/info", timeout=10) as r:
        info = json.load(r)
    assert info["limits"]["max_doc_tokens"] == 8192 and info["limits"]["max_positions"] == 4096
    assert info["max_input_length"] == 4096


def test_the_api_pages_client_is_the_example_clients_code():
    (snippet,) = [s for s in snippets(ROOT / "docs" / "api.md") if "def rank(" in s.code]
    rank = snippet.code[snippet.code.index("def rank(") : snippet.code.index("\n\n\nresponse = ")]
    assert rank in (ROOT / "examples" / "client.py").read_text()
