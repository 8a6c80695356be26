#!/usr/bin/env python3
"""Accuracy of one engine's teacher-forced logits against a reference (both in the JSON format
written by `lily logits` and scripts/transformers_goldens.py).

    python scripts/compare_logits.py REFERENCE.json CANDIDATE.json [--json]

Compares, per position, the logits at the reference's top-20 ids and at the probe ids:
top-1 agreement, max and mean |Δlogit|, relative logit error ‖Δ‖₂/‖ref‖₂, and the mean |Δ log p|
of the reference's top-1 token (using each side's own logsumexp).
"""
import json
import math
import sys


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    ref, cand = (json.load(open(p)) for p in args[:2])
    if ref["prompt_ids"] != cand["prompt_ids"][: len(ref["prompt_ids"])]:
        raise SystemExit("the two files were computed on different prompts")
    n = min(len(ref["positions"]), len(cand["positions"]))
    agree, max_err, sum_err, count, num, den, dlogp = 0, 0.0, 0.0, 0, 0.0, 0.0, 0.0
    for t in range(n):
        r, c = ref["positions"][t], cand["positions"][t]
        cand_at = dict(zip(c["top_ids"], c["top_logits"]))
        cand_at.update(zip(cand["probe_ids"], c["probe_logits"]))
        if c["top_ids"][0] == r["top_ids"][0]:
            agree += 1
        pairs = list(zip(ref["probe_ids"], r["probe_logits"]))
        pairs += [(i, v) for i, v in zip(r["top_ids"], r["top_logits"]) if i in cand_at]
        for i, v in pairs:
            if i not in cand_at:
                continue
            e = abs(cand_at[i] - v)
            max_err, sum_err, count = max(max_err, e), sum_err + e, count + 1
            num += e * e
            den += v * v
        top = r["top_ids"][0]
        if top in cand_at:
            dlogp += abs((cand_at[top] - c["logsumexp"]) - (r["top_logits"][0] - r["logsumexp"]))
    out = {
        "positions": n,
        "top1_agreement": agree / n,
        "max_abs_logit_error": max_err,
        "mean_abs_logit_error": sum_err / max(count, 1),
        "relative_logit_error": math.sqrt(num / max(den, 1e-30)),
        "mean_abs_top1_logprob_error": dlogp / n,
        "reference": ref.get("source"),
        "candidate": cand.get("source"),
    }
    if "--json" in sys.argv:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:30} {v}")


if __name__ == "__main__":
    main()
