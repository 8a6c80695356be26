"""Time to first token of one request at a time against a running `lily serve`: streamed
completions of distinct token-id prompts (so the prefix cache never hits), each sent after the
previous one's answer, so the server is idle for each (the path where a prompt goes in with its
first token). One JSON line per prompt length: the TTFT of every request and their median.

    python3 scripts/serve_ttft.py URL --lens 4096,32768 --repeats 5 [--vocab 248320] [--label X]
"""
import argparse
import json
import statistics
import time
import urllib.request


def ttft(url, prompt, max_tokens):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - sent
    return first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--lens", default="4096")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    for n in (int(x) for x in a.lens.split(",")):
        secs = []
        # One warm-up request of the same length, then the timed ones, each prompt distinct.
        for r in range(a.repeats + 1):
            prompt = [((i + 7919 * (r + 1) + 104729 * n) * 2654435761 % 2**32) % a.vocab for i in range(n)]
            t = ttft(a.url, prompt, a.max_tokens)
            if r > 0:
                secs.append(t)
        print(json.dumps({"label": a.label, "prompt_len": n, "ttft_secs": secs, "ttft_median_secs": statistics.median(secs),
                          "prefill_tok_s_median": n / statistics.median(secs)}), flush=True)


if __name__ == "__main__":
    main()
