"""bench/serve_load.py, the load test through the server with the openai client, against the tiny
model: every level (two rounds of requests per client) reports its requests' tokens, and the
latencies are ordered and positive."""

import json
import re
import sys

import httpx
import pytest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import serve_load  # noqa: E402

from conftest import API_KEY  # noqa: E402


def test_levels_report_tokens_and_latencies(tiny, model_dir, tmp_path):
    vocab = json.loads((model_dir / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    out = tmp_path / "load.jsonl"
    hits = lambda: re.search(r"^lily_prefix_cache_hits_total (\d+)", httpx.get(f"{tiny.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text, re.M).group(1)
    before = hits()
    lines = serve_load.main(["--url", tiny.url, "--api-key", API_KEY, "--concurrency", "1,3", "--rounds", "2", "--modes", "greedy,sampled,json", "--prompt-len", "24", "--max-tokens", "6", "--vocab", str(vocab), "--out", str(out)])
    assert [(r["mode"], r["batch"]) for r in lines] == [(m, c) for m in ("greedy", "sampled", "json") for c in (1, 3)]
    for r in lines:
        assert r["requests"] == 2 * r["concurrency"], r
        # ignore_eos: every request generates exactly max_tokens.
        assert r["completion_tokens"] == 6 * r["requests"], r
        assert r["decode"]["aggregate_tok_s"] > 0, r
        assert 0 < r["ttft_secs"]["p50"] <= r["ttft_secs"]["p95"], r
        assert 0 <= r["itl_secs"]["p50"] <= r["itl_secs"]["p95"], r
        # The clients' own time: every request was seen going on the wire, and with two rounds
        # each client's second request left after its first stream ended.
        c = r["client_secs"]
        assert 0 < c["build_p50"] <= c["build_p95"] < r["ttft_secs"]["p95"], r
        assert 0 < c["turnaround_p50"] <= c["turnaround_p95"] < r["wall_secs"], r
        # The worker's time over the level, by phase: it prefilled and decoded.
        w = r["worker_secs"]
        assert set(w) == {"idle", "admit", "prefill", "snapshot", "decode", "retire"}, r
        assert w["prefill"] > 0 and w["decode"] > 0, r
    assert [json.loads(l) for l in out.read_text().splitlines()] == lines
    # Every request's prompt was new to the server: no level is helped by the prefix cache.
    assert hits() == before
    assert {r["prompt_form"] for r in lines} == {"text"}


def test_prompts_as_ids_or_text_hold_exactly_the_prompt_length(tiny, model_dir, monkeypatch):
    vocab = json.loads((model_dir / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    for form in ("ids", "text"):
        [r] = serve_load.main(["--url", tiny.url, "--api-key", API_KEY, "--concurrency", "2", "--modes", "greedy", "--prompt-form", form, "--prompt-len", "37", "--max-tokens", "3", "--vocab", str(vocab)])
        assert r["prompt_form"] == form and r["requests"] == 2 and r["completion_tokens"] == 6, r
    # The text prompts: distinct words of the server's vocabulary, each one token, so a prompt of
    # n words is n tokens (the level above checked every request's usage.prompt_tokens).
    words = serve_load.word_pool(tiny.url, API_KEY, vocab)
    assert len(set(words)) == len(words) >= 1000
    text = serve_load.prompt_text(5, 1, 300, words)
    got = httpx.post(f"{tiny.url}/tokenize", json={"prompt": text}, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).json()
    assert got["count"] == 300
    assert serve_load.prompt_text(5, 1, 300, words) == text != serve_load.prompt_text(5, 2, 300, words)
    # A level whose prompts the server counts otherwise stops with the counts, not a table.
    one_more = lambda level, client, n, words: text_of(level, client, n, words) + words[0]
    text_of = serve_load.prompt_text
    monkeypatch.setattr(serve_load, "prompt_text", one_more)
    with pytest.raises(RuntimeError, match=r"counted prompts of \[38\] tokens, the level wants 37"):
        serve_load.main(["--url", tiny.url, "--api-key", API_KEY, "--concurrency", "1", "--modes", "greedy", "--prompt-len", "37", "--max-tokens", "2", "--vocab", str(vocab)])


def test_clients_spread_over_processes(tiny, model_dir):
    # Three clients in two processes: every request of both comes back, timed on one clock.
    vocab = json.loads((model_dir / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    lines = serve_load.main(["--url", tiny.url, "--api-key", API_KEY, "--concurrency", "3", "--rounds", "2", "--modes", "greedy", "--procs", "2", "--prompt-len", "24", "--max-tokens", "6", "--vocab", str(vocab)])
    [r] = lines
    assert r["client_procs"] == 2 and r["requests"] == 6 and r["completion_tokens"] == 36, r
    assert 0 < r["ttft_secs"]["p50"] <= r["ttft_secs"]["p95"] < r["wall_secs"], r
    # The worker's phases cover the level from the clients' start (not the second before it the
    # processes get to take their share), its idle time counted while it waits.
    assert sum(r["worker_secs"].values()) < r["wall_secs"] + 0.5, r


def test_scenarios_report_cache_hits_and_interleaving(tiny, model_dir):
    import serve_scenarios

    vocab = json.loads((model_dir / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    r = serve_scenarios.main(["turns", "--url", tiny.url, "--api-key", API_KEY, "--doc-tokens", "300", "--max-tokens", "4"])
    # The conversations left snapshots behind, and the scenario says how much they hold.
    added = r["cached_memory_added"]
    assert added["prefix_cache_entries"] >= 1 and added["prefix_cache_bytes"] > 0, added
    assert r["turn1"]["cached_tokens"] == 0 or r["turn1"]["cached_tokens"] < r["turn1"]["prompt_tokens"]
    # Turn 2 and the new conversation resume at least from the document's message.
    for k in ("turn2", "new_conversation"):
        assert r[k]["cached_tokens"] >= 0.9 * r["turn1"]["prompt_tokens"] - 20, r
    r = serve_scenarios.main(["interleave", "--url", tiny.url, "--api-key", API_KEY, "--streams", "2", "--stream-tokens", "48", "--prompt-len", "16", "--long", "300", "--settle", "0.1", "--vocab", str(vocab)])
    assert r["itl_during_secs"]["count"] > 0, r
    assert r["long_ttft_secs"] > 0
