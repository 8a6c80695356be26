"""The server driven by the official `openai` Python package."""

import json

import openai
import pytest

MODEL = "Qwen3.6-35B-A3B"
NOTHINK = {"chat_template_kwargs": {"enable_thinking": False}}


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0)
    assert r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_matches_non_streaming(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "stream me"}], max_completion_tokens=8, temperature=0, extra_body=NOTHINK)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert text == (full.choices[0].message.content or "")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_seed_reproducible(client):
    kw = dict(model=MODEL, prompt="The sea", max_tokens=10, temperature=1.0, top_p=0.9, seed=123)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    assert a.object == "text_completion"


def test_completions_streaming_and_logprobs(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, stream=True, logprobs=2))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert lps and all(len(lp.top_logprobs[0]) == 2 for lp in lps)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) >= 1
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)


def test_prefix_cache_reports_cached_tokens(client):
    kw = dict(model=MODEL, messages=[{"role": "system", "content": "Cache me " * 20}, {"role": "user", "content": "same"}], max_tokens=4, temperature=0)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    # The prompt went in with its first token (the server was idle), so its repeat resumes at the
    # last message start: only the assistant's header is prefilled again.
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert 0 < b.usage.prompt_tokens - cached <= 8, (cached, b.usage.prompt_tokens)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_n_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3, max_tokens=4, temperature=1.0, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens >= 3
    c = client.completions.create(model=MODEL, prompt=["one", "two"], n=2, max_tokens=3, seed=3)
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]


def test_errors(client, tiny):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=17)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-3)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    assert e.value.code == "context_length_exceeded"
    bad = openai.OpenAI(base_url=tiny.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- scripted output ----

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def test_tool_calls_non_streaming(sclient):
    r = sclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    tc = c.message.tool_calls[0]
    assert tc.type == "function" and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris", "days": 3}
    assert c.message.content == "Let me check.\n\n"
    assert c.message.model_extra.get("reasoning_content") == "The user wants weather."


def test_tool_calls_streaming(sclient):
    stream = sclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS, stream=True)
    calls = {}
    content = ""
    finish = None
    for ch in stream:
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            entry = calls.setdefault(t.index, {"name": None, "args": ""})
            if t.function.name:
                entry["name"] = t.function.name
            entry["args"] += t.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert "<tool_call>" not in content
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["args"]) == {"city": "Paris", "days": 3}
    assert finish == "tool_calls"


def test_tool_round_trip(sclient):
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"},
    ]
    r = sclient.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
    assert r.choices[0].finish_reason in ("stop", "tool_calls")


def test_reasoning(sclient):
    r = sclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "what is 2+2?"}])
    m = r.choices[0].message
    assert m.content == "The answer is 4."
    assert m.model_extra["reasoning_content"] == "Two plus two is four."
    assert m.model_extra["reasoning"] == "Two plus two is four."
    stream = sclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "what is 2+2?"}], stream=True)
    reasoning = content = ""
    for ch in stream:
        d = ch.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
    assert (reasoning, content) == ("Two plus two is four.", "The answer is 4.")


@pytest.mark.parametrize("stop", ["STOP", ["nope", ", ST"], "two, S"])
def test_stop_strings(sclient, stop):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "stop test"}], stop=stop, extra_body=NOTHINK)
    r = sclient.chat.completions.create(**kw)
    text = r.choices[0].message.content
    assert text.startswith("Counting: one") and "ST" not in text and "three" not in text
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in sclient.chat.completions.create(stream=True, **kw))
    assert streamed == text


def test_unicode_stream(sclient):
    pieces = [ch.choices[0].delta.content or "" for ch in sclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "unicode"}], stream=True, extra_body=NOTHINK)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "Héllo wörld 你好 🎉 done"
