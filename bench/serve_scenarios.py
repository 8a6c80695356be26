"""Server scenarios with the official openai client, one JSON line each:

* `turns`: a conversation over a long document (DOC_TOKENS tokens of text in the system message):
  turn 1, then turn 2 with the same history, the first answer and a new question; then a new
  conversation over the same document. Time to first token and cached tokens of each (the prefix
  cache's job: turn 2 and the new conversation should prefill only what is new), and the memory
  the three left cached (/metrics before and after).
* `interleave`: STREAMS streaming requests decode; once they all run, one prompt of LONG tokens
  arrives. Reports the streams' inter-token gaps before it arrived and while it was prefilled
  (the largest is what a running stream waits at worst), and the long prompt's time to first
  token.

    python3 bench/serve_scenarios.py turns --url URL [--doc-tokens 30000]
    python3 bench/serve_scenarios.py interleave --url URL [--streams 15 --long 32768]
"""
import argparse
import asyncio
import datetime
import json
import os
import random
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import percentile, prompt_ids  # noqa: E402


def document(tokens, seed=1):
    """About `tokens` tokens of plain words (random, so nothing repeats across runs' prefixes):
    a word and a three-digit number are four tokens (Qwen's tokenizer splits digits)."""
    rng = random.Random(seed)
    words = ["river", "stone", "lamp", "orbit", "cedar", "signal", "harbor", "prism", "meadow", "copper", "violet", "engine", "glacier", "sonnet", "tundra", "quartz"]
    return " ".join(f"{rng.choice(words)}{rng.randrange(100, 1000)}" for _ in range(tokens // 4))


async def timed_chat(client, model, messages, max_tokens, extra):
    t0 = time.perf_counter()
    first = None
    text = []
    usage = None
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=extra)
    async for ev in stream:
        if ev.choices and (ev.choices[0].delta.content or getattr(ev.choices[0].delta, "reasoning_content", None)):
            first = first or time.perf_counter()
            text.append(ev.choices[0].delta.content or "")
        if ev.usage is not None:
            usage = ev.usage
    return {"ttft_secs": round((first or time.perf_counter()) - t0, 4), "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens, "answer": "".join(text)}


def gauges(url, *names):
    """Values of /metrics gauges (None where absent)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for n in names:
        m = re.search(rf"^{n} (\S+)$", text, re.M)
        out[n] = float(m.group(1)) if m else None
    return out


async def turns(client, model, args):
    memory = ("lily_sequence_memory_used_bytes", "lily_prefix_cache_bytes", "lily_prefix_cache_entries")
    before = gauges(args.url, *memory)
    doc = document(args.doc_tokens)
    system = {"role": "system", "content": f"Answer from this document.\n\n{doc}"}
    extra = {"ignore_eos": True}
    t1_msgs = [system, {"role": "user", "content": "What is the first word?"}]
    t1 = await timed_chat(client, model, t1_msgs, args.max_tokens, extra)
    t2_msgs = t1_msgs + [{"role": "assistant", "content": t1["answer"] or "It is river1."}, {"role": "user", "content": "And the second one?"}]
    t2 = await timed_chat(client, model, t2_msgs, args.max_tokens, extra)
    other = await timed_chat(client, model, [system, {"role": "user", "content": "Which word appears most?"}], args.max_tokens, extra)
    out = {}
    for name, r in [("turn1", t1), ("turn2", t2), ("new_conversation", other)]:
        r.pop("answer")
        out[name] = r
    after = gauges(args.url, *memory)
    # What the three requests left cached on the device (the first conversation, its second
    # turn and the second conversation share the document's KV pages).
    held = {k.removeprefix("lily_"): (after[k] - before[k]) if None not in (after[k], before[k]) else None for k in memory}
    return {"scenario": "turns", "doc_tokens": args.doc_tokens, **out, "cached_memory_added": held}


async def interleave(client, model, args):
    vocab = args.vocab
    chunks = [[] for _ in range(args.streams)]
    started = asyncio.Event()
    running = [0]

    async def stream(i):
        s = await client.completions.create(model=model, prompt=prompt_ids(7, i, args.prompt_len, vocab), max_tokens=args.stream_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for ev in s:
            if ev.choices and ev.choices[0].text:
                if not chunks[i]:
                    running[0] += 1
                    if running[0] == args.streams:
                        started.set()
                chunks[i].append(time.perf_counter())

    tasks = [asyncio.create_task(stream(i)) for i in range(args.streams)]
    await started.wait()
    await asyncio.sleep(args.settle)
    # Text, not token ids: a 32K-id JSON body takes the client's event loop long enough to
    # stall the streams' reading (their gaps would be the client's, not the server's).
    text = document(args.long, seed=8)
    sent = time.perf_counter()
    long = await client.completions.create(model=model, prompt=text, max_tokens=1, temperature=0, stream=True, stream_options={"include_usage": True})
    first = None
    long_tokens = None
    async for ev in long:
        if ev.choices and ev.choices[0].text:
            first = first or time.perf_counter()
        if ev.usage is not None:
            long_tokens = ev.usage.prompt_tokens
    first = first or time.perf_counter()
    await asyncio.gather(*tasks)
    before, during = [], []
    for c in chunks:
        for a, b in zip(c, c[1:]):
            if b <= sent:
                before.append(b - a)
            elif a < first:
                during.append(b - a)
    return {
        "scenario": "interleave",
        "streams": args.streams,
        "long_prompt_tokens": long_tokens,
        "long_ttft_secs": round(first - sent, 4),
        "itl_before_secs": {"p50": round(percentile(before, 0.5) or 0, 5), "max": round(max(before, default=0), 5)},
        "itl_during_secs": {"p50": round(percentile(during, 0.5) or 0, 5), "p95": round(percentile(during, 0.95) or 0, 5), "max": round(max(during, default=0), 5), "count": len(during)},
    }


async def main_async(args):
    import openai

    client = openai.AsyncOpenAI(base_url=args.url + "/v1", api_key=args.api_key, max_retries=0, timeout=1200)
    model = (await client.models.list()).data[0].id
    r = await {"turns": turns, "interleave": interleave}[args.scenario](client, model, args)
    rec = {"engine": "lily-serve", "client": f"openai {openai.__version__}", "date": datetime.date.today().isoformat(), **({"tag": args.tag} if args.tag else {}), **r}
    print(json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=["turns", "interleave"])
    ap.add_argument("--url", required=True)
    ap.add_argument("--api-key", default=os.environ.get("LILY_API_KEY", "unused"))
    ap.add_argument("--doc-tokens", type=int, default=30000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--streams", type=int, default=15)
    ap.add_argument("--stream-tokens", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=700)
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--settle", type=float, default=0.5, help="seconds the streams run alone before the long prompt")
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--tag", help="recorded with the result (e.g. the server's settings)")
    ap.add_argument("--out")
    return asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
