"""Structured output through real clients on the tiny random-weight model: only the constraint
can make its output well formed, so a parsed result proves it. The official SDK's
`chat.completions.parse` with a Pydantic model, and LangChain's `ChatOpenAI` with
`with_structured_output` (JSON schema and function calling) and `bind_tools` with an enforced
tool choice. Thinking is switched off per request: the random model's reasoning never ends, and
the constraint applies after it."""

from typing import Literal

import pytest
from pydantic import BaseModel, Field

from conftest import API_KEY

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=150)
    mood: Literal["happy", "sad", "calm"]


class Weather(BaseModel):
    """Get the weather for a city."""

    city: str = Field(max_length=20)
    days: int = Field(ge=1, le=7)


def test_sdk_parse_returns_the_pydantic_model(client):
    for seed in (1, 2):
        r = client.chat.completions.parse(model="lily", messages=[{"role": "user", "content": "Describe someone."}], response_format=Person, max_tokens=200, seed=seed, extra_body=NO_THINKING)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", msg.content
        assert isinstance(msg.parsed, Person), msg.content
        assert 0 <= msg.parsed.age <= 150


def test_sdk_stream_of_a_schema_parses(client):
    with client.chat.completions.stream(model="lily", messages=[{"role": "user", "content": "Describe someone."}], response_format=Person, max_tokens=200, seed=3, extra_body=NO_THINKING) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Person)


@pytest.fixture(scope="module")
def chat(tiny):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model="lily", base_url=tiny.url + "/v1", api_key=API_KEY, max_tokens=200, temperature=0.7, seed=5, max_retries=0, extra_body=NO_THINKING)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat, method):
    out = chat.with_structured_output(Person, method=method).invoke("Describe someone.")
    assert isinstance(out, Person)


def test_langchain_bind_tools_with_a_forced_tool(chat):
    msg = chat.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Paris for three days?")
    assert len(msg.tool_calls) >= 1, msg
    for call in msg.tool_calls:
        assert call["name"] == "Weather"
        w = Weather(**call["args"])
        assert 1 <= w.days <= 7
