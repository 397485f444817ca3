"""``scorer score``: a bad file prints no result, ids and indexes count docs (not lines), the
request options work as flags, and every flag is explained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scorer import cli
from scorer.engine import Engine

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SCORER_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cli-cache"))


def score(capsys, path, *flags):
    """rc, the result lines and stderr of ``scorer score`` on ``path``."""
    rc = cli.main(["score", "--prompt", "greek letters", "--docs", str(path), "--device", "cpu", *flags])
    out, err = capsys.readouterr()
    return rc, [json.loads(line) for line in out.splitlines()], err


def write(tmp_path, *lines) -> str:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_an_error_in_the_last_chunk_prints_no_result_and_scores_nothing(tmp_path, capsys, monkeypatch):
    launched = []
    real = Engine.launch
    monkeypatch.setattr(Engine, "launch", lambda self, jobs: launched.append(jobs) or real(self, jobs))
    path = write(tmp_path, *[{"text": f"doc {i}"} for i in range(299)], {"text": ""})
    rc, out, err = score(capsys, path)
    assert rc == 2 and out == [] and not launched
    assert (
        err.strip().splitlines()[-1]
        == "error: docs[299].text: empty document (only white space or control characters)"
    )


def test_a_null_or_missing_id_is_the_index_and_a_number_its_json_text(tmp_path, capsys):
    path = write(
        tmp_path,
        {"text": "alpha", "id": None},
        {"text": "beta"},
        {"text": "gamma", "id": 7},
        {"text": "delta", "id": 2.5},
        {"text": "epsilon", "id": "e"},
    )
    rc, out, _ = score(capsys, path)
    assert rc == 0 and [o["id"] for o in out] == ["0", "1", "7", "2.5", "e"]


def test_blank_lines_count_neither_for_ids_nor_for_the_docs_of_errors(tmp_path, capsys):
    rc, out, _ = score(capsys, write(tmp_path, "", {"text": "alpha"}, "  ", {"text": "beta"}))
    assert rc == 0 and [(o["index"], o["id"]) for o in out] == [(0, "0"), (1, "1")]
    rc, out, err = score(capsys, write(tmp_path, "", {"text": "alpha"}, "", {"text": " "}))
    assert rc == 2 and out == [] and "error: docs[1].text: empty document" in err
    rc, out, err = score(capsys, write(tmp_path, "", {"text": "alpha"}, "", "{oops"))
    assert rc == 2 and out == [] and f"error: {tmp_path / 'docs.jsonl'}:4: not JSON" in err


def test_invalid_utf8_names_its_line(tmp_path, capsys):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "alpha"}\n\n{"text": "caf\xe9"}\n')
    rc, out, err = score(capsys, path)
    assert rc == 2 and out == []
    assert err.strip() == f"error: {path}:3: not UTF-8"


def test_top_n_prints_the_best_docs_by_score(tmp_path, capsys):
    path = write(tmp_path, *[{"text": t} for t in ("alpha beta", "gamma", "delta", "epsilon zeta", "eta")])
    rc, every, _ = score(capsys, path)
    assert rc == 0 and len(every) == 5
    rc, best, _ = score(capsys, path, "--top-n", "2")
    want = sorted(every, key=lambda o: -o["score"])[:2]
    assert rc == 0 and [o["index"] for o in best] == [o["index"] for o in want]
    assert [o["score"] for o in best] == pytest.approx([o["score"] for o in want], abs=1e-6)


def test_label_tokens_change_the_scores(tmp_path, capsys):
    path = write(tmp_path, {"text": "alpha beta"}, {"text": "gamma"})
    _, yes_no, _ = score(capsys, path)
    rc, no_yes, _ = score(capsys, path, "--label-tokens", "no", "yes")
    assert rc == 0
    assert [a["score"] + b["score"] for a, b in zip(yes_no, no_yes, strict=True)] == pytest.approx([1, 1])
    assert [a["score"] for a in yes_no] != pytest.approx([b["score"] for b in no_yes])


def test_max_doc_tokens_refuses_or_with_truncate_doc_end_cuts(tmp_path, capsys):
    path = write(tmp_path, {"text": "alpha beta gamma delta epsilon"}, {"text": "eta"})
    rc, out, err = score(capsys, path, "--max-doc-tokens", "4")
    assert rc == 2 and out == [] and "error: docs[0]" in err
    rc, out, _ = score(capsys, path, "--max-doc-tokens", "4", "--truncate", "doc_end")
    assert rc == 0 and out[0]["truncated_tokens"] > 0 and "truncated_tokens" not in out[1]


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--model", "/nonexistent/checkpoint"], "--model (model): '/nonexistent/checkpoint' is not a"),
        (["--cuda-graph-max-tokens", "-1"], "--cuda-graph-max-tokens (cuda_graph_max_tokens): -1"),
        pytest.param(
            ["--device", "cuda"],
            "--device (device): 'cuda'",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here"),
        ),
    ],
)
def test_a_bad_setting_is_one_error_line(tmp_path, capsys, flags, fragment):
    rc, out, err = score(capsys, write(tmp_path, {"text": "alpha"}), *flags)
    assert rc == 2 and out == []
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: {fragment}")


def test_every_flag_of_both_subcommands_is_explained_in_plain_text():
    parser = cli.build_parser()
    assert "``" not in parser.description
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        assert p.description and "``" not in p.description, name
        for action in p._actions:
            assert action.help and "``" not in action.help, (name, action.dest)


@pytest.mark.parametrize("command", ["score", "serve"])
def test_help_prints(capsys, command):
    """``--help`` of each subcommand prints (a help text with a bare % once broke argparse's)."""
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0 and "--device" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["serve", "--help"],
        ["score", "--help"],
        ["serve", "--no-such-flag"],
        ["serve", "--port", "x"],
    ],
)
def test_help_and_argument_errors_answer_before_the_model_stack_is_imported(argv):
    """``scorer --help``, ``scorer serve --help`` and a bad flag take a few hundredths of a second
    because nothing heavy is imported before the arguments are parsed: the modules a process has
    imported when argparse exits are counted, not the clock (torch alone takes ~2 s to import on
    a 2-core machine)."""
    probe = (
        "import sys\n"
        "from scorer import cli\n"
        "try:\n"
        f"    cli.main({argv!r})\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'transformers', 'tokenizers',"
        " 'numpy', 'grpc', 'fastapi'} or m == 'scorer.engine')\n"
        "print('EXIT', code, 'HEAVY', heavy, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    last = done.stderr.strip().splitlines()[-1]
    code = 0 if argv[-1] == "--help" else 2
    assert last == f"EXIT {code} HEAVY []", done.stderr


def test_serve_help_says_it_serves_grpc_and_http(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "gRPC" in out and "HTTP" in out and "fused" in out


def test_a_scheme_or_template_is_checked_when_the_arguments_are_parsed(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(
            ["score", "--prompt", "q", "--docs", str(write(tmp_path, {"text": "a"})), "--scheme", "nope"]
        )
    err = capsys.readouterr().err
    assert done.value.code == 2 and "--scheme: invalid choice: 'nope'" in err and "ragged" in err
    with pytest.raises(SystemExit):
        cli.main(["score", "--prompt", "q", "--docs", "d", "--template", "nope"])
    assert "qwen3_reranker" in capsys.readouterr().err


def test_http_port_without_the_http_extra_is_one_line(monkeypatch, capsys):
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(
        cli.importlib.util, "find_spec", lambda name: None if name == "fastapi" else real(name)
    )
    with pytest.raises(SystemExit) as done:
        cli.main(["serve", "--http-port", "8080"])
    assert done.value.code == 2 and "pip install 'scorer[http]'" in capsys.readouterr().err
