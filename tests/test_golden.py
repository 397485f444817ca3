"""The embedded default's scores and usage reproduce tests/data/golden.json bit for bit (see
scripts/golden.py): a refactor may not move a score by one ulp."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "golden.py"


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SCORER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield runpy.run_path(str(SCRIPT))
    mp.undo()


def test_the_engine_reproduces_the_golden_file_exactly(tmp_path):
    """In a process of its own: the script's reproducible-math environment is read when torch
    starts (this process started it already)."""
    env = {**os.environ, "SCORER_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "golden.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    want = json.loads((SCRIPT.parents[1] / "tests" / "data" / "golden.json").read_text())
    got = json.loads(out.read_text())
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name


def test_the_golden_cases_cover_every_scheme_template_and_a_split(golden):
    names = [name for name, _, _ in golden["cases"]()]
    want = json.loads(golden["GOLDEN"].read_text())
    for scheme in ("auto", *golden["CONCRETE"]):
        for kind, budget in (("ids", golden["IDS_SPLIT"]), ("text", golden["TEXT_SPLIT"])):
            assert {f"{kind}/{scheme}", f"{kind}/{scheme}/split{budget}"} <= set(names)
            assert want[f"{kind}/{scheme}"]["usage"][2] > budget  # tokens computed: over a pass
            # the prompt still computed once
            assert want[f"{kind}/{scheme}/split{budget}"]["usage"] == want[f"{kind}/{scheme}"]["usage"]
