"""Load test through the server with the official openai client: C concurrent streaming requests
per level, each with its own prompt (no prefix-cache hits), `max_tokens` out with
`ignore_eos` (every request generates exactly that many), greedy and sampled (temperature 0.7,
top-p 0.8, top-k 20: what chat clients send), or sampled with `response_format` json_object
(`--modes json`: structured output, every token drawn under the grammar's mask).

A prompt is text, as applications send it (`--prompt-form text`, the default): `--prompt-len`
words drawn from the server's own vocabulary, each a word with its leading space that the
tokenizer keeps as one token, so the server tokenizes exactly `--prompt-len` tokens (every
request's `usage.prompt_tokens` is checked). `--prompt-form ids` sends the token ids themselves
(the tables before 2026-12-05's session 70): the openai client then spends ~5 ms of Python per
request building a 700-id prompt (~0.3 ms for the same prompt as text, measured on a 2-core
machine), client time that a closed-loop level at few clients waits on. With
`--rounds R` each client sends R requests back to back, so the level measures a steady load (new
prompts prefilled while others decode) rather than one burst.

The clients of a level are spread over `--procs` processes (default: one per 8 clients, at most
half the machine's cores), each with its own event loop and client: one Python process parses
every streamed chunk of every client in turn, and at 64 streams that parsing, not the server, set
the pace (against a stand-in server emitting a token per stream every 14.4 ms, one process
delivered 70% of the tokens per second the server sent). `--procs 1` is the single-process
client. Every process starts its clients at the same instant.

Per level it prints one JSON line: aggregate completion tok/s over the level's wall time (first
request sent to last stream ended), time to first token p50 / p95 (request sent to first text
chunk), inter-token latency p50 / p95 (gaps between consecutive text chunks of a stream; a
chunk carries one token unless text is held back, e.g. an incomplete UTF-8 character), the
clients' own time (`client_secs`: building a request until the HTTP client puts it on the wire,
and between a stream's end and the same client's next request on the wire), and where
a Lily server's model worker spent the level (`worker_secs`: idle, admit, prefill, snapshot, decode, retire,
from `lily_worker_microseconds_total` just before the clients start and after the last stream
ended; absent for other servers).

    python3 bench/serve_load.py --lily target/release/lily --model DIR        # starts `lily serve`
    python3 bench/serve_load.py --url http://127.0.0.1:8000                   # a running server
"""
import argparse
import asyncio
import concurrent.futures
import datetime
import multiprocessing
import json
import os
import re
import subprocess
import sys
import threading
import time

SAMPLED = {"temperature": 0.7, "top_p": 0.8, "extra_body": {"top_k": 20, "ignore_eos": True}}
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
# Structured output as applications send it: sampled, the answer held to JSON by the server.
JSON = {"temperature": 0.7, "top_p": 0.8, "extra_body": {"top_k": 20, "ignore_eos": True, "response_format": {"type": "json_object"}}}


def percentile(xs, q):
    """The q-quantile (0..1) by linear interpolation; None for no samples."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def lcg_draws(level, client, n, bound):
    """n deterministic draws below `bound`, distinct per (level, client): a 64-bit LCG."""
    x = (level * 1_000_003 + client * 7919 + 1) & ((1 << 64) - 1)
    out = []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) & ((1 << 64) - 1)
        out.append((x >> 33) % bound)
    return out


def prompt_ids(level, client, n, vocab):
    """A distinct deterministic prompt of token ids per (level, client), avoiding the lowest 1000
    ids (special and byte tokens)."""
    return [1000 + d for d in lcg_draws(level, client, n, vocab - 1000)]


def prompt_text(level, client, n, words):
    """A distinct deterministic prompt of n words of `words` (each one token) per (level, client)."""
    return "".join(words[d] for d in lcg_draws(level, client, n, len(words)))


# A word the tokenizer keeps as one token wherever it stands among others: a space, then lowercase
# ASCII letters (a pre-token of its own: the next word's space ends it).
ONE_TOKEN_WORD = re.compile(r" [a-z]{3,12}")


def server_post(url, api_key, path, body):
    import urllib.request

    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def word_pool(url, api_key, vocab, size=4096):
    """Up to `size` words of the server's vocabulary that tokenize as one token each, found through
    its /detokenize and checked through its /tokenize (the prompts' token count depends on it)."""
    [sep] = server_post(url, api_key, "/tokenize", {"prompt": "\x00"})["tokens"]

    def spelled(ids):
        # The ids' texts, one request for a range: each id followed by the separator byte. A range
        # whose text splits into the wrong number of pieces (a token holding that byte) is halved.
        text = server_post(url, api_key, "/detokenize", {"tokens": [t for i in ids for t in (i, sep)]})["prompt"]
        pieces = text.split("\x00")
        if len(pieces) == len(ids) + 1:
            return list(zip(ids, pieces))
        if len(ids) == 1:
            return []
        return spelled(ids[: len(ids) // 2]) + spelled(ids[len(ids) // 2 :])

    words = []
    for lo in range(1000, vocab, 8192):
        words += [(i, w) for i, w in spelled(list(range(lo, min(vocab, lo + 8192)))) if ONE_TOKEN_WORD.fullmatch(w)]
        if len(words) >= size:
            break
    words = words[:size]
    got = server_post(url, api_key, "/tokenize", {"prompt": "".join(w for _, w in words)})["tokens"]
    if len(words) < 64 or got != [i for i, _ in words]:
        raise RuntimeError(f"the server's vocabulary gave {len(words)} one-token words that do not tokenize back one token each; use --prompt-form ids")
    return [w for _, w in words]


# Each request carries an id in this header; the HTTP client's request hook notes when it goes on
# the wire (after the openai client built it).
WIRE_ID = "x-serve-load-request"


async def one_stream(client, model, prompt, max_tokens, params, on_wire, rid):
    sent = time.monotonic()
    chunks = []
    usage = None
    extra = {**params, "extra_headers": {WIRE_ID: rid}}
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}, **extra)
    async for ev in stream:
        if ev.choices and ev.choices[0].text:
            chunks.append(time.monotonic())
        if ev.usage is not None:
            usage = ev.usage
    return {"sent": sent, "wire": on_wire.pop(rid, None), "chunks": chunks, "ended": time.monotonic(), "completion_tokens": usage.completion_tokens if usage else 0, "prompt_tokens": usage.prompt_tokens if usage else None}


def make_prompt(words, level, client, n, vocab):
    """The request's prompt: text of n one-token words (`words`), or n token ids where None."""
    return prompt_text(level, client, n, words) if words is not None else prompt_ids(level, client, n, vocab)


async def run_clients(url, api_key, model, level, clients, prompt_len, max_tokens, params, vocab, words, rounds, start_at):
    """Clients `clients` of a level in this process, each sending `rounds` requests back to back (a
    closed loop: a client's next request leaves when its last one ended, so after the first round
    requests arrive while others decode, as they do in service), from `start_at` (time.monotonic)."""
    import openai

    on_wire = {}

    async def note_wire(request):
        rid = request.headers.get(WIRE_ID)
        if rid is not None:
            on_wire[rid] = time.monotonic()

    # The openai client's own HTTP client (its connection limits), with the hook.
    http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [note_wire]})
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=600, http_client=http)

    async def client_loop(c):
        out = []
        for r in range(rounds):
            prompt = make_prompt(words, level, c + r * 100_003, prompt_len, vocab)
            out.append(await one_stream(client, model, prompt, max_tokens, params, on_wire, f"{c}.{r}"))
            if r > 0 and out[-1]["wire"] is not None:
                # The client's turnaround: its last stream's end to its next request on the wire.
                out[-1]["turnaround"] = out[-1]["wire"] - out[-2]["ended"]
        return out

    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    results = [x for xs in await asyncio.gather(*(client_loop(c) for c in clients)) for x in xs]
    await client.close()
    return results


def clients_in_process(*args):
    return asyncio.run(run_clients(*args))


def default_procs(concurrency):
    return max(1, min((concurrency + 7) // 8, (os.cpu_count() or 2) // 2))


async def run_level(pool, url, api_key, model, level, concurrency, prompt_len, max_tokens, params, vocab, words, rounds=1, procs=1):
    """One level: `concurrency` clients over `procs` processes of `pool` (the single-process client
    runs in this one's loop)."""
    procs = max(1, min(procs, concurrency))
    # A second for the processes to take their share before the common start.
    start_at = time.monotonic() + (1.0 if procs > 1 else 0.0)
    shares = [list(range(concurrency))[p::procs] for p in range(procs)]
    args = [(url, api_key, model, level, share, prompt_len, max_tokens, params, vocab, words, rounds, start_at) for share in shares]

    async def worker_at_start():
        # The worker's phases from just before the clients start, so that its idle time is the
        # level's own, not the wait for the client processes.
        await asyncio.sleep(max(0.0, start_at - 0.01 - time.monotonic()))
        return await asyncio.to_thread(worker_micros, url, api_key)

    before = asyncio.create_task(worker_at_start())
    if procs == 1:
        results = await run_clients(*args[0])
    else:
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(*(loop.run_in_executor(pool, clients_in_process, *a) for a in args))
        results = [x for part in parts for x in part]
    before = await before
    after = worker_micros(url, api_key)
    start = min(r["sent"] for r in results)
    end = max(r["ended"] for r in results)
    tokens = sum(r["completion_tokens"] for r in results)
    wrong = sorted({r["prompt_tokens"] for r in results} - {prompt_len})
    if wrong:
        raise RuntimeError(f"the server counted prompts of {wrong} tokens, the level wants {prompt_len}")
    ttft = [r["chunks"][0] - r["sent"] for r in results if r["chunks"]]
    itl = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    build = [r["wire"] - r["sent"] for r in results if r["wire"] is not None]
    turnaround = [r["turnaround"] for r in results if "turnaround" in r]
    wall = end - start
    return {
        "requests": len(results),
        "completion_tokens": tokens,
        "client_procs": procs,
        "wall_secs": round(wall, 4),
        "decode": {"aggregate_tok_s": round(tokens / wall, 2) if wall > 0 else None},
        "per_stream_tok_s_p50": round(percentile([r["completion_tokens"] / (r["ended"] - r["chunks"][0]) for r in results if len(r["chunks"]) > 1], 0.5) or 0, 2),
        "ttft_secs": {"p50": round(percentile(ttft, 0.5), 4), "p95": round(percentile(ttft, 0.95), 4)},
        "itl_secs": {"p50": round(percentile(itl, 0.5) or 0, 5), "p95": round(percentile(itl, 0.95) or 0, 5)},
        # The client's own time: building a request until it goes on the wire (part of TTFT), and
        # with rounds > 1 a client's last stream's end to its next request on the wire.
        "client_secs": {
            "build_p50": round(percentile(build, 0.5) or 0, 5),
            "build_p95": round(percentile(build, 0.95) or 0, 5),
            **({"turnaround_p50": round(percentile(turnaround, 0.5), 5), "turnaround_p95": round(percentile(turnaround, 0.95), 5)} if turnaround else {}),
        },
        **({"worker_secs": {k: round((after[k] - before.get(k, 0)) / 1e6, 3) for k in after}} if before and after else {}),
    }


def worker_micros(url, api_key):
    """The server's `lily_worker_microseconds_total` by phase, or None where it has none."""
    import urllib.request

    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    found = dict(re.findall(r'^lily_worker_microseconds_total\{phase="(\w+)"\} (\d+)', text, re.M))
    return {k: int(v) for k, v in found.items()} or None


def start_server(lily, model, extra):
    proc = subprocess.Popen([lily, "serve", "--bind", "127.0.0.1:0", *(["--model", model] if model else []), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found = {}
    ready = threading.Event()

    def pump():
        for line in proc.stdout:
            sys.stderr.write(line)
            m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            if m and "url" not in found:
                found["url"] = m.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(600) or "url" not in found:
        proc.kill()
        sys.exit("lily serve did not start")
    return proc, found["url"]


async def main_async(args, url):
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=args.api_key, max_retries=0, timeout=600)
    models = await client.models.list()
    model = models.data[0].id
    await client.close()
    vocab = args.vocab
    words = word_pool(url, args.api_key, vocab) if args.prompt_form == "text" else None
    levels = [int(x) for x in args.concurrency.split(",")]
    procs = lambda c: args.procs or default_procs(c)
    lines = []
    with concurrent.futures.ProcessPoolExecutor(max(procs(c) for c in levels), mp_context=multiprocessing.get_context("spawn")) as pool:
        for m, mode in enumerate(args.modes.split(",")):
            params = {"greedy": GREEDY, "sampled": SAMPLED, "json": JSON}[mode]
            # Warm-up: graphs for the batch shapes of this mode, allocator pools, the client processes.
            for j, c in enumerate(sorted({1, max(levels)})):
                await run_level(pool, url, args.api_key, model, 100 * m + 90 + j, c, args.prompt_len, 8, params, vocab, words, 1, procs(c))
            for i, c in enumerate(levels):
                # Prompts differ across levels and modes: no request finds another's in the prefix cache.
                r = await run_level(pool, url, args.api_key, model, 100 * m + i, c, args.prompt_len, args.max_tokens, params, vocab, words, args.rounds, procs(c))
                rec = {"engine": "lily-serve", "client": f"openai {openai.__version__}", "date": datetime.date.today().isoformat(), "mode": mode, "batch": c, "concurrency": c, "rounds": args.rounds, "prompt_form": args.prompt_form, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, **r}
                print(json.dumps(rec), flush=True)
                lines.append(rec)
    if args.out:
        with open(args.out, "a") as f:
            for rec in lines:
                f.write(json.dumps(rec) + "\n")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (else --lily starts one)")
    ap.add_argument("--lily", default="target/release/lily")
    ap.add_argument("--model", help="checkpoint directory for the started server (default: the embedded tiny model)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `lily serve` argument (repeatable)")
    ap.add_argument("--api-key", default=os.environ.get("LILY_API_KEY", "unused"))
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--modes", default="greedy,sampled")
    ap.add_argument("--rounds", type=int, default=1, help="requests each client sends back to back (1: one burst of `concurrency` requests)")
    ap.add_argument("--procs", type=int, default=0, help="client processes per level (0: one per 8 clients, at most half the cores)")
    ap.add_argument("--prompt-len", type=int, default=700)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-form", choices=["text", "ids"], default="text", help="prompts as text of one-token words (what applications send) or as token ids")
    ap.add_argument("--vocab", type=int, default=248320, help="prompt ids (and the words of text prompts) are drawn below this")
    ap.add_argument("--out", help="append the JSON lines here too")
    args = ap.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.lily, args.model, args.serve_arg)
    try:
        return asyncio.run(main_async(args, url))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
