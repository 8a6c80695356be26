"""Fixtures: start `lily serve` (the real binary) on loopback ports and hand out openai clients.

Two servers share one tiny synthetic checkpoint (written once with `lily synth`):
  * `tiny`: the random-weight tiny model on the CPU backend (generation paths);
  * `scripted`: the same binary with the hidden, test-only `--test-script` option, so the
    "model" output is known text (tool calls, reasoning, stop strings).

Environment: LILY_BIN (default target/debug/lily; build it first with `cargo build --bin lily`).
"""

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("LILY_BIN", ROOT / "target" / "debug" / "lily"))
API_KEY = "sk-lily-test"

SCRIPT = [
    {"match": "weather", "reply": "The user wants weather.</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"},
    {"match": "stop test", "reply": "Counting: one, two, STOP three, four"},
    {"match": "unicode", "reply": "Héllo wörld 你好 🎉 done"},
    {"match": "what is 2+2", "reply": "Two plus two is four.</think>\n\nThe answer is 4."},
    {"reply": "Hello there! I am a scripted reply."},
]


class Server:
    def __init__(self, args, name):
        self.name = name
        self.log = []
        self.proc = subprocess.Popen(
            [str(BIN), "serve", "--bind", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.url = None
        ready = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.log.append(line)
                m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
                if m and self.url is None:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(120) or self.url is None:
            self.stop()
            raise RuntimeError(f"{name} server did not start:\n" + "".join(self.log))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    if not BIN.exists():
        pytest.fail(f"{BIN} not found: run `cargo build --bin lily` first (or set LILY_BIN)")
    # tmp_path_factory, not mkdtemp: pytest keeps only its last few runs' directories.
    d = tmp_path_factory.mktemp("lily-openai") / "tiny"
    subprocess.run([str(BIN), "synth", "--preset", "tiny", "--out", str(d), "--seed", "0"], check=True, capture_output=True)
    return d


@pytest.fixture(scope="session")
def tiny(model_dir):
    s = Server(["--model", str(model_dir), "--backend", "cpu", "--max-seq", "1024", "--api-key", API_KEY], "tiny")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def scripted(model_dir, tmp_path_factory):
    p = tmp_path_factory.mktemp("script") / "script.json"
    p.write_text(json.dumps(SCRIPT))
    s = Server(["--model", str(model_dir), "--max-seq", "1024", "--test-script", str(p)], "scripted")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(tiny):
    import openai

    return openai.OpenAI(base_url=tiny.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def sclient(scripted):
    import openai

    return openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
