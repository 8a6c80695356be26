"""scripts/call_summary.py on a device call's output written here: test suites' counts and
failures, arms beside the base arm of their shape, digest checks (equal and not), the hand-over
differences, and the errors for a missing directory or a malformed --same."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("call_summary", os.path.join(ROOT, "scripts", "call_summary.py"))
cs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cs)


def line(arm, prefill, decode, digest, batch=None, digests=None):
    d = {"arm": arm, "prompt_len": 700, "prefill": {"tok_s": prefill}, "decode": {"tok_s": decode, "token_digest": digest}}
    if batch:
        d["batch"] = batch
        d["decode"]["aggregate_tok_s"] = decode * batch
        d["decode"]["token_digests"] = digests
    return json.dumps(d)


def write_call(tmp_path):
    (tmp_path / "tests-cuda_gpu.log").write_text("test a ... ok\ntest b ... FAILED\ntest result: FAILED. 12 passed; 1 failed; 0 ignored\nrc=101\n")
    (tmp_path / "tests-cuda_batch.log").write_text("test result: ok. 13 passed; 0 failed; 0 ignored\nrc=0\n")
    arms = [
        line("base b1 4K", 40000, 500, "aa"),
        line("all b1 4K", 50000, 550, "bb"),
        line("all9 b1 4K", 48000, 549, "bb"),
        line("base b16", 30000, 160, "x", 16, ["x", "y"]),
        line("all b16", 30000, 176, "x", 16, ["x", "z"]),
        line("all9 b16", 30000, 176, "x", 16, ["x", "y"]),
        "not json",
    ]
    (tmp_path / "call-ab.jsonl").write_text("\n".join(arms) + "\n")
    ho = []
    for way, us in [("launches+prefetch", 9.0), ("launches", 10.0), ("persistent+prefetch", 6.5), ("persistent", 7.0), ("no-wait+prefetch", 5.0)]:
        ho.append(json.dumps({"handover": {"way": way, "phase_bytes": 4194304, "blocks": 264, "neighbour": False, "us_per_phase": us}}))
    (tmp_path / "handover.jsonl").write_text("\n".join(ho) + "\n")


def test_summary_pairs_arms_checks_digests_and_reads_the_handover(tmp_path, capsys):
    write_call(tmp_path)
    rc = cs.main([str(tmp_path), "--same", "all=all9"])
    out = capsys.readouterr().out
    assert "cuda_gpu: 12 passed, 1 failed, rc 101 (b)" in out
    assert "cuda_batch: 13 passed, 0 failed, rc 0" in out
    # all b1 4K against base b1 4K: prefill +25.0%, decode +10.0%.
    assert "| all b1 4K | 50,000 | +25.0% | 550.0 | +10.0% | bb |" in out
    # The batch's aggregate is its headline rate: 176 x 16 against 160 x 16.
    assert "| all b16 | 30,000 | +0.0% | 2,816.0 | +10.0% | x |" in out
    assert "same: all b1 4K / all9 b1 4K" in out
    assert "MISMATCH: all b16 / all9 b16" in out  # the second sequence's digest differs
    assert "| 4.19 | 264 | the grid | 9.00 | 10.00 | 6.50 | 7.00 | 5.00 | +2.50 | +4.00 | +1.50 |" in out
    assert rc == 1  # a failed test and a mismatch


def test_a_clean_call_exits_zero_and_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "tests-cuda_prefill.log").write_text("test result: ok. 17 passed; 0 failed\nrc=0\n")
    (tmp_path / "ab.jsonl").write_text(line("base b1 700", 20000, 500, "aa") + "\n" + line("all b1 700", 21000, 505, "aa") + "\n")
    assert cs.main([str(tmp_path), "--same", "all=base"]) == 0
    assert cs.main([str(tmp_path / "missing")]) == 2
    assert cs.main([str(tmp_path), "--same", "all"]) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and "--same takes A=B" in err


def test_the_serving_load_test_reads_as_one_table_per_file(tmp_path, capsys):
    (tmp_path / "tests-cuda_gpu.log").write_text("test result: ok. 12 passed; 0 failed\nrc=0\n")
    rows = []
    for mode, c, tok_s, ttft, itl in [("greedy", 1, 430.74, 0.0495, 0.00219), ("greedy", 16, 1800.79, 0.2808, 0.00708),
                                      ("sampled", 16, 1732.82, 0.2631, 0.00744)]:
        rows.append(json.dumps({"mode": mode, "concurrency": c, "decode": {"aggregate_tok_s": tok_s},
                                "ttft_secs": {"p50": ttft}, "itl_secs": {"p95": itl}}))
    rows.append("{\"mode\": \"greedy\"}")  # a line without the figures is skipped
    (tmp_path / "serve_load.jsonl").write_text("\n".join(rows) + "\n")
    assert cs.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| C | greedy tok/s | TTFT p50 s | ITL p95 ms | sampled tok/s | TTFT p50 s | ITL p95 ms |" in out
    assert "| 16 | 1,800.8 | 0.281 | 7.1 | 1,732.8 | 0.263 | 7.4 |" in out
    assert "| 1 | 430.7 | 0.050 | 2.2 |  | | " in out  # no sampled row at one client


def test_step_windows_show_where_a_decode_changes_speed(tmp_path, capsys):
    steady = {"arm": "base p4K", "prompt_len": 4096, "prefill": {"tok_s": 1.0},
              "decode": {"tok_s": 500.0, "token_digest": "aa", "step_wall_secs": [0.002] * 4 + [0.0019] * 4}}
    batch = {"arm": "base b16", "batch": 16, "prefill": {"tok_s": 1.0},
             "decode": {"aggregate_tok_s": 1.0, "token_digest": "x", "step_wall_secs": [0.01] * 8}}
    (tmp_path / "ab.jsonl").write_text(json.dumps(steady) + "\n" + json.dumps(batch) + "\n")
    assert cs.main([str(tmp_path), "--step-windows", "4"]) == 0
    out = capsys.readouterr().out
    assert "## Median decode step (us) per 4 steps" in out
    assert "base p4K" + " " * 21 + "  2000   1900" in out
    assert "base b16   " not in out  # batched arms have no single sequence's steps
    cs.main([str(tmp_path)])
    assert "Median decode step" not in capsys.readouterr().out  # only when asked
