"""bench/serve_load.py, the load test through the server with the openai client, against the tiny
model: every level reports its requests' tokens, and the latencies are ordered and positive."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import serve_load  # noqa: E402

from conftest import API_KEY  # noqa: E402


def test_levels_report_tokens_and_latencies(tiny, model_dir, tmp_path):
    vocab = json.loads((model_dir / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    out = tmp_path / "load.jsonl"
    lines = serve_load.main(["--url", tiny.url, "--api-key", API_KEY, "--concurrency", "1,3", "--modes", "greedy,sampled", "--prompt-len", "24", "--max-tokens", "6", "--vocab", str(vocab), "--out", str(out)])
    assert [(r["mode"], r["batch"]) for r in lines] == [("greedy", 1), ("greedy", 3), ("sampled", 1), ("sampled", 3)]
    for r in lines:
        # ignore_eos: every request generates exactly max_tokens.
        assert r["completion_tokens"] == 6 * r["requests"], r
        assert r["decode"]["aggregate_tok_s"] > 0, r
        assert 0 < r["ttft_secs"]["p50"] <= r["ttft_secs"]["p95"], r
        assert 0 <= r["itl_secs"]["p50"] <= r["itl_secs"]["p95"], r
    assert [json.loads(l) for l in out.read_text().splitlines()] == lines
