"""CPU-only checks of scripts/tf_determinism.py's trace comparison (the part that decides which
transformers variant the benchmark runs with). No torch needed.

    python3 -m pytest tests/bench -q
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import tf_determinism as td  # noqa: E402


def test_first_difference_names_the_entry():
    a = ["0:3.linear_attn:1", "0:3.self_attn:2", "1:logits:3"]
    assert td.first_difference(a, list(a)) is None
    b = ["0:3.linear_attn:1", "0:3.self_attn:9", "1:logits:4"]
    assert td.first_difference(a, b) == (1, "0:3.self_attn:2", "0:3.self_attn:9")
    # A trace that stops early differs where it stops.
    assert td.first_difference(a, a[:2]) == (2, None, None)


def test_compare_reports_across_processes(tmp_path, capsys):
    rep = {"tokens": [1, 2, 3], "top2_gaps": [0.1, 0.2, 0.3], "trace": ["0:logits:5", "1:logits:6"]}
    other = dict(rep, tokens=[1, 2, 4], trace=["0:logits:5", "1:logits:7"])
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"runs": {"sdpa-flash": [rep, rep], "sdpa": [rep, rep]}}))
    b.write_text(json.dumps({"runs": {"sdpa-flash": [rep, rep], "sdpa": [other, other]}}))
    td.compare(str(a), str(b))
    out = capsys.readouterr().out
    assert "sdpa-flash across processes: identical" in out
    assert "sdpa across processes: first checksum difference at entry 1" in out and "first token difference at step 2" in out
