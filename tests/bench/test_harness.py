"""CPU-only checks of the peer-benchmark harness (bench/): the contract's prompt and digest, the
fail-closed summary, the table generation on canned JSON lines, the rooflines, and (when torch and
gguf are importable) the GGUF quantizers and V-head reorder. No engine is needed.

    python3 -m pytest tests/bench -q
"""
import copy
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import common  # noqa: E402
import roofline  # noqa: E402
import run_all  # noqa: E402

TINY_TC = {"vocab_size": 248320, "hidden_size": 128, "num_hidden_layers": 4,
           "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
           "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}
BIG_TC = dict(TINY_TC, hidden_size=2048, num_hidden_layers=40, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
              num_attention_heads=16, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
              linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
              shared_expert_intermediate_size=512)


def test_prompt_matches_lily_bench():
    p = common.prompt_tokens(4, 248320)
    assert p[0] == 0 and p[1] == 2654435761 % 248320
    assert p[3] == (3 * 2654435761 % 2**32) % 248320


def test_fnv1a_over_whole_u32_values():
    assert common.fnv1a64([]) == "cbf29ce484222325"
    assert common.fnv1a64([1]) == f"{((0xCBF29CE484222325 ^ 1) * 0x100000001B3) % 2**64:016x}"
    # whole u32 values, not bytes: 256 differs from the byte string [0, 1]
    assert common.fnv1a64([256]) != common.fnv1a64([0, 1])
    assert len(common.fnv1a64([248319] * 64)) == 16


def test_make_record_validates():
    rec = common.make_record("x", "cpu", "/m", 8, 2, True, 0.5, 7, [0.1, 0.2], [3, 4])
    assert rec["decode"]["tok_s"] == pytest.approx(2 / 0.3)
    assert rec["prefill"]["tok_s"] == pytest.approx(16.0)
    assert rec["decode"]["token_digest"] == common.fnv1a64([3, 4])
    with pytest.raises(ValueError):
        common.make_record("x", "cpu", "/m", 8, 2, True, 0.5, 7, [0.1], [3])
    with pytest.raises(ValueError):
        common.make_record("x", "cpu", "/m", 8, 2, True, 0.0, 7, [0.1, 0.2], [3, 4])


def canned(engine, ctx, rnd, dec, pre, digest, variant=None):
    r = {"engine": engine, "prompt_len": ctx, "round": rnd, "backend": "test",
         "prefill": {"tok_s": pre}, "decode": {"tok_s": dec, "token_digest": digest}}
    if variant:
        r["variant"] = variant
    return r


RECORDS = [
    canned("lily", 256, 0, 200.0, 5000.0, "aaaa"), canned("lily", 256, 1, 202.0, 5100.0, "aaaa"),
    canned("mlx-lm", 256, 0, 100.0, 2500.0, "bbbb"), canned("mlx-lm", 256, 1, 100.0, 2500.0, "bbbb"),
    canned("transformers", 256, 0, 10.0, 8000.0, "cccc"), canned("transformers", 256, 1, 10.0, 8000.0, "dddd"),
    canned("llama.cpp", 256, 0, 250.0, 9000.0, None, "Q4_0"), canned("llama.cpp", 256, 1, 260.0, 9200.0, None, "Q4_0"),
    canned("lily", 1024, 0, 190.0, 6000.0, "eeee"),
]


def test_summary_is_fail_closed():
    cells = run_all.summarize(RECORDS, 2)
    assert cells[("lily", 256)]["status"] == "ok"
    assert cells[("lily", 256)]["decode_median"] == pytest.approx(201.0)
    assert cells[("mlx-lm", 256)]["status"] == "ok"
    assert cells[("transformers", 256)]["status"].startswith("refused: digests differ")
    assert cells[("llama.cpp Q4_0", 256)]["status"] == "ok (digest n/a)"
    assert cells[("lily", 1024)]["status"].startswith("refused: 1 of 2")


def test_render_table():
    cells = run_all.summarize(RECORDS, 2)
    labels = ["lily", "mlx-lm", "transformers", "llama.cpp Q4_0", "llama.cpp Q4_K_M"]
    meta = {"title": "test", "note": "canned", "date": "2026-01-01", "host": "h", "machine": "m", "out_rel": "bench/results/x",
            "model": "/m", "rounds": 2, "decode_steps": 64, "versions": {"python": "3"}, "backends": {}}
    acc = [{"reference_source": "transformers", "candidate_source": "lily", "positions": 192, "top1_agreement": 1.0,
            "relative_logit_error": 1e-5, "max_abs_logit_error": 1e-4, "mean_abs_top1_logprob_error": 1e-6}]
    md = run_all.render(cells, [256, 1024], labels, {"llama.cpp Q4_K_M": "GGUF not found"}, acc, meta, BIG_TC)
    dec = [l for l in md.splitlines() if l.startswith("| 256 |")][0]
    cols = [c.strip() for c in dec.strip("|").split("|")]
    # Context, 5 engines, 4 ratios, roofline
    assert cols[:6] == ["256", "201.0", "100.0", "refused", "255.0", "missing"]
    assert cols[6] == "2.010x" and cols[7] == "—" and cols[8] == f"{201 / 255:.3f}x" and cols[9] == "—"
    assert cols[10].endswith(f"of {roofline.decode_roofline(BIG_TC, 256):,.0f}")
    row1024 = [l for l in md.splitlines() if l.startswith("| 1,024 |")][0]
    assert "refused" in row1024 and "190" not in row1024.split("|")[2]
    assert "GGUF not found" in md and "| transformers | lily | 192 | 1.0000 |" in md
    assert "> **canned**" in md


def test_batched_decode_roofline_reads_each_expert_once():
    # Batch 1 is the single-stream decode; at 16 a layer touches ~102 of 256 experts, so the
    # aggregate bound grows several-fold but each sequence's state and KV still count in full.
    assert roofline.batch_decode_bytes_per_step(BIG_TC, 828, 1) == roofline.decode_bytes_per_token(BIG_TC, 828)
    assert roofline.experts_touched(BIG_TC, 16) == pytest.approx(102.0, abs=0.5)
    assert roofline.experts_touched(BIG_TC, 64) == pytest.approx(222.4, abs=0.5)
    r1, r16, r64 = (roofline.batch_decode_roofline(BIG_TC, 828, b) for b in (1, 16, 64))
    assert 2 * r1 < r16 < 16 * r1 and r16 < r64


def test_rooflines_match_reference_for_35b():
    assert roofline.decode_bytes_per_token(BIG_TC, 4096) / 1e9 == pytest.approx(1.882, abs=1e-3)
    assert roofline.decode_roofline(BIG_TC, 4096) == pytest.approx(2285, abs=1)
    assert 140_000 < roofline.prefill_roofline(BIG_TC, 512) < 160_000


def _have(*mods):
    return all(importlib.util.find_spec(m) is not None for m in mods)


@pytest.mark.skipif(not _have("torch", "gguf"), reason="needs torch and gguf")
def test_quantizers_match_gguf_reference():
    import numpy as np
    import torch
    import gguf.quants as gq
    from gguf import GGMLQuantizationType as T
    import write_gguf
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 256, generator=g) * 0.05
    x[0, :32] = 0.0           # all-zero block
    x[1, 5] = 3.0             # outlier
    for fn, qt in ((write_gguf.quantize_q8_0, T.Q8_0), (write_gguf.quantize_q4_0, T.Q4_0)):
        ours = fn(x)
        ref = gq.quantize(x.numpy().astype(np.float32), qt)
        assert ours.shape == ref.shape and ours.dtype == np.uint8
        assert np.array_equal(ours, ref), qt


@pytest.mark.skipif(not _have("torch"), reason="needs torch")
def test_v_head_reorder_grouped_to_tiled():
    import torch
    import write_gguf
    # 2 K heads, 2 V heads per K head, head_dim 1: grouped [k0v0, k0v1, k1v0, k1v1] -> tiled [k0v0, k1v0, k0v1, k1v1]
    t = torch.arange(4).reshape(4, 1)
    assert write_gguf.reorder_v_heads(t, 0, 2, 2, 1).reshape(-1).tolist() == [0, 2, 1, 3]
    t = torch.arange(8).reshape(1, 8)  # columns, head_dim 2
    assert write_gguf.reorder_v_heads(t, 1, 2, 2, 2).reshape(-1).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
