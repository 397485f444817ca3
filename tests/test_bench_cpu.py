"""The CPU benchmarks run and report every stage (their numbers are in bench/RESULTS.md)."""

import json

from bench import host_path


def test_host_path_reports_every_stage(tmp_path, capsys) -> None:
    host_path.main(["--calls", "12", "--batch", "6", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "host_path.json").read_text())
    for kind in ("token_ids", "text"):
        ms = result["ms"][kind]
        assert set(ms) == {"parse", "convert", "tokenize", "respond", "plan"}
        assert all(v > 0 for v in ms.values()), ms
    lookup = result["label_lookup_ms"]
    assert lookup["lookup"] < lookup["get_vocab"]
    assert "| token_ids |" in capsys.readouterr().out
