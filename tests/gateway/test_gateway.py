"""Three replicas of the tiny model on the CPU behind the SGLang Model Gateway (PyPI
`sglang-router`), started by deploy/replicas.sh, driven by the openai client: 30 three-turn
conversations, each later turn landing where the conversation's cache is (cached tokens show it);
one replica killed mid-run loses no request that had not started streaming (the gateway sends it
elsewhere), and the survivors keep serving.

Environment: LILY_BIN (default target/debug/lily)."""

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("LILY_BIN", ROOT / "target" / "debug" / "lily"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_run(n, avoid=()):
    """A port p with p .. p + n - 1 all free now (each bound once to check) and none in `avoid`."""
    for _ in range(200):
        p = free_port()
        if p + n > 65536 or any(q in avoid for q in range(p, p + n)):
            continue
        socks = []
        try:
            for q in range(p, p + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports")


def start_cluster(logs):
    """deploy/replicas.sh on fresh ports: (process, gateway port, first replica port, its output
    lines, whether it started)."""
    port = free_port()
    base = free_run(3, avoid=(port,))
    env = dict(os.environ, LOG_DIR=str(logs))
    proc = subprocess.Popen(["bash", str(ROOT / "deploy" / "replicas.sh"), "--cpu", "3", "--lily", str(BIN), "--port", str(port), "--base-port", str(base), "--", "--max-seq", "2048"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    out = []
    ready = threading.Event()

    def pump():
        for line in proc.stdout:
            out.append(line)
            if line.startswith("gateway:"):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    started = ready.wait(180) and proc.poll() is None
    return proc, port, base, out, started


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pytest.importorskip("sglang_router")
    if not BIN.exists():
        pytest.fail(f"{BIN} not found: run `cargo build --bin lily` first (or set LILY_BIN)")
    # The ports are free when chosen, but another process on the machine (the Rust tests running
    # beside these) may take one before a replica binds it: then new ports, a few times.
    for attempt in range(3):
        logs = tmp_path_factory.mktemp("replica-logs")
        proc, port, base, out, started = start_cluster(logs)
        if started:
            break
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        taken = any("Address already in use" in f.read_text(errors="replace") for f in logs.glob("*.log"))
        if not taken or attempt == 2:
            pytest.fail("the cluster did not start:\n" + "".join(out))
    yield {"url": f"http://127.0.0.1:{port}/v1", "base": base, "logs": logs}
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def turn(client, messages):
    """One streamed turn: (outcome, cached tokens), outcome one of ok / lost (failed before the
    response began) / cut (failed after the stream's response began: its replica died)."""
    started = False
    try:
        stream = client.chat.completions.create(model="lily", messages=messages, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True})
        started = True
        cached = None
        for ev in stream:
            if ev.usage is not None:
                cached = ev.usage.prompt_tokens_details.cached_tokens
        return ("ok", cached)
    except Exception as e:
        if not started:
            print(f"lost: {type(e).__name__}: {e}")
        return ("cut" if started else "lost", None)


def test_conversations_stick_to_their_replica_and_survive_a_lost_one(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster["url"], api_key="unused", max_retries=0, timeout=120)
    killed_at = {}
    done = [0]
    lock = threading.Lock()

    def conversation(k):
        words = " ".join(f"topic{k}-{i}" for i in range(60))
        messages = [{"role": "system", "content": f"You are assistant number {k}. Context: {words}."}]
        results = []
        for t in range(3):
            messages.append({"role": "user", "content": f"Turn {t} of conversation {k}: go on."})
            t0 = time.monotonic()
            results.append((t, t0, *turn(client, messages)))
            messages.append({"role": "assistant", "content": f"Answer {t}."})
            with lock:
                done[0] += 1
                if done[0] == 30 and not killed_at:
                    # A third of the way: one replica dies without warning.
                    subprocess.run(["pkill", "-KILL", "-f", f"lily serve --bind 127.0.0.1:{cluster['base'] + 2}"])
                    killed_at["t"] = time.monotonic()
        return results

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        runs = list(pool.map(conversation, range(30)))
    assert killed_at, "the replica was killed"
    outcomes = [r[2] for run in runs for r in run]
    assert outcomes.count("lost") == 0, f"requests lost before streaming began: {outcomes}"
    assert outcomes.count("ok") >= 85, outcomes
    # Later turns that ran before the kill found their conversation's cache on their replica.
    before = [r for run in runs for r in run if r[0] > 0 and r[2] == "ok" and r[1] < killed_at["t"]]
    assert before, "some later turns ran before the kill"
    hits = sum(1 for r in before if r[3])
    assert hits >= 0.9 * len(before), f"{hits} of {len(before)} later turns had cached tokens"
    # The survivors keep serving.
    assert turn(client, [{"role": "user", "content": "still there?"}])[0] == "ok"
